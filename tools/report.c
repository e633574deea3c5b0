/* The replay's HTML report (`gcalloc replay --report`, `gcalloc tune
 * --report`): one self-contained page (no network, no external script)
 * showing a replay: the settings in force beside their defaults, the
 * capacity, per device a timeline of requested, allocated and reserved
 * bytes for gcalloc with PyTorch's recorded reserved, the lower bound and
 * the capacity beside them, and the segments at gcalloc's peak grouped
 * where identical; with tune, its answers, each drawn over the same
 * timeline. The data is embedded as JSON and drawn as SVG by a short
 * script in the page; docs/replay.md describes what it shows.
 *
 * The timeline starts where recording began: allocations live before it
 * (the replay's seeds) are its first point, not a ramp of operations the
 * job never made. It keeps at most TIMELINE_POINTS points per series: each
 * point is the maximum over its stretch of operations, so no peak is
 * smoothed away, and the page stays the same size at any length of trace.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "replay/replay.h"
#include "replay/trace.h"
#include "report_page.h" /* report_page_js: tools/report_page.js, generated */
#include "tool.h"

#define TIMELINE_POINTS 1500
#define MAP_ROWS 200       /* rows of the segment map (identical segments are one row); the rest are counted */
#define MAP_BLOCKS 40000   /* in all; beyond, a row is drawn as its totals */
#define MAP_STACKS 2000    /* call stacks in the page (about 1 KB each); beyond, blocks are drawn without theirs */

/* The operations a device's timeline covers after the seeds: recorded
 * operations replayed (up to the out-of-memory where one stopped it). */
static size_t recorded_ops(const replay_device_t *d) {
  return d->timeline_count > d->seeded ? d->timeline_count - d->seeded : 0;
}

static size_t timeline_step(const replay_device_t *d) {
  size_t n = recorded_ops(d);
  return n > TIMELINE_POINTS ? (n + TIMELINE_POINTS - 1) / TIMELINE_POINTS : 1;
}

/* One series: the state when recording began (after the seeds; nothing
 * when none), then the maximum of each stretch of `step` operations. */
static uint64_t value_at(const uint64_t *u, const int64_t *s, size_t i) {
  return u ? u[i] : s[i] > 0 ? (uint64_t)s[i] : 0;
}

static void put_series(FILE *f, const char *name, const replay_device_t *d, const uint64_t *u, const int64_t *s) {
  size_t from = d->seeded, to = d->timeline_count > from ? d->timeline_count : from, step = timeline_step(d);
  fprintf(f, "\"%s\": [%" PRIu64, name, from && from <= d->timeline_count ? value_at(u, s, from - 1) : 0);
  for (size_t i = from; i < to; i += step) {
    uint64_t m = 0;
    for (size_t j = i; j < to && j < i + step; j++)
      if (value_at(u, s, j) > m) m = value_at(u, s, j);
    fprintf(f, ",%" PRIu64, m);
  }
  fprintf(f, "]");
}

static void put_timeline(FILE *f, const replay_device_t *d) {
  fprintf(f, "\"step\": %zu, \"operations\": %zu, ", timeline_step(d), recorded_ops(d));
  put_series(f, "requested", d, d->requested_at, NULL);
  fprintf(f, ", ");
  put_series(f, "allocated", d, d->allocated_at, NULL);
  fprintf(f, ", ");
  put_series(f, "reserved", d, d->reserved_at, NULL);
  fprintf(f, ", ");
  /* (A record with nothing reserved in it has no line to draw: a flat
   * PyTorch line at zero under gcalloc's would only mislead.) */
  if (d->recorded_reserved_at && d->recorded_peak_reserved > 0) {
    put_series(f, "recorded", d, NULL, d->recorded_reserved_at);
  } else {
    fprintf(f, "\"recorded\": null");
  }
}

/* Ordinary segments in the map's order: largest first, and identical ones
 * (size, pool, stream and the same blocks in the same states) next to each
 * other, so that they become one row. */
