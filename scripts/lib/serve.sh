# Shared by the scripts that start `lockstep serve` on loopback (bench-serve.sh,
# soak-serve.sh, cpu-forward-bench.sh): a scratch directory, a server started on a free
# port, and a trap that stops it and removes the directory whatever happens. Source it
# after `set -euo pipefail`.

work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# start_server BINARY ARGS...: `BINARY serve ARGS... --port 0` in the background; sets
# $server_pid and $url (http://HOST:PORT, as the server announces it) or exits 1 with
# the server's stderr.
start_server() {
  local binary="$1"
  shift
  : > "$work/serve.out"
  "$binary" serve "$@" --port 0 > "$work/serve.out" 2> "$work/serve.err" &
  server_pid=$!
  url=""
  for _ in $(seq 1 400); do
    url="$(grep -o 'http://[0-9.:]*' "$work/serve.out" || true)"
    [[ -n "$url" ]] && return 0
    sleep 0.05
  done
  echo "lockstep serve did not start:" >&2; cat "$work/serve.err" >&2; exit 1
}

# stop_server: SIGTERM, wait; its exit status in $server_code.
stop_server() {
  server_code=0
  kill -TERM "$server_pid"
  wait "$server_pid" || server_code=$?
  server_pid=""
}
