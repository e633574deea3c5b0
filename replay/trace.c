/* Reading allocation traces (see trace.h). Every field is validated: a trace
 * with a missing action, a negative size or an unknown layout is refused with
 * the entry's position named, never half-loaded.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <bzlib.h>
#include <lzma.h>
#include <zlib.h>
#include <zstd.h>
#include <zstd_errors.h>

#include "base/base.h"
#include "pickle.h"
#include "trace.h"
#include "record.h"
#include "util.h"

/* ---- what reading a compressed trace may cost ---------------------------
 * A few kilobytes of zstd or bzip2 can stand for gigabytes, and a reader
 * builds more from its input than the input itself: reading a compressed
 * trace may hold at most READ_BUDGET_FLOOR + READ_BUDGET_PER_PACKED bytes per
 * compressed byte in all (under 256 MB for a file under 100 KB). A quarter
 * of it may be the decompressed data; what the data leaves is the reader's:
 * the pickle reader's containers, stack, marks and memo (pickle_options.
 * memory_limit) and the event arrays (a quarter of it, events_limit). The
 * real snapshots compress 13 to 60 to 1 and take about 200 bytes per
 * compressed byte to read, so only a file made to explode meets the bound;
 * one that does is refused with the advice to decompress it first (a file
 * read as it is takes its per-byte bounds). */
#define READ_BUDGET_FLOOR ((size_t)96 << 20)
#define READ_BUDGET_PER_PACKED ((size_t)1024)

static size_t read_budget(size_t packed) {
  return packed < (SIZE_MAX / 2 - READ_BUDGET_FLOOR) / READ_BUDGET_PER_PACKED
             ? READ_BUDGET_FLOOR + packed * READ_BUDGET_PER_PACKED
             : SIZE_MAX / 2;
}

/* Bytes the event arrays of the read in progress on this thread may take,
 * and its path. */
static _Thread_local size_t events_limit = SIZE_MAX;
static _Thread_local const char *events_path;

/* Whether an array the reader keeps per event may grow to `count` items of
 * `size` bytes. */
static bool events_fit(size_t count, size_t size) { return count <= events_limit / size; }

/* ---- streams by number (trace_streams_t) ------------------------------ */

static uint32_t stream_slot(uint64_t value, uint32_t cap) {
  return (uint32_t)((value * 0x9e3779b97f4a7c15ull) >> 32) & (cap - 1);
}

/* The index grown to twice its size (16 at first), every number put back. */
static bool stream_index_grow(trace_streams_t *s) {
  uint32_t cap = s->index_cap ? 2 * s->index_cap : 16;
  uint32_t *index = cap ? calloc(cap, sizeof *index) : NULL;
  if (!index) return false;
  for (uint32_t n = 1; n < s->count; n++) {
    uint32_t h = stream_slot(s->values[n], cap);
    while (index[h]) h = (h + 1) & (cap - 1);
    index[h] = n + 1;
  }
  free(s->index);
  s->index = index;
  s->index_cap = cap;
  return true;
}

int trace_stream_lookup(trace_streams_t *s, uint64_t value, uint32_t *number) {
  if (value == 0) {
    *number = s->last = 0;
    s->last_value = 0;
    return GCA_OK;
  }
  uint32_t h = 0;
  if (s->index_cap) {
    for (h = stream_slot(value, s->index_cap); s->index[h]; h = (h + 1) & (s->index_cap - 1))
      if (s->values[s->index[h] - 1] == value) {
        *number = s->last = s->index[h] - 1;
        s->last_value = value;
        return GCA_OK;
      }
  }
  /* New: numbered next (the table begins with stream 0 at number 0). */
  if (s->count >= UINT32_MAX - 1) return gca__set_error(GCA_ERR_INVALID, "a trace of more than 2^32 - 2 streams");
  if (s->count + 1 >= s->cap) {
    uint32_t cap = s->cap ? (s->cap > UINT32_MAX / 2 ? UINT32_MAX : 2 * s->cap) : 8;
    uint64_t *values = realloc(s->values, (size_t)cap * sizeof *values);
    if (!values) return gca__set_error(GCA_ERR_NOMEM, "out of host memory numbering a trace's streams");
    s->values = values;
    s->cap = cap;
    if (!s->count) s->values[s->count++] = 0;
  }
  if ((uint64_t)(s->count + 1) * 2 > s->index_cap) {
    if (!stream_index_grow(s)) return gca__set_error(GCA_ERR_NOMEM, "out of host memory numbering a trace's streams");
    h = stream_slot(value, s->index_cap);
    while (s->index[h]) h = (h + 1) & (s->index_cap - 1);
  }
  s->values[s->count] = value;
  s->index[h] = s->count + 1;
  s->last_value = value;
  *number = s->last = s->count++;
  return GCA_OK;
}

void trace_streams_free(trace_streams_t *s) {
  free(s->values);
  free(s->index);
  memset(s, 0, sizeof *s);
}

/* Adds e, naming `stream` (numbered here). */
static int push_event(trace_t *t, size_t *cap, const trace_event_t *e, uint64_t stream) {
  if (t->count == *cap) {
    size_t n = *cap ? *cap * 2 : 1024;
    if (!events_fit(n, sizeof *t->events))
      return gca__set_error(GCA_ERR_INVALID, "%s: more events than a compressed trace of its size may hold (%zu bytes "
                            "of them); refused as malformed: decompress it first to read it", events_path, events_limit);
    trace_event_t *ev = realloc(t->events, n * sizeof *ev);
    if (!ev) return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading a trace");
    t->events = ev;
    *cap = n;
  }
  trace_event_t *to = &t->events[t->count];
  *to = *e;
  int rc = trace_stream_number(&t->streams, stream, &to->stream);
  if (rc == GCA_OK) t->count++;
  return rc;
}

