#!/usr/bin/env python3
"""The replay's HTML report, rendered by headless Chromium (Debian's
`chromium`): the page must draw its timeline. Checked two ways:

1. the DOM after the page's script ran (chromium --dump-dom): one polyline per
   series, each with as many points as the data has;
2. the pixels (chromium --screenshot): the timeline's series colours are
   painted, in more pixels than the legend alone has.

With --expect-unmapped (a replay with expandable segments whose peak has
unmapped holes), the segment map must also draw each expandable range (one
row each) and each hole in the unmapped colour: one rect per unmapped run of
the data, and enough pixels of that colour.

As a control, the same page with its drawing call removed must fail check 2:
so the check can tell a drawn plot from a blank one.

usage: check_report.py GCALLOC_TOOL TRACE WORKDIR [--expect-unmapped] [REPLAY OPTIONS...]
Exit 77 (CTest's skip) when Chromium is not installed, unless
GCALLOC_REQUIRE_CHROMIUM=1 (CI sets it, so there it fails instead).
"""
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
           "--window-size=1000,1600", "--virtual-time-budget=5000"] + args + [url]
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


def main():
    if len(sys.argv) < 4:
        print(__doc__)
        sys.exit(2)
    tool, trace, work = sys.argv[1:4]
    extra = sys.argv[4:]
    expect_unmapped = "--expect-unmapped" in extra
    extra = [a for a in extra if a != "--expect-unmapped"]
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
    out = subprocess.run([tool, "replay", trace, "--report", page] + extra, capture_output=True, text=True)
    if out.returncode != 0:
        fail("gcalloc replay --report exited %d: %s" % (out.returncode, out.stderr))
    html = open(page, encoding="utf-8").read()
    # Self-contained: nothing fetched (the SVG namespace URI is a name, not a fetch).
    if re.search(r"<script[^>]+src=|<link[^>]+href=|<img|url\(|@import|fetch\(|XMLHttpRequest", html):
        fail("the report loads something from outside the page")

    # 1. The DOM the script built.
    dom = run_chromium(browser, ["--dump-dom"], "file://" + os.path.abspath(page))
    if dom.returncode != 0:
        fail("chromium --dump-dom exited %d: %s" % (dom.returncode, dom.stderr[-2000:]))
    if 'data-drawn="1"' not in dom.stdout:
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

    if expect_unmapped:
        data = report
        ranges = [g for d in data["devices"] for g in d["segments"] if g["range"]]
        holes = sum(1 for g in ranges for size, state in g["blocks"] if state == 3)
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
