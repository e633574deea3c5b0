#!/usr/bin/env python3
"""The replay's HTML report, rendered by headless Chromium (Debian's
`chromium`): the page must draw what its data holds. Checked two ways:

1. the DOM after the page's script ran (chromium --dump-dom): one polyline per
   series, each with as many points as the data has; a settings table with
   one row per key and the keys set apart from their defaults marked; axes
   with ticks (bytes in a unit, operations); the lower bound drawn; the
   memory live when recording began as the first point, not a ramp from zero;
   the segment map one row per group of identical segments (no two rows
   alike), with a legend, a scale and a tooltip on every block; devices with
   nothing recorded on them one line, not a section;
2. the pixels (chromium --screenshot): the timeline's series colours are
   painted, in more pixels than the legend alone has.

With --expect-unmapped (a replay with expandable segments whose peak has
unmapped holes), the segment map must also draw each expandable range (one
row each) and each hole in the unmapped colour: one rect per unmapped run of
the data, and enough pixels of that colour.

With --expect-stacks (a snapshot with frames), every block whose data names
where it came from (a stack of the trace's, or live when recording began)
must say so in its tooltip, with the stack's innermost frame first.

With --tune the page is `gcalloc tune TRACE --report`'s: the run it shows must
have `gcalloc replay`'s figures (peak reserved, segment events reproduced),
its table of answers must have a row each, and each answer other than the run shown a line over
the timeline of each device.

As a control, the same page with its drawing call removed must fail check 2:
so the check can tell a drawn plot from a blank one.

usage: check_report.py GCALLOC_TOOL TRACE WORKDIR [--expect-unmapped] [--expect-stacks] [--tune] [OPTIONS...]
Exit 77 (CTest's skip) when Chromium is not installed, unless
GCALLOC_REQUIRE_CHROMIUM=1 (CI sets it, so there it fails instead).
"""
import html as htmllib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib

# The timeline's colours (tools/report.c): reserved (gcalloc), allocated, recorded (PyTorch).
SERIES = {"reserved": (0xD6, 0x27, 0x28), "allocated": (0x1F, 0x77, 0xB4), "recorded": (0xFF, 0x7F, 0x0E)}
# A legend swatch is 14 x 4 pixels; a drawn series crosses the 880-pixel-wide plot.
MIN_PIXELS = 400
# The segment map's unmapped holes (tools/report.c UNMAPPED_COLOR); rows are 10 pixels high.
UNMAPPED = (0x9E, 0xCA, 0xE1)
MIN_UNMAPPED_PIXELS = 200


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def run_chromium(browser, args, url):
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--window-size=1000,3200", "--virtual-time-budget=5000"] + args + [url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def png_pixels(path):
    """Decode an 8-bit RGB or RGBA, non-interlaced PNG: (width, height, rows of bytes, channels)."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail(path + " is not a PNG")
    pos, idat, width = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or colour not in (2, 6) or interlace:
                fail("unexpected PNG layout (depth %d, colour %d, interlace %d)" % (depth, colour, interlace))
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        filt = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if filt == 1:
            for i in range(channels, stride):
                line[i] = (line[i] + line[i - channels]) & 0xFF
        elif filt == 2:
            for i in range(stride):
                line[i] = (line[i] + prev[i]) & 0xFF
        elif filt == 3:
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif filt == 4:
            for i in range(stride):
                a = line[i - channels] if i >= channels else 0
                b = prev[i]
                c = prev[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        elif filt != 0:
            fail("PNG filter %d" % filt)
        rows.append(line)
        prev = line
    return width, height, rows, channels


def colour_counts(png, colours):
    width, height, rows, channels = png_pixels(png)
    counts = {name: 0 for name in colours}
    wanted = {rgb: name for name, rgb in colours.items()}
    for line in rows:
        for x in range(0, width * channels, channels):
            name = wanted.get((line[x], line[x + 1], line[x + 2]))
            if name:
                counts[name] += 1
    return counts


def parse_settings(text):
    """'k:v,k:[a,b]' as a dict (commas inside brackets belong to the value)."""
    out, depth, start = {}, 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if item:
                key, _, value = item.partition(":")
                out[key] = value
    return out


def check_page(report, dom, tune):
    """What the page must show beyond its series (module docstring, check 1)."""
    # The settings: a row per key, the ones set apart from their defaults marked.
    in_force, defaults = parse_settings(report["settings"]), parse_settings(report["defaults"])
    if not defaults:
        fail("the report carries no default settings to compare with")
    keys = set(in_force) | set(defaults)
    differ = sum(1 for k in keys if in_force.get(k, "unset") != defaults.get(k, "unset"))
    table = re.search(r'<table class="settings">(.*?)</table>', dom, re.S)
    if not table:
        fail("no settings table")
    rows = re.findall(r"<tr[ >]", table.group(1))
    marked = len(re.findall(r'<tr class="set">', table.group(1)))
    print("settings: %d keys, %d set apart from the defaults, %d rows, %d marked" % (len(keys), differ, len(rows) - 1,
                                                                                  marked))
    if len(rows) - 1 != len(keys) or marked != differ:
        fail("the settings table has %d rows (%d marked) for %d keys (%d set)" % (len(rows) - 1, marked, len(keys), differ))
    if "capacity" not in dom or not re.search(r'id="capacity">[^<]+<', dom):
        fail("the capacity is not named")

    shown = [d for d in report["devices"] if not d["empty"]]
    empty = [d for d in report["devices"] if d["empty"]]
    sections = re.findall(r"<section>(.*?)</section>", dom, re.S)
    if len(sections) != len(shown):
        fail("%d device sections for %d devices with something recorded" % (len(sections), len(shown)))
    for d in empty:
        name = d["name"].replace("device", "Device", 1)
        if not re.search(r'class="empty">[^<]*%s[^<]*nothing recorded on' % re.escape(name), dom):
            fail("%s, with nothing recorded on it, is not one line" % name)
    for d, sec in zip(shown, sections):
        # Axes: ticks in a unit of bytes, and in operations.
        yt = re.findall(r'class="ytick">([^<]*)<', sec)
        xt = re.findall(r'class="xtick">([^<]*)<', sec)
        if len(yt) < 3 or not all(re.fullmatch(r"[0-9.]+ (B|KiB|MiB|GiB|TiB)", v) for v in yt):
            fail("%s: the byte axis has ticks %s" % (d["name"], yt))
        if len(xt) < 3 or not all(re.fullmatch(r"[0-9.,]+[kM]?", v) for v in xt):
            fail("%s: the operations axis has ticks %s" % (d["name"], xt))
        if d["bound_reserved"] and 'class="bound"' not in sec:
            fail("%s: the lower bound is not drawn" % d["name"])
        # Memory live when recording began: the first point, and said so.
        if d["seeded"]:
            if not d["requested"][0] or 'class="start-note"' not in sec:
                fail("%s: the %d allocations live at the start are not the timeline's first point"
                     % (d["name"], d["seeded"]))
        # The segment map: a row per group, identical segments on one row, a tooltip on every block.
        drawn_rows = len(re.findall(r'<g class="row">', sec))
        if drawn_rows != len(d["segments"]):
            fail("%s: %d rows drawn for %d in the data" % (d["name"], drawn_rows, len(d["segments"])))
        ordinary = [g for g in d["segments"] if not g["range"]]
        key = lambda g: (g["size"], g["pool"], g["stream"], [b[:2] for b in g["blocks"]])
        for a, b in zip(ordinary, ordinary[1:]):
            if a["blocks"] and key(a) == key(b):
                fail("%s: two rows alike (%d bytes, %d blocks): identical segments not grouped"
                     % (d["name"], a["size"], len(a["blocks"])))
        for g in ordinary:
            if g["count"] > 1 and "%d \u00d7 " % g["count"] not in sec and "%d × " % g["count"] not in sec:
                fail("%s: a row of %d identical segments does not say so" % (d["name"], g["count"]))
        blocks = len(re.findall(r'<rect [^>]*class="(block|unmapped)"[^>]*><title>[^<]+</title>', sec))
        if d["segments"] and not blocks:
            fail("%s: the segment map's blocks have no tooltips" % d["name"])
        if d["segments"] and not re.search(r'class="scale">[0-9.]+ (B|KiB|MiB|GiB|TiB)<', sec):
            fail("%s: the segment map has no scale" % d["name"])
    if tune:
        answers = report.get("answers") or []
        table = re.search(r'<table class="answers">(.*?)</table>', dom, re.S)
        if not answers or not table:
            fail("tune's report has no answers")
        rows = len(re.findall(r"<tr[ >]", table.group(1))) - 1
        drawn = len(re.findall(r'class="series-answer"', dom))
        expected = sum(1 for a in answers if a["conf"] != report["conf"]) * len(shown)
        print("answers: %d, rows %d, lines drawn %d (expected %d)" % (len(answers), rows, drawn, expected))
        if rows != len(answers) or drawn != expected:
            fail("tune's answers: %d rows and %d lines for %d answers" % (rows, drawn, len(answers)))


def check_stacks(report, dom):
    """Each block with an origin in the data says it in its tooltip (--expect-stacks)."""
    stacks = report.get("stacks") or {}
    blocks = [b for d in report["devices"] for g in d["segments"] for b in g["blocks"] if len(b) > 3 and b[3]]
    named = [b for b in blocks if b[3] > 0]
    if not named or not stacks:
        fail("the report names no block's stack (%d blocks with an origin, %d stacks)" % (len(blocks), len(stacks)))
    titles = [htmllib.unescape(t) for t in re.findall(r"<title>([^<]*)</title>", dom)]
    told = [t for t in titles if "\nallocated at\n  " in t]
    before = [t for t in titles if "live when recording began" in t]
    print("blocks with a stack %d, tooltips with one %d; live before recording %d, said %d"
          % (len(named), len(told), len(blocks) - len(named), len(before)))
    if len(told) != len(named) or len(before) != len(blocks) - len(named):
        fail("tooltips say where %d blocks came from; the data names %d" % (len(told) + len(before), len(blocks)))
    for b in named:
        first = stacks[str(b[3])].split("\n")[0]
        if not any("\nallocated at\n  " + first in t for t in told):
            fail("no tooltip shows stack %d from its innermost frame %r" % (b[3], first))


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        sys.exit(2)
    tool, trace, work = sys.argv[1:4]
    extra = sys.argv[4:]
    expect_unmapped = "--expect-unmapped" in extra
    tune = "--tune" in extra
    expect_stacks = "--expect-stacks" in extra
    extra = [a for a in extra if a not in ("--expect-unmapped", "--tune", "--expect-stacks")]
    colours = dict(SERIES, unmapped=UNMAPPED) if expect_unmapped else SERIES
    minimum = {name: MIN_PIXELS for name in SERIES}
    minimum["unmapped"] = MIN_UNMAPPED_PIXELS
    browser = chromium()
    if not browser:
        if os.environ.get("GCALLOC_REQUIRE_CHROMIUM") == "1":
            fail("chromium is not installed (scripts/install-deps.sh installs it)")
        print("SKIP: chromium is not installed")
        sys.exit(77)
    os.makedirs(work, exist_ok=True)
    page = os.path.join(work, "report.html")
    command = "tune" if tune else "replay"
    out = subprocess.run([tool, command, trace, "--report", page] + extra, capture_output=True, text=True)
    if out.returncode != 0:
        fail("gcalloc %s --report exited %d: %s" % (command, out.returncode, out.stderr))
    html = open(page, encoding="utf-8").read()
    # Self-contained: nothing fetched (the SVG namespace URI is a name, not a fetch).
    if re.search(r"<script[^>]+src=|<link[^>]+href=|<img|url\(|@import|fetch\(|XMLHttpRequest", html):
        fail("the report loads something from outside the page")

    # 1. The DOM the script built.
    dom = run_chromium(browser, ["--dump-dom"], "file://" + os.path.abspath(page))
    if dom.returncode != 0:
        fail("chromium --dump-dom exited %d: %s" % (dom.returncode, dom.stderr[-2000:]))
    if not re.search(r'data-drawn="[0-9]+"', dom.stdout):
        fail("the page's script did not finish drawing (no data-drawn on <body>)")
    data = re.search(r'"reserved": \[([0-9,]*)\]', html)
    expected_points = len(data.group(1).split(",")) if data and data.group(1) else 0
    for name in ("recorded", "requested", "allocated", "reserved"):
        m = re.search(r'<polyline points="([^"]*)"[^>]*class="series-%s"' % name, dom.stdout)
        if not m:
            fail("no polyline for the %s series" % name)
        points = len(m.group(1).split())
        if points != expected_points or points < 100:
            fail("the %s polyline has %d points, the data %d" % (name, points, expected_points))

    # The summary says when the start was made as PyTorch had it.
    report = json.loads(re.search(r"const REPORT = (\{.*?\});\n", html, re.S).group(1))
    for d in report["devices"]:
        if d["start_segments"] and "(in %d segments as recorded)" % d["start_segments"] not in dom.stdout:
            fail("the summary does not say device %d's start was made in %d segments as recorded"
                 % (d["device"], d["start_segments"]))
    check_page(report, dom.stdout, tune)
    if tune:
        # The run shown is the one `gcalloc replay` replays, with its figures.
        plain = subprocess.run([tool, "replay", trace, "--json"] + extra, capture_output=True, text=True)
        replayed = {d["device"]: d for d in json.loads(plain.stdout)["devices"]}
        for d in report["devices"]:
            r = replayed[d["device"]]
            for k, rk in (("peak_reserved", "peak_reserved_bytes"), ("segment_events_matched",) * 2,
                          ("segment_events_recorded",) * 2):
                if d[k] != r[rk]:
                    fail("device %d: tune's report shows %s %s, gcalloc replay %s" % (d["device"], k, d[k], r[rk]))
    if expect_stacks:
        check_stacks(report, dom.stdout)

    if expect_unmapped:
        data = report
        ranges = [g for d in data["devices"] for g in d["segments"] if g["range"]]
        holes = sum(1 for g in ranges for b in g["blocks"] if b[1] == 3)
        pages = [d["pages"] for d in data["devices"] if d["pages"]]
        if not ranges or not holes or not pages or not sum(p["at_peak"]["unmapped_pages"] for p in pages):
            fail("the replay has no unmapped pages at its peak to draw (%d ranges, %d holes)" % (len(ranges), holes))
        drawn_ranges = len(re.findall(r'<rect [^>]*class="range"', dom.stdout))
        drawn_holes = len(re.findall(r'<rect [^>]*class="unmapped"', dom.stdout))
        print("ranges %d, drawn %d; unmapped runs %d, drawn %d" % (len(ranges), drawn_ranges, holes, drawn_holes))
        if drawn_ranges != len(ranges) or drawn_holes != holes:
            fail("the segment map does not draw each range and each unmapped run")
        if 'class="pages"' not in dom.stdout:
            fail("no line on the pages of expandable segments")

    # 2. The pixels.
    shot = os.path.join(work, "report.png")
    r = run_chromium(browser, ["--screenshot=" + shot], "file://" + os.path.abspath(page))
    if r.returncode != 0 or not os.path.exists(shot):
        fail("chromium --screenshot failed: %s" % r.stderr[-2000:])
    counts = colour_counts(shot, colours)
    print("pixels of each colour:", counts)
    for name, n in counts.items():
        if n < minimum[name]:
            fail("the %s series has %d pixels of its colour; the plot was not drawn" % (name, n))

    # The control: the same page, not drawn, must fail the pixel check.
    blank = os.path.join(work, "report-not-drawn.html")
    open(blank, "w", encoding="utf-8").write(html.replace("\ndraw();\n", "\n"))
    blank_shot = os.path.join(work, "report-not-drawn.png")
    run_chromium(browser, ["--screenshot=" + blank_shot], "file://" + os.path.abspath(blank))
    control = colour_counts(blank_shot, colours)
    print("control (not drawn):", control)
    if any(n >= minimum[name] for name, n in control.items()):
        fail("the pixel check passes on a page that draws nothing: it cannot tell")
    print("OK")


if __name__ == "__main__":
    main()