static trace_action action_of(const pv_t *v) {
  static const struct { const char *name; trace_action action; } names[] = {
      {"alloc", TA_ALLOC},
      {"free_requested", TA_FREE_REQUESTED},
      {"free_completed", TA_FREE_COMPLETED},
      {"segment_alloc", TA_SEGMENT_ALLOC},
      {"segment_free", TA_SEGMENT_FREE},
      {"segment_map", TA_SEGMENT_MAP},
      {"segment_unmap", TA_SEGMENT_UNMAP},
      {"snapshot", TA_SNAPSHOT},
      {"oom", TA_OOM},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (pv_str_eq(v, names[i].name)) return names[i].action;
  return TA_OTHER;
}

static bool read_uint(const pv_t *v, uint64_t *out) {
  if (!v || v->kind != PV_INT || v->u.i < 0) return false;
  *out = (uint64_t)v->u.i;
  return true;
}

/* device_traces entries taken as the pickle is parsed (pickle_options):
 * no dict is built for them, and no second pass reads it. The array is a
 * big one (util.c), and becomes the trace's when the device lists hold
 * its entries in order, as PyTorch writes them: a new process then faults
 * in one array, not two, and nothing is copied. The final segments'
 * blocks are taken so too (pickle_options.block_key): a dict of five
 * pairs each in the reader's arena was 200 bytes a block, most of that
 * arena (about 200 KiB for a thousand blocks), each page of it a fault in
 * a new process. */
typedef struct entry_sink {
  trace_event_t *events;
  size_t count, cap;
  trace_streams_t *streams; /* the trace's: the events' streams numbered as they are taken */
  trace_block_t *blocks; /* device and stream 0: a segment's, filled in from it */
  size_t block_count, block_cap;
  /* Reading stacks (trace_load_options): each record's frames list (NULL:
   * none), in step with events. */
  bool stacks;
  const pv_seq_t **frames;
  size_t frames_cap;
} entry_sink_t;

/* One final block's fields from its pairs (key, value, ...), the last of
 * a key counting, as in Python's dict and entry_fields; false when it
 * lacks a valid address, size or state. */
static bool block_fields(const pv_t *pairs, size_t count, trace_block_t *b) {
  const pv_t *address = NULL, *size = NULL, *requested = NULL, *state = NULL;
  for (size_t k = 0; k + 1 < count; k += 2) {
    const pv_t *key = &pairs[k], *value = &pairs[k + 1];
    if (key->kind != PV_STR) continue;
    if (key->len == 7 && !memcmp(key->u.data, "address", 7)) address = value;
    else if (key->len == 4 && !memcmp(key->u.data, "size", 4)) size = value;
    else if (key->len == 14 && !memcmp(key->u.data, "requested_size", 14)) requested = value;
    else if (key->len == 5 && !memcmp(key->u.data, "state", 5)) state = value;
  }
  *b = (trace_block_t){0};
  if (!read_uint(address, &b->addr) || !read_uint(size, &b->size) || !state || state->kind != PV_STR) return false;
  if (!read_uint(requested, &b->requested)) b->requested = b->size;
  b->active = pv_str_eq(state, "active_allocated") || pv_str_eq(state, "active_pending_free");
  return true;
}

/* The final state: every segment and block the snapshot lists, the blocks
 * taken as records (sink) or read as dicts. */
static int load_final_state(const char *path, const pv_t *segments, const entry_sink_t *sink, trace_t *t) {
  size_t nseg = pv_len(segments), nblocks = 0;
  for (size_t i = 0; i < nseg; i++) nblocks += pv_len(pv_get(pv_at(segments, i), "blocks"));
  t->final_segments = calloc(nseg + 1, sizeof *t->final_segments);
  t->final_blocks = calloc(nblocks + 1, sizeof *t->final_blocks);
  if (!t->final_segments || !t->final_blocks) return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
  for (size_t i = 0; i < nseg; i++) {
    const pv_t *seg = pv_at(segments, i);
    trace_segment_t *s = &t->final_segments[t->final_segment_count];
    uint64_t device = 0, stream = 0;
    if (!read_uint(pv_get(seg, "address"), &s->addr) || !read_uint(pv_get(seg, "total_size"), &s->size) ||
        (pv_get(seg, "device") && !read_uint(pv_get(seg, "device"), &device)) || device > 255)
      return gca__set_error(GCA_ERR_INVALID, "%s: segment %zu lacks a valid address, total_size or device", path, i);
    (void)read_uint(pv_get(seg, "stream"), &stream);
    s->device = (int)device;
    s->stream = stream;
    t->final_segment_count++;
    const pv_t *blocks = pv_get(seg, "blocks");
    for (size_t j = 0; j < pv_len(blocks); j++) {
      pv_t held;
      const pv_t *b = pv_item(blocks, j, &held);
      trace_block_t *out = &t->final_blocks[t->final_block_count];
      if (b && b->kind == PV_RECORD && b->len == 1 && (uint64_t)b->u.i < sink->block_count)
        *out = sink->blocks[b->u.i];
      else if (!b || b->kind != PV_DICT || !block_fields(b->u.seq->items, b->u.seq->count, out))
        return gca__set_error(GCA_ERR_INVALID, "%s: segment %zu block %zu lacks a valid address, size or state", path, i,
                              j);
      out->device = (int)device;
      out->stream = stream;
      t->final_block_count++;
    }
  }
  t->has_segment_state = true;
  return GCA_OK;
}

/* An entry as read, before its stream is numbered (on the thread that
 * takes it: the numbering is the trace's). */
typedef struct entry_read {
  trace_event_t event;
  uint64_t stream;
  const pv_seq_t *frames; /* its frames list, NULL if none (pruned: an empty one) */
} entry_read_t;

/* One device_traces entry's fields from its pairs (key, value, key, value
 * ...), in one pass: an entry has half a dozen keys, and looking each up by
 * name would scan them six times. Returns NULL, or what is wrong with it. */
static const char *entry_fields(const pv_t *pairs, size_t count, entry_read_t *read) {
  trace_event_t *e = &read->event;
  const pv_t *action = NULL, *addr = NULL, *device_free = NULL, *size = NULL, *stream = NULL, *time_us = NULL,
             *frames = NULL;
  for (size_t k = 0; k + 1 < count; k += 2) {
    const pv_t *key = &pairs[k], *value = &pairs[k + 1];
    if (key->kind != PV_STR) continue;
    switch (key->len) {
      case 4:
        if (!memcmp(key->u.data, "addr", 4)) addr = value;
        else if (!memcmp(key->u.data, "size", 4)) size = value;
        break;
      case 6:
        if (!memcmp(key->u.data, "action", 6)) action = value;
        else if (!memcmp(key->u.data, "stream", 6)) stream = value;
        else if (!memcmp(key->u.data, "frames", 6)) frames = value;
        break;
      case 7:
        if (!memcmp(key->u.data, "time_us", 7)) time_us = value;
        break;
      case 11:
        if (!memcmp(key->u.data, "device_free", 11)) device_free = value;
        break;
      default:
        break;
    }
  }
  *e = (trace_event_t){.time_us = -1};
  read->frames = frames && frames->kind == PV_LIST ? frames->u.seq : NULL;
  if (!action || action->kind != PV_STR) return "has no action";
  e->action = (uint8_t)action_of(action);
  /* An oom entry carries the device's free bytes where others have addr. */
  if (!read_uint(e->action == TA_OOM ? device_free : addr, &e->addr) || !read_uint(size, &e->size))
    return e->action == TA_OOM ? "lacks a valid device_free or size" : "lacks a valid addr or size";
  if (!read_uint(stream, &read->stream)) read->stream = 0;
  uint64_t us;
  if (read_uint(time_us, &us)) e->time_us = (int64_t)us;
  return NULL;
}

static int read_entry(const char *path, const pv_t *entry, size_t d, size_t i, trace_t *t, size_t *cap,
                      const pv_seq_t **frames) {
  if (!entry || entry->kind != PV_DICT)
    return gca__set_error(GCA_ERR_INVALID, "%s: device %zu trace entry %zu is not a dict", path, d, i);
  entry_read_t e;
  const char *wrong = entry_fields(entry->u.seq->items, entry->u.seq->count, &e);
  if (wrong) return gca__set_error(GCA_ERR_INVALID, "%s: device %zu trace entry %zu %s", path, d, i, wrong);
  e.event.device = (uint8_t)d; /* (d < 256: snapshot_to_trace) */
  *frames = e.frames;
  return push_event(t, cap, &e.event, e.stream);
}


/* The pickle reader's record steps (pickle_options): an entry's event from
 * its pairs, on whichever thread read it; then into the sink, in order.
 * One with a problem is declined: read as a dict, read_entry names it. */
static bool prepare_entry(const void *ctx, const pv_t *pairs, size_t count, void *out) {
  (void)ctx;
  return entry_fields(pairs, count, out) == NULL;
}

static bool take_entry(void *ctx, const void *prepared, int64_t *id) {
  entry_sink_t *sink = ctx;
  const entry_read_t *e = prepared;
  if (sink->count == sink->cap) {
    /* From 256 KiB, a big array (util.c): one mapping that grows in place
     * to 2 MiB, instead of three reallocs on the heap and a copy (35 page
     * faults on the first reader's path in a new process). Not zeroed:
     * each entry is written whole before anything reads it, and zeroing a
     * kept mapping would be half a megabyte of memset on a 10,000-event read. */
    size_t cap = sink->cap ? sink->cap * 2 : ((size_t)256 << 10) / sizeof *sink->events + 1;
    if (!events_fit(cap, sizeof *sink->events)) return false; /* (read as a dict: the reader's own bound refuses it) */
    trace_event_t *grown = gca__big_regrow(sink->events, sink->cap * sizeof *grown, cap * sizeof *grown);
    if (!grown) return false;
    sink->events = grown;
    sink->cap = cap;
  }
  if (sink->stacks && sink->count == sink->frames_cap) {
    const pv_seq_t **grown = gca__grow_array(sink->frames, &sink->frames_cap, sizeof *grown, 1024);
    if (!grown) return false;
    sink->frames = grown;
  }
  trace_event_t *to = &sink->events[sink->count];
  *to = e->event;
  if (trace_stream_number(sink->streams, e->stream, &to->stream) != GCA_OK) return false;
  if (sink->stacks) sink->frames[sink->count] = e->frames;
  *id = (int64_t)sink->count++;
  return true;
}

static bool prepare_block(const void *ctx, const pv_t *pairs, size_t count, void *out) {
  (void)ctx;
  return block_fields(pairs, count, out);
}

static bool take_block(void *ctx, const void *prepared, int64_t *id) {
  entry_sink_t *sink = ctx;
  if (sink->block_count == sink->block_cap) {
    size_t cap = sink->block_cap ? sink->block_cap * 2 : 256;
    trace_block_t *grown = realloc(sink->blocks, cap * sizeof *grown);
    if (!grown) return false;
    sink->blocks = grown;
    sink->block_cap = cap;
  }
  memcpy(&sink->blocks[sink->block_count], prepared, sizeof *sink->blocks);
  *id = (int64_t)sink->block_count++;
  return true;
}

/* Whether the device lists hold the sink's records and nothing else, in the
 * order they were read. */
static bool records_in_order(const pv_t *traces, const entry_sink_t *sink) {
  size_t next = 0;
  for (size_t d = 0; d < pv_len(traces); d++) {
    const pv_t *list = pv_at(traces, d);
    if (!list) return false;
    int64_t first;
    size_t held = pv_records(list, &first);
    if (held) { /* (as the reader holds them: a range) */
      if ((uint64_t)first != next) return false;
      next += held;
      continue;
    }
    for (size_t i = 0; i < pv_len(list); i++) {
      const pv_t *entry = pv_at(list, i);
      if (!entry || entry->kind != PV_RECORD || (uint64_t)entry->u.i != next++) return false;
    }
  }
  return next == sink->count;
}

/* ---- call stacks (trace_load_options.stacks) ---------------------------
 * A frame is left out where PyTorch's memory viewer leaves it out: the
 * frames that capture the stack, the dispatcher's and the interpreter's
 * own, which are in every stack and tell nothing of the job. */
static bool frame_omitted(const pv_t *name, const pv_t *file) {
  static const char *const names[] = {"unwind::unwind", "CapturedTraceback::gather", "gather_with_cpp", "_start",
                                      "__libc_start_main", "PyEval_", "PyObject_", "PyFunction_"};
  static const char *const files[] = {"core/boxing", "/Register", "/Redispatch", "pythonrun.c", "Modules/main.c",
                                      "Objects/call.c", "Objects/methodobject.c", "pycore_ceval.h", "ceval.c",
                                      "cpython/abstract.h"};
  for (size_t i = 0; name && i < sizeof names / sizeof *names; i++)
    if (memmem(name->u.data, name->len, names[i], strlen(names[i]))) return true;
  for (size_t i = 0; file && i < sizeof files / sizeof *files; i++)
    if (memmem(file->u.data, file->len, files[i], strlen(files[i]))) return true;
  return false;
}

static const pv_t *frame_str(const pv_t *frame, const char *key) {
  const pv_t *v = pv_get(frame, key);
  return v && v->kind == PV_STR ? v : NULL;
}

static bool python_file(const pv_t *file) {
  return file && file->len >= 3 && !memcmp(file->u.data + file->len - 3, ".py", 3);
}

/* A frames list as a stack's text (trace_t.stacks), in *out (malloc'd);
 * NULL in *out when no frame is left. A stack with Python frames is told by
 * them alone: they say where the job allocated, and the native frames
 * between them (the interpreter's, the dispatcher's: 190 of 198 frames of
 * a stack of one real snapshot) would push them out of the shown ones.
 * False: the host out of memory. */
static bool stack_text(const pv_seq_t *frames, char **out) {
  char *text = NULL;
  size_t len = 0, shown = 0, more = 0;
  bool python = false;
  for (size_t i = 0; i < frames->count && !python; i++) python = python_file(frame_str(&frames->items[i], "filename"));
  FILE *f = open_memstream(&text, &len);
  if (!f) return false;
  for (size_t i = 0; i < frames->count; i++) {
    const pv_t *frame = &frames->items[i];
    const pv_t *name = frame_str(frame, "name"), *file = frame_str(frame, "filename"), *line = pv_get(frame, "line");
    if ((!name && !file) || (python && !python_file(file)) || frame_omitted(name, file)) continue;
    if (shown == TRACE_STACK_FRAMES) {
      more++;
      continue;
    }
    size_t from = 0; /* the file's last path component, of a POSIX or a Windows path */
    for (size_t k = 0; file && k < file->len; k++)
      if (file->u.data[k] == '/' || file->u.data[k] == '\\') from = k + 1;
    fprintf(f, "%s%.*s:%" PRId64 ":%.*s", shown++ ? "\n" : "", file ? (int)(file->len - from) : 2,
            file ? file->u.data + from : "??", line && line->kind == PV_INT ? line->u.i : 0, name ? (int)name->len : 2,
            name ? name->u.data : "??");
  }
  if (more) fprintf(f, "\n... %zu more frames", more);
  bool failed = ferror(f);
  if (fclose(f) != 0 || failed) {
    free(text);
    return false;
  }
  if (!shown) {
    free(text);
    text = NULL;
  }
  *out = text;
  return true;
}

/* t's alloc events' stacks from their frames lists (frames[i] for event i,
 * NULL none), while the document that holds them is still there. Frame
 * dicts are shared through the memo, so two lists of the same frames hold
 * the same items: a list is looked up by its items (a hash, then a compare
 * with the first list seen with that hash) and formatted only when new,
 * and equal texts are one stack. */
typedef struct seen_list {
  const pv_seq_t *list;
  uint32_t stack;
} seen_list_t;

/* A key for the maps below (addr_map_t's keys stop short of its markers). */
static uint64_t map_key(const void *data, size_t len) { return gca__bytes_hash(data, len) >> 1; }

static bool same_items(const pv_seq_t *a, const pv_seq_t *b) {
  return a->count == b->count && !memcmp(a->items, b->items, a->count * sizeof *a->items);
}

static int intern_stacks(const char *path, const pv_seq_t *const *frames, trace_t *t) {
  addr_map_t by_items = {0}, by_text = {0};
  seen_list_t *seen = NULL;
  size_t cap = 0, seen_count = 0, seen_cap = 0;
  int rc = GCA_OK;
  if (!gca__addr_map_init(&by_items) || !gca__addr_map_init(&by_text) ||
      !(t->event_stacks = calloc(t->count ? t->count : 1, sizeof *t->event_stacks)))
    rc = GCA_ERR_NOMEM;
  for (size_t i = 0; rc == GCA_OK && i < t->count; i++) {
    const pv_seq_t *list = frames[i];
    if (!list || !list->count || t->events[i].action != TA_ALLOC) continue;
    uint64_t items_hash = map_key(list->items, list->count * sizeof *list->items);
    const uint64_t *known = gca__addr_map_get(&by_items, items_hash);
    if (known && same_items(seen[*known].list, list)) {
      t->event_stacks[i] = seen[*known].stack;
      continue;
    }
    char *text;
    if (!stack_text(list, &text)) {
      rc = GCA_ERR_NOMEM;
      break;
    }
    uint32_t id = 0;
    if (text) {
      uint64_t hash = map_key(text, strlen(text));
      const uint64_t *same = gca__addr_map_get(&by_text, hash);
      if (same && !strcmp(t->stacks[*same], text)) {
        id = (uint32_t)*same;
        free(text);
      } else {
        if (t->stack_count + 1 >= cap) { /* (ids are 32 bits) */
          char **grown = cap < UINT32_MAX / 2 ? gca__grow_array(t->stacks, &cap, sizeof *grown, 64) : NULL;
          if (!grown) {
            free(text);
            rc = GCA_ERR_NOMEM;
            break;
          }
          t->stacks = grown;
        }
        if (!t->stack_count) t->stacks[t->stack_count++] = NULL; /* (0: none) */
        id = (uint32_t)t->stack_count;
        t->stacks[t->stack_count++] = text;
        if (!same && !gca__addr_map_put(&by_text, hash, id)) rc = GCA_ERR_NOMEM;
      }
    }
    t->event_stacks[i] = id;
    if (rc != GCA_OK || known) continue; /* (a hash seen with other items: looked up by text each time) */
    if (seen_count == seen_cap) {
      seen_list_t *grown = gca__grow_array(seen, &seen_cap, sizeof *grown, 64);
      if (!grown) {
        rc = GCA_ERR_NOMEM;
        break;
      }
      seen = grown;
    }
    seen[seen_count] = (seen_list_t){list, id};
    if (!gca__addr_map_put(&by_items, items_hash, seen_count++)) rc = GCA_ERR_NOMEM;
  }
  gca__addr_map_free(&by_items);
  gca__addr_map_free(&by_text);
  free(seen);
  if (rc != GCA_OK) return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading the call stacks of %s", path);
  if (!t->stack_count) { /* (no frames anywhere: nothing kept) */
    free(t->event_stacks);
    t->event_stacks = NULL;
  }
  return GCA_OK;
}

/* The snapshot's parsed document (taken over) into t; `path` names it in errors. */
static int snapshot_to_trace(const char *path, pickle_doc_t *doc, entry_sink_t *sink, trace_t *t) {
  const pv_t *segments = pv_get(pickle_root(doc), "segments");
  if (segments && segments->kind == PV_LIST) {
    int frc = load_final_state(path, segments, sink, t);
    if (frc) {
      pickle_free(doc);
      return frc;
    }
  }
  const pv_t *conf = pv_get(pv_get(pickle_root(doc), "allocator_settings"), "PYTORCH_CUDA_ALLOC_CONF");
  if (conf && conf->kind == PV_STR) {
    t->settings = malloc(conf->len + 1);
    if (t->settings) {
      memcpy(t->settings, conf->u.data, conf->len);
      t->settings[conf->len] = '\0';
    }
  }
  const pv_t *traces = pv_get(pickle_root(doc), "device_traces");
  if (!traces || traces->kind != PV_LIST) {
    pickle_free(doc);
    return gca__set_error(GCA_ERR_INVALID, "%s: not a PyTorch memory snapshot (no device_traces list)", path);
  }
  size_t cap = 0;
  int rc = GCA_OK;
  if (pv_len(traces) > 256) {
    pickle_free(doc);
    return gca__set_error(GCA_ERR_INVALID, "%s: %zu device traces; devices are numbered 0 to 255", path, pv_len(traces));
  }
  t->device_count = (int)pv_len(traces);
  if (sink->count && records_in_order(traces, sink)) {
    t->events = sink->events;
    t->events_big = sink->cap * sizeof *sink->events;
    sink->events = NULL;
    for (size_t d = 0; d < pv_len(traces); d++)
      for (size_t i = 0; i < pv_len(pv_at(traces, d)); i++) t->events[t->count++].device = (uint8_t)d;
    rc = sink->stacks ? intern_stacks(path, sink->frames, t) : GCA_OK;
    pickle_free(doc);
    return rc;
  }
  size_t total = 0;
  for (size_t d = 0; d < pv_len(traces); d++) total += pv_len(pv_at(traces, d));
  const pv_seq_t **frames = NULL;
  if (total && (!(t->events = malloc(total * sizeof *t->events)) ||
                (sink->stacks && !(frames = calloc(total, sizeof *frames)))))
    rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
  cap = total;
  for (size_t d = 0; d < pv_len(traces) && rc == GCA_OK; d++) {
    const pv_t *list = pv_at(traces, d);
    for (size_t i = 0; i < pv_len(list) && rc == GCA_OK; i++) {
      pv_t held;
      const pv_t *entry = pv_item(list, i, &held);
      const pv_seq_t *stack = NULL;
      size_t at = t->count;
      if (entry && entry->kind == PV_RECORD && (uint64_t)entry->u.i < sink->count) {
        trace_event_t e = sink->events[entry->u.i];
        e.device = (uint8_t)d;
        if (sink->stacks) stack = sink->frames[entry->u.i];
        rc = push_event(t, &cap, &e, trace_event_stream(t, &e)); /* (numbered in t already) */
      } else {
        rc = read_entry(path, entry, d, i, t, &cap, &stack);
      }
      if (frames && at < total) frames[at] = stack;
    }
  }
  if (rc == GCA_OK && frames) rc = intern_stacks(path, frames, t);
  free(frames);
  pickle_free(doc);
  return rc;
}

/* A decimal field of a text line after blanks: digits only (no sign, so a
 * negative number is refused, not wrapped) and no overflow. sscanf was
 * most of the time of reading a small log. */
static bool read_decimal(const char **text, uint64_t *out) {
  const char *p = *text;
  while (*p == ' ' || *p == '\t') p++;
  size_t digits = gca__parse_decimal(p, strlen(p), out);
  *text = p + digits;
  return digits > 0;
}

/* allocatorSim: "<alloc_op> <free_op> <size>" per line; frees at an op index
 * come before the allocations at the same index, each kind in line order
 * (a block allocated and freed at one index is freed after the
 * allocations there: it cannot go before it exists).
 * The order is a sort of the lines' two ends, not a table by op index: the
 * indices are the file's to choose, and "0 100000000 1" must not cost a
 * table of a hundred million. */
typedef struct allocsim_end {
  uint64_t op;
  uint64_t order; /* kind << 62 | line index; kinds at an op: 0 frees, 1 allocations, 2 frees of those */
  uint64_t size;
} allocsim_end_t;

#define ALLOCSIM_LINE(order) ((order) & (((uint64_t)1 << 62) - 1))

static inline bool end_before(const allocsim_end_t *x, const allocsim_end_t *y) {
  return x->op != y->op ? x->op < y->op : x->order < y->order;
}

/* Sorts ends[0 .. n) by (op, order), every key distinct (the order holds
 * the line), with room for n more in tmp. qsort was a fifth of replaying
 * the allocatorSim log here: a call through a pointer for each of its
 * 3,300 comparisons. Runs of 8 sorted by insertion, then merged bottom up,
 * back and forth between the two arrays. */
#define ENDS_RUN 8
static void sort_ends(allocsim_end_t *ends, allocsim_end_t *tmp, size_t n) {
  for (size_t lo = 0; lo < n; lo += ENDS_RUN) {
    size_t hi = lo + ENDS_RUN < n ? lo + ENDS_RUN : n;
    for (size_t i = lo + 1; i < hi; i++) {
      allocsim_end_t v = ends[i];
      size_t j = i;
      for (; j > lo && end_before(&v, &ends[j - 1]); j--) ends[j] = ends[j - 1];
      ends[j] = v;
    }
  }
  allocsim_end_t *from = ends, *to = tmp;
  for (size_t width = ENDS_RUN; width < n; width *= 2) {
    for (size_t lo = 0; lo < n; lo += 2 * width) {
      size_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
      size_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi) to[k++] = end_before(&from[j], &from[i]) ? from[j++] : from[i++];
      while (i < mid) to[k++] = from[i++];
      while (j < hi) to[k++] = from[j++];
    }
    allocsim_end_t *swap = from;
    from = to;
    to = swap;
  }
  if (from != ends) memcpy(ends, from, n * sizeof *ends);
}

