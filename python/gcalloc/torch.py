"""gcalloc as PyTorch's CUDA allocator.

    import gcalloc.torch
    gcalloc.torch.install("expandable_segments:True")   # before CUDA is initialized (the first CUDA call)
    ...
    torch.cuda.memory_stats()   # gcalloc's, with PyTorch's keys and formats

install() opens gcalloc's process-wide allocator (gca_torch_init) and hands
its C functions gca_torch_malloc / gca_torch_free to
torch.cuda.memory.CUDAPluggableAllocator, passes gcalloc's C functions to
the optional hooks the running PyTorch offers (empty_cache, the memory
fraction, every record_stream, CUDA's initialization, base allocations),
makes it the current allocator, and routes PyTorch's memory functions,
which raise or do nothing under a pluggable allocator, to gcalloc
(ROUTED). PyTorch accepts that only before its allocator has been used,
and offers no way back: the context manager `using(conf)` installs on entry
and on exit waits for the device and empties gcalloc's cache, but PyTorch
keeps allocating through gcalloc afterwards.
"""
import collections
import contextlib
import ctypes
import os
import sys
import threading
import warnings

from . import GCA_ERR_INVALID, GcallocError, GcallocWarning, OutOfMemoryError, _device, _lib, _oom_error, _python_warnings, _text, library_path

# The oldest PyTorch with torch.cuda.memory.CUDAPluggableAllocator.
MINIMUM_TORCH = "2.0"

__all__ = ["install", "using", "installed", "hooks", "routed", "raises", "raises_out_of_memory", "last_failure", "foreign_stream_uses", "pool", "pause",
           "resume", "cpu_backup", "region", "cuda_graph", "regions", "MINIMUM_TORCH", "ROUTED"]

# void c10::detail::torchCheckFail(const char *func, const char *file, uint32_t line, const char *msg)
# in PyTorch's libc10.so: it throws c10::Error, which Python sees as RuntimeError.
RAISE_SYMBOL = "_ZN3c106detail14torchCheckFailEPKcS2_jS2_"

# The same signature, throwing c10::OutOfMemoryError, which PyTorch's Python bindings turn into
# torch.OutOfMemoryError. libc10 exports nothing that throws that class (PyTorch's allocator
# constructs it inline), so install() builds these lines against the running PyTorch's own headers
# (torch/include) and libc10, with its std::string ABI, once per PyTorch, into gcalloc's cache
# (GCALLOC_CACHE_DIR, else $XDG_CACHE_HOME/gcalloc, else ~/.cache/gcalloc).
OOM_RAISER_SYMBOL = "gcalloc_throw_out_of_memory"
OOM_RAISER_SOURCE = r"""
#include <c10/util/Exception.h>
extern "C" __attribute__((visibility("default"))) void gcalloc_throw_out_of_memory(
    const char *func, const char *file, uint32_t line, const char *msg) {
  throw c10::OutOfMemoryError(c10::SourceLocation{func, file, line}, std::string(msg ? msg : ""));
}
"""

# The pluggable allocator's hooks, and gcalloc's function for each, with
# the C signature the hook's C++ type has (include/gcalloc.h). The graph
# hooks (PyTorch 2.3+) take a pool id (a pair of 64-bit integers) and, to
# begin, a std::function filter by hidden reference, which gcalloc does not
# call: the driver says which stream captures. PyTorch 2.1 and 2.2 have
# the begin and end in another form, naming the capturing stream.
HOOKS = (("set_reset_fn", "gca_torch_empty_cache"),
         ("set_memory_fraction_fn", "gca_torch_set_memory_fraction"),
         ("set_record_stream_fn", "gca_torch_record_stream"),
         ("set_init_fn", "gca_torch_init_devices"),
         ("set_base_alloc_fn", "gca_torch_base_alloc"),
         ("set_begin_allocate_to_pool", "gca_torch_begin_allocate_to_pool"),
         ("set_end_allocate_to_pool_fn", "gca_torch_end_allocate_to_pool"),
         ("set_release_pool", "gca_torch_release_pool"),
         ("set_begin_allocate_stream_to_pool", "gca_torch_begin_allocate_stream_to_pool"),
         ("set_end_allocate_stream_to_pool_fn", "gca_torch_end_allocate_stream_to_pool"))

# PyTorch's memory functions that raise (or do nothing) under a pluggable
# allocator, answered by gcalloc once installed, in torch.cuda and
# torch.cuda.memory wherever the running PyTorch has them.
ROUTED = ("memory_stats", "memory_stats_as_nested_dict", "memory_allocated", "max_memory_allocated",
          "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached",
          "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
          "reset_accumulated_memory_stats", "memory_summary", "memory_snapshot", "mem_get_info",
          "get_per_process_memory_fraction", "_record_memory_history", "_snapshot", "_dump_snapshot",
          "_set_allocator_settings")

