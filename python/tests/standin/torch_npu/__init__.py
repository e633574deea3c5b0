"""A stand-in for torch_npu (see ../README.md): the allocator's side only,
on the AscendCL stand-in named by GCALLOC_ACL_LIBRARY. Its C++ library,
lib/libtorch_npu.so, is the build's tests/fake_torch_npu.c, put there by the
test that uses it."""
from . import _C  # noqa: F401
from . import npu  # noqa: F401

__version__ = "2.5.1.standin"
