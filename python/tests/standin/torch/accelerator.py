"""torch.accelerator of the stand-in (PyTorch 2.9): the memory functions ask
the current device allocator, which a pluggable allocator answers with
"does not yet support"."""
from . import _C

__all__ = ["memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
           "reset_accumulated_memory_stats", "reset_peak_memory_stats"]


def memory_stats(device_index=None):
    return _C._accelerator_getDeviceStats(device_index or 0)


def memory_allocated(device_index=None):
    return memory_stats(device_index).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device_index=None):
    return memory_stats(device_index).get("allocated_bytes.all.peak", 0)


def memory_reserved(device_index=None):
    return memory_stats(device_index).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device_index=None):
    return memory_stats(device_index).get("reserved_bytes.all.peak", 0)


def reset_accumulated_memory_stats(device_index=None):
    _C._current().resetAccumulatedStats(device_index or 0)


def reset_peak_memory_stats(device_index=None):
    _C._current().resetPeakStats(device_index or 0)
