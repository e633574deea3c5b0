"""gcalloc inside torch_npu on an Ascend host (scripts/npu-check.sh runs it).

Each part runs in a child process of its own (a process installs an
allocator once):
- train: a small convolutional network for STEPS steps on npu:0, once with
  torch_npu's own allocator and once with gcalloc (gcalloc.torch_npu.install),
  same seed: the losses, the mean step time and the peak reserved memory of
  each, and whether the losses agree;
- devices: with gcalloc, a tensor on every NPU from a thread on npu:0: the
  thread's device after each (torch.npu.current_device()) and the devices
  AscendCL reports a context for;
- hccl: with gcalloc on every rank, an all-reduce over min(2, NPUs) ranks whose
  inputs HCCL records on its stream, freed right after, repeated; the results,
  and gcalloc's statistics (every free completed) at the end.
Writes one JSON file with everything; exits 1 if a part failed.
usage: python3 bench/torch_npu_check.py [--steps N] [--json PATH]
"""
import argparse
import json
import os
import subprocess
import sys
import textwrap

STEPS = 50

TRAIN = """
import json, sys, time
import torch, torch_npu
if sys.argv[1] == "gcalloc":
    import gcalloc.torch_npu
    gcalloc.torch_npu.install()
torch.manual_seed(0)
device = torch.device("npu:0")
model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, padding=1),
                            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(64, 3, 64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(8)]
losses, times = [], []
for step in range(int(sys.argv[2])):
    x, y = data[step % len(data)]
    torch.npu.synchronize()
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
    torch.npu.synchronize()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
print(json.dumps({"losses": losses, "mean_step_ms": 1e3 * sum(times[5:]) / max(1, len(times) - 5),
                  "peak_reserved": torch.npu.max_memory_reserved(0)}))
"""

DEVICES = """
import ctypes, json
import torch, torch_npu, gcalloc, gcalloc.torch_npu
gcalloc.torch_npu.install()
torch.npu.set_device(0)
after = []
for d in range(torch.npu.device_count()):
    t = torch.empty(1 << 20, device="npu:%d" % d)
    after.append(torch.npu.current_device())
    del t
torch.npu.empty_cache()
print(json.dumps({"devices": torch.npu.device_count(), "current_after_each": after,
                  "hooks": gcalloc.torch_npu.hooks(), "queue_drain": gcalloc.torch_npu.queue_drain()}))
"""

HCCL = """
import json, os, sys
import torch, torch_npu, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, world, results):
    import gcalloc, gcalloc.torch_npu
    gcalloc.torch_npu.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", rank=rank, world_size=world)
    ok = True
    for i in range(20):
        x = torch.full((1 << 20,), float(rank + 1), device="npu:%d" % rank)
        dist.all_reduce(x)
        ok &= abs(x[0].item() - world * (world + 1) / 2) < 1e-3
        del x  # freed right after: its block waits for HCCL's stream
    torch.npu.synchronize()
    gcalloc.synchronize(rank)  # the frees that waited for HCCL's stream complete
    s = gcalloc.memory_stats(rank)
    results[rank] = {"ok": bool(ok), "active_bytes_after": s["active_bytes.all.current"],
                     "allocated_bytes_after": s["allocated_bytes.all.current"]}
    dist.destroy_process_group()

if __name__ == "__main__":
    world = min(2, torch.npu.device_count())
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(rank_main, args=(world, results), nprocs=world)
    print(json.dumps({"world": world, "ranks": dict(results)}))
"""


def child(code, *args):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                       timeout=1800)
    if p.returncode != 0:
        return {"failed": True, "exit": p.returncode, "stderr": p.stderr[-4000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--json", default="torch_npu_check.json")
    args = parser.parse_args()
    result = {"train": {which: child(TRAIN, which, str(args.steps)) for which in ("native", "gcalloc")}}
    native, ours = result["train"]["native"], result["train"]["gcalloc"]
    if "losses" in native and "losses" in ours:
        result["train"]["losses_agree"] = all(abs(a - b) <= 1e-3 * max(1.0, abs(a))
                                              for a, b in zip(native["losses"], ours["losses"]))
        result["train"]["step_time_ratio"] = ours["mean_step_ms"] / native["mean_step_ms"]
    result["devices"] = child(DEVICES)
    result["hccl"] = child(HCCL)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    devices = result["devices"]
    failed = (any(part.get("failed") for part in (native, ours, devices, result["hccl"]))
              or not result["train"].get("losses_agree")
              or set(devices.get("current_after_each", [0])) != {0}
              or not all(r["ok"] and r["active_bytes_after"] == 0 for r in result["hccl"].get("ranks", {}).values()))
    print("torch_npu check: %s" % ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
