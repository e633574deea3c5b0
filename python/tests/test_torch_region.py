"""Regions that pause and resume at the same addresses, behind PyTorch's MemPool (gcalloc.torch.region,
pause, resume, cuda_graph, and torch_memory_saver's names), against the stand-in torch, whose native
caching allocator keeps PyTorch's rules for private pools (python/tests/standin/README.md). Each test
runs in a child process of its own, on a simulated device whose memory is host memory (its contents
can be read back)."""
import textwrap

from test_torch_hooks import run

BACKEND = {"GCALLOC_TORCH_BACKEND": "sim:backed=1,devices=2,capacity=256MiB", "PYTORCH_CUDA_ALLOC_CONF": ""}
REGION = """
from gcalloc.torch import region, pause, resume
def free_mib():
    return gcalloc.mem_get_info()[0] // MiB
def by_hand():  # a pausable pool, and a MemPool of gcalloc's region functions, without a region
    pool = gcalloc._process_allocator().create_pool(0, pausable=True)
    a = torch.cuda.memory.CUDAPluggableAllocator(gcalloc.library_path, "gca_torch_region_malloc",
                                                "gca_torch_region_free")
    return pool, a, torch.cuda.MemPool(a.allocator())
def pool_stats(tag):
    r = [r for r in gcalloc.torch.regions() if r["tag"] == tag][0]
    return gcalloc._process_allocator().pool_stats(r["pool"])
"""


def run_region(code, env=None):
    return run(REGION + textwrap.dedent(code), env=dict(BACKEND, **(env or {})))


def test_standin_pool_asks_its_allocator_per_segment():
    """The control: a MemPool caches what its allocator gave, asks it per segment, and raises
    torch.OutOfMemoryError when it refuses: here gcalloc's region function used outside a region."""
    run_region("""
        pool, a, mp = by_hand()
        with gcalloc._process_allocator().pool(pool), torch.cuda.use_mem_pool(mp):
            x = torch.empty(MiB)
            y = torch.empty(MiB)       # (the same 2 MiB segment)
            z = torch.empty(12 * MiB)  # (a segment of its own, 12 MiB)
        assert len(a.allocator()._metadata) == 2, a.allocator()._metadata
        x.free(); y.free()
        assert len(a.allocator()._metadata) == 2  # (cached by PyTorch, not given back)
        with torch.cuda.use_mem_pool(mp):  # (no gcalloc pool pushed)
            try:
                torch.empty(64 * MiB)
            except torch.OutOfMemoryError as e:
                assert "Tried to allocate 64.00 MiB" in str(e), e
            else:
                raise AssertionError("allocated")
        assert "outside gcalloc.torch.region()" in gcalloc.torch.last_failure(), gcalloc.torch.last_failure()
    """)


def test_region_tensors_come_from_the_tags_pool():
    """Inside region(tag) PyTorch's MemPool takes its segments from the tag's pausable pool; outside,
    tensors stay on PyTorch's allocator and gcalloc sees nothing."""
    run_region("""
        outside = torch.empty(4 * MiB)
        with region("weights") as pool:
            w = [torch.empty(3 * MiB) for _ in range(4)]  # (20 MiB segments: one holds six)
        s = pool_stats("weights")
        assert s["reserved_bytes"] == 20 * MiB and s["allocated_bytes"] == 20 * MiB, s
        assert torch._C._current().live.get(outside.data_ptr()) == 4 * MiB
        with region("weights") as again:
            w.append(torch.empty(3 * MiB))  # (PyTorch's cached block of the same segment)
        assert again == pool and pool_stats("weights")["reserved_bytes"] == 20 * MiB
        assert [r["tag"] for r in gcalloc.torch.regions()] == ["weights"]
    """)


