#!/usr/bin/env bash
# Cross-driver determinism under CPU load: the tests that say sim and threads (and MPI,
# when its build is there) agree request by request, and the ordered run's tests
# (`run --ordered`: the real hosts in the simulator's order of events), run RUNS times
# in a row while BURNERS CPU-bound processes compete for the cores; plus the CLI
# comparison that first showed the disagreement (disagg-small, 60 requests, --preload),
# sim against threads, request by request on (id, output tokens, token digest,
# failure): with --ordered it must agree; without it the count of requests that differ
# is printed as a figure (thread timing decides which fetch reads a handoff there).
#
#   scripts/cross-driver-under-load.sh [RUNS=20] [BURNERS=3]
#
# The debug build the test suite uses. Prints one line per run and a last line `agreed A of R runs`; exits non-zero if any run
# disagreed. MPI: set LOCKSTEP_MPI_BIN (scripts/test.sh builds it at
# target/mpi-driver/lockstep) and have mpirun on PATH; otherwise the MPI cases print
# "skipped".
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:-20}
burners=${2:-3}
log_dir=$(mktemp -d)

cargo build -q -p lockstep || exit 1
bin=${CARGO_TARGET_DIR:-target}/debug/lockstep
# The test binary for the threads cross-driver tests, built once.
threads_test=$(cargo test -q -p lockstep --test threads --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("target",{}).get("name")=="threads" and m.get("executable"): print(m["executable"])' | tail -1)
if [ -z "$threads_test" ]; then echo "could not build the threads test binary" >&2; exit 1; fi
ordered_test=$(cargo test -q -p lockstep --test ordered --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("target",{}).get("name")=="ordered" and m.get("executable"): print(m["executable"])' | tail -1)
if [ -z "$ordered_test" ]; then echo "could not build the ordered test binary" >&2; exit 1; fi

mpi_test=""
if [ -n "${LOCKSTEP_MPI_BIN:-}" ] && [ -x "${LOCKSTEP_MPI_BIN}" ] && command -v mpirun >/dev/null; then
  mpi_test=$(cargo test -q -p lockstep --test mpi --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("target",{}).get("name")=="mpi" and m.get("executable"): print(m["executable"])' | tail -1)
fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$log_dir"; }
trap cleanup EXIT
for _ in $(seq "$burners"); do
  ( while :; do :; done ) &
  pids+=($!)
done
echo "cores: $(nproc); CPU-bound processes beside the runs: $burners; runs: $runs"

# (id, output tokens, token digest, failure) of every request of a report.
outcomes() {
  python3 -c 'import json,sys
r=json.load(open(sys.argv[1]))
for d in r["per_request"]: print(d["id"], d["output_tokens"], d["token_digest"], d.get("failure"))' "$1"
}

# The cross-driver tests, by full name: a renamed test is an error here, not a run that
# passes because it ran nothing (each run must pass exactly this many).
threads_tests=(
  aggregated_runs_agree_exactly_on_iterations_forwards_routing_and_tokens
  disaggregated_runs_agree_on_tokens_over_two_ctx_and_two_gen_servers
  lost_kv_fails_exactly_the_requests_whose_kv_the_wire_lost_in_both_drivers
)
ordered_tests=(
  an_ordered_run_does_what_the_simulator_does_on_every_server_of_a_disaggregated_fleet
  an_ordered_run_agrees_with_lost_kv_generation_first_and_the_legacy_policy
  an_ordered_aggregated_run_agrees_exactly
)
mpi_tests=(
  mpi_aggregated_runs_agree_exactly_with_the_simulator_at_2_and_4_ranks
  mpi_disaggregated_runs_stream_the_simulators_tokens_over_two_ctx_and_two_gen_servers
  mpi_lost_kv_fails_exactly_the_requests_the_simulator_fails
  mpi_ordered_runs_do_what_the_simulator_does_on_every_server
)
# Runs a test binary on exactly the named tests; true when all of them ran and passed.
all_passed() {
  local log=$1 want=$2
  shift 2
  "$@" >"$log" 2>&1 && grep -q "^test result: ok. $want passed" "$log"
}

set_args=(--set workload.num_requests=60 --set workload.concurrency=60)
"$bin" sim --preload examples/disagg-small.toml "${set_args[@]}" --json "$log_dir/sim.json" >/dev/null || exit 1
outcomes "$log_dir/sim.json" >"$log_dir/sim.txt"

agreed=0
for i in $(seq "$runs"); do
  ok=1
  what=()
  if all_passed "$log_dir/threads.log" "${#threads_tests[@]}" \
    "$threads_test" --exact --test-threads=1 "${threads_tests[@]}"; then
    what+=("threads tests ok")
  else
    ok=0
    what+=("threads tests FAILED: $(grep -E '^test .* FAILED|^test result' "$log_dir/threads.log" | tr '\n' ' ')")
  fi
  if all_passed "$log_dir/ordered.log" "${#ordered_tests[@]}" \
    "$ordered_test" --exact --test-threads=1 "${ordered_tests[@]}"; then
    what+=("ordered tests ok")
  else
    ok=0
    what+=("ordered tests FAILED: $(grep -E '^test .* FAILED|^test result' "$log_dir/ordered.log" | tr '\n' ' ')")
  fi
  for mode in ordered unordered; do
    flags=()
    [ "$mode" = ordered ] && flags=(--ordered)
    if "$bin" run --driver threads --preload "${flags[@]}" examples/disagg-small.toml "${set_args[@]}" \
      --json "$log_dir/threads.json" >/dev/null 2>"$log_dir/run.err"; then
      outcomes "$log_dir/threads.json" >"$log_dir/threads.txt"
      # Requests of the sim run whose outcome threads did not reproduce (missing ones count).
      differ=$(diff "$log_dir/sim.txt" "$log_dir/threads.txt" | grep -c '^<')
      if [ "$differ" -eq 0 ]; then
        what+=("disagg-small $mode: 60 of 60 agree")
      elif [ "$mode" = ordered ]; then
        ok=0
        what+=("disagg-small ordered: $differ of 60 DIFFER")
      else
        what+=("disagg-small unordered: $differ of 60 differ")
      fi
    else
      ok=0
      what+=("disagg-small $mode run FAILED: $(tail -1 "$log_dir/run.err")")
    fi
  done
  if [ -n "$mpi_test" ]; then
    if all_passed "$log_dir/mpi.log" "${#mpi_tests[@]}" \
      "$mpi_test" --ignored --exact --test-threads=1 "${mpi_tests[@]}"; then
      what+=("mpi tests ok")
    else
      ok=0
      what+=("mpi tests FAILED: $(grep -E '^test .* FAILED|^test result' "$log_dir/mpi.log" | tr '\n' ' ')")
    fi
  else
    what+=("mpi skipped (no LOCKSTEP_MPI_BIN or mpirun)")
  fi
  agreed=$((agreed + ok))
  echo "run $i: $(IFS=';'; echo "${what[*]}")"
done
echo "agreed $agreed of $runs runs"
[ "$agreed" -eq "$runs" ]
