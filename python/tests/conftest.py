"""What several test modules share: a torch module's file beside a lib/libc10.so (the build's C++
tests/fake_c10.cpp), for tests that hand gcalloc.torch.install() a torch of their own making: install()
needs the libc10 it raises through."""
import os

import pytest


@pytest.fixture
def torch_file(tmp_path, monkeypatch):
    """The `__file__` to give a hand-made torch module: its folder has lib/libc10.so. The raiser of
    torch.OutOfMemoryError is not built (no headers there): GCALLOC_TORCH_BUILD_RAISER=0."""
    fake = os.environ.get("GCALLOC_TEST_FAKE_C10")
    if not fake:
        pytest.skip("GCALLOC_TEST_FAKE_C10 is not set (CTest sets it)")
    (tmp_path / "torch" / "lib").mkdir(parents=True)
    os.symlink(os.path.abspath(fake), tmp_path / "torch" / "lib" / "libc10.so")
    monkeypatch.setenv("GCALLOC_TORCH_BUILD_RAISER", "0")
    return str(tmp_path / "torch" / "__init__.py")
