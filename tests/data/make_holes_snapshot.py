#!/usr/bin/env python3
"""Writes snapshot_holes.pickle: a small PyTorch-style memory snapshot
recorded with expandable segments whose peak leaves a hole, for the
report's segment map (tests/check_report.py --expect-unmapped).

The job maps A (200 MiB), B (400 MiB) and C (200 MiB) one after another,
frees B and empties the cache (B's pages are unmapped: a hole between A
and C), then maps D (600 MiB), which does not fit the hole and goes to the
end: the peak (A, C and D mapped, 1000 MiB) has 400 MiB unmapped below
the range's highest mapped page. Small tensors come and go throughout in a
2 MiB page of the small pool, so that the report's plot has the hundred
points its check asks for. Everything is freed and unmapped at the end,
so the snapshot's segment list is empty.

Run: python3 make_holes_snapshot.py > snapshot_holes.pickle
"""
import pickle
import sys

MIB = 1 << 20


def main():
    files = ["/opt/app/model.py", "/opt/app/train.py"]
    frames = [{"name": "step%d" % i, "filename": files[i % 2], "line": 10 + i} for i in range(6)]
    base = 0x7F0000000000
    events, t = [], 1000

    def add(action, addr, size, stack=0):
        nonlocal t
        events.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
                       "frames": frames[stack:stack + 3]})
        t += 10

    at = {"A": (base, 200 * MIB), "B": (base + 200 * MIB, 400 * MIB), "C": (base + 600 * MIB, 200 * MIB),
          "D": (base + 800 * MIB, 600 * MIB)}
    small = base + (4 << 30)

    def small_tensors(n):
        for i in range(n):
            add("alloc", small, 512 * 1024, i % 3)
            add("free_requested", small, 512 * 1024, i % 3)
            add("free_completed", small, 512 * 1024, i % 3)

    add("segment_map", small, 2 * MIB)
    small_tensors(30)
    for i, name in enumerate("ABC"):
        addr, size = at[name]
        add("segment_map", addr, size, i)
        add("alloc", addr, size, i)
    add("free_requested", *at["B"], 3)
    add("free_completed", *at["B"], 3)
    add("segment_unmap", *at["B"], 3)
    add("segment_map", *at["D"], 4)
    add("alloc", *at["D"], 4)
    small_tensors(30)
    for name in "ACD":
        add("free_requested", *at[name], 5)
        add("free_completed", *at[name], 5)
    for name in "ACD":
        add("segment_unmap", *at[name], 5)
    add("segment_unmap", small, 2 * MIB)
    snapshot = {"segments": [], "device_traces": [events],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                       "expandable_segments": True}}
    sys.stdout.buffer.write(pickle.dumps(snapshot, protocol=4))


if __name__ == "__main__":
    main()
