"""torch.cuda.memory of the stand-in, layered as PyTorch's: every statistic
goes through memory_stats, which asks the current allocator."""
import collections
import contextlib
import pickle
import sys

from .. import _C

__all__ = ["CUDAPluggableAllocator", "change_current_allocator", "empty_cache", "memory_stats",
           "memory_stats_as_nested_dict", "reset_accumulated_memory_stats", "reset_peak_memory_stats",
           "reset_max_memory_allocated", "memory_allocated", "max_memory_allocated", "memory_reserved",
           "max_memory_reserved", "memory_snapshot", "memory_summary", "mem_get_info",
           "set_per_process_memory_fraction", "MemPool", "use_mem_pool"]


def _index(device):
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.split(":")[1]) if ":" in device else 0
    return device.index or 0


class CUDAPluggableAllocator:
    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        import ctypes

        allocator = ctypes.CDLL(path_to_so_file)
        alloc_fn = ctypes.cast(getattr(allocator, alloc_fn_name), ctypes.c_void_p).value
        free_fn = ctypes.cast(getattr(allocator, free_fn_name), ctypes.c_void_p).value
        assert alloc_fn is not None and free_fn is not None
        self._allocator = _C._cuda_customAllocator(alloc_fn, free_fn)

    def allocator(self):
        return self._allocator


def change_current_allocator(allocator):
    _C._cuda_changeCurrentAllocator(allocator.allocator())


def empty_cache():
    _C._cuda_emptyCache()


def set_per_process_memory_fraction(fraction, device=None):
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError("Invalid fraction value: {}. Allowed range: 0~1".format(fraction))
    _C._cuda_setMemoryFraction(fraction, _index(device))


def memory_stats_as_nested_dict(device=None):
    stats = _C._cuda_memoryStats(_index(device))
    nested = {}
    for key, value in stats.items():
        level = nested
        *path, last = key.split(".")
        for part in path:
            level = level.setdefault(part, {})
        level[last] = value
    return nested


def memory_stats(device=None):
    result = []

    def _recurse(prefix, obj):
        if isinstance(obj, dict):
            if prefix:
                prefix += "."
            for k, v in obj.items():
                _recurse(prefix + k, v)
        else:
            result.append((prefix, obj))

    _recurse("", memory_stats_as_nested_dict(device=device))
    result.sort()
    return collections.OrderedDict(result)


def reset_accumulated_memory_stats(device=None):
    _C._cuda_resetAccumulatedMemoryStats(_index(device))


def reset_peak_memory_stats(device=None):
    _C._cuda_resetPeakMemoryStats(_index(device))


def reset_max_memory_allocated(device=None):
    return reset_peak_memory_stats(device=device)


def memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.peak", 0)


def memory_summary(device=None, abbreviated=False):
    stats = memory_stats(device=device)
    return "|  PyTorch CUDA memory summary, device ID %d  |\n%r" % (_index(device), dict(stats))


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None,
                           clear_history=False, compile_context=False, global_record_annotations=False,
                           skip_actions=None):
    _C._cuda_record_memory_history(enabled, context, stacks, max_entries, clear_history, compile_context,
                                   global_record_annotations, skip_actions or [])


def _snapshot(device=None):
    return _C._cuda_memorySnapshot(None)


def memory_snapshot(mempool_id=None):
    return _C._cuda_memorySnapshot(mempool_id)["segments"]


def _set_allocator_settings(env):
    """Parsed into the native caching allocator's configuration (a pluggable allocator never reads it)."""
    _C._cuda_cudaCachingAllocator_set_allocator_settings(env)


def _dump_snapshot(filename="dump_snapshot.pickle"):
    s = _snapshot()
    with open(filename, "wb") as f:
        pickle.dump(s, f)


def mem_get_info(device=None):
    """The driver's answer (cudaMemGetInfo), which no allocator sees."""
    return (0, 0)


class MemPool(_C._MemPool):
    """torch.cuda.MemPool (PyTorch 2.6+): a private pool of the caching allocator on the current device,
    whose segments come from `allocator` (a CUDAPluggableAllocator's allocator()) where one is given."""

    def __init__(self, allocator=None, use_on_oom=False, no_split=False):
        super().__init__(allocator, True, use_on_oom, no_split)

    def snapshot(self):
        return _C._native().poolSegments(self.id)


@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    """This thread's allocations on the device go to `pool` (PyTorch's: begin, then end and release)."""
    from . import current_device

    device_index = current_device() if device is None else _index(device)
    _C._cuda_beginAllocateCurrentThreadToPool(device_index, pool.id)
    try:
        yield
    finally:
        _C._cuda_endAllocateToPool(device_index, pool.id)
        _C._cuda_releasePool(device_index, pool.id)
