"""gcalloc from Python: the caching allocator through ctypes (no compile step).

    import gcalloc
    a = gcalloc.Allocator("sim:capacity=24GiB", "expandable_segments:True")
    p = a.malloc(1 << 20)
    a.memory_stats()["allocated_bytes.all.current"]   # PyTorch's keys and meanings
    a.free(p)

With PyTorch: gcalloc.torch.install() (see gcalloc/torch.py). The module-level
functions (memory_stats(), memory_summary(), ...) act on the process-wide
allocator PyTorch uses once installed.

The shared library is found from $GCALLOC_LIBRARY, else beside this package
(gcalloc/libgcalloc.so*), else by the system's search (libgcalloc.so).
"""
import ctypes
import ctypes.util
import glob
import json
import os
import tempfile

__all__ = ["Allocator", "GcallocError", "library_path", "memory_stats", "memory_summary", "memory_snapshot",
           "dump_snapshot", "empty_cache", "set_per_process_memory_fraction", "reset_peak_memory_stats",
           "host_memory_stats", "host_empty_cache"]


class GcallocError(RuntimeError):
    """A gcalloc call failed; the message is gcalloc's (gca_last_error)."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def _find_library():
    env = os.environ.get("GCALLOC_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    beside = sorted(glob.glob(os.path.join(here, "libgcalloc.so*")))
    if beside:
        return beside[0]
    found = ctypes.util.find_library("gcalloc")
    if found:
        return found
    raise OSError("gcalloc: cannot find libgcalloc.so (set GCALLOC_LIBRARY to its path)")


library_path = _find_library()
_lib = ctypes.CDLL(library_path)

_P = ctypes.c_void_p
_STATS_FLAT_COUNT = 122  # GCA_STATS_FLAT_COUNT


class _StatItem(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


class _Stat(ctypes.Structure):
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64), ("allocated", ctypes.c_int64),
                ("freed", ctypes.c_int64)]


class _DurationStat(ctypes.Structure):
    _fields_ = [("total", ctypes.c_int64), ("max", ctypes.c_int64), ("min", ctypes.c_int64),
                ("count", ctypes.c_int64)]


class _HostStats(ctypes.Structure):  # gca_host_stats_t
    _fields_ = [("allocation", _Stat), ("segment", _Stat), ("allocated_bytes", _Stat), ("reserved_bytes", _Stat),
                ("host_alloc_time", _DurationStat), ("host_free_time", _DurationStat),
                ("num_host_alloc", ctypes.c_int64), ("num_host_free", ctypes.c_int64),
                ("pending_blocks", ctypes.c_int64), ("cached_bytes", ctypes.c_int64),
                ("num_alloc_retries", ctypes.c_int64), ("num_event_errors", ctypes.c_int64),
                ("quarantined_blocks", ctypes.c_int64)]


def _sig(name, restype, *argtypes):
    fn = getattr(_lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_sig("gca_last_error", ctypes.c_char_p)
_sig("gca_last_status", ctypes.c_int)
_sig("gca_version", ctypes.c_char_p)
_sig("gca_open", ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_P))
_sig("gca_close", None, _P)
_sig("gca_device_count", ctypes.c_int, _P)
_sig("gca_backend_name", ctypes.c_char_p, _P)
_sig("gca_malloc", _P, _P, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t)
_sig("gca_free", ctypes.c_int, _P, _P)
_sig("gca_record_stream", ctypes.c_int, _P, _P, ctypes.c_size_t)
_sig("gca_empty_cache", ctypes.c_int, _P, ctypes.c_int)
_sig("gca_synchronize", ctypes.c_int, _P, ctypes.c_int)
_sig("gca_set_memory_fraction", ctypes.c_int, _P, ctypes.c_double, ctypes.c_int)
_sig("gca_set_config", ctypes.c_int, _P, ctypes.c_char_p)
_sig("gca_get_config", ctypes.c_int, _P, ctypes.c_char_p, ctypes.c_size_t)
_sig("gca_reset_peak_stats", ctypes.c_int, _P, ctypes.c_int)
_sig("gca_reset_accumulated_stats", ctypes.c_int, _P, ctypes.c_int)
_sig("gca_memory_summary", ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
_sig("gca_snapshot_take", ctypes.c_int, _P, ctypes.POINTER(_P))
_sig("gca_snapshot_free", None, _P)
_sig("gca_snapshot_write", ctypes.c_int, _P, ctypes.c_char_p, ctypes.c_int)
_sig("gca_get_stats", ctypes.c_int, _P, ctypes.c_int, _P)
_sig("gca_stats_flatten", ctypes.c_size_t, _P, ctypes.POINTER(_StatItem), ctypes.c_size_t)
_sig("gca_record_history", ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.c_size_t)
_sig("gca_host_malloc", _P, _P, ctypes.c_size_t)
_sig("gca_host_free", ctypes.c_int, _P, _P)
_sig("gca_host_record_stream", ctypes.c_int, _P, _P, ctypes.c_int, ctypes.c_size_t)
_sig("gca_host_empty_cache", ctypes.c_int, _P)
_sig("gca_host_is_pinned", ctypes.c_int, _P, _P, ctypes.POINTER(ctypes.c_int))
_sig("gca_host_stats", ctypes.c_int, _P, ctypes.POINTER(_HostStats))
_sig("gca_host_reset_peak_stats", ctypes.c_int, _P)
_sig("gca_torch_init", ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p)
_sig("gca_torch_allocator", _P)
_sig("gca_torch_malloc", _P, ctypes.c_ssize_t, ctypes.c_int, _P)
_sig("gca_torch_free", None, _P, ctypes.c_ssize_t, ctypes.c_int, _P)
_sig("gca_torch_shutdown", None)
_sig("gca_torch_record_stream", None, _P, _P)
_sig("gca_torch_last_failure", ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t)

# gca_stats_t (about 1 KiB) is read as opaque bytes and handed to
# gca_stats_flatten, which knows its layout: no structure to keep in step.
_STATS_BYTES = 4096


def _check(rc):
    if rc < 0:
        raise GcallocError(rc, _lib.gca_last_error().decode())
    return rc


def _text(s):
    return s.encode() if isinstance(s, str) else s


def _allocated(size, call):
    """Run an allocating call: its address, 0 for size 0; MemoryError when out of memory."""
    if size < 0:
        raise ValueError("size must be >= 0, not %d" % size)
    p = call()
    if not p:
        status = _lib.gca_last_status()
        if status == -2:  # GCA_ERR_OOM
            raise MemoryError(_lib.gca_last_error().decode())
        _check(status)
    return p or 0


def version():
    return _lib.gca_version().decode()


class Allocator:
    """An allocator on a backend ("sim", "sim:capacity=24GiB", "cuda") with a
    configuration string in PyTorch's syntax. Addresses are ints."""

    def __init__(self, backend="sim", conf=None, _handle=None):
        if _handle is not None:
            self._a, self._owned = _handle, False
            return
        handle = _P()
        _check(_lib.gca_open(_text(backend), _text(conf), ctypes.byref(handle)))
        self._a, self._owned = handle, True

    def close(self):
        if self._owned and self._a:
            _lib.gca_close(self._a)
        self._a = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @property
    def device_count(self):
        return _check(_lib.gca_device_count(self._a))

    @property
    def backend(self):
        return _lib.gca_backend_name(self._a).decode()

    def malloc(self, size, device=0, stream=0):
        """Device address of `size` bytes; MemoryError when out of memory."""
        return _allocated(size, lambda: _lib.gca_malloc(self._a, size, device, stream))

    def free(self, ptr):
        _check(_lib.gca_free(self._a, ptr))

    def record_stream(self, ptr, stream):
        _check(_lib.gca_record_stream(self._a, ptr, stream))

    def empty_cache(self, device=-1):
        _check(_lib.gca_empty_cache(self._a, device))

    def synchronize(self, device=-1):
        _check(_lib.gca_synchronize(self._a, device))

    def set_config(self, conf):
        _check(_lib.gca_set_config(self._a, _text(conf)))

    def get_config(self):
        n = _check(_lib.gca_get_config(self._a, None, 0))
        buf = ctypes.create_string_buffer(n + 1)
        _check(_lib.gca_get_config(self._a, buf, n + 1))
        return buf.value.decode()

    def set_per_process_memory_fraction(self, fraction, device=0):
        _check(_lib.gca_set_memory_fraction(self._a, fraction, device))

    def reset_peak_memory_stats(self, device=0):
        _check(_lib.gca_reset_peak_stats(self._a, device))

    def reset_accumulated_memory_stats(self, device=0):
        _check(_lib.gca_reset_accumulated_stats(self._a, device))

    def memory_stats(self, device=0):
        """torch.cuda.memory_stats(): the same keys, in the same order."""
        raw = ctypes.create_string_buffer(_STATS_BYTES)
        _check(_lib.gca_get_stats(self._a, device, raw))
        items = (_StatItem * _STATS_FLAT_COUNT)()
        n = _lib.gca_stats_flatten(raw, items, _STATS_FLAT_COUNT)
        return {items[i].name.decode(): items[i].value for i in range(min(n, _STATS_FLAT_COUNT))}

    def memory_summary(self, device=0, abbreviated=False):
        """torch.cuda.memory_summary()'s table."""
        n = _check(_lib.gca_memory_summary(self._a, device, int(abbreviated), None, 0))
        buf = ctypes.create_string_buffer(n + 1)
        _check(_lib.gca_memory_summary(self._a, device, int(abbreviated), buf, n + 1))
        return buf.value.decode()

    # Pinned host memory (gca_host_*): PyTorch's CachingHostAllocator.

    def host_malloc(self, size):
        """Address of `size` bytes of pinned host memory (0 for size 0); MemoryError when out of it."""
        return _allocated(size, lambda: _lib.gca_host_malloc(self._a, size))

    def host_free(self, ptr):
        _check(_lib.gca_host_free(self._a, ptr))

    def host_record_stream(self, ptr, stream, device=0):
        _check(_lib.gca_host_record_stream(self._a, ptr, device, stream))

    def host_empty_cache(self):
        _check(_lib.gca_host_empty_cache(self._a))

    def host_is_pinned(self, ptr):
        pinned = ctypes.c_int(0)
        _check(_lib.gca_host_is_pinned(self._a, ptr, ctypes.byref(pinned)))
        return bool(pinned.value)

    def host_memory_stats(self):
        """torch.cuda.host_memory_stats(): its keys ("allocation.current", "host_alloc_time.total",
        "num_host_alloc", ...), then gcalloc's own (pending_blocks, cached_bytes, ...)."""
        st = _HostStats()
        _check(_lib.gca_host_stats(self._a, ctypes.byref(st)))
        out = {}
        for name, kind in _HostStats._fields_:
            value = getattr(st, name)
            if kind in (_Stat, _DurationStat):
                for field, _ in kind._fields_:
                    out["%s.%s" % (name, field)] = getattr(value, field)
            else:
                out[name] = value
        return out

    def host_reset_peak_memory_stats(self):
        _check(_lib.gca_host_reset_peak_stats(self._a))

    def record_history(self, enabled=True, context="state", max_entries=100000):
        levels = {None: 0, "none": 0, "state": 1, "alloc": 2, "all": 3}
        _check(_lib.gca_record_history(self._a, int(enabled), levels[context], max_entries))

    def _write_snapshot(self, path, fmt):
        snap = _P()
        _check(_lib.gca_snapshot_take(self._a, ctypes.byref(snap)))
        try:
            _check(_lib.gca_snapshot_write(snap, _text(path), fmt))
        finally:
            _lib.gca_snapshot_free(snap)

    def dump_snapshot(self, path):
        """torch.cuda.memory._dump_snapshot(path): a pickle memory_viz opens."""
        self._write_snapshot(path, 0)

    def memory_snapshot(self):
        """torch.cuda.memory._snapshot(): a dict with segments, device_traces, allocator_settings."""
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._write_snapshot(path, 1)
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        finally:
            os.unlink(path)


def _process_allocator():
    a = _lib.gca_torch_allocator()
    if not a:
        raise GcallocError(_lib.gca_last_status(), _lib.gca_last_error().decode())
    return Allocator(_handle=a)


def memory_stats(device=0):
    return _process_allocator().memory_stats(device)


def memory_summary(device=0, abbreviated=False):
    return _process_allocator().memory_summary(device, abbreviated)


def memory_snapshot():
    return _process_allocator().memory_snapshot()


def dump_snapshot(path):
    _process_allocator().dump_snapshot(path)


def empty_cache():
    _process_allocator().empty_cache(-1)


def set_per_process_memory_fraction(fraction, device=0):
    _process_allocator().set_per_process_memory_fraction(fraction, device)


def reset_peak_memory_stats(device=0):
    _process_allocator().reset_peak_memory_stats(device)


def host_memory_stats():
    return _process_allocator().host_memory_stats()


def host_empty_cache():
    _process_allocator().host_empty_cache()
