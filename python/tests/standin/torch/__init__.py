"""A stand-in for PyTorch (see ../README.md): the allocator's side only."""
from . import _C  # noqa: F401
from . import cuda  # noqa: F401
from . import accelerator  # noqa: F401

__version__ = "2.5.0+standin"


class OutOfMemoryError(RuntimeError):
    pass


cuda.OutOfMemoryError = OutOfMemoryError


class device:  # noqa: N801 (PyTorch's name)
    def __init__(self, kind, index=None):
        if ":" in kind:
            kind, index = kind.split(":")[0], int(kind.split(":")[1])
        self.type, self.index = kind, index


class AcceleratorError(RuntimeError):
    pass


_context_lost = []  # an illegal memory access ends the process's CUDA context: every later call fails


class Tensor:
    """A block of device memory from the current allocator, freed when the tensor is. As in PyTorch,
    the pluggable allocator's NULL is not checked: the tensor is made, and the first kernel that
    writes it is an illegal memory access."""

    def __init__(self, nbytes, device_index, stream):
        _check_context()
        self.nbytes = nbytes
        self.ptr = _C._current().malloc(nbytes, device_index, stream)
        self.is_cuda = True

    def fill_(self, value):
        _check_context()
        if self.nbytes and not self.ptr:
            _context_lost.append(True)
            _check_context()
        return self

    def data_ptr(self):
        return self.ptr

    def untyped_storage(self):
        ptr = self.ptr
        return type("Storage", (), {"data_ptr": staticmethod(lambda: ptr)})()

    def record_stream(self, stream):
        _C._current().recordStream(self.ptr, stream.cuda_stream)

    def free(self):
        if self.ptr:
            _C._current().raw_delete(self.ptr)
            self.ptr = 0


def _check_context():
    if _context_lost:
        raise AcceleratorError("CUDA error: an illegal memory access was encountered")


def empty(nbytes, device="cuda"):
    index = device.index if isinstance(device, globals()["device"]) else (int(device.split(":")[1]) if ":" in device
                                                                          else None)
    index = cuda.current_device() if index is None else index
    return Tensor(nbytes, index, cuda.current_stream(index).cuda_stream)
