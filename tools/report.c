/* `gcalloc replay TRACE --report FILE.html`: one self-contained page (no
 * network, no external script) showing a replay: per device, a timeline of
 * requested, allocated and reserved bytes for gcalloc with PyTorch's recorded
 * reserved beside it, the segments and blocks at gcalloc's peak, and the
 * settings. The data is embedded as JSON and drawn as SVG by a short script
 * in the page; docs/replay.md shows what it looks like.
 *
 * The timeline keeps at most TIMELINE_POINTS points per series: each point is
 * the maximum over its stretch of operations, so no peak is smoothed away.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "replay/replay.h"
#include "tool.h"

#define TIMELINE_POINTS 1500
#define MAP_SEGMENTS 400   /* the largest ones; the rest are counted */
#define MAP_BLOCKS 40000   /* in all; beyond, a segment is drawn as its totals */

static uint64_t max_in(const uint64_t *v, size_t from, size_t to) {
  uint64_t m = 0;
  for (size_t i = from; i < to; i++)
    if (v[i] > m) m = v[i];
  return m;
}

static void put_series(FILE *f, const char *name, const uint64_t *v, size_t n, size_t step) {
  fprintf(f, "\"%s\": [", name);
  for (size_t i = 0, k = 0; i < n; i += step, k++) fprintf(f, "%s%" PRIu64, k ? "," : "", max_in(v, i, i + step < n ? i + step : n));
  fprintf(f, "]");
}

static void put_timeline(FILE *f, const replay_device_t *d) {
  size_t n = d->timeline_count;
  size_t step = n > TIMELINE_POINTS ? (n + TIMELINE_POINTS - 1) / TIMELINE_POINTS : 1;
  fprintf(f, "\"step\": %zu, \"operations\": %zu, ", step, n);
  put_series(f, "requested", d->requested_at, n, step);
  fprintf(f, ", ");
  put_series(f, "allocated", d->allocated_at, n, step);
  fprintf(f, ", ");
  put_series(f, "reserved", d->reserved_at, n, step);
  fprintf(f, ", \"recorded\": ");
  /* (A record with nothing reserved in it has no line to draw: a flat
   * PyTorch line at zero under gcalloc's would only mislead.) */
  if (d->recorded_reserved_at && d->recorded_peak_reserved > 0) {
    fprintf(f, "[");
    for (size_t i = 0, k = 0; i < n; i += step, k++) {
      int64_t m = 0;
      for (size_t j = i; j < n && j < i + step; j++)
        if (d->recorded_reserved_at[j] > m) m = d->recorded_reserved_at[j];
      fprintf(f, "%s%" PRId64, k ? "," : "", m);
    }
    fprintf(f, "]");
  } else {
    fprintf(f, "null");
  }
}

static int by_size_desc(const void *x, const void *y) {
  const gca_snapshot_segment_t *a = *(const gca_snapshot_segment_t *const *)x;
  const gca_snapshot_segment_t *b = *(const gca_snapshot_segment_t *const *)y;
  return a->total_size < b->total_size ? 1 : a->total_size > b->total_size ? -1 : (a->address > b->address) - (a->address < b->address);
}

/* The opening of one row of the segment map; the caller writes its blocks
 * as [size, state] pairs (0 allocated, 1 pending free, 2 free, 3 unmapped),
 * or none beyond the budget of blocks, and closes it. */
static void put_row(FILE *f, bool first, uint64_t address, uint64_t size, uint64_t allocated, gca_stream_t stream,
                    int pool, bool range) {
  fprintf(f, "%s\n{\"address\": %" PRIu64 ", \"size\": %" PRIu64 ", \"allocated\": %" PRIu64
             ", \"stream\": %" PRIuPTR ", \"pool\": \"%s\", \"range\": %s, \"blocks\": [",
          first ? "" : ",", address, size, allocated, (uintptr_t)stream, pool == GCA_POOL_SMALL ? "small" : "large",
          range ? "true" : "false");
}

/* The segments at the peak: first each expandable segment's range up to its
 * highest mapped page (mapped blocks and unmapped holes, from the page
 * census), then the ordinary segments, largest first. */
