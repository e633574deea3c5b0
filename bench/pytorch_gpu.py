#!/usr/bin/env python3
"""gcalloc as PyTorch's CUDA allocator on a real GPU, beside PyTorch's own.

    python3 bench/pytorch_gpu.py --lib build/libgcalloc.so [--tool build/gcalloc] [--out DIR]

Needs a GPU and PyTorch; CI has neither, so this is a benchmark, not a test.
Each allocator runs in a process of its own (PyTorch fixes its allocator at
the first CUDA allocation):

  native              PyTorch's caching allocator
  native-expandable   the same with expandable_segments:True
  cudaMallocAsync     PyTorch's backend:cudaMallocAsync (the driver's pool)
  gcalloc             gcalloc through CUDAPluggableAllocator (gcalloc.torch)
  gcalloc-expandable  the same with expandable_segments:True

and in each it measures:
  - alloc+free pairs: torch.empty(n, uint8) then del, per size (ns per pair,
    PyTorch's own work in the call included, the same for every allocator);
  - a training run: a transformer language model with AdamW whose sequence
    length changes every step (as with packed or bucketed batches), which is
    what fragments a caching allocator. Deterministic algorithms and seeds,
    so the losses must agree exactly across allocators: the allocator does
    not change arithmetic. Reported: median step time, peak reserved and
    allocated.

Then, for "will it fit": the native run is repeated with PyTorch's memory
history on, its snapshot is replayed with `gcalloc replay`, and the replay's
prediction of PyTorch's peak reserved is set against the peak measured; the
same for gcalloc's own snapshot (the replay should give gcalloc's measured
peak), which is also read by PyTorch's memory_viz code (torch.cuda._memory_viz)
to check that it opens. `gcalloc tune` on the native snapshot names the
settings that reserve least; the run is repeated under them (the best one
PyTorch's allocator understands, under PyTorch; the best of all, under
gcalloc) and the peak measured set against tune's prediction.

Under memory pressure: the training again with a memory fraction of 0.2
(16 GB of the H100's 80: above the run's peak allocated, below what it
reserves when nothing limits it), where the allocator must free its cache
and retry; step time, retries and peak reserved, PyTorch's and gcalloc's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = {
    "native": {},
    "native-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "gcalloc": {"GCALLOC_BENCH_CONF": ""},
    "gcalloc-expandable": {"GCALLOC_BENCH_CONF": "expandable_segments:True"},
}
PAIR_SIZES = [512, 64 << 10, 4 << 20, 64 << 20]


def child(mode, args):
    import torch

    use_gcalloc = "GCALLOC_BENCH_CONF" in os.environ
    fraction = float(os.environ.get("GCALLOC_BENCH_FRACTION", "0"))
    if use_gcalloc:
        import gcalloc
        import gcalloc.torch

        gcalloc.torch.install(os.environ["GCALLOC_BENCH_CONF"] or None)
        if fraction:
            gcalloc.set_per_process_memory_fraction(fraction)
    elif fraction:
        torch.cuda.set_per_process_memory_fraction(fraction)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    out = {"mode": mode, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}

    def stats():
        return gcalloc.memory_stats() if use_gcalloc else torch.cuda.memory_stats()

    # alloc+free pairs
    if not args.record and not args.train_only:
        pairs = {}
        for size in PAIR_SIZES:
            n = 20000 if size <= 4 << 20 else 5000
            for _ in range(200):
                x = torch.empty(size, dtype=torch.uint8, device=dev)
                del x
            best = None
            for _ in range(5):
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    x = torch.empty(size, dtype=torch.uint8, device=dev)
                    del x
                t = (time.perf_counter_ns() - t0) / n
                best = t if best is None else min(best, t)
            pairs[str(size)] = round(best, 1)
        torch.cuda.synchronize()
        out["pair_ns"] = pairs
        # What the pair loop left cached must not count in the training's peak.
        if use_gcalloc:
            gcalloc.empty_cache()
            gcalloc.reset_peak_memory_stats()
        else:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    if args.record:
        if use_gcalloc:
            gcalloc._process_allocator().record_history(True, "alloc", 1000000)
        else:
            torch.cuda.memory._record_memory_history(max_entries=1000000)

    # training
    torch.manual_seed(0)
    vocab, d, layers = 32000, 1024, 8
    layer = torch.nn.TransformerEncoderLayer(d, 16, 4 * d, dropout=0.0, batch_first=True)
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, d),
        "enc": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        "head": torch.nn.Linear(d, vocab),
    }).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(64, 1025, (args.steps,), generator=g)]
    batch = 12
    losses, times = [], []
    out["oom"] = None
    for step, seq in enumerate(lengths):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            h = model["enc"](model["emb"](tokens[:, :-1]))
            logits = model["head"](h)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        except RuntimeError as e:  # out of memory (under a memory fraction): reported, the run ends
            out["oom"] = f"step {step}: {str(e)[:300]}"
            if use_gcalloc:  # PyTorch's message does not say why; gcalloc's does
                out["oom"] += f" [gcalloc.torch.last_failure(): {gcalloc.torch.last_failure()[:300]}]"
            break
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    out["losses"] = losses
    out["step_ms_median"] = round(statistics.median(times[3:] or times or [0]) * 1e3, 3)
    out["steps_s"] = round(sum(times), 3)
    st = stats()
    for key, name in (("reserved_bytes.all.peak", "peak_reserved"), ("allocated_bytes.all.peak", "peak_allocated"),
                      ("num_alloc_retries", "alloc_retries"), ("num_ooms", "ooms")):
        out[name] = st.get(key)

    if args.record:
        path = os.path.join(args.out, f"{mode}.pickle")
        if use_gcalloc:
            gcalloc.dump_snapshot(path)
        else:
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
        out["snapshot"] = path
    print("RESULT " + json.dumps(out), flush=True)


def run_child(mode, args, record=False, extra=None, train_only=False):
    env = dict(os.environ)
    env.update(MODES[mode])
    env.update(extra or {})
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["GCALLOC_LIBRARY"] = os.path.abspath(args.lib)
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python") + os.pathsep + env.get(
        "PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--out", args.out, "--steps", str(args.steps)]
    if record:
        cmd.append("--record")
    if train_only:
        cmd.append("--train-only")
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r["process_s"] = round(time.time() - t0, 1)
            return r
    sys.stderr.write(f"{mode}{' (record)' if record else ''} failed, exit {p.returncode}:\n{p.stdout[-3000:]}\n"
                     f"{p.stderr[-6000:]}\n")
    return None


def replay_peak(tool, snapshot, conf=None):
    cmd = [tool, "replay", snapshot, "--json"]
    if conf:
        cmd += ["--conf", conf]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return None, p.stderr.strip()[-500:]
    return json.loads(p.stdout), None


def mib(x):
    return "-" if x is None else f"{x / 2**20:.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libgcalloc.so")
    ap.add_argument("--tool", default="build/gcalloc")
    ap.add_argument("--out", default="pytorch-gpu-out")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--child")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args)
    os.makedirs(args.out, exist_ok=True)

    results = {m: run_child(m, args) for m in MODES}
    ok = {m: r for m, r in results.items() if r}
    if not ok:
        print("no mode ran")
        return 1
    first = next(iter(ok.values()))
    print(f"{first['gpu']}, PyTorch {first['torch']}, {args.steps} training steps\n")
    print("alloc+free pair, ns (torch.empty + del, best of 5)")
    print("%-20s" % "mode" + "".join("%12s" % f"{s >> 10} KiB" if s >= 1024 else "%12s" % f"{s} B" for s in PAIR_SIZES))
    for m, r in ok.items():
        print("%-20s" % m + "".join("%12.0f" % r["pair_ns"][str(s)] for s in PAIR_SIZES))
    base = ok.get("native")
    if base:
        print("ratio to native       " + "  ".join(
            f"{m}: " + "/".join("%.2f" % (r["pair_ns"][str(s)] / base["pair_ns"][str(s)]) for s in PAIR_SIZES)
            for m, r in ok.items() if m != "native"))
    print("\ntraining: median step ms, peak reserved and allocated MiB, losses vs native")
    for m, r in ok.items():
        same = "-" if not base else ("identical" if r["losses"] == base["losses"] else "max diff %.3g" % max(
            abs(a - b) for a, b in zip(r["losses"], base["losses"])))
        print("%-20s %9.2f ms %9s %9s  %s" % (m, r["step_ms_median"], mib(r["peak_reserved"]),
                                               mib(r["peak_allocated"]), same))

    # Will it fit: the replay's prediction against what was measured.
    print("\nreplay of recorded snapshots (gcalloc replay) against the measured peak reserved")
    recorded = {}
    for m, conf in (("native", None), ("native-expandable", "expandable_segments:True"), ("gcalloc", None)):
        r = run_child(m, args, record=True)
        if not r:
            continue
        recorded[m] = r
        rep, err = replay_peak(args.tool, r["snapshot"], conf)
        if err:
            print(f"{m}: replay failed: {err}")
            continue
        d = rep["devices"][0]
        print(f"{m:20s} measured peak reserved {mib(r['peak_reserved'])} MiB; replay predicts "
              f"{mib(d['peak_reserved_bytes'])} MiB (peak allocated {mib(d['peak_allocated_bytes'])} MiB, "
              f"measured {mib(r['peak_allocated'])}); segment events matched {d['segment_events_matched']} of "
              f"{d['segment_events_recorded']} recorded, {d['segment_events_replayed']} replayed; "
              f"{rep['trace_events']} events")
        r["replay"] = rep
    for m, r in recorded.items():
        print(f"{m:20s} snapshot {os.path.getsize(r['snapshot']) / 2**20:.1f} MiB")

    # Which settings: tune on the native snapshot, then measured under them.
    tuned = {}
    if "native" in recorded:
        p = subprocess.run([args.tool, "tune", recorded["native"]["snapshot"], "--json"], capture_output=True,
                           text=True)
        if p.returncode != 0:
            print(f"tune failed: {p.stderr.strip()[-500:]}")
        else:
            ranked = json.loads(p.stdout)["ranked"]
            pytorch_best = next((c for c in ranked if "stitching" not in c["conf"]), None)
            print(f"\ngcalloc tune on the native snapshot: best {ranked[0]['conf']} "
                  f"({mib(ranked[0]['peak_reserved_bytes'])} MiB predicted); best PyTorch understands: "
                  f"{pytorch_best['conf'] if pytorch_best else '-'}"
                  f" ({mib(pytorch_best['peak_reserved_bytes']) if pytorch_best else '-'} MiB predicted)")
            runs = [("gcalloc", ranked[0], {"GCALLOC_BENCH_CONF": ranked[0]["conf"]})]
            if pytorch_best:
                runs.append(("native", pytorch_best, {"PYTORCH_CUDA_ALLOC_CONF": pytorch_best["conf"]}))
            for m, choice, extra in runs:
                r = run_child(m, args, extra=extra, train_only=True)
                if not r:
                    continue
                tuned[f"{m} {choice['conf']}"] = r
                same = "identical" if base and r["losses"] == base["losses"] else "DIFFERENT"
                print(f"  {m} under {choice['conf']}: measured peak reserved {mib(r['peak_reserved'])} MiB, "
                      f"predicted {mib(choice['peak_reserved_bytes'])}; step {r['step_ms_median']:.2f} ms; "
                      f"losses {same}")

    # Under memory pressure.
    print("\nmemory fraction 0.2: median step ms, peak reserved MiB, alloc retries, OOMs, losses vs native")
    pressure = {}
    for m in ("native", "gcalloc", "native-expandable", "gcalloc-expandable"):
        r = run_child(m, args, extra={"GCALLOC_BENCH_FRACTION": "0.2"}, train_only=True)
        if not r:
            continue
        pressure[m] = r
        same = "identical" if base and r["losses"] == base["losses"] else "DIFFERENT"
        if r["oom"]:
            same = "out of memory at " + r["oom"]
        print("%-20s %9.2f ms %9s %6s %6s  %s" % (m, r["step_ms_median"], mib(r["peak_reserved"]),
                                                  r["alloc_retries"], r["ooms"], same))

    if "gcalloc" in recorded:
        try:
            import pickle

            import torch.cuda._memory_viz as viz

            with open(recorded["gcalloc"]["snapshot"], "rb") as f:
                snap = pickle.load(f)
            html = viz.trace_plot(snap)
            seg = viz.segment_plot(snap)
            print(f"\ngcalloc's snapshot: PyTorch's _memory_viz made a trace plot of {len(html)} bytes and a segment "
                  f"plot of {len(seg)} bytes; {len(snap['segments'])} segments, "
                  f"{sum(len(t) for t in snap['device_traces'])} trace entries")
            allocs = [e for t in snap["device_traces"] for e in t if e["action"] == "alloc" and e["frames"]]
            if allocs:
                print("  an allocation's stack: " + " <- ".join(f["name"] for f in allocs[len(allocs) // 2]["frames"]))
        except Exception as e:  # reported, not hidden: this is what the check is for
            print(f"\ngcalloc's snapshot: PyTorch's _memory_viz failed: {type(e).__name__}: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"modes": results, "recorded": recorded, "tuned": tuned, "pressure": pressure}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
