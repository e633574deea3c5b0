"""gcalloc inside torch_npu's pluggable allocator, against the stand-in
`torch_npu` of python/tests/standin (torch_npu's rules: hooks called only
when set, memory functions warning or undefined under a pluggable allocator,
aclInit with its configuration at its lazy initialization, a task queue
drained by c10_npu::npuSynchronizeDevice in its libtorch_npu.so) on the
AscendCL stand-in. Each test runs in a child process of its own: a process
installs once."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import gcalloc

STANDINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")
STANDIN = os.path.join(STANDINS, "torch_npu")
PRELUDE = """
import ctypes, os, warnings
import torch_npu, gcalloc, gcalloc.torch_npu
from torch_npu import _C
MiB = 1 << 20
acl = ctypes.CDLL(os.environ["GCALLOC_ACL_LIBRARY"])
acl.fakeacl_init_config.restype = ctypes.c_char_p
acl.fakeacl_stale_work.restype = ctypes.c_size_t
acl.fakeacl_used.restype = ctypes.c_size_t
acl.fakeacl_set_capacity.argtypes = [ctypes.c_size_t]
acl.fakeacl_set_capacity(64 * MiB)
def alloc(size, device=0, stream=None):
    p = _C._malloc(size, device, stream)
    assert p, gcalloc.torch_npu.last_failure()
    return p
def free(p):
    _C._current_allocator().raw_delete(p)
def native():
    return _C._current_allocator()
"""


@pytest.fixture
def run(tmp_path):
    fake_acl = os.environ.get("GCALLOC_TEST_FAKE_ACL")
    fake_torch_npu = os.environ.get("GCALLOC_TEST_FAKE_TORCH_NPU")
    if not fake_acl or not fake_torch_npu:
        pytest.skip("GCALLOC_TEST_FAKE_ACL or GCALLOC_TEST_FAKE_TORCH_NPU is not set (CTest sets them)")
    # torch_npu as installed: the package, and its C++ library in lib/.
    package = tmp_path / "torch_npu"
    shutil.copytree(STANDIN, package)
    (package / "lib").mkdir()
    os.symlink(os.path.abspath(fake_torch_npu), package / "lib" / "libtorch_npu.so")
    gcalloc_dir = os.path.dirname(os.path.dirname(os.path.abspath(gcalloc.__file__)))

    def run_code(code, **env):
        full = dict(os.environ, GCALLOC_LIBRARY=gcalloc.library_path, GCALLOC_ACL_LIBRARY=fake_acl,
                    PYTHONPATH=os.pathsep.join([str(tmp_path), STANDINS, gcalloc_dir, os.environ.get("PYTHONPATH", "")]))
        for name in ("GCALLOC_TORCH_BACKEND", "GCALLOC_ALLOC_CONF", "MINDTORCH_NPU_ALLOC_CONF",
                     "PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE", "FAKEACL_DEVICES"):
            full.pop(name, None)
        full.update(env)
        p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=full, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        return p

    run_code.package = package
    return run_code


def test_the_standin_is_strict_without_gcalloc(run):
    """The control: a pluggable allocator alone loses torch_npu's memory functions, as in torch_npu."""
    run("""
        a = torch_npu.npu.memory.NPUPluggableAllocator(gcalloc.library_path, "gca_npu_malloc", "gca_npu_free")
        torch_npu.npu.memory.change_current_allocator(a)
        try:
            torch_npu.npu.memory_stats()
        except RuntimeError as e:
            assert "undefined behaviour" in str(e), e
        else:
            raise AssertionError("memory_stats did not fail")
        torch_npu.npu.empty_cache()  # no reset hook: nothing happens
        assert a.allocator().calls == []
    """)


