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
import contextlib
import ctypes
import ctypes.util
import glob
import json
import os
import re
import tempfile
import sys
import threading
import warnings
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

__all__ = ["Allocator", "GcallocError", "OutOfMemoryError", "GcallocWarning", "DeviceProperties", "library_path", "version",
           "device_count", "synchronize", "empty_cache", "mem_get_info", "memory_stats",
           "memory_stats_as_nested_dict", "memory_allocated", "max_memory_allocated", "memory_reserved",
           "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated",
           "reset_accumulated_memory_stats", "memory_summary", "gcalloc_stats", "ipc_peers", "memory_snapshot",
           "dump_snapshot", "record_memory_history", "set_per_process_memory_fraction",
           "get_per_process_memory_fraction", "get_device_properties", "can_device_access_peer",
           "host_memory_stats", "host_empty_cache"]


# gca_status (include/gcalloc.h)
GCA_ERR_INVALID, GCA_ERR_OOM, GCA_ERR_CONFIG, GCA_ERR_BACKEND, GCA_ERR_BAD_POINTER = -1, -2, -3, -4, -5


class GcallocError(RuntimeError):
    """A gcalloc call failed; the message is gcalloc's (gca_last_error) and
    `status` its gca_status (a negative int). A call on a closed allocator
    raises it too, with status GCA_ERR_INVALID."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class OutOfMemoryError(GcallocError, MemoryError):
    """The device (or pinned host memory) cannot serve an allocation: a
    RuntimeError as PyTorch's torch.OutOfMemoryError is, and a MemoryError.
    Once gcalloc.torch is imported, the out-of-memory errors raised are also
    instances of torch.OutOfMemoryError."""


class GcallocWarning(UserWarning):
    """What gcalloc warns about while applying a configuration (a key it does not know, a feature it does
    not build, an environment variable hiding another), raised through Python's warnings module."""


# The class an out-of-memory raises: gcalloc.torch puts a subclass that is
# also torch.OutOfMemoryError here.
_oom_error = [OutOfMemoryError]


def _error(status, message):
    return (_oom_error[0] if status == GCA_ERR_OOM else GcallocError)(status, message)


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


class _StatItem(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


class _Stat(ctypes.Structure):
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64), ("allocated", ctypes.c_int64),
                ("freed", ctypes.c_int64)]


class _DurationStat(ctypes.Structure):
    _fields_ = [("total", ctypes.c_int64), ("max", ctypes.c_int64), ("min", ctypes.c_int64),
                ("count", ctypes.c_int64)]


class _PoolStats(ctypes.Structure):  # gca_pool_stats_t
    _fields_ = [("id", ctypes.c_uint64), ("device", ctypes.c_int), ("references", ctypes.c_int64),
                ("routes", ctypes.c_uint64), ("segments", ctypes.c_uint64), ("reserved_bytes", ctypes.c_uint64),
                ("allocated_bytes", ctypes.c_uint64), ("requested_bytes", ctypes.c_uint64),
                ("allocations", ctypes.c_uint64), ("pending_bytes", ctypes.c_uint64),
                ("cached_bytes", ctypes.c_uint64), ("pausable", ctypes.c_int), ("paused", ctypes.c_int),
                ("backup_bytes", ctypes.c_uint64)]


class _Stats(ctypes.Structure):  # gca_stats_t: only gcalloc's own counters are read from it here
    _fields_ = [(name, _Stat * 3) for name in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                                               "reserved_bytes", "active_bytes", "inactive_split_bytes",
                                               "requested_bytes")] + \
               [("oversize_allocations", _Stat), ("oversize_segments", _Stat)] + \
               [(name, ctypes.c_int64) for name in ("num_alloc_retries", "num_ooms", "num_sync_all_streams",
                                                    "num_device_alloc", "num_device_free", "max_split_size",
                                                    "num_cross_stream_reuses", "num_device_free_failures",
                                                    "num_gc_releases", "num_alloc_waits", "num_oom_handler_retries",
                                                    "num_pages_moved", "num_ipc_requests", "ipc_bytes_received",
                                                    "num_ipc_timeouts", "num_oom_rejections", "num_ipc_peers_asked",
                                                    "num_avoidable_ooms", "num_stitch_waits", "num_ipc_rounds",
                                                    "ipc_outside_bytes")]


_OWN_COUNTERS = ("num_cross_stream_reuses", "num_device_free_failures", "num_gc_releases", "num_alloc_waits",
                 "num_oom_handler_retries", "num_pages_moved", "num_ipc_requests", "num_ipc_peers_asked",
                 "ipc_bytes_received", "num_ipc_timeouts", "num_avoidable_ooms", "num_stitch_waits",
                 "num_ipc_rounds", "ipc_outside_bytes")