static int same_blocks(const gca_snapshot_segment_t *a, const gca_snapshot_segment_t *b) {
  if (a->block_count != b->block_count) return a->block_count < b->block_count ? -1 : 1;
  for (size_t i = 0; i < a->block_count; i++) {
    const gca_snapshot_block_t *x = &a->blocks[i], *y = &b->blocks[i];
    if (x->size != y->size) return x->size < y->size ? -1 : 1;
    if (x->state != y->state) return x->state < y->state ? -1 : 1;
  }
  return 0;
}

static int map_order(const void *x, const void *y) {
  const gca_snapshot_segment_t *a = *(const gca_snapshot_segment_t *const *)x;
  const gca_snapshot_segment_t *b = *(const gca_snapshot_segment_t *const *)y;
  if (a->total_size != b->total_size) return a->total_size < b->total_size ? 1 : -1;
  if (a->pool != b->pool) return a->pool < b->pool ? -1 : 1;
  if (a->stream != b->stream) return (uintptr_t)a->stream < (uintptr_t)b->stream ? -1 : 1;
  int c = same_blocks(a, b);
  return c ? c : (a->address > b->address) - (a->address < b->address);
}

static bool identical(const gca_snapshot_segment_t *a, const gca_snapshot_segment_t *b) {
  return a->total_size == b->total_size && a->pool == b->pool && a->stream == b->stream && !same_blocks(a, b);
}

/* What the segment map says of where blocks came from: the trace's stacks,
 * and which of them the page names (written once, after the devices). */
typedef struct origins {
  const trace_t *trace; /* NULL: no stacks */
  uint8_t *named;       /* a flag per stack; NULL: none to name */
  size_t named_count;   /* flags set, at most MAP_STACKS */
  size_t unnamed;       /* blocks whose stack did not fit in the page */
} origins_t;

/* A block's origin as the page has it: 0 none known, -1 live when
 * recording began, else a key of the page's "stacks". */
static long long origin_of(origins_t *o, const replay_device_t *d, uint64_t addr, int state) {
  if (state == GCA_BLOCK_INACTIVE || state == PAGE_RUN_UNMAPPED) return 0;
  const replay_origin_t *at = replay_origin_at(d, addr);
  if (!at) return 0;
  if (at->stack == REPLAY_BEFORE_RECORDING) return -1;
  if (!o->named || !o->trace || at->stack >= o->trace->stack_count) return 0;
  if (!o->named[at->stack]) {
    if (o->named_count == MAP_STACKS) {
      o->unnamed++;
      return 0;
    }
    o->named[at->stack] = 1;
    o->named_count++;
  }
  return at->stack;
}

/* The stacks the blocks named, as "stacks": {"N": "frame\nframe ..."}, and
 * the size of a snapshot whose stacks were not read (0: none). */
static void put_stacks(FILE *f, const origins_t *o) {
  fprintf(f, ", \"stacks_left_out\": %" PRIu64 ", \"stacks_limit\": %" PRIu64 ", \"stacks_most\": %d, \"stacks\": {",
          o->trace ? o->trace->stacks_left_out : 0, (uint64_t)TOOL_STACKS_LIMIT, MAP_STACKS);
  for (size_t i = 1, n = 0; o->named && i < o->trace->stack_count; i++) {
    if (!o->named[i]) continue;
    fprintf(f, "%s\"%zu\": ", n++ ? ",\n" : "\n", i);
    gca__json_string(f, o->trace->stacks[i]);
  }
  fprintf(f, "}");
}

/* The opening of one row of the segment map; the caller writes its blocks
 * as [size, state, requested, origin] (state 0 allocated, 1 pending free,
 * 2 free, 3 unmapped; origin as origin_of), or none beyond the budget of
 * blocks, and closes it. */
