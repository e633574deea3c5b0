/* Writing a snapshot: one walk over it, through an emitter with two
 * backends, so the JSON and the pickle cannot disagree on the layout.
 *
 * The layout is torch.cuda.memory._snapshot()'s (what _dump_snapshot
 * pickles and memory_viz reads): {"segments": [...], "device_traces":
 * [[...] per device], "allocator_settings": {...}}, keys and value types as
 * PyTorch writes them, except that segment_pool_id is a list [id, 0] where
 * PyTorch has a tuple, so the file holds only dicts, lists, strings, ints,
 * floats, bools and None (memory_viz reads both alike).
 *
 * Pickle: protocol 2, with only the opcodes the standard library's
 * unpickler and memory_viz's JavaScript unpickler both read (PROTO,
 * EMPTY_DICT, EMPTY_LIST, MARK, SETITEMS, APPENDS, BININT1/BININT2/BININT,
 * LONG1, BINUNICODE, BINFLOAT, NEWTRUE, NEWFALSE, NONE, BINPUT/LONG_BINPUT,
 * BINGET/LONG_BINGET, STOP); no globals. Every distinct string and every
 * distinct stack frame is written once and referred to through the memo
 * after, as Python's pickler does with the objects PyTorch's snapshot
 * shares: without it a history's frames repeat their file names thousands
 * of times (a PyTorch training run's snapshot was 84 MB, PyTorch's own 12).
 * JSON: json-c serializes every string and number; the containers are
 * streamed, so a history of millions of entries never sits in memory twice.
 */
#include <errno.h>
#include <json-c/json.h>
#include <stdio.h>
#include <string.h>

#include "observe/observe.h"

/* The pickle's memo: strings and frames already written, by content. The
 * texts are the snapshot's own, alive for the whole write. */
typedef struct memo_slot {
  uint64_t hash; /* 0: empty */
  const char *text; /* the string, or the frame's file name */
  const char *name; /* the frame's function */
  int line;
  bool is_frame;
  uint32_t id;
} memo_slot_t;

typedef struct memo {
  memo_slot_t *slots;
  size_t cap, count; /* cap: a power of two, or 0 */
  uint32_t next_id;
  bool off; /* host memory ran out: everything after is written in full */
} memo_t;

typedef struct emitter emitter_t;
struct emitter {
  FILE *f;
  void (*begin_dict)(emitter_t *);
  void (*end_dict)(emitter_t *);
  void (*begin_list)(emitter_t *);
  void (*end_list)(emitter_t *);
  void (*key)(emitter_t *, const char *);
  void (*str)(emitter_t *, const char *);
  void (*integer)(emitter_t *, int64_t);
  void (*real)(emitter_t *, double);
  void (*boolean)(emitter_t *, bool);
  void (*none)(emitter_t *);
  void (*frame)(emitter_t *, const gca_frame_t *);
  memo_t memo; /* pickle only */
  /* JSON: whether a ',' is due before the next item, per nesting level. */
  bool comma[16];
  int depth;
};

/* ---- pickle ------------------------------------------------------------- */

enum {
  P_PROTO = 0x80, P_STOP = '.', P_MARK = '(', P_EMPTY_DICT = '}', P_EMPTY_LIST = ']', P_SETITEMS = 'u',
  P_APPENDS = 'e', P_BININT1 = 'K', P_BININT2 = 'M', P_BININT = 'J', P_LONG1 = 0x8a, P_BINUNICODE = 'X',
  P_BINFLOAT = 'G', P_NEWTRUE = 0x88, P_NEWFALSE = 0x89, P_NONE = 'N', P_BINPUT = 'q', P_LONG_BINPUT = 'r',
  P_BINGET = 'h', P_LONG_BINGET = 'j'
};

static void p_byte(emitter_t *e, int b) { fputc(b, e->f); }

static void p_le(emitter_t *e, uint64_t v, int n) {
  for (int i = 0; i < n; i++) p_byte(e, (int)((v >> (8 * i)) & 0xff));
}

/* A container: created empty, then filled by one MARK ... SETITEMS/APPENDS. */
static void p_begin_dict(emitter_t *e) {
  p_byte(e, P_EMPTY_DICT);
  p_byte(e, P_MARK);
}
static void p_end_dict(emitter_t *e) { p_byte(e, P_SETITEMS); }
static void p_begin_list(emitter_t *e) {
  p_byte(e, P_EMPTY_LIST);
  p_byte(e, P_MARK);
}
static void p_end_list(emitter_t *e) { p_byte(e, P_APPENDS); }

static bool memo_same(const memo_slot_t *m, uint64_t hash, const char *text, const char *name, int line,
                      bool is_frame) {
  return m->hash == hash && m->is_frame == is_frame && !strcmp(m->text, text) &&
         (!is_frame || (m->line == line && !strcmp(m->name, name)));
}

