#!/usr/bin/env python3
"""Check a gcalloc snapshot pickle and its JSON twin (test_observability).

The pickle must load with an unpickler that refuses every global, use only
the opcodes memory_viz's JavaScript unpickler reads, hold only plain data,
follow torch.cuda.memory._snapshot()'s layout, and equal the JSON. Every
distinct string must be written once (then referred to through the memo),
and equal frames must be one shared object, as in PyTorch's own pickles.
Usage: check_snapshot.py SNAPSHOT.pickle SNAPSHOT.json EXPECTED_SEGMENTS EXPECTED_ENTRIES [OPCODE,...]
(the opcodes listed last must appear: LONG_BINPUT,LONG_BINGET for a memo of more than 256 objects).
"""
import json
import pickle
import pickletools
import sys

ALLOWED_OPCODES = {"PROTO", "EMPTY_DICT", "EMPTY_LIST", "MARK", "SETITEMS", "APPENDS", "BININT1", "BININT2",
                   "BININT", "LONG1", "BINUNICODE", "BINFLOAT", "NEWTRUE", "NEWFALSE", "NONE", "BINPUT",
                   "LONG_BINPUT", "BINGET", "LONG_BINGET", "STOP"}


class Restricted(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name} refused")


def fail(msg):
    print("check_snapshot:", msg)
    sys.exit(1)


def check_types(value, path="snapshot"):
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                fail(f"{path}: key {k!r} is not a string")
            check_types(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_types(v, f"{path}[{i}]")
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        fail(f"{path}: {type(value).__name__} is not plain data")


def need(d, keys, types, path):
    for k, t in zip(keys, types):
        if k not in d:
            fail(f"{path}: missing '{k}'")
        if not isinstance(d[k], t):
            fail(f"{path}.{k}: {type(d[k]).__name__}, expected {t}")


def main():
    pickle_path, json_path, want_segments, want_entries = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    data = open(pickle_path, "rb").read()
    used = {op.name for op, _, _ in pickletools.genops(data)}
    required = set(sys.argv[5].split(",")) if len(sys.argv) > 5 else set()
    if not required <= used:
        fail(f"opcodes expected but not used: {sorted(required - used)}")
    if not used <= ALLOWED_OPCODES:
        fail(f"opcodes outside what memory_viz reads: {sorted(used - ALLOWED_OPCODES)}")
    strings = [arg for op, arg, _ in pickletools.genops(data) if op.name == "BINUNICODE"]
    if len(strings) != len(set(strings)):
        fail(f"strings written more than once: {sorted({x for x in strings if strings.count(x) > 1})[:5]}")
    snap = Restricted(open(pickle_path, "rb")).load()
    check_types(snap)
    frames = {}
    for owner in [b for seg in snap["segments"] for b in seg["blocks"]] + [t for d in snap["device_traces"] for t in d]:
        for f in owner["frames"]:
            if frames.setdefault((f["filename"], f["line"], f["name"]), f) is not f:
                fail(f"frame {f} written twice, not shared")
    if not frames:
        fail("no frames: the memo of frames went untested")
    need(snap, ["segments", "device_traces", "allocator_settings"], [list, list, dict], "snapshot")
    for i, seg in enumerate(snap["segments"]):
        p = f"segments[{i}]"
        need(seg, ["device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                   "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"],
             [int, int, int, int, int, int, int, str, list, bool, list, list], p)
        if seg["segment_type"] not in ("small", "large"):
            fail(f"{p}.segment_type is {seg['segment_type']!r}")
        covered = 0
        for j, b in enumerate(seg["blocks"]):
            need(b, ["address", "size", "requested_size", "state", "frames"], [int, int, int, str, list],
                 f"{p}.blocks[{j}]")
            if b["state"] not in ("active_allocated", "active_pending_free", "inactive"):
                fail(f"{p}.blocks[{j}].state is {b['state']!r}")
            if b["address"] != seg["address"] + covered:
                fail(f"{p}.blocks[{j}] does not start where the previous block ends")
            covered += b["size"]
            for f in b["frames"]:
                need(f, ["filename", "line", "name"], [str, int, str], f"{p}.blocks[{j}].frames")
        if covered != seg["total_size"]:
            fail(f"{p}: blocks cover {covered} of {seg['total_size']} bytes")
    entries = 0
    for d, trace in enumerate(snap["device_traces"]):
        for k, e in enumerate(trace):
            p = f"device_traces[{d}][{k}]"
            need(e, ["action", "size", "stream", "time_us", "frames"], [str, int, int, int, list], p)
            if e["action"] == "oom":
                need(e, ["device_free"], [int], p)
            else:
                need(e, ["addr"], [int], p)
            entries += 1
    need(snap["allocator_settings"], ["PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "garbage_collection_threshold",
                                      "expandable_segments", "roundup_power2_divisions"],
         [str, int, float, bool, dict], "allocator_settings")
    if len(snap["segments"]) != want_segments:
        fail(f"{len(snap['segments'])} segments, expected {want_segments}")
    if entries != want_entries:
        fail(f"{entries} history entries, expected {want_entries}")
    with open(json_path) as f:
        twin = json.load(f)
    if twin != snap:
        fail("the JSON and the pickle differ")
    print(f"check_snapshot: ok ({len(snap['segments'])} segments, {entries} entries, opcodes {sorted(used)})")


main()
