"""The Python package on the sim backend (label cuda, run by CTest with
GCALLOC_LIBRARY pointing at the build's libgcalloc.so): the Allocator's
calls with PyTorch's names and values worked out by hand, bad input, the
snapshot files, and the PyTorch drop-in functions with a stand-in for the
torch module (the real one is not installed in CI)."""
import ctypes
import os
import pickle
import sys
import threading
import types

import pytest

import gcalloc
import gcalloc.torch
import gcalloc.torch_npu

MiB = 1 << 20


def test_malloc_free_and_statistics():
    with gcalloc.Allocator("sim:capacity=4GiB") as a:
        assert a.backend == "sim" and a.device_count == 1
        p = a.malloc(1000)
        assert p and p % 512 == 0
        s = a.memory_stats()
        assert len(s) == 123  # torch.cuda.memory_stats() has these keys
        assert list(s) == sorted(s)
        # 1000 bytes round to 1024 in the small pool's 2 MiB segment.
        assert s["allocated_bytes.all.current"] == 1024
        assert s["requested_bytes.all.current"] == 1000
        assert s["reserved_bytes.small_pool.current"] == 2 * MiB
        assert s["segment.all.current"] == 1
        q = a.malloc(30 * MiB)
        a.free(q)
        a.free(p)
        assert a.memory_stats()["allocated_bytes.all.peak"] == 1024 + 30 * MiB
        a.reset_peak_memory_stats()
        assert a.memory_stats()["allocated_bytes.all.peak"] == 0
        a.empty_cache()
        assert a.memory_stats()["reserved_bytes.all.current"] == 0
        assert "gcalloc" in a.memory_summary() and "Allocated memory" in a.memory_summary()


def test_bad_input():
    with pytest.raises(gcalloc.GcallocError, match="unknown backend 'nope'"):
        gcalloc.Allocator("nope")
    with pytest.raises(gcalloc.GcallocError, match="max_split_size_mb"):
        gcalloc.Allocator("sim", "max_split_size_mb:-3")
    with gcalloc.Allocator("sim:capacity=1GiB") as a:
        p = a.malloc(4096)
        with pytest.raises(gcalloc.GcallocError, match="GCA_ERR_BAD_POINTER|not|free") as e:
            a.free(p + 512)
        assert e.value.status == -5
        with pytest.raises(MemoryError, match="out of memory"):
            a.malloc(2 << 30)
        with pytest.raises(ValueError):
            a.malloc(-1)
        with pytest.raises(gcalloc.GcallocError, match="device 3"):
            a.memory_stats(3)
        a.free(p)  # still there: nothing was lost


def test_fraction_and_config():
    with gcalloc.Allocator("sim:capacity=1GiB", "expandable_segments:True") as a:
        assert "expandable_segments:True" in a.get_config()
        a.set_per_process_memory_fraction(0.5)
        with pytest.raises(MemoryError):
            a.malloc(600 * MiB)
        p = a.malloc(400 * MiB)
        a.free(p)
        for bad in (1.5, -0.1, float("nan")):  # (ValueError, as torch raises)
            with pytest.raises(ValueError, match="fraction"):
                a.set_per_process_memory_fraction(bad)


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError("global %s.%s" % (module, name))


def test_pinned_host_memory():
    with gcalloc.Allocator("sim:host_capacity=64KiB") as a:
        p = a.host_malloc(3000)
        assert p and p % 4096 == 0
        ctypes.memset(p, 7, 4096)  # real memory, the whole power-of-two block
        assert a.host_is_pinned(p + 4095)
        assert not a.host_is_pinned(ctypes.addressof(ctypes.c_int(0)))
        a.host_record_stream(p, stream=0x10)
        a.host_free(p)
        s = a.host_memory_stats()
        # torch.cuda.host_memory_stats()'s keys, worked out: one 4096-byte block.
        assert s["segment.current"] == 1 and s["reserved_bytes.current"] == 4096
        assert s["num_host_alloc"] == 1 and s["host_alloc_time.count"] == 1
        assert s["allocation.allocated"] == 1
        assert a.host_malloc(4096) == p  # the event completed: reused
        assert a.host_malloc(0) == 0
        with pytest.raises(MemoryError, match="out of pinned host memory"):
            a.host_malloc(128 * 1024)
        with pytest.raises(gcalloc.GcallocError, match="freed already"):
            a.host_free(p)
            a.host_free(p)
        a.host_empty_cache()
        s = a.host_memory_stats()
        assert s["segment.current"] == 0 and s["num_host_free"] == 1


