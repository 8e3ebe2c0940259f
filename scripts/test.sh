#!/usr/bin/env bash
# The one test command (README.md). On a fresh Debian machine, run as root, it first
# installs what the tests need (a C toolchain, OpenMPI, and libclang for the MPI driver's
# bindgen step); then it runs, in order:
#   1. the MPI driver build (release, --features mpi, in the shared target directory:
#      it reuses the main job's release artifacts of every crate MPI does not touch; the
#      binary is copied to target/mpi-driver/, so a later plain release build can
#      replace target/release/lockstep);
#   2. the whole workspace suite (--all-targets --no-fail-fast); the MPI tests are
#      #[ignore]d there (they need mpirun and the MPI build);
#   3. the MPI tests (cluster/cli/tests/mpi.rs, the ignored ones), one at a time, through
#      mpirun with the driver of stage 1;
#   4. the browser test of the HTML report (cluster/cli/tests/report_browser.rs, ignored in
#      stage 2): Chromium is installed from Debian's packages when missing; when it
#      cannot be, the test is reported SKIPPED by name, never passed;
#   5. the multi-host tests (scripts/multihost.sh test: the MPI driver across three
#      network-namespace "hosts", cluster/cli/tests/multihost.rs); SKIPPED, and counted as
#      skipped, where namespaces cannot be made (not root, no iproute2);
#   6. the official `openai` Python client against `lockstep serve` (installed from PyPI
#      when missing; SKIPPED by name when it cannot be);
#   7. the loom models (release, loom-tests' `loom` feature: only the transport and what
#      builds on it are rebuilt; every other crate's release artifacts are shared).
# A failing stage does not stop the later ones. At the end it prints how long each stage
# took, which stages failed or were skipped, and one closing line summed over every test
# runner:
#   summary: N passed, M failed[, K skipped stages]
# The exit status is 0 only when every stage succeeded (the MPI driver included) and no
# test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# One clean build: incremental state would only add gigabytes to the target directory.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

log=$(mktemp)
trap 'rm -f "$log"' EXIT

failed_stages=()
skipped_stages=()
stage_times=()
started_all=$SECONDS

# stage NAME COMMAND...: runs one stage; remembers its time and whether it failed.
# Returns the command's exit status.
stage() {
  local name=$1 started=$SECONDS rc
  shift
  echo "== $name"
  "$@"
  rc=$?
  stage_times+=("== $name: $((SECONDS - started)) s")
  if [ "$rc" -ne 0 ]; then
    failed_stages+=("$name (exit status $rc)")
    echo "!! $name failed (exit status $rc); going on with the next stage" >&2
  fi
  return "$rc"
}

# logged COMMAND...: runs a test runner, copying its output into the log the summary
# reads. Returns the runner's exit status, not tee's.
logged() {
  "$@" 2>&1 | tee -a "$log"
  return "${PIPESTATUS[0]}"
}

# summarize LOG: the closing line, summed over every "test result:" line of LOG (one per
# test binary, from cargo test and the loom runs alike).
summarize() {
  awk '
    /^test result: / {
      for (i = 2; i <= NF; i++) {
        if ($i == "passed;") passed += $(i - 1)
        if ($i == "failed;") failed += $(i - 1)
      }
    }
    END { printf "summary: %d passed, %d failed\n", passed, failed }
  ' "$1"
}

have_mpi_h() {
  [ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h ] ||
    [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] ||
    [ -e /usr/include/mpi.h ]
}

