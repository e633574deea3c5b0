#!/bin/sh
# Compare the replay's end-to-end speed of two commits on this host:
#   scripts/compare-replay.sh OLD_REV [NEW_REV] [ROUNDS]
# builds both (Release, in a temporary directory; NEW_REV defaults to the
# working tree), then runs `gcalloc bench-replay --speed-only --runs 40`
# of each in turn, ROUNDS times (default 10), and prints the best time per
# trace and build, and the first quartile of the rounds' bests.
# Alternating matters on a machine whose speed drifts from one minute to
# the next: a slow stretch then hits both builds. A tree that has
# scripts/build-pgo.sh is built with it, as scripts/run.sh builds (PGO=0:
# plain Release builds for both).
#   NEW_PROCESS=1 scripts/compare-replay.sh OLD_REV [NEW_REV] [ROUNDS]
# compares them in new processes instead, as a user runs `gcalloc replay`
# once: each round runs `gcalloc replay --json` three times per trace and
# build, in turn, and it prints the best, first quartile and median of
# the times the processes report (their own clocks, from opening the file).
#   IDLE=SECONDS NEW_PROCESS=1 scripts/compare-replay.sh OLD_REV [NEW_REV] [ROUNDS]
# waits that long before each process (one per trace and build a round,
# then): a process run once after the machine has been idle, whose fresh
# memory the kernel may have to get back from a virtual machine's host
# first.
set -eu
old=${1:?usage: scripts/compare-replay.sh OLD_REV [NEW_REV] [ROUNDS]}
new=${2:-}
rounds=${3:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/old" 2>/dev/null; [ -z "$new" ] || git -C "$root" worktree remove --force "$work/new" 2>/dev/null; rm -rf "$work"' EXIT

build() { # SOURCE_DIR BUILD_DIR: Release, with the profile where the tree builds one (PGO=0: without)
  if [ "${PGO:-1}" = 1 ] && [ -x "$1/scripts/build-pgo.sh" ]; then
    "$1/scripts/build-pgo.sh" "$2" -DGCALLOC_BUILD_TESTS=OFF >/dev/null
  else
    cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release -DGCALLOC_BUILD_TESTS=OFF >/dev/null
    cmake --build "$2" -j "$(nproc)" --target gcalloc_tool >/dev/null
  fi
}
git -C "$root" worktree add -q --detach "$work/old" "$old"
build "$work/old" "$work/build-old"
if [ -n "$new" ]; then
  git -C "$root" worktree add -q --detach "$work/new" "$new"
  build "$work/new" "$work/build-new"
else
  build "$root" "$work/build-new"
fi
traces="$root/../shared/traces"
if [ "${NEW_PROCESS:-}" = 1 ]; then
  python3 - "$work/build-old/gcalloc" "$work/build-new/gcalloc" "$traces" "$rounds" "${IDLE:-0}" <<'PY'
import json, os, subprocess, sys, time
old, new, traces, rounds, idle = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
per_round = 1 if idle > 0 else 3
paths = sorted(os.path.join(traces, d, f) for d in os.listdir(traces) if os.path.isdir(os.path.join(traces, d))
               for f in os.listdir(os.path.join(traces, d)) if f.endswith(('.pickle', '.log', '.csv', '.trace')))
times = {}
for _ in range(rounds):
    for path in paths:
        for build, exe in (('old', old), ('new', new)):
            for _ in range(per_round):
                time.sleep(idle)
                out = subprocess.run([exe, 'replay', '--json', path], capture_output=True, text=True, check=True).stdout
                times.setdefault((path, build), []).append(json.loads(out)['seconds'] * 1e3)
print('new processes%s, %d of each build per trace, ms: best, first quartile, median'
      % (' each after %g s idle' % idle if idle > 0 else '', per_round * rounds))
print('%-34s %22s %22s' % ('trace', 'old', 'new'))
for path in paths:
    cells = []
    for build in ('old', 'new'):
        v = sorted(times[(path, build)])
        cells.append('%6.2f %6.2f %6.2f' % (v[0], v[len(v) // 4], v[len(v) // 2]))
    print('%-34s %22s %22s' % (os.path.basename(os.path.dirname(path))[:34], cells[0], cells[1]))
PY
  exit 0
fi
# (A build from before --speed-only measures the peers too: slower, the same figures.)
speed_only() { "$1" bench-replay --speed-only --runs 1 --traces "$traces" >/dev/null 2>&1 && echo --speed-only || true; }
flag_old=$(speed_only "$work/build-old/gcalloc")
flag_new=$(speed_only "$work/build-new/gcalloc")
for r in $(seq "$rounds"); do
  for b in old new; do
    eval "flag=\$flag_$b"
    "$work/build-$b/gcalloc" bench-replay $flag --runs 40 --json --traces "$traces" |
      python3 -c "import json,sys; [print('$b', t['trace'], t['best_seconds']) for t in json.load(sys.stdin)['traces']]"
  done
done | python3 -c "
import sys
bests = {}
for line in sys.stdin:
    build, trace, s = line.split()
    bests.setdefault((trace, build), []).append(float(s))
# Per round, each build's best of 40; over the rounds, the least and the
# first quartile (a slow stretch of the machine that hits a few rounds moves the
# quartile less than the median, and the least alone can be one lucky round).
def q25(v):
    v = sorted(v)
    return v[len(v) // 4]
print('best of %s runs (%s rounds of 40), and the first quartile of the rounds\' bests, ms:' % (40 * $rounds, $rounds))
print('%-34s %10s %10s %8s %10s %10s %8s' % ('trace', 'old', 'new', 'new/old', 'old q25', 'new q25', 'new/old'))
for trace in sorted({t for t, _ in bests}):
    o, n = bests[(trace, 'old')], bests[(trace, 'new')]
    print('%-34s %10.3f %10.3f %8.3f %10.3f %10.3f %8.3f' % (trace, min(o) * 1e3, min(n) * 1e3, min(n) / min(o),
          q25(o) * 1e3, q25(n) * 1e3, q25(n) / q25(o)))
"