/* What a text reader tells of its progress: the bytes read of the file or
 * memory file `f` of `total`, every 65,536 lines. */
typedef struct reading {
  trace_progress_fn progress; /* NULL: nothing to tell */
  void *ctx;
  FILE *f;
  uint64_t total;
  size_t memory_limit; /* what the reader may hold (a compressed trace's; 0: its own per-byte bounds) */
  bool stacks;         /* trace_load_options.stacks */
} reading_t;

static void text_progress(const reading_t *r, size_t lineno) {
  if (!r->progress || (lineno & 65535) != 0) return;
  off_t at = ftello(r->f);
  r->progress(r->ctx, "reading", at > 0 ? (uint64_t)at : 0, r->total);
}

static int load_allocsim(const char *path, FILE *f, const reading_t *reading, trace_t *t) {
  allocsim_end_t *ends = NULL;
  size_t n = 0, cap = 0;
  char text[258];
  size_t lineno = 0;
  int rc = GCA_OK;
  while (fgets(text, sizeof text, f)) {
    text_progress(reading, ++lineno);
    size_t len = strlen(text);
    if (len && text[len - 1] != '\n' && !feof(f)) {
      if (len + 1 < sizeof text) rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: holds a NUL character", path, lineno);
      else rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: longer than %zu characters", path, lineno, sizeof text - 2);
      break;
    }
    if (text[0] == '\n' || text[0] == '#') continue;
    uint64_t a, b, s;
    const char *at = text;
    bool parsed = read_decimal(&at, &a) && read_decimal(&at, &b) && read_decimal(&at, &s);
    while (parsed && (*at == ' ' || *at == '\t' || *at == '\r' || *at == '\n')) at++;
    if (!parsed || *at || b < a) {
      rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: expected '<alloc_op> <free_op> <size>' with free_op >= alloc_op",
                          path, lineno);
      break;
    }
    if (2 * n + 2 > cap) {
      if (!events_fit(cap ? cap * 2 : 512, sizeof *ends)) {
        rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: more allocations than a compressed trace of its size may hold; "
                            "refused as malformed: decompress it first to read it", path, lineno);
        break;
      }
      allocsim_end_t *more = gca__grow_array(ends, &cap, sizeof *more, 512);
      if (!more) {
        rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
        break;
      }
      ends = more;
    }
    ends[2 * n] = (allocsim_end_t){a, (uint64_t)1 << 62 | n, s};
    ends[2 * n + 1] = (allocsim_end_t){b, (uint64_t)(a == b ? 2 : 0) << 62 | n, s};
    n++;
  }
  if (rc == GCA_OK && ferror(f)) rc = gca__set_error(GCA_ERR_IO, "cannot read %s", path);
  if (rc == GCA_OK && n == 0) rc = gca__set_error(GCA_ERR_INVALID, "%s: no allocations in the file", path);
  t->device_count = 1;
  allocsim_end_t *tmp = rc == GCA_OK ? malloc(2 * n * sizeof *tmp) : NULL;
  if (rc == GCA_OK && !tmp) rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
  if (rc == GCA_OK) sort_ends(ends, tmp, 2 * n);
  free(tmp);
  size_t ecap = 0;
  for (size_t k = 0; rc == GCA_OK && k < 2 * n; k++) {
    size_t i = (size_t)ALLOCSIM_LINE(ends[k].order);
    trace_event_t e = {.action = ends[k].order >> 62 == 1 ? TA_ALLOC : TA_FREE_COMPLETED,
                       .addr = ((uint64_t)i + 1) * 512, .size = ends[k].size, .time_us = (int64_t)ends[k].op};
    rc = push_event(t, &ecap, &e, 0);
  }
  free(ends);
  return rc;
}