static void put_row(FILE *f, bool first, uint64_t address, uint64_t size, uint64_t allocated, uint64_t requested,
                    gca_stream_t stream, int pool, bool range, size_t count) {
  fprintf(f, "%s\n{\"address\": %" PRIu64 ", \"size\": %" PRIu64 ", \"allocated\": %" PRIu64
             ", \"requested\": %" PRIu64 ", \"stream\": %" PRIuPTR ", \"pool\": \"%s\", \"range\": %s"
             ", \"count\": %zu, \"blocks\": [",
          first ? "" : ",", address, size, allocated, requested, (uintptr_t)stream,
          pool == GCA_POOL_SMALL ? "small" : "large", range ? "true" : "false", count);
}

/* The segments at the peak: first each expandable segment's range up to its
 * highest mapped page (mapped blocks and unmapped holes, from the page
 * census), then the ordinary segments, largest first, each run of
 * identical ones as one row with its count. */
static void put_segments(FILE *f, const replay_device_t *d, origins_t *o) {
  const gca_snapshot_t *s = d->peak_snapshot;
  const page_census_t *c = &d->peak_pages;
  size_t rows = 0, blocks = 0, ordinary = 0, left_out = 0;
  fprintf(f, "\"segments\": [");
  for (size_t i = 0; c->maps && i < c->ranges; i++) {
    const page_range_t *g = &c->maps[i];
    if (!g->extent) continue;
    uint64_t allocated = 0;
    for (size_t k = 0; k < g->run_count; k++)
      if (g->runs[k].state == GCA_BLOCK_ACTIVE_ALLOCATED) allocated += g->runs[k].size;
    put_row(f, rows++ == 0, g->addr, g->extent, allocated, 0, g->stream, g->pool, true, 1);
    if (blocks + g->run_count <= MAP_BLOCKS) {
      uint64_t at = g->addr;
      for (size_t k = 0; k < g->run_count; k++) {
        fprintf(f, "%s[%" PRIu64 ",%d,0,%lld]", k ? "," : "", g->runs[k].size, g->runs[k].state,
                origin_of(o, d, at, g->runs[k].state));
        at += g->runs[k].size;
      }
      blocks += g->run_count;
    }
    fprintf(f, "]}");
  }
  for (size_t i = 0; s && i < s->segment_count; i++) ordinary += !s->segments[i].is_expandable;
  const gca_snapshot_segment_t **order = ordinary ? malloc(ordinary * sizeof *order) : NULL;
  for (size_t i = 0, k = 0; order && i < s->segment_count; i++)
    if (!s->segments[i].is_expandable) order[k++] = &s->segments[i];
  if (order) qsort(order, ordinary, sizeof *order, map_order);
  else left_out = ordinary; /* (the host out of memory: counted, not drawn) */
  for (size_t i = 0, run; order && i < ordinary; i += run) {
    const gca_snapshot_segment_t *g = order[i];
    for (run = 1; i + run < ordinary && identical(g, order[i + run]); run++) {}
    if (rows >= MAP_ROWS) {
      left_out += run;
      continue;
    }
    put_row(f, rows++ == 0, g->address, g->total_size, g->allocated_size, g->requested_size, g->stream, g->pool,
            false, run);
    if (blocks + g->block_count <= MAP_BLOCKS) {
      for (size_t b = 0; b < g->block_count; b++)
        fprintf(f, "%s[%" PRIu64 ",%d,%" PRIu64 ",%lld]", b ? "," : "", g->blocks[b].size, g->blocks[b].state,
                g->blocks[b].requested_size, origin_of(o, d, g->blocks[b].address, g->blocks[b].state));
      blocks += g->block_count;
    }
    fprintf(f, "]}");
  }
  fprintf(f, "], \"segments_left_out\": %zu", left_out);
  free(order);
}

/* The settings every key has by default, as gca_get_config writes them:
 * the settings table's other column. Empty when it cannot be had. */
