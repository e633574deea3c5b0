#!/usr/bin/env bash
# What CI cannot check, for a machine with an NVIDIA GPU and PyTorch: the
# cuda backend on the real driver, the driver-level benchmark (and PyTorch's
# pinned host allocator on the same pinned workloads), the replay's speed on
# that machine's processors, the Python package, pausable pools and processes
# sharing the GPU under PyTorch, the allocator's own cost beside PyTorch's in
# one process, gcalloc plugged into PyTorch beside PyTorch's own allocators,
# a CUDA graph captured through the drop-in's graph hooks, and regions that
# pause and resume behind PyTorch's MemPool.
# usage: scripts/gpu-check.sh [BUILD_DIR [OUT_DIR]]   (defaults: build, gpu-check-out)
# BUILD_DIR is a configured and built tree (cmake -S . -B build && cmake --build build).
# Every step runs even when one before it failed; the exit status says
# whether all passed. Logs go to OUT_DIR. ONLY="step ..." runs just those.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build} out=${2:-gpu-check-out}
mkdir -p "$out"
. scripts/check-steps.sh
step gpu nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
step test_cuda_driver env GCALLOC_REQUIRE_GPU=1 CMOCKA_MESSAGE_OUTPUT=stdout "$build/tests/test_cuda_driver"
step pytorch_sharing env PYTHONUNBUFFERED=1 python3 bench/pytorch_sharing.py --lib "$build/libgcalloc.so" \
  --json "$out/pytorch_sharing.json"
step pytorch_cost env PYTHONUNBUFFERED=1 python3 bench/pytorch_cost.py --lib "$build/libgcalloc.so" \
  --build-dir /tmp/gcalloc-cost-ext --json "$out/pytorch_cost.json"
step bench_cuda "$build/gcalloc" bench-cuda
# The replay's speed on the device machine's processors (a regression
# check, docs/benchmarks.md), back to back and once after 4 s idle: the traces
# are ../shared/traces, or where TRACES says (a copy carried to a device
# machine, which has no ../shared); skipped when there are none.
traces=${TRACES:-../shared/traces}
if [ -d "$traces" ]; then
  step replay_speed "$build/gcalloc" bench-replay --runs 50 --idle 4 --traces "$traces"
else
  echo "=== replay_speed: skipped, no traces at $traces ==="
fi
step pytorch_pinned env PYTHONUNBUFFERED=1 python3 bench/pytorch_pinned.py --json "$out/pytorch_pinned.json"
step python_package env GCALLOC_LIBRARY="$build/libgcalloc.so" PYTHONPATH=python python3 -m pytest -q -p no:cacheprovider python/tests
# A CUDA graph captured and replayed under the drop-in (its private pool,
# through the pluggable allocator's graph hooks): also in python_package,
# named here so that its outcome stands on its own line.
step cuda_graph env GCALLOC_LIBRARY="$build/libgcalloc.so" PYTHONPATH=python python3 -m pytest -q -p no:cacheprovider \
  python/tests/test_torch_gpu.py -k cuda_graph
# Out of memory under the drop-in as torch.OutOfMemoryError (the raiser
# install() builds against the running PyTorch's headers).
step torch_oom env GCALLOC_LIBRARY="$build/libgcalloc.so" PYTHONPATH=python python3 -m pytest -q -p no:cacheprovider \
  python/tests/test_torch_gpu.py -k out_of_memory
# Regions behind PyTorch's MemPool: weights and KV-cache-like buffers in two
# tags, a graph captured into one, 20 pauses and resumes with the output
# unchanged, the free memory each pause gave, ms per GiB (its log has them);
# then two processes taking turns on the GPU by pausing their regions.
step regions env GCALLOC_LIBRARY="$build/libgcalloc.so" PYTHONPATH=python python3 -m pytest -q -s -p no:cacheprovider \
  python/tests/test_torch_gpu.py -k regions
step pytorch env PYTHONUNBUFFERED=1 python3 bench/pytorch_gpu.py --lib "$build/libgcalloc.so" --tool "$build/gcalloc" \
  --out "$out/pytorch" --json "$out/pytorch.json"
finish gpu-check
