"""PyTorch's own pinned host allocator on the workloads of `gcalloc bench-cuda`'s
pinned section, so the two can be read side by side (run both in one session;
scripts/gpu-check.sh does).

For each PYTORCH_CUDA_ALLOC_CONF setting (a child process each, since PyTorch
reads the pinned keys once): µs per new pinned block, 64 blocks of 64 KiB,
1 MiB and 16 MiB from an empty host cache (torch.empty(..., pin_memory=True); the
cache emptied before each of 5 repetitions, best kept), then ns per cached
alloc+free pair of 64 KiB. The first repetition is shown too: with
pinned_use_cuda_host_register, PyTorch's later repetitions were seen to get
memory its process had already faulted in (an H100 machine: 16 MiB blocks,
10.0 ms the first time, 1.2-1.8 ms after), which fresh memory does not give.
A setting this PyTorch does not know is reported,
not measured. Needs PyTorch with CUDA and a GPU.

usage: python3 bench/pytorch_pinned.py [--json FILE]
"""
import json
import os
import subprocess
import sys
import time

BLOCKS = 64
SIZES = (64 << 10, 1 << 20, 16 << 20)
SETTINGS = {
    "PyTorch": "",
    "PyTorch reserve segment": "pinned_reserve_segment_size_mb:{mb}",
    "PyTorch register, 1 thr": "pinned_use_cuda_host_register:True",
    "PyTorch register, 8 thr": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
}


def child(size):
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    reps = []
    for _ in range(5):
        torch._C._host_emptyCache()
        t0 = time.perf_counter()
        held = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(BLOCKS)]
        reps.append((time.perf_counter() - t0) * 1e6 / BLOCKS)
        del held
    pair = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(20000):
            x = torch.empty(64 << 10, dtype=torch.uint8, pin_memory=True)
            del x
        pair = min(pair, (time.perf_counter() - t0) * 1e9 / 20000)
    print(json.dumps({"us": min(reps), "first_us": reps[0], "pair_ns": pair}))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
        return
    out = {}
    print(f"PyTorch's pinned host allocator: µs per new block ({BLOCKS} from an empty cache, best of 5)")
    print(f"{'':26} {'64 KiB':>10} {'1 MiB':>10} {'16 MiB':>10} {'pair 64 KiB ns':>15}   first repetition")
    for name, conf in SETTINGS.items():
        row = {}
        for size in SIZES:
            env = dict(os.environ)
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf.format(mb=(BLOCKS * size + (1 << 20) - 1) >> 20)
            r = subprocess.run([sys.executable, __file__, "--child", str(size)], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
                row = {"error": last[:200]}
                break
            row[str(size)] = json.loads(r.stdout.strip().splitlines()[-1])
        out[name] = row
        if "error" in row:
            print(f"{name:26} not measured: {row['error']}")
        else:
            us = " ".join(f"{row[str(size)]['us']:10.1f}" for size in SIZES)
            first = " ".join(f"{row[str(size)]['first_us']:.1f}" for size in SIZES)
            print(f"{name:26} {us} {row[str(SIZES[0])]['pair_ns']:15.0f}   {first}")
    if len(sys.argv) == 3 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