# PyTorch keeps its whole history by default (max_entries sys.maxsize);
# gcalloc's is a ring allocated up front, of this many entries then.
DEFAULT_HISTORY = 100000

_installed = False
_hooks = []
_raise = [None]  # the libc10 whose torchCheckFail refuses allocations
_raise_oom = [None]  # the built raiser of c10::OutOfMemoryError (OOM_RAISER_SOURCE)
_routed = []
_named_pools = {}  # (process allocator, name, device) -> pool id
_named_lock = threading.Lock()
_history_settings = [None]  # what _record_memory_history last started, through the routed function


def installed():
    """Whether install() has made gcalloc PyTorch's allocator in this process."""
    return _installed


def hooks():
    """The pluggable allocator's hooks install() set (the running PyTorch's, of HOOKS)."""
    return list(_hooks)


def routed():
    """The names in torch.cuda and torch.cuda.memory install() routed to gcalloc."""
    return list(_routed)


def raises():
    """The libc10.so through which an allocation gcalloc refuses raises in PyTorch (install() connects it;
    RuntimeError("gcalloc: CUDA ...")); None where it was not found (gcalloc.torch.install then refuses:
    PyTorch would get NULL, which it does not check)."""
    return _raise[0]


def raises_out_of_memory():
    """The library, built at install() against the running PyTorch, through which out of memory raises
    torch.OutOfMemoryError; None where it could not be built (out of memory is a RuntimeError then, and
    install() warned why)."""
    return _raise_oom[0]


def _cache_dir():
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("GCALLOC_CACHE_DIR") or os.path.join(home, "gcalloc")


def _build_oom_raiser(torch, root, libc10):
    """OOM_RAISER_SOURCE built against the PyTorch in `root`: (the library's path, None), or (None, why
    not). Reused from the cache where it was built for the same source, PyTorch, ABI and compiler."""
    import hashlib
    import shutil
    import subprocess
    import tempfile

    header = os.path.join(root, "include", "c10", "util", "Exception.h")
    if not os.path.exists(header):
        return None, "this PyTorch has no C++ headers (no %s)" % header
    cxx = os.environ.get("CXX") or next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)
    if not cxx:
        return None, "no C++ compiler was found (c++, g++ or clang++ on PATH, or $CXX)"
    abi = int(bool(getattr(getattr(torch, "_C", None), "_GLIBCXX_USE_CXX11_ABI", True)))
    lib_dir = os.path.dirname(libc10)
    stat = os.stat(libc10)
    key = hashlib.sha256(repr((OOM_RAISER_SOURCE, getattr(torch, "__version__", ""), os.path.realpath(libc10),
                               stat.st_size, stat.st_mtime_ns, abi, cxx)).encode()).hexdigest()[:16]
    cache = _cache_dir()
    out = os.path.join(cache, "oom-raiser-%s.so" % key)
    if os.path.exists(out):
        return out, None
    try:
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as work:
            source, built = os.path.join(work, "raiser.cpp"), os.path.join(work, "raiser.so")
            with open(source, "w") as f:
                f.write(OOM_RAISER_SOURCE)
            for standard in ("c++17", "c++20"):  # (PyTorch's headers need C++17; a newer one may need more)
                command = [cxx, "-std=" + standard, "-O1", "-shared", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi,
                           "-I", os.path.join(root, "include"), source, "-o", built, "-L", lib_dir, "-lc10",
                           "-Wl,-rpath," + lib_dir, "-Wl,--no-undefined"]
                done = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if done.returncode == 0:
                    break
            if done.returncode != 0:
                said = (done.stderr or done.stdout).strip().splitlines()[-3:]
                return None, "building it with %s failed: %s" % (cxx, " / ".join(said) or "exit %d" % done.returncode)
            os.replace(built, out)  # (atomic: processes building at once each put a whole library there)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "building it in %s failed: %s" % (cache, e)
    return out, None


