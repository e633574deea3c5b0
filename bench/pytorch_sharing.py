#!/usr/bin/env python3
"""gcalloc's pausable pools and processes sharing one real GPU, under PyTorch.

    python3 bench/pytorch_sharing.py --lib build/libgcalloc.so [--json FILE] [--only pause|share]

Needs a GPU and PyTorch (a benchmark for scripts/gpu-check.sh, not a test:
CI has neither). Each part runs in processes of its own, gcalloc installed
as PyTorch's allocator (gcalloc.torch):

pause   A model's weights and a KV-cache-like buffer in two named pools
        (gcalloc.torch.pool). Each cycle pauses the cache with a backup and
        the weights without, fills most of the device with ordinary tensors
        and frees them (gcalloc's cache then holds that memory), and resumes
        both: resume must make room by releasing that cache. Checked every
        cycle: every tensor at its data_ptr(); the cache's contents
        bit-identical (a checksum, and the whole buffer against a host copy
        in the first and last cycles); with --keep-backup the cache resumes
        keeping its pinned copies, which the next pause fills again; the weights, refilled as a reload
        would, identical too; the driver's free memory (cuMemGetInfo) risen
        by what pause reported; no growth of reserved or free memory over
        the cycles. Pause and resume are timed per GiB.
share   2 and 4 processes on the GPU, taking turns at a phase that needs
        most of its memory (1 GiB tensors, then freed: the memory stays in
        the process's cache), each holding a small working set throughout,
        with ipc_cooperation on and off. Counted: phases that completed and
        phases that ran out of memory (a real job would have stopped there);
        the release round trip (the allocation that asked the peers, in
        microseconds).
"""
import argparse
import json
import os
import statistics
import sys
import time

GiB = 1 << 30
MiB = 1 << 20


def _torch_with_gcalloc(conf):
    import torch

    import gcalloc
    import gcalloc.torch

    gcalloc.torch.install(conf)
    return torch, gcalloc