/* RMM's logging_resource_adaptor CSV: a header naming the columns (Thread,
 * Time, Action, Pointer, Size, Stream in every version seen), then one row
 * a call. Actions: "allocate", "free" (older RMM) or "deallocate" (newer),
 * and "allocate failure", which records an OOM of the original run and is
 * kept as such. Time is "HH:MM:SS.ffffff" (older) or seconds since the epoch
 * (newer); a clock going back past midnight is taken as the next day. */
static int csv_column(char **fields, int nfields, const char *name) {
  for (int i = 0; i < nfields; i++)
    if (!strcmp(fields[i], name)) return i;
  return -1;
}

static int split_csv(char *line, char **fields, int max) {
  int n = 0;
  char *p = line;
  line[strcspn(line, "\r\n")] = '\0';
  while (n < max) {
    while (*p == ' ') p++;
    fields[n++] = p;
    char *comma = strchr(p, ',');
    if (!comma) break;
    *comma = '\0';
    p = comma + 1;
  }
  return n;
}

static bool csv_number(const char *text, int base, uint64_t *out) {
  if (!(*text >= '0' && *text <= '9')) return false; /* (strtoull would take blanks and a sign first) */
  char *end;
  errno = 0;
  unsigned long long v = strtoull(text, &end, base);
  if (errno || *end) return false;
  *out = v;
  return true;
}

/* Microseconds from "HH:MM:SS.ffffff" or "seconds.fraction"; either at most
 * 10^12 seconds, so that the microseconds fit (and a day can be added). */
static bool parse_rmm_time(const char *text, int64_t *us) {
  unsigned h, m;
  double sec, s;
  int used = 0;
  if (sscanf(text, "%u:%u:%lf%n", &h, &m, &sec, &used) == 3 && !text[used]) {
    if (m >= 60 || !(sec >= 0 && sec < 61)) return false;
    s = h * 3600.0 + m * 60.0 + sec;
  } else {
    char *end;
    s = strtod(text, &end);
    if (end == text || *end) return false;
  }
  if (!(s >= 0) || s > 1e12) return false;
  *us = (int64_t)(s * 1e6 + 0.5);
  return true;
}

static int load_rmm_csv(const char *path, FILE *f, const reading_t *reading, trace_t *t) {
  char line[1024];
  char *fields[16];
  if (!fgets(line, sizeof line, f)) return gca__set_error(GCA_ERR_INVALID, "%s: empty file", path);
  if (!strchr(line, '\n') && !feof(f))
    return gca__set_error(GCA_ERR_INVALID, "%s:1: line longer than %zu characters", path, sizeof line - 2);
  int nf = split_csv(line, fields, 16);
  int col_time = csv_column(fields, nf, "Time"), col_action = csv_column(fields, nf, "Action"),
      col_ptr = csv_column(fields, nf, "Pointer"), col_size = csv_column(fields, nf, "Size"),
      col_stream = csv_column(fields, nf, "Stream");
  if (col_action < 0 || col_ptr < 0 || col_size < 0)
    return gca__set_error(GCA_ERR_INVALID, "%s:1: an RMM log header needs the columns Action, Pointer and Size", path);
  size_t cap = 0, lineno = 1;
  int64_t day = 0, last_us = -1;
  t->device_count = 1;
  int rc = GCA_OK;
  while (rc == GCA_OK && fgets(line, sizeof line, f)) {
    text_progress(reading, ++lineno);
    if (!strchr(line, '\n') && !feof(f)) {
      /* (fgets stopped short of a full buffer and a newline: at a NUL) */
      if (strlen(line) + 1 < sizeof line)
        rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: holds a NUL character", path, lineno);
      else rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: line longer than %zu characters", path, lineno, sizeof line - 2);
      break;
    }
    if (line[0] == '\n' || (line[0] == '\r' && line[1] == '\n')) continue;
    int n = split_csv(line, fields, 16);
    int need = col_action > col_ptr ? col_action : col_ptr;
    if (col_size > need) need = col_size;
    if (col_stream > need) need = col_stream;
    if (col_time > need) need = col_time;
    if (n <= need) {
      rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: %d fields where the header has %d", path, lineno, n, nf);
      break;
    }
    trace_event_t e = {.device = 0, .time_us = -1};
    uint64_t stream_value = 0;
    const char *action = fields[col_action];
    if (!strcmp(action, "allocate")) e.action = TA_ALLOC;
    else if (!strcmp(action, "free") || !strcmp(action, "deallocate")) e.action = TA_FREE_COMPLETED;
    else if (!strcmp(action, "allocate failure")) e.action = TA_OOM;
    else {
      rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: unknown action '%s' (allocate, free, deallocate, allocate failure)",
                          path, lineno, action);
      break;
    }
    const char *ptr = fields[col_ptr];
    if (!strcmp(ptr, "nullptr") || !strcmp(ptr, "(nil)")) ptr = "0";
    if (!csv_number(ptr, 0, &e.addr) || !csv_number(fields[col_size], 10, &e.size)) {
      rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: Pointer '%s' or Size '%s' is not a number", path, lineno,
                          fields[col_ptr], fields[col_size]);
      break;
    }
    if (e.action == TA_OOM) e.addr = 0; /* a failed allocate has no pointer; oom entries carry free bytes, unknown */
    if (col_stream >= 0) {
      const char *stream = fields[col_stream];
      if (!strcmp(stream, "nullptr") || !strcmp(stream, "(nil)")) stream = "0";
      if (!csv_number(stream, 0, &stream_value)) {
        rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: Stream '%s' is not a number", path, lineno, fields[col_stream]);
        break;
      }
    }
    if (col_time >= 0) {
      int64_t us;
      if (!parse_rmm_time(fields[col_time], &us)) {
        rc = gca__set_error(GCA_ERR_INVALID, "%s:%zu: Time '%s' is neither HH:MM:SS.ffffff nor seconds", path, lineno,
                            fields[col_time]);
        break;
      }
      if (last_us >= 0 && us + day < last_us && last_us - (us + day) > (int64_t)12 * 3600 * 1000000)
        day += (int64_t)24 * 3600 * 1000000;
      e.time_us = last_us = us + day;
    }
    rc = push_event(t, &cap, &e, stream_value);
  }
  if (rc == GCA_OK && ferror(f)) rc = gca__set_error(GCA_ERR_IO, "cannot read %s", path);
  if (rc == GCA_OK && t->count == 0) rc = gca__set_error(GCA_ERR_INVALID, "%s: no calls in the RMM log", path);
  return rc;
}

/* gcalloc's own trace (GCALLOC_TRACE_FILE): mallocs that succeeded become
 * allocs, frees that succeeded their release (a free that left its block
 * pending, in version 2, a free_requested, and its free_completed line the
 * release); a free names no device, so
 * it takes its allocation's, looked up by (allocator, pointer): two
 * allocators of one process may hand out the same address (two sim
 * devices). empty_cache calls become a segment_free marker the replay turns
 * back into an empty_cache; one for every device (-1) becomes a marker on
 * each device its allocator had allocated on by then (on the others it
 * could have done nothing, and so does one naming such a device). The file
 * is read a line at a time, and what is held is the live allocations, not
 * the calls.
 *
 * Each allocator is an allocator of its own in the replay too: the devices
 * replayed are (allocator, device) pairs. While no device number is used by
 * two allocators, a pair is replayed as its device number; when one is (two
 * allocators of one process on one GPU), the pairs are numbered in the
 * order they first allocated, and the trace says which is which
 * (trace_t.origins): replayed as one, their calls would have shared one
 * cache that the job never had. */
typedef struct gcalloc_owner {
  int allocator;
  addr_map_t live;    /* pointer -> pair; made at its first malloc, dropped at its close */
  uint16_t pair[256]; /* per device: its pair + 1, 0 before its first malloc there */
} gcalloc_owner_t;

typedef struct gcalloc_reader {
  const char *path;
  trace_t *t;
  size_t cap;
  addr_map_t allocators; /* allocator id -> index in owners + 1 */
  gcalloc_owner_t *owners;
  size_t owner_count, owner_cap;
  trace_origin_t pairs[256]; /* in the order they first allocated */
  int pair_count;
  uint64_t devices_used[4]; /* device numbers some pair has: a bit each of 0-255 */
  bool shared;              /* a device number is two pairs' */
  const reading_t *reading;
} gcalloc_reader_t;

static gcalloc_owner_t *gcalloc_owner(gcalloc_reader_t *r, int allocator) {
  uint64_t key = (uint32_t)allocator, *at = gca__addr_map_get(&r->allocators, key);
  if (at) return &r->owners[*at - 1];
  if (r->owner_count == r->owner_cap) {
    gcalloc_owner_t *grown = gca__grow_array(r->owners, &r->owner_cap, sizeof *grown, 4);
    if (!grown) return NULL;
    r->owners = grown;
  }
  gcalloc_owner_t *o = &r->owners[r->owner_count];
  memset(o, 0, sizeof *o);
  o->allocator = allocator;
  if (!gca__addr_map_put(&r->allocators, key, r->owner_count + 1)) return NULL;
  r->owner_count++;
  return o;
}

/* The pair of allocator o and device, made at its first malloc; -1 with the
 * error set when there would be more than 256. */
static int gcalloc_pair(gcalloc_reader_t *r, gcalloc_owner_t *o, int device, size_t lineno) {
  if (o->pair[device]) return o->pair[device] - 1;
  if (r->pair_count == 256) {
    (void)gca__set_error(GCA_ERR_INVALID, "trace %s, line %zu: more than 256 (allocator, device) pairs to replay", r->path,
                         lineno);
    return -1;
  }
  uint64_t bit = (uint64_t)1 << (device % 64);
  if (r->devices_used[device / 64] & bit) r->shared = true;
  r->devices_used[device / 64] |= bit;
  r->pairs[r->pair_count] = (trace_origin_t){o->allocator, device};
  o->pair[device] = (uint16_t)(r->pair_count + 1);
  return r->pair_count++;
}

/* In an owner's live map, beside the pair: the pointer's free was pending
 * (its free_completed line is the release). */
#define LIVE_REQUESTED ((uint64_t)1 << 32)

