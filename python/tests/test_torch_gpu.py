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


# PyTorch's own memory functions under the drop-in, its hooks, and Python
# frames in its snapshot, on the real thing.
TOOLS = r"""
import torch, gcalloc, gcalloc.torch
gcalloc.torch.install()
def allocate_in_model():
    return torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.memory._record_memory_history(max_entries=1000)
x = allocate_in_model()
assert torch.cuda.memory_allocated() == gcalloc.memory_allocated() >= 32 << 20
assert torch.cuda.max_memory_reserved() == gcalloc.max_memory_reserved() > 0
assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == gcalloc.memory_allocated()
assert "set_reset_fn" in gcalloc.torch.hooks() and "memory_stats" in gcalloc.torch.routed()
names = [f["name"] for e in torch.cuda.memory._snapshot()["device_traces"][0] if e["action"] == "alloc"
         for f in e["frames"]]
del x
torch.cuda.empty_cache()  # the reset hook
print(gcalloc.memory_reserved() == 0, "allocate_in_model" in names, torch.__version__)
"""


def test_pytorchs_tools_under_the_drop_in():
    emptied, named, version = run(TOOLS)
    assert emptied == "True", "torch.cuda.empty_cache() did not reach gcalloc (PyTorch %s)" % version
    assert named == "True", "no Python frame of the allocating function in the snapshot"


# A CUDA graph under the drop-in: the capture's allocations come from the
# graph's private pool, so a tensor allocated after the capture does not get
# memory the graph's replays write, and the replay's result is right.
GRAPH = r"""
import torch, gcalloc, gcalloc.torch
gcalloc.torch.install()
static_in = torch.zeros(1 << 20, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):  # warm-up, as PyTorch's docs do
        (static_in * 2 + 1).sum()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    temp = static_in * 2          # freed inside the capture: the pool's
    static_out = (temp + 1).sum()
    del temp
pooled = gcalloc.memory_snapshot()
other = torch.full((1 << 20,), 7.0, device="cuda")  # after the capture: not the graph's memory
static_in.fill_(1.0)
g.replay()
torch.cuda.synchronize()
in_pool = any(tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0) for seg in pooled["segments"])
print("set_begin_allocate_to_pool" in gcalloc.torch.hooks(), in_pool, float(static_out), float(other[0]))
"""


def test_cuda_graph_capture_uses_a_private_pool():
    hooked, in_pool, out, other = run(GRAPH)
    if hooked != "True":
        pytest.skip("this PyTorch has no graph-pool hooks (PyTorch 2.3+)")
    assert in_pool == "True", "no segment of the capture's private pool in the snapshot"
    assert float(out) == 3.0 * (1 << 20), "the graph's replay gave %s" % out
    assert float(other) == 7.0, "a tensor allocated after the capture was overwritten by the replay"


# Out of memory under the drop-in is the class training loops catch, built
# against this PyTorch's headers at install().
OOM = r"""
import torch, gcalloc, gcalloc.torch
gcalloc.torch.install()
try:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # a petabyte
except torch.OutOfMemoryError as e:
    print(gcalloc.torch.raises_out_of_memory() is not None, "out of memory" in str(e))
"""


def test_out_of_memory_is_torch_out_of_memory_error():
    built, said = run(OOM)
    assert built == "True", "the raiser of c10::OutOfMemoryError was not built"
    assert said == "True"


