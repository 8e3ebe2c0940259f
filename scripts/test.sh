#!/usr/bin/env bash
# The one test command (README.md). Installs what the tests need on a fresh Debian
# machine, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  else
    echo "missing system packages: ${need_apt[*]} (install them or run as root)" >&2
    exit 1
  fi
fi

cargo test --workspace --all-targets
