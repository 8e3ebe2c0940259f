#!/usr/bin/env bash
# The CPU forward's serving throughput, before and after a change (README "A real model
# (CPU)"): `lockstep serve --model` of each binary in turn on loopback, `lockstep bench`
# at concurrency 1, 8 and 32 with 32-token prompts and 32-token outputs (closed loop,
# every request as soon as a slot frees), old and new interleaved round by round so that
# the machine's load falls on both alike. Prints each run's output tokens/s, then the
# median per binary and concurrency, the new/old ratio, and each round's own ratio.
#
# Usage: scripts/cpu-forward-bench.sh OLD_BINARY [NEW_BINARY] [ROUNDS]
#   NEW_BINARY defaults to target/release/lockstep (built first), ROUNDS to 3.
# The model: a random Llama, 4 layers, hidden 256, 8 heads, 4 KV heads, vocab 32,000,
# intermediate 704 (19.3M parameters, most of them the LM head, as in the issue's model).
set -euo pipefail
cd "$(dirname "$0")/.."
old="${1:?usage: $0 OLD_BINARY [NEW_BINARY] [ROUNDS]}"
new="${2:-}"
rounds="${3:-3}"
if [[ -z "$new" ]]; then
  cargo build --release -q -p lockstep --bin lockstep
  new="$PWD/target/release/lockstep"
fi
source scripts/lib/serve.sh  # after the cd: a path from the repository root

source scripts/lib/cpu-forward.sh
write_cpu_forward "$new"

# run BINARY CONCURRENCY: output tokens/s of one serve + bench (in a subshell: it stops
# its own server, failing or not).
run() {
  local bin="$1" conc="$2" tps
  start_server "$bin" "$work/scenario.toml" --model "$work/model" --host 127.0.0.1
  tps="$(bench_tokens_per_s "$bin" "$url" "$conc")" || { kill "$server_pid"; exit 1; }
  stop_server
  echo "$tps"
}

echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
: > "$work/results"
for round in $(seq 1 "$rounds"); do
  for conc in 1 8 32; do
    # Alternate which binary goes first, so neither always follows the other.
    if (( round % 2 )); then order="old new"; else order="new old"; fi
    for which in $order; do
      if [[ "$which" == old ]]; then bin="$old"; else bin="$new"; fi
      tps="$(run "$bin" "$conc")"
      echo "round $round concurrency $conc $which: $tps output tok/s"
      echo "$which $conc $tps" >> "$work/results"
    done
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
summarize "$work/results" old new old new
