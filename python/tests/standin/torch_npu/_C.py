"""The C++ side of the stand-in, as torch_npu/csrc/npu/NPUPluggableAllocator.cpp,
Module.cpp and NpuSysCtrl have it: the caching allocator torch_npu starts
with, the pluggable allocator object (hooks called only when set, the rest
warning "does not yet support"), the lazy initialization (aclInit with
torch_npu's configuration file, the thread's device set, the allocator's
init), and the task queue (an operator queued on the host, launched when
the queue is emptied)."""
import ctypes
import os
import warnings

from _pluggable import Pluggable

DEVICE_COUNT = 2
ACL_CONFIG = "torch_npu_acl.json"  # what torch_npu's aclInit reads

# set_*_fn: name -> the C signature Module.cpp casts the address to.
HOOKS = {
    "set_init_fn": ctypes.CFUNCTYPE(None, ctypes.c_int),
    "set_reset_fn": ctypes.CFUNCTYPE(None, ctypes.c_bool),
    "set_memory_fraction_fn": ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int),
    "set_base_alloc_fn": ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)),
}
# The record- and erase-stream hooks are held and called in the C++ library
# (lib/libtorch_npu.so, tests/fake_torch_npu.cpp), with torch_npu's own types:
# the address cast to std::function of the release's form, called with an
# NPUStream object.
STREAM_SETTERS = ("set_record_stream_fn", "set_erase_stream_fn")


def _acl():
    return ctypes.CDLL(os.environ["GCALLOC_ACL_LIBRARY"])


def _torch_npu_lib():
    return ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libtorch_npu.so"))


def _unsupported(what):
    warnings.warn("NPUPluggableAllocator does not yet support %s. If you need it, please file an issue describing "
                  "your use case." % what)


class _NativeAllocator:
    """torch_npu's own caching allocator, standing in as plain bookkeeping."""

    def __init__(self):
        self._initialized = False
        self.live, self.next = {}, 0x7F0000000000

    def initialized(self):
        return self._initialized

    def init(self, device_count):
        self._initialized = True

    def malloc(self, size, device, stream):
        p, self.next = self.next, self.next + ((size + 511) // 512) * 512
        self.live[p] = size
        return p

    def raw_delete(self, ptr):
        del self.live[ptr]


class _NPUPluggableAllocator(Pluggable):
    HOOKS = HOOKS

    def emptyCache(self, check_error=True):  # noqa: N802 (torch_npu's names)
        self._hook("set_reset_fn", check_error)

    def setMemoryFraction(self, fraction, device):  # noqa: N802
        self._hook("set_memory_fraction_fn", fraction, device)

    def __getattr__(self, name):
        if name in STREAM_SETTERS:
            def set_hook(func_ptr, _name=name):
                if not isinstance(func_ptr, int) or not func_ptr:
                    raise TypeError("%s(): incompatible function arguments (an int address)" % _name)
                lib = _torch_npu_lib()
                lib.fake_torch_npu_set_stream_hook.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
                if lib.fake_torch_npu_set_stream_hook(_name.encode(), func_ptr) != 0:
                    raise RuntimeError("no such hook: %s" % _name)
                self._hooks[_name] = True
            return set_hook
        return super().__getattr__(name)

    def _stream_use(self, setter, entry, ptr, stream, device):
        """recordStream / eraseStream with the stream `stream` (an id of torch_npu's pool, 0-7) of
        `device`: the C++ library calls the hook, when set, with its NPUStream."""
        if setter in self._hooks:
            self.calls.append((setter, (ptr, stream)))
        fn = getattr(_torch_npu_lib(), entry)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
        if fn(ptr, device, stream) != 0:
            failure = _torch_npu_lib().fake_torch_npu_failure
            failure.restype = ctypes.c_char_p
            raise RuntimeError(failure().decode())

    def recordStream(self, ptr, stream, device=0):  # noqa: N802
        self._stream_use("set_record_stream_fn", "fake_torch_npu_record_stream", ptr, stream, device)

    def eraseStream(self, ptr, stream, device=0):  # noqa: N802
        self._stream_use("set_erase_stream_fn", "fake_torch_npu_erase_stream", ptr, stream, device)

    def getDeviceStats(self, device):  # noqa: N802
        # torch_npu warns, then falls off the end of a function returning DeviceStats: undefined behaviour.
        _unsupported("getDeviceStats")
        raise RuntimeError("undefined behaviour: NPUPluggableAllocator::getDeviceStats returned nothing")

    def resetPeakStats(self, device):  # noqa: N802
        _unsupported("resetPeakStats")

    def resetAccumulatedStats(self, device):  # noqa: N802
        _unsupported("resetAccumulatedStats")


_current = _NativeAllocator()
_initialized = False
_queue = []  # operators queued on the host: (address, bytes)


def _current_allocator():
    return _current


def _npu_customAllocator(malloc_ptr, free_ptr):  # noqa: N802
    allocator = _NPUPluggableAllocator(malloc_ptr, free_ptr)
    allocator.init(DEVICE_COUNT)  # createCustomAllocator calls init before any hook can be set
    return allocator


def _npu_changeCurrentAllocator(allocator):  # noqa: N802
    global _current
    if _current.initialized():
        raise RuntimeError("Can't swap an already initialized allocator")
    _current = allocator


def _lazy_init():
    """NpuSysCtrl::Initialize: aclInit with torch_npu's configuration, the
    thread's device, the caching allocator's init."""
    global _initialized
    if _initialized:
        return
    acl = _acl()
    rc = acl.aclInit(ACL_CONFIG.encode())
    if rc not in (0, 100002):
        raise RuntimeError("aclInit failed: %d" % rc)
    if acl.aclrtSetDevice(0) != 0:
        raise RuntimeError("aclrtSetDevice failed")
    _initialized = True
    _current.init(DEVICE_COUNT)


def _malloc(size, device, stream):
    _lazy_init()
    return _current.malloc(size, device, stream)


def _enqueue(ptr, size):
    """An operator writing [ptr, ptr + size) queued on the host (TASK_QUEUE_ENABLE), launched later."""
    acl = _acl()
    acl.fakeacl_queue_work.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if acl.fakeacl_queue_work(ptr, size) != 0:
        raise RuntimeError("the stand-in's queue refused the operator")


def _npu_synchronize():
    drain = _torch_npu_lib()._ZN7c10_npu20npuSynchronizeDeviceEb
    drain.restype, drain.argtypes = ctypes.c_bool, [ctypes.c_bool]
    drain(True)
