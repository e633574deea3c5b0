"""gcalloc as PyTorch's allocator on Ascend NPUs, through torch_npu.

    import gcalloc.torch_npu
    gcalloc.torch_npu.install("expandable_segments:True")   # before the first NPU allocation
    ...
    gcalloc.memory_stats()      # gcalloc's, with torch.npu.memory_stats()'s keys

install() opens gcalloc's process-wide allocator on the "acl" backend
(gca_torch_init; $GCALLOC_TORCH_BACKEND or `backend` name another) and hands
its C functions gca_npu_malloc / gca_npu_free, which have the signatures
torch_npu loads, to torch_npu.npu.memory.NPUPluggableAllocator, then makes
it the current allocator. torch_npu accepts that only before its allocator
has been used, and offers no way back. The configuration is read from the
first set of GCALLOC_ALLOC_CONF, MINDTORCH_NPU_ALLOC_CONF,
PYTORCH_NPU_ALLOC_CONF, PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF, then
`conf` on top (docs/acl.md).
"""
import contextlib

from . import GcallocError, _lib, _python_warnings, _text, library_path
from .torch import last_failure  # noqa: F401  (the same process-wide allocator)

__all__ = ["install", "using", "installed", "last_failure"]

_installed = False


def installed():
    return _installed


def install(conf=None, backend=None):
    """Make gcalloc torch_npu's NPU allocator. `conf` is a configuration in
    PYTORCH_NPU_ALLOC_CONF's syntax; `backend` defaults to
    $GCALLOC_TORCH_BACKEND, else "acl" (AscendCL, found as libascendcl.so or
    $GCALLOC_ACL_LIBRARY)."""
    global _installed
    import torch_npu  # only here: the rest of the package works without it

    with _python_warnings():
        rc = _lib.gca_torch_init(_text(backend or _default_backend(), "backend"), _text(conf, "conf"))
    if rc < 0:
        raise GcallocError(rc, _lib.gca_last_error().decode())
    if _installed:
        return
    allocator = torch_npu.npu.memory.NPUPluggableAllocator(library_path, "gca_npu_malloc", "gca_npu_free")
    torch_npu.npu.memory.change_current_allocator(allocator)
    _installed = True


def _default_backend():
    import os

    return os.environ.get("GCALLOC_TORCH_BACKEND") or "acl"


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
