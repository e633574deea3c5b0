#!/usr/bin/env python3
"""Writes snapshot_small.pickle: a small PyTorch-style memory snapshot,
pickled the way torch.cuda.memory._dump_snapshot does (pickle.dump,
protocol 4, so strings and dicts are memoized and shared), for the pickle
reader's tests. It has what the real snapshots have (segments with blocks,
device_traces entries whose frames lists share frame dicts and strings,
allocator_settings) and the forms the fast path for flat dicts must hand
back to the general machine: a one-item list (APPEND), an empty list, a
one-frame list, an oom entry, a device with a single entry.

Run: python3 make_small_snapshot.py > snapshot_small.pickle
"""
import pickle
import sys


def frame(name, line, filename):
    return {"name": name, "filename": filename, "line": line}


def main():
    files = ["/opt/app/model.py", "/opt/app/train.py", "/usr/lib/python3/torch/nn/module.py"]
    frames = [frame("forward", 10 + i, files[i % 3]) for i in range(12)]
    segments = []
    for s in range(3):
        base = 0x7F0000000000 + s * (1 << 26)
        blocks = []
        for b in range(4):
            blocks.append({"address": base + b * (1 << 20), "size": 1 << 20, "requested_size": (1 << 20) - b,
                           "state": "active_allocated" if b % 2 == 0 else "inactive",
                           "frames": frames[b:b + 3]})
        segments.append({"device": s % 2, "address": base, "total_size": 4 << 20, "allocated_size": 2 << 20,
                         "active_size": 2 << 20, "requested_size": 2 << 20, "stream": 0, "segment_type": "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks})
    traces = [[], []]
    t = 1000
    for i in range(60):
        d = 0
        addr = 0x7F0000000000 + (i % 8) * (1 << 20)
        action = ["alloc", "free_requested", "free_completed"][i % 3]
        if i % 17 == 5:
            stack = []  # an empty frames list
        elif i % 13 == 4:
            stack = [frames[i % 12]]  # one frame: APPEND
        elif i % 11 == 7:
            stack = frames[:3] + [frame("fresh%d" % i, i, files[0])] + frames[3:6]  # a new frame in the list
        else:
            stack = frames[i % 5:i % 5 + 6]
        entry = {"action": action, "addr": addr, "size": 512 * (i + 1), "stream": 0, "time_us": t, "frames": stack}
        if i == 30:
            entry = {"action": "oom", "device_free": 12345, "size": 1 << 40, "stream": 0, "time_us": t,
                     "frames": frames[:4]}
        traces[d].append(entry)
        t += 7
    traces[1].append({"action": "segment_alloc", "addr": 0x7F0004000000, "size": 4 << 20, "stream": 0,
                      "frames": frames[2:9]})
    snapshot = {"segments": segments, "device_traces": traces,
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "max_split_size": 64 << 20}}
    sys.stdout.buffer.write(pickle.dumps(snapshot, protocol=4))


if __name__ == "__main__":
    main()
