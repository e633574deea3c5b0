"""torch_memory_saver's names over gcalloc's regions, so that a framework switches by its import:

    from gcalloc.torch_memory_saver import torch_memory_saver   # was: from torch_memory_saver import ...

    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = load_model()
    with torch_memory_saver.region(tag="kv_cache"):
        kv = allocate_kv_cache()
    torch_memory_saver.pause("kv_cache")    # its device memory is free for others (another process too)
    torch_memory_saver.resume("kv_cache")   # mapped again at the same addresses

Each name keeps torch_memory_saver's meaning (its torch hook mode: a torch.cuda.MemPool per tag and
cpu_backup), on gcalloc.torch.region, pause and resume (docs/pytorch.md compares the two line by line).
What differs: expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF works (torch_memory_saver refuses it);
a region of another process may take the memory a pause gave back, and with ipc_cooperation:True a
resume asks the other processes for what it lacks; pausing a region a thread is inside, or entering a
paused region, is refused with an error instead of a fault; cuda_graph works without LD_PRELOAD.
"""
import contextlib

from . import torch as _torch

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]

_TAG_DEFAULT = "default"


def _check_backup_backend(enable_cpu_backup, cpu_backup_backend):
    """torch_memory_saver's rule for cpu_backup_backend (it checks it for region and cuda_graph alike);
    gcalloc's copies are pinned host memory, its "pinned"."""
    if cpu_backup_backend not in (None, "pinned"):
        raise ValueError("gcalloc.torch_memory_saver: cpu_backup_backend=%r: gcalloc keeps copies in pinned "
                         "host memory only" % (cpu_backup_backend,))
    if cpu_backup_backend is not None and not enable_cpu_backup:
        raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")


class TorchMemorySaver:
    """torch_memory_saver.TorchMemorySaver's methods (use the module's `torch_memory_saver`). What it
    does not offer raises NotImplementedError naming it, rather than being set and ignored."""

    __slots__ = ()

    @contextlib.contextmanager
    def region(self, tag=_TAG_DEFAULT, enable_cpu_backup=False, enable_disk_backup=False, cpu_backup_backend=None):
        """Tensors created inside go to the region `tag` (with enable_cpu_backup, pause keeps their
        contents in pinned host memory)."""
        if enable_disk_backup:
            raise NotImplementedError("gcalloc.torch_memory_saver: enable_disk_backup is not offered; use "
                                      "enable_cpu_backup=True")
        _check_backup_backend(enable_cpu_backup, cpu_backup_backend)
        with _torch.region(tag, cpu_backup=enable_cpu_backup):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag=_TAG_DEFAULT,
                   enable_cpu_backup=False, cpu_backup_backend=None):
        """torch.cuda.graph capturing into the region `tag`, whose pause gives the graph's memory back."""
        _check_backup_backend(enable_cpu_backup, cpu_backup_backend)
        with _torch.cuda_graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode, tag=tag,
                               cpu_backup=enable_cpu_backup):
            yield

    @contextlib.contextmanager
    def disable(self):
        """Inside a region, tensors that stay on PyTorch's own allocator (a MemPool of its own, dropped
        after, as torch_memory_saver does)."""
        import torch

        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            yield
        del pool

    def pause(self, tag=None):
        """Give the device memory of region `tag` (None: every region) back, keeping its addresses."""
        _torch.pause(tag)

    def resume(self, tag=None):
        """Map region `tag` (None: every region) again at its addresses, restoring backed-up contents."""
        _torch.resume(tag)

    def get_cpu_backup(self, x, zero_copy=False):
        """The host copy of tensor `x` in a region paused with backup (a CPU tensor; a clone unless
        zero_copy); None where it has none."""
        from . import GcallocError

        try:
            copy = _torch.cpu_backup(x)
        except GcallocError:
            return None
        return copy if zero_copy else copy.clone()

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        raise AttributeError("hook_mode")

    @hook_mode.setter
    def hook_mode(self, hook_mode):
        """Accepted for compatibility: gcalloc always works through PyTorch's MemPool ("torch")."""
        if hook_mode not in ("preload", "torch"):
            raise ValueError("hook_mode must be 'preload' or 'torch', not %r" % (hook_mode,))


    def _not_offered(self, name, instead):
        raise NotImplementedError("gcalloc.torch_memory_saver: %s is not offered; %s" % (name, instead))

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("memory_margin_bytes")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value):
        self._not_offered("memory_margin_bytes", "a resume that finds too little free memory fails with "
                          "gcalloc.OutOfMemoryError, the region paused as before")

    @property
    def retain_cpu_backup(self):
        return False

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value):
        self._not_offered("retain_cpu_backup", "gcalloc.torch.resume(tag, keep_backup=True) keeps the copies")

    def set_disk_backup_dir(self, path):
        self._not_offered("set_disk_backup_dir", "use enable_cpu_backup=True")


torch_memory_saver = TorchMemorySaver()


@contextlib.contextmanager
def configure_subprocess():
    """torch_memory_saver sets LD_PRELOAD for subprocesses here; gcalloc needs nothing preloaded."""
    yield