static int gcalloc_call(void *ctx, const recorded_call_t *c, size_t lineno) {
  gcalloc_reader_t *r = ctx;
  text_progress(r->reading, lineno);
  bool is_malloc = c->call == RC_MALLOC && c->ptr, is_free = c->call == RC_FREE && c->status == GCA_OK;
  bool is_empty = c->call == RC_EMPTY_CACHE && c->status == GCA_OK;
  is_free |= c->call == RC_FREE_COMPLETED;
  if (c->call == RC_CLOSE) { /* its allocations are gone with it */
    uint64_t *at = gca__addr_map_get(&r->allocators, (uint32_t)c->allocator);
    if (at) gca__addr_map_free(&r->owners[*at - 1].live);
    return GCA_OK;
  }
  if (!is_malloc && !is_free && !is_empty) return GCA_OK; /* failed calls, open, record_stream */
  if ((is_malloc || is_empty) && (c->device < (is_empty ? -1 : 0) || c->device > 255))
    return gca__set_error(GCA_ERR_INVALID, "trace %s, line %zu: device %d out of range (0-255)", r->path, lineno,
                          c->device);
  /* (addr_map's keys stop two short of the largest.) */
  if ((is_malloc || is_free) && c->ptr >= UINT64_MAX - 1)
    return gca__set_error(GCA_ERR_INVALID, "trace %s, line %zu: pointer %llx out of range", r->path, lineno,
                          (unsigned long long)c->ptr);
  gcalloc_owner_t *o = gcalloc_owner(r, c->allocator);
  if (!o) return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", r->path);
  /* Events name their pair until the end of the file (load_gcalloc_trace). */
  trace_event_t e = {.time_us = c->time_us};
  uint64_t stream = 0;
  if (is_malloc) {
    int pair = gcalloc_pair(r, o, c->device, lineno);
    if (pair < 0) return gca_last_status();
    if (o->live.keys && gca__addr_map_get(&o->live, c->ptr))
      return gca__set_error(GCA_ERR_INVALID, "trace %s, line %zu: a malloc at %llx, which allocator %d has given out "
                            "already and not freed", r->path, lineno, (unsigned long long)c->ptr, c->allocator);
    if ((!o->live.keys && !gca__addr_map_init(&o->live)) || !gca__addr_map_put(&o->live, c->ptr, (uint64_t)pair))
      return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", r->path);
    e = (trace_event_t){.device = (uint8_t)pair, .action = TA_ALLOC, .addr = c->ptr, .size = c->size,
                        .time_us = c->time_us};
    stream = c->stream;
  } else if (is_free) {
    /* A pointer this allocator did not give out in the trace (a free after
     * its close) frees nothing of any device replayed. A free that left
     * its block pending is the program's request, and the memory comes
     * back at its free_completed line (a replay releases it there, as it
     * does a snapshot's); another free is both. */
    uint64_t *pair = o->live.keys ? gca__addr_map_get(&o->live, c->ptr) : NULL;
    if (!pair) return GCA_OK;
    int index = (int)(*pair & (LIVE_REQUESTED - 1));
    bool requested = c->call == RC_FREE && c->pending;
    if (requested && (*pair & LIVE_REQUESTED)) return GCA_OK; /* (asked twice: the first stands) */
    e = (trace_event_t){.device = (uint8_t)index, .action = requested ? TA_FREE_REQUESTED : TA_FREE_COMPLETED,
                        .addr = c->ptr, .time_us = c->time_us};
    if (requested) *pair |= LIVE_REQUESTED;
    else gca__addr_map_del(&o->live, c->ptr);
  } else {
    for (int d = c->device < 0 ? 0 : c->device; d <= (c->device < 0 ? 255 : c->device); d++) {
      if (!o->pair[d]) continue;
      e = (trace_event_t){.device = (uint8_t)(o->pair[d] - 1), .action = TA_SEGMENT_FREE, .time_us = c->time_us};
      int rc = push_event(r->t, &r->cap, &e, 0);
      if (rc) return rc;
    }
    return GCA_OK;
  }
  return push_event(r->t, &r->cap, &e, stream);
}

static int load_gcalloc_trace(const char *path, FILE *f, const reading_t *reading, trace_t *t) {
  gcalloc_reader_t r = {.path = path, .t = t, .reading = reading};
  int rc = gca__addr_map_init(&r.allocators) ? record_read_each_file(f, path, gcalloc_call, &r)
                                        : gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
  for (size_t i = 0; i < r.owner_count; i++) gca__addr_map_free(&r.owners[i].live);
  free(r.owners);
  gca__addr_map_free(&r.allocators);
  if (rc == GCA_OK && t->count == 0) rc = gca__set_error(GCA_ERR_INVALID, "%s: no allocations or frees in the trace", path);
  if (rc != GCA_OK) return rc;
  if (r.shared) {
    t->device_count = r.pair_count;
    t->origins = malloc((size_t)r.pair_count * sizeof *t->origins);
    if (!t->origins) return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
    memcpy(t->origins, r.pairs, (size_t)r.pair_count * sizeof *t->origins);
  } else {
    for (size_t i = 0; i < t->count; i++) {
      trace_event_t *e = &t->events[i];
      e->device = (uint8_t)r.pairs[e->device].device;
      if (e->device + 1 > t->device_count) t->device_count = e->device + 1;
    }
  }
  return GCA_OK;
}

/* pickle_options.progress: the reading's, told as text readers tell theirs. */
static void snapshot_progress(void *ctx, size_t done, size_t total) {
  const reading_t *r = ctx;
  r->progress(r->ctx, "reading", done, total);
}

/* Reads a snapshot from the file at `path`, else from `owned` (len bytes
 * from malloc, which this takes over), else from a copy of `data`; `name`
 * names it in the messages. */
static int read_snapshot(const char *name, const char *path, unsigned char *owned, const void *data, size_t len,
                         bool machine_only, size_t split, const reading_t *reading, trace_t *t) {
  bool stacks = reading && reading->stacks;
  entry_sink_t sink = {.streams = &t->streams, .stacks = stacks};
  /* Frames (call stacks) are most of a snapshot and a replay reads none:
   * they are kept only when asked for, and then read by one reader (the
   * second's records may not look inside containers). */
  pickle_options_t options = {.pruned_key = stacks ? NULL : "frames", .machine_only = machine_only,
                              .split = stacks ? PICKLE_ONE_READER : split,
                              .memory_limit = reading ? reading->memory_limit : 0};
  if (reading && reading->progress) {
    options.progress = snapshot_progress;
    options.progress_ctx = (void *)(uintptr_t)reading; /* (read only there) */
  }
  if (!machine_only) {
    options.records_key = "device_traces";
    options.prepare = prepare_entry;
    options.take = take_entry;
    options.record_size = sizeof(entry_read_t);
    options.record_ctx = &sink;
    options.block_key = "blocks";
    options.block_prepare = prepare_block;
    options.block_take = take_block;
    options.block_size = sizeof(trace_block_t);
  }
  pickle_doc_t *doc = path    ? pickle_load(path, &options)
                      : owned ? pickle_parse_owned(owned, len, &options)
                              : pickle_parse(data, len, &options);
  int rc = doc ? snapshot_to_trace(name, doc, &sink, t) : gca__prefix_error("%s", name);
  gca__big_free(sink.events, sink.cap * sizeof *sink.events);
  free(sink.blocks);
  free(sink.frames);
  return rc;
}

static int parse_snapshot(const char *name, const void *data, size_t len, bool machine_only, size_t split,
                          bool stacks, trace_t *out) {
  memset(out, 0, sizeof *out);
  reading_t reading = {.total = len, .stacks = true};
  int rc = read_snapshot(name, NULL, NULL, data, len, machine_only, split, stacks ? &reading : NULL, out);
  if (rc != GCA_OK) trace_free(out);
  return rc;
}

int trace_parse_snapshot(const char *name, const void *data, size_t len, trace_t *out) {
  return parse_snapshot(name, data, len, false, 0, false, out);
}

int trace_parse_snapshot_slowly(const char *name, const void *data, size_t len, trace_t *out) {
  return parse_snapshot(name, data, len, true, 0, false, out);
}

int trace_parse_snapshot_split(const char *name, const void *data, size_t len, size_t split, trace_t *out) {
  return parse_snapshot(name, data, len, false, split, false, out);
}

int trace_parse_snapshot_stacks(const char *name, const void *data, size_t len, trace_t *out) {
  return parse_snapshot(name, data, len, false, 0, true, out);
}

bool trace_equal(const trace_t *a, const trace_t *b) {
  if (a->count != b->count || a->device_count != b->device_count || a->final_block_count != b->final_block_count ||
      a->final_segment_count != b->final_segment_count || a->has_segment_state != b->has_segment_state ||
      !a->settings != !b->settings || (a->settings && strcmp(a->settings, b->settings)) ||
      !a->origins != !b->origins ||
      (a->origins && memcmp(a->origins, b->origins, (size_t)a->device_count * sizeof *a->origins)))
    return false;
  for (size_t i = 0; i < a->count; i++) {
    const trace_event_t *x = &a->events[i], *y = &b->events[i];
    if (x->device != y->device || x->action != y->action || x->addr != y->addr || x->size != y->size ||
        trace_event_stream(a, x) != trace_event_stream(b, y) || x->time_us != y->time_us)
      return false;
  }
  for (size_t i = 0; i < a->final_block_count; i++) {
    const trace_block_t *x = &a->final_blocks[i], *y = &b->final_blocks[i];
    if (x->device != y->device || x->addr != y->addr || x->size != y->size || x->requested != y->requested ||
        x->stream != y->stream || x->active != y->active)
      return false;
  }
  for (size_t i = 0; i < a->final_segment_count; i++) {
    const trace_segment_t *x = &a->final_segments[i], *y = &b->final_segments[i];
    if (x->device != y->device || x->addr != y->addr || x->size != y->size || x->stream != y->stream) return false;
  }
  return true;
}

/* Compressions a trace may come in, told by their first bytes. gzip, zstd,
 * xz and bzip2 are read; lz4 (no library of the project's reads it) is
 * named, with the command that decompresses it. */
typedef enum packing { PACK_GZIP, PACK_ZSTD, PACK_XZ, PACK_BZIP2, PACK_OTHER } packing;

typedef struct compression {
  const char *magic;
  size_t magic_len;
  packing packing;
  const char *name, *cat; /* and the command that decompresses to stdout */
} compression_t;

static const compression_t *compression_of(const unsigned char *head, size_t len) {
  static const compression_t known[] = {
      {"\037\213", 2, PACK_GZIP, "gzip", "zcat"},
      {"\050\265\057\375", 4, PACK_ZSTD, "zstd", "zstdcat"},
      {"\3757zXZ\0", 6, PACK_XZ, "xz", "xzcat"},
      {"BZh", 3, PACK_BZIP2, "bzip2", "bzcat"},
      {"\004\042\115\030", 4, PACK_OTHER, "lz4", "lz4cat"},
  };
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
    if (len >= known[i].magic_len && !memcmp(head, known[i].magic, known[i].magic_len)) return &known[i];
  return NULL;
}

/* ---- what a trace held in memory may be -------------------------------
 * Input read whole into memory (a pipe, a device, decompressed data) is
 * held to a cap, GCALLOC_TRACE_MAX_BYTES (a size: "64GiB"; 16 GiB by
 * default), and looked at as it arrives, so that a file that cannot be a
 * trace fails at its first bytes rather than after filling the host: its
 * first byte must start one of the formats, a text trace has no line
 * longer than TEXT_LINE_LIMIT (the text readers take 1,024 characters),
 * and a pickle's opcodes are ones its reader reads (pickle_scan). */
#define TRACE_MAX_BYTES_DEFAULT ((size_t)16 << 30)
#define TEXT_LINE_LIMIT ((size_t)4096)