def test_pause_gives_the_memory_back_and_resume_restores_it():
    """A pause gives the region's segments back to the device (its free memory grows by them); the
    resume maps them at the same addresses, a cpu_backup region's contents restored."""
    run_region("""
        with region("weights", cpu_backup=True):
            w = torch.empty(24 * MiB)
        with region("kv"):
            kv = torch.empty(40 * MiB)
        ctypes.memset(w.data_ptr(), 0x5A, 24 * MiB)
        before = free_mib()
        released = pause("weights")
        assert released == 24 * MiB, released
        assert free_mib() == before + 24, (before, free_mib())
        assert pause("kv") == 40 * MiB and free_mib() == before + 64
        address = w.data_ptr()
        resume("weights")
        assert w.data_ptr() == address and ctypes.string_at(address, 8) == b"\\x5a" * 8
        assert ctypes.string_at(address + 24 * MiB - 8, 8) == b"\\x5a" * 8
        assert free_mib() == before + 40
        resume()
        assert free_mib() == before
        kv.free(); w.free()
    """)


def test_a_paused_region_refuses_allocation_and_a_used_one_refuses_pause():
    """The rule for PyTorch's cached blocks of a paused region: entering it is refused with an error
    (PyTorch would hand out blocks with no memory under them); pausing a region a thread is inside is
    refused too."""
    run_region("""
        import threading
        with region("kv"):
            kv = torch.empty(8 * MiB)
        kv.free()  # (a free block PyTorch keeps cached in the pool)
        pause("kv")
        try:
            with region("kv"):
                torch.empty(MiB)
        except gcalloc.GcallocError as e:
            assert "region is paused" in str(e) and "resume('kv')" in str(e), e
        else:
            raise AssertionError("entered a paused region")
        resume("kv")
        inside, leave = threading.Event(), threading.Event()
        def hold():
            with region("kv"):
                inside.set()
                leave.wait(10)
        t = threading.Thread(target=hold)
        t.start()
        inside.wait(10)
        try:
            pause("kv")
        except gcalloc.GcallocError as e:
            assert "1 thread is inside region('kv')" in str(e), e
        else:
            raise AssertionError("paused a region in use")
        leave.set()
        t.join()
        assert pause("kv") > 0
    """)


