"""gcalloc as PyTorch's CUDA allocator.

    import gcalloc.torch
    gcalloc.torch.install("expandable_segments:True")   # before the first CUDA allocation
    ...
    gcalloc.memory_stats()      # gcalloc's, with torch.cuda.memory_stats()'s keys

install() opens gcalloc's process-wide allocator (gca_torch_init) and hands
its C functions gca_torch_malloc / gca_torch_free to
torch.cuda.memory.CUDAPluggableAllocator, then makes it the current
allocator. It also wraps torch.Tensor.record_stream so that the use reaches
gcalloc: PyTorch's pluggable allocator drops record_stream unless a C++ hook
is set, which Python cannot do, and memory used on a side stream would then
be reused while that stream still works on it. PyTorch accepts that only before its allocator has been used, and
offers no way back: the context manager `using(conf)` installs on entry and
on exit waits for the device and empties gcalloc's cache, but PyTorch keeps
allocating through gcalloc afterwards.
"""
import contextlib
import threading

from . import GCA_ERR_INVALID, GcallocError, OutOfMemoryError, _device, _lib, _oom_error, _text, library_path

# The oldest PyTorch with torch.cuda.memory.CUDAPluggableAllocator.
MINIMUM_TORCH = "2.0"

__all__ = ["install", "using", "installed", "last_failure", "pool", "pause", "resume"]

_installed = False
_named_pools = {}  # (process allocator, name, device) -> pool id
_named_lock = threading.Lock()


def installed():
    return _installed


def install(conf=None, backend=None):
    """Make gcalloc PyTorch's CUDA allocator. `conf` is a configuration in
    PYTORCH_CUDA_ALLOC_CONF's syntax (on top of the environment's); `backend`
    defaults to $GCALLOC_TORCH_BACKEND, else "cuda"."""
    global _installed
    import torch  # only here: the rest of the package works without PyTorch

    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    if not hasattr(memory, "CUDAPluggableAllocator") or not hasattr(memory, "change_current_allocator"):
        raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.install needs PyTorch %s or newer "
                           "(torch.cuda.memory.CUDAPluggableAllocator); this is torch %s"
                           % (MINIMUM_TORCH, getattr(torch, "__version__", "of an unknown version")))
    _use_torch_oom_error(torch)
    rc = _lib.gca_torch_init(_text(backend), _text(conf))
    if rc < 0:
        raise GcallocError(rc, _lib.gca_last_error().decode())
    if _installed:
        return
    allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path, "gca_torch_malloc", "gca_torch_free")
    torch.cuda.memory.change_current_allocator(allocator)
    _wrap_record_stream(torch)
    _installed = True


def _use_torch_oom_error(torch):
    """From now on gcalloc's out-of-memory errors are torch.OutOfMemoryError
    too, so that code catching PyTorch's catches gcalloc's."""
    base = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if not isinstance(base, type) or not issubclass(base, BaseException) or issubclass(_oom_error[0], base):
        return

    class TorchOutOfMemoryError(OutOfMemoryError, base):
        """gcalloc.OutOfMemoryError that is also torch.OutOfMemoryError."""

    TorchOutOfMemoryError.__module__ = OutOfMemoryError.__module__
    _oom_error[0] = TorchOutOfMemoryError


def _wrap_record_stream(torch):
    """Tensor.record_stream(stream) also tells gcalloc, for the storage's
    block (what gcalloc handed out: the storage's start, not a view's).
    Callers in PyTorch's C++ (none on the paths of a single-process program)
    are not reached."""
    import ctypes

    original = torch.Tensor.record_stream
    if getattr(original, "_gcalloc", False):
        return

    def record_stream(self, stream):
        original(self, stream)
        ptr = self.untyped_storage().data_ptr()
        if self.is_cuda and ptr:
            _lib.gca_torch_record_stream(ctypes.c_void_p(ptr), ctypes.c_void_p(stream.cuda_stream))

    record_stream._gcalloc = True
    record_stream.__doc__ = original.__doc__
    torch.Tensor.record_stream = record_stream


def last_failure():
    """gcalloc's message for the last allocation it refused PyTorch, from any
    thread ("" if none). PyTorch does not check a pluggable allocator's NULL:
    out of memory then surfaces as "The tensor has a non-zero number of
    elements, but its data is not allocated yet", and this says why."""
    import ctypes

    n = _lib.gca_torch_last_failure(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    _lib.gca_torch_last_failure(buf, n + 1)
    return buf.value.decode()


@contextlib.contextmanager
def using(conf=None, backend=None):
    install(conf, backend)
    try:
        yield
    finally:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _lib.gca_torch_empty_cache()


def _current_device():
    try:
        import torch

        return torch.cuda.current_device()
    except Exception:  # (no CUDA here, or a stand-in without it)
        return 0


@contextlib.contextmanager
def pool(name, device=None):
    """Inside the block, PyTorch's allocations made on this thread go to
    gcalloc's private pool `name` on `device` (the current CUDA device by
    default), created at the first use of the name; blocks freed in it are
    reused only in it (docs/pools.md). Yields the pool's id."""
    from . import _process_allocator

    allocator, pool_id = _named(name, device, create=True)
    with allocator.pool(pool_id):
        yield pool_id


def _named(name, device, create):
    """The process allocator and the id of the pool `name` (made pausable where the device allows)."""
    from . import _process_allocator

    if not isinstance(name, str):
        raise TypeError("gcalloc: a pool's name must be a str, not %s" % type(name).__name__)
    device = _current_device() if device is None else _device(device)
    allocator = _process_allocator()
    key = (allocator._a, name, device)
    with _named_lock:
        pool_id = _named_pools.get(key)
        if pool_id is None:
            if not create:
                raise KeyError("gcalloc: no pool named %r on device %d" % (name, device))
            try:
                pool_id = allocator.create_pool(key[2], pausable=True)
            except GcallocError:  # (no virtual memory there: a pool that cannot pause)
                pool_id = allocator.create_pool(key[2])
            _named_pools[key] = pool_id
    return allocator, pool_id


def pause(name, backup=True, device=None):
    """Give the memory of pool `name` back to the device, keeping its addresses: PyTorch's tensors in it
    stay valid, to be used after resume(name). With backup, their contents are kept in pinned host memory
    and written back at resume; without, they are lost (for caches to be refilled). Returns the bytes
    given back. Synchronizes only the pool's own streams."""
    allocator, pool_id = _named(name, device, create=False)
    return allocator.pause_pool(pool_id, backup=backup)


def resume(name, device=None):
    """Map memory again under pool `name`'s addresses and restore what pause(name, backup=True) kept."""
    allocator, pool_id = _named(name, device, create=False)
    allocator.resume_pool(pool_id)
