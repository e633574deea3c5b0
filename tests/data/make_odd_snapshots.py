#!/usr/bin/env python3
"""Writes snapshot_shared.pickle and snapshot_escape.pickle: small
PyTorch-style snapshots (protocol 4, as torch.cuda.memory._dump_snapshot
writes them) whose device_traces entries share objects in the ways the
pickle reader's second reader (pickle.c, "Reading on two cores") must get
right or hand back: a free_completed entry's frames list shared with its
free_requested entry, as PyTorch does; a frames value that is a string, a
frame dict, an int or a dict; a list under another key; an entry that is
its own frames; a key and an action first seen late in the file. In snapshot_escape.pickle one
entry's frames is another entry, which makes the reader read the file
again without records.

Run: python3 make_odd_snapshots.py shared > snapshot_shared.pickle
     python3 make_odd_snapshots.py escape > snapshot_escape.pickle
"""
import pickle
import sys


def frame(name, line, filename):
    return {"name": name, "filename": filename, "line": line}


def main(kind):
    files = ["/opt/app/model.py", "/opt/app/train.py"]
    frames = [frame("f%d" % i, 10 + i, files[i % 2]) for i in range(10)]
    segments = [{"device": 0, "address": 0x7F0000000000, "total_size": 8 << 20, "allocated_size": 0,
                 "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "large",
                 "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                 "blocks": [{"address": 0x7F0000000000, "size": 8 << 20, "requested_size": 0, "state": "inactive",
                             "frames": frames[:2]}]}]
    entries = []
    context = "N/A context"
    for i in range(48):
        addr = 0x7F0000000000 + (i % 6) * (1 << 20)
        stack = frames[i % 4:i % 4 + 5]
        entries.append({"action": "alloc", "addr": addr, "size": 512 * (i + 1), "stream": 0, "time_us": 1000 + i,
                        "compile_context": context, "frames": stack})
        requested = {"action": "free_requested", "addr": addr, "size": 512 * (i + 1), "stream": 0,
                     "time_us": 1001 + i, "compile_context": context, "frames": stack}
        entries.append(requested)
        # PyTorch's free_completed shares the free_requested entry's list.
        entries.append({"action": "free_completed", "addr": addr, "size": 512 * (i + 1), "stream": 0,
                        "time_us": 1002 + i, "compile_context": context, "frames": requested["frames"]})
        if i == 30:
            late = "late context %d" % i  # a string first stored here, then shared
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0, "compile_context": late,
                            "frames": []})
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0,
                            "frames": late})  # frames: a string stored just before
            fresh = frame("fresh", 99, files[0])
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0, "frames": frames[:2] + [fresh]})
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0, "frames": fresh})  # a frame
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0, "frames": frames[3]})
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0, "frames": 7})
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0, "frames": {"a": 1}})
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0, "compile_context": [],
                            "frames": []})  # a container under another key: read as a dict
            entries.append({"action": "segment_map", "addr": addr, "size": 8, "stream": 0, "user_metadata": "x",
                            "frames": []})  # an action and a key first seen late
            selfish = {"action": "alloc", "addr": addr, "size": 8, "stream": 0}
            selfish["frames"] = selfish
            entries.append(selfish)
        if i == 40 and kind == "escape":
            entries.append({"action": "alloc", "addr": addr, "size": 8, "stream": 0, "frames": entries[-5]})
    snapshot = {"segments": segments, "device_traces": [entries],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    sys.stdout.buffer.write(pickle.dumps(snapshot, protocol=4))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "shared")
