"""The C++ side of the stand-in: the caching allocator PyTorch starts with,
the pluggable allocator object, and the functions torch.cuda.memory calls."""
import ctypes
import os

from _pluggable import Pluggable

# libc10, loaded with the package as PyTorch's C++ libraries are (where the tests put one in lib/).
_LIBC10 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libc10.so")
if os.path.exists(_LIBC10):
    Pluggable.c10 = ctypes.CDLL(_LIBC10)

DEVICE_COUNT = 2

# How PyTorch's C++ was built: std::string's ABI, which code built against its headers must match.
_GLIBCXX_USE_CXX11_ABI = True


class _MempoolId(ctypes.Structure):  # c10::cuda::MempoolId_t, a pair of two 64-bit ints
    _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]


# set_*_fn: name -> the C signature Module.cpp casts the address to.
HOOKS = {
    "set_init_fn": ctypes.CFUNCTYPE(None, ctypes.c_int),
    "set_reset_fn": ctypes.CFUNCTYPE(None),
    "set_memory_fraction_fn": ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int),
    "set_base_alloc_fn": ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)),
    "set_record_stream_fn": ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p),
    # (the filter, a std::function, arrives by hidden reference: an address; tests/test_frameworks.cpp
    # calls these hooks from C++ with the real types)
    "set_begin_allocate_to_pool": ctypes.CFUNCTYPE(None, ctypes.c_int, _MempoolId, ctypes.c_void_p),
    "set_end_allocate_to_pool_fn": ctypes.CFUNCTYPE(None, ctypes.c_int, _MempoolId),
    "set_release_pool": ctypes.CFUNCTYPE(None, ctypes.c_int, _MempoolId),
}
# PyTorch 2.1 and 2.2 (GCALLOC_STANDIN_TORCH=2.2): the graph hooks name the capturing stream instead.
if os.environ.get("GCALLOC_STANDIN_TORCH") == "2.2":
    del HOOKS["set_begin_allocate_to_pool"], HOOKS["set_end_allocate_to_pool_fn"]
    HOOKS["set_begin_allocate_stream_to_pool"] = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, _MempoolId)
    HOOKS["set_end_allocate_stream_to_pool_fn"] = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p)


def _unsupported(what):
    raise RuntimeError("CUDAPluggableAllocator does not yet support %s. If you need it, please file an issue "
                       "describing your use case." % what)


class _NativeAllocator:
    """PyTorch's own caching allocator, standing in as plain bookkeeping."""

    def __init__(self):
        self._initialized = False
        self.live = {}
        self.next = 0x7F0000000000

    def initialized(self):
        return self._initialized

    def init(self, device_count):
        self._initialized = True

    def malloc(self, size, device, stream):
        self._initialized = True
        p, self.next = self.next, self.next + ((size + 511) // 512) * 512
        self.live[p] = size
        return p

    def raw_delete(self, ptr):
        del self.live[ptr]

    def recordStream(self, ptr, stream):  # noqa: N802 (PyTorch's name)
        pass

    def emptyCache(self):  # noqa: N802
        pass

    def setMemoryFraction(self, fraction, device):  # noqa: N802
        pass

    def getDeviceStats(self, device):  # noqa: N802
        allocated = sum(self.live.values())
        return {"allocated_bytes.all.current": allocated}

    def getBaseAllocation(self, ptr):  # noqa: N802
        return ptr, self.live.get(ptr, 0)


class _CUDAPluggableAllocator(Pluggable):
    """torch::cuda::CUDAPluggableAllocator: the two functions, the hooks
    (called only when set), and "does not yet support" for the rest."""

    HOOKS = HOOKS

    def recordStream(self, ptr, stream):  # noqa: N802
        self._hook("set_record_stream_fn", ptr, stream)

    def emptyCache(self):  # noqa: N802
        self._hook("set_reset_fn")

    def setMemoryFraction(self, fraction, device):  # noqa: N802
        self._hook("set_memory_fraction_fn", fraction, device)

    def releasePool(self, device, first, second):  # noqa: N802
        self._hook("set_release_pool", device, _MempoolId(first, second))

    def getDeviceStats(self, device):  # noqa: N802
        _unsupported("getDeviceStats")

    def resetPeakStats(self, device):  # noqa: N802
        _unsupported("resetPeakStats")

    def resetAccumulatedStats(self, device):  # noqa: N802
        _unsupported("resetAccumulatedStats")

    def snapshot(self):
        _unsupported("snapshot")

    def recordHistory(self, *args):  # noqa: N802
        _unsupported("recordHistory")

    def cacheInfo(self, device):  # noqa: N802
        _unsupported("cacheInfo")


_allocator = [_NativeAllocator()]


def _current():
    return _allocator[0]


def _cuda_customAllocator(malloc_ptr, free_ptr):  # noqa: N802
    a = _CUDAPluggableAllocator(malloc_ptr, free_ptr)
    a.init(0)  # createCustomAllocator: init(device_count) with the count known so far
    return a


def _cuda_changeCurrentAllocator(allocator):  # noqa: N802
    if _allocator[0].initialized() and not isinstance(_allocator[0], _CUDAPluggableAllocator):
        raise RuntimeError("Can't swap an already initialized allocator")
    _allocator[0] = allocator


_native_settings = []  # what _set_allocator_settings gave the native allocator's configuration


def _cuda_cudaCachingAllocator_set_allocator_settings(env):  # noqa: N802
    _native_settings.append(env)


def _accelerator_getDeviceStats(device_index):  # noqa: N802 (torch.accelerator's, PyTorch 2.9)
    return _current().getDeviceStats(device_index)


def _cuda_lazy_init():
    _current().init(DEVICE_COUNT)


def _cuda_memoryStats(device):  # noqa: N802
    return _current().getDeviceStats(device)


def _cuda_resetPeakMemoryStats(device):  # noqa: N802
    _current().resetPeakStats(device)


def _cuda_resetAccumulatedMemoryStats(device):  # noqa: N802
    _current().resetAccumulatedStats(device)


def _cuda_emptyCache():  # noqa: N802
    _current().emptyCache()


def _cuda_setMemoryFraction(fraction, device):  # noqa: N802
    _current().setMemoryFraction(fraction, device)


def _cuda_memorySnapshot(*args):  # noqa: N802
    return _current().snapshot()


def _cuda_record_memory_history(*args):
    _current().recordHistory(*args)


def _cuda_cacheInfo(device):  # noqa: N802 (what cuDNN's benchmark mode asks, from C++)
    return _current().cacheInfo(device)


def _record_stream_from_cpp(ptr, stream):
    """What c10d's process groups do: recordStream in C++, no Python in between."""
    _current().recordStream(ptr, stream)


def _base_allocation(ptr):
    """What IPC and storage sharing ask (getBaseAllocation)."""
    return _current().getBaseAllocation(ptr)
