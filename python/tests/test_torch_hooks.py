"""gcalloc inside PyTorch's pluggable allocator, against the stand-in
`torch` of python/tests/standin (PyTorch's rules: hooks called only when
set, native memory functions raising under a pluggable allocator). Each
test runs in a child process of its own: a process installs once."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

import gcalloc

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
PRELUDE = """
import collections, ctypes, os, pickle, sys
import torch, gcalloc, gcalloc.torch
MiB = 1 << 20
native = None
def install(conf=None):
    global native
    gcalloc.torch.install(conf, backend="sim:devices=2,capacity=4GiB")
    native = torch._C._current()
"""


_torch_root = []


def torch_with_libc10():
    """A copy of the stand-in torch as a PyTorch wheel has it, with lib/libc10.so (the build's C++
    tests/fake_c10.cpp) and include/ (tests/fake_torch_include): the folder to put first on the path,
    made once for the module, with gcalloc's cache (the built raiser) in it."""
    fake, include = os.environ.get("GCALLOC_TEST_FAKE_C10"), os.environ.get("GCALLOC_TEST_FAKE_TORCH_INCLUDE")
    if not fake or not include:
        pytest.skip("GCALLOC_TEST_FAKE_C10 and GCALLOC_TEST_FAKE_TORCH_INCLUDE are not set (CTest sets them)")
    if not _torch_root:
        root = tempfile.mkdtemp(prefix="gcalloc-torch-")
        atexit.register(shutil.rmtree, root, True)
        shutil.copytree(os.path.join(STANDIN, "torch"), os.path.join(root, "torch"))
        os.mkdir(os.path.join(root, "torch", "lib"))
        os.symlink(os.path.abspath(fake), os.path.join(root, "torch", "lib", "libc10.so"))
        os.symlink(os.path.abspath(include), os.path.join(root, "torch", "include"))
        _torch_root.append(root)
    return _torch_root[0]


def child_environment(first=None, env=None):
    """A child's environment: the stand-in torch of torch_with_libc10() (or the folders `first`) first on
    its path, then the stand-ins and the package; gcalloc's library and cache; `env` on top."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(gcalloc.__file__)))
    if first is None:
        first = [torch_with_libc10()]
    cache = os.path.join(torch_with_libc10(), "cache")
    environment = dict(os.environ, GCALLOC_LIBRARY=gcalloc.library_path, GCALLOC_CACHE_DIR=cache)
    environment.update(env or {})
    environment["PYTHONPATH"] = os.pathsep.join([*first, STANDIN, package, os.environ.get("PYTHONPATH", "")])
    return environment


def run(code, first=None, env=None):
    """Run `code` after PRELUDE in a child process, with the stand-in torch of torch_with_libc10() unless
    `first` names the folders to put first on the path instead; `env` on top of the environment."""
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=child_environment(first, env),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_the_standin_is_strict_without_gcalloc():
    """The control: a pluggable allocator alone loses PyTorch's memory functions, as in PyTorch."""
    run("""
        a = torch.cuda.memory.CUDAPluggableAllocator(gcalloc.library_path, "gca_torch_malloc", "gca_torch_free")
        torch.cuda.memory.change_current_allocator(a)
        for call in (torch.cuda.memory_stats, torch.cuda.memory_allocated, torch.cuda.max_memory_reserved,
                     torch.cuda.reset_peak_memory_stats, torch.cuda.memory._snapshot,
                     torch.cuda.memory._record_memory_history):
            try:
                call()
            except RuntimeError as e:
                assert "does not yet support" in str(e), e
            else:
                raise AssertionError("%s did not raise" % call.__name__)
        torch.cuda.empty_cache()  # no reset hook: nothing happens
        assert a.allocator().calls == []
    """)