class _DeviceProperties(ctypes.Structure):  # gca_device_properties_t
    _fields_ = [("name", ctypes.c_char * 256), ("major", ctypes.c_int), ("minor", ctypes.c_int),
                ("multiprocessor_count", ctypes.c_int), ("total_memory", ctypes.c_uint64)]


class DeviceProperties(NamedTuple):
    """A device's properties, with the attribute names of torch.cuda.get_device_properties()."""
    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int


class _IpcPeer(ctypes.Structure):  # gca_ipc_peer_t
    _fields_ = [("pid", ctypes.c_int32), ("reserved_bytes", ctypes.c_uint64), ("allocated_bytes", ctypes.c_uint64),
                ("cached_bytes", ctypes.c_uint64), ("waiting_bytes", ctypes.c_uint64),
                ("paused_bytes", ctypes.c_uint64), ("requests", ctypes.c_uint64), ("bytes_received", ctypes.c_uint64),
                ("bytes_released", ctypes.c_uint64), ("timeouts", ctypes.c_uint64),
                ("avoidable_ooms", ctypes.c_uint64), ("silent_ms", ctypes.c_uint64)]


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
_sig("gca_mem_get_info", ctypes.c_int, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_sig("gca_get_memory_fraction", ctypes.c_int, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_double))
_sig("gca_device_properties", ctypes.c_int, _P, ctypes.c_int, ctypes.POINTER(_DeviceProperties))
_sig("gca_ipc_peers", ctypes.c_int, _P, ctypes.c_int, ctypes.POINTER(_IpcPeer), ctypes.c_size_t)
_sig("gca_can_access_peer", ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
_sig("gca_stats_flatten", ctypes.c_size_t, _P, ctypes.POINTER(_StatItem), ctypes.c_size_t)
_STATS_FLAT_COUNT = _lib.gca_stats_flatten(None, None, 0)  # GCA_STATS_FLAT_COUNT, as the library was built
_sig("gca_record_history", ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.c_size_t)
_sig("gca_record_history_ex", ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_size_t)
_sig("gca_host_malloc", _P, _P, ctypes.c_size_t)
_sig("gca_host_free", ctypes.c_int, _P, _P)
_sig("gca_host_record_stream", ctypes.c_int, _P, _P, ctypes.c_int, ctypes.c_size_t)
_sig("gca_host_empty_cache", ctypes.c_int, _P)
_sig("gca_host_is_pinned", ctypes.c_int, _P, _P, ctypes.POINTER(ctypes.c_int))
_sig("gca_host_stats", ctypes.c_int, _P, ctypes.POINTER(_HostStats))
_sig("gca_pool_get_stats", ctypes.c_int, _P, ctypes.c_uint64, ctypes.POINTER(_PoolStats))
_sig("gca_host_reset_peak_stats", ctypes.c_int, _P)
_sig("gca_pool_create", ctypes.c_int, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64))
_sig("gca_pool_create_ex", ctypes.c_int, _P, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(ctypes.c_uint64))
_sig("gca_pool_pause", ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_uint, ctypes.POINTER(ctypes.c_size_t))
_sig("gca_pool_resume", ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_uint)
_sig("gca_pool_pause_all", ctypes.c_int, _P, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(ctypes.c_size_t))
_sig("gca_pool_resume_all", ctypes.c_int, _P, ctypes.c_int, ctypes.c_uint)
_sig("gca_pool_backup", ctypes.c_int, _P, _P, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))
_sig("gca_pool_retain", ctypes.c_int, _P, ctypes.c_uint64)
_sig("gca_pool_release", ctypes.c_int, _P, ctypes.c_uint64)
_sig("gca_pool_push", ctypes.c_int, _P, ctypes.c_uint64)
_sig("gca_pool_pop", ctypes.c_int, _P)
_sig("gca_pool_route_stream", ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_size_t)
_sig("gca_pool_unroute_stream", ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_size_t)
_sig("gca_capture_begin", ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_size_t)
_sig("gca_capture_end", ctypes.c_int, _P, ctypes.c_uint64, ctypes.c_size_t)
_sig("gca_pool_of", ctypes.c_int, _P, _P, ctypes.POINTER(ctypes.c_uint64))
_sig("gca_pool_list", ctypes.c_int, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
_sig("gca_torch_init", ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p)
_sig("gca_torch_defer", ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p)
_sig("gca_npu_set_queue_drain", ctypes.c_int, _P)
_sig("gca_npu_set_stream_accessor", ctypes.c_int, _P)
_sig("gca_npu_set_workspace_release", ctypes.c_int, _P, ctypes.c_int)
_sig("gca_torch_foreign_stream_uses", ctypes.c_size_t)
_sig("gca_torch_set_raise", ctypes.c_int, _P)
_sig("gca_torch_set_raise_oom", ctypes.c_int, _P)
_sig("gca_torch_allocator", _P)
_sig("gca_torch_is_open", ctypes.c_int)
_sig("gca_torch_malloc", _P, ctypes.c_ssize_t, ctypes.c_int, _P)
_sig("gca_torch_free", None, _P, ctypes.c_ssize_t, ctypes.c_int, _P)
_sig("gca_torch_shutdown", None)
_sig("gca_torch_record_stream", None, _P, _P)
_sig("gca_torch_last_failure", ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t)

_LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_sig("gca_set_thread_log_handler", None, _LOG_FN, ctypes.c_void_p)
_LOG_LEVELS = ("off", "error", "warning", "info", "debug", "trace")
_collecting = threading.local()


@_LOG_FN
def _thread_log(level, message, user):
    """The calling thread's log during a call that applies a configuration: warnings are kept for
    Python's warnings module, anything else is written as the library's default handler writes it."""
    text = message.decode(errors="replace")
    kept = getattr(_collecting, "messages", None)
    if level == 2 and kept is not None:
        kept.append(text)
    else:
        sys.stderr.write("gcalloc: %s: %s\n" % (_LOG_LEVELS[level] if 0 <= level < 6 else level, text))


@contextlib.contextmanager
def _python_warnings(stacklevel=3):
    """Inside, the library's warnings on this thread become GcallocWarning (after the block, so that
    none is raised from inside a C call)."""
    if getattr(_collecting, "messages", None) is not None:  # (nested: the outer block raises them)
        yield
        return
    _collecting.messages = []
    _lib.gca_set_thread_log_handler(_thread_log, None)
    try:
        yield
    finally:
        _lib.gca_set_thread_log_handler(_LOG_FN(), None)
        messages, _collecting.messages = _collecting.messages, None
        for text in messages:
            warnings.warn(text, GcallocWarning, stacklevel=stacklevel)


# gca_stats_t (about 1 KiB) is read as opaque bytes and handed to
# gca_stats_flatten, which knows its layout: no structure to keep in step.
_STATS_BYTES = 4096


def _check(rc):
    if rc < 0:
        raise _error(rc, _lib.gca_last_error().decode())
    return rc


# Arguments are checked here, before ctypes sees them: ctypes converts an
# int to a C type by truncating it, so 2**64 + 4096 would become 4096.
_SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
_PTR_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_void_p))) - 1
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1


