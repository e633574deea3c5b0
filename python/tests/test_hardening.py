"""Hostile use of the Python package (label hardening): every argument is
range-checked and typed before ctypes could truncate it, and close() while
other threads use the allocator waits for their calls and refuses later
ones; a child of fork leaves its parent's share of a device alone."""
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

import gcalloc

MiB = 1 << 20


def test_sizes_that_would_wrap():
    with gcalloc.Allocator("sim:capacity=1GiB") as a:
        with pytest.raises(OverflowError):
            a.malloc(2**64 + 4096)
        with pytest.raises(OverflowError):
            a.host_malloc(2**64 + 8)
        with pytest.raises(ValueError):
            a.malloc(-1)
        with pytest.raises(TypeError):
            a.malloc("4096")
        with pytest.raises(TypeError):
            a.malloc(4096.0)
        with pytest.raises(TypeError):
            a.malloc(True)
        assert a.memory_stats()["allocation.all.current"] == 0
        assert a.host_memory_stats()["allocation.current"] == 0


def test_devices_streams_and_pointers_that_would_wrap():
    with gcalloc.Allocator("sim:capacity=1GiB") as a:
        with pytest.raises(OverflowError):
            a.malloc(4096, device=2**32)
        with pytest.raises(ValueError):
            a.malloc(4096, device=-1)
        with pytest.raises(OverflowError):
            a.malloc(4096, stream=2**70)
        with pytest.raises(ValueError):
            a.malloc(4096, stream=-1)
        p = a.malloc(4096, stream=7)
        with pytest.raises(OverflowError):
            a.free(p + 2**64)
        with pytest.raises(OverflowError):
            a.record_stream(p, 2**64)
        with pytest.raises(OverflowError):
            a.memory_stats(2**32)
        with pytest.raises(OverflowError):
            a.host_record_stream(0, 0, device=2**40)
        with pytest.raises(TypeError):
            a.set_per_process_memory_fraction("0.5")
        assert a.memory_stats()["allocation.all.current"] == 1  # p is still live
        a.free(p)
        a.empty_cache(-1)


def test_text_with_a_nul():
    with pytest.raises(ValueError, match="NUL"):
        gcalloc.Allocator("sim", "max_split_size_mb:64\0,garbage")
    with pytest.raises(ValueError, match="NUL"):
        gcalloc.Allocator("sim\0:capacity=1GiB")
    with gcalloc.Allocator("sim") as a:
        with pytest.raises(ValueError, match="NUL"):
            a.set_config("expandable_segments:True\0")
        with pytest.raises(TypeError):
            a.set_config(42)
        assert "expandable_segments:False" in a.get_config()


def test_close_waits_for_calls_in_flight():
    a = gcalloc.Allocator("sim:capacity=100MiB", "oom_retry_timeout_ms:600")
    held = a.malloc(60 * MiB)
    outcome = {}

    def wait_for_memory():
        try:
            a.malloc(60 * MiB)  # waits inside C for memory until its deadline
            outcome["result"] = "allocated"
        except MemoryError:
            outcome["result"] = "MemoryError"
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            outcome["result"] = repr(e)

    t = threading.Thread(target=wait_for_memory)
    t.start()
    time.sleep(0.1)  # inside its wait
    start = time.monotonic()
    a.close()
    waited = time.monotonic() - start
    t.join()
    assert outcome["result"] == "MemoryError"
    assert waited > 0.2  # close waited for the call (its deadline was 0.6 s)
    with pytest.raises(gcalloc.GcallocError, match="closed") as closed:
        a.free(held)
    assert closed.value.status == gcalloc.GCA_ERR_INVALID
    with pytest.raises(gcalloc.GcallocError, match="closed"):
        a.memory_stats()
    a.close()  # twice: nothing


def test_close_while_threads_allocate():
    a = gcalloc.Allocator("sim:capacity=1GiB")
    errors, closed_seen = [], []
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            try:
                p = a.malloc(4096)
                a.record_stream(p, 3)
                a.free(p)
                a.memory_stats()
            except gcalloc.GcallocError as e:
                closed_seen.append(str(e))
                return
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    a.close()
    stop.set()
    for t in threads:
        t.join()
    assert errors == []
    assert all("closed" in m for m in closed_seen)
    assert a.closed


def test_close_from_another_thread_inside_a_pool_block():
    """A pool push open on one thread while another closes: the block ends
    quietly, and an allocator opened after routes nothing through the old push."""
    a = gcalloc.Allocator("sim:capacity=1GiB")
    p = a.create_pool()
    inside, closed = threading.Event(), threading.Event()
    errors = []

    def worker():
        try:
            with a.pool(p):
                inside.set()
                closed.wait(10)
        except Exception as e:  # pragma: no cover - the failure being tested
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    assert inside.wait(10)
    a.close()
    closed.set()
    t.join(10)
    assert not t.is_alive() and errors == []
    for _ in range(8):  # new allocators, some perhaps at the old address
        with gcalloc.Allocator("sim:capacity=1GiB") as b:
            q = b.create_pool()
            x = b.malloc(MiB)
            assert b.pool_of(x) == 0
            with b.pool(q):
                y = b.malloc(MiB)
            assert b.pool_of(y) == q
            b.free(x)
            b.free(y)
            b.release_pool(q)


def test_thread_ending_inside_a_pool_block_does_not_pin_the_pool():
    with gcalloc.Allocator("sim:capacity=1GiB") as a:
        p = a.create_pool()

        def worker():  # the thread ends inside a push it never pops
            with a._handle() as h:
                assert gcalloc._lib.gca_pool_push(h, p) == 0

        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
        # join returns when the Python thread is done; the push is undone
        # when its native thread exits, a moment later.
        deadline = time.monotonic() + 10
        while a.pool_stats(p)["routes"] and time.monotonic() < deadline:
            time.sleep(0.001)
        a.release_pool(p)


