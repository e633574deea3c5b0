#!/usr/bin/env bash
# One command for a fresh machine: install what is needed, build gcalloc,
# and run the main job on the simulated device: replay a PyTorch job's
# allocations (the sample snapshot data/snapshots/training/memory.pickle, or
# the snapshot given), print gcalloc's peaks beside what PyTorch's allocator
# reserved on the same sequence, and write the HTML report to
# build/replay-report.html.
#
#   scripts/run.sh [SNAPSHOT] [gcalloc replay options]
#
# The build is reused while it is current: it is made again only when the
# sources, the build scripts or the compiler changed since it was made
# (a fingerprint of them is kept in build/.source-fingerprint).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh

# What the build depends on: every file the build reads, and the compiler.
fingerprint() {
  {
    find CMakeLists.txt cmake include src replay tools bench scripts/build-pgo.sh -type f -print0 |
      sort -z | xargs -0 sha256sum
    gcc --version | head -n 1
  } | sha256sum | cut -d' ' -f1
}
now=$(fingerprint)
if [ -x build/gcalloc ] && [ "$(cat build/.source-fingerprint 2>/dev/null)" = "$now" ]; then
  echo "run.sh: the build in build/ is current; not building again" >&2
else
  # Release, with GCC's profile-guided optimization trained on a synthetic
  # snapshot (scripts/build-pgo.sh): the replay of real snapshots takes 5-8%
  # fewer instructions than a plain Release build (docs/benchmarks.md).
  rm -f build/.source-fingerprint
  scripts/build-pgo.sh build
  echo "$now" >build/.source-fingerprint
fi

trace=data/snapshots/training/memory.pickle
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  trace=$1
  shift
fi
build/gcalloc replay "$trace" --report build/replay-report.html "$@"
cat <<EOF

What to try next:
  open build/replay-report.html                          the run, drawn (a browser)
  build/gcalloc replay $trace --capacity 30GiB
                                                         will it fit on a 30 GiB device?
  build/gcalloc tune $trace --report build/tune-report.html
                                                         which settings reserve least, drawn
  scripts/run.sh data/snapshots/inference/memory.pickle  another sample (data/README.md)
  scripts/run.sh YOUR_SNAPSHOT.pickle                    your own job (torch.cuda.memory._dump_snapshot)
  build/gcalloc --help                                   every command
  scripts/test.sh                                        the tests
EOF
