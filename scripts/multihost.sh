#!/usr/bin/env bash
# Several "hosts" on one machine, made of network namespaces, for running the MPI
# driver across hosts (README.md, "Running on several machines"). Nothing outside the
# namespaces is touched: the bridge lives in a namespace of its own (the switch), every
# host namespace has one veth link to it with an address in 10.77.0.0/24, and mpirun
# runs in a control namespace plugged into the same switch. Deleting the namespaces
# removes every link and address. Needs root, iproute2 (ip, tc), util-linux (unshare)
# and OpenMPI.
#
#   scripts/multihost.sh test       the multi-host test stage of scripts/test.sh: three
#                                   hosts, cluster/cli/tests/multihost.rs against them;
#                                   exit status 77 (and SKIPPED) when namespaces cannot
#                                   be made here
#   scripts/multihost.sh overhead   `lockstep overhead --driver mpi` with its two ranks
#                                   on two hosts, at 0, 100 us and 1 ms one-way delay:
#                                   the README's latency table
#
# The tests drive the hosts through the same script (MH_PREFIX in the environment):
#   setup HOST...  teardown  mpirun ARGS...  link HOST up|down  netem HOST SPEC...|none
#   rx-bytes HOST  reap HOST
#
# Sourced, it provides the functions below (mh_*).

MH_PREFIX=${MH_PREFIX:-lsmh$$}
export MH_PREFIX
MH_SUBNET=10.77.0.0/24
MH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MH_AGENT=$MH_DIR/multihost-agent.sh
MH_SELF=$MH_DIR/multihost.sh
MH_WIRE=$MH_DIR/multihost-wire.py
MH_STATE=${TMPDIR:-/tmp}/$MH_PREFIX-state
MH_HOSTS=()

# mh_unavailable: prints why namespaces cannot be made here, or nothing.
mh_unavailable() {
  if [ "$(id -u)" != 0 ]; then
    echo "not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    return
  fi
  command -v ip >/dev/null 2>&1 || { echo "no \`ip\` (iproute2)"; return; }
  command -v tc >/dev/null 2>&1 || { echo "no \`tc\` (iproute2)"; return; }
  command -v unshare >/dev/null 2>&1 || { echo "no \`unshare\` (util-linux)"; return; }
  command -v python3 >/dev/null 2>&1 || { echo "no python3 (the user-space link)"; return; }
  command -v mpirun >/dev/null 2>&1 || { echo "no mpirun (OpenMPI)"; return; }
  local probe="${MH_PREFIX}probe"
  if ! ip netns add "$probe" 2>/dev/null; then
    echo "\`ip netns add\` fails here (no network namespaces in this container?)"
    return
  fi
  if ! ip netns exec "$probe" ip link add p0 type veth peer name p1 2>/dev/null; then
    ip netns del "$probe" 2>/dev/null
    echo "veth links cannot be created here"
    return
  fi
  ip netns del "$probe" 2>/dev/null
}

mh_ns() { ip netns exec "$1" "${@:2}"; }

# mh_setup HOST...: the switch, the control namespace and the hosts. Every namespace's
# TCP gives up on a silent peer after about 6 s (net.ipv4.tcp_retries2 = 4; 15, about
# 15 minutes, by default), so that mpirun notices a lost host's daemon.
mh_setup() {
  local sw="${MH_PREFIX}-sw" ctl="${MH_PREFIX}-ctl" i=10 h
  ip netns add "$sw" || return 1
  mh_ns "$sw" ip link set lo up
  mh_ns "$sw" ip link add br0 type bridge || return 1
  mh_ns "$sw" ip link set br0 up
  # The control namespace (mpirun) is .2, the hosts .10, .11, ...
  _mh_plug "$ctl" 2 || return 1
  mkdir -p "$MH_STATE"
  for h in "$@"; do
    case "$h" in
      *:wire) h=${h%:wire}; _mh_plug_wire "$h" "$i" || return 1 ;;
      *) _mh_plug "$h" "$i" || return 1 ;;
    esac
    MH_HOSTS+=("$h")
    i=$((i + 1))
  done
}