def test_snapshots(tmp_path):
    with gcalloc.Allocator("sim:capacity=4GiB") as a:
        a.record_history(True, "state")
        p = a.malloc(3 * MiB)
        snap = a.memory_snapshot()
        assert [s["total_size"] for s in snap["segments"]] == [20 * MiB]
        assert any(e["action"] == "alloc" and e["size"] == 3 * MiB for e in snap["device_traces"][0])
        path = tmp_path / "snapshot.pickle"
        a.dump_snapshot(str(path))
        with open(path, "rb") as f:
            loaded = _NoGlobals(f).load()
        assert loaded["segments"][0]["blocks"][0]["state"] == "active_allocated"
        a.free(p)
        with pytest.raises(gcalloc.GcallocError, match="/nonexistent"):
            a.dump_snapshot("/nonexistent/dir/x.pickle")


def test_torch_entry_points(monkeypatch, torch_file):
    """The C functions PyTorch calls, on the process-wide allocator (the sim here)."""
    lib = ctypes.CDLL(gcalloc.library_path)
    calls = {}

    class PluggableAllocator:
        def __init__(self, path, alloc_name, free_name):
            # What PyTorch does with these: look both names up in the library.
            so = ctypes.CDLL(path)
            calls["alloc"], calls["free"] = getattr(so, alloc_name), getattr(so, free_name)
            calls["names"] = (alloc_name, free_name)

    def change_current_allocator(allocator):
        calls["installed"] = allocator

    class Tensor:
        """What the record_stream wrapper uses of torch.Tensor."""
        is_cuda = True

        def __init__(self, ptr):
            self.ptr = ptr

        def untyped_storage(self):
            return types.SimpleNamespace(data_ptr=lambda: self.ptr)

        def record_stream(self, stream):  # PyTorch's own, which never reaches gcalloc
            calls.setdefault("record_stream", []).append(stream.cuda_stream)

    memory = types.SimpleNamespace(CUDAPluggableAllocator=PluggableAllocator,
                                   change_current_allocator=change_current_allocator)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(memory=memory, is_available=lambda: False,
                                                                  synchronize=lambda: None), Tensor=Tensor,
                                       __file__=torch_file)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    gcalloc.torch.install("max_split_size_mb:64", backend="sim:capacity=2GiB")
    assert gcalloc.torch.raises() == os.path.join(os.path.dirname(torch_file), "lib", "libc10.so")
    # Called here through ctypes, which no C++ exception may cross: the raiser disconnected, as where
    # the functions are handed to PyTorch by hand (out of memory returns NULL then).
    lib.gca_torch_set_raise(None)
    assert calls["names"] == ("gca_torch_malloc", "gca_torch_free")
    assert isinstance(calls["installed"], PluggableAllocator)
    alloc, free = calls["alloc"], calls["free"]
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    p = alloc(100 * MiB, 0, None)
    assert p
    s = gcalloc.memory_stats()
    assert s["allocated_bytes.all.current"] == 100 * MiB
    assert s["oversize_allocations.current"] == 1  # max_split_size_mb:64 applied
    assert "max_split_size_mb:64" in gcalloc.memory_snapshot()["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"]
    free(p, 100 * MiB, 0, None)
    assert gcalloc.memory_stats()["allocated_bytes.all.current"] == 0
    assert gcalloc.memory_stats()["active_bytes.all.current"] == 0
    # Tensor.record_stream reaches gcalloc too: the block freed after a use
    # on stream 7 stays active (its free waits for the stream's event) until
    # the next allocation completes it.
    p = alloc(100 * MiB, 0, None)
    fake_torch.Tensor(p).record_stream(types.SimpleNamespace(cuda_stream=7))
    fake_torch.Tensor(0).record_stream(types.SimpleNamespace(cuda_stream=7))  # no storage: not gcalloc's business
    assert calls["record_stream"] == [7, 7]  # PyTorch's own still called
    free(p, 100 * MiB, 0, None)
    s = gcalloc.memory_stats()
    assert (s["allocated_bytes.all.current"], s["active_bytes.all.current"]) == (0, 100 * MiB)
    free(alloc(MiB, 0, None), MiB, 0, None)
    assert gcalloc.memory_stats()["active_bytes.all.current"] == 0
    # Out of memory: NULL back to PyTorch (and the message logged, and kept
    # for any thread: autograd allocates on threads of its own).
    assert gcalloc.torch.last_failure() == ""
    failed = []
    worker = threading.Thread(target=lambda: failed.append(alloc(3 << 30, 0, None)))
    worker.start()
    worker.join()
    assert failed == [None]
    assert "out of memory. Tried to allocate 3.00 GiB" in gcalloc.torch.last_failure()
    assert not alloc(3 << 30, 0, None)
    gcalloc.set_per_process_memory_fraction(0.5)
    assert not alloc(1500 * MiB, 0, None)
    gcalloc.reset_peak_memory_stats()
    gcalloc.empty_cache()
    assert gcalloc.memory_stats()["reserved_bytes.all.current"] == 0
    # Already open on the sim: another backend is refused, settings apply.
    with pytest.raises(gcalloc.GcallocError, match="already open"):
        gcalloc.torch.install(backend="cuda")
    with gcalloc.torch.using("garbage_collection_threshold:0.8"):
        p = alloc(MiB, 0, None)
        free(p, MiB, 0, None)
    assert "garbage_collection_threshold:0.8" in gcalloc.memory_snapshot()["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"]
    # PyTorch's allocations inside gcalloc.torch.pool(name) go to that pool.
    with gcalloc.torch.pool("kv") as kv:
        p = alloc(MiB, 0, None)
    with gcalloc.torch.pool("kv") as again:
        q = alloc(MiB, 0, None)
    r = alloc(MiB, 0, None)
    process = gcalloc._process_allocator()
    assert kv == again and [process.pool_of(x) for x in (p, q, r)] == [kv, kv, 0]
    snapshot = gcalloc.memory_snapshot()
    assert [kv, 0] in [seg["segment_pool_id"] for seg in snapshot["segments"]]
    # Sleep mode: the pool's memory goes back and comes again at the same addresses.
    reserved = gcalloc.memory_stats()["reserved_bytes.all.current"]
    released = gcalloc.torch.pause("kv")
    assert released > 0 and gcalloc.memory_stats()["reserved_bytes.all.current"] == reserved - released
    assert process.pool_stats(kv)["paused"] == 1
    gcalloc.torch.resume("kv")
    assert gcalloc.memory_stats()["reserved_bytes.all.current"] == reserved
    assert [process.pool_of(x) for x in (p, q)] == [kv, kv]
    with pytest.raises(KeyError, match="no pool named 'nothing'"):
        gcalloc.torch.pause("nothing")
    with pytest.raises(ValueError, match="device 'x' is not a device"):
        gcalloc.torch.pause("kv", device="x")
    with pytest.raises(TypeError, match="device must be an int, not float"):
        gcalloc.torch.pause("kv", device=0.0)
    # Every pool at once (name None), and a name on every device it is on (device None).
    released = gcalloc.torch.pause()
    assert released > 0 and process.pool_stats(kv)["paused"] == 1
    assert gcalloc.torch.pause() == 0  # (nothing runs)
    gcalloc.torch.resume()
    assert process.pool_stats(kv)["paused"] == 0
    gcalloc.torch.pause("kv", device=None)
    gcalloc.torch.resume("kv", device=None, keep_backup=True)
    assert gcalloc.memory_stats()["reserved_bytes.all.current"] == reserved
    for name in (0, False, 0.0, b"kv"):  # (names are str: 0, False and 0.0 would be one pool)
        with pytest.raises(TypeError, match="a pool's name must be a str"):
            gcalloc.torch.pause(name)
    for x in (p, q, r):
        free(x, MiB, 0, None)
    lib.gca_torch_shutdown()