def test_every_hook_reaches_gcalloc(run):
    run("""
        gcalloc.torch_npu.install("garbage_collection_threshold:0.9")
        assert gcalloc.torch_npu.hooks() == [h for h, _ in gcalloc.torch_npu.HOOKS], gcalloc.torch_npu.hooks()
        assert acl.fakeacl_init_config() == b""  # gcalloc opened nothing yet
        p = alloc(30 * MiB, 1)  # torch_npu's lazy init first: its aclInit with its configuration
        assert acl.fakeacl_init_config() == _C.ACL_CONFIG.encode(), acl.fakeacl_init_config()
        # (gcalloc's own aclInit came second: ACL_ERROR_REPEAT_INITIALIZE, and torch_npu's configuration stands)
        assert ("set_init_fn", (2,)) in native().calls
        free(p)
        # empty_cache: the reset hook gives gcalloc's cache back.
        assert gcalloc.memory_reserved(1) > 0
        torch_npu.npu.empty_cache()
        assert ("set_reset_fn", (True,)) in native().calls
        assert gcalloc.memory_reserved(1) == 0
        # The fraction: torch_npu checks it, then the hook sets gcalloc's.
        torch_npu.npu.set_per_process_memory_fraction(0.5, 1)
        assert gcalloc.get_per_process_memory_fraction(1) == 0.5
        # record_stream from C++ (HCCL's process groups): the free waits for the stream; erase_stream undoes it.
        acl.fakeacl_hold_events(1)  # (work on the stream stays pending)
        p = alloc(10 * MiB)
        native().recordStream(p, 7)
        free(p)
        assert gcalloc.memory_stats(0)["active_bytes.all.current"] > 10 * MiB  # (10 MiB and the pad, rounded)
        acl.fakeacl_complete_events()
        free(alloc(MiB))  # the next allocation completes the free
        assert gcalloc.memory_stats(0)["active_bytes.all.current"] == 0
        p = alloc(10 * MiB)
        native().recordStream(p, 7)
        native().eraseStream(p, 7)
        free(p)
        assert gcalloc.memory_stats(0)["active_bytes.all.current"] == 0
        acl.fakeacl_hold_events(0)
        # Base allocations: the segment a block was carved from.
        a, b = alloc(1000), alloc(3000)
        assert native().getBaseAllocation(b) == (a, 2 * MiB)
        free(a); free(b)
        # The configuration given to install() applied at the open.
        assert "garbage_collection_threshold:0.9" in gcalloc.memory_snapshot()["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"]
    """)


def test_memory_functions_answer_from_gcalloc(run):
    run("""
        gcalloc.torch_npu.install()
        assert set(gcalloc.torch_npu.routed()) >= {"memory_stats", "memory_allocated", "reset_peak_memory_stats"}
        p = alloc(5 * MiB)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch_npu's "does not yet support" would be an error here
            s = torch_npu.npu.memory_stats()
            assert s["requested_bytes.all.current"] == 5 * MiB
            assert torch_npu.npu.memory_allocated(0) == s["allocated_bytes.all.current"]
            assert torch_npu.npu.memory.max_memory_reserved(0) == s["reserved_bytes.all.peak"]
            free(p)
            torch_npu.npu.reset_peak_memory_stats(0)
            assert torch_npu.npu.max_memory_allocated(0) == 0
    """)


def test_initialization_order_with_a_bad_configuration(run):
    """install() checks the configuration at once, though it opens nothing."""
    p = run("""
        try:
            gcalloc.torch_npu.install("max_split_size_mb:banana")
        except gcalloc.GcallocError as e:
            assert "max_split_size_mb" in str(e), e
        else:
            raise AssertionError("a bad configuration was accepted")
        assert acl.fakeacl_calls(b"aclInit") == 0
    """)
    assert p.returncode == 0


def use_release_form(run, form):
    """The stand-in torch_npu's library of the releases whose stream hooks take the stream object
    ("object", the default) or a handle ("handle": tests/fake_torch_npu.cpp's older form)."""
    if form == "handle":
        handles = os.environ.get("GCALLOC_TEST_FAKE_TORCH_NPU_HANDLES")
        if not handles:
            pytest.skip("GCALLOC_TEST_FAKE_TORCH_NPU_HANDLES is not set (CTest sets it)")
        os.remove(run.package / "lib" / "libtorch_npu.so")
        os.symlink(os.path.abspath(handles), run.package / "lib" / "libtorch_npu.so")


