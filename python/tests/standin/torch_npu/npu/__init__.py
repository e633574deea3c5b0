"""torch_npu.npu of the stand-in: the memory functions through the current
allocator, as torch_npu/npu/memory.py has them."""
from .. import _C
from . import memory
from .memory import (empty_cache, max_memory_allocated, max_memory_reserved, memory_allocated,  # noqa: F401
                     memory_reserved, memory_stats, reset_peak_memory_stats, set_per_process_memory_fraction)


def synchronize(device=None):
    _C._npu_synchronize()
