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
#   frontend    the figures of `[frontend] preset = "serve"`, from serve's own front-door
#               accounting (/metrics: lockstep_front_service_seconds, _output_seconds):
#               a request's fixed cost (token-id prompts of 16 and 2,048 tokens, no
#               model), the tokenizer's cost per prompt token (chat prompts of 64 and
#               1,024 words through a random model's tokenizer, --model), the cost per
#               output token; one client at a time, so nothing waits.
#
# Usage: scripts/bench-serve.sh [front-door|load|fidelity|frontend|all]   (default all)
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
cargo build --release -q -p lockstep
bin="$PWD/target/release/lockstep"
source scripts/lib/serve.sh  # after the cd: a path from the repository root

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
  start_server "$bin" examples/agg-dp2-binding.toml --set server.max_batch_size=64 --max-pending 100000
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
  start_server "$bin" examples/agg-dp2-binding.toml --set server.max_batch_size=256 --max-pending 100000
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
  start_server "$bin" examples/agg-balanced.toml --time-scale 1
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

# metric NAME: the value of one sample of the running server's /metrics.
metric() {
  curl -s "$url/metrics" | awk -v n="$1" '$1 == n {print $2}'
}

# service_run SCENARIO ENDPOINT INPUT_LEN SERVE_ARGS...: 200 requests of INPUT_LEN prompt
# tokens (words for chat), 16 output tokens, one at a time; prints "service_s count
# output_s tokens".
service_run() {
  local scenario=$1 endpoint=$2 len=$3
  shift 3
  start_server "$bin" "$scenario" "$@"
  "$bin" bench --url "$url" "$scenario" --endpoint "$endpoint" --time-scale 0 --no-progress \
    --set workload.kind=\"closed_loop\" --set workload.concurrency=1 \
    --set workload.num_requests=200 --set workload.input_len="$len" \
    --set workload.output_len=16 --set workload.warmup_requests=0 > /dev/null 2>&1
  echo "$(metric lockstep_front_service_seconds_sum) $(metric lockstep_front_service_seconds_count) $(metric lockstep_front_output_seconds_total) $(metric lockstep_generation_tokens_total) $(metric lockstep_prompt_tokens_total)"
  stop_server
}

frontend() {
  echo "== frontend: serve's own front-door accounting, one client at a time"
  local model="$work/tiny"
  "$bin" model init "$model" > /dev/null
  # The tiny model's example as a closed loop (its open loop's rate has no place there).
  sed -e 's/^kind = "open_loop"/kind = "closed_loop"\nconcurrency = 1/' -e '/^rate = /d' \
    examples/model/agg-tiny.toml > "$work/agg-tiny-closed.toml"
  local short long chat_short chat_long
  short="$(service_run examples/agg-dp2-binding.toml completions 16)"
  long="$(service_run examples/agg-dp2-binding.toml completions 2048)"
  chat_short="$(service_run "$work/agg-tiny-closed.toml" chat 64 --model "$model")"
  chat_long="$(service_run "$work/agg-tiny-closed.toml" chat 1024 --model "$model")"
  python3 - "$short" "$long" "$chat_short" "$chat_long" <<'PY'
import sys
runs = [list(map(float, a.split())) for a in sys.argv[1:]]
mean = [r[0] / r[1] for r in runs]
tokens = [r[4] / r[1] for r in runs]  # prompt tokens per request, as the server counted
ids_ns = (mean[1] - mean[0]) / (tokens[1] - tokens[0]) * 1e9
request_us = (mean[0] - tokens[0] * ids_ns / 1e9) * 1e6
text_ns = (mean[3] - mean[2]) / (tokens[3] - tokens[2]) * 1e9
text_us = (mean[2] - tokens[2] * text_ns / 1e9) * 1e6
output_ns = runs[3][2] / runs[3][3] * 1e9
print(f"token ids, no model: {mean[0]*1e6:.1f} us at {tokens[0]:.0f} tokens, {mean[1]*1e6:.1f} us at {tokens[1]:.0f}")
print(f"chat text, --model: {mean[2]*1e6:.1f} us at {tokens[2]:.0f} tokens, {mean[3]*1e6:.1f} us at {tokens[3]:.0f}")
print(f"request_us = {request_us:.1f}   (a request's fixed cost; {text_us:.1f} for a chat request with --model, its template included)")
print(f"prompt_token_ns = {text_ns:.1f}   (per prompt token through --model's tokenizer; {ids_ns:.1f} per token id without)")
print(f"output_token_ns = {output_ns:.1f}   (per output token, --model: detokenize, stop strings, the event)")
PY
}

case "$what" in
  front-door) front_door ;;
  load) load ;;
  fidelity) fidelity ;;
  frontend) frontend ;;
  all) front_door; load; fidelity; frontend ;;
  *) echo "usage: $0 [front-door|load|fidelity|frontend|all]"; exit 2 ;;
esac
