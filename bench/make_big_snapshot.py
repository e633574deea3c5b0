#!/usr/bin/env python3
"""Writes a PyTorch-style memory snapshot of N operations to stdout, for
timing gcalloc's reading and replay of a long history (docs/replay.md,
"Speed", long traces): the real snapshots in ../shared/traces hold 8,000 to
23,000 events, PyTorch's default history keeps 100,000, and a job recorded
with a larger max_entries can hold millions.

It is pickled as torch.cuda.memory._dump_snapshot pickles (protocol 4,
strings, dicts and frame lists memoized and shared): a training-like mix of
allocations of 512 B to 100 MB, each freed later (free_requested, then
free_completed) while at most 300 are live, freed addresses reused for the
same size as a caching allocator reuses them, and each entry with 5 to 20
frames taken from 400. No segment events are recorded, so there is no
PyTorch figure to compare with: it times the reader and the replay only.
Deterministic (seeded).

Run: python3 bench/make_big_snapshot.py 1000000 > /tmp/big.pickle
     (1,000,000 operations, 1.5 million events, 117 MB; about 10 s)
"""
import pickle
import random
import sys


def main(n):
    rng = random.Random(1)
    files = ["/opt/app/model%d.py" % i for i in range(40)]
    frames = [{"name": "fn%d" % i, "filename": files[i % 40], "line": i} for i in range(400)]
    sizes = [512, 1024, 4096, 1 << 20, 3 << 20, 25 << 20]
    live, freed, entries = {}, {}, []
    next_addr, t = 0x7F0000000000, 0
    for i in range(n):
        t += 3
        if live and (rng.random() < 0.5 or len(live) > 300):
            addr = rng.choice(list(live)) if len(live) < 50 else next(iter(live))
            size = live.pop(addr)
            freed.setdefault(size, []).append(addr)
            stack = frames[(i * 7) % 380:(i * 7) % 380 + rng.randint(5, 20)]
            for action in ("free_requested", "free_completed"):
                entries.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
                                "frames": stack})
        else:
            size = rng.choice(sizes) * rng.randint(1, 4)
            if freed.get(size):
                addr = freed[size].pop()
            else:
                addr = next_addr
                next_addr += size + 512
            live[addr] = size
            stack = frames[(i * 13) % 380:(i * 13) % 380 + rng.randint(5, 20)]
            entries.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t,
                            "frames": stack})
    snapshot = {"segments": [], "device_traces": [entries], "allocator_settings": {}}
    sys.stdout.buffer.write(pickle.dumps(snapshot, protocol=4))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: make_big_snapshot.py OPERATIONS > FILE.pickle")
    main(int(sys.argv[1]))
