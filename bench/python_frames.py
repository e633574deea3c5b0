#!/usr/bin/env python3
"""What recording the calling thread's Python frames costs per allocation.

A malloc+free loop of 4 KiB runs in C (tests/pyhelper.c, built with the
tests) called from Python at a stack depth of DEPTH Python frames, on the
sim, in one process, settings interleaved round by round: the history off,
on with native stacks only, and on with Python frames too (context "all":
each allocation and each free gathers them, taking the GIL first). Prints
ns per pair, best of the rounds, and the ratios.

usage: python3 bench/python_frames.py PYHELPER_SO [--depth N] [--pairs N] [--rounds N]
  (PYHELPER_SO: build/tests/libgcalloc_pyhelper.so; GCALLOC_LIBRARY and PYTHONPATH as for the package)
"""
import argparse
import ctypes
import sys

import gcalloc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("helper")
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=100000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    lib = ctypes.CDLL(args.helper)
    lib.gcalloc_test_pairs_ns.restype = ctypes.c_double
    lib.gcalloc_test_pairs_ns.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    settings = {"off": None, "native": "native", "python+native": "all"}
    best = {name: float("inf") for name in settings}
    with gcalloc.Allocator("sim") as a:
        def at_depth(n, run):
            return run() if n <= 1 else at_depth(n - 1, run)

        for _ in range(args.rounds):
            for name, stacks in settings.items():
                if stacks is None:
                    a.record_history(False)
                else:
                    a.record_history(True, "all", 100000, stacks=stacks)
                with a._handle() as h:
                    ns = at_depth(args.depth, lambda: lib.gcalloc_test_pairs_ns(h, 4096, args.pairs))
                if ns < 0:
                    sys.exit("a malloc or free failed")
                best[name] = min(best[name], ns)
    print("4 KiB malloc+free from Python at a depth of %d frames, best of %d rounds of %d pairs (ns per pair):"
          % (args.depth, args.rounds, args.pairs))
    for name, ns in best.items():
        print("  %-14s %9.1f ns   %6.2fx off   %6.2fx native" % (name, ns, ns / best["off"], ns / best["native"]))
    print("Python frames cost %.0f ns per recorded event (two a pair: the allocation and the free)"
          % ((best["python+native"] - best["native"]) / 2))


if __name__ == "__main__":
    main()