/* Whether this string or frame was written before (*id: its memo index).
 * If not, it is entered under a new index (*id), which the caller stores
 * with p_put right after writing it; *id is UINT32_MAX when the memo is off
 * (nothing to store). */
static bool memo_seen(memo_t *m, const char *text, const char *name, int line, bool is_frame, uint32_t *id) {
  *id = UINT32_MAX;
  if (m->off) return false;
  if ((m->count + 1) * 2 > m->cap) {
    size_t cap = m->cap ? 2 * m->cap : 1024;
    memo_slot_t *slots = calloc(cap, sizeof *slots);
    if (!slots) {
      m->off = true;
      return false;
    }
    for (size_t i = 0; i < m->cap; i++) {
      if (!m->slots[i].hash) continue;
      size_t j = (size_t)m->slots[i].hash & (cap - 1);
      while (slots[j].hash) j = (j + 1) & (cap - 1);
      slots[j] = m->slots[i];
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
  }
  uint64_t hash = gca__text_hash(text);
  if (is_frame) hash = (hash ^ (gca__text_hash(name) * 31) ^ (uint64_t)(unsigned)line) | 1;
  size_t i = (size_t)hash & (m->cap - 1);
  for (; m->slots[i].hash; i = (i + 1) & (m->cap - 1))
    if (memo_same(&m->slots[i], hash, text, name, line, is_frame)) {
      *id = m->slots[i].id;
      return true;
    }
  m->slots[i] = (memo_slot_t){hash, text, name, line, is_frame, m->next_id};
  *id = m->next_id++;
  m->count++;
  return false;
}

static void p_memo_op(emitter_t *e, int short_op, int long_op, uint32_t id) {
  if (id < 256) {
    p_byte(e, short_op);
    p_byte(e, (int)id);
  } else {
    p_byte(e, long_op);
    p_le(e, id, 4);
  }
}
static void p_put(emitter_t *e, uint32_t id) {
  if (id != UINT32_MAX) p_memo_op(e, P_BINPUT, P_LONG_BINPUT, id);
}
static void p_get(emitter_t *e, uint32_t id) { p_memo_op(e, P_BINGET, P_LONG_BINGET, id); }

static void p_str(emitter_t *e, const char *s) {
  uint32_t id;
  if (memo_seen(&e->memo, s, NULL, 0, false, &id)) {
    p_get(e, id);
    return;
  }
  size_t n = strlen(s);
  p_byte(e, P_BINUNICODE);
  p_le(e, n, 4);
  fwrite(s, 1, n, e->f);
  p_put(e, id);
}

static void p_integer(emitter_t *e, int64_t v) {
  if (v >= 0 && v < 256) {
    p_byte(e, P_BININT1);
    p_byte(e, (int)v);
  } else if (v >= 0 && v < 65536) {
    p_byte(e, P_BININT2);
    p_le(e, (uint64_t)v, 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    p_byte(e, P_BININT);
    p_le(e, (uint64_t)(uint32_t)(int32_t)v, 4);
  } else {
    /* LONG1: the fewest little-endian two's-complement bytes that hold v. */
    int n = 8;
    while (n > 1) {
      int64_t top = v >> (8 * (n - 1) - 1); /* the bits a shorter form would drop, and its sign bit */
      if (top != 0 && top != -1) break;
      n--;
    }
    p_byte(e, P_LONG1);
    p_byte(e, n);
    p_le(e, (uint64_t)v, n);
  }
}

static void p_real(emitter_t *e, double v) {
  uint64_t bits;
  memcpy(&bits, &v, sizeof bits);
  p_byte(e, P_BINFLOAT);
  for (int i = 7; i >= 0; i--) p_byte(e, (int)((bits >> (8 * i)) & 0xff)); /* big-endian */
}

static void p_boolean(emitter_t *e, bool v) { p_byte(e, v ? P_NEWTRUE : P_NEWFALSE); }
static void p_none(emitter_t *e) { p_byte(e, P_NONE); }

/* ---- JSON --------------------------------------------------------------- */

static void j_item(emitter_t *e) {
  if (e->comma[e->depth]) fputc(',', e->f);
  e->comma[e->depth] = true;
}

static void j_open(emitter_t *e, char c) {
  fputc(c, e->f);
  if (e->depth < 15) e->depth++;
  e->comma[e->depth] = false;
}

static void j_close(emitter_t *e, char c) {
  fputc(c, e->f);
  if (e->depth > 0) e->depth--;
}

static void j_begin_dict(emitter_t *e) {
  j_item(e);
  j_open(e, '{');
}
static void j_end_dict(emitter_t *e) { j_close(e, '}'); }
static void j_begin_list(emitter_t *e) {
  j_item(e);
  j_open(e, '[');
}
static void j_end_list(emitter_t *e) { j_close(e, ']'); }

static void j_value(emitter_t *e, json_object *o) {
  j_item(e);
  fputs(json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE), e->f);
  json_object_put(o);
}

/* Strings are written by gca__json_string, not json-c, which passes bytes
 * that are not UTF-8 through as they are: a frame's file or function name
 * may hold any. */
static void j_text(emitter_t *e, const char *s) {
  j_item(e);
  gca__json_string(e->f, s);
}

static void j_key(emitter_t *e, const char *k) {
  j_text(e, k);
  fputc(':', e->f);
  e->comma[e->depth] = false; /* the value follows without a comma */
}

static void j_str(emitter_t *e, const char *s) { j_text(e, s); }
static void j_integer(emitter_t *e, int64_t v) { j_value(e, json_object_new_int64(v)); }
static void j_real(emitter_t *e, double v) { j_value(e, json_object_new_double(v)); }
static void j_boolean(emitter_t *e, bool v) { j_value(e, json_object_new_boolean(v)); }
static void j_none(emitter_t *e) {
  j_item(e);
  fputs("null", e->f);
}

/* ---- the layout --------------------------------------------------------- */

static void kv_int(emitter_t *e, const char *k, int64_t v) {
  e->key(e, k);
  e->integer(e, v);
}
static void kv_str(emitter_t *e, const char *k, const char *v) {
  e->key(e, k);
  e->str(e, v);
}
static void kv_bool(emitter_t *e, const char *k, bool v) {
  e->key(e, k);
  e->boolean(e, v);
}

/* A frame's dict; in a pickle, written once and referred to after. */
static void frame_fields(emitter_t *e, const gca_frame_t *f) {
  kv_str(e, "filename", f->filename);
  kv_int(e, "line", f->line);
  kv_str(e, "name", f->name);
}

static void p_frame(emitter_t *e, const gca_frame_t *f) {
  uint32_t id;
  if (memo_seen(&e->memo, f->filename, f->name, f->line, true, &id)) {
    p_get(e, id);
    return;
  }
  p_byte(e, P_EMPTY_DICT);
  p_put(e, id);
  p_byte(e, P_MARK);
  frame_fields(e, f);
  p_byte(e, P_SETITEMS);
}

static void j_frame(emitter_t *e, const gca_frame_t *f) {
  e->begin_dict(e);
  frame_fields(e, f);
  e->end_dict(e);
}

static void emit_frames(emitter_t *e, const gca_frame_t *frames, size_t n) {
  e->begin_list(e);
  for (size_t i = 0; i < n; i++) e->frame(e, &frames[i]);
  e->end_list(e);
}

static const char *const block_states[] = {"active_allocated", "active_pending_free", "inactive"};
static const char *const actions[] = {"alloc",         "free_requested", "free_completed", "segment_alloc",
                                      "segment_free",  "segment_map",    "segment_unmap",  "snapshot",
                                      "oom",           "ipc_request",    "ipc_release"};
_Static_assert(sizeof actions / sizeof actions[0] == GCA_TRACE_IPC_RELEASE + 1, "a name for every action");

static void emit_segment(emitter_t *e, const gca_snapshot_segment_t *s) {
  e->begin_dict(e);
  kv_int(e, "device", s->device);
  kv_int(e, "address", (int64_t)s->address);
  kv_int(e, "total_size", (int64_t)s->total_size);
  kv_int(e, "allocated_size", (int64_t)s->allocated_size);
  kv_int(e, "active_size", (int64_t)s->active_size);
  kv_int(e, "requested_size", (int64_t)s->requested_size);
  kv_int(e, "stream", (int64_t)s->stream);
  kv_str(e, "segment_type", s->pool == GCA_POOL_SMALL ? "small" : "large");
  e->key(e, "segment_pool_id"); /* (PyTorch's (id, 0) of a torch.cuda.MemPool) */
  e->begin_list(e);
  e->integer(e, (int64_t)s->pool_id);
  e->integer(e, 0);
  e->end_list(e);
  kv_bool(e, "is_expandable", s->is_expandable != 0);
  e->key(e, "frames");
  emit_frames(e, NULL, 0);
  e->key(e, "blocks");
  e->begin_list(e);
  for (size_t i = 0; i < s->block_count; i++) {
    const gca_snapshot_block_t *b = &s->blocks[i];
    e->begin_dict(e);
    kv_int(e, "address", (int64_t)b->address);
    kv_int(e, "size", (int64_t)b->size);
    kv_int(e, "requested_size", (int64_t)b->requested_size);
    kv_str(e, "state", block_states[b->state]);
    e->key(e, "frames");
    emit_frames(e, b->frames, b->frame_count);
    e->end_dict(e);
  }
  e->end_list(e);
  e->end_dict(e);
}

static void emit_entry(emitter_t *e, const gca_trace_entry_t *t) {
  e->begin_dict(e);
  kv_str(e, "action", actions[t->action]);
  if (t->action == GCA_TRACE_OOM) kv_int(e, "device_free", (int64_t)t->device_free);
  else kv_int(e, "addr", (int64_t)t->addr);
  kv_int(e, "size", (int64_t)t->size);
  kv_int(e, "stream", (int64_t)t->stream);
  kv_int(e, "time_us", t->time_us);
  if (t->action == GCA_TRACE_IPC_REQUEST) {
    kv_int(e, "peers_asked", t->ipc_peers_asked);
    kv_int(e, "peers_silent", t->ipc_peers_silent);
    kv_int(e, "bytes_received", (int64_t)t->ipc_bytes_received);
  } else if (t->action == GCA_TRACE_IPC_RELEASE) {
    kv_int(e, "requester_pid", t->ipc_requester);
  }
  e->key(e, "frames");
  emit_frames(e, t->frames, t->frame_count);
  e->end_dict(e);
}

/* PyTorch's allocator_settings, from the configuration in force. */
static void emit_settings(emitter_t *e, const gca_snapshot_t *s) {
  const config_t *c = gca__snapshot_config(s);
  e->begin_dict(e);
  kv_str(e, "PYTORCH_CUDA_ALLOC_CONF", s->settings);
  kv_int(e, "max_split_size", c->max_split_size == SIZE_MAX ? -1 : (int64_t)c->max_split_size);
  e->key(e, "garbage_collection_threshold");
  e->real(e, c->gc_threshold);
  kv_bool(e, "expandable_segments", c->expandable_segments);
  kv_int(e, "pinned_num_register_threads", (int64_t)c->pinned_num_register_threads);
  kv_bool(e, "release_lock_on_cudamalloc", c->release_lock_on_malloc);
  kv_bool(e, "pinned_use_cuda_host_register", c->pinned_use_host_register);
  e->key(e, "roundup_power2_divisions");
  e->begin_dict(e);
  for (int i = 0; i < ROUNDUP_INTERVALS; i++) {
    char k[16];
    snprintf(k, sizeof k, "%d", 1 << i);
    kv_int(e, k, (int64_t)c->roundup_divisions[i]);
  }
  e->end_dict(e);
  e->key(e, "backend");
  e->str(e, s->backend);
  e->end_dict(e);
}

static void emit_snapshot(emitter_t *e, const gca_snapshot_t *s) {
  e->begin_dict(e);
  e->key(e, "segments");
  e->begin_list(e);
  for (size_t i = 0; i < s->segment_count; i++) emit_segment(e, &s->segments[i]);
  e->end_list(e);
  e->key(e, "device_traces");
  e->begin_list(e);
  for (int d = 0; d < s->device_count; d++) {
    e->begin_list(e);
    for (size_t i = 0; i < s->trace_counts[d]; i++) emit_entry(e, &s->device_traces[d][i]);
    e->end_list(e);
  }
  e->end_list(e);
  e->key(e, "allocator_settings");
  emit_settings(e, s);
  e->end_dict(e);
}

int gca_snapshot_write(const gca_snapshot_t *s, const char *path, gca_snapshot_format format) {
  if (!s || !path) return gca__set_error(GCA_ERR_INVALID, "gca_snapshot_write: %s is NULL", s ? "path" : "snapshot");
  if (format != GCA_SNAPSHOT_PICKLE && format != GCA_SNAPSHOT_JSON)
    return gca__set_error(GCA_ERR_INVALID, "gca_snapshot_write: unknown format %d", (int)format);
  FILE *f = fopen(path, "wb");
  if (!f) return gca__set_error(GCA_ERR_IO, "cannot write the snapshot to %s: %s", path, strerror(errno));
  emitter_t e;
  memset(&e, 0, sizeof e);
  e.f = f;
  if (format == GCA_SNAPSHOT_PICKLE) {
    e = (emitter_t){f, p_begin_dict, p_end_dict, p_begin_list, p_end_list, p_str, p_str, p_integer, p_real,
                    p_boolean, p_none, p_frame, {0}, {0}, 0};
    p_byte(&e, P_PROTO);
    p_byte(&e, 2);
  } else {
    e = (emitter_t){f, j_begin_dict, j_end_dict, j_begin_list, j_end_list, j_key, j_str, j_integer, j_real,
                    j_boolean, j_none, j_frame, {0}, {0}, 0};
  }
  emit_snapshot(&e, s);
  if (format == GCA_SNAPSHOT_PICKLE) p_byte(&e, P_STOP);
  else fputc('\n', f);
  free(e.memo.slots);
  bool failed = ferror(f) != 0;
  if (fclose(f) != 0) failed = true;
  if (failed) return gca__set_error(GCA_ERR_IO, "cannot write the snapshot to %s: %s", path, strerror(errno));
  return GCA_OK;
}