def _find_raisers(torch, build=True):
    """The running PyTorch's ways to refuse an allocation: (its libc10's path, torchCheckFail's address
    or None, the built c10::OutOfMemoryError raiser's (path, address) or None, why not that)."""
    if torch is None or not getattr(torch, "__file__", None):
        return None, None, None, "the framework's torch module has no file"
    root = os.path.dirname(os.path.abspath(torch.__file__))
    path = os.path.join(root, "lib", "libc10.so")
    try:  # (already loaded by PyTorch: the same copy)
        check = ctypes.cast(getattr(ctypes.CDLL(path), RAISE_SYMBOL), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return path, None, None, "%s lacks c10::detail::torchCheckFail" % path
    if not build:
        return path, check, None, "GCALLOC_TORCH_BUILD_RAISER=0"
    built, why = _build_oom_raiser(torch, root, path)
    if built is None:
        return path, check, None, why
    try:
        oom = ctypes.cast(getattr(ctypes.CDLL(built), OOM_RAISER_SYMBOL), ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        return path, check, None, "the built raiser %s does not load: %s" % (built, e)
    return path, check, (built, oom), None


def _connect_raise(torch, raisers=None):
    """Hand the running PyTorch's raisers (_find_raisers) to gcalloc (gca_torch_set_raise and
    gca_torch_set_raise_oom); the reason out of memory is not torch.OutOfMemoryError, or None."""
    path, check, oom, why = raisers or _find_raisers(torch, _build_wanted())
    if check is not None:
        _lib.gca_torch_set_raise(ctypes.c_void_p(check))
        _raise[0] = path
    if oom is not None:
        _lib.gca_torch_set_raise_oom(ctypes.c_void_p(oom[1]))
        _raise_oom[0] = oom[0]
    return why


def _build_wanted():
    value = os.environ.get("GCALLOC_TORCH_BUILD_RAISER", "1")
    if value not in ("0", "1"):
        raise GcallocError(GCA_ERR_INVALID, "GCALLOC_TORCH_BUILD_RAISER=%r: expected 1 (build the raiser of "
                           "torch.OutOfMemoryError, the default) or 0 (out of memory raises RuntimeError)" % value)
    return value == "1"


def install(conf=None, backend=None):
    """Make gcalloc PyTorch's CUDA allocator. `conf` is a configuration in
    PYTORCH_CUDA_ALLOC_CONF's syntax (on top of the environment's); `backend`
    defaults to $GCALLOC_TORCH_BACKEND, else "cuda"."""
    global _installed
    import torch  # only here: the rest of the package works without PyTorch

    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    if not hasattr(memory, "CUDAPluggableAllocator") or not hasattr(memory, "change_current_allocator"):
        raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.install needs PyTorch %s or newer "
                           "(torch.cuda.memory.CUDAPluggableAllocator); this is torch %s"
                           % (MINIMUM_TORCH, getattr(torch, "__version__", "of an unknown version")))
    raisers = None
    if not _installed:
        _check_installable(torch)  # (before anything is opened)
        raisers = _find_raisers(torch, _build_wanted())
        if raisers[1] is None:
            raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.install: no way to refuse PyTorch an allocation: %s. "
                               "PyTorch does not check the pointer an allocator returns, so gcalloc must throw "
                               "into it; without that, out of memory would become an illegal memory access. "
                               "Is this a PyTorch wheel or build with its lib/ beside torch/__init__.py?"
                               % raisers[3])
    _use_torch_oom_error(torch)
    was_open = bool(_lib.gca_torch_is_open())
    with _python_warnings():
        rc = _lib.gca_torch_init(_text(backend), _text(conf))
    if rc < 0:
        raise GcallocError(rc, _lib.gca_last_error().decode())
    if _installed:
        return
    try:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path, "gca_torch_malloc", "gca_torch_free")
        hooks_set = _set_hooks(allocator, HOOKS)
        torch.cuda.memory.change_current_allocator(allocator)
    except Exception as e:  # (PyTorch's own refusal: nothing of gcalloc's is left open)
        if not was_open:
            _lib.gca_torch_shutdown()
        raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.install: PyTorch refused gcalloc as its CUDA allocator: "
                           "%s: %s" % (type(e).__name__, e)) from e
    why = _connect_raise(torch, raisers)
    if why is not None and why != "GCALLOC_TORCH_BUILD_RAISER=0":
        warnings.warn("gcalloc.torch.install: out of memory will raise RuntimeError(\"gcalloc: CUDA out of memory. "
                      "...\"), not torch.OutOfMemoryError: the raiser of that class is built at install() against "
                      "PyTorch's headers, and %s. Code that catches torch.OutOfMemoryError should catch "
                      "RuntimeError and look for \"out of memory\" in its message; set "
                      "GCALLOC_TORCH_BUILD_RAISER=0 to choose that and silence this" % why, GcallocWarning,
                      stacklevel=2)
    _hooks[:] = hooks_set
    if "set_record_stream_fn" not in hooks_set:
        _wrap_record_stream(torch, lambda t: t.is_cuda, lambda stream: stream.cuda_stream)
    modules = [torch.cuda.memory, torch.cuda]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:  # (PyTorch 2.9+: torch.accelerator.memory_stats and the like)
        modules.append(accelerator)
    _routed[:] = _route_memory_functions(modules, ROUTED)
    _installed = True