static void put_defaults(FILE *f) {
  char buf[2048] = "";
  gca_allocator_t *a;
  if (gca_open("sim", "", &a) == GCA_OK) {
    if (gca_get_config(a, buf, sizeof buf) < 0) buf[0] = 0;
    gca_close(a);
  }
  gca__json_string(f, buf);
}

static const char *settings_of(const replay_result_t *r) {
  for (int i = 0; i < r->device_count; i++)
    if (r->devices[i].peak_snapshot) return r->devices[i].peak_snapshot->settings;
  return "";
}

static void put_device(FILE *f, const replay_device_t *d, origins_t *o) {
  fprintf(f, "{\"device\": %d, \"empty\": %s, \"events\": %zu, \"seeded\": %zu, \"start_segments\": %zu, "
             "\"peak_requested\": %" PRIu64 ", \"peak_allocated\": %" PRIu64 ", \"peak_reserved\": %" PRIu64
             ", \"bound_reserved\": %" PRIu64 ", \"recorded_peak_reserved\": ",
          d->device, replay_device_empty(d) ? "true" : "false", d->events, d->seeded, d->start_segments,
          d->peak_requested, d->peak_allocated, d->peak_reserved, d->bound_reserved);
  if (d->recorded_peak_reserved >= 0) fprintf(f, "%" PRId64, d->recorded_peak_reserved);
  else fprintf(f, "null");
  char name[64];
  replay_device_name(d, name, sizeof name);
  fprintf(f, ", \"name\": ");
  gca__json_string(f, name);
  /* Operations count from the start of recording: 1 is the first recorded
   * one, 0 the state the seeds made. */
  fprintf(f, ", \"segment_events_matched\": %zu, \"segment_events_recorded\": %zu, \"peak_at\": %zu"
             ", \"oom_seeding\": %s, \"oom\": ",
          d->segment_events_matched, d->segment_events_recorded,
          d->peak_op >= d->seeded ? d->peak_op + 1 - d->seeded : 0, d->oom && d->oom_event < d->seeded ? "true" : "false");
  if (d->oom) gca__json_string(f, d->oom_message);
  else fprintf(f, "null");
  fprintf(f, ", ");
  put_timeline(f, d);
  fprintf(f, ", ");
  size_t unnamed = o->unnamed;
  put_segments(f, d, o);
  fprintf(f, ", \"stacks_unnamed\": %zu", o->unnamed - unnamed); /* (blocks drawn without their stack: MAP_STACKS) */
  fprintf(f, ", \"pages\": ");
  pages_json_put(f, d);
  fprintf(f, "}");
}

/* An answer of tune's as the report embeds it: its totals per device and
 * its reserved timeline (TIMELINE_POINTS at most), kept so that tune need
 * not hold every answer's replay at once. */
char *report_answer_json(const report_run_t *a) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (!f) return NULL;
  fprintf(f, "{\"label\": ");
  gca__json_string(f, a->label);
  fprintf(f, ", \"conf\": ");
  gca__json_string(f, a->r->conf);
  fprintf(f, ", \"env\": ");
  gca__json_string(f, a->env ? a->env : "GCALLOC_ALLOC_CONF");
  fprintf(f, ", \"devices\": [");
  for (int i = 0; i < a->r->device_count; i++) {
    const replay_device_t *d = &a->r->devices[i];
    fprintf(f, "%s{\"device\": %d, \"peak_reserved\": %" PRIu64 ", \"bound_reserved\": %" PRIu64
               ", \"oom\": %s, \"step\": %zu, \"operations\": %zu, ",
            i ? ", " : "", d->device, d->peak_reserved, d->bound_reserved, d->oom ? "true" : "false",
            timeline_step(d), recorded_ops(d));
    if (d->reserved_at) put_series(f, "reserved", d, d->reserved_at, NULL);
    else fprintf(f, "\"reserved\": null");
    fprintf(f, "}");
  }
  fprintf(f, "]}");
  bool failed = ferror(f);
  if (fclose(f) != 0 || failed) {
    free(text);
    return NULL;
  }
  return text;
}

