"""Python frames in the history's stacks: the file, line and function of
the Python code that allocated, from any Python thread; none from a thread
without Python; and no deadlock with the GIL (it is taken before any
gcalloc lock)."""
import ctypes
import os
import threading
import time

import pytest

import gcalloc

MiB = 1 << 20
HERE = os.path.abspath(__file__)


def helper():
    path = os.environ.get("GCALLOC_TEST_PYHELPER")
    if not path:
        pytest.skip("GCALLOC_TEST_PYHELPER is not set (CTest sets it)")
    lib = ctypes.CDLL(path)
    lib.gcalloc_test_alloc_in_c_thread.restype = ctypes.c_int
    lib.gcalloc_test_alloc_in_c_thread.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


def frames_of(entry):
    return [(f["name"], f["filename"], f["line"]) for f in entry["frames"]]


def python_frames(entry):
    return [f for f in frames_of(entry) if f[1].endswith(".py")]


def layer_forward(a, size):
    return a.malloc(size)  # the line the snapshot must name


def train_step(a, size):
    p = layer_forward(a, size)
    a.free(p)


def test_frames_of_the_callers_python_code():
    with gcalloc.Allocator("sim") as a:
        a.record_history(True, "all", 1000)
        train_step(a, MiB)
        worker = threading.Thread(target=train_step, args=(a, 2 * MiB), name="second")
        worker.start()
        worker.join()
        kept = a.malloc(3 * MiB)  # a live block: its stack is in the segments too
        trace = a.memory_snapshot()["device_traces"][0]
        allocs = [e for e in trace if e["action"] == "alloc"]
        assert [e["size"] for e in allocs] == [MiB, 2 * MiB, 3 * MiB]
        for entry in allocs[:2]:
            names = [(name, line) for name, filename, line in python_frames(entry) if filename == HERE]
            forward_line = layer_forward.__code__.co_firstlineno + 1
            assert names[:2] == [("layer_forward", forward_line), ("train_step", forward_line + 4)], frames_of(entry)
            # Python's frames first (what the user's code did), then the native ones.
            first_native = next(i for i, f in enumerate(frames_of(entry)) if not f[1].endswith(".py"))
            assert all(f[1].endswith(".py") for f in frames_of(entry)[:first_native]) and first_native > 0
        frees = [e for e in trace if e["action"] == "free_requested"]
        assert any(name == "train_step" for name, filename, _ in python_frames(frees[0]))
        blocks = [b for s in a.memory_snapshot()["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        assert [f["name"] for f in blocks[0]["frames"] if f["filename"] == HERE] == [
            "test_frames_of_the_callers_python_code"]
        a.free(kept)


def test_stacks_python_and_native():
    with gcalloc.Allocator("sim") as a:
        a.record_history(True, "alloc", 100, stacks="python")
        train_step(a, MiB)
        a.record_history(True, "alloc", 100, stacks="native")
        train_step(a, MiB)
        with pytest.raises(ValueError, match="stacks"):
            a.record_history(True, "alloc", 100, stacks="some")
        trace = a.memory_snapshot()["device_traces"][0]
        alloc = [e for e in trace if e["action"] == "alloc"][-1]
        assert python_frames(alloc) == [] and frames_of(alloc)  # native only
        a.record_history(True, "alloc", 100, stacks="python")
        train_step(a, MiB)
        alloc = [e for e in a.memory_snapshot()["device_traces"][0] if e["action"] == "alloc"][-1]
        assert frames_of(alloc) == python_frames(alloc) and python_frames(alloc)  # Python only


def test_no_python_frames_from_a_thread_without_python():
    lib = helper()
    with gcalloc.Allocator("sim") as a:
        a.record_history(True, "all", 100)
        with a._handle() as h:
            assert lib.gcalloc_test_alloc_in_c_thread(h, MiB) == 0
        alloc = [e for e in a.memory_snapshot()["device_traces"][0] if e["action"] == "alloc"][-1]
        assert frames_of(alloc) and python_frames(alloc) == [], frames_of(alloc)


DEADLOCK_SCENARIO = """
import ctypes, threading, time, gcalloc
holding = ctypes.PyDLL(gcalloc.library_path)
holding.gca_free.restype = ctypes.c_int
holding.gca_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
a = gcalloc.Allocator("sim")
a.record_history(True, "all", 10000)
stop = time.monotonic() + 1.0
counts = {"allocs": 0, "frees": 0}
handed, lock, allocating = [], threading.Lock(), threading.Event()
allocating.set()

def allocate():
    while time.monotonic() < stop:
        p = a.malloc(4096)
        with lock:
            handed.append(p)
        counts["allocs"] += 1
    allocating.clear()

def free_holding_the_gil():
    with a._handle() as h:
        while allocating.is_set() or handed:
            with lock:
                p = handed.pop() if handed else None
            if p is None:
                time.sleep(0)
                continue
            assert holding.gca_free(h, p) == 0
            counts["frees"] += 1

threads = [threading.Thread(target=allocate), threading.Thread(target=free_holding_the_gil)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert counts["allocs"] == counts["frees"] > 100, counts
allocs = [e for e in a.memory_snapshot()["device_traces"][0] if e["action"] == "alloc"]
assert any(f["name"] == "allocate" for f in allocs[-1]["frames"]), allocs[-1]["frames"]
print("ok", counts["allocs"])
"""


def test_no_deadlock_with_a_thread_that_frees_holding_the_gil():
    """One thread allocates through ctypes (the GIL released during the C call, taken again to gather its
    frames); another frees while holding the GIL throughout the call (PyDLL). Gathering before any gcalloc
    lock means neither can wait on the other in a cycle; gathering under the device lock hangs this (the
    holder of the GIL waits for the lock held by the one that waits for the GIL), so it runs in a process
    of its own with a deadline."""
    import subprocess
    import sys
    env = dict(os.environ, GCALLOC_LIBRARY=gcalloc.library_path,
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(gcalloc.__file__))))
    try:
        p = subprocess.run([sys.executable, "-c", DEADLOCK_SCENARIO], env=env, capture_output=True, text=True,
                           timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlocked: a thread allocating and one freeing while holding the GIL made no progress in 60 s")
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout + p.stderr
