"""gcalloc inside a real PyTorch on a GPU: skipped where either is missing
(CI has neither; scripts/gpu-check.sh runs it on a machine that has both).

Each check runs in a child process: PyTorch fixes its allocator for the
process, and test_gcalloc.py installs gcalloc on the sim in this one."""
import os
import subprocess
import sys

import pytest

import gcalloc

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

# Memory written on a side stream after a record_stream, then freed: the next
# block of that size on the main stream must not be it while the side stream
# still works (else the side stream's late write lands in the new tensor).
RECORD_STREAM = r"""
import torch, gcalloc.torch
gcalloc.torch.install()
s = torch.cuda.Stream()
big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for i in range(80):
        big.fill_(i)  # tens of milliseconds of work
    x.fill_(3)
x.record_stream(s)
ptr = x.untyped_storage().data_ptr()
del x
busy = not s.query()
y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
y.fill_(9)
torch.cuda.synchronize()
print(busy, y.data_ptr() == ptr, int(y[0]), int(y[-1]))
"""


def run(code):
    env = dict(os.environ, GCALLOC_LIBRARY=gcalloc.library_path,
               PYTHONPATH=os.path.join(os.path.dirname(__file__), "..") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split()


def test_record_stream_reaches_gcalloc():
    busy, reused, first, last = run(RECORD_STREAM)
    assert busy == "True", "the side stream finished too soon for the check to mean anything"
    assert reused == "False"
    assert (first, last) == ("9", "9")
