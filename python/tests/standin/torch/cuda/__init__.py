"""torch.cuda of the stand-in: devices, streams, and memory (memory.py)."""
from .. import _C
from . import memory
from .memory import *  # noqa: F401,F403 (as torch.cuda does)

OutOfMemoryError = None  # set by torch/__init__ below
_current = [0]
_initialized = [False]


class Stream:
    def __init__(self, cuda_stream):
        self.cuda_stream = cuda_stream


def is_available():
    return True


def is_initialized():
    return _initialized[0]


def _lazy_init():
    if not _initialized[0]:
        _initialized[0] = True
        _C._cuda_lazy_init()


def device_count():
    return _C.DEVICE_COUNT


def current_device():
    _lazy_init()
    return _current[0]


def set_device(index):
    _current[0] = index


def current_stream(device=None):
    return Stream(0)


def synchronize(device=None):
    pass