static void put_segments(FILE *f, const replay_device_t *d) {
  const gca_snapshot_t *s = d->peak_snapshot;
  const page_census_t *c = &d->peak_pages;
  size_t rows = 0, blocks = 0, ordinary = 0;
  fprintf(f, "\"segments\": [");
  for (size_t i = 0; c->maps && i < c->ranges; i++) {
    const page_range_t *g = &c->maps[i];
    if (!g->extent) continue;
    uint64_t allocated = 0;
    for (size_t k = 0; k < g->run_count; k++)
      if (g->runs[k].state == GCA_BLOCK_ACTIVE_ALLOCATED) allocated += g->runs[k].size;
    put_row(f, rows++ == 0, g->addr, g->extent, allocated, g->stream, g->pool, true);
    if (blocks + g->run_count <= MAP_BLOCKS) {
      for (size_t k = 0; k < g->run_count; k++)
        fprintf(f, "%s[%" PRIu64 ",%d]", k ? "," : "", g->runs[k].size, g->runs[k].state);
      blocks += g->run_count;
    }
    fprintf(f, "]}");
  }
  for (size_t i = 0; s && i < s->segment_count; i++) ordinary += !s->segments[i].is_expandable;
  const gca_snapshot_segment_t **order = ordinary ? malloc(ordinary * sizeof *order) : NULL;
  for (size_t i = 0, k = 0; order && i < s->segment_count; i++)
    if (!s->segments[i].is_expandable) order[k++] = &s->segments[i];
  if (order) qsort(order, ordinary, sizeof *order, by_size_desc);
  size_t shown = !order ? 0 : ordinary < MAP_SEGMENTS ? ordinary : MAP_SEGMENTS;
  for (size_t i = 0; i < shown; i++) {
    const gca_snapshot_segment_t *g = order[i];
    put_row(f, rows++ == 0, g->address, g->total_size, g->allocated_size, g->stream, g->pool, false);
    if (blocks + g->block_count <= MAP_BLOCKS) {
      for (size_t b = 0; b < g->block_count; b++)
        fprintf(f, "%s[%" PRIu64 ",%d]", b ? "," : "", g->blocks[b].size, g->blocks[b].state);
      blocks += g->block_count;
    }
    fprintf(f, "]}");
  }
  fprintf(f, "], \"segments_left_out\": %zu", ordinary - shown);
  free(order);
}