def _checksum(torch, t):
    """Two sums of the tensor's bytes read as int32, one weighted by position, chunk by chunk."""
    words = t.view(-1).view(torch.int32)
    s1 = s2 = 0
    step = 64 * MiB
    for off in range(0, words.numel(), step):
        w = words[off:off + step].to(torch.int64)
        s1 += int(w.sum())
        pos = torch.arange(off, off + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        s2 += int((w * pos).sum())
        del w, pos
    return (s1, s2)


def pause_child(args):
    torch, gcalloc = _torch_with_gcalloc("")
    out = {"device": torch.cuda.get_device_name(0), "cycles": []}
    free0, total = torch.cuda.mem_get_info()
    out["total_bytes"] = total
    gen = torch.Generator(device="cuda").manual_seed(1234)
    nweights, ncache = args.weights_gib, args.cache_gib
    with gcalloc.torch.pool("weights"):
        weights = [torch.randn(GiB // 2, dtype=torch.bfloat16, device="cuda", generator=gen)
                   for _ in range(nweights)]
    with gcalloc.torch.pool("kv"):
        cache = [torch.randn(GiB // 2, dtype=torch.bfloat16, device="cuda", generator=gen)
                 for _ in range(ncache)]
    torch.cuda.synchronize()
    weights_host = [w.cpu() for w in weights]
    cache_host = [c.cpu() for c in cache]
    ptrs = [t.data_ptr() for t in weights + cache]
    sums = [_checksum(torch, c) for c in cache]
    problems = []
    for cycle in range(args.cycles):
        torch.cuda.synchronize()
        before_free, _ = torch.cuda.mem_get_info()
        t0 = time.perf_counter()
        released_cache = gcalloc.torch.pause("kv", backup=True)
        t1 = time.perf_counter()
        released_weights = gcalloc.torch.pause("weights", backup=False)
        t2 = time.perf_counter()
        paused_free, _ = torch.cuda.mem_get_info()
        rose = paused_free - before_free
        # The driver's free memory moves with its own bookkeeping too (a few MiB at the first pause).
        if rose + 32 * MiB < released_cache + released_weights:
            problems.append("cycle %d: free memory rose by %d bytes, pause reported %d"
                            % (cycle, rose, released_cache + released_weights))
        # Most of the device in ordinary tensors, then freed: gcalloc caches it.
        filler, chunk = [], GiB
        free_now, _ = torch.cuda.mem_get_info()
        for _ in range(max(0, (free_now - 2 * GiB) // chunk)):
            filler.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        filled = len(filler) * chunk
        for t in filler:
            t.fill_(cycle & 0xFF)
        torch.cuda.synchronize()
        filler = t = None
        t3 = time.perf_counter()
        gcalloc.torch.resume("kv", keep_backup=args.keep_backup)
        t4 = time.perf_counter()
        gcalloc.torch.resume("weights")
        t5 = time.perf_counter()
        for w, h in zip(weights, weights_host):  # the reload of weights paused without a backup
            w.copy_(h, non_blocking=False)
        torch.cuda.synchronize()
        now_ptrs = [t.data_ptr() for t in weights + cache]
        if now_ptrs != ptrs:
            problems.append("cycle %d: data_ptr() moved" % cycle)
        now_sums = [_checksum(torch, c) for c in cache]
        if now_sums != sums:
            problems.append("cycle %d: the cache's checksums changed" % cycle)
        if cycle in (0, args.cycles - 1):
            for i, (c, h) in enumerate(zip(cache, cache_host)):
                if not torch.equal(c.cpu(), h):
                    problems.append("cycle %d: cache tensor %d differs from its host copy" % (cycle, i))
            for i, (w, h) in enumerate(zip(weights, weights_host)):
                if not torch.equal(w.cpu(), h):
                    problems.append("cycle %d: weights tensor %d differs after the reload" % (cycle, i))
        free_after, _ = torch.cuda.mem_get_info()
        st = torch.cuda.memory_stats(0)
        out["cycles"].append({
            "released_cache": released_cache, "released_weights": released_weights, "free_rose": rose,
            "filled": filled, "pause_cache_s": t1 - t0, "pause_weights_s": t2 - t1,
            "resume_cache_s": t4 - t3, "resume_weights_s": t5 - t4, "free_after": free_after,
            "reserved_after": st["reserved_bytes.all.current"],
            "rss_kib": int(open("/proc/self/statm").read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)})
    first, last = out["cycles"][0], out["cycles"][-1]
    if last["reserved_after"] > first["reserved_after"] + 64 * MiB:
        problems.append("reserved grew from %d to %d bytes" % (first["reserved_after"], last["reserved_after"]))
    if last["free_after"] + 256 * MiB < first["free_after"]:
        problems.append("free memory fell from %d to %d bytes" % (first["free_after"], last["free_after"]))
    out["problems"] = problems
    print(json.dumps(out))


def share_worker(me, n, rounds, conf, barrier, queue):
    try:
        torch, gcalloc = _torch_with_gcalloc(conf)
        resident = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        resident.fill_(me)
        _, total = torch.cuda.mem_get_info()
        phase_chunks = int(total * 0.75) // GiB
        ok = oom = 0
        round_trips = []
        errors = []
        for _ in range(rounds):
            for turn in range(n):
                barrier.wait(timeout=300)
                if turn != me:
                    barrier.wait(timeout=300)
                    continue
                chunks = []
                try:
                    for _ in range(phase_chunks):
                        asked = gcalloc.gcalloc_stats(0)["num_ipc_requests"]
                        t0 = time.perf_counter()
                        chunks.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
                        dt = time.perf_counter() - t0
                        if gcalloc.gcalloc_stats(0)["num_ipc_requests"] != asked:
                            round_trips.append(dt * 1e6)
                    chunks[-1].fill_(1)
                    torch.cuda.synchronize()
                    ok += 1
                except RuntimeError as e:  # torch.OutOfMemoryError is one
                    oom += 1
                    errors.append("%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0][:300]))
                del chunks
                torch.cuda.synchronize()
                barrier.wait(timeout=300)
        if int(resident[:4096].float().mean()) != me:
            errors.append("the resident tensor changed")
        st = gcalloc.gcalloc_stats(0)
        queue.put({"rank": me, "ok": ok, "oom": oom, "round_trips_us": round_trips, "errors": errors[:3],
                   "num_ipc_requests": st["num_ipc_requests"], "num_ipc_timeouts": st["num_ipc_timeouts"],
                   "ipc_bytes_received": st["ipc_bytes_received"], "phase_bytes": phase_chunks * GiB})
    except Exception as e:  # reported, not lost: the parent counts a missing worker as a failure
        queue.put({"rank": me, "crash": "%s: %s" % (type(e).__name__, e)})
        barrier.abort()


def share(args):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = []
    for n in (2, 4):
        for coop in (True, False):
            conf = "ipc_cooperation:True" if coop else ""
            barrier, queue = ctx.Barrier(n), ctx.Queue()
            t0 = time.perf_counter()
            procs = [ctx.Process(target=share_worker, args=(i, n, args.rounds, conf, barrier, queue))
                     for i in range(n)]
            for p in procs:
                p.start()
            workers = []
            for _ in range(n):
                try:
                    workers.append(queue.get(timeout=600))
                except Exception:
                    break
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
            rts = [x for w in workers for x in w.get("round_trips_us", [])]
            row = {"processes": n, "cooperation": coop, "seconds": time.perf_counter() - t0,
                   "phases": n * args.rounds, "ok": sum(w.get("ok", 0) for w in workers),
                   "oom": sum(w.get("oom", 0) for w in workers),
                   "crashed": [w["crash"] for w in workers if "crash" in w] + ["missing"] * (n - len(workers)),
                   "requests": sum(w.get("num_ipc_requests", 0) for w in workers),
                   "timeouts": sum(w.get("num_ipc_timeouts", 0) for w in workers),
                   "round_trip_us": {"count": len(rts),
                                     "p50": statistics.median(rts) if rts else None,
                                     "max": max(rts) if rts else None},
                   "errors": [e for w in workers for e in w.get("errors", [])][:2]}
            results.append(row)
            rt = row["round_trip_us"]
            print("%d processes, cooperation %-5s: %d of %d phases done, %d out of memory, %d requests, "
                  "%d timeouts, round trip p50 %s us max %s us, %.1f s%s"
                  % (n, coop, row["ok"], row["phases"], row["oom"], row["requests"], row["timeouts"],
                     "%.0f" % rt["p50"] if rt["p50"] is not None else "-",
                     "%.0f" % rt["max"] if rt["max"] is not None else "-", row["seconds"],
                     ("; crashed: %s" % row["crashed"]) if row["crashed"] else ""), flush=True)
            if row["errors"]:
                print("   first error: %s" % row["errors"][0], flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libgcalloc.so")
    ap.add_argument("--json")
    ap.add_argument("--only", choices=("pause", "share"))
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--weights-gib", type=int, default=4)
    ap.add_argument("--cache-gib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep-backup", action="store_true",
                    help="resume the cache with keep_backup: the next pause copies into the same pinned memory")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    os.environ["GCALLOC_LIBRARY"] = os.path.abspath(args.lib)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    if args.child:
        pause_child(args)
        return 0
    report, failed = {}, False
    if args.only in (None, "pause"):
        import subprocess

        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--lib", args.lib, "--cycles",
               str(args.cycles), "--weights-gib", str(args.weights_gib), "--cache-gib", str(args.cache_gib)]
        cmd += ["--keep-backup"] if args.keep_backup else []
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        sys.stderr.write(r.stderr[-4000:])
        if r.returncode != 0 or not r.stdout.strip():
            print("pause: the child failed (exit %d)" % r.returncode)
            failed = True
        else:
            p = json.loads(r.stdout.strip().splitlines()[-1])
            report["pause"] = p
            cyc = p["cycles"]
            per_gib = lambda key, size: statistics.median(c[key] / (c[size] / GiB) for c in cyc) * 1e3
            print("pause/resume on %s, %d cycles, weights %d GiB (no backup), cache %d GiB (backup), "
                  "%d GiB filled in between:" % (p["device"], len(cyc), args.weights_gib, args.cache_gib,
                                                 cyc[0]["filled"] // GiB))
            print("  median ms per GiB: pause with backup %.1f, pause without %.1f, resume with restore %.1f, "
                  "resume without %.1f" % (per_gib("pause_cache_s", "released_cache"),
                                           per_gib("pause_weights_s", "released_weights"),
                                           per_gib("resume_cache_s", "released_cache"),
                                           per_gib("resume_weights_s", "released_weights")))
            print("  free memory rose by what pause reported, within %d MiB;" % (max(
                c["released_cache"] + c["released_weights"] - c["free_rose"] for c in cyc) // MiB))
            print("  released per cycle %.2f GiB, free memory rose %.2f GiB; reserved after cycle 1 %.2f GiB, "
                  "after cycle %d %.2f GiB; free %.2f -> %.2f GiB; RSS %d -> %d MiB"
                  % ((cyc[0]["released_cache"] + cyc[0]["released_weights"]) / GiB, cyc[0]["free_rose"] / GiB,
                     cyc[0]["reserved_after"] / GiB, len(cyc), cyc[-1]["reserved_after"] / GiB,
                     cyc[0]["free_after"] / GiB, cyc[-1]["free_after"] / GiB, cyc[0]["rss_kib"] // 1024,
                     cyc[-1]["rss_kib"] // 1024))
            for msg in p["problems"]:
                print("  PROBLEM: " + msg)
            failed |= bool(p["problems"])
    if args.only in (None, "share"):
        rows = share(args)
        report["share"] = rows
        for row in rows:
            if row["crashed"] or (row["cooperation"] and (row["oom"] or row["ok"] != row["phases"])):
                failed = True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