def test_every_hook_reaches_gcalloc():
    run("""
        install()
        assert gcalloc.torch.hooks() == ["set_reset_fn", "set_memory_fraction_fn", "set_record_stream_fn",
                                         "set_init_fn", "set_base_alloc_fn", "set_begin_allocate_to_pool",
                                         "set_end_allocate_to_pool_fn", "set_release_pool"], gcalloc.torch.hooks()
        torch.cuda._lazy_init()  # CUDA's initialization: the init hook with PyTorch's device count
        assert ("set_init_fn", (2,)) in native.calls
        # empty_cache: the reset hook gives gcalloc's cache back.
        t = torch.empty(30 * MiB, device="cuda:1")
        t.free()
        assert gcalloc.memory_reserved(1) > 0
        torch.cuda.empty_cache()
        assert gcalloc.memory_reserved(1) == 0
        # The fraction: PyTorch checks it, then the hook sets gcalloc's.
        torch.cuda.set_per_process_memory_fraction(0.5, 1)
        assert gcalloc.get_per_process_memory_fraction(1) == 0.5
        try:
            torch.cuda.set_per_process_memory_fraction(1.5, 1)
        except ValueError:
            pass
        else:
            raise AssertionError("PyTorch's own check did not refuse 1.5")
        # record_stream from C++ (c10d's process groups): the block's free waits for the stream.
        assert not getattr(torch.Tensor.record_stream, "_gcalloc", False)  # (no Python wrapper needed)
        t = torch.empty(10 * MiB, device="cuda:0")
        torch._C._record_stream_from_cpp(t.data_ptr(), 7)
        t.free()
        s = gcalloc.memory_stats(0)
        assert (s["allocated_bytes.all.current"], s["active_bytes.all.current"]) == (0, 10 * MiB)
        torch.empty(MiB).free()  # the next allocation completes the free
        assert gcalloc.memory_stats(0)["active_bytes.all.current"] == 0
        t = torch.empty(10 * MiB)
        t.record_stream(torch.cuda.Stream(9))  # the Python method goes through the same hook
        assert ("set_record_stream_fn", (t.data_ptr(), 9)) in native.calls
        t.free()
        # Base allocations (IPC, storage sharing): the segment a block was carved from.
        a, b = torch.empty(1000), torch.empty(3000)
        assert torch._C._base_allocation(b.data_ptr()) == (a.data_ptr(), 2 * MiB)
        a.free(); b.free()
    """)


def test_init_hook_warns_when_pytorch_sees_more_devices():
    p = run("""
        torch._C.DEVICE_COUNT = 3
        install()
        torch.cuda._lazy_init()
        assert ("set_init_fn", (3,)) in native.calls
    """)
    assert "PyTorch sees 3 devices, gcalloc's sim backend 2" in p.stderr


def test_pytorchs_memory_functions_answer_from_gcalloc():
    run("""
        install()
        assert set(gcalloc.torch.routed()) >= {"memory_stats", "memory_stats_as_nested_dict", "memory_allocated",
            "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
            "reset_max_memory_allocated", "reset_accumulated_memory_stats", "memory_summary", "memory_snapshot",
            "mem_get_info", "_record_memory_history", "_snapshot", "_dump_snapshot"}, gcalloc.torch.routed()
        t = torch.empty(30 * MiB, device="cuda:1")
        stats = torch.cuda.memory_stats(1)
        assert isinstance(stats, collections.OrderedDict) and list(stats) == sorted(stats)
        assert stats == gcalloc.memory_stats(1) and len(stats) == 123
        assert torch.cuda.memory.memory_stats(torch.device("cuda", 1)) == stats
        assert torch.cuda.memory_stats_as_nested_dict(1)["allocated_bytes"]["all"]["current"] == 30 * MiB
        for device in (1, "cuda:1", torch.device("cuda:1")):
            assert torch.cuda.memory_allocated(device) == 30 * MiB == torch.cuda.max_memory_allocated(device)
            assert torch.cuda.memory_reserved(device) == stats["reserved_bytes.all.current"] > 0
            assert torch.cuda.max_memory_reserved(device) == stats["reserved_bytes.all.peak"]
        assert torch.cuda.memory_allocated() == 0  # the current device, 0
        t.free()
        torch.cuda.reset_peak_memory_stats(1)
        assert torch.cuda.max_memory_allocated(1) == 0
        torch.cuda.reset_accumulated_memory_stats(1)
        assert torch.cuda.memory_stats(1)["allocated_bytes.all.allocated"] == 0
        assert torch.cuda.mem_get_info(1) == gcalloc.mem_get_info(1) and torch.cuda.mem_get_info(1)[1] == 4 << 30
        assert torch.cuda.memory_summary(1) == gcalloc.memory_summary(1)
        # History and snapshots, in PyTorch's forms.
        torch.cuda.memory._record_memory_history(max_entries=1000)
        t = torch.empty(5 * MiB)
        snapshot = torch.cuda.memory._snapshot()
        allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
        assert [e["size"] for e in allocs] == [5 * MiB], snapshot["device_traces"][0]
        assert isinstance(torch.cuda.memory_snapshot(), list)
        assert any(b["size"] == 5 * MiB for s in torch.cuda.memory_snapshot() for b in s["blocks"])
        path = "snap.pickle"
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            assert "device_traces" in pickle.load(f)
        os.unlink(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        t.free()
        torch.empty(MiB).free()
        actions = [e["action"] for e in torch.cuda.memory._snapshot()["device_traces"][0]]
        assert actions.count("alloc") == 1 and "free_requested" not in actions, actions  # (stopped: nothing new)
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100)  # PyTorch 2.0's form
        torch.cuda.memory._record_memory_history()  # PyTorch's default: no limit (gcalloc keeps 100,000)
        torch.cuda.memory._record_memory_history(False)
        # What no pluggable allocator can route: cuDNN's workspace query, from C++.
        try:
            torch._C._cuda_cacheInfo(0)
        except RuntimeError as e:
            assert "cacheInfo" in str(e)
        else:
            raise AssertionError("cacheInfo answered")
    """)


