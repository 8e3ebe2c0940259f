# Shared by cpu-forward-bench.sh and cpu-forward-vs-vllm.sh: the benchmark model and
# scenario, and the client run against a server. Source it after scripts/lib/serve.sh
# (it writes under $work).

# write_cpu_forward BINARY: a random Llama in $work/model (4 layers, hidden 256, 8 heads,
# 4 KV heads, vocab 32,000, intermediate 704: 19.3M parameters, most of them the LM
# head, as in issue 28's model) and $work/scenario.toml (one rank, 32 sequences, 2,048
# tokens a step, closed loop, 32-token prompts and outputs).
write_cpu_forward() {
  "$1" model init "$work/model" --layers 4 --hidden 256 --heads 8 --kv-heads 4 --vocab 32000 > /dev/null
  cat > "$work/scenario.toml" <<'EOF'
name = "cpu-forward"

[[server]]
name = "agg0"
role = "agg"
tensor_parallel_size = 1
max_batch_size = 32
max_num_tokens = 2048
enable_chunked_prefill = true

[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 8192
enable_block_reuse = false

[workload]
kind = "closed_loop"
concurrency = 1
num_requests = 64
input_len = 32
output_len = 32
EOF
}

# bench_tokens_per_s BINARY URL CONCURRENCY: output tokens/s of `BINARY bench` against
# URL, eight requests per client slot (at least 32: past warm-up); exits 1 with the
# client's output if it fails.
bench_tokens_per_s() {
  local bin="$1" url="$2" conc="$3"
  local requests=$((conc * 8 < 32 ? 32 : conc * 8))
  timeout 600 "$bin" bench "$work/scenario.toml" --url "$url" --time-scale 0 --no-progress \
    --tokenizer "$work/model" --set "workload.concurrency=$conc" \
    --set "workload.num_requests=$requests" --json "$work/report.json" > "$work/bench.out" 2>&1 \
    || { echo "bench failed:" >&2; cat "$work/bench.out" >&2; return 1; }
  python3 -c "import json, sys; print('%.1f' % json.load(open(sys.argv[1]))['throughput']['output_tokens_per_s'])" "$work/report.json"
}

# summarize RESULTS BASE NEW BASE_TITLE NEW_TITLE: RESULTS holds "WHICH CONCURRENCY TOKS"
# lines, round after round; prints, per concurrency, the median output tok/s of BASE and
# of NEW, the ratio of the medians, and each round's own ratio NEW/BASE.
summarize() {
  python3 - "$@" <<'PY'
import statistics, sys
path, base, new, base_title, new_title = sys.argv[1:]
runs = {}
for line in open(path):
    which, conc, tps = line.split()
    runs.setdefault((which, int(conc)), []).append(float(tps))
print(f"| concurrency | {base_title} output tok/s | {new_title} output tok/s | {new_title}/{base_title} | each round |")
print("|---|---|---|---|---|")
for conc in (1, 8, 32):
    b, n = runs[(base, conc)], runs[(new, conc)]
    rounds = ", ".join(f"{y / x:.2f}x" for x, y in zip(b, n))
    mb, mn = statistics.median(b), statistics.median(n)
    print(f"| {conc} | {mb:,.0f} | {mn:,.0f} | {mn / mb:.2f}x | {rounds} |")
PY
}
