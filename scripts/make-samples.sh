#!/usr/bin/env bash
# Makes the sample snapshots in data/snapshots (data/README.md says what
# they are): `gcalloc demo` runs each workload on the simulated device with
# PyTorch's default settings and writes its history as a PyTorch snapshot,
# pickled as PyTorch pickles it.
#
#   scripts/make-samples.sh [BUILD_DIR]   (default build; built first if needed)
#
# A sample made again has other timestamps, and the same events.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
if [ ! -x "$build/gcalloc" ]; then
  cmake -S . -B "$build" >/dev/null
  cmake --build "$build" -j"$(nproc)" --target gcalloc_tool >/dev/null
fi
for workload in training inference cnn; do
  mkdir -p "data/snapshots/$workload"
  GCALLOC_ALLOC_CONF= "$build/gcalloc" demo --workload "$workload" --steps 6 --seed 42 \
    --snapshot "data/snapshots/$workload/memory.pickle" >/dev/null
  # Pickled again as torch.cuda.memory._dump_snapshot pickles (Python's
  # pickle.dump, protocol 4: frames and memo as in the snapshots users take).
  python3 -c 'import pickle, sys
with open(sys.argv[1], "rb") as f: s = pickle.load(f)
with open(sys.argv[1], "wb") as f: pickle.dump(s, f, protocol=4)' "data/snapshots/$workload/memory.pickle"
  echo "data/snapshots/$workload/memory.pickle: $(stat -c %s "data/snapshots/$workload/memory.pickle") bytes"
done