def test_install_after_pytorch_allocated_is_refused():
    p = run("""
        torch.empty(MiB).free()  # PyTorch's own allocator is in use now
        try:
            install()
        except RuntimeError as e:
            print(e)
        else:
            raise AssertionError("installed over a used allocator")
        assert not gcalloc.torch.installed() and gcalloc.torch.routed() == []
    """)
    assert "Can't swap an already initialized allocator" in p.stdout


OOM = """
    install()
    kept = torch.empty(1 << 30)
    big = None
    try:
        big = torch.empty(8 << 30)  # the sim device has 4 GiB
    except RuntimeError as e:
        print("raised %s:" % type(e).__name__, e)
"""


def test_without_a_raiser_pytorch_gets_null():
    """The rule the raiser is for: PyTorch does not check a pluggable allocator's NULL, and the first
    kernel writing the tensor ends the process's CUDA context (gcalloc's functions handed over by hand)."""
    p = run("""
    assert gcalloc._lib.gca_torch_init(b"sim:capacity=4GiB", None) == 0
    a = torch.cuda.memory.CUDAPluggableAllocator(gcalloc.library_path, "gca_torch_malloc", "gca_torch_free")
    torch.cuda.memory.change_current_allocator(a)
    big = torch.empty(8 << 30)
    assert gcalloc.torch.raises() is None
    assert big is not None and big.data_ptr() == 0
    try:
        big.fill_(1)
    except torch.AcceleratorError as e:
        assert "illegal memory access" in str(e)
    else:
        raise AssertionError("no illegal memory access")
    """)
    assert "PyTorch allocation on device 0 failed: out of memory" in p.stderr, p.stderr


def install_refused(**run_args):
    """What install() said refusing, in a child run as run(code, **run_args) runs it; it opened nothing."""
    return run("""
    try:
        install()
    except gcalloc.GcallocError as e:
        print("refused:", e)
    else:
        raise AssertionError("installed")
    assert not gcalloc.torch.installed() and not gcalloc._lib.gca_torch_is_open()
    """, **run_args).stdout


def test_install_refuses_where_nothing_can_raise():
    """A torch without lib/libc10.so: install() refuses before it opens anything, rather than let an
    out-of-memory become an illegal memory access."""
    said = install_refused(first=[])
    assert "no way to refuse PyTorch an allocation: " in said and "lacks c10::detail::torchCheckFail" in said


