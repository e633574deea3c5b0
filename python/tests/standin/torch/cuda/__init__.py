"""torch.cuda of the stand-in: devices, streams, and memory (memory.py)."""
from .. import _C
from . import memory
from .memory import *  # noqa: F401,F403 (as torch.cuda does)

OutOfMemoryError = None  # set by torch/__init__ below
_current = [0]
_initialized = [False]


class Stream:
    _next = [0x5000]

    def __init__(self, cuda_stream=None):
        if cuda_stream is None:  # (a new stream: a handle of its own)
            cuda_stream, Stream._next[0] = Stream._next[0], Stream._next[0] + 0x10
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


class CUDAGraph:
    """A capture into a private pool (a new graph pool, or the one given, a MemPool's id among them):
    from capture_begin to capture_end the capturing thread's allocations go to it (PyTorch routes the
    capturing stream; the stand-in's streams are all one); reset releases the pool."""

    def __init__(self):
        self.pool = None
        self.device = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        import threading

        self.device = current_device()
        self.pool = _C._graph_pool_id() if pool is None else tuple(pool)
        _C._native().createOrIncrefPool(self.device, self.pool)
        _C._native().beginAllocateToPool(self.device, self.pool, threading.get_ident())
        _C._native().releasePool(self.device, self.pool)  # (begin took one use: the graph keeps the other)

    def capture_end(self):
        import threading

        _C._native().endAllocateToPool(self.device, self.pool, threading.get_ident())

    def replay(self):
        pass

    def pool_id(self):
        return self.pool

    def reset(self):
        if self.pool is not None:
            _C._native().releasePool(self.device, self.pool)
            self.pool = None


def graph_pool_handle():
    return _C._graph_pool_id()


class graph:  # noqa: N801 (PyTorch's name)
    """torch.cuda.graph: capture_begin(pool) on entry, capture_end on exit."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        self.cuda_graph, self.pool, self.stream = cuda_graph, pool, stream
        self.capture_error_mode = capture_error_mode

    def __enter__(self):
        self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, *exc):
        self.cuda_graph.capture_end()
        return False