def _check_installable(torch):
    """Refuse, before anything is opened, where PyTorch cannot take a
    pluggable CUDA allocator: a build without CUDA, or CUDA already
    initialized in this process (PyTorch then keeps the allocator it has)."""
    native = getattr(torch, "_C", None)
    if native is not None and not hasattr(native, "_cuda_customAllocator"):
        raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.install: this PyTorch (torch %s) was built without CUDA "
                           "(torch.version.cuda is %r): it has no CUDA allocator to replace. gcalloc's own API "
                           "(gcalloc.Allocator) works without PyTorch"
                           % (getattr(torch, "__version__", "of an unknown version"),
                              getattr(getattr(torch, "version", None), "cuda", None)))
    is_initialized = getattr(torch.cuda, "is_initialized", None)
    if callable(is_initialized) and is_initialized():
        raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.install: CUDA is already initialized in this process, and "
                           "PyTorch cannot change its allocator after that (\"Can't swap an already initialized "
                           "allocator\"). Call install() before the first CUDA call (a tensor on the GPU, "
                           "torch.cuda.current_device(), set_device, synchronize, a CUDA RNG seed): first thing "
                           "in the program, or in a launcher before it runs")


def _set_hooks(allocator, hooks):
    """Pass gcalloc's C function for each of `hooks` ((setter, symbol)) the
    pluggable allocator's native object has; the setters called."""
    native = allocator.allocator() if callable(getattr(allocator, "allocator", None)) else None
    done = []
    for method, symbol in hooks:
        setter = getattr(native, method, None)
        if callable(setter):
            setter(ctypes.cast(getattr(_lib, symbol), ctypes.c_void_p).value)
            done.append(method)
    return done


def _use_torch_oom_error(torch):
    """From now on gcalloc's out-of-memory errors are torch.OutOfMemoryError
    too, so that code catching PyTorch's catches gcalloc's."""
    base = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if not isinstance(base, type) or not issubclass(base, BaseException) or issubclass(_oom_error[0], base):
        return

    class TorchOutOfMemoryError(OutOfMemoryError, base):
        """gcalloc.OutOfMemoryError that is also torch.OutOfMemoryError."""

    TorchOutOfMemoryError.__module__ = OutOfMemoryError.__module__
    _oom_error[0] = TorchOutOfMemoryError


def _history_arguments(enabled, context, stacks, max_entries, kwargs):
    """PyTorch's _record_memory_history arguments, the current ones or the
    legacy (enabled: bool, trace_alloc_max_entries, ...), as
    gcalloc.record_memory_history's."""
    if isinstance(enabled, bool):  # (PyTorch 2.0's signature)
        entries = kwargs.get("trace_alloc_max_entries", 1)
        if not enabled:
            return None, context, stacks, max_entries
        return ("all" if entries > 1 else "state"), "all", "all", entries
    if max_entries == sys.maxsize:
        max_entries = DEFAULT_HISTORY
    return enabled, context, stacks if stacks in ("python", "all") else "all", max_entries


