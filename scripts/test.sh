#!/usr/bin/env bash
# The one test command (README.md). Installs what the tests need on a fresh Debian
# machine (a C toolchain, OpenMPI and libclang for the MPI driver), then runs:
#   1. the whole workspace suite, with the MPI cases run through mpirun;
#   2. the loom models (a separate build with --cfg lockstep_loom).
set -euo pipefail
shopt -s inherit_errexit 2>/dev/null || true
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || need_apt+=(libopenmpi-dev)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need_apt+=(libclang-dev clang)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  else
    echo "missing system packages: ${need_apt[*]} (install them or run as root)" >&2
    exit 1
  fi
fi

# mpirun refuses root unless told; the tests oversubscribe 2 cores with 4 ranks.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo "== building the MPI driver"
CARGO_TARGET_DIR=target/mpi cargo build --release -p lockstep-cluster --features mpi
export LOCKSTEP_MPI_BIN="$PWD/target/mpi/release/lockstep"

log=$(mktemp)
trap 'rm -f "$log"' EXIT

echo "== workspace tests"
cargo test --workspace --all-targets 2>&1 | tee -a "$log"

echo "== loom models"
RUSTFLAGS="--cfg lockstep_loom" CARGO_TARGET_DIR=target/loom \
  cargo test --release -p loom-tests --tests 2>&1 | tee -a "$log"

# One closing line over every runner above.
passed=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')
failed=$(grep -Eo '[0-9]+ failed;' "$log" | awk '{s += $1} END {print s + 0}')
echo "summary: $passed passed, $failed failed"
