#!/usr/bin/env bash
# The fidelity loop on this machine: a real model (a 5M-parameter random Llama, CPU)
# runs the calibration workload, `lockstep model calibrate --from-log` fits the cost
# model to the forwards it logged, and the simulator, with that profile, predicts the
# mean TTFT and TPOT of another workload (other lengths and concurrency), which the
# real model then runs: on an aggregated server, and on a ctx and a gen server whose
# real run moves the model's K/V between them. Prints a table for each; files stay under
# target/fidelity.
#
#   scripts/fidelity.sh [RUNS]   (RUNS: real runs of the predicted workload, default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
cargo build --release -q -p lockstep
bin=target/release/lockstep
work=target/fidelity
rm -rf "$work"
mkdir -p "$work"
"$bin" model init "$work/model" --layers 4 --hidden 256 --heads 8 --kv-heads 4 --vocab 4096
"$bin" run examples/model/fidelity-calibrate.toml --driver threads --model "$work/model" \
    --time-scale 1 --forward-log "$work/forwards.jsonl" >"$work/calibration-run.txt"
"$bin" model calibrate --model "$work/model" --from-log "$work/forwards.jsonl" \
    --out "$work/profile.toml"
profile="$(cd "$work" && pwd)/profile.toml"
# The mean column of a latency row of a report.
mean_of() { awk -v row="$1" '$1 == row { print $2; exit }' "$2"; }
for predict in fidelity-predict fidelity-predict-disagg; do
    "$bin" sim "examples/model/$predict.toml" --set "model.profile=\"$profile\"" \
        >"$work/$predict-sim.txt"
    for i in $(seq 1 "$runs"); do
        "$bin" run "examples/model/$predict.toml" --driver threads --model "$work/model" \
            --time-scale 1 >"$work/$predict-run-$i.txt"
    done
    echo
    echo "$predict"
    printf '%-6s %12s %14s %s\n' metric "sim (ms)" "real mean (ms)" "error   real runs (ms)"
    for metric in ttft tpot; do
        predicted=$(mean_of "$metric" "$work/$predict-sim.txt")
        measured=""
        for i in $(seq 1 "$runs"); do
            measured="$measured $(mean_of "$metric" "$work/$predict-run-$i.txt")"
        done
        awk -v m="$metric" -v p="$predicted" -v list="$measured" 'BEGIN {
            n = split(list, v, " "); s = 0
            for (i = 1; i <= n; i++) s += v[i]
            mean = s / n
            printf "%-6s %12.2f %14.2f %+6.1f%%  %s\n", m, p, mean, (p - mean) / mean * 100, list
        }'
    done
done
