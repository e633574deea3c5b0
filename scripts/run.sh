#!/usr/bin/env bash
# One command for a fresh machine: install what is needed, build gcalloc,
# and run the main job on the simulated device (the training-like demo,
# which prints the statistics). Extra arguments go to `gcalloc demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)"
exec build/gcalloc demo "$@"