/* The cap, or 0 with the error set when GCALLOC_TRACE_MAX_BYTES is set to
 * something that is not a size above 0 (unset or empty: the default). */
static size_t trace_max_bytes(void) {
  const char *text = getenv("GCALLOC_TRACE_MAX_BYTES");
  if (!text || !*text) return TRACE_MAX_BYTES_DEFAULT;
  uint64_t v = 0;
  if (gca__parse_size(text, strlen(text), &v) && v > 0) return v < SIZE_MAX / 2 ? (size_t)v : SIZE_MAX / 2;
  gca__set_error(GCA_ERR_INVALID, "GCALLOC_TRACE_MAX_BYTES=%.40s is not a size above 0 (e.g. 64GiB, 512MiB or 1000000)",
                 text);
  return 0;
}

typedef struct input_guard {
  size_t checked;       /* bytes looked at */
  size_t line_run;      /* of a text trace: bytes since the last newline */
  bool text;
  pickle_scan_t pickle; /* of a pickle: its opcodes (pickle.h) */
} input_guard_t;

/* Look at buf[g->checked, len): false, with the error set, when it cannot
 * be a trace. */
static bool guard_input(input_guard_t *g, const char *path, const char *what, const unsigned char *buf, size_t len) {
  if (g->checked == 0 && len > 0) {
    unsigned first = buf[0];
    if (compression_of(buf, len)) { /* compressed: its decompression is looked at instead */
      g->checked = len;
      return true;
    }
    bool known = first == 0x80 || first == 0xEF || first == '\t' || first == '\n' || first == '\r' ||
                 (first >= ' ' && first <= '~');
    if (!known)
      return !gca__set_error(GCA_ERR_INVALID,
                             "%s: %s starts with the byte 0x%02x: not a PyTorch snapshot (pickle), a gcalloc trace, an "
                             "RMM CSV log or an allocatorSim log", path, what, first);
    g->text = first != 0x80;
  }
  if (!g->text && !pickle_scan(&g->pickle, buf, len)) { /* (the message the parser would give) */
    gca__prefix_error("%s", path);
    return false;
  }
  if (g->text) {
    for (size_t i = g->checked; i < len; i++) {
      const unsigned char *nl = memchr(buf + i, '\n', len - i);
      size_t run = (nl ? (size_t)(nl - (buf + i)) : len - i);
      if (g->line_run + run > TEXT_LINE_LIMIT)
        return !gca__set_error(GCA_ERR_INVALID, "%s: %s has a line longer than %zu characters near byte %zu: not a text "
                               "trace", path, what, TEXT_LINE_LIMIT, i);
      if (!nl) {
        g->line_run += run;
        break;
      }
      g->line_run = 0;
      i += run;
    }
  }
  g->checked = len;
  return true;
}

/* ---- input read as it is used --------------------------------------------
 * A pipe can be read only once: what it gives is kept (a source's buf holds
 * all of it so far), and is read a piece at a time, as the reader that uses
 * it asks, so that input that cannot be a trace is refused at its first
 * bad bytes, not after all of it has come (a decompressor decodes what has
 * come; the pickle and text guards look at it). A file read whole is a
 * source that has ended. Either is held to the cap of input read whole,
 * GCALLOC_TRACE_MAX_BYTES (a file is bounded by its size). */
typedef struct source {
  FILE *f;          /* NULL once it has ended (closed then) */
  const char *path;
  unsigned char *buf; /* with a byte to spare past len, for a NUL */
  size_t len, cap, max;
} source_t;

/* A pipe's read: at most this much at once, so that a reader looks at its
 * input in pieces while more comes. */
#define SOURCE_PIECE ((size_t)1 << 20)

static void source_end(source_t *s) {
  if (s->f) fclose(s->f);
  s->f = NULL;
}

static bool source_refuse_over_cap(const source_t *s) {
  return !gca__set_error(GCA_ERR_INVALID, "%s: more than %zu bytes of input, the most a trace read whole may be "
                         "(GCALLOC_TRACE_MAX_BYTES raises it)", s->path, s->max);
}

/* The next piece of *s (nothing once it has ended); false, with the error
 * set, when it cannot be read or would pass the cap. */
static bool source_more(source_t *s) {
  if (!s->f) return true;
  if (s->len == s->cap) {
    if (s->cap >= s->max) return source_refuse_over_cap(s);
    size_t cap = s->cap == 0 ? (size_t)64 << 10 : s->cap > s->max / 2 ? s->max : s->cap * 2;
    unsigned char *grown = realloc(s->buf, cap + 1);
    if (!grown) return !gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", s->path);
    s->buf = grown;
    s->cap = cap;
  }
  size_t want = s->cap - s->len < SOURCE_PIECE ? s->cap - s->len : SOURCE_PIECE;
  size_t got = fread(s->buf + s->len, 1, want, s->f);
  s->len += got;
  if (got < want) {
    bool failed = ferror(s->f);
    int err = errno;
    source_end(s);
    if (failed) return !gca__set_error(GCA_ERR_IO, "cannot read %s: %s", s->path, strerror(err));
  }
  return true;
}

/* At least `n` bytes from `at` in *s, or all there is (false, the error
 * set, when it cannot be read). */
static bool source_want(source_t *s, size_t at, size_t n) {
  while (s->f && s->len - at < n)
    if (!source_more(s)) return false;
  return true;
}

/* The length *s has when all of it is read (`total`), what is read past
 * `keep` dropped as it comes (it is not held; past the cap it is
 * refused). */
static bool source_length(source_t *s, size_t keep, size_t *total) {
  *total = s->len;
  while (s->f) {
    s->len = keep;
    if (!source_more(s)) return false;
    *total += s->len - keep;
    if (*total > s->max) return source_refuse_over_cap(s);
  }
  s->len = keep < s->len ? keep : s->len;
  return true;
}

typedef struct unpacked {
  unsigned char *buf;
  size_t len, cap, max;
  source_t *in;               /* what is decompressed */
  trace_progress_fn progress; /* told the input read after each step (NULL: nothing to tell) */
  void *ctx;
  input_guard_t guard;
} unpacked_t;

/* Each decoder call writes at most this much, so that a big trace's
 * progress is told as it is decompressed (trace_load_progress). */
#define UNPACK_STEP ((size_t)8 << 20)

/* Output room for one decoder call: what is left, at most UNPACK_STEP. */
static size_t step_room(const unpacked_t *u) {
  size_t room = u->cap - 1 - u->len;
  return room < UNPACK_STEP ? room : UNPACK_STEP;
}

static void unpack_told(const unpacked_t *u, size_t done) {
  if (u->progress) u->progress(u->ctx, "decompressing", done, u->in->f ? 0 : u->in->len);
}

/* false, with the error that the host ran out of memory decompressing. */
static bool unpack_out_of_memory(const char *path) {
  gca__set_error(GCA_ERR_NOMEM, "out of host memory decompressing %s", path);
  return false;
}

/* zlib and libbz2 count in 32 bits: longer input and output go to them in
 * pieces of at most this. */
static unsigned piece32(size_t n) { return n < UINT32_MAX ? (unsigned)n : UINT32_MAX; }

/* What the decompressed data may be: a quarter of the reading's budget for
 * the compressed bytes, at most the cap. */
static size_t unpack_limit(const unpacked_t *u) {
  size_t limit = read_budget(u->in->len) / 4;
  return limit < u->max ? limit : u->max;
}

/* Room for more output: false (the error set) at the bound or when the
 * host is out of memory. The bound is the compressed data's whole: where
 * more of a pipe may come, it is read (and held) before the output is
 * refused, so that a pipe is refused exactly where its file would be. One
 * byte is kept past the end, for the NUL the text readers' memory file
 * wants. */
static bool unpacked_room(unpacked_t *u, const char *path, const char *name) {
  char what[48];
  snprintf(what, sizeof what, "its %s data", name);
  if (!guard_input(&u->guard, path, what, u->buf, u->len)) return false;
  if (u->len + 1 < u->cap) return true;
  while (u->cap > unpack_limit(u) && u->in->f)
    if (!source_more(u->in)) return false;
  size_t limit = unpack_limit(u);
  if (u->cap > limit) {
    gca__set_error(GCA_ERR_INVALID, "%s: %s data that decompresses to more than %zu bytes (%zu per compressed byte, "
                   "and %zu MiB more, at most GCALLOC_TRACE_MAX_BYTES) is refused as malformed; decompress it "
                   "yourself to read it, or raise GCALLOC_TRACE_MAX_BYTES",
                   path, name, limit, READ_BUDGET_PER_PACKED / 4, (READ_BUDGET_FLOOR / 4) >> 20);
    return false;
  }
  size_t cap = u->cap * 2 > limit + 1 ? limit + 1 : u->cap * 2;
  unsigned char *grown = realloc(u->buf, cap + 1);
  if (!grown) return unpack_out_of_memory(path);
  u->buf = grown;
  u->cap = cap + 1;
  return true;
}

/* What follows the end of a compressed stream at `at` of the input: true
 * when another stream starts there (its magic, or as much of it as there
 * is: a stream cut short in its magic is cut short, not other bytes); else
 * false, with the error set unless the input ends there. (zcat, xzcat and
 * bzcat read streams one after another; a trace followed by other bytes is
 * refused, not guessed at.) */
static bool next_stream(const char *path, const compression_t *c, source_t *in, size_t at, bool *ok) {
  if (!(*ok = source_want(in, at, c->magic_len))) return false;
  if (at == in->len) return false;
  size_t n = in->len - at < c->magic_len ? in->len - at : c->magic_len;
  if (!memcmp(in->buf + at, c->magic, n)) return true;
  size_t total = 0;
  if (!(*ok = source_length(in, at, &total))) return false;
  *ok = !gca__set_error(GCA_ERR_INVALID, "%s: %zu bytes after the %s data, from byte %zu, are not %s", path,
                        total - at, c->name, at, c->name);
  return false;
}

/* gzip, with zlib: one member after another (as zcat reads them). */
static bool gunzip(const char *path, const compression_t *c, unpacked_t *u) {
  source_t *in = u->in;
  z_stream z;
  memset(&z, 0, sizeof z);
  if (inflateInit2(&z, 15 + 16) != Z_OK) return unpack_out_of_memory(path);
  size_t at = 0; /* input consumed */
  bool ok = true, ended = false;
  while (ok) {
    if (!(ok = unpacked_room(u, path, c->name) && source_want(in, at, 1))) break;
    unsigned in_piece = piece32(in->len - at), out_room = piece32(step_room(u));
    z.next_in = in->buf + at;
    z.avail_in = in_piece;
    z.next_out = u->buf + u->len;
    z.avail_out = out_room;
    int rc = inflate(&z, Z_NO_FLUSH);
    at += in_piece - z.avail_in;
    u->len += out_room - z.avail_out;
    unpack_told(u, at);
    ended = rc == Z_STREAM_END;
    if (ended) {
      if (!next_stream(path, c, in, at, &ok)) break;
      ended = false;
      if (inflateReset(&z) != Z_OK) ok = !gca__set_error(GCA_ERR_INVALID, "%s: gzip: cannot start its next member", path);
    } else if (rc == Z_BUF_ERROR && at == in->len) {
      break; /* all input read, and the member not finished: cut short */
    } else if (rc != Z_OK) { /* (Z_BUF_ERROR with input and room left: no progress possible) */
      ok = !gca__set_error(rc == Z_MEM_ERROR ? GCA_ERR_NOMEM : GCA_ERR_INVALID, "%s: gzip data corrupt near byte %zu: %s",
                           path, at, z.msg ? z.msg : zError(rc));
    }
  }
  inflateEnd(&z);
  if (ok && !ended)
    ok = !gca__set_error(GCA_ERR_INVALID, "%s: the gzip data is cut short (it ends at byte %zu, inside a member)", path,
                         in->len);
  return ok;
}

