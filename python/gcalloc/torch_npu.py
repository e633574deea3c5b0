"""gcalloc as PyTorch's allocator on Ascend NPUs, through torch_npu.

    import gcalloc.torch_npu
    gcalloc.torch_npu.install("expandable_segments:True")   # before the first NPU allocation
    ...
    torch.npu.memory_stats()    # gcalloc's, with torch_npu's keys

install() hands gcalloc's C functions gca_npu_malloc / gca_npu_free, which
have the signatures torch_npu loads, to
torch_npu.npu.memory.NPUPluggableAllocator, passes gcalloc's C function for
each optional hook the running torch_npu offers (HOOKS: its initialization,
empty_cache, the memory fraction, base allocations, record_stream and
erase_stream from Python and from C++, HCCL's included), makes it the
current allocator, and routes torch_npu's memory functions, which warn and
answer nothing (memory_stats is undefined behaviour) under a pluggable
allocator, to gcalloc (ROUTED). torch_npu accepts that only before its
allocator has been used, and offers no way back.

Three rules of torch_npu's own allocator are kept (docs/acl.md):
- The allocator opens at the first allocation (or torch_npu's
  initialization hook), not at install(): torch_npu calls aclInit with its
  configuration file at its lazy initialization, which a runtime initialized
  before refuses. The configuration is checked at install().
- torch_npu's task queue (TASK_QUEUE_ENABLE, on by default) launches
  operators after their memory was freed: its drain,
  c10_npu::npuSynchronizeDevice, found in torch_npu's libtorch_npu.so, runs
  before gcalloc gives memory back. Without it, install() refuses while the
  queue is on.
- The configuration is read from the first set of GCALLOC_ALLOC_CONF,
  MINDTORCH_NPU_ALLOC_CONF, PYTORCH_NPU_ALLOC_CONF, PYTORCH_ALLOC_CONF,
  PYTORCH_CUDA_ALLOC_CONF, then `conf` on top.

An allocation that fails is thrown into torch_npu through PyTorch's libc10,
as gcalloc.torch throws it (torch.OutOfMemoryError where its raiser could be
built, else RuntimeError); without libc10, torch_npu gets a NULL pointer and
gcalloc logs its message as an error. Either way the message is kept for
last_failure().
"""
import contextlib
import ctypes
import os
import warnings

from . import GCA_ERR_INVALID, GcallocError, GcallocWarning, _lib, _python_warnings, _text, library_path
from .torch import _connect_raise, _route_memory_functions, _set_hooks, _wrap_record_stream
from .torch import raises  # noqa: F401  (the same process-wide allocator)
from .torch import last_failure  # noqa: F401  (the same process-wide allocator)
from .torch import foreign_stream_uses  # noqa: F401  (the same process-wide allocator)

__all__ = ["install", "using", "installed", "hooks", "routed", "last_failure", "foreign_stream_uses", "raises",
           "queue_drain", "stream_form", "workspace_release",
           "HOOKS", "STREAM_HOOKS", "ROUTED"]

# NPUPluggableAllocator's hooks (torch_npu's Module.cpp casts each address
# to a C signature) and gcalloc's function for each (include/gcalloc.h).
# The record- and erase-stream hooks are those of STREAM_HOOKS the running
# torch_npu takes.
HOOKS = (("set_init_fn", "gca_npu_init"),
         ("set_reset_fn", "gca_npu_empty_cache"),
         ("set_memory_fraction_fn", "gca_torch_set_memory_fraction"),
         ("set_base_alloc_fn", "gca_torch_base_alloc"),
         ("set_record_stream_fn", "gca_torch_record_stream"),
         ("set_erase_stream_fn", "gca_npu_erase_stream"))

# The stream hooks' form differs between torch_npu releases: Module.cpp
# casts the address to void(void*, aclrtStream) in some and to
# void(void*, c10_npu::NPUStream) in others, where the NPUStream (a class
# with a user-provided destructor) arrives as the address of the caller's
# object. The setter's mangled name, exported by libtorch_npu.so, says
# which; the object form reads the stream with NPUStream::stream(bool).
STREAM_FORMS = (
    ("object", "_ZN5torch3npu21NPUPluggableAllocator21NPUPluggableAllocator20set_record_stream_fn"
               "ESt8functionIFvPvN7c10_npu9NPUStreamEEE"),
    ("handle", "_ZN5torch3npu21NPUPluggableAllocator21NPUPluggableAllocator20set_record_stream_fn"
               "ESt8functionIFvPvS4_EE"),
)
STREAM_ACCESSOR_SYMBOL = "_ZNK7c10_npu9NPUStream6streamEb"

