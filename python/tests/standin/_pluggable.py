"""What the stand-ins' pluggable allocators share: PyTorch's
CUDAPluggableAllocator and torch_npu's NPUPluggableAllocator are one design
in C++: the alloc and free functions; hooks set by a C function's address
(cast to a C signature) and called only when set; a free of a pointer not
allocated here refused. `calls` lists each hook called, for the tests."""
import ctypes

MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class Pluggable:
    HOOKS = {}  # set_*_fn -> the C signature the framework casts the address to

    def __init__(self, malloc_ptr, free_ptr):
        self._malloc, self._free = MALLOC(malloc_ptr), FREE(free_ptr)
        self._hooks, self._metadata = {}, {}
        self._initialized = False
        self.calls = []  # (hook, arguments) each time a hook is called

    def __getattr__(self, name):
        if name in type(self).HOOKS:
            def set_hook(func_ptr, _name=name):
                if not isinstance(func_ptr, int) or not func_ptr:
                    raise TypeError("%s(): incompatible function arguments (an int address)" % _name)
                self._hooks[_name] = type(self).HOOKS[_name](func_ptr)
            return set_hook
        raise AttributeError(name)

    def _hook(self, name, *args):
        fn = self._hooks.get(name)
        if fn is None:
            return None
        self.calls.append((name, args))
        return fn(*args)

    def initialized(self):
        return self._initialized

    def init(self, device_count):
        self._hook("set_init_fn", device_count)
        self._initialized = True

    c10 = None  # the framework's libc10 (ctypes), when its lib/ has one

    def malloc(self, size, device, stream):
        if self.c10 is not None and hasattr(self.c10, "fake_c10_call_malloc"):
            # The alloc function may throw c10::Error (torchCheckFail) or c10::OutOfMemoryError: the
            # frameworks let it pass, and PyTorch's bindings raise RuntimeError or torch.OutOfMemoryError.
            import torch

            out, msg = ctypes.c_void_p(), ctypes.create_string_buffer(8192)
            thrown = self.c10.fake_c10_call_malloc(ctypes.cast(self._malloc, ctypes.c_void_p),
                                                   ctypes.c_size_t(size), device, ctypes.c_void_p(stream),
                                                   ctypes.byref(out), msg, 8192)
            if thrown:
                raise (torch.OutOfMemoryError if thrown == 2 else RuntimeError)(msg.value.decode())
            r = out.value or 0
        else:
            r = self._malloc(size, device, stream) or 0
        self._metadata[r] = (size, device, stream)  # (a NULL too: neither framework checks it)
        return r

    def raw_alloc(self, size, device, stream):
        """What a private pool asks its allocator for a segment (raw_alloc: the alloc function, with
        the current device and stream)."""
        return self.malloc(size, device, stream)

    def raw_delete(self, ptr):
        if ptr not in self._metadata:
            raise RuntimeError("Trying to free a pointer not allocated here")
        size, device, stream = self._metadata.pop(ptr)
        self._free(ptr, size, device, stream)

    def getBaseAllocation(self, ptr):  # noqa: N802 (the frameworks' names)
        if "set_base_alloc_fn" not in self._hooks:
            return ptr, 0
        size = ctypes.c_size_t(0)
        return self._hook("set_base_alloc_fn", ptr, ctypes.byref(size)) or 0, size.value
