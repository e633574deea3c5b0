#!/usr/bin/env bash
# What CI cannot check, for an Ascend host with CANN (set_env.sh sourced, so
# that libascendcl.so loads) and, for the last steps, torch_npu: the acl
# backend on the real runtime (ctest -L acl, test_acl_runtime required to
# find an NPU), the backend's benchmark, and gcalloc inside torch_npu: a
# training loop with and without it, the thread's device across every NPU,
# and an HCCL all-reduce whose inputs HCCL records on its stream
# (bench/torch_npu_check.py). Nothing here has run on NPU hardware yet:
# docs/acl.md says what it would settle.
# usage: scripts/npu-check.sh [BUILD_DIR [OUT_DIR]]   (defaults: build-npu, npu-check-out)
# BUILD_DIR is configured and built here (Release). Every step runs even
# when one before it failed; the exit status says whether all passed. Logs
# and the JSON results go to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-npu} out=${2:-npu-check-out}
mkdir -p "$out"
. scripts/check-steps.sh
step npu npu-smi info
step build sh -c "cmake -S . -B '$build' -DCMAKE_BUILD_TYPE=Release && cmake --build '$build' -j"
step ctest_acl env GCALLOC_REQUIRE_NPU=1 ctest --test-dir "$build" -L acl --output-on-failure
step bench_acl "$build/gcalloc" bench-acl
step torch_npu env PYTHONUNBUFFERED=1 PYTHONPATH=python GCALLOC_LIBRARY="$build/libgcalloc.so" \
  python3 bench/torch_npu_check.py --json "$out/torch_npu.json"
finish npu-check