# Regions behind PyTorch's MemPool (gcalloc.torch.region): a small model's weights (with a host copy) and
# KV-cache-like buffers (without) in two tags, a CUDA graph captured into the KV region, 20 cycles of
# pause and resume, the graph's output the same every time; the device's free memory before and after
# each pause, and the pause and resume times per GiB. With expandable segments in PyTorch's
# configuration, which a region turns off while it is entered.
REGIONS = r"""
import json, time, torch, gcalloc.torch as gt
torch.manual_seed(0)
with gt.region("weights", cpu_backup=True):
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda().half()
with gt.region("kv"):
    kv = torch.zeros(64, 4096, 4096, dtype=torch.half, device="cuda")  # 2 GiB
    x = torch.randn(16, 4096, dtype=torch.half, generator=torch.Generator().manual_seed(0)).cuda()
outside = torch.ones(1 << 20, device="cuda")  # PyTorch's own allocator
graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    y = model(x) + kv[0, :16]  # (warm-up outside the capture)
torch.cuda.current_stream().wait_stream(stream)
with gt.cuda_graph(graph, tag="kv"):
    y = model(x) + kv[0, :16]
graph.replay()
torch.cuda.synchronize()
expected = y.clone()
freed, pause_ms, resume_ms, same = [], [], [], 0
for cycle in range(20):
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    released = gt.pause("kv") + gt.pause("weights")
    t1 = time.perf_counter()
    free1 = torch.cuda.mem_get_info()[0]
    gt.resume()
    t2 = time.perf_counter()
    kv.zero_(); x.copy_(torch.randn(16, 4096, dtype=torch.half, generator=torch.Generator().manual_seed(0)).cuda())
    freed.append(free1 - free0)
    pause_ms.append((t1 - t0) * 1e3 / (released / 2**30))
    resume_ms.append((t2 - t1) * 1e3 / (released / 2**30))
    graph.replay()
    torch.cuda.synchronize()
    same += bool(torch.equal(y, expected))
print(json.dumps({"released": released, "freed_min": min(freed), "same": same, "outside": float(outside.sum()),
                  "pause_ms_per_gib": sorted(pause_ms)[10], "resume_ms_per_gib": sorted(resume_ms)[10]},
                 separators=(",", ":")))
"""


def test_regions_pause_and_resume_at_the_same_addresses():
    import json

    env_before = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        (line,) = run(REGIONS)
    finally:
        if env_before is None:
            del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env_before
    result = json.loads(line)
    print("regions on this GPU:", result)
    assert result["same"] == 20, result
    assert result["freed_min"] >= result["released"] * 0.95, result  # (the driver's free memory rose by it)
    assert result["outside"] == float(1 << 20)


# Two processes on one GPU taking turns through regions (ipc_cooperation:True): each holds 60% of the
# free memory in a region of its own and pauses it at the end of its turn, so the other's resume finds
# the memory back; while one holds its region, the other's resume fails with torch.OutOfMemoryError
# naming that process, and succeeds once it paused.
TURNS = r"""
import os, sys, torch
from gcalloc.torch import region, pause, resume
tag, size, first = sys.argv[1], int(sys.argv[2]), True
torch.cuda.init()
print("ready", os.getpid(), flush=True)
for line in sys.stdin:
    command = line.split()
    try:
        if first:
            with region(tag):
                held = torch.empty(size, dtype=torch.uint8, device="cuda")
            first = False
        else:
            resume(tag)
        held.fill_(7)
        torch.cuda.synchronize()
        if command[0] == "turn":
            pause(tag)
        print("ok", flush=True)
    except Exception as e:
        print("error %s: %s" % (type(e).__name__, " ".join(str(e).split())), flush=True)
"""


def test_regions_two_processes_take_turns():
    env = dict(os.environ, GCALLOC_LIBRARY=gcalloc.library_path, GCALLOC_ALLOC_CONF="ipc_cooperation:True",
               PYTHONPATH=os.path.join(os.path.dirname(__file__), "..") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[0])"], env=env,
                           capture_output=True, text=True, timeout=120)
    size = int(probe.stdout.split()[0]) * 6 // 10 // (2 << 20) * (2 << 20)
    children = [subprocess.Popen([sys.executable, "-c", TURNS, tag, str(size)], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for tag in ("kv_cache", "train")]

    def ask(child, command):
        child.stdin.write(command + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    try:
        pids = [int(c.stdout.readline().split()[1]) for c in children]
        results = []
        for turn in range(10):
            results += [ask(children[0], "turn"), ask(children[1], "turn")]
        print("turns on this GPU: %d of 20 ok, %.1f GiB each" % (results.count("ok"), size / 2**30))
        assert results == ["ok"] * 20, results
        assert ask(children[1], "hold") == "ok"  # (resumed, not paused)
        refused = ask(children[0], "turn")
        assert refused.startswith("error OutOfMemoryError") and "pid %d" % pids[1] in refused, refused
        assert ask(children[1], "turn") == "ok"  # (it pauses now)
        assert ask(children[0], "turn") == "ok"
    finally:
        for child in children:
            child.stdin.close()
            child.wait(60)