STREAMS = """
        lib = ctypes.CDLL(str(_C._torch_npu_lib()._name))
        lib.fake_torch_npu_stream_handle.restype = ctypes.c_void_p
        lib.fake_torch_npu_stream_handle.argtypes = [ctypes.c_int, ctypes.c_int64]
        acl.fakeacl_complete_stream.argtypes = [ctypes.c_void_p]
        acl.fakeacl_bad_streams.restype = ctypes.c_ulong
        def handle(stream):
            return lib.fake_torch_npu_stream_handle(0, stream)
"""


@pytest.mark.parametrize("form", ["object", "handle"])
def test_stream_hooks_take_the_releases_form(run, form):
    """torch_npu's releases pass the record- and erase-stream hooks either its NPUStream object (by
    address: it has a user-provided destructor) or an aclrtStream; install() sets the hooks of the form
    the running one takes, and the use reaches the runtime's stream (the AscendCL stand-in refuses any
    handle it did not create)."""
    use_release_form(run, form)
    run(STREAMS + """
        gcalloc.torch_npu.install()
        assert gcalloc.torch_npu.stream_form() == %r
        acl.fakeacl_hold_events(1)
        p = alloc(10 * MiB)
        native().recordStream(p, 3)  # (HCCL's, from C++)
        free(p)
        acl.fakeacl_complete_stream(handle(2))  # another stream's work: the free still waits
        free(alloc(MiB))
        assert gcalloc.memory_stats(0)["active_bytes.all.current"] > 10 * MiB
        acl.fakeacl_complete_stream(handle(3))
        free(alloc(MiB))
        assert gcalloc.memory_stats(0)["active_bytes.all.current"] == 0
        p = alloc(10 * MiB)
        native().recordStream(p, 3)
        native().eraseStream(p, 3)
        free(p)
        assert gcalloc.memory_stats(0)["active_bytes.all.current"] == 0
        assert acl.fakeacl_bad_streams() == 0
    """ % form)


@pytest.mark.parametrize("form", ["object", "handle"])
def test_workspaces_give_way_before_out_of_memory(run, form):
    """torch_npu's operator workspaces are cached beside gcalloc: an allocation the device cannot serve
    while they hold memory succeeds once gcalloc empties them, through the release's emptyCache."""
    use_release_form(run, form)
    run("""
        gcalloc.torch_npu.install()
        assert gcalloc.torch_npu.workspace_release() == %d
        lib = ctypes.CDLL(str(_C._torch_npu_lib()._name))
        lib.fake_torch_npu_workspace.restype = ctypes.c_void_p
        lib.fake_torch_npu_workspace.argtypes = [ctypes.c_int, ctypes.c_size_t]
        lib.fake_torch_npu_workspace_bytes.restype = ctypes.c_size_t
        p = alloc(MiB)  # (torch_npu's lazy initialization: the thread's device)
        assert lib.fake_torch_npu_workspace(0, 40 * MiB)
        q = alloc(40 * MiB)  # 40 + 40 > 64 MiB: the workspace goes back first
        assert lib.fake_torch_npu_workspace_bytes(0) == 0
        free(q); free(p)
    """ % (3 if form == "object" else 2))


def test_stream_form_unknown_wraps_record_stream(run):
    """A libtorch_npu.so that exports neither form of the setter: the stream hooks stay unset, and
    install() says so."""
    os.remove(run.package / "lib" / "libtorch_npu.so")
    os.symlink(os.environ["GCALLOC_TEST_FAKE_ACL"], run.package / "lib" / "libtorch_npu.so")
    run("""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gcalloc.torch_npu.install()
        assert gcalloc.torch_npu.stream_form() is None
        assert "set_record_stream_fn" not in gcalloc.torch_npu.hooks()
        assert "set_erase_stream_fn" not in gcalloc.torch_npu.hooks()
        said = [str(w.message) for w in caught if issubclass(w.category, gcalloc.GcallocWarning)]
        assert any("neither form" in m and "MULTI_STREAM_MEMORY_REUSE=0" in m for m in said), said
    """, TASK_QUEUE_ENABLE="0")


