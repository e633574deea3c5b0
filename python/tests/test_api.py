"""The Python API as a PyTorch user expects it: torch.cuda's memory and
device functions at module level, devices given as PyTorch gives them, and
PyTorch's error classes. Module-level functions run in a child process of
their own (the process-wide allocator opens once per process)."""
import os
import subprocess
import sys
import textwrap
import types

import pytest

import gcalloc

MiB = 1 << 20


def run_child(code, args=(), **env):
    """Run `code` (with `args` in sys.argv[1:]) in a new python3 with this package and library; its stdout."""
    environment = dict(os.environ, GCALLOC_LIBRARY=gcalloc.library_path,
                       PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(gcalloc.__file__))), **env)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=environment, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_errors_are_pytorchs_classes():
    with gcalloc.Allocator("sim:capacity=1GiB") as a:
        with pytest.raises(gcalloc.OutOfMemoryError, match="out of memory") as oom:
            a.malloc(2 << 30)
        assert isinstance(oom.value, RuntimeError) and isinstance(oom.value, MemoryError)
        assert oom.value.status == gcalloc.GCA_ERR_OOM
        with pytest.raises(gcalloc.OutOfMemoryError):
            a.host_malloc(1 << 60)
        for bad in (1.01, -0.5, float("inf")):
            with pytest.raises(ValueError, match="within \\[0, 1\\]"):
                a.set_per_process_memory_fraction(bad)
        with pytest.raises(gcalloc.GcallocError) as bad_pointer:
            a.free(12345)
        assert bad_pointer.value.status == gcalloc.GCA_ERR_BAD_POINTER
        a.free(None)  # as free(NULL): nothing
        a.free(0)
        a.host_free(None)
    with pytest.raises(gcalloc.GcallocError, match="closed") as closed:
        a.malloc(MiB)
    assert isinstance(closed.value, RuntimeError) and closed.value.status == gcalloc.GCA_ERR_INVALID


def test_devices_as_pytorch_gives_them():
    with gcalloc.Allocator("sim:devices=2,capacity=1GiB") as a:
        torch_device = types.SimpleNamespace(type="cuda", index=1)  # what the API reads of torch.device
        for device in (1, "cuda:1", "npu:1", torch_device):
            p = a.malloc(MiB, device=device)
            assert a.memory_stats(device)["allocated_bytes.all.current"] == MiB
            a.free(p)
        assert a.memory_stats("cuda")["allocated_bytes.all.current"] == 0  # no index: the current device (0)
        assert a.memory_stats(None) == a.memory_stats(0)
        for bad, error in (("cuda:x", ValueError), ("cpu", ValueError), (types.SimpleNamespace(type="cpu", index=0),
                                                                           ValueError), (1.0, TypeError),
                           (True, TypeError), (-1, ValueError), (2, gcalloc.GcallocError)):
            with pytest.raises(error):
                a.malloc(MiB, device=bad)


def test_device_api():
    with gcalloc.Allocator("sim:devices=2,capacity=3GiB") as a:
        assert a.mem_get_info(0) == (3 << 30, 3 << 30)
        p = a.malloc(100 * MiB)
        free, total = a.mem_get_info(0)
        assert total == 3 << 30 and free < total
        a.free(p)
        props = a.device_properties("cuda:1")
        assert props.name == "gcalloc sim device" and props.total_memory == 3 << 30
        assert props.multi_processor_count == 0 and (props.major, props.minor) == (0, 0)
        assert a.can_access_peer(0, 1) is False  # the sim has no peer access
        assert a.get_per_process_memory_fraction(0) == 1.0
        a.set_per_process_memory_fraction(0.25, 0)
        assert a.get_per_process_memory_fraction(0) == 0.25