/* zstd: frame after frame (skippable ones skipped), as zstdcat reads them. */
static bool unzstd(const char *path, const compression_t *c, unpacked_t *u) {
  source_t *in = u->in;
  ZSTD_DCtx *z = ZSTD_createDCtx();
  if (!z) return unpack_out_of_memory(path);
  /* The input goes in pieces of UNZSTD_PIECE, so that an error can be
   * placed: zstd says what is wrong, not where. */
  enum { UNZSTD_PIECE = 64 << 10 };
  ZSTD_inBuffer input = {NULL, 0, 0};
  size_t left = 0; /* 0 when the last frame read is whole */
  bool ok = true;
  while (ok) {
    if (!(ok = unpacked_room(u, path, c->name))) break;
    if (input.pos == input.size) {
      if (!(ok = source_want(in, input.size, 1))) break;
      input.size = in->len - input.size < UNZSTD_PIECE ? in->len : input.size + UNZSTD_PIECE;
    }
    input.src = in->buf;
    ZSTD_outBuffer output = {u->buf + u->len, step_room(u), 0};
    size_t from = input.pos;
    left = ZSTD_decompressStream(z, &output, &input);
    u->len += output.pos;
    unpack_told(u, input.pos);
    if (ZSTD_isError(left)) {
      ok = !gca__set_error(ZSTD_getErrorCode(left) == ZSTD_error_memory_allocation ? GCA_ERR_NOMEM : GCA_ERR_INVALID,
                           "%s: zstd data corrupt between bytes %zu and %zu: %s", path, from, input.size,
                           ZSTD_getErrorName(left));
      break;
    }
    /* All input read, and the output not filled: nothing is held back. */
    if (input.pos == in->len && !in->f && output.pos < output.size) break;
  }
  ZSTD_freeDCtx(z);
  if (ok && left != 0)
    ok = !gca__set_error(GCA_ERR_INVALID, "%s: the zstd data is cut short (it ends at byte %zu, inside a frame)", path,
                         in->len);
  return ok;
}

/* The most memory xz's decoder may take: a stream whose dictionary needs
 * more is refused with a message that says so (`xz -9` needs 65 MiB; a
 * trace of a few megabytes gains nothing from more). */
#define XZ_MEMORY_LIMIT ((uint64_t)1 << 30)

/* xz, with liblzma: stream after stream, with the padding xz allows
 * between them (zero bytes, four at a time), as xzcat reads them. */
static bool unxz(const char *path, const compression_t *c, unpacked_t *u) {
  source_t *in = u->in;
  lzma_stream z = LZMA_STREAM_INIT;
  bool ok = true, ended = false;
  size_t at = 0; /* input consumed by the streams before this one */
  if (lzma_stream_decoder(&z, XZ_MEMORY_LIMIT, 0) != LZMA_OK) return unpack_out_of_memory(path);
  while (ok) {
    if (!(ok = unpacked_room(u, path, c->name))) break;
    size_t used = at + (size_t)z.total_in;
    if (!(ok = source_want(in, used, 1))) break;
    z.next_in = in->buf + used;
    z.avail_in = in->len - used;
    size_t room = step_room(u);
    z.next_out = u->buf + u->len;
    z.avail_out = room;
    lzma_ret rc = lzma_code(&z, in->f ? LZMA_RUN : LZMA_FINISH); /* (FINISH: the whole input is given) */
    u->len += room - z.avail_out;
    unpack_told(u, at + (size_t)z.total_in);
    if (rc == LZMA_OK) continue;
    if (rc == LZMA_STREAM_END) {
      ended = true;
      size_t end = at + (size_t)z.total_in, next = end;
      for (;;) {
        while (next < in->len && !in->buf[next]) next++;
        if (next < in->len || !in->f) break;
        if (!(ok = source_more(in))) break;
      }
      if (!ok) break;
      if ((next - end) % 4) {
        ok = !gca__set_error(GCA_ERR_INVALID, "%s: xz data corrupt near byte %zu: padding of %zu bytes, not a multiple "
                             "of four", path, end, next - end);
        break;
      }
      if (!next_stream(path, c, in, next, &ok)) break;
      lzma_end(&z);
      z = (lzma_stream)LZMA_STREAM_INIT;
      if (lzma_stream_decoder(&z, XZ_MEMORY_LIMIT, 0) != LZMA_OK) {
        ok = unpack_out_of_memory(path);
        break;
      }
      at = next;
      ended = false;
      continue;
    }
    size_t near = at + (size_t)z.total_in;
    if (rc == LZMA_BUF_ERROR && !z.avail_in) break; /* all input read, and the stream not finished: cut short */
    if (rc == LZMA_MEM_ERROR) ok = unpack_out_of_memory(path);
    else if (rc == LZMA_MEMLIMIT_ERROR)
      ok = !gca__set_error(GCA_ERR_INVALID, "%s: the xz stream at byte %zu needs %llu MiB to decompress, more than the "
                           "%llu MiB gcalloc allows; decompress it yourself (with xzcat: gcalloc replay <(xzcat FILE))",
                           path, at, (unsigned long long)(lzma_memusage(&z) >> 20),
                           (unsigned long long)(XZ_MEMORY_LIMIT >> 20));
    else
      ok = !gca__set_error(GCA_ERR_INVALID, "%s: xz data corrupt near byte %zu: %s", path, near,
                           rc == LZMA_FORMAT_ERROR    ? "not an xz stream"
                           : rc == LZMA_OPTIONS_ERROR ? "options this liblzma does not support"
                                                 : "its data or a check does not match");
  }
  lzma_end(&z);
  if (ok && !ended)
    ok = !gca__set_error(GCA_ERR_INVALID, "%s: the xz data is cut short (it ends at byte %zu, inside a stream)", path,
                         in->len);
  return ok;
}

/* bzip2, with libbz2: stream after stream, as bzcat reads them. */
static bool bunzip2(const char *path, const compression_t *c, unpacked_t *u) {
  source_t *in = u->in;
  bz_stream z;
  memset(&z, 0, sizeof z);
  if (BZ2_bzDecompressInit(&z, 0, 0) != BZ_OK) return unpack_out_of_memory(path);
  size_t at = 0; /* input consumed */
  bool ok = true, ended = false;
  while (ok) {
    if (!(ok = unpacked_room(u, path, c->name) && source_want(in, at, 1))) break;
    unsigned in_piece = piece32(in->len - at), out_room = piece32(step_room(u));
    z.next_in = (char *)(in->buf + at);
    z.avail_in = in_piece;
    z.next_out = (char *)(u->buf + u->len);
    z.avail_out = out_room;
    int rc = BZ2_bzDecompress(&z);
    at += in_piece - z.avail_in;
    u->len += out_room - z.avail_out;
    unpack_told(u, at);
    if (rc == BZ_STREAM_END) {
      ended = true;
      if (!next_stream(path, c, in, at, &ok)) break;
      BZ2_bzDecompressEnd(&z);
      memset(&z, 0, sizeof z);
      if (BZ2_bzDecompressInit(&z, 0, 0) != BZ_OK) {
        ok = unpack_out_of_memory(path);
        break;
      }
      ended = false;
    } else if (rc == BZ_OK) {
      if (at == in->len && !in->f && z.avail_out) break; /* all input read, and room left: cut short */
    } else {
      /* (A block's check is tested at its end: the damage may lie
       * anywhere in the block read up to there.) */
      if (rc == BZ_MEM_ERROR) ok = unpack_out_of_memory(path);
      else if (rc == BZ_DATA_ERROR_MAGIC)
        ok = !gca__set_error(GCA_ERR_INVALID, "%s: bzip2 data corrupt near byte %zu: not a bzip2 stream", path, at);
      else ok = !gca__set_error(GCA_ERR_INVALID, "%s: bzip2 data corrupt in the block read up to byte %zu", path, at);
    }
  }
  BZ2_bzDecompressEnd(&z);
  if (ok && !ended)
    ok = !gca__set_error(GCA_ERR_INVALID, "%s: the bzip2 data is cut short (it ends at byte %zu, inside a stream)", path,
                         in->len);
  return ok;
}

/* The size the last xz stream's index records (the sum of its blocks'
 * uncompressed sizes), read from the stream's end; 0 where there is none
 * to read (padding after it, or a damaged end: the decoder names what is
 * wrong). */
static size_t xz_last_size(const unsigned char *in, size_t len) {
  lzma_stream_flags footer;
  if (len < 2 * LZMA_STREAM_HEADER_SIZE ||
      lzma_stream_footer_decode(&footer, in + len - LZMA_STREAM_HEADER_SIZE) != LZMA_OK ||
      footer.backward_size > len - 2 * LZMA_STREAM_HEADER_SIZE)
    return 0;
  lzma_index *index = NULL;
  uint64_t memory = (uint64_t)16 << 20;
  size_t at = 0;
  if (lzma_index_buffer_decode(&index, &memory, NULL, in + len - LZMA_STREAM_HEADER_SIZE - footer.backward_size, &at,
                               (size_t)footer.backward_size) != LZMA_OK)
    return 0;
  lzma_vli size = lzma_index_uncompressed_size(index);
  lzma_index_end(index, NULL);
  return size < SIZE_MAX / 2 ? (size_t)size : 0;
}

/* The trace in *in decompressed, NUL-terminated (len without it), read as
 * it is decompressed where it is a pipe; NULL with the error set. */
static unsigned char *unpack(const char *path, const compression_t *c, source_t *in, size_t max,
                             trace_progress_fn progress, void *ctx, size_t *out_len) {
  unpacked_t u = {.max = max, .in = in, .progress = progress, .ctx = ctx};
  size_t limit = unpack_limit(&u);
  /* Sized at once where the data says how long it is: a zstd frame may
   * carry its size; gzip's last member ends with its size (mod 2^32); xz's
   * last stream ends with an index of its blocks' sizes (a pipe's end is
   * not there yet: it grows). Each is the whole when there is one frame,
   * member or stream (under 4 GiB for gzip), as the tools write them; else
   * the buffer grows. Without a size (bzip2 records none), four times the
   * input to start with, doubling. */
  const unsigned char *packed = in->buf;
  size_t len = in->len, hint = 0;
  if (c->packing == PACK_ZSTD) {
    unsigned long long first = ZSTD_getFrameContentSize(packed, len);
    if (first != ZSTD_CONTENTSIZE_UNKNOWN && first != ZSTD_CONTENTSIZE_ERROR && first < limit) hint = (size_t)first;
  } else if (in->f) {
    hint = 0;
  } else if (c->packing == PACK_XZ) {
    hint = xz_last_size(packed, len);
  } else if (c->packing == PACK_GZIP && len >= 18) {
    hint = (size_t)packed[len - 4] | (size_t)packed[len - 3] << 8 | (size_t)packed[len - 2] << 16 |
           (size_t)packed[len - 1] << 24;
  }
  /* A size the data claims is taken only where the data could hold it
   * (gzip cannot pass 1,032 to 1; the others are held to the bound without
   * its floor): a damaged or made-up one would have every small file ask
   * for 24 MiB at once. */
  if (hint > ((size_t)64 << 10) && hint / (c->packing == PACK_GZIP ? 1032 : READ_BUDGET_PER_PACKED / 4) > len) hint = 0;
  u.cap = hint ? hint + 2 : len < ((size_t)16 << 10) ? (size_t)64 << 10 : len * 4;
  if (u.cap > limit) u.cap = limit;
  if (!(u.buf = malloc(u.cap))) {
    unpack_out_of_memory(path);
    return NULL;
  }
  bool done = c->packing == PACK_GZIP    ? gunzip(path, c, &u)
              : c->packing == PACK_ZSTD  ? unzstd(path, c, &u)
              : c->packing == PACK_XZ    ? unxz(path, c, &u)
                                         : bunzip2(path, c, &u);
  char what[48];
  snprintf(what, sizeof what, "its %s data", c->name);
  if (done) done = guard_input(&u.guard, path, what, u.buf, u.len);
  if (!done) {
    free(u.buf);
    return NULL;
  }
  u.buf[u.len] = '\0';
  *out_len = u.len;
  return u.buf;
}