def test_private_pools():
    """Pools from Python: routing by thread (nested) and by stream, reuse inside, release refused then done,
    statistics, a capture."""
    with gcalloc.Allocator("sim:capacity=1GiB") as a:
        kv, other = a.create_pool(), a.create_pool()
        assert a.pools() == [kv, other]
        with a.pool(kv):
            p = a.malloc(4 * MiB)
            with a.pool(other):
                q = a.malloc(MiB)
            r = a.malloc(MiB)
        s = a.malloc(MiB)
        assert [a.pool_of(x) for x in (p, q, r, s)] == [kv, other, kv, 0]
        stats = a.pool_stats(kv)
        assert (stats["allocations"], stats["allocated_bytes"], stats["segments"]) == (2, 5 * MiB, 2)  # large, small
        with pytest.raises(gcalloc.GcallocError, match="2 blocks .* of it are live"):
            a.release_pool(kv)
        for x in (p, r):
            a.free(x)
        with a.pool(kv):
            assert a.malloc(4 * MiB) == p  # its own block again
        a.free(p)
        a.route_stream(other, 7)
        t = a.malloc(MiB, stream=7)
        assert a.pool_of(t) == other
        a.unroute_stream(other, 7)
        with a.capture(other, 9):
            u = a.malloc(MiB, stream=9)
            with pytest.raises(gcalloc.GcallocError, match="captured into a graph"):
                a.empty_cache()
        assert a.pool_of(u) == other
        for x in (q, s, t, u):
            a.free(x)
        a.release_pool(kv)
        a.release_pool(other)
        assert a.pools() == []
        with pytest.raises(gcalloc.GcallocError, match="was released"):
            a.pool_stats(kv)
        with pytest.raises(OverflowError):
            a.release_pool(1 << 64)
        a.empty_cache()
        assert a.memory_stats()["reserved_bytes.all.current"] == 0
        # A pausable pool: its memory given back and taken again, at the same addresses.
        sleepy = a.create_pool(pausable=True)
        with a.pool(sleepy):
            p = a.malloc(8 * MiB)
        released = a.pause_pool(sleepy, backup=True)
        assert released >= 8 * MiB and a.pool_stats(sleepy)["backup_bytes"] == 8 * MiB
        with pytest.raises(gcalloc.GcallocError, match="paused already"):
            a.pause_pool(sleepy)
        with pytest.raises(gcalloc.GcallocError, match="it is paused"):
            with a.pool(sleepy):
                a.malloc(MiB)
        a.resume_pool(sleepy)
        assert a.pool_of(p) == sleepy and a.pool_stats(sleepy)["paused"] == 0
        a.free(p)
        a.release_pool(sleepy)