def test_gcalloc_counters_agree_with_the_flat_statistics():
    """gcalloc_stats reads gca_stats_t whole: the fields it shares with the flat form must agree, so a
    layout out of step with the C struct fails here."""
    with gcalloc.Allocator("sim:capacity=1GiB", "cross_stream_reuse:True") as a:
        p = a.malloc(40 * MiB, stream=1)
        a.free(p)
        q = a.malloc(40 * MiB, stream=2)  # the segment cached for stream 1 moves to stream 2
        a.free(q)
        own = a.gcalloc_stats()
        assert own["num_cross_stream_reuses"] == 1
        assert set(own) == {"num_cross_stream_reuses", "num_device_free_failures", "num_gc_releases",
                            "num_alloc_waits", "num_oom_handler_retries", "num_pages_moved", "num_ipc_requests",
                            "num_ipc_peers_asked", "ipc_bytes_received", "num_ipc_timeouts", "num_avoidable_ooms",
                            "num_stitch_waits", "num_ipc_rounds", "ipc_outside_bytes"}
        import ctypes
        raw = gcalloc._Stats()
        with a._handle() as h:
            gcalloc._check(gcalloc._lib.gca_get_stats(h, 0, ctypes.byref(raw)))
        flat = a.memory_stats()
        assert raw.num_device_alloc == flat["num_device_alloc"] == 1
        assert raw.max_split_size == flat["max_split_size"]
        assert raw.reserved_bytes[0].peak == flat["reserved_bytes.all.peak"]


def test_module_level_functions():
    out = run_child("""
        import gcalloc
        MiB = 1 << 20
        a = gcalloc._process_allocator()
        p = a.malloc(30 * MiB, device=1)
        assert gcalloc.device_count() == 2
        assert gcalloc.memory_allocated("cuda:1") == 30 * MiB == gcalloc.max_memory_allocated(1)
        assert gcalloc.memory_reserved(1) == gcalloc.max_memory_reserved(1) > 0
        assert gcalloc.memory_allocated() == 0  # None: the current device, 0
        nested = gcalloc.memory_stats_as_nested_dict(1)
        assert nested["allocated_bytes"]["all"]["current"] == 30 * MiB
        assert nested["num_device_alloc"] == 1
        a.free(p)
        gcalloc.reset_max_memory_allocated(1)
        assert gcalloc.max_memory_allocated(1) == 0
        gcalloc.reset_accumulated_memory_stats(1)
        assert gcalloc.memory_stats(1)["allocated_bytes.all.allocated"] == 0
        free, total = gcalloc.mem_get_info(1)
        assert total == 2 << 30
        gcalloc.synchronize(1)
        gcalloc.empty_cache()
        assert gcalloc.memory_reserved(1) == 0
        gcalloc.set_per_process_memory_fraction(0.5, "cuda:1")
        assert gcalloc.get_per_process_memory_fraction(1) == 0.5
        assert gcalloc.get_device_properties(1).total_memory == 2 << 30
        assert gcalloc.can_device_access_peer(0, 1) is False
        assert gcalloc.gcalloc_stats(1)["num_alloc_waits"] == 0
        gcalloc.record_memory_history()
        q = a.malloc(MiB)
        actions = [e["action"] for e in gcalloc.memory_snapshot()["device_traces"][0]]
        assert "alloc" in actions, actions
        gcalloc.record_memory_history(None)
        a.free(q)
        assert "Active memory" in gcalloc.memory_summary(0) or "PyTorch" in gcalloc.memory_summary(0)
        assert gcalloc.host_memory_stats()["num_host_alloc"] == 0
        gcalloc.host_empty_cache()
        print("ok")
        """, GCALLOC_TORCH_BACKEND="sim:devices=2,capacity=2GiB")
    assert out.strip() == "ok"


def test_every_public_name_is_documented():
    for name in gcalloc.__all__:
        obj = getattr(gcalloc, name)
        if callable(obj):
            assert obj.__doc__, "%s has no docstring" % name