# _mh_plug_wire NS N: as _mh_plug, but the link is scripts/multihost-wire.py (two TAP
# devices and a process copying frames between them), whose delay and loss mh_netem sets
# on kernels without netem.
_mh_plug_wire() {
  local ns=$1 n=$2 sw="${MH_PREFIX}-sw" ready
  ip netns add "$ns" || return 1
  mh_ns "$ns" ip link set lo up
  echo "0 0" >"$MH_STATE/wire-$ns"
  ready="$MH_STATE/wire-$ns.out"
  # Real-time priority (it sleeps in select, never spins): frames cross when due even
  # while the ranks keep every core busy.
  local rt=()
  chrt -f 1 true 2>/dev/null && rt=(chrt -f 1)
  mh_ns "$ns" "${rt[@]}" python3 "$MH_WIRE" "$sw" "p-$n" "$MH_STATE/wire-$ns" >"$ready" 2>&1 &
  local t
  for t in $(seq 50); do
    grep -q ready "$ready" 2>/dev/null && break
    sleep 0.1
  done
  grep -q ready "$ready" || { cat "$ready" >&2; return 1; }
  mh_ns "$sw" ip link set "p-$n" master br0
  mh_ns "$sw" ip link set "p-$n" up
  mh_ns "$ns" ip addr add "10.77.0.$n/24" dev eth0
  mh_ns "$ns" ip link set eth0 up
  mh_ns "$ns" sh -c 'echo 4 >/proc/sys/net/ipv4/tcp_retries2'
}

# _mh_plug NS N: namespace NS with eth0 = 10.77.0.N/24 on the switch (port p-N).
_mh_plug() {
  local ns=$1 n=$2 sw="${MH_PREFIX}-sw"
  ip netns add "$ns" || return 1
  mh_ns "$ns" ip link set lo up
  ip link add "${MH_PREFIX}x$n" type veth peer name "${MH_PREFIX}y$n" || return 1
  ip link set "${MH_PREFIX}x$n" netns "$sw" || return 1
  ip link set "${MH_PREFIX}y$n" netns "$ns" || return 1
  mh_ns "$sw" ip link set "${MH_PREFIX}x$n" name "p-$n"
  mh_ns "$sw" ip link set "p-$n" master br0
  mh_ns "$sw" ip link set "p-$n" up
  mh_ns "$ns" ip link set "${MH_PREFIX}y$n" name eth0
  mh_ns "$ns" ip addr add "10.77.0.$n/24" dev eth0
  mh_ns "$ns" ip link set eth0 up
  mh_ns "$ns" sh -c 'echo 4 >/proc/sys/net/ipv4/tcp_retries2'
}

mh_teardown() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${MH_PREFIX}-"); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$MH_STATE"
  # A veth that never made it into a namespace.
  for ns in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^${MH_PREFIX}[xy]"); do
    ip link del "$ns" 2>/dev/null
  done
  return 0
}

# mh_hostfile FILE HOST:SLOTS...: a hostfile.
mh_hostfile() {
  local f=$1 hs
  shift
  : >"$f"
  for hs in "$@"; do
    echo "${hs%%:*} slots=${hs##*:}" >>"$f"
  done
}

mh_mpirun() {
  timeout -k 5 "${MH_TIMEOUT:-600}" ip netns exec "${MH_PREFIX}-ctl" env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun --allow-run-as-root \
    --mca plm_rsh_agent "$MH_AGENT" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl tcp,self --mca btl_tcp_if_include "$MH_SUBNET" \
    --mca oob_tcp_if_include "$MH_SUBNET" --bind-to none "$@"
}

# The host's end of its link (inside the host's namespace).
mh_link() { mh_ns "$1" ip link set eth0 "$2"; }