/* The page's script: draws what REPORT holds. Plain SVG, no library. */
static const char page_script[] =
    "const GiB = 1024 * 1024 * 1024;\n"
    "const SVG = 'http://www.w3.org/2000/svg';\n"
    "function el(tag, attrs, parent) {\n"
    "  const e = document.createElementNS(SVG, tag);\n"
    "  for (const k in attrs) e.setAttribute(k, attrs[k]);\n"
    "  if (parent) parent.appendChild(e);\n"
    "  return e;\n"
    "}\n"
    "function fmt(b) { return b >= GiB ? (b / GiB).toFixed(3) + ' GiB' : (b / 1048576).toFixed(1) + ' MiB'; }\n"
    "const COLORS = {requested: '#2ca02c', allocated: '#1f77b4', reserved: '#d62728', recorded: '#ff7f0e'};\n"
    "const LABELS = {requested: 'requested', allocated: 'allocated (gcalloc)', reserved: 'reserved (gcalloc)',\n"
    "                recorded: 'reserved (PyTorch, recorded)'};\n"
    "function timeline(dev, host) {\n"
    "  const W = 960, H = 320, L = 70, R = 10, T = 10, B = 40;\n"
    "  const svg = el('svg', {width: W, height: H, class: 'timeline'}, host);\n"
    "  // PyTorch's recorded reserved first, wide and dashed, so that gcalloc's drawn over it stays visible.\n"
    "  const names = ['recorded', 'requested', 'allocated', 'reserved'].filter(n => dev[n]);\n"
    "  const n = dev.reserved.length;\n"
    "  let top = 1;\n"
    "  for (const s of names) for (const v of dev[s]) if (v > top) top = v;\n"
    "  const x = i => L + (n > 1 ? i / (n - 1) : 0) * (W - L - R);\n"
    "  const y = v => T + (1 - v / top) * (H - T - B);\n"
    "  el('rect', {x: L, y: T, width: W - L - R, height: H - T - B, fill: '#fafafa', stroke: '#ccc'}, svg);\n"
    "  for (let k = 0; k <= 4; k++) {\n"
    "    const v = top * k / 4;\n"
    "    el('line', {x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: '#e4e4e4'}, svg);\n"
    "    el('text', {x: L - 6, y: y(v) + 4, 'text-anchor': 'end', 'font-size': 11}, svg).textContent = fmt(v);\n"
    "  }\n"
    "  el('text', {x: (L + W) / 2, y: H - 8, 'text-anchor': 'middle', 'font-size': 12}, svg).textContent =\n"
    "      'operation (' + dev.operations + ' in all' + (dev.step > 1 ? ', each point the maximum over ' + dev.step : '') + ')';\n"
    "  for (const s of names) {\n"
    "    const pts = dev[s].map((v, i) => x(i).toFixed(1) + ',' + y(v).toFixed(1)).join(' ');\n"
    "    el('polyline', {points: pts, fill: 'none', stroke: COLORS[s], 'stroke-width': s === 'recorded' ? 5 : 2,\n"
    "                    'stroke-dasharray': s === 'recorded' ? '8 4' : 'none', class: 'series-' + s}, svg);\n"
    "  }\n"
    "  const cursor = el('line', {y1: T, y2: H - B, stroke: '#888', visibility: 'hidden'}, svg);\n"
    "  const readout = document.createElement('div');\n"
    "  readout.className = 'readout';\n"
    "  host.appendChild(readout);\n"
    "  svg.addEventListener('mousemove', ev => {\n"
    "    const r = svg.getBoundingClientRect();\n"
    "    const i = Math.max(0, Math.min(n - 1, Math.round((ev.clientX - r.left - L) / (W - L - R) * (n - 1))));\n"
    "    cursor.setAttribute('x1', x(i)); cursor.setAttribute('x2', x(i)); cursor.setAttribute('visibility', 'visible');\n"
    "    readout.textContent = 'operation ' + i * dev.step + ': ' + names.map(s => LABELS[s] + ' ' + fmt(dev[s][i])).join(', ');\n"
    "  });\n"
    "  const legend = document.createElement('div');\n"
    "  legend.className = 'legend';\n"
    "  for (const s of names) {\n"
    "    const item = document.createElement('span');\n"
    "    item.innerHTML = '<i style=\"background:' + COLORS[s] + '\"></i>';\n"
    "    item.appendChild(document.createTextNode(LABELS[s]));\n"
    "    legend.appendChild(item);\n"
    "  }\n"
    "  host.appendChild(legend);\n"
    "}\n"
    "// Not the timeline's colours: a test counts those to see that the plot was drawn.\n"
    "const BLOCK_COLORS = ['#6a51a3', '#fdae6b', '#dddddd'], UNMAPPED_COLOR = '#9ecae1';\n"
    "function segmentMap(dev, host) {\n"
    "  const segs = dev.segments;\n"
    "  if (!segs.length) { host.appendChild(document.createTextNode('No segments at the peak.')); return; }\n"
    "  const W = 960, L = 130, ROW = 12, biggest = Math.max(...segs.map(g => g.size));\n"
    "  const svg = el('svg', {width: W, height: segs.length * ROW + 4, class: 'segments'}, host);\n"
    "  segs.forEach((g, r) => {\n"
    "    const y = r * ROW + 2, scale = (W - L - 10) / biggest;\n"
    "    el('text', {x: L - 6, y: y + ROW - 3, 'text-anchor': 'end', 'font-size': 10}, svg).textContent =\n"
    "        fmt(g.size) + ' ' + g.pool + (g.range ? ' range' : '');\n"
    "    el('rect', {x: L, y: y, width: Math.max(1, g.size * scale), height: ROW - 2, fill: BLOCK_COLORS[2],\n"
    "                class: g.range ? 'range' : 'segment'}, svg);\n"
    "    if (g.blocks.length) {\n"
    "      let at = 0;\n"
    "      for (const [size, state] of g.blocks) {\n"
    "        if (state === 3) el('rect', {x: L + at * scale, y: y, width: Math.max(0.5, size * scale), height: ROW - 2,\n"
    "                                     fill: UNMAPPED_COLOR, class: 'unmapped'}, svg);\n"
    "        else if (state !== 2) el('rect', {x: L + at * scale, y: y, width: Math.max(0.5, size * scale), height: ROW - 2,\n"
    "                                          fill: BLOCK_COLORS[state]}, svg);\n"
    "        at += size;\n"
    "      }\n"
    "    } else {\n"
    "      el('rect', {x: L, y: y, width: Math.max(0.5, g.allocated * scale), height: ROW - 2, fill: BLOCK_COLORS[0]}, svg);\n"
    "    }\n"
    "  });\n"
    "  if (dev.segments_left_out)\n"
    "    host.appendChild(document.createTextNode('... and ' + dev.segments_left_out + ' smaller segments.'));\n"
    "}\n"
    "function pagesLine(dev, host) {\n"
    "  const p = dev.pages;\n"
    "  if (!p) return;\n"
    "  const par = document.createElement('p');\n"
    "  par.className = 'pages';\n"
    "  const a = p.at_peak;\n"
    "  par.textContent = 'Expandable segments: ' + p.mapped + ' pages mapped and ' + p.unmapped +\n"
    "      ' unmapped over the replay (' + p.moved + ' of each moved by stitching). At the peak: ' + a.mapped_pages +\n"
    "      ' pages mapped (' + fmt(a.mapped_bytes) + ', ' + a.free_pages + ' of them free), ' + a.unmapped_pages +\n"
    "      ' unmapped below the top of ' + a.ranges + ' range' + (a.ranges === 1 ? '' : 's') + ' (' +\n"
    "      fmt(a.unmapped_bytes) + ').';\n"
    "  host.appendChild(par);\n"
    "}\n"
    "function row(table, cells, head) {\n"
    "  const tr = table.insertRow();\n"
    "  for (const c of cells) { const td = document.createElement(head ? 'th' : 'td'); td.textContent = c; tr.appendChild(td); }\n"
    "}\n"
    "function draw() {\n"
    "  document.getElementById('title').textContent = 'gcalloc replay of ' + REPORT.trace;\n"
    "  document.getElementById('conf').textContent = REPORT.conf || '(defaults)';\n"
    "  document.getElementById('settings').textContent = REPORT.settings;\n"
    "  const summary = document.getElementById('summary');\n"
    "  const paged = REPORT.devices.some(d => d.pages);\n"
    "  row(summary, ['device', 'operations', 'seeded', 'peak requested', 'peak allocated', 'peak reserved',\n"
    "                'lower bound (above it)', 'PyTorch reserved (recorded)', 'gcalloc / PyTorch',\n"
    "                'segment events reproduced', 'fits']\n"
    "                .concat(paged ? ['pages mapped at peak', 'pages unmapped below the top'] : []), true);\n"
    "  for (const d of REPORT.devices) {\n"
    "    row(summary, [d.name.replace(/^device /, ''), d.events,\n"
    "                  d.seeded + (d.start_segments ? ' (in ' + d.start_segments + ' segments as recorded)' : ''),\n"
    "                  fmt(d.peak_requested), fmt(d.peak_allocated), fmt(d.peak_reserved),\n"
    "                  d.bound_reserved ? fmt(d.bound_reserved) + (d.oom ? '' : ' (+' +\n"
    "                    (100 * (d.peak_reserved / d.bound_reserved - 1)).toFixed(2) + '%)') : '',\n"
    "                  d.recorded_peak_reserved === null ? 'unknown'\n"
    "                  : d.recorded_peak_reserved === 0 ? 'none (no segment in the record)' : fmt(d.recorded_peak_reserved),\n"
    "                  d.recorded_peak_reserved ? (d.peak_reserved / d.recorded_peak_reserved).toFixed(3) : '',\n"
    "                  d.segment_events_matched + ' of ' + d.segment_events_recorded,\n"
    "                  d.oom ? 'no: ' + d.oom : 'yes']\n"
    "                 .concat(!paged ? [] : d.pages ? [d.pages.at_peak.mapped_pages, d.pages.at_peak.unmapped_pages] : ['', '']));\n"
    "    const sec = document.createElement('section');\n"
    "    const h = document.createElement('h2');\n"
    "    h.textContent = d.name.replace(/^d/, 'D');\n"
    "    sec.appendChild(h);\n"
    "    document.getElementById('devices').appendChild(sec);\n"
    "    timeline(d, sec);\n"
    "    const h3 = document.createElement('h3');\n"
    "    h3.textContent = 'Segments at gcalloc\\'s peak reserved (operation ' + d.peak_op + '), ' +\n"
    "        (d.pages ? 'expandable ranges up to their highest mapped page first, then ' : '') +\n"
    "        'largest first: allocated, pending free, free' + (d.pages ? ', unmapped' : '');\n"
    "    sec.appendChild(h3);\n"
    "    pagesLine(d, sec);\n"
    "    segmentMap(d, sec);\n"
    "  }\n"
    "  document.body.setAttribute('data-drawn', REPORT.devices.length);\n"
    "}\n"
    "draw();\n";