# bindgen needs libclang itself (libclang.so or libclang-<N>.so, shipped by libclang-dev
# with the clang headers it also needs). libclang-cpp.so.* is a different library that
# plain LLVM installs bring along, and a runtime-only libclang.so.1 comes without headers:
# neither counts.
have_libclang() {
  local d f dirs=(/usr/lib/llvm-*/lib /usr/lib/*-linux-gnu /usr/lib64 /usr/local/lib)
  if [ -n "${LIBCLANG_PATH:-}" ]; then
    dirs=("$LIBCLANG_PATH" "${dirs[@]}")
  fi
  for d in "${dirs[@]}"; do
    for f in "$d"/libclang.so "$d"/libclang-[0-9]*.so; do
      [ -e "$f" ] && return 0
    done
  done
  return 1
}

install_packages() {
  local need_apt=()
  command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
  command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
  # The multi-host stage: ip and tc (network namespaces, links, delay), python3 (its
  # user-space link where the kernel has no netem).
  command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
  command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
  command -v curl >/dev/null 2>&1 || need_apt+=(curl)
  have_mpi_h || need_apt+=(libopenmpi-dev)
  have_libclang || need_apt+=(libclang-dev clang)
  if [ ${#need_apt[@]} -eq 0 ]; then
    echo "all present"
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "missing system packages: ${need_apt[*]} (install them or run as root)" >&2
    return 1
  fi
  echo "installing: ${need_apt[*]}"
  apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
}

have_browser() {
  [ -n "${LOCKSTEP_CHROMIUM:-}" ] || command -v chromium >/dev/null 2>&1
}

# Chromium for the browser test, as the packages above: from Debian's packages, as root.
# Best effort: without it that one test is skipped (and said so), the run goes on.
install_browser() {
  have_browser && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "chromium is missing (install it or run as root)" >&2
    return 1
  fi
  echo "installing: chromium"
  apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
}

build_mpi_driver() {
  cargo build --release -p lockstep --features mpi &&
    mkdir -p target/mpi-driver &&
    cp target/release/lockstep target/mpi-driver/lockstep
}

stage "system packages" install_packages

# mpirun refuses root unless told; the tests oversubscribe 2 cores with 4 ranks.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The MPI tests run only when LOCKSTEP_MPI_BIN names a driver this run built; a failed
# build fails the run.
unset LOCKSTEP_MPI_BIN
mpi_missing=()
command -v mpirun >/dev/null 2>&1 || mpi_missing+=(mpirun)
have_mpi_h || mpi_missing+=(mpi.h)
have_libclang || mpi_missing+=(libclang)
if [ ${#mpi_missing[@]} -gt 0 ]; then
  echo "== MPI driver build"
  echo "!! MPI driver NOT BUILT: missing ${mpi_missing[*]}; the MPI test cases will not run and this run fails" >&2
  failed_stages+=("MPI driver build (skipped: missing ${mpi_missing[*]})")
  stage_times+=("== MPI driver build: skipped")
elif ! stage "MPI driver build" build_mpi_driver; then
  echo "!! MPI driver build FAILED: the MPI test cases will not run and this run fails" >&2
elif [ ! -x target/mpi-driver/lockstep ]; then
  echo "!! MPI driver build produced no target/mpi-driver/lockstep: the MPI test cases will not run and this run fails" >&2
  failed_stages+=("MPI driver build (no binary)")
else
  export LOCKSTEP_MPI_BIN="$PWD/target/mpi-driver/lockstep"
fi

stage "workspace tests" logged cargo test --workspace --all-targets --no-fail-fast

if [ -n "${LOCKSTEP_MPI_BIN:-}" ]; then
  # One at a time: each test is a whole mpirun job, and one of them paces the cost model
  # in real time.
  stage "MPI tests" logged cargo test -p lockstep --test mpi -- --ignored --test-threads=1
else
  echo "== MPI tests"
  echo "!! MPI tests NOT RUN: the MPI driver did not build (see above); this run fails" >&2
  stage_times+=("== MPI tests: not run")
fi

skipped_tests=()
echo "== browser test"
if install_browser && have_browser; then
  stage "browser test" logged cargo test -p lockstep --test report_browser -- --ignored
else
  echo "SKIPPED: report_browser::the_ab_report_renders_in_headless_chromium (chromium could not be installed)" >&2
  skipped_tests+=("report_browser::the_ab_report_renders_in_headless_chromium (no chromium)")
  stage_times+=("== browser test: skipped")
fi

# The multi-host tests: exit status 77 means skipped (it says why).
multihost_stage() {
  logged scripts/multihost.sh test
  local rc=$?
  if [ "$rc" = 77 ]; then
    skipped_stages+=("multi-host tests ($(grep '^SKIPPED' "$log" | tail -1))")
    return 0
  fi
  return "$rc"
}
if [ -n "${LOCKSTEP_MPI_BIN:-}" ]; then
  stage "multi-host tests" multihost_stage
else
  echo "== multi-host tests"
  echo "!! multi-host tests NOT RUN: the MPI driver did not build (see above); this run fails" >&2
  stage_times+=("== multi-host tests: not run")
fi

# The official `openai` Python client against `lockstep serve`: the package from PyPI when
# missing. Best effort: without it that one test is skipped (and said so).
have_openai() {
  python3 -c 'import openai' >/dev/null 2>&1
}
echo "== openai client test"
if have_openai || { python3 -m pip install -q openai >/dev/null 2>&1 && have_openai; }; then
  stage "openai client test" logged cargo test -p lockstep --test serve -- --ignored the_official_openai_client
else
  echo "SKIPPED: serve::the_official_openai_client_talks_to_it (the openai package could not be installed)" >&2
  skipped_tests+=("serve::the_official_openai_client_talks_to_it (no openai package)")
  stage_times+=("== openai client test: skipped")
fi

stage "loom models" logged cargo test --release -p loom-tests --features loom --tests

echo
printf '%s\n' "${stage_times[@]}"
echo "== total: $((SECONDS - started_all)) s"
if [ ${#failed_stages[@]} -gt 0 ]; then
  echo "failed stages:"
  printf '  %s\n' "${failed_stages[@]}"
fi
if [ ${#skipped_tests[@]} -gt 0 ]; then
  echo "skipped tests:"
  printf '  SKIPPED %s\n' "${skipped_tests[@]}"
fi
if [ ${#skipped_stages[@]} -gt 0 ]; then
  echo "skipped stages (not counted as passed):"
  printf '  %s\n' "${skipped_stages[@]}"
fi
summary=$(summarize "$log")
shown="$summary"
if [ ${#skipped_tests[@]} -gt 0 ]; then
  shown="$shown, ${#skipped_tests[@]} skipped"
fi
if [ ${#skipped_stages[@]} -gt 0 ]; then
  shown="$shown, ${#skipped_stages[@]} skipped stages"
fi
echo "$shown"

tests_failed=$(echo "$summary" | awk '{print $4}')
if [ ${#failed_stages[@]} -gt 0 ] || [ "$tests_failed" != 0 ]; then
  exit 1
fi
