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


KiB, MiB = 1 << 10, 1 << 20


def _format_size(size):
    return "%.2f MiB" % (size / MiB) if size < (1 << 30) else "%.2f GiB" % (size / (1 << 30))


class _PrivatePool:
    """A MemPool's or a graph's private pool (PrivatePool): its own cached segments, its use count, and
    the allocator that gives it segments (None: cudaMalloc, as the native allocator)."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.use_count = 1
        self.segments = []  # [device, stream, is_small, ptr, size, blocks: [[ptr, size, allocated], ...]]


class _NativeAllocator:
    """PyTorch's own caching allocator. The default pools stand in as plain bookkeeping; the private
    pools (torch.cuda.MemPool, graph captures) keep PyTorch's rules, as c10/cuda/CUDACachingAllocator.cpp
    has them: a request rounded to 512 bytes; served best fit from the pool's cached blocks of its kind
    (small: 1 MiB or less) and split (small: a remainder of 512 bytes or more, large: more than 1 MiB);
    else a new segment (2 MiB for a small request, 20 MiB below 10 MiB, else the request rounded to
    2 MiB) from the pool's allocator (raw_alloc: its alloc function with the current device and
    stream), which refuses expandable segments (RuntimeError); a NULL segment frees the cache of the
    default pools and of the freeable pools and asks again, then raises torch.OutOfMemoryError. A freed
    block goes back to its pool, merged with its free neighbours, never to the allocator: a pool's free
    segments go back (raw_delete, the free function) only once the pool is freeable (use count 0) and
    the cache is emptied (empty_cache, or the MemPool's destruction)."""

    def __init__(self):
        self._initialized = False
        self.live = {}
        self.next = 0x7F0000000000
        self.pools = {}  # (device, id) -> _PrivatePool
        self.routes = {}  # (thread, device) -> [id, ...]: beginAllocateCurrentThreadToPool's
        self.blocks = {}  # ptr -> (pool, segment, block) of the live blocks of private pools

    def initialized(self):
        return self._initialized

    def init(self, device_count):
        self._initialized = True

    # ---- private pools (createOrIncrefPool, beginAllocateToPool, endAllocateToPool, releasePool)

    def createOrIncrefPool(self, device, mempool_id, allocator=None):  # noqa: N802
        pool = self.pools.get((device, mempool_id))
        if pool is None:
            self.pools[(device, mempool_id)] = _PrivatePool(allocator)
        else:
            if allocator is not None and pool.allocator is not allocator:
                raise RuntimeError("Allocator of existing pool does not match passed allocator")
            pool.use_count += 1

    def beginAllocateToPool(self, device, mempool_id, thread):  # noqa: N802
        self.createOrIncrefPool(device, mempool_id)
        self.routes.setdefault((thread, device), []).append(mempool_id)

    def endAllocateToPool(self, device, mempool_id, thread):  # noqa: N802
        stack = self.routes.get((thread, device), [])
        if mempool_id in stack:
            stack.remove(mempool_id)

    def releasePool(self, device, mempool_id):  # noqa: N802
        pool = self.pools[(device, mempool_id)]
        pool.use_count -= 1
        if pool.use_count < 0:
            raise RuntimeError("INTERNAL ASSERT FAILED: use_count of a private pool below 0")

    def getPoolUseCount(self, device, mempool_id):  # noqa: N802
        pool = self.pools.get((device, mempool_id))
        return pool.use_count if pool else 0

    # ---- allocation

    def malloc(self, size, device, stream):
        import threading

        self._initialized = True
        stack = self.routes.get((threading.get_ident(), device))
        if stack:
            return self._pool_malloc(stack[-1], size, device, stream)
        p, self.next = self.next, self.next + ((size + 511) // 512) * 512
        self.live[p] = size
        return p

    def _pool_malloc(self, mempool_id, size, device, stream):
        pool = self.pools[(device, mempool_id)]
        rounded = max(512, (size + 511) // 512 * 512)
        small = rounded <= MiB
        best = None
        for segment in pool.segments:
            if segment[0] != device or segment[1] != stream or segment[2] != small:
                continue
            for block in segment[5]:
                if not block[2] and block[1] >= rounded and (best is None or block[1] < best[1][1]):
                    best = (segment, block)
        if best is None:
            best = self._new_segment(pool, mempool_id, rounded, small, device, stream)
        segment, block = best
        remaining = block[1] - rounded
        if (small and remaining >= 512) or (not small and remaining > MiB):
            blocks = segment[5]
            blocks.insert(blocks.index(block) + 1, [block[0] + rounded, remaining, False])
            block[1] = rounded
        block[2] = True
        self.blocks[block[0]] = (pool, segment, block)
        return block[0]

    def _new_segment(self, pool, mempool_id, rounded, small, device, stream):
        import torch

        alloc = 2 * MiB if small else (20 * MiB if rounded < 10 * MiB else (rounded + 2 * MiB - 1) // (2 * MiB) * (2 * MiB))
        if pool.allocator is None:
            ptr, self.next = self.next, self.next + alloc
        else:
            if _expandable_segments():
                raise RuntimeError("MemPool doesn't currently support expandable_segments.")
            ptr = pool.allocator.raw_alloc(alloc, device, stream)
            if not ptr:
                self.emptyCache()
                ptr = pool.allocator.raw_alloc(alloc, device, stream)
            if not ptr:
                raise torch.OutOfMemoryError(
                    "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of 4.00 GiB of which "
                    "0 bytes is free." % (_format_size(rounded), device))
        segment = [device, stream, small, ptr, alloc, [[ptr, alloc, False]]]
        pool.segments.append(segment)
        return segment, segment[5][0]

    def raw_delete(self, ptr):
        found = self.blocks.pop(ptr, None)
        if found is None:
            del self.live[ptr]
            return
        pool, segment, block = found
        block[2] = False
        blocks = segment[5]
        i = blocks.index(block)
        if i + 1 < len(blocks) and not blocks[i + 1][2]:
            block[1] += blocks.pop(i + 1)[1]
        if i > 0 and not blocks[i - 1][2]:
            blocks[i - 1][1] += blocks.pop(i)[1]

    def recordStream(self, ptr, stream):  # noqa: N802 (PyTorch's name)
        pass

    def emptyCache(self, mempool_id=None):  # noqa: N802
        """The free segments of the freeable private pools (all of them, or `mempool_id`'s) go back."""
        for (device, pool_id), pool in list(self.pools.items()):
            if pool.use_count or (mempool_id is not None and pool_id != mempool_id):
                continue
            for segment in list(pool.segments):
                if len(segment[5]) == 1 and not segment[5][0][2]:
                    pool.segments.remove(segment)
                    if pool.allocator is not None:
                        pool.allocator.raw_delete(segment[3])
            if not pool.segments:
                del self.pools[(device, pool_id)]

    def setMemoryFraction(self, fraction, device):  # noqa: N802
        pass

    def getDeviceStats(self, device):  # noqa: N802
        allocated = sum(self.live.values()) + sum(b[1] for _, _, b in self.blocks.values())
        return {"allocated_bytes.all.current": allocated}

    def getBaseAllocation(self, ptr):  # noqa: N802
        return ptr, self.live.get(ptr, 0)

    def poolSegments(self, mempool_id):  # noqa: N802 (what MemPool.snapshot reads)
        return [{"device": s[0], "address": s[3], "total_size": s[4],
                 "allocated_size": sum(b[1] for b in s[5] if b[2])}
                for (_, pool_id), pool in self.pools.items() if pool_id == mempool_id for s in pool.segments]


_settings_env = [None]  # what the configuration said at start (PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF)


def _expandable_segments():
    """The native allocator's expandable_segments setting: the environment's, then every
    _set_allocator_settings in turn (a later key wins)."""
    if _settings_env[0] is None:
        _settings_env[0] = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    value = False
    for conf in [_settings_env[0], *_native_settings]:
        for item in conf.split(","):
            key, _, v = item.partition(":")
            if key.strip() == "expandable_segments":
                value = v.strip() == "True"
    return value


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


def _native():
    if not isinstance(_current(), _NativeAllocator):
        raise NotImplementedError("the stand-in models torch.cuda.MemPool on PyTorch's native allocator only")
    return _current()


class _MemPool:
    """c10::cuda::MemPool: an id ((0, n) for a user's pool, (n, 0) for a graph's), made on the current
    device with one use, released (and its cache emptied) when destroyed."""

    _uid = [0]
    _graph_uid = [0]

    def __init__(self, allocator=None, is_user_created=True, use_on_oom=False, no_split=False):
        from . import cuda

        if is_user_created:
            _MemPool._uid[0] += 1
            self._id = (0, _MemPool._uid[0])
        else:
            self._id = _graph_pool_id()
        self._allocator = allocator
        self._device = cuda.current_device()
        _native().createOrIncrefPool(self._device, self._id, allocator)

    @property
    def id(self):
        return self._id

    @property
    def allocator(self):
        return self._allocator

    def use_count(self):
        return _native().getPoolUseCount(self._device, self._id)

    def __del__(self):
        try:
            native = _native()
        except Exception:
            return
        native.releasePool(self._device, self._id)
        native.emptyCache(self._id)


def _graph_pool_id():
    """A new graph pool's id, (n, 0) (graph_pool_handle's, and a capture's given none)."""
    _MemPool._graph_uid[0] += 1
    return (_MemPool._graph_uid[0], 0)


def _cuda_beginAllocateCurrentThreadToPool(device, mempool_id):  # noqa: N802
    import threading

    _native().beginAllocateToPool(device, tuple(mempool_id), threading.get_ident())


def _cuda_endAllocateToPool(device, mempool_id):  # noqa: N802
    import threading

    _native().endAllocateToPool(device, tuple(mempool_id), threading.get_ident())


def _cuda_releasePool(device, mempool_id):  # noqa: N802
    _native().releasePool(device, tuple(mempool_id))


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
