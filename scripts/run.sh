#!/usr/bin/env bash
# One command for a fresh machine: install what is needed, build gcalloc,
# and run the main job on the simulated device: replay a real PyTorch job's
# allocations (a trace from ../shared/traces), print gcalloc's peaks beside
# what PyTorch's allocator reserved on the same sequence, and write the HTML
# report to build/replay-report.html.
#
#   scripts/run.sh [TRACE] [gcalloc replay options]
#
# Without ../shared/traces (and no TRACE given) it runs the training-like
# demo instead, which needs no input.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# Release, with GCC's profile-guided optimization trained on a synthetic
# snapshot (scripts/build-pgo.sh): the replay of the real snapshots takes
# 5-8% fewer instructions than a plain Release build, which takes 4% fewer
# than RelWithDebInfo with the profile (docs/benchmarks.md).
scripts/build-pgo.sh build

trace=../shared/traces/ZidongLiu__DeComFL/memory.pickle
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  trace=$1
  shift
fi
if [ ! -e "$trace" ]; then
  echo "run.sh: $trace not found; running the demo instead (build/gcalloc demo)" >&2
  exec build/gcalloc demo "$@"
fi
exec build/gcalloc replay "$trace" --report build/replay-report.html "$@"