# torch_npu's operator workspace cache (NPUWorkspaceAllocator: a block per
# stream, from the runtime directly, beside gcalloc): its emptyCache in the
# forms torch_npu's releases have, by the number of arguments. gcalloc calls
# it before an allocation fails for want of memory.
WORKSPACE_RELEASES = ((3, "_ZN7c10_npu21NPUWorkspaceAllocator10emptyCacheEibb"),  # (device, need_empty_queue, check_error)
                      (2, "_ZN7c10_npu21NPUWorkspaceAllocator10emptyCacheEib"),   # (device, check_error)
                      (1, "_ZN7c10_npu21NPUWorkspaceAllocator10emptyCacheEb"))    # (check_error)
STREAM_HOOKS = {
    "handle": (("set_record_stream_fn", "gca_torch_record_stream"), ("set_erase_stream_fn", "gca_npu_erase_stream")),
    "object": (("set_record_stream_fn", "gca_npu_record_stream_object"),
               ("set_erase_stream_fn", "gca_npu_erase_stream_object")),
}

# torch_npu's memory functions that warn "does not yet support" (or are
# undefined behaviour) under a pluggable allocator, answered by gcalloc, in
# torch_npu.npu and torch_npu.npu.memory wherever the running torch_npu
# has them.
ROUTED = ("memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "max_memory_allocated",
          "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached",
          "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
          "reset_accumulated_memory_stats", "memory_summary", "memory_snapshot",
          "_record_memory_history", "_snapshot", "_dump_snapshot")

# bool c10_npu::npuSynchronizeDevice(bool check_error): empties every stream's
# task queue, then synchronizes the thread's device (NPUStream.cpp).
DRAIN_SYMBOL = "_ZN7c10_npu20npuSynchronizeDeviceEb"

_installed = False
_hooks = []
_routed = []
_drain = [None]  # where the drain was found
_stream_form = [None]  # the form of the stream hooks set: "handle", "object" or None
_workspaces = [None]  # the number of arguments of the workspace cache's emptyCache connected, or None


def installed():
    return _installed


def hooks():
    """The pluggable allocator's hooks install() set (the running torch_npu's, of HOOKS)."""
    return list(_hooks)


def routed():
    """The names in torch_npu.npu and torch_npu.npu.memory install() routed to gcalloc."""
    return list(_routed)


def queue_drain():
    """The library whose npuSynchronizeDevice install() connected, or None."""
    return _drain[0]


def workspace_release():
    """How many arguments the NPUWorkspaceAllocator::emptyCache install()
    connected takes (3, 2 or 1: WORKSPACE_RELEASES), or None where the
    running torch_npu exports none: its operator workspaces then stay
    cached through gcalloc's out-of-memory."""
    return _workspaces[0]


def stream_form():
    """How the running torch_npu passes streams to the record- and
    erase-stream hooks install() set: "handle" (an aclrtStream), "object"
    (its NPUStream object), or None where it could not tell and
    Tensor.record_stream is wrapped instead."""
    return _stream_form[0]