/* The page: its style and skeleton, the data, then the script that draws
 * it (tools/report_page.js, embedded at build time). */
static const char page_head[] =
    "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
    "<title>gcalloc replay</title>\n<style>\n"
    "body { font: 14px sans-serif; margin: 20px; color: #222; max-width: 980px; }\n"
    "h1 { font-size: 22px; word-break: break-all; } h2 { font-size: 18px; margin-top: 28px; }\n"
    "h3 { font-size: 14px; }\n"
    "table { border-collapse: collapse; margin: 8px 0 12px; }\n"
    "td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }\n"
    "th { background: #f4f4f4; text-align: left; } td.key { text-align: left; }\n"
    "table.settings td { font-family: monospace; text-align: left; } table.settings tr.set td { font-weight: bold; }\n"
    "td.conf { text-align: left; } code { background: #f2f2f2; padding: 1px 4px; word-break: break-all; display: inline-block; line-height: 1.5; }\n"
    "details { margin: 8px 0; } summary { cursor: pointer; }\n"
    ".legend span { margin-right: 16px; white-space: nowrap; } .legend i { display: inline-block; width: 16px; "
    "height: 4px; margin-right: 4px; vertical-align: middle; }\n"
    ".legend b { display: inline-block; width: 12px; height: 10px; margin-right: 4px; vertical-align: middle; }\n"
    ".readout { min-height: 18px; font-size: 12px; color: #555; } .note { color: #555; } .oom { color: #b00; }\n"
    "</style></head>\n<body>\n<h1 id=\"title\">gcalloc replay</h1>\n"
    "<p>Configuration replayed: <code id=\"conf\"></code>; capacity: <span id=\"capacity\"></span></p>\n"
    "<details id=\"settings\" open><summary>Settings in force, beside their defaults</summary></details>\n"
    "<div id=\"head\"></div>\n<div id=\"devices\"></div>\n"
    "<noscript>This report draws its plots with JavaScript.</noscript>\n";

int report_write(const char *out_path, const report_input_t *in) {
  FILE *f = fopen(out_path, "w");
  if (!f) {
    fprintf(stderr, "gcalloc %s: cannot write the report %s: %s\n", in->command, out_path, strerror(errno));
    return 1;
  }
  const replay_result_t *r = in->r;
  fputs(page_head, f);
  fprintf(f, "<script>\nconst REPORT = {\"trace\": ");
  gca__json_string(f, in->trace_path);
  fprintf(f, ", \"conf\": ");
  gca__json_string(f, r->conf);
  fprintf(f, ", \"capacity\": %" PRIu64 ", \"settings\": ", in->capacity);
  gca__json_string(f, settings_of(r));
  fprintf(f, ", \"defaults\": ");
  put_defaults(f);
  origins_t origins = {.trace = in->trace};
  if (in->trace && in->trace->stack_count) origins.named = calloc(in->trace->stack_count, 1);
  fprintf(f, ", \"devices\": [");
  for (int i = 0; i < r->device_count; i++) {
    fprintf(f, "%s\n", i ? "," : "");
    put_device(f, &r->devices[i], &origins);
  }
  fprintf(f, "]");
  put_stacks(f, &origins);
  free(origins.named);
  if (in->answer_count) {
    fprintf(f, ", \"answers\": [");
    for (size_t i = 0; i < in->answer_count; i++) {
      fprintf(f, "%s\n", i ? "," : "");
      fputs(in->answers[i], f);
    }
    fprintf(f, "], \"answers_note\": ");
    gca__json_string(f, in->answers_note ? in->answers_note : "");
  }
  fprintf(f, "};\n%s</script>\n</body></html>\n", report_page_js);
  bool failed = ferror(f);
  if (fclose(f) != 0 || failed) {
    fprintf(stderr, "gcalloc %s: cannot write the report %s: %s\n", in->command, out_path, strerror(errno));
    return 1;
  }
  return 0;
}
