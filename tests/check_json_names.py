#!/usr/bin/env python3
"""Every JSON output is valid UTF-8 whatever the input names (label
hardening): a snapshot whose file name and frame names hold bytes that are
not UTF-8 (and escape sequences) is replayed and tuned with --json, and
reported; each output must decode as strict UTF-8 and parse as JSON, and
the names come back byte for byte through surrogateescape, the documented
escape (docs/replay.md, "JSON output").

usage: check_json_names.py GCALLOC SNAPSHOT_WITH_FRAMES WORKDIR
"""
import json
import os
import pickle
import shutil
import subprocess
import sys

HOSTILE = "\udcff\udc9b\x1b]0;owned\x07 caf\u00e9"  # two stray bytes, an escape sequence, real UTF-8


def hostile_snapshot(source, target):
    """The snapshot with every frame's name made hostile (pickled with
    surrogatepass, as Python pickles such a str: its bytes are not UTF-8)."""
    with open(source, "rb") as f:
        snapshot = pickle.load(f)
    named = 0
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            for frame in entry.get("frames") or []:
                frame["name"] = frame["name"] + HOSTILE
                named += 1
    assert named, "the snapshot has no frames to name"
    with open(target, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)


def run_json(tool, what, *args):
    """`gcalloc WHAT ARGS --json`, which must succeed and print UTF-8 JSON."""
    out = subprocess.run([os.fsencode(tool), what.encode()] + list(args) + [b"--json"], capture_output=True,
                         timeout=300)
    if out.returncode != 0:
        sys.exit("FAIL: %s --json: %s" % (what, out.stderr.decode(errors="replace")))
    return strict_json(out.stdout, what + " --json")


def strict_json(raw, what):
    text = raw.decode("utf-8")  # (strict: raises on any byte that is not UTF-8)
    try:
        return json.loads(text)
    except ValueError as e:
        sys.exit("FAIL: %s is not JSON: %s" % (what, e))


def main():
    tool, source, work = sys.argv[1:4]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    path = os.path.join(os.fsencode(work), b"trace-\xff\x9b\x1b[2J.pickle")
    hostile_snapshot(source, path)

    replay = run_json(tool, "replay", path)
    if replay["trace"].encode("utf-8", "surrogateescape") != path:
        sys.exit("FAIL: the trace's name did not come back: %r" % replay["trace"])

    tune = run_json(tool, "tune", path)
    if tune["trace"].encode("utf-8", "surrogateescape") != path:
        sys.exit("FAIL: tune's trace name did not come back: %r" % tune["trace"])

    report = os.path.join(os.fsencode(work), b"report.html")
    out = subprocess.run([os.fsencode(tool), b"replay", path, b"--report", report, b"--stacks"],
                         capture_output=True, timeout=120)
    if out.returncode != 0:
        sys.exit("FAIL: replay --report: %s" % out.stderr.decode(errors="replace"))
    with open(report, "rb") as f:
        page = f.read().decode("utf-8")  # strict
    start = page.index("{", page.index("const REPORT = "))
    data, _ = json.JSONDecoder().raw_decode(page[start:])
    if data["trace"].encode("utf-8", "surrogateescape") != path:
        sys.exit("FAIL: the report's trace name did not come back: %r" % data["trace"])
    stacks = "\n".join(data["stacks"].values()).encode("utf-8", "surrogateescape")
    if HOSTILE.encode("utf-8", "surrogatepass") not in stacks:  # (the bytes the pickle holds)
        sys.exit("FAIL: the report's stacks lost the frames' bytes")
    for raw in (b"\x1b", b"\x9b"):
        if raw in page.encode("utf-8"):
            sys.exit("FAIL: the report holds the raw byte %r" % raw)
    print("ok: replay --json, tune --json and the report are UTF-8 JSON; the names come back byte for byte")


if __name__ == "__main__":
    main()