def _route_memory_functions(modules, names):
    """Answer each of `names` the modules have from gcalloc; the names routed."""
    from . import (dump_snapshot, get_per_process_memory_fraction, max_memory_allocated, max_memory_reserved,
                   mem_get_info, memory_allocated, memory_reserved, memory_snapshot, memory_stats,
                   memory_stats_as_nested_dict, memory_summary, record_memory_history,
                   reset_accumulated_memory_stats, reset_peak_memory_stats)

    def stats(device=None):
        return collections.OrderedDict(memory_stats(device))

    def history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None, clear_history=False,
                compile_context=False, global_record_annotations=False, skip_actions=None, **kwargs):
        # (PyTorch 2.9's arguments: those gcalloc's history cannot honour are refused by name.)
        refused = [(name, value) for name, value in (("compile_context", compile_context),
                                                     ("global_record_annotations", global_record_annotations),
                                                     ("skip_actions", skip_actions)) if value]
        if refused:
            raise GcallocError(GCA_ERR_INVALID, "_record_memory_history: %s: gcalloc's history records every "
                               "action, without compile contexts or annotations; leave %s out"
                               % (", ".join("%s=%r" % r for r in refused), " and ".join(r[0] for r in refused)))
        arguments = _history_arguments(enabled, context, stacks, max_entries, kwargs)
        # Starting gcalloc's history drops what it holds; PyTorch keeps it unless clear_history. The
        # same settings again are left running, so that nothing is lost.
        if clear_history or arguments != _history_settings[0] or arguments[0] is None:
            record_memory_history(*arguments)
        _history_settings[0] = arguments if arguments[0] is not None else None

    def snapshot_segments(*args, mempool_id=None, **kwargs):
        if mempool_id is not None:
            raise GcallocError(GCA_ERR_INVALID, "memory_snapshot(mempool_id=%r): a MemPool's own snapshot is not "
                               "served under gcalloc (its snapshot covers the whole allocator, private pools "
                               "included, each segment naming its pool)" % (mempool_id,))
        return memory_snapshot()["segments"]

    def allocator_settings(env):
        with _python_warnings(stacklevel=4):
            rc = _lib.gca_torch_init(None, _text(env, "env"))
        if rc < 0:
            raise GcallocError(rc, _lib.gca_last_error().decode())

    def dump(filename="dump_snapshot.pickle", *args, **kwargs):
        dump_snapshot(filename)

    # The package's module-level functions take PyTorch's arguments and answer in its forms; only these
    # few differ in shape. (memory_cached and the like are PyTorch's older names for reserved memory.)
    answers = {
        "memory_stats": stats, "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "memory_allocated": memory_allocated, "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_reserved, "max_memory_reserved": max_memory_reserved,
        "memory_cached": memory_reserved, "max_memory_cached": max_memory_reserved,
        "reset_peak_memory_stats": reset_peak_memory_stats, "reset_max_memory_allocated": reset_peak_memory_stats,
        "reset_max_memory_cached": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats, "memory_summary": memory_summary,
        "memory_snapshot": snapshot_segments,
        "mem_get_info": mem_get_info, "get_per_process_memory_fraction": get_per_process_memory_fraction,
        "_record_memory_history": history,
        "_snapshot": lambda *args, **kwargs: memory_snapshot(),
        "_dump_snapshot": dump,
        "_set_allocator_settings": allocator_settings,
    }
    done = []
    for name in names:
        for module in modules:
            original = getattr(module, name, None)
            if original is None or getattr(original, "_gcalloc", False):
                continue
            answer = answers[name]
            # (torch.accelerator's functions name the device `device_index`.)
            routed_fn = (lambda f: lambda *a, **k: f(*a, **{"device" if key == "device_index" else key: value
                                                            for key, value in k.items()}))(answer)
            routed_fn.__name__, routed_fn.__doc__ = name, getattr(original, "__doc__", None)
            routed_fn._gcalloc = True
            setattr(module, name, routed_fn)
            if name not in done:
                done.append(name)
    return done


def _wrap_record_stream(torch, on_device, handle):
    """Where the running framework has no record-stream hook:
    Tensor.record_stream(stream) also tells gcalloc, for the storage's block
    (what gcalloc handed out: the storage's start, not a view's), when
    on_device(tensor); handle(stream) is the driver's stream. Callers in the
    framework's C++ (c10d's process groups) are not reached then."""
    original = torch.Tensor.record_stream
    if getattr(original, "_gcalloc", False):
        return

    def record_stream(self, stream):
        original(self, stream)
        ptr = self.untyped_storage().data_ptr()
        if on_device(self) and ptr:
            _lib.gca_torch_record_stream(ctypes.c_void_p(ptr), ctypes.c_void_p(handle(stream)))

    record_stream._gcalloc = True
    record_stream.__doc__ = original.__doc__
    torch.Tensor.record_stream = record_stream


def foreign_stream_uses():
    """record_stream and erase_stream calls from the framework's hooks on
    memory gcalloc did not make (an empty tensor's NULL, from_blob, DLPack
    or IPC memory), ignored quietly as PyTorch's own allocator ignores them:
    how many, since the process started."""
    return _lib.gca_torch_foreign_stream_uses()