# mh_netem HOST delay D [loss P%] | none: the host's link delays every frame by D in
# each direction (a round trip to the host gains 2 D) and drops P % of them. netem on
# both ends of a veth link; on a wire link (mh_setup HOST:wire, for kernels without
# netem) the wire's settings.
mh_netem() {
  local h=$1 delay=0 loss=0 us
  shift
  if [ -f "$MH_STATE/wire-$h" ]; then
    while [ $# -gt 0 ]; do
      case "$1" in
        delay) delay=$2; shift 2 ;;
        loss) loss=${2%%%}; shift 2 ;;
        none) shift ;;
        *) echo "mh_netem: unknown $1" >&2; return 2 ;;
      esac
    done
    case "$delay" in
      *us) us=${delay%us} ;;
      *ms) us=$(awk -v v="${delay%ms}" 'BEGIN { print v * 1000 }') ;;
      *) us=$delay ;;
    esac
    echo "$us $loss" >"$MH_STATE/wire-$h"
    sleep 0.3 # the wire reads its settings every 0.1 s
    return 0
  fi
  local port
  port=$(mh_ns "$h" cat /sys/class/net/eth0/iflink 2>/dev/null)
  port=$(mh_ns "${MH_PREFIX}-sw" ip -o link show 2>/dev/null | awk -F': ' -v i="$port" '$1 == i { print $2 }' | cut -d@ -f1)
  if [ "$1" = none ]; then
    mh_ns "$h" tc qdisc del dev eth0 root 2>/dev/null
    [ -n "$port" ] && mh_ns "${MH_PREFIX}-sw" tc qdisc del dev "$port" root 2>/dev/null
    return 0
  fi
  mh_ns "$h" tc qdisc replace dev eth0 root netem "$@" &&
    mh_ns "${MH_PREFIX}-sw" tc qdisc replace dev "$port" root netem "$@"
}

# mh_has_netem: whether this kernel has the netem qdisc.
mh_has_netem() {
  local probe="${MH_PREFIX}netem" ok=1
  ip netns add "$probe" 2>/dev/null || return 1
  ip netns exec "$probe" ip link add p0 type veth peer name p1 2>/dev/null &&
    ip netns exec "$probe" tc qdisc add dev p0 root netem delay 1ms 2>/dev/null && ok=0
  ip netns del "$probe" 2>/dev/null
  return $ok
}

mh_rx_bytes() { mh_ns "$1" cat /sys/class/net/eth0/statistics/rx_bytes; }

# mh_reap HOST: ends what a cut-off job left running on the host (its MPI daemon and
# ranks), by pid; the host's link process lives in the switch's namespace.
mh_reap() {
  local pid
  for pid in $(ip netns pids "$1" 2>/dev/null); do
    grep -q multihost-wire "/proc/$pid/cmdline" 2>/dev/null || kill -9 "$pid" 2>/dev/null
  done
  return 0
}

# The test stage.
mh_test() {
  local why
  why=$(mh_unavailable)
  if [ -n "$why" ]; then
    echo "SKIPPED: multi-host tests: $why"
    return 77
  fi
  if [ -z "${LOCKSTEP_MPI_BIN:-}" ]; then
    echo "!! multi-host tests: LOCKSTEP_MPI_BIN names no MPI driver (build it first)" >&2
    return 1
  fi
  trap mh_teardown EXIT
  trap 'exit 130' INT TERM
  mh_teardown
  local hosts=("${MH_PREFIX}-h0" "${MH_PREFIX}-a" "${MH_PREFIX}-b") b="${MH_PREFIX}-b"
  # The third host's link takes delay and loss: netem, or the user-space wire.
  mh_has_netem || b="$b:wire"
  if ! mh_setup "${hosts[0]}" "${hosts[1]}" "$b"; then
    echo "!! multi-host tests: setting up the namespaces failed" >&2
    return 1
  fi
  local third=veth
  [ "$b" != "${b%:wire}" ] && third="user-space wire (no netem in this kernel)"
  echo "hosts: ${hosts[*]} on 10.77.0.0/24, mpirun in ${MH_PREFIX}-ctl; the third host's link: $third"
  LOCKSTEP_MULTIHOST="$MH_SELF" LOCKSTEP_MULTIHOST_HOSTS="${hosts[*]}" \
    cargo test -p lockstep --test multihost -- --ignored --test-threads=1
}

# mh_rtt FROM TO_ADDRESS: the median TCP round trip (1 byte, 200 times) in µs.
mh_rtt() {
  local to_ns=$2 addr=$3 out="$MH_STATE/rtt.out"
  mh_ns "$to_ns" python3 "$MH_WIRE" rtt-server 5999 >"$out" 2>&1 &
  local t
  for t in $(seq 50); do
    grep -q ready "$out" 2>/dev/null && break
    sleep 0.1
  done
  mh_ns "$1" python3 "$MH_WIRE" rtt "$addr" 5999 200
  wait
}

