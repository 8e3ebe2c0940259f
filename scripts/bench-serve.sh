#!/usr/bin/env bash
# The serving benchmarks of README "Benchmarks": `lockstep bench` against `lockstep serve`
# on this machine, every figure of one invocation measured in the same run.
#
#   front-door  zero-cost backend, dp 2: streamed 16-token completions per second over
#               HTTP, and the p99 inter-token latency next to `lockstep run` of the same
#               workload without HTTP (the added latency per token).
#   load        20,000 requests at concurrency 512: every one completes, and the server's
#               resident memory, sampled every second, after warm-up and at the end.
#   fidelity    the analytic backend at time scale 1: mean TTFT and TPOT that bench
#               measures against what `lockstep sim` predicts for the same workload.
#
# Usage: scripts/bench-serve.sh [front-door|load|fidelity|all]   (default all)
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
cargo build --release -q -p lockstep
bin="$PWD/target/release/lockstep"
work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# Starts `lockstep serve SCENARIO ARGS...` on a free port; sets $url and $server_pid.
start_server() {
  local out="$work/serve.out"
  : > "$out"
  "$bin" serve "$@" --port 0 > "$out" 2> "$work/serve.err" &
  server_pid=$!
  for _ in $(seq 1 200); do
    url="$(grep -o 'http://[0-9.:]*' "$out" || true)"
    [[ -n "$url" ]] && return 0
    sleep 0.05
  done
  echo "lockstep serve did not start:"; cat "$work/serve.err"; exit 1
}

stop_server() {
  kill -TERM "$server_pid"; wait "$server_pid" || true; server_pid=""
}

# field FILE PATH... : a number from a JSON report.
field() {
  python3 - "$@" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
for k in sys.argv[2:]:
    v = v[k]
print(f"{v:.3f}" if isinstance(v, float) else v)
PY
}

front_door() {
  local sets=(--set workload.input_len=16 --set workload.output_len=16
              --set workload.num_requests=10000 --set workload.concurrency=64
              --set server.max_batch_size=64)
  echo "== front door: zero-cost, dp 2 B 64 (examples/agg-dp2-binding.toml), 10,000 streamed completions of 16 tokens, concurrency 64"
  start_server examples/agg-dp2-binding.toml --set server.max_batch_size=64 --max-pending 100000
  "$bin" bench --url "$url" examples/agg-dp2-binding.toml "${sets[@]}" --time-scale 0 \
    --no-progress --json "$work/http.json" > "$work/bench.out"
  stop_server
  "$bin" run examples/agg-dp2-binding.toml "${sets[@]}" --json "$work/run.json" > /dev/null
  local rps completed itl_http itl_run
  rps="$(field "$work/http.json" throughput requests_per_s)"
  completed="$(field "$work/http.json" requests completed)"
  itl_http="$(field "$work/http.json" latency_ms itl p99)"
  itl_run="$(field "$work/run.json" latency_ms itl p99)"
  echo "completed ${completed}/10000   completions/s over HTTP ${rps} (target >= 2000)"
  echo "p99 inter-token latency: ${itl_http} ms over HTTP, ${itl_run} ms in lockstep run (no HTTP)"
  python3 -c "print(f'added p99 latency per token: {float(\"$itl_http\") - float(\"$itl_run\"):.3f} ms')"
}

rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }

load() {
  echo "== load: 20,000 requests at concurrency 512 (examples/agg-dp2-binding.toml, B 256, zero-cost)"
  start_server examples/agg-dp2-binding.toml --set server.max_batch_size=256 --max-pending 100000
  local sets=(--set workload.concurrency=512 --set workload.num_requests=20000
              --set workload.input_len=64 --set workload.output_len=16
              --set server.max_batch_size=256)
  "$bin" bench --url "$url" examples/agg-dp2-binding.toml "${sets[@]}" --time-scale 0 \
    --no-progress --json "$work/load.json" > "$work/load.out" 2>&1 &
  local bench_pid=$! samples=()
  while kill -0 "$bench_pid" 2>/dev/null; do samples+=("$(rss_kb "$server_pid")"); sleep 1; done
  wait "$bench_pid" || true
  samples+=("$(rss_kb "$server_pid")")
  stop_server
  echo "completed $(field "$work/load.json" requests completed) of 20000, failed $(field "$work/load.json" requests failed)"
  echo "server RSS (MB) sampled each second: $(printf '%s\n' "${samples[@]}" | awk '{printf "%.0f ", $1/1024}')"
  printf '%s\n' "${samples[@]}" | awk '{a[NR]=$1} END {w=int(NR/4)+1; printf "after warm-up (sample %d) %.1f MB, at the end %.1f MB, ratio %.3f\n", w, a[w]/1024, a[NR]/1024, a[NR]/a[w]}'
}

fidelity() {
  local sets=(--set workload.rate=4.0 --set workload.num_requests=150)
  echo "== fidelity: analytic backend at time scale 1 (examples/agg-balanced.toml, Poisson 4 req/s, 150 requests)"
  "$bin" sim examples/agg-balanced.toml "${sets[@]}" --json "$work/sim.json" > /dev/null
  start_server examples/agg-balanced.toml --time-scale 1
  "$bin" bench --url "$url" examples/agg-balanced.toml "${sets[@]}" --time-scale 1 \
    --no-progress --json "$work/fid.json" > /dev/null
  stop_server
  python3 - "$work/sim.json" "$work/fid.json" <<'PY'
import json, sys
sim, http = (json.load(open(p)) for p in sys.argv[1:])
print(f"{'ms':8} {'sim':>10} {'bench':>10} {'bench/sim':>10}")
for m in ("ttft", "tpot", "itl", "e2e"):
    s, h = sim["latency_ms"][m]["mean"], http["latency_ms"][m]["mean"]
    print(f"{m:8} {s:10.2f} {h:10.2f} {h / s:10.3f}")
print(f"completed: sim {sim['requests']['completed']}, bench {http['requests']['completed']}")
PY
}

case "$what" in
  front-door) front_door ;;
  load) load ;;
  fidelity) fidelity ;;
  all) front_door; load; fidelity ;;
  *) echo "usage: $0 [front-door|load|fidelity|all]"; exit 2 ;;
esac