def _integer(value, name):
    if isinstance(value, bool):  # (an int to Python, almost always a slip here)
        raise TypeError("%s must be an int, not bool" % name)
    if not isinstance(value, int):
        try:
            value = value.__index__()
        except (AttributeError, TypeError):
            raise TypeError("%s must be an int, not %s" % (name, type(value).__name__)) from None
    return value


def _unsigned(value, name, top):
    value = _integer(value, name)
    if value < 0:
        raise ValueError("%s must be >= 0, not %d" % (name, value))
    if value > top:
        raise OverflowError("%s %d does not fit in %d bits" % (name, value, top.bit_length()))
    return value


def _size(value, name="size"):
    return _unsigned(value, name, _SIZE_MAX)


def _address(value, name="ptr"):
    return _unsigned(value, name, _PTR_MAX)


def _stream(value):
    return _unsigned(value, "stream", _PTR_MAX)


_DEVICE_TEXT = re.compile(r"(cuda|npu|sim|acl)(?::([0-9]+))?\Z")


def _current_device():
    """The calling thread's current device as PyTorch (or torch_npu) sees it
    where gcalloc is installed in it, else 0."""
    from . import torch as _torch_glue  # (imports nothing of PyTorch itself)

    return _torch_glue._current_device() if _torch_glue.installed() else 0


def _device(value, name="device", allow_all=False):
    """A device index from an int, "cuda:1" / "npu:1" (the type's current
    device without an index), a torch.device, or None (the current device)."""
    if value is None:
        return _current_device()
    if isinstance(value, str) or (hasattr(value, "type") and hasattr(value, "index") and not isinstance(value, int)):
        kind, index = (value.type, value.index) if not isinstance(value, str) else (None, None)
        if isinstance(value, str):
            m = _DEVICE_TEXT.match(value)
            if not m:
                raise ValueError("%s %r is not a device: give an int, 'cuda:N', 'npu:N', a torch.device or None"
                                 % (name, value))
            kind, index = m.group(1), m.group(2)
        if kind not in ("cuda", "npu", "sim", "acl"):
            raise ValueError("%s %r is a %s device, not one gcalloc manages" % (name, str(value), kind))
        return _current_device() if index is None else _device(int(index), name)
    value = _integer(value, name)
    if value < (-1 if allow_all else 0) or value > _INT_MAX:
        if value < _INT_MIN or value > _INT_MAX:
            raise OverflowError("%s %d does not fit in a C int" % (name, value))
        raise ValueError("%s must be %s, not %d" % (name, ">= -1 (-1: every device)" if allow_all else ">= 0", value))
    return value


