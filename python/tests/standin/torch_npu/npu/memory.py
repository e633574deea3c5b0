"""torch_npu.npu.memory of the stand-in: every statistic goes through
memory_stats, which asks the current allocator for its device stats."""
import ctypes

from .. import _C


class NPUPluggableAllocator:
    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        allocator = ctypes.CDLL(path_to_so_file)
        alloc_fn = ctypes.cast(getattr(allocator, alloc_fn_name), ctypes.c_void_p).value
        free_fn = ctypes.cast(getattr(allocator, free_fn_name), ctypes.c_void_p).value
        self._allocator = _C._npu_customAllocator(alloc_fn, free_fn)

    def allocator(self):
        return self._allocator


def change_current_allocator(allocator):
    _C._npu_changeCurrentAllocator(allocator.allocator())


def empty_cache():
    _C._current_allocator().emptyCache(True)


def set_per_process_memory_fraction(fraction, device=None):
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError("Invalid fraction value: {}. Allowed range: 0~1".format(fraction))
    _C._current_allocator().setMemoryFraction(fraction, device or 0)


def memory_stats(device=None):
    return _C._current_allocator().getDeviceStats(device or 0)


def memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device=None):
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device=None):
    _C._current_allocator().resetPeakStats(device or 0)