def last_failure():
    """gcalloc's message for the last allocation it refused PyTorch, from any
    thread ("" if none): the text of the RuntimeError raised through PyTorch's
    libc10 (raises()), kept for the threads that did not see it; without the
    raiser, PyTorch got NULL, and this says why."""
    n = _lib.gca_torch_last_failure(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    _lib.gca_torch_last_failure(buf, n + 1)
    return buf.value.decode()


@contextlib.contextmanager
def using(conf=None, backend=None):
    install(conf, backend)
    try:
        yield
    finally:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _lib.gca_torch_empty_cache()


def _current_device():
    try:
        import torch

        return torch.cuda.current_device()
    except Exception:  # (no CUDA here, or a stand-in without it)
        return 0


@contextlib.contextmanager
def pool(name, device=None):
    """Inside the block, PyTorch's allocations made on this thread go to
    gcalloc's private pool `name` on `device` (the current CUDA device by
    default), created at the first use of the name; blocks freed in it are
    reused only in it (docs/pools.md). Yields the pool's id."""
    from . import _process_allocator

    allocator, pool_id = _named(name, device, create=True)
    with allocator.pool(pool_id):
        yield pool_id


def _named(name, device, create):
    """The process allocator and the id of the pool `name` (made pausable where the device allows)."""
    from . import _process_allocator

    if not isinstance(name, str):
        raise TypeError("gcalloc: a pool's name must be a str, not %s" % type(name).__name__)
    device = _current_device() if device is None else _device(device)
    allocator = _process_allocator()
    key = (allocator._a, name, device)
    with _named_lock:
        pool_id = _named_pools.get(key)
        if pool_id is None:
            if not create:
                raise KeyError("gcalloc: no pool named %r on device %d" % (name, device))
            try:
                pool_id = allocator.create_pool(key[2], pausable=True)
            except GcallocError:  # (no virtual memory there: a pool that cannot pause)
                pool_id = allocator.create_pool(key[2])
            _named_pools[key] = pool_id
    return allocator, pool_id


def _pools_named(name, device):
    """The process allocator and the ids of the pools `name` on `device` (None: every device it is on)."""
    from . import _process_allocator

    if device is not None:
        allocator, pool_id = _named(name, device, create=False)
        return allocator, [pool_id]
    if not isinstance(name, str):
        raise TypeError("gcalloc: a pool's name must be a str, not %s" % type(name).__name__)
    allocator = _process_allocator()
    with _named_lock:
        ids = [pool_id for (a, n, _), pool_id in sorted(_named_pools.items()) if a == allocator._a and n == name]
    if not ids:
        raise KeyError("gcalloc: no pool named %r" % name)
    return allocator, ids


def pause(name=None, backup=None, device=None):
    """Give the memory of pool or region `name` back to the device, keeping its addresses: PyTorch's
    tensors in it stay valid, to be used after resume(name). With backup, their contents are kept in
    pinned host memory and written back at resume (cpu_backup(tensor) reads them meanwhile); without,
    they are lost (for caches to be refilled). backup None: a region's own cpu_backup, True for a pool.
    `device` None: the name on every device it is on; `name` None: every region and every pool that can
    pause and runs, on `device` (None: every device). A region is refused while a thread is inside it.
    Returns the bytes given back. Synchronizes only the pools' own streams (a region: its device)."""
    from . import _process_allocator

    released = 0
    with _region_lock:
        chosen = _regions_named(name, device)
        for r in chosen:
            if r.entered:
                raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.pause(%r): %d thread%s inside region(%r) on "
                                   "device %d: leave it first" % (name, r.entered, " is" if r.entered == 1 else "s are",
                                                                 r.tag, r.device))
        for r in chosen:
            r.pausing = True
    try:
        for r in chosen:
            if not r.allocator.pool_stats(r.pool_id)["paused"]:
                _synchronize(r.device)
                released += r.allocator.pause_pool(r.pool_id, backup=r.cpu_backup if backup is None else backup)
    finally:
        with _region_lock:
            for r in chosen:
                r.pausing = False
    if name is None:
        return released + _process_allocator().pause_pools(device, backup=True if backup is None else backup)
    if chosen and not _has_named(name):
        return released
    allocator, ids = _pools_named(name, device)
    return released + sum(allocator.pause_pool(pool_id, backup=True if backup is None else backup) for pool_id in ids
                          if len(ids) == 1 or not allocator.pool_stats(pool_id)["paused"])


def resume(name=None, device=None, keep_backup=False):
    """Map memory again under pool or region `name`'s addresses and restore what pause(name,
    backup=True) kept; the host copies then go back to the system, unless keep_backup (the next pause
    copies into them again). `device` and `name` None as for pause(). Out of memory (with
    ipc_cooperation:True, after asking the other processes): GcallocError naming the need, the pool
    paused as before."""
    from . import _process_allocator

    with _region_lock:
        chosen = _regions_named(name, device)
    for r in chosen:
        if r.allocator.pool_stats(r.pool_id)["paused"]:
            r.allocator.resume_pool(r.pool_id, keep_backup=keep_backup)
    if name is None:
        _process_allocator().resume_pools(device, keep_backup=keep_backup)
        return
    if chosen and not _has_named(name):
        return
    allocator, ids = _pools_named(name, device)
    for pool_id in ids:
        if len(ids) == 1 or allocator.pool_stats(pool_id)["paused"]:
            allocator.resume_pool(pool_id, keep_backup=keep_backup)