def test_out_of_memory_raises_torch_out_of_memory_error():
    """The raiser of c10::OutOfMemoryError, built at install() against the running PyTorch's headers and
    libc10 (cached), makes out of memory torch.OutOfMemoryError; other refusals stay RuntimeError through
    libc10's torchCheckFail; the process goes on allocating."""
    p = run(OOM + """
    import warnings
    assert gcalloc.torch.raises() == os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    built = gcalloc.torch.raises_out_of_memory()
    assert built and built.startswith(os.environ["GCALLOC_CACHE_DIR"]), built
    assert big is None
    again = torch.empty(1 << 30)
    again.fill_(1)
    assert gcalloc.memory_stats(0)["allocated_bytes.all.current"] == 2 << 30
    assert gcalloc.torch.last_failure().startswith("out of memory. Tried to allocate 8.00 GiB")
    try:
        torch.empty(8 << 30)
    except torch.OutOfMemoryError as e:  # what training loops and batch-size finders catch
        assert isinstance(e, torch.cuda.OutOfMemoryError)
    try:  # a size of 2^63 bytes or more reaches gcalloc negative: raised too, not NULL
        torch.empty(1 << 63)
    except torch.OutOfMemoryError:
        raise AssertionError("a size no device holds is not out of memory")
    except RuntimeError as e:
        print("raised:", e)
    else:
        raise AssertionError("a size of 2^63 bytes did not raise")
    """)
    assert "raised OutOfMemoryError: gcalloc: CUDA out of memory. Tried to allocate 8.00 GiB" in p.stdout, p.stdout
    assert "cannot allocate 9223372036854775808 bytes: more than any device holds" in p.stdout, p.stdout
    assert "GcallocWarning" not in p.stderr, p.stderr


@pytest.mark.parametrize("case", ["chosen", "no compiler", "wrong ABI", "no headers"])
def test_out_of_memory_is_runtime_error_where_the_raiser_cannot_be_built(case, tmp_path):
    """Where the raiser of torch.OutOfMemoryError cannot be built, out of memory raises RuntimeError
    through libc10, with a warning naming why (none where GCALLOC_TORCH_BUILD_RAISER=0 chose it)."""
    env = {"GCALLOC_CACHE_DIR": str(tmp_path / "cache")}
    first = None
    if case == "chosen":
        env["GCALLOC_TORCH_BUILD_RAISER"] = "0"
    elif case == "no compiler":
        env["CXX"] = str(tmp_path / "no-such-compiler")
    else:
        shutil.copytree(os.path.join(torch_with_libc10(), "torch"), tmp_path / "torch", symlinks=True)
        if case == "wrong ABI":  # (code built with the other std::string ABI does not link to libc10)
            with open(tmp_path / "torch" / "_C.py", "a") as f:
                f.write("_GLIBCXX_USE_CXX11_ABI = False\n")
        else:
            os.unlink(tmp_path / "torch" / "include")
        first = [str(tmp_path)]
    p = run(OOM + """
    assert big is None and gcalloc.torch.raises_out_of_memory() is None
    assert gcalloc.torch.raises() == os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    """, first=first, env=env)
    assert "raised RuntimeError: gcalloc: CUDA out of memory. Tried to allocate 8.00 GiB" in p.stdout, p.stdout
    why = {"chosen": None, "no compiler": "failed: ", "wrong ABI": "failed: ",
           "no headers": "this PyTorch has no C++ headers"}[case]
    if why is None:
        assert "GcallocWarning" not in p.stderr, p.stderr
    else:
        assert "not torch.OutOfMemoryError: the raiser of that class is built at install() against PyTorch's " \
               "headers, and " in p.stderr and why in p.stderr, p.stderr


def test_a_bad_build_raiser_setting_is_refused():
    said = install_refused(env={"GCALLOC_TORCH_BUILD_RAISER": "yes"})
    assert "GCALLOC_TORCH_BUILD_RAISER='yes': expected 1" in said, said


def test_graph_hooks_of_pytorch_2_2_are_set():
    """PyTorch 2.1 and 2.2 name the capturing stream in their graph hooks: install() sets that form."""
    run("""
        install()
        assert gcalloc.torch.hooks()[-3:] == ["set_release_pool", "set_begin_allocate_stream_to_pool",
                                              "set_end_allocate_stream_to_pool_fn"], gcalloc.torch.hooks()
        s = 0x5000
        native._hook("set_begin_allocate_stream_to_pool", 0, s, torch._C._MempoolId(9, 0))
        t = native.malloc(2 * MiB, 0, s)  # (as a tensor allocated on the capturing stream)
        pools = [seg["segment_pool_id"] for seg in gcalloc.memory_snapshot()["segments"]]
        assert any(tuple(p) != (0, 0) for p in pools), pools
        native._hook("set_end_allocate_stream_to_pool_fn", 0, s)
        native.raw_delete(t)
        native.releasePool(0, 9, 0)
        assert all(tuple(seg["segment_pool_id"]) == (0, 0) for seg in gcalloc.memory_snapshot()["segments"])
    """, env={"GCALLOC_STANDIN_TORCH": "2.2"})