# mh_overhead [--iterations N] [--active A]: the overhead benchmark's two ranks on two
# hosts, at 0, 100 µs and 1 ms one-way delay (the second host's link delays each
# direction, so a round trip gains twice the delay); one table row per delay, with the
# TCP round trip measured between the two hosts just before. With a delay the ranks
# yield the core while they wait (mpi_yield_when_idle).
mh_overhead() {
  local iterations=1000 active=256 bin=${LOCKSTEP_MPI_BIN:-$MH_DIR/../target/mpi-driver/lockstep}
  while [ $# -gt 0 ]; do
    case "$1" in
      --iterations) iterations=$2; shift 2 ;;
      --active) active=$2; shift 2 ;;
      *) echo "overhead: unknown option $1" >&2; return 2 ;;
    esac
  done
  local why
  why=$(mh_unavailable)
  if [ -n "$why" ]; then
    echo "SKIPPED: $why" >&2
    return 77
  fi
  if [ ! -x "$bin" ]; then
    echo "no MPI driver at $bin: scripts/test.sh builds it there (or cargo build --release -p lockstep --features mpi, and set LOCKSTEP_MPI_BIN=target/release/lockstep)" >&2
    return 1
  fi
  trap mh_teardown EXIT
  trap 'exit 130' INT TERM
  mh_teardown
  # a and b: veth links (the zero-delay row); c: the delayed host (netem on its veth
  # link, or the user-space wire when the kernel has no netem).
  local a="${MH_PREFIX}-a" b="${MH_PREFIX}-b" c="${MH_PREFIX}-c" link=netem hf out delay rtt peer
  if ! mh_has_netem; then
    link="user-space wire (no netem in this kernel)"
    mh_setup "$a" "$b" "$c:wire" || return 1
  else
    mh_setup "$a" "$b" "$c" || return 1
  fi
  hf="$MH_STATE/hostfile"
  echo "delay: $link; $iterations iterations, dp 2, $active active requests per rank, one rank per host"
  echo
  echo "| one-way delay | measured TCP RTT µs | collectives per iteration | control µs per iteration | floor µs per iteration | control / floor | control / (collectives × RTT) |"
  echo "|---|---|---|---|---|---|---|"
  for delay in 0 100us 1ms; do
    if [ "$delay" = 0 ]; then
      peer=$b
      mh_hostfile "$hf" "$a:1" "$b:1"
      rtt=$(mh_rtt "$a" "$b" 10.77.0.11)
    else
      peer=$c
      mh_hostfile "$hf" "$a:1" "$c:1"
      mh_netem "$c" delay "$delay" || return 1
      rtt=$(mh_rtt "$a" "$c" 10.77.0.12)
    fi
    # With a delay the ranks mostly wait: they yield the core while they do (on a small
    # shared machine a spinning rank keeps its peer and the link process off the core).
    local yield=0
    [ "$delay" != 0 ] && yield=1
    out=$(MH_TIMEOUT=600 mh_mpirun --mca mpi_yield_when_idle "$yield" --hostfile "$hf" -n 2 --map-by node "$bin" overhead \
      --driver mpi-rank --dp 2 --active "$active" --iterations "$iterations" 2>/dev/null) || {
      echo "the run at delay $delay ($peer) failed" >&2
      return 1
    }
    echo "$out" | awk -v rtt="$rtt" -v d="$delay" '
      /collectives_per_iteration=/ { split($NF, kv, "="); c = kv[2] }
      /^overhead_us=/ {
        for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        printf "| %s | %s | %d | %.1f | %.1f | %.2f | %.2f |\n", d, rtt, c,
          v["overhead_us"], v["floor_us"], v["overhead_us"] / v["floor_us"], v["overhead_us"] / (c * rtt)
      }'
  done
}

# Executed (not sourced): a subcommand.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  cmd=${1:-}
  shift || true
  case "$cmd" in
    test) mh_test ;;
    overhead) mh_overhead "$@" ;;
    setup) mh_setup "$@" ;;
    teardown) mh_teardown ;;
    mpirun) mh_mpirun "$@" ;;
    link) mh_link "$@" ;;
    netem) mh_netem "$@" ;;
    rx-bytes) mh_rx_bytes "$@" ;;
    reap) mh_reap "$@" ;;
    *)
      echo "usage: $0 test|overhead|setup HOST...|teardown|mpirun ARGS...|link HOST up|down|netem HOST SPEC...|none|rx-bytes HOST" >&2
      exit 2
      ;;
  esac
fi