def test_record_stream_on_foreign_memory_is_quiet(run):
    """As torch_npu's own allocator: record_stream on an empty tensor (NULL) or on memory gcalloc did not
    make returns quietly; gcalloc counts them."""
    p = run("""
        gcalloc.torch_npu.install()
        p = alloc(MiB)
        before = gcalloc.torch_npu.foreign_stream_uses()
        native().recordStream(0, 1)
        native().recordStream(0x1000, 1)
        native().eraseStream(0x1000, 1)
        native().recordStream(p + 512, 1)  # (inside a block: not a pointer gcalloc gave)
        assert gcalloc.torch_npu.foreign_stream_uses() - before == 4
        free(p)
    """)
    assert "error" not in p.stderr, p.stderr


QUEUED = """
        gcalloc.torch_npu.install()
        p = alloc(40 * MiB)
        _C._enqueue(p, 4096)         # an operator on p, still in the host queue
        free(p)                      # torch_npu frees right after enqueueing
        q = alloc(50 * MiB)          # 40 + 50 > 64 MiB: the ladder gives p's segment back
        free(q)
        torch_npu.npu.synchronize()  # the queue runs
"""


def test_queue_drained_before_memory_goes_back(run):
    run(QUEUED + """
        assert gcalloc.torch_npu.queue_drain().endswith("libtorch_npu.so")
        lib = ctypes.CDLL(gcalloc.torch_npu.queue_drain())
        assert lib.fake_torch_npu_drains() >= 2  # the ladder's, then the user's
        assert acl.fakeacl_stale_work() == 0
    """)


def test_queue_not_drained_is_the_hazard(run):
    """The control: with the drain gone (the queue off, as the message says, but operators still queued
    here), the operator writes memory the runtime took back."""
    os.remove(run.package / "lib" / "libtorch_npu.so")
    run("""
        try:
            gcalloc.torch_npu.install()
        except gcalloc.GcallocError as e:
            assert "TASK_QUEUE_ENABLE=1 (the default)" in str(e) and "npuSynchronizeDevice" in str(e), e
        else:
            raise AssertionError("installed with the task queue on and no drain")
    """)
    run(QUEUED.replace("torch_npu.npu.synchronize()", "acl.fakeacl_run_queue()") + """
        assert gcalloc.torch_npu.queue_drain() is None
        assert acl.fakeacl_stale_work() == 1
    """, TASK_QUEUE_ENABLE="0")


def test_configuration_and_failures(run):
    """An NPU variable read on acl, oversize blocks, a failed allocation's message for any thread, using(),
    and an Allocator of its own beside the drop-in."""
    run("""
        os.environ["PYTORCH_NPU_ALLOC_CONF"] = "max_split_size_mb:64"  # read at the open, on acl
        acl.fakeacl_set_capacity(1 << 30)
        gcalloc.torch_npu.install()
        p = alloc(100 * MiB, 1)
        ctypes.memset(p, 1, 100 * MiB)  # the stand-in's memory is real
        s = gcalloc.memory_stats(1)
        assert s["requested_bytes.all.current"] == 100 * MiB
        # Oversize: the whole segment, 100 MiB and torch_npu's 32-byte pad rounded up to 2 MiB.
        assert (s["oversize_allocations.current"], s["allocated_bytes.all.current"]) == (1, 102 * MiB)
        free(p)
        assert not _C._malloc(1 << 40, 0, None)  # out of memory: NULL (torch_npu does not check), and why kept
        assert "out of memory" in gcalloc.torch_npu.last_failure()
        with gcalloc.torch_npu.using():
            free(alloc(MiB))
        assert gcalloc.memory_stats(0)["reserved_bytes.all.current"] == 0
        with gcalloc.Allocator("acl") as a:
            assert a.backend == "acl" and a.device_count == 2
            a.free(a.malloc(4096, device=1))
    """)
