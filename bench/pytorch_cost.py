#!/usr/bin/env python3
"""The allocator's own cost beside PyTorch's, in one process on a real GPU.

    python3 bench/pytorch_cost.py --lib build/libgcalloc.so [--json FILE]

Needs a GPU, PyTorch and a C++ compiler (a benchmark for scripts/gpu-check.sh,
not a test). A small extension built with torch.utils.cpp_extension.load_inline
times, in C++ and with no Python in the loop, PyTorch's caching allocator
(c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete) and
gcalloc (gca_malloc / gca_free, an allocator of its own opened on the cuda
backend in the same process) on the same cached pairs: 512 B, 64 KiB, 4 MiB
and 64 MiB, one thread and four threads on the default stream. Reported: ns
per pair (wall time over pairs, all threads together) and the ratio
gcalloc / PyTorch.

Then, in a child with gcalloc installed as PyTorch's allocator, cuDNN's
benchmark mode on a small convolutional net: what happens (docs/pytorch.md
says to leave it off under the drop-in).
"""
import argparse
import json
import os
import subprocess
import sys

SIZES = [512, 64 << 10, 4 << 20, 64 << 20]

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>
#include "gcalloc.h"

static gca_allocator_t *ga;

// Wall nanoseconds for `threads` threads each doing `pairs` cached pairs.
template <class Pair> static double timed(int threads, long pairs, Pair pair) {
  for (int i = 0; i < 1000; i++) pair();  // the cache filled
  std::vector<std::thread> ts;
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; t++)
    ts.emplace_back([&] { for (long i = 0; i < pairs; i++) pair(); });
  for (auto &t : ts) t.join();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
}

double torch_pairs(int64_t size, int threads, int64_t pairs) {
  auto *alloc = c10::cuda::CUDACachingAllocator::get();
  (void)alloc;
  return timed(threads, pairs, [size] {
    void *p = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream((size_t)size, nullptr);
    c10::cuda::CUDACachingAllocator::raw_delete(p);
  });
}

double gcalloc_pairs(int64_t size, int threads, int64_t pairs) {
  if (!ga && gca_open("cuda", "", &ga) != 0) throw std::runtime_error(gca_last_error());
  return timed(threads, pairs, [size] {
    void *p = gca_malloc(ga, (size_t)size, 0, 0);
    if (!p) throw std::runtime_error(gca_last_error());
    gca_free(ga, p);
  });
}
"""


def cost(args):
    import torch
    from torch.utils.cpp_extension import load_inline

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    libdir = os.path.dirname(os.path.abspath(args.lib))
    ext = load_inline("gcalloc_cost", cpp_sources=[SOURCE], functions=["torch_pairs", "gcalloc_pairs"],
                      with_cuda=True, extra_include_paths=[os.path.join(root, "include"), os.path.join(libdir, "include")],
                      extra_ldflags=["-L" + libdir, "-lgcalloc", "-Wl,-rpath," + libdir],
                      build_directory=args.build_dir, verbose=False)
    torch.empty(1, device="cuda")  # PyTorch's context and allocator up
    rows = []
    print("allocator cost on %s (torch %s), ns per cached pair, all threads together:"
          % (torch.cuda.get_device_name(0), torch.__version__))
    print("%10s %8s %12s %12s %8s" % ("size", "threads", "PyTorch", "gcalloc", "ratio"))
    for threads in (1, 4):
        for size in SIZES:
            pairs = args.pairs // threads
            best_t = best_g = None
            for _ in range(args.repeat):  # interleaved, the best of each kept
                t = ext.torch_pairs(size, threads, pairs) / (pairs * threads)
                g = ext.gcalloc_pairs(size, threads, pairs) / (pairs * threads)
                best_t = t if best_t is None else min(best_t, t)
                best_g = g if best_g is None else min(best_g, g)
            rows.append({"size": size, "threads": threads, "torch_ns": best_t, "gcalloc_ns": best_g})
            print("%10d %8d %12.1f %12.1f %8.2f" % (size, threads, best_t, best_g, best_g / best_t), flush=True)
    return rows


def cudnn_child():
    import torch

    import gcalloc.torch

    gcalloc.torch.install()
    torch.backends.cudnn.benchmark = True
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(32, 32, 3, padding=1)).cuda()
    try:
        for _ in range(3):
            net(torch.randn(16, 3, 64, 64, device="cuda")).sum().backward()
        torch.cuda.synchronize()
        print(json.dumps({"benchmark_mode": "ran"}))
    except Exception as e:
        print(json.dumps({"benchmark_mode": "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300])}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libgcalloc.so")
    ap.add_argument("--json")
    ap.add_argument("--pairs", type=int, default=400000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--build-dir", default=None)
    ap.add_argument("--cudnn-child", action="store_true")
    args = ap.parse_args()
    os.environ["GCALLOC_LIBRARY"] = os.path.abspath(args.lib)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    if args.cudnn_child:
        cudnn_child()
        return 0
    if args.build_dir:
        os.makedirs(args.build_dir, exist_ok=True)
    report = {"cost": cost(args)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--cudnn-child", "--lib", args.lib],
                       capture_output=True, text=True, timeout=300, env=env)
    line = (r.stdout.strip().splitlines() or ["{}"])[-1]
    report["cudnn"] = json.loads(line) if line.startswith("{") else {"failed": r.stderr[-2000:]}
    print("cuDNN benchmark mode under the drop-in: %s" % report["cudnn"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
