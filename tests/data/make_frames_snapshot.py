#!/usr/bin/env python3
"""Writes snapshot_frames.pickle: a small PyTorch-style memory snapshot whose
entries carry call stacks of the kinds real snapshots have, for the report's
stacks (trace_load_options.stacks) and their tests (test_replay,
check_report.py --expect-stacks). Pickled as torch.cuda.memory._dump_snapshot
does (protocol 4): frame dicts are shared between stacks and a free entry
shares its allocation's frames list, so the memo carries them.

Device 0, in order (sizes in MiB; each of A to D a segment of its own, so
that all are live at the peak, reached at D):
  S 0.5 a block live before recording (its only entry a free at the end)
  A 30  a stack of native and Python frames: told by its Python frames alone
  B 40  native frames only: the capturing frames left out, the rest kept
  C 50  40 Python frames in a Windows path: 32 kept, then "... 8 more frames"
  D 30  A's frames again in new objects: the same stack as A
  E 1   allocated and freed in S's segment, 60 times (its free entries
        share its frames list)
PyTorch's segment_alloc entries come before A to D, and the segments at the
end are listed, so that the report has PyTorch's reserved bytes to draw.

With `many`, it writes snapshot_many_stacks.pickle instead: 2,100 blocks of
512 B, each allocated from a stack of its own, live at the peak (a 30 MiB
allocation after them), 100 more than the 2,000 stacks a report holds.

Run: python3 make_frames_snapshot.py > snapshot_frames.pickle
     python3 make_frames_snapshot.py many > snapshot_many_stacks.pickle
"""
import pickle
import sys

MiB = 1 << 20


def frame(name, line, filename):
    return {"name": name, "filename": filename, "line": line}


def mixed():
    return [frame("torch::unwind::unwind()", 0, "??"),
            frame("torch::CapturedTraceback::gather(bool, bool, bool)", 0, "??"),
            frame("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc", 0,
                  "CUDACachingAllocator.cpp"),
            frame("step", 42, "/opt/job/train.py"),
            frame("_PyEval_EvalFrameDefault", 2586, "/usr/src/python/Python/ceval.c"),
            frame("<module>", 7, "/opt/job/main.py")]


def main():
    native = [frame("torch::unwind::unwind()", 0, "??"),
              frame("torch::CapturedTraceback::gather(bool, bool, bool)", 0, "??"),
              frame("at::native::empty_cuda", 0, "??"),
              frame("main", 12, "/src/app/app.cpp")]
    deep = [frame("f%d" % i, i, "C:\\job\\deep.py") for i in range(40)]
    e_frames = [frame("evict", 3, "/opt/job/cache.py")]
    t = 1000
    base = 0x7F0000000000
    trace = []

    def entry(action, addr, size, frames):
        nonlocal t
        t += 10
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": frames}

    def segment(addr, size, state, frames):
        return {"device": 0, "address": addr, "total_size": size, "stream": 0,
                "segment_type": "large" if size > MiB else "small", "is_expandable": False,
                "blocks": [{"address": addr, "size": size, "requested_size": size, "state": state,
                            "frames": frames}]}

    segments = [segment(base, 2 * MiB, "inactive", [])]
    for k, (size, frames) in enumerate([(30, mixed()), (40, native), (50, deep), (30, mixed())]):
        addr = base + (k + 1) * 0x10000000
        trace.append(entry("segment_alloc", addr, size * MiB, []))
        trace.append(entry("alloc", addr, size * MiB, frames))
        segments.append(segment(addr, size * MiB, "active_allocated", frames))
    for _ in range(60):
        trace.append(entry("alloc", base + 0x200000, 1 * MiB, e_frames))
        trace.append(entry("free_requested", base + 0x200000, 1 * MiB, e_frames))
        trace.append(entry("free_completed", base + 0x200000, 1 * MiB, e_frames))
    trace.append(entry("free_completed", base, MiB // 2, []))
    snapshot = {"segments": segments, "device_traces": [trace], "allocator_settings": {}}
    sys.stdout.buffer.write(pickle.dumps(snapshot, protocol=4))


def many():
    trace = [{"action": "alloc", "addr": 0x7F0000000000 + i * 512, "size": 512, "stream": 0, "time_us": i,
              "frames": [frame("layer%d" % i, i, "/opt/job/model.py")]} for i in range(2100)]
    trace.append({"action": "alloc", "addr": 0x7F1000000000, "size": 30 * MiB, "stream": 0, "time_us": 5000,
                  "frames": []})
    sys.stdout.buffer.write(pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4))


if __name__ == "__main__":
    many() if sys.argv[1:] == ["many"] else main()