def test_install_after_cuda_initialized_refuses_clearly():
    """PyTorch keeps the allocator it has once CUDA is initialized: install() says so, and what to do, before
    it opens anything."""
    run("""
        torch.cuda.current_device()  # (CUDA's lazy initialization: the native allocator is initialized)
        try:
            gcalloc.torch.install(backend="sim")
        except gcalloc.GcallocError as e:
            assert "already initialized" in str(e) and "before the first CUDA call" in str(e), e
        else:
            raise AssertionError("installed after CUDA was initialized")
        assert not gcalloc.torch.installed()
        assert gcalloc._lib.gca_torch_is_open() == 0
    """)


def test_install_on_a_torch_without_cuda():
    """A CPU-only PyTorch has the Python class but no CUDA allocator behind it: a GcallocError naming it,
    and nothing left open."""
    run("""
        del torch._C._cuda_customAllocator
        try:
            gcalloc.torch.install(backend="sim")
        except gcalloc.GcallocError as e:
            assert "built without CUDA" in str(e), e
        else:
            raise AssertionError("installed on a PyTorch without CUDA")
        assert gcalloc._lib.gca_torch_is_open() == 0
    """)


def test_refused_swap_leaves_nothing_open():
    """Where PyTorch refuses the swap itself, install() raises GcallocError with PyTorch's reason and closes
    what it opened."""
    run("""
        def refuse(allocator):
            raise RuntimeError("Can't swap an already initialized allocator")
        torch._C._cuda_changeCurrentAllocator = refuse
        try:
            gcalloc.torch.install(backend="sim")
        except gcalloc.GcallocError as e:
            assert "Can't swap an already initialized allocator" in str(e), e
        else:
            raise AssertionError("the refusal did not reach the caller")
        assert gcalloc._lib.gca_torch_is_open() == 0
    """)


def test_accelerator_settings_and_history_arguments():
    """torch.accelerator's memory functions (PyTorch 2.9) answer from gcalloc; _set_allocator_settings
    configures gcalloc; the newer _record_memory_history and memory_snapshot arguments are honoured
    (clear_history) or refused by name."""
    run("""
        install()
        t = torch.empty(3 * MiB)
        assert torch.accelerator.memory_allocated(device_index=0) == gcalloc.memory_allocated(0) > 0
        assert torch.accelerator.memory_stats(0)["allocated_bytes.all.current"] == gcalloc.memory_allocated(0)
        torch.accelerator.reset_peak_memory_stats(0)
        torch.cuda.memory._set_allocator_settings("garbage_collection_threshold:0.7")
        assert gcalloc.memory_snapshot()["allocator_settings"]["garbage_collection_threshold"] == 0.7
        assert torch._C._native_settings == []  # (not the native allocator's, which nothing reads)
        try:
            torch.cuda.memory._set_allocator_settings("max_split_size_mb:banana")
        except gcalloc.GcallocError as e:
            assert "max_split_size_mb" in str(e), e
        else:
            raise AssertionError("a bad setting was accepted")
        torch.cuda.memory._record_memory_history(max_entries=1000)
        u = torch.empty(MiB)
        def entries():
            return sum(e["action"] == "alloc" for t in gcalloc.memory_snapshot()["device_traces"] for e in t)
        assert entries() >= 1
        torch.cuda.memory._record_memory_history(max_entries=1000)  # the same again: kept, as PyTorch keeps it
        assert entries() >= 1
        torch.cuda.memory._record_memory_history(max_entries=1000, clear_history=True)
        assert entries() == 0
        for bad in ({"skip_actions": ["free_requested"]}, {"compile_context": True}):
            try:
                torch.cuda.memory._record_memory_history(**bad)
            except gcalloc.GcallocError as e:
                assert list(bad)[0] in str(e), e
            else:
                raise AssertionError("%r was accepted" % bad)
        try:
            torch.cuda.memory_snapshot(mempool_id=(1, 0))
        except gcalloc.GcallocError as e:
            assert "mempool_id" in str(e), e
        else:
            raise AssertionError("memory_snapshot(mempool_id=) was accepted")
        assert isinstance(torch.cuda.memory_snapshot(), list)
        t.free(); u.free()
    """)