def _regions_named(name, device):
    """The regions of tag `name` (None: all) on `device` (None: every device). Under _region_lock."""
    device = None if device is None else _device(device)
    return [r for r in _regions.values() if (name is None or r.tag == name) and (device is None or r.device == device)]


def _has_named(name):
    with _named_lock:
        return any(n == name for (_, n, _) in _named_pools)


def cpu_backup(tensor):
    """The host copy of a tensor in a pool paused with backup, as a CPU tensor of its dtype and shape
    sharing the copy's memory (read it, do not keep it past the resume): torch_memory_saver's
    get_cpu_backup. The tensor must be contiguous."""
    import torch

    from . import _process_allocator

    if not tensor.is_contiguous():
        raise ValueError("gcalloc.torch.cpu_backup: the tensor is not contiguous")
    view = _process_allocator().pool_backup(tensor.data_ptr())
    nbytes = tensor.numel() * tensor.element_size()
    if len(view) < nbytes:
        raise ValueError("gcalloc.torch.cpu_backup: the copy holds %d bytes, the tensor %d" % (len(view), nbytes))
    with warnings.catch_warnings():  # (torch warns that the buffer is not writable: it is read-only)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view[:nbytes], dtype=tensor.dtype) if nbytes else torch.empty(0, dtype=tensor.dtype)
    return flat.view(tensor.shape)


# ---- sleep mode for part of a program: regions behind PyTorch's MemPool --------------------------
#
# region(tag) routes the thread's tensors to a torch.cuda.MemPool whose segments come from gcalloc
# (gca_torch_region_malloc / gca_torch_region_free, a CUDAPluggableAllocator's functions) out of a
# pausable pool for the tag. PyTorch's own caching allocator serves them, keeps its tools, and raises
# torch.OutOfMemoryError itself when gcalloc refuses a segment; the rest of the program stays on
# PyTorch's allocator, untouched. Under install() gcalloc is PyTorch's allocator already: a region is
# then the tag's pool (pool()), with no MemPool.


class _Region:
    """A tag's pool on a device, with the cpu_backup it was made with."""

    def __init__(self, tag, cpu_backup, device, allocator, pool_id, mempool):
        self.tag, self.cpu_backup, self.device = tag, cpu_backup, device
        self.allocator, self.pool_id, self.mempool = allocator, pool_id, mempool
        self.entered = 0  # threads inside region() now
        self.pausing = False


_regions = {}  # (tag, cpu_backup, device) -> _Region (kept for the process's life, MemPool included)
_region_lock = threading.Lock()
_region_allocator = [None]  # the CUDAPluggableAllocator of the region functions, made once
_expandable_off = [0, None]  # regions entered while PyTorch's expandable segments are turned off; the setter


def regions():
    """Every region made so far: dicts of tag, cpu_backup, device, pool (gcalloc's pool id), mempool_id
    (PyTorch's, None under install()), paused, entered (threads inside now)."""
    with _region_lock:
        chosen = list(_regions.values())
    return [{"tag": r.tag, "cpu_backup": r.cpu_backup, "device": r.device, "pool": r.pool_id,
             "mempool_id": None if r.mempool is None else tuple(r.mempool.id),
             "paused": bool(r.allocator.pool_stats(r.pool_id)["paused"]), "entered": r.entered} for r in chosen]