def test_expandable_segments_in_the_configuration():
    """PyTorch refuses a MemPool's allocator a segment while expandable segments are on (the control);
    a region turns them off while a thread is inside and back on after."""
    run_region("""
        from torch import _C as C
        pool, a, mp = by_hand()
        with gcalloc._process_allocator().pool(pool), torch.cuda.use_mem_pool(mp):
            try:
                torch.empty(MiB)
            except RuntimeError as e:
                assert "doesn't currently support expandable_segments" in str(e), e
            else:
                raise AssertionError("the stand-in let a MemPool's allocator work with expandable segments")
        with region("kv"):
            assert not C._expandable_segments()
            kv = torch.empty(30 * MiB)
        assert C._expandable_segments() and C._native_settings[-2:] == ["expandable_segments:False",
                                                                      "expandable_segments:True"]
        assert pause("kv") == 30 * MiB
    """, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def test_a_graph_captured_into_a_region_pauses_with_it():
    """cuda_graph captures into the region's MemPool: the capture's memory is the region's."""
    run_region("""
        g = torch.cuda.CUDAGraph()
        with gcalloc.torch.cuda_graph(g, tag="graphs"):
            out = torch.empty(16 * MiB)
        assert g.pool_id() == [r for r in gcalloc.torch.regions() if r["tag"] == "graphs"][0]["mempool_id"]
        assert pool_stats("graphs")["reserved_bytes"] == 16 * MiB
        address = out.data_ptr()
        assert pause("graphs") == 16 * MiB
        resume("graphs")
        assert out.data_ptr() == address
    """)


def test_torch_memory_saver_names():
    """The same through torch_memory_saver's names: a switch of import."""
    run_region("""
        from gcalloc.torch_memory_saver import torch_memory_saver
        with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
            w = torch.empty(6 * MiB)
        with torch_memory_saver.region(tag="kv_cache"):
            kv = torch.empty(10 * MiB)
            with torch_memory_saver.disable():
                plain = torch.empty(10 * MiB)
        assert pool_stats("kv_cache")["reserved_bytes"] == 10 * MiB  # (plain: PyTorch's own MemPool)
        ctypes.memset(w.data_ptr(), 7, 64)
        before = free_mib()
        torch_memory_saver.pause("kv_cache")
        assert free_mib() == before + 10
        torch_memory_saver.pause()
        assert free_mib() == before + 30
        torch_memory_saver.resume()
        assert free_mib() == before and ctypes.string_at(w.data_ptr(), 4) == b"\\x07" * 4
        try:
            with torch_memory_saver.region(tag="x", enable_disk_backup=True):
                pass
        except NotImplementedError as e:
            assert "enable_cpu_backup" in str(e)
        assert torch_memory_saver.enabled
        for name, value in (("memory_margin_bytes", 1 << 30), ("retain_cpu_backup", True), ("extra", 1)):
            try:
                setattr(torch_memory_saver, name, value)
            except (NotImplementedError, AttributeError) as e:
                assert name in str(e) or "attribute" in str(e), e
            else:
                raise AssertionError("%s was set and would be ignored" % name)
    """)


def test_under_install_a_region_is_the_tags_pool():
    """With gcalloc installed as PyTorch's allocator a region needs no MemPool: the tag's pool."""
    run_region("""
        install()
        with region("kv") as pool:
            kv = torch.empty(8 * MiB)
        assert gcalloc._process_allocator().pool_of(kv.data_ptr()) == pool
        assert [r["mempool_id"] for r in gcalloc.torch.regions()] == [None]
        assert pause("kv") >= 8 * MiB
        resume("kv")
        try:
            with gcalloc.torch.cuda_graph(object(), tag="g"):
                pass
        except gcalloc.GcallocError as e:
            assert "under install()" in str(e)
        else:
            raise AssertionError("captured under install()")
    """)


TURNS = """
import sys
from gcalloc.torch import region, pause, resume
tag, first = sys.argv[1], True
print("ready", os.getpid(), flush=True)
for line in sys.stdin:
    command = line.split()
    try:
        if first:
            with region(tag):
                held = torch.empty(int(command[1]) * MiB)
            first = False
        else:
            resume(tag)
        if command[0] == "turn":
            pause(tag)
        print("ok", flush=True)
    except Exception as e:
        print("error %s: %s" % (type(e).__name__, " ".join(str(e).split())), flush=True)
"""


def spawn(code, env, *args):
    """`code` after PRELUDE in a child process with the stand-in torch, reading commands on its stdin."""
    import subprocess
    import sys

    from test_torch_hooks import PRELUDE, child_environment

    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
                            env=child_environment(env=env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(child, command):
    child.stdin.write(command + "\n")
    child.stdin.flush()
    return child.stdout.readline().strip()


def test_two_processes_take_turns_on_one_device():
    """A trainer and an engine in two processes, each with 80 MiB live in a region of a 128 MiB shared
    device, take turns by pausing: every turn resumes without running out of memory. A process that
    does not pause makes the other's resume fail, with an error naming what it needed, the region paused
    as before (and resumed once the memory is back)."""
    import os

    env = {"GCALLOC_TORCH_BACKEND": "sim:shared=regions-%d,capacity=128MiB" % os.getpid(),
           "GCALLOC_ALLOC_CONF": "ipc_cooperation:True,ipc_release_timeout_ms:300", "PYTORCH_CUDA_ALLOC_CONF": ""}
    engine, trainer = spawn(TURNS, env, "kv_cache"), spawn(TURNS, env, "train")
    try:
        pids = [int(c.stdout.readline().split()[1]) for c in (engine, trainer)]
        results = []
        for turn in range(6):
            results += [ask(engine, "turn 80"), ask(trainer, "turn 80")]
        assert results == ["ok"] * 12, results
        assert ask(trainer, "hold 80") == "ok"  # (resumed, not paused)
        refused = ask(engine, "turn 80")
        assert refused.startswith("error OutOfMemoryError") and "80.00 MiB" in refused, refused
        assert "pid %d holds 80.00 MiB, 0 bytes of it cached" % pids[1] in refused, refused
        assert ask(trainer, "turn 80") == "ok"  # (it pauses now)
        assert ask(engine, "turn 80") == "ok"
    finally:
        for child in (engine, trainer):
            child.stdin.close()
            child.wait(30)