def install(conf=None, backend=None):
    """Make gcalloc torch_npu's NPU allocator. `conf` is a configuration in
    PYTORCH_NPU_ALLOC_CONF's syntax; `backend` defaults to
    $GCALLOC_TORCH_BACKEND, else "acl" (AscendCL, found as libascendcl.so or
    $GCALLOC_ACL_LIBRARY)."""
    global _installed
    import torch_npu  # only here: the rest of the package works without it

    with _python_warnings():
        rc = _lib.gca_torch_defer(_text(backend or _default_backend(), "backend"), _text(conf, "conf"))
    if rc < 0:
        raise GcallocError(rc, _lib.gca_last_error().decode())
    if _installed:
        return
    library, where = _libtorch_npu(torch_npu)
    drain = _address(library, DRAIN_SYMBOL)
    if drain is None and _task_queue_on():
        raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch_npu.install: torch_npu's task queue is on "
                           "(TASK_QUEUE_ENABLE=%s) and its drain, c10_npu::npuSynchronizeDevice, is not in %s: "
                           "memory could go back to the NPU while queued operators still use it. Set "
                           "TASK_QUEUE_ENABLE=0 before torch_npu starts, or use a torch_npu that exports it"
                           % (os.environ.get("TASK_QUEUE_ENABLE", "1 (the default)"), where))
    form, accessor = _stream_form_of(library)
    stream_setters = [setter for setter, _ in STREAM_HOOKS["handle"]]
    hooks = [hook for hook in HOOKS if hook[0] not in stream_setters] + list(STREAM_HOOKS.get(form, ()))
    allocator = torch_npu.npu.memory.NPUPluggableAllocator(library_path, "gca_npu_malloc", "gca_npu_free")
    if accessor is not None:
        _lib.gca_npu_set_stream_accessor(ctypes.c_void_p(accessor))
    hooks_set = _set_hooks(allocator, hooks)
    torch_npu.npu.memory.change_current_allocator(allocator)
    if drain is not None:
        _lib.gca_npu_set_queue_drain(ctypes.c_void_p(drain))
        _drain[0] = where
    for arity, symbol in WORKSPACE_RELEASES:
        release = _address(library, symbol)
        if release is not None:
            _lib.gca_npu_set_workspace_release(ctypes.c_void_p(release), arity)
            _workspaces[0] = arity
            break
    _hooks[:] = hooks_set
    _stream_form[0] = form if "set_record_stream_fn" in hooks_set else None
    torch = _torch_of(torch_npu)
    _connect_raise(torch)
    if form is None:
        warnings.warn("gcalloc.torch_npu: %s exports neither form of NPUPluggableAllocator::set_record_stream_fn "
                      "(or not NPUStream::stream(bool)), so how this torch_npu passes streams to its hooks is "
                      "unknown: its record- and erase-stream hooks are left unset and Tensor.record_stream is "
                      "wrapped instead. record_stream from C++ (HCCL's collectives) is not seen: memory a "
                      "collective uses may be reused before it ends; set MULTI_STREAM_MEMORY_REUSE=0 for HCCL"
                      % where, GcallocWarning, stacklevel=2)
    if "set_record_stream_fn" not in hooks_set and torch is not None:
        _wrap_record_stream(torch, lambda t: getattr(t, "is_npu", False), _npu_stream_handle)
    modules = [torch_npu.npu.memory, torch_npu.npu]
    npu = getattr(torch, "npu", None) if torch is not None else None
    if npu is not None and npu is not torch_npu.npu:
        modules.append(npu)
    _routed[:] = _route_memory_functions(modules, ROUTED)
    _installed = True


def _default_backend():
    return os.environ.get("GCALLOC_TORCH_BACKEND") or "acl"


def _task_queue_on():
    return os.environ.get("TASK_QUEUE_ENABLE", "1").strip() not in ("0", "")


def _libtorch_npu(torch_npu):
    """torch_npu's libtorch_npu.so (ctypes, None where it does not load) and its path."""
    path = os.path.join(os.path.dirname(os.path.abspath(torch_npu.__file__)), "lib", "libtorch_npu.so")
    try:
        return ctypes.CDLL(path), path
    except OSError:
        return None, path


def _address(library, symbol):
    """The address of `symbol` in `library`, or None."""
    try:
        return ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value if library is not None else None
    except AttributeError:
        return None


def _stream_form_of(library):
    """The form of the running torch_npu's stream hooks (STREAM_FORMS) and,
    for "object", NPUStream::stream(bool)'s address; (None, None) where it
    cannot be told, or the object form's stream cannot be read."""
    for form, setter in STREAM_FORMS:
        if _address(library, setter) is None:
            continue
        if form == "handle":
            return form, None
        accessor = _address(library, STREAM_ACCESSOR_SYMBOL)
        return (form, accessor) if accessor is not None else (None, None)
    return None, None


def _torch_of(torch_npu):
    import sys

    return sys.modules.get("torch")


def _npu_stream_handle(stream):
    for name in ("npu_stream", "stream_handle"):
        handle = getattr(stream, name, None)
        if handle is not None:
            return handle
    raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch_npu: cannot find the aclrtStream of %r" % (stream,))


@contextlib.contextmanager
def using(conf=None, backend=None):
    """install() on entry; on exit, wait for the device and empty gcalloc's cache."""
    install(conf, backend)
    try:
        yield
    finally:
        import torch_npu

        synchronize = getattr(getattr(torch_npu, "npu", None), "synchronize", None)
        if synchronize:
            synchronize()
        _lib.gca_torch_empty_cache()