int trace_load(const char *path, trace_t *out) { return trace_load_progress(path, out, NULL, NULL); }

int trace_load_progress(const char *path, trace_t *out, trace_progress_fn progress, void *ctx) {
  trace_load_options_t options = {.progress = progress, .ctx = ctx};
  return trace_load_with(path, &options, out);
}

int trace_load_with(const char *path, const trace_load_options_t *options, trace_t *out) {
  trace_progress_fn progress = options->progress;
  void *ctx = options->ctx;
  memset(out, 0, sizeof *out);
  /* A process reading its second trace reads trace after trace: its big
   * arrays are worth huge pages from now on (util.c). */
  static atomic_int loads;
  if (atomic_fetch_add_explicit(&loads, 1, memory_order_relaxed) > 0) gca__big_prefer_huge_pages();
  size_t max = trace_max_bytes();
  if (!max) return gca_last_status();
  FILE *f = fopen(path, "rb");
  if (!f) return gca__set_error(GCA_ERR_IO, "cannot open trace %s: %s", path, strerror(errno));
  struct stat st;
  bool known = fstat(fileno(f), &st) == 0, regular = known && S_ISREG(st.st_mode);
  if (known && S_ISDIR(st.st_mode)) {
    fclose(f);
    return gca__set_error(GCA_ERR_IO, "cannot read trace %s: it is a directory", path);
  }
  /* A pipe (`<(zcat trace.gz)`, /dev/stdin) can be read only once, and its
   * first byte says which reader reads it: it is read into memory, as the
   * guard or the decompressor that looks at it goes (source_t), and the
   * reader reads it there. A file's first bytes are read and it is
   * rewound. */
  source_t in = {.f = f, .path = path, .max = max};
  unsigned char head[6] = {0};
  size_t head_len;
  if (regular) {
    head_len = fread(head, 1, sizeof head, f);
    rewind(f);
  } else {
    if (!source_want(&in, 0, sizeof head)) goto refused;
    head_len = in.len < sizeof head ? in.len : sizeof head;
    memcpy(head, in.buf, head_len);
  }
  /* A file is held to the same first bytes as a pipe, so that both refuse
   * alike. */
  input_guard_t guard = {0};
  if (!guard_input(&guard, path, "its input", head, head_len)) goto refused;
  /* A gzip, zstd, xz or bzip2 trace is decompressed into memory (a file
   * read whole first, a pipe as it comes), and read there as a pipe's;
   * lz4 is named, with the command that decompresses it (read as it is,
   * it would be taken for an allocatorSim log and refused for its first
   * line). */
  const compression_t *packed = compression_of(head, head_len);
  unsigned char *piped = NULL;
  size_t piped_len = 0, memory_limit = 0;
  if (packed && packed->packing == PACK_OTHER) {
    gca__set_error(GCA_ERR_INVALID, "%s: %s-compressed: decompress it first (with %s: gcalloc replay <(%s FILE))",
                   path, packed->name, packed->cat, packed->cat);
    goto refused;
  }
  if (packed) {
    if (regular) { /* (bounded by its size: read whole, in one buffer unless it grows) */
      in.max = SIZE_MAX / 2;
      in.cap = st.st_size > 0 && (uint64_t)st.st_size < in.max ? (size_t)st.st_size + 1 : 0;
      if (in.cap && !(in.buf = malloc(in.cap + 1))) {
        gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
        goto refused;
      }
      while (in.f)
        if (!source_more(&in)) goto refused;
    }
    size_t plain_len = 0;
    unsigned char *plain = unpack(path, packed, &in, max, progress, ctx, &plain_len);
    if (plain && !source_length(&in, in.len, &piped_len)) {
      free(plain);
      plain = NULL;
    }
    source_end(&in);
    free(in.buf);
    if (!plain) return gca_last_status();
    memory_limit = read_budget(piped_len) - plain_len; /* (the data is at most a quarter of it) */
    piped = plain;
    piped_len = plain_len;
    head_len = piped_len < sizeof head ? piped_len : sizeof head;
    memset(head, 0, sizeof head);
    memcpy(head, piped, head_len);
    const compression_t *inner = compression_of(head, head_len);
    if (inner) {
      free(piped);
      return gca__set_error(GCA_ERR_INVALID, "%s: %s-compressed data inside the %s data: decompress it first (with %s)",
                            path, inner->name, packed->name, inner->cat);
    }
    f = NULL;
  } else if (!regular) {
    /* The rest of the pipe, looked at as it comes; a pickle's ends at its
     * STOP opcode, after which its reader reads nothing. */
    for (;;) {
      if (!guard_input(&guard, path, "its input", in.buf, in.len)) goto refused;
      if (!in.f || guard.pickle.stopped) break;
      if (!source_more(&in)) goto refused;
    }
    source_end(&in);
    piped = in.buf;
    piped_len = in.len;
    if (!piped && !(piped = malloc(1))) return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
    piped[piped_len] = '\0';
    f = NULL;
  }
  /* A text trace in memory is read through a memory file. */
  if (piped && piped_len && piped[0] != 0x80 && !(f = fmemopen(piped, piped_len, "rb"))) {
    free(piped);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", path);
  }
  /* A text trace saved by an editor or a spreadsheet may open with a UTF-8
   * byte order mark: the format is told by what follows it, and the reader
   * starts there. (Such a pipe was opened as a memory file above.) */
  size_t mark = head_len >= 3 && !memcmp(head, "\357\273\277", 3) ? 3 : 0;
  if (mark) (void)fseek(f, (long)mark, SEEK_SET);
  int first = head_len > mark ? head[mark] : EOF;
  reading_t reading = {.progress = progress, .ctx = ctx, .f = f,
                       .total = piped ? piped_len : regular ? (uint64_t)st.st_size : 0, .memory_limit = memory_limit,
                       .stacks = options->stacks};
  events_limit = memory_limit ? memory_limit / 4 : SIZE_MAX;
  events_path = path;
  /* Stacks from a snapshot within the limit only (pickle_options.pruned_key). */
  uint64_t snapshot_bytes = reading.total;
  if (reading.stacks && options->stacks_limit && snapshot_bytes > options->stacks_limit) reading.stacks = false;
  int rc;
  if (first == EOF) rc = gca__set_error(GCA_ERR_INVALID, "%s: empty file", path);
  else if (first == 0x80 && piped) {
    rc = read_snapshot(path, NULL, piped, NULL, piped_len, false, 0, &reading, out);
    piped = NULL; /* (the reader's now) */
  } else if (first == 0x80) {
    fclose(f);
    f = NULL;
    rc = read_snapshot(path, path, NULL, NULL, 0, false, 0, &reading, out);
  } else if (first == '#') rc = load_gcalloc_trace(path, f, &reading, out);
  else if (first == 'T') rc = load_rmm_csv(path, f, &reading, out);
  else rc = load_allocsim(path, f, &reading, out);
  events_limit = SIZE_MAX;
  if (f) fclose(f);
  free(piped);
  if (rc != GCA_OK) trace_free(out);
  else if (first == 0x80 && options->stacks && !reading.stacks) out->stacks_left_out = snapshot_bytes;
  return rc;
refused:
  source_end(&in);
  free(in.buf);
  return gca_last_status();
}

void trace_free(trace_t *t) {
  if (t->events_big) gca__big_free(t->events, t->events_big);
  else free(t->events);
  free(t->final_blocks);
  free(t->final_segments);
  free(t->settings);
  free(t->origins);
  for (size_t i = 0; i < t->stack_count; i++) free(t->stacks[i]);
  free(t->stacks);
  free(t->event_stacks);
  trace_streams_free(&t->streams);
  memset(t, 0, sizeof *t);
}

/* ---- trace to operations ------------------------------------------------ */

/* Live blocks are keyed by (device, address). */
static uint64_t live_key(int device, uint64_t addr) { return addr ^ ((uint64_t)device << 56); }

static int push_op(trace_ops_t *o, size_t *cap, trace_op_t op) {
  if (o->count == *cap) {
    size_t n = *cap ? *cap * 2 : 1024;
    trace_op_t *ops = realloc(o->ops, n * sizeof *ops);
    if (!ops) return gca__set_error(GCA_ERR_NOMEM, "out of host memory converting a trace");
    o->ops = ops;
    *cap = n;
  }
  o->ops[o->count++] = op;
  return GCA_OK;
}

int trace_to_ops(const trace_t *t, trace_ops_t *out) {
  memset(out, 0, sizeof *out);
  addr_map_t m; /* key -> slot + 1; 0 once freed (the key stays) */
  if (!gca__addr_map_init(&m)) return gca__set_error(GCA_ERR_NOMEM, "out of host memory converting a trace");
  size_t cap = 0;
  int rc = GCA_OK;
  for (size_t i = 0; i < t->count && rc == GCA_OK; i++) {
    const trace_event_t *e = &t->events[i];
    uint64_t key = live_key(e->device, e->addr);
    if (e->action == TA_ALLOC) {
      if (!gca__addr_map_put(&m, key, out->slot_count + 1)) {
        rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory converting a trace");
        break;
      }
      trace_op_t op = {.slot = (uint32_t)out->slot_count++, .device = e->device, .size = e->size,
                       .stream = trace_event_stream(t, e)};
      out->allocs++;
      rc = push_op(out, &cap, op);
    } else if (e->action == TA_FREE_REQUESTED || e->action == TA_FREE_COMPLETED) {
      uint64_t *slot = gca__addr_map_get(&m, key);
      if (!slot || !*slot) {
        /* Allocated before recording began, or its free was already taken
         * from the free_requested entry. */
        if (e->action == TA_FREE_REQUESTED || !slot) out->skipped_frees++;
        continue;
      }
      trace_op_t op = {.slot = (uint32_t)(*slot - 1), .is_free = 1, .device = e->device,
                       .stream = trace_event_stream(t, e)};
      *slot = 0;
      rc = push_op(out, &cap, op);
    }
  }
  gca__addr_map_free(&m);
  if (rc != GCA_OK) trace_ops_free(out);
  return rc;
}

void trace_ops_free(trace_ops_t *o) {
  free(o->ops);
  memset(o, 0, sizeof *o);
}