# ---- the argument surface, fuzzed -------------------------------------------
# A seeded random walk over the Allocator's methods with hostile arguments
# (integers at and past every C width, negatives, floats, NaN, bools, None,
# strings with and without NUL bytes, bytes, containers, arbitrary objects)
# mixed with the addresses and pools the walk itself made. Every call either
# works or raises one of the documented classes, and after each the
# allocator's books hold (gca_check).

_HOSTILE = [0, 1, -1, 7, 4096, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -2**63,
            0.0, 1.5, float("nan"), float("inf"), True, False, None, "", "0", "cuda:1", "a\0b",
            b"", b"x", [], [1], {}, object(), 1 << 20]
_METHODS = ["malloc", "free", "record_stream", "empty_cache", "synchronize", "create_pool", "pause_pool",
            "resume_pool", "retain_pool", "release_pool", "route_stream", "unroute_stream", "pool_stats",
            "pool_of", "pools", "set_config", "get_config", "set_per_process_memory_fraction",
            "reset_peak_memory_stats", "reset_accumulated_memory_stats", "memory_stats", "memory_summary",
            "host_malloc", "host_free", "host_record_stream", "host_empty_cache", "host_is_pinned",
            "host_memory_stats", "host_reset_peak_memory_stats", "record_history", "memory_snapshot", "pool",
            "pause_pools", "resume_pools", "pool_backup"]
_ALLOWED = (TypeError, ValueError, OverflowError, KeyError, MemoryError, gcalloc.GcallocError)


@pytest.mark.filterwarnings("ignore::gcalloc.GcallocWarning")  # (random configurations warn)
def test_argument_surface_fuzzed():
    import random

    rng = random.Random(20261127)
    outcomes = {}
    with gcalloc.Allocator("sim:capacity=256MiB,host_capacity=64MiB") as a:
        made = []  # addresses and pools the walk made: legal values to mix in
        for _ in range(20000):
            name = rng.choice(_METHODS)
            args = [rng.choice(_HOSTILE + made * 2) if made and rng.random() < 0.5 else rng.choice(_HOSTILE)
                    for _ in range(rng.randint(0, 3))]
            try:
                if name == "pool":
                    with a.pool(*args):
                        pass
                    result = None
                else:
                    result = getattr(a, name)(*args)
                kind = "ok"
                if isinstance(result, int) and not isinstance(result, bool) and result > 0:
                    made.append(result)
                    del made[:-16]
            except _ALLOWED as e:
                kind = type(e).__name__
            outcomes[kind] = outcomes.get(kind, 0) + 1
            with a._handle() as h:
                assert gcalloc._lib.gca_check(h, -1) == 0, gcalloc._lib.gca_last_error().decode()
    print("argument fuzz, 20,000 calls:", sorted(outcomes.items()))
    assert outcomes["ok"] > 1000 and outcomes["TypeError"] > 1000 and outcomes["GcallocError"] > 100


# ---- fork: a child never touches its parent's share -------------------------

_FORK_CHILD_EXITS_NORMALLY = r"""
import os, sys
import gcalloc
spec, MiB = sys.argv[1], 1 << 20
a = gcalloc.Allocator(spec, "ipc_cooperation:True")
p = a.malloc(40 * MiB)
before = a.mem_get_info()[0]
pid = os.fork()
if pid == 0:
    # A normal exit: the interpreter's finalizers close the inherited allocator.
    sys.exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
pids = [peer["pid"] for peer in a.ipc_peers()]
assert os.getpid() in pids and pid not in pids, pids
assert a.mem_get_info()[0] == before, (a.mem_get_info()[0], before)
a.free(p)
a.close()
print("parent intact")
"""


def _shared_spec(tag):
    return "sim:shared=pyfork-%d-%s,capacity=100MiB" % (os.getpid(), tag)


def test_fork_child_exiting_normally_leaves_the_parent_alone():
    out = subprocess.run([sys.executable, "-c", _FORK_CHILD_EXITS_NORMALLY, _shared_spec("exit")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "parent intact" in out.stdout


def _child_opens_its_own(spec, inherited, queue):
    try:
        with pytest.raises(gcalloc.GcallocError, match="child of its fork"):
            inherited.malloc(4096)
        with gcalloc.Allocator(spec, "ipc_cooperation:True") as own:
            p = own.malloc(20 * MiB)  # (one page of an expandable segment, which cooperation implies)
            queue.put(("ok", own.mem_get_info()[0], sorted(peer["pid"] for peer in own.ipc_peers())))
            own.free(p)
    except BaseException as e:  # (reported to the parent, which asserts)
        queue.put(("failed", repr(e), []))


def test_multiprocessing_fork_children_leave_the_parent_alone():
    ctx = multiprocessing.get_context("fork")
    spec = _shared_spec("mp")
    with gcalloc.Allocator(spec, "ipc_cooperation:True") as a:
        p = a.malloc(40 * MiB)
        before = a.mem_get_info()[0]
        for _ in range(3):
            queue = ctx.Queue()
            child = ctx.Process(target=_child_opens_its_own, args=(spec, a, queue))
            child.start()
            state, free, pids = queue.get(timeout=60)
            child.join(60)
            assert state == "ok", free
            assert child.exitcode == 0
            assert free == before - 20 * MiB  # (the parent's 40 MiB still held)
            assert os.getpid() in pids and child.pid in pids
            assert [peer["pid"] for peer in a.ipc_peers()] == [os.getpid()]
            assert a.mem_get_info()[0] == before
        a.free(p)