def test_pause_every_pool_and_read_copies():
    """pause_pools / resume_pools over devices, and a paused block's copy read in place."""
    import ctypes

    with gcalloc.Allocator("sim:backed=1,devices=2,capacity=256MiB") as a:
        p0, p1, plain = a.create_pool(0, pausable=True), a.create_pool(1, pausable=True), a.create_pool(0)
        with a.pool(p0):
            x = a.malloc(MiB, 0)
        with a.pool(p1):
            y = a.malloc(MiB, 1)
        ctypes.memset(x, 0x5A, MiB)
        ctypes.memset(y, 0x3C, MiB)
        released = a.pause_pools(backup=True)
        assert released >= 2 * MiB and a.pool_stats(p0)["paused"] and a.pool_stats(p1)["paused"]
        assert not a.pool_stats(plain)["paused"]
        view = a.pool_backup(x + 10)
        assert len(view) == MiB - 10 and view.readonly and bytes(view[:4]) == b"\x5a" * 4
        assert bytes(a.pool_backup(y)[-2:]) == b"\x3c" * 2
        with pytest.raises(gcalloc.GcallocError, match="has no host copy"):
            a.pool_backup(x + MiB + 4096)
        a.resume_pools(device=1)
        assert a.pool_stats(p0)["paused"] and not a.pool_stats(p1)["paused"]
        a.resume_pools()
        assert ctypes.string_at(x, 4) == b"\x5a" * 4 and ctypes.string_at(y, 4) == b"\x3c" * 4
        with pytest.raises(gcalloc.GcallocError, match="has no host copy"):
            a.pool_backup(x)  # (given back at resume)
        a.free(x)
        a.free(y)
        for p in (p0, p1, plain):
            a.release_pool(p)