static const char page_head[] =
    "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
    "<title>gcalloc replay</title>\n<style>\n"
    "body { font: 14px sans-serif; margin: 20px; color: #222; }\n"
    "table { border-collapse: collapse; margin: 8px 0 16px; }\n"
    "td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }\n"
    "code { background: #f2f2f2; padding: 2px 4px; word-break: break-all; }\n"
    ".legend span { margin-right: 16px; } .legend i { display: inline-block; width: 14px; height: 4px; "
    "margin-right: 4px; vertical-align: middle; }\n"
    ".readout { min-height: 18px; font-size: 12px; color: #555; }\n"
    "</style></head>\n<body>\n<h1 id=\"title\">gcalloc replay</h1>\n"
    "<p>Configuration replayed: <code id=\"conf\"></code></p>\n"
    "<p>Settings in force: <code id=\"settings\"></code></p>\n"
    "<table id=\"summary\"></table>\n<div id=\"devices\"></div>\n"
    "<noscript>This report draws its plots with JavaScript.</noscript>\n";

int report_write(const char *out_path, const char *trace_path, const struct replay_result *r) {
  FILE *f = fopen(out_path, "w");
  if (!f) {
    fprintf(stderr, "gcalloc replay: cannot write the report %s: %s\n", out_path, strerror(errno));
    return 1;
  }
  fputs(page_head, f);
  fprintf(f, "<script>\nconst REPORT = {\"trace\": ");
  json_put_string(f, trace_path);
  fprintf(f, ", \"conf\": ");
  json_put_string(f, r->conf);
  const char *settings = "";
  for (int i = 0; i < r->device_count; i++)
    if (r->devices[i].peak_snapshot) settings = r->devices[i].peak_snapshot->settings;
  fprintf(f, ", \"settings\": ");
  json_put_string(f, settings);
  fprintf(f, ", \"devices\": [");
  for (int i = 0; i < r->device_count; i++) {
    const replay_device_t *d = &r->devices[i];
    fprintf(f, "%s\n{\"device\": %d, \"events\": %zu, \"seeded\": %zu, \"start_segments\": %zu, "
               "\"peak_requested\": %" PRIu64 ", \"peak_allocated\": %" PRIu64 ", \"peak_reserved\": %" PRIu64
               ", \"bound_reserved\": %" PRIu64 ", \"recorded_peak_reserved\": ",
            i ? "," : "", d->device, d->events, d->seeded, d->start_segments, d->peak_requested, d->peak_allocated,
            d->peak_reserved, d->bound_reserved);
    if (d->recorded_peak_reserved >= 0) fprintf(f, "%" PRId64, d->recorded_peak_reserved);
    else fprintf(f, "null");
    char name[64];
    replay_device_name(d, name, sizeof name);
    fprintf(f, ", \"name\": ");
    json_put_string(f, name);
    fprintf(f, ", \"segment_events_matched\": %zu, \"segment_events_recorded\": %zu, \"peak_op\": %zu, \"oom\": ",
            d->segment_events_matched, d->segment_events_recorded, d->peak_op);
    if (d->oom) json_put_string(f, d->oom_message);
    else fprintf(f, "null");
    fprintf(f, ", ");
    put_timeline(f, d);
    fprintf(f, ", ");
    put_segments(f, d);
    fprintf(f, ", \"pages\": ");
    pages_json_put(f, d);
    fprintf(f, "}");
  }
  fprintf(f, "]};\n%s</script>\n</body></html>\n", page_script);
  bool failed = ferror(f);
  if (fclose(f) != 0 || failed) {
    fprintf(stderr, "gcalloc replay: cannot write the report %s: %s\n", out_path, strerror(errno));
    return 1;
  }
  return 0;
}
