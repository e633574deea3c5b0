#!/usr/bin/env bash
# Builds gcalloc with GCC's profile-guided optimization, in two stages in
# one build folder (GCC finds a profile by the object's path):
#
#   scripts/build-pgo.sh [BUILD_DIR] [cmake options...]
#
# 1. an instrumented `gcalloc` tool (GCALLOC_PGO=generate);
# 2. training runs of it on inputs made here, none of them a trace from
#    ../shared/traces, so that the benchmark's figures are not measured on
#    what the build was trained on: a synthetic PyTorch snapshot
#    (bench/make_big_snapshot.py) replayed with the default settings, with
#    expandable segments and to an HTML report, timed in one process as
#    bench-replay does; a gcalloc trace recorded from `gcalloc demo`; an
#    allocatorSim-style log; `gcalloc tune` on the log;
# 3. the whole build with the profile (GCALLOC_PGO=use): library, tool and
#    whatever else the options ask for.
#
# BUILD_DIR defaults to build; the build type to Release (pass
# -DCMAKE_BUILD_TYPE=... to change it). The compiler is gcc. After the
# source changes, run it again: a plain rebuild of the folder compiles with
# the old profile, and GCC warns that it no longer matches (with
# GCALLOC_WERROR, fails).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
[ $# -gt 0 ] && shift
jobs=$(nproc)
mkdir -p "$build"
profile="$(cd "$build" && pwd)/pgo-profile"
train="$build/pgo-train"

say() { echo "build-pgo.sh: $*" >&2; }

say "1/3 an instrumented gcalloc in $build"
cmake -S . -B "$build" -DCMAKE_C_COMPILER=gcc -DCMAKE_BUILD_TYPE=Release "$@" \
  -DGCALLOC_PGO=generate -DGCALLOC_PGO_DIR="$profile" >/dev/null
rm -rf "$profile" "$train"
mkdir -p "$train/snapshot"
cmake --build "$build" -j"$jobs" --target gcalloc_tool >/dev/null

say "2/3 training it on inputs made in $train"
tool="$build/gcalloc"
python3 bench/make_big_snapshot.py 20000 >"$train/snapshot/memory.pickle"
"$tool" replay "$train/snapshot/memory.pickle" >/dev/null
"$tool" replay "$train/snapshot/memory.pickle" --conf expandable_segments:True --json >/dev/null
"$tool" replay "$train/snapshot/memory.pickle" --report "$train/report.html" >/dev/null
"$tool" bench-replay --traces "$train" --runs 5 --speed-only >/dev/null
GCALLOC_TRACE_FILE="$train/demo.trace" "$tool" demo >/dev/null
"$tool" replay "$train/demo.trace" >/dev/null
# An allocatorSim log: operation numbers of each allocation and its free,
# and a size; lifetimes nested as a training step's are.
awk 'BEGIN { n = 600; for (i = 0; i < n / 2; i++) print i, n - 1 - i, 512 * (1 + (i * 7919) % 4096) }' \
  >"$train/sim.log"
"$tool" replay "$train/sim.log" >/dev/null
"$tool" tune "$train/sim.log" >/dev/null

say "3/3 the build with the profile"
cmake -S . -B "$build" -DGCALLOC_PGO=use >/dev/null
cmake --build "$build" -j"$jobs" >/dev/null
say "done: $build, built with the profile of $(find "$profile" -name '*.gcda' | wc -l) files ($profile)"