def _synchronize(device):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def _pytorch_expandable(torch):
    """Whether PyTorch's own allocator has expandable segments on, as its configuration says
    (PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF; a later key wins)."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    value = False
    for item in conf.split(","):
        key, _, v = item.partition(":")
        if key.strip() == "expandable_segments":
            value = v.strip() == "True"
    return value


def _allocator_settings_setter(torch):
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    return setter if setter is not None else torch.cuda.memory._set_allocator_settings


def _expandable_enter(torch):
    """PyTorch refuses a MemPool's allocator a segment while expandable segments are on ("MemPool
    doesn't currently support expandable_segments."): they are turned off from the first region entered
    to the last left, where the configuration turns them on. Under _region_lock."""
    if _expandable_off[0] == 0:
        if not _pytorch_expandable(torch):
            return
        _expandable_off[1] = _allocator_settings_setter(torch)
        _expandable_off[1]("expandable_segments:False")
    _expandable_off[0] += 1


def _expandable_leave():
    """Under _region_lock."""
    if _expandable_off[0] == 0:
        return
    _expandable_off[0] -= 1
    if _expandable_off[0] == 0:
        _expandable_off[1]("expandable_segments:True")
        _expandable_off[1] = None


def _region_of(tag, cpu_backup):
    """The tag's region on the current device, made at its first use. Under _region_lock."""
    import torch

    from . import _process_allocator

    if not isinstance(tag, str):
        raise TypeError("gcalloc: a region's tag must be a str, not %s" % type(tag).__name__)
    device = _current_device()
    key = (tag, bool(cpu_backup), device)
    r = _regions.get(key)
    if r is not None:
        return r
    allocator = _process_allocator()
    try:
        pool_id = allocator.create_pool(device, pausable=True, fine_pages=not _installed)
    except GcallocError as e:
        raise GcallocError(e.status, "gcalloc.torch.region(%r): device %d cannot pause a pool: %s" % (tag, device, e)) from None
    mempool = None
    if not _installed:
        if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
            allocator.release_pool(pool_id)
            raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.region: PyTorch %s has no torch.cuda.MemPool with "
                               "use_mem_pool: call gcalloc.torch.install() to make "
                               "gcalloc PyTorch's allocator instead" % getattr(torch, "__version__", "?"))
        if _region_allocator[0] is None:
            _region_allocator[0] = torch.cuda.memory.CUDAPluggableAllocator(
                library_path, "gca_torch_region_malloc", "gca_torch_region_free")
        mempool = torch.cuda.MemPool(_region_allocator[0].allocator())
    r = _regions[key] = _Region(tag, bool(cpu_backup), device, allocator, pool_id, mempool)
    return r


@contextlib.contextmanager
def _entered(tag, cpu_backup):
    """The thread inside region `tag` on the current device (refused while paused): yields the region."""
    import torch

    with _region_lock:
        r = _region_of(tag, cpu_backup)
        if r.pausing or r.allocator.pool_stats(r.pool_id)["paused"]:
            raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.region(%r): the region is paused on device %d: "
                               "resume(%r) before allocating in it" % (tag, r.device, tag))
        if r.mempool is not None:
            _expandable_enter(torch)
        r.entered += 1
    try:
        with r.allocator.pool(r.pool_id):
            if r.mempool is None:
                yield r
            else:
                with torch.cuda.use_mem_pool(r.mempool, r.device):
                    yield r
    finally:
        with _region_lock:
            r.entered -= 1
            if r.mempool is not None:
                _expandable_leave()


@contextlib.contextmanager
def region(tag="default", cpu_backup=False):
    """Inside the block, the tensors this thread creates on the current CUDA device go to the region
    `tag`: PyTorch's caching allocator serves them from a torch.cuda.MemPool whose segments come from a
    gcalloc pool that pause(tag) gives back to the device and resume(tag) maps again at the same
    addresses (their contents restored where cpu_backup). The rest of the program stays on PyTorch's
    allocator. Entering a paused region is refused (GcallocError): PyTorch would hand out its cached
    blocks there, with no memory under them. Yields the region's gcalloc pool id."""
    with _entered(tag, cpu_backup) as r:
        yield r.pool_id


@contextlib.contextmanager
def cuda_graph(graph, pool=None, stream=None, capture_error_mode="global", tag="default", cpu_backup=False):
    """torch.cuda.graph(graph, ...) capturing into the region `tag`: the graph's memory is the region's,
    given back by pause(tag) and mapped again at the same addresses by resume(tag), where the replays
    find it. `pool` None: the region's MemPool (another pool is PyTorch's, not the region's). Not under
    install() (GcallocError: gcalloc's own graph pools serve captures there)."""
    import torch

    if _installed:
        raise GcallocError(GCA_ERR_INVALID, "gcalloc.torch.cuda_graph: under install() captures go to gcalloc's "
                           "graph pools, which do not pause; use regions without install()")
    with _entered(tag, cpu_backup) as r:
        if stream is None:  # (a stream of its own, so that gcalloc knows which one captures)
            stream = torch.cuda.Stream()
        # gcalloc capture-safe on the device while the driver captures: nothing freed, synchronized or
        # queried there (docs/pools.md, "Graph capture"); begun before the capture, ended after it.
        with r.allocator.capture(r.pool_id, stream.cuda_stream):
            with torch.cuda.graph(graph, pool=r.mempool.id if pool is None else pool, stream=stream,
                                  capture_error_mode=capture_error_mode):
                yield