def _pool(value, name="pool"):
    return _unsigned(value, name, (1 << 64) - 1)


def _fraction(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("fraction must be a float, not %s" % type(value).__name__)
    value = float(value)
    if not 0.0 <= value <= 1.0:  # (what torch.cuda.set_per_process_memory_fraction raises)
        raise ValueError("invalid fraction %r: it must be within [0, 1]" % value)
    return value


def _text(s, name="text"):
    if s is None:
        return None
    if isinstance(s, str):
        s = s.encode()
    elif not isinstance(s, bytes):
        raise TypeError("%s must be a str, not %s" % (name, type(s).__name__))
    if b"\0" in s:
        raise ValueError("%s contains a NUL character" % name)
    return s


def _allocated(size, call):
    """Run an allocating call: its address, 0 for size 0; OutOfMemoryError when out of memory."""
    size = _size(size)
    p = call(size)
    if not p:
        status = _lib.gca_last_status()
        if status < 0:
            _check(status)
    return p or 0


def version() -> str:
    """The library's version, "MAJOR.MINOR.PATCH" (gca_version)."""
    return _lib.gca_version().decode()


class Allocator:
    """An allocator on a backend ("sim", "sim:capacity=24GiB", "cuda") with a
    configuration string in PyTorch's syntax. Addresses are ints.

    Arguments are checked before they reach C: a value of the wrong type
    raises TypeError, a negative size or address ValueError, and one too
    large for its C type OverflowError (never truncated).

    Threads may share an Allocator. close() waits for the calls other threads
    have in flight, then closes; a call made after (or while close waits)
    raises GcallocError (status GCA_ERR_INVALID). The C allocator stays
    valid for the whole of every call that started before close."""

    def __init__(self, backend="sim", conf=None, _handle=None):
        self._cond = threading.Condition()
        self._in_flight = 0
        self._closing = False
        if _handle is not None:
            self._a, self._owned = _handle, False
            return
        handle = _P()
        with _python_warnings(stacklevel=4):
            rc = _lib.gca_open(_text(backend, "backend"), _text(conf, "conf"), ctypes.byref(handle))
        _check(rc)
        self._a, self._owned = handle, True

    def _enter(self, closed_ok=False):
        """The C allocator, held open until _leave(); GcallocError where it
        is closed (None with closed_ok)."""
        with self._cond:
            if self._closing or not self._a:
                if closed_ok:
                    return None
                raise GcallocError(GCA_ERR_INVALID, "gcalloc: the allocator is closed")
            self._in_flight += 1
            return self._a

    def _leave(self):
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._cond.notify_all()

    @contextlib.contextmanager
    def _handle(self):
        a = self._enter()
        try:
            yield a
        finally:
            self._leave()

    def _end_block(self, end, *args):
        """The end of a block (a pool push, a capture): nothing to end where
        another thread closed the allocator meanwhile, since the block's
        state ended with it."""
        a = self._enter(closed_ok=True)
        if a is None:
            return
        try:
            _check(end(a, *args))
        finally:
            self._leave()

    def close(self):
        cond = getattr(self, "_cond", None)
        if cond is None:  # (__init__ failed before it)
            return
        with cond:
            if self._closing:
                return
            self._closing = True
            while self._in_flight:
                cond.wait()
            a, self._a = self._a, None
        if self._owned and a:
            _lib.gca_close(a)

    @property
    def closed(self):
        return self._closing

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
        with self._handle() as a:
            return _check(_lib.gca_device_count(a))

    @property
    def backend(self):
        with self._handle() as a:
            return _lib.gca_backend_name(a).decode()

    def malloc(self, size, device=0, stream=0):
        """Device address of `size` bytes; MemoryError when out of memory."""
        device, stream = _device(device), _stream(stream)
        with self._handle() as a:
            return _allocated(size, lambda n: _lib.gca_malloc(a, n, device, stream))

    def free(self, ptr):
        """Free an address malloc returned; None (or 0) does nothing, as free(NULL)."""
        if ptr is None:
            return
        ptr = _address(ptr)
        with self._handle() as a:
            _check(_lib.gca_free(a, ptr))

    def record_stream(self, ptr, stream):
        ptr, stream = _address(ptr), _stream(stream)
        with self._handle() as a:
            _check(_lib.gca_record_stream(a, ptr, stream))

    def empty_cache(self, device=-1):
        device = _device(device, allow_all=True)
        with self._handle() as a:
            _check(_lib.gca_empty_cache(a, device))

    def synchronize(self, device=-1):
        device = _device(device, allow_all=True)
        with self._handle() as a:
            _check(_lib.gca_synchronize(a, device))

    # ---- private pools (docs/pools.md) ----

    def create_pool(self, device=0, pausable=False, fine_pages=False):
        """A new private pool on `device`: its id (an int > 0), holding one reference. A pausable pool
        can give its memory back and take it again at the same addresses (pause_pool, resume_pool);
        with fine_pages its segments map 2 MiB pages in both size classes (GCA_POOL_FINE_PAGES)."""
        device = _device(device)
        out = ctypes.c_uint64()
        flags = (1 if pausable else 0) | (2 if fine_pages else 0)
        with self._handle() as a:
            _check(_lib.gca_pool_create_ex(a, device, flags, ctypes.byref(out)))
        return out.value

    def pause_pool(self, pool, backup=False):
        """Give a pausable pool's memory back, keeping its addresses (with backup, a pinned host copy of
        every live block first); the bytes given back."""
        pool = _pool(pool)
        released = ctypes.c_size_t()
        with self._handle() as a:
            _check(_lib.gca_pool_pause(a, pool, 1 if backup else 0, ctypes.byref(released)))
        return released.value

    def resume_pool(self, pool, keep_backup=False):
        """Map new memory at a paused pool's addresses and write its copies back."""
        pool = _pool(pool)
        with self._handle() as a:
            _check(_lib.gca_pool_resume(a, pool, 1 if keep_backup else 0))

    def pause_pools(self, device=None, backup=False):
        """pause_pool for every pausable pool that runs on `device` (None: every device); the bytes given
        back. Every pool is tried; the first failure raises, the others are paused."""
        device = -1 if device is None else _device(device)
        released = ctypes.c_size_t()
        with self._handle() as a:
            _check(_lib.gca_pool_pause_all(a, device, 1 if backup else 0, ctypes.byref(released)))
        return released.value

    def resume_pools(self, device=None, keep_backup=False):
        """resume_pool for every paused pool on `device` (None: every device)."""
        device = -1 if device is None else _device(device)
        with self._handle() as a:
            _check(_lib.gca_pool_resume_all(a, device, 1 if keep_backup else 0))

    def pool_backup(self, ptr):
        """The host copy of a paused block (pause_pool with backup, or kept by resume_pool with
        keep_backup), from `ptr` to the end of its block, as a read-only memoryview: valid until the pool
        resumes without keep_backup, pauses again, or the block is freed. GcallocError where `ptr` has
        none."""
        host, size = ctypes.c_void_p(), ctypes.c_size_t()
        with self._handle() as a:
            _check(_lib.gca_pool_backup(a, _address(ptr), ctypes.byref(host), ctypes.byref(size)))
        return memoryview((ctypes.c_char * size.value).from_address(host.value)).toreadonly()

    def retain_pool(self, pool):
        pool = _pool(pool)
        with self._handle() as a:
            _check(_lib.gca_pool_retain(a, pool))

    def release_pool(self, pool):
        """Drop a reference; the last one gives the pool's memory back (refused while anything in it is live)."""
        pool = _pool(pool)
        with self._handle() as a:
            _check(_lib.gca_pool_release(a, pool))

    @contextlib.contextmanager
    def pool(self, pool):
        """Inside the block, this thread's allocations go to `pool` (0: the default pool)."""
        pool = _pool(pool)
        with self._handle() as a:
            _check(_lib.gca_pool_push(a, pool))
        try:
            yield pool
        finally:
            self._end_block(_lib.gca_pool_pop)

    def route_stream(self, pool, stream):
        pool, stream = _pool(pool), _stream(stream)
        with self._handle() as a:
            _check(_lib.gca_pool_route_stream(a, pool, stream))

    def unroute_stream(self, pool, stream):
        pool, stream = _pool(pool), _stream(stream)
        with self._handle() as a:
            _check(_lib.gca_pool_unroute_stream(a, pool, stream))

    @contextlib.contextmanager
    def capture(self, pool, stream):
        """A graph capture of `stream` into `pool` for the block's length (gca_capture_begin/end)."""
        pool, stream = _pool(pool), _stream(stream)
        with self._handle() as a:
            _check(_lib.gca_capture_begin(a, pool, stream))
        try:
            yield pool
        finally:
            self._end_block(_lib.gca_capture_end, pool, stream)

    def pool_stats(self, pool):
        """What the pool holds now, as a dict (gca_pool_stats_t's fields)."""
        pool = _pool(pool)
        s = _PoolStats()
        with self._handle() as a:
            _check(_lib.gca_pool_get_stats(a, pool, ctypes.byref(s)))
        return {name: getattr(s, name) for name, _ in _PoolStats._fields_}

    def _answer(self, call, kind, *args):
        """The value a C call writes through its last argument, a pointer to `kind`."""
        out = kind()
        with self._handle() as a:
            _check(call(a, *args, ctypes.byref(out)))
        return out.value

    def pool_of(self, ptr):
        """The pool of a live allocation (0: the default pool)."""
        return self._answer(_lib.gca_pool_of, ctypes.c_uint64, _address(ptr))

    def pools(self, device=0):
        """The ids of the device's private pools, oldest first."""
        device = _device(device)
        with self._handle() as a:
            n = _check(_lib.gca_pool_list(a, device, None, 0))
            ids = (ctypes.c_uint64 * max(n, 1))()
            n = _check(_lib.gca_pool_list(a, device, ids, n))
        return list(ids[:n])

    def set_config(self, conf):
        """Apply a configuration string on top of the settings in force (gca_set_config); keys gcalloc
        does not know or does not build raise GcallocWarning."""
        conf = _text(conf, "conf")
        with self._handle() as a, _python_warnings(stacklevel=5):
            rc = _lib.gca_set_config(a, conf)
        _check(rc)

    def get_config(self):
        with self._handle() as a:
            n = _check(_lib.gca_get_config(a, None, 0))
            buf = ctypes.create_string_buffer(n + 1)
            _check(_lib.gca_get_config(a, buf, n + 1))
        return buf.value.decode()

    def set_per_process_memory_fraction(self, fraction, device=0):
        fraction, device = _fraction(fraction), _device(device)
        with self._handle() as a:
            _check(_lib.gca_set_memory_fraction(a, fraction, device))

    def get_per_process_memory_fraction(self, device=0):
        """The memory fraction in force on the device (1.0 when none was set)."""
        return self._answer(_lib.gca_get_memory_fraction, ctypes.c_double, _device(device))

    def mem_get_info(self, device=0):
        """(free, total) bytes of the device, as its driver reports them."""
        device = _device(device)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with self._handle() as a:
            _check(_lib.gca_mem_get_info(a, device, ctypes.byref(free), ctypes.byref(total)))
        return free.value, total.value

    def device_properties(self, device=0):
        """The device's DeviceProperties."""
        device = _device(device)
        p = _DeviceProperties()
        with self._handle() as a:
            _check(_lib.gca_device_properties(a, device, ctypes.byref(p)))
        return DeviceProperties(p.name.decode(errors="replace"), p.major, p.minor, p.multiprocessor_count,
                                p.total_memory)

    def can_access_peer(self, device, peer):
        """Whether `device` can reach `peer`'s memory once peer access is enabled (False where the
        backend has no peers, as the sim)."""
        device, peer = _device(device), _device(peer, "peer")
        can = ctypes.c_int(0)
        with self._handle() as a:
            rc = _lib.gca_can_access_peer(a, device, peer, ctypes.byref(can))
        if rc == GCA_ERR_BACKEND and device != peer:
            return False
        _check(rc)
        return bool(can.value)

    def ipc_peers(self, device=0):
        """The processes cooperating on the device (ipc_cooperation:True; this one included), as each last
        published itself: dicts of pid, reserved_bytes, allocated_bytes (with device memory under it),
        cached_bytes, waiting_bytes, paused_bytes (allocated in paused pools: no device memory under it),
        and its cooperation so far: requests, bytes_received, bytes_released (for the others' requests),
        timeouts, avoidable_ooms. GcallocError where cooperation is off for the device."""
        device = _device(device)
        with self._handle() as a:
            n = _check(_lib.gca_ipc_peers(a, device, None, 0))
            peers = (_IpcPeer * max(n, 1))()
            n = min(_check(_lib.gca_ipc_peers(a, device, peers, n)), n)
        return [{name: getattr(p, name) for name, _ in _IpcPeer._fields_} for p in peers[:n]]

    def gcalloc_stats(self, device=0):
        """gcalloc's own counters of the device (gcalloc.gcalloc_stats)."""
        device = _device(device)
        st = _Stats()
        with self._handle() as a:
            _check(_lib.gca_get_stats(a, device, ctypes.byref(st)))
        return {name: getattr(st, name) for name in _OWN_COUNTERS}

    def reset_peak_memory_stats(self, device=0):
        device = _device(device)
        with self._handle() as a:
            _check(_lib.gca_reset_peak_stats(a, device))

    def reset_accumulated_memory_stats(self, device=0):
        device = _device(device)
        with self._handle() as a:
            _check(_lib.gca_reset_accumulated_stats(a, device))

    def memory_stats(self, device=0):
        """torch.cuda.memory_stats(): the same keys, in the same order."""
        device = _device(device)
        raw = ctypes.create_string_buffer(_STATS_BYTES)
        with self._handle() as a:
            _check(_lib.gca_get_stats(a, device, raw))
        items = (_StatItem * _STATS_FLAT_COUNT)()
        n = _lib.gca_stats_flatten(raw, items, _STATS_FLAT_COUNT)
        return {items[i].name.decode(): items[i].value for i in range(min(n, _STATS_FLAT_COUNT))}

    def memory_summary(self, device=0, abbreviated=False):
        """torch.cuda.memory_summary()'s table."""
        device = _device(device)
        with self._handle() as a:
            n = _check(_lib.gca_memory_summary(a, device, int(bool(abbreviated)), None, 0))
            buf = ctypes.create_string_buffer(n + 1)
            _check(_lib.gca_memory_summary(a, device, int(bool(abbreviated)), buf, n + 1))
        return buf.value.decode()

    # Pinned host memory (gca_host_*): PyTorch's CachingHostAllocator.

    def host_malloc(self, size):
        """Address of `size` bytes of pinned host memory (0 for size 0); MemoryError when out of it."""
        with self._handle() as a:
            return _allocated(size, lambda n: _lib.gca_host_malloc(a, n))

    def host_free(self, ptr):
        """Free an address host_malloc returned; None (or 0) does nothing."""
        if ptr is None:
            return
        ptr = _address(ptr)
        with self._handle() as a:
            _check(_lib.gca_host_free(a, ptr))

    def host_record_stream(self, ptr, stream, device=0):
        ptr, stream, device = _address(ptr), _stream(stream), _device(device)
        with self._handle() as a:
            _check(_lib.gca_host_record_stream(a, ptr, device, stream))

    def host_empty_cache(self):
        with self._handle() as a:
            _check(_lib.gca_host_empty_cache(a))

    def host_is_pinned(self, ptr):
        """Whether the address lies in pinned host memory this allocator handed out."""
        return bool(self._answer(_lib.gca_host_is_pinned, ctypes.c_int, _address(ptr)))

    def host_memory_stats(self):
        """torch.cuda.host_memory_stats(): its keys ("allocation.current", "host_alloc_time.total",
        "num_host_alloc", ...), then gcalloc's own (pending_blocks, cached_bytes, ...)."""
        st = _HostStats()
        with self._handle() as a:
            _check(_lib.gca_host_stats(a, ctypes.byref(st)))
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
        with self._handle() as a:
            _check(_lib.gca_host_reset_peak_stats(a))

    def record_history(self, enabled=True, context="state", max_entries=100000, stacks="all"):
        """Start (or, enabled False, stop) the history of every device: the last `max_entries` events;
        `context` None, "state" (stacks of live blocks), "alloc" (and of allocations) or "all" (and of
        frees); `stacks` "all" (the calling Python thread's frames, then native ones), "python" (Python
        frames only) or "native"."""
        levels = {None: 0, "none": 0, "state": 1, "alloc": 2, "all": 3}
        frames = {"native": 0, "python": 1, "all": 2}
        if context not in levels:
            raise ValueError("context must be one of None, 'none', 'state', 'alloc', 'all', not %r" % (context,))
        if stacks not in frames:
            raise ValueError("stacks must be 'all', 'python' or 'native', not %r" % (stacks,))
        max_entries = _size(max_entries, "max_entries")
        with self._handle() as a:
            _check(_lib.gca_record_history_ex(a, int(bool(enabled)), levels[context], frames[stacks], max_entries))

    def _write_snapshot(self, path, fmt):
        path = _text(os.fspath(path), "path")
        snap = _P()
        with self._handle() as a:
            _check(_lib.gca_snapshot_take(a, ctypes.byref(snap)))
        try:
            _check(_lib.gca_snapshot_write(snap, path, fmt))
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


def _process_allocator() -> "Allocator":
    """The process-wide allocator (the one PyTorch uses once gcalloc.torch or
    gcalloc.torch_npu is installed), opened on first use on
    $GCALLOC_TORCH_BACKEND (default cuda) with the environment's settings."""
    with _python_warnings(stacklevel=5):
        a = _lib.gca_torch_allocator()
    if not a:
        raise _error(_lib.gca_last_status(), _lib.gca_last_error().decode())
    return Allocator(_handle=a)


# ---- module-level functions: torch.cuda's memory and device API, on the
# process-wide allocator, whatever its backend (sim, cuda, acl). `device` is
# an int, "cuda:1" / "npu:1", a torch.device, or None (the current device).

Device = Union[int, str, Any, None]


def device_count() -> int:
    """The devices of the process-wide allocator's backend."""
    return _process_allocator().device_count


def synchronize(device: Device = None) -> None:
    """Wait for the device's work and complete the frees that waited for it."""
    _process_allocator().synchronize(_device(device))


def empty_cache() -> None:
    """Give every unused cached segment of every device back (torch.cuda.empty_cache)."""
    _process_allocator().empty_cache(-1)


def mem_get_info(device: Device = None) -> Tuple[int, int]:
    """(free, total) bytes of the device, as the driver reports them (torch.cuda.mem_get_info)."""
    return _process_allocator().mem_get_info(_device(device))


def memory_stats(device: Device = None) -> Dict[str, int]:
    """torch.cuda.memory_stats(): the same keys, in the same order."""
    return _process_allocator().memory_stats(_device(device))


def memory_stats_as_nested_dict(device: Device = None) -> Dict[str, Any]:
    """torch.cuda.memory_stats_as_nested_dict(): the flat keys split at their dots."""
    nested: Dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        *path, last = key.split(".")
        level = nested
        for part in path:
            level = level.setdefault(part, {})
        level[last] = value
    return nested


def memory_allocated(device: Device = None) -> int:
    """Bytes in allocated blocks now (torch.cuda.memory_allocated)."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: Device = None) -> int:
    """The peak of memory_allocated since the start or the last reset."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: Device = None) -> int:
    """Bytes the allocator holds from the device now, cached included (torch.cuda.memory_reserved)."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: Device = None) -> int:
    """The peak of memory_reserved since the start or the last reset."""
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: Device = None) -> None:
    """Every peak set to its current value (torch.cuda.reset_peak_memory_stats)."""
    _process_allocator().reset_peak_memory_stats(_device(device))


def reset_max_memory_allocated(device: Device = None) -> None:
    """As torch.cuda.reset_max_memory_allocated: resets every peak."""
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: Device = None) -> None:
    """Every allocated/freed total and num_* counter set to 0."""
    _process_allocator().reset_accumulated_memory_stats(_device(device))


def memory_summary(device: Device = None, abbreviated: bool = False) -> str:
    """torch.cuda.memory_summary()'s table."""
    return _process_allocator().memory_summary(_device(device), abbreviated)


def gcalloc_stats(device: Device = None) -> Dict[str, int]:
    """gcalloc's own counters, which torch.cuda.memory_stats() has no keys for: cross-stream reuses,
    device frees refused, garbage-collection releases, allocations that waited, OOM-handler retries,
    pages moved by stitching, and the requests to (and bytes from) processes sharing the device."""
    return _process_allocator().gcalloc_stats(_device(device))


def ipc_peers(device: Device = None) -> list:
    """The processes cooperating on the device with the process-wide allocator (docs/sharing.md)."""
    return _process_allocator().ipc_peers(_device(device))


def memory_snapshot() -> Dict[str, Any]:
    """torch.cuda.memory._snapshot(): a dict with segments, device_traces and allocator_settings."""
    return _process_allocator().memory_snapshot()


def dump_snapshot(path: Union[str, "os.PathLike[str]"]) -> None:
    """torch.cuda.memory._dump_snapshot(path): a pickle memory_viz opens."""
    _process_allocator().dump_snapshot(path)


def record_memory_history(enabled: Optional[str] = "all", context: Optional[str] = "all",
                          stacks: str = "all", max_entries: int = 100000) -> None:
    """torch.cuda.memory._record_memory_history on every device of the process-wide allocator:
    `enabled` None stops, "state" keeps the stacks of live blocks only, "all" also the history of
    allocations and frees (max_entries of them); `context` None, "state", "alloc" or "all" says which
    events keep a stack; `stacks` "python" (the calling thread's Python frames) or "all" (those, then
    the native ones)."""
    if stacks not in ("python", "all"):
        raise ValueError("stacks must be 'python' or 'all', not %r" % (stacks,))
    if enabled not in (None, "state", "all"):
        raise ValueError("enabled must be None, 'state' or 'all', not %r" % (enabled,))
    allocator = _process_allocator()
    for device in range(allocator.device_count):
        allocator.record_history(enabled is not None, context if enabled == "all" else "state",
                                 max_entries if enabled == "all" else 1, stacks)


def set_per_process_memory_fraction(fraction: float, device: Device = None) -> None:
    """Limit what the device may reserve to fraction x its memory (ValueError outside [0, 1])."""
    _process_allocator().set_per_process_memory_fraction(fraction, _device(device))


def get_per_process_memory_fraction(device: Device = None) -> float:
    """The fraction in force (1.0 when none was set)."""
    return _process_allocator().get_per_process_memory_fraction(_device(device))


def get_device_properties(device: Device = None) -> "DeviceProperties":
    """The device's name, compute capability, multiprocessor count and total memory."""
    return _process_allocator().device_properties(_device(device))


def can_device_access_peer(device: Device, peer: Device) -> bool:
    """Whether `device` can reach `peer`'s memory once peer access is enabled (False on the sim)."""
    return _process_allocator().can_access_peer(_device(device), _device(peer, "peer"))


def host_memory_stats() -> Dict[str, int]:
    """torch.cuda.host_memory_stats() of the pinned host allocator, then gcalloc's own keys."""
    return _process_allocator().host_memory_stats()


def host_empty_cache() -> None:
    """Give the pinned host allocator's unused blocks back."""
    _process_allocator().host_empty_cache()