def test_python_m_gcalloc_runs_the_tool():
    from gcalloc.__main__ import tool_path
    if tool_path() is None:
        pytest.skip("no gcalloc tool installed with the package or on PATH")
    p = subprocess.run([sys.executable, "-m", "gcalloc", "version"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(gcalloc.__file__))))
    assert p.returncode == 0 and p.stdout.strip() == "gcalloc " + gcalloc.version()


def test_install_refuses_a_pytorch_without_the_pluggable_allocator(monkeypatch):
    """PyTorch 1.x has no CUDAPluggableAllocator: a clear error before anything is opened."""
    old = types.SimpleNamespace(__version__="1.13.1", cuda=types.SimpleNamespace(memory=types.SimpleNamespace()))
    monkeypatch.setitem(sys.modules, "torch", old)
    import gcalloc.torch
    with pytest.raises(gcalloc.GcallocError, match="needs PyTorch 2.0 or newer .* this is torch 1.13.1"):
        gcalloc.torch.install()
    assert not gcalloc.torch.installed()


def test_out_of_memory_is_torchs_once_installed(torch_file):
    out = run_child("""
        import sys, types, gcalloc, gcalloc.torch

        class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError
            pass

        class Pluggable:
            def __init__(self, path, alloc, free):
                pass

        memory = types.SimpleNamespace(CUDAPluggableAllocator=Pluggable, change_current_allocator=lambda a: None)
        sys.modules["torch"] = types.SimpleNamespace(
            __file__=sys.argv[1], OutOfMemoryError=OutOfMemoryError, Tensor=type("Tensor", (), {"record_stream": lambda self, s: None}),
            cuda=types.SimpleNamespace(memory=memory, OutOfMemoryError=OutOfMemoryError))
        gcalloc.torch.install(backend="sim:capacity=1GiB")
        try:
            gcalloc._process_allocator().malloc(2 << 30)
        except OutOfMemoryError as e:
            assert isinstance(e, gcalloc.OutOfMemoryError) and isinstance(e, MemoryError), type(e).__mro__
            print("torch's")
        """, args=[torch_file])
    assert out.strip() == "torch's"


def test_configuration_warnings_are_python_warnings(capfd):
    with pytest.warns(gcalloc.GcallocWarning, match="no_such_key") as caught:
        a = gcalloc.Allocator("sim", "no_such_key:1")
    assert caught[0].filename == __file__  # (pointing at the caller's line)
    with pytest.warns(gcalloc.GcallocWarning, match="another_key"):
        a.set_config("another_key:2")
    a.close()
    assert "no_such_key" not in capfd.readouterr().err  # (raised, not also printed)
    # Outside those calls the library's own log is as it was: nothing is kept for Python.
    assert getattr(gcalloc._collecting, "messages", None) is None


def test_peers_sharing_the_device():
    name = "gcalloc-peers-%d" % os.getpid()
    with gcalloc.Allocator("sim:shared=%s,capacity=1GiB" % name, "ipc_cooperation:True") as a:
        p = a.malloc(100 * MiB)
        import time
        deadline = time.monotonic() + 10  # (each process publishes its figures from a thread of its own)
        while True:
            peers = a.ipc_peers(0)
            assert [peer["pid"] for peer in peers] == [os.getpid()], peers
            if peers[0]["allocated_bytes"] == 100 * MiB or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert peers[0]["allocated_bytes"] == 100 * MiB and peers[0]["waiting_bytes"] == 0, peers
        assert {k: peers[0][k] for k in ("requests", "bytes_received", "bytes_released", "timeouts",
                                         "avoidable_ooms")} == dict.fromkeys(("requests", "bytes_received",
                                                                              "bytes_released", "timeouts",
                                                                              "avoidable_ooms"), 0), peers
        free, total = a.mem_get_info(0)
        assert total == 1 << 30 and free <= total - 100 * MiB
        assert a.gcalloc_stats(0)["num_avoidable_ooms"] == 0
        a.free(p)
    with gcalloc.Allocator("sim") as a, pytest.raises(gcalloc.GcallocError):
        a.ipc_peers(0)  # cooperation off
