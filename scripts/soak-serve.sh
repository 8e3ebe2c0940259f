#!/usr/bin/env bash
# The soak of `lockstep serve` (README "Serving over HTTP", bad input): on this machine,
# loopback only, about two minutes. A server paced at 1/20 of the model's time
# (examples/agg-balanced.toml, --time-scale 0.05, --write-timeout-s 5) takes a steady
# load of small completions while scripts/soak-serve.py sends malformed and extreme
# requests, cuts streams and whole answers, stalls streams, half-closes and holds idle
# and half-sent connections. It fails (exit 1) unless every /health probe is answered
# within 100 ms, the server's resident memory returns within 10 % of its level after
# the warm-up, /metrics accounts for every request (completed + failed + cancelled =
# submitted, each outcome as expected), and the server then stops on SIGTERM with its
# drain complete (exit 0, nothing cut).
#
# Usage: scripts/soak-serve.sh [--waves 2] [--wave-s 25] [--warmup-s 45] [--settle-s 20] ...
#   (options go to soak-serve.py; LOCKSTEP_BIN=path uses that binary instead of
#   building the release one)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${LOCKSTEP_BIN:-}" ]]; then
  bin="$LOCKSTEP_BIN"
else
  cargo build --release -q -p lockstep
  bin="$PWD/target/release/lockstep"
fi
source scripts/lib/serve.sh  # after the cd: a path from the repository root

start_server "$bin" examples/agg-balanced.toml --host 127.0.0.1 --time-scale 0.05 \
  --write-timeout-s ${SOAK_WRITE_TIMEOUT_S:-5} --drain-timeout-s 10
addr="${url#http://}"
echo "lockstep serve on $addr (pid $server_pid)"

status=0
python3 scripts/soak-serve.py "$addr" "$server_pid" "$@" || status=1

# The load is over: the server must stop on SIGTERM with nothing left to cut.
stop_server
code=$server_code
summary="$(grep 'stopped after' "$work/serve.out" || true)"
echo "server: ${summary:-no summary} (exit $code)"
if [[ $code -ne 0 || "$summary" != *"; 0 cut at the drain timeout"* ]]; then
  echo "FAIL: the server did not stop cleanly"; cat "$work/serve.err"; status=1
fi
exit $status
