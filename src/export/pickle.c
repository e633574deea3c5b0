/* The plain-data pickle reader (see pickle.h). One loop over the opcodes,
 * every read bounds-checked, values kept by value on the stack, in the memo
 * and in containers. Containers and their item arrays come from an arena
 * owned by the document: the memo may share a container between many
 * parents, and freeing is a walk over a few chunks, not over the tree.
 *
 * Why it is shaped like this: a PyTorch snapshot is mostly memo references
 * (BINGET) to frames and strings, hundreds of thousands of them, and the
 * replay's speed target makes the reader's cost per opcode count.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../internal.h"
#include "pickle.h"

#define ARENA_CHUNK ((size_t)4 << 20)

struct pickle_doc {
  unsigned char *buf;
  size_t len;
  bool mapped;   /* buf is the file, mapped; else malloc'd */
  pickle_options_t options;
  size_t pruned_len, records_len; /* of the two keys; 0 without them */
  arena_t arena; /* containers and their item arrays */
  pv_t root;
  pv_seq_t pruned_seq; /* the contents of every container the flat reader prunes: none */
};

void pickle_free(pickle_doc_t *doc) {
  if (!doc) return;
  arena_free(&doc->arena);
  if (doc->mapped) munmap(doc->buf, doc->len);
  else free(doc->buf);
  free(doc);
}

const pv_t *pickle_root(const pickle_doc_t *doc) { return doc ? &doc->root : NULL; }

/* ---- the machine -------------------------------------------------------- */

static int fail_memory(const pickle_doc_t *doc, size_t at) {
  if (doc->arena.over_limit)
    return set_error(GCA_ERR_INVALID,
                     "pickle: at offset %zu the file needs more than %d bytes of host memory per byte of input; "
                     "refused as malformed", at, GCA_PICKLE_BYTES_PER_INPUT_BYTE);
  return set_error(GCA_ERR_NOMEM, "pickle: out of host memory at offset %zu", at);
}

static pv_seq_t *seq_new(pickle_doc_t *doc, bool pruned) {
  pv_seq_t *s = arena_alloc(&doc->arena, sizeof *s);
  if (s) *s = (pv_seq_t){NULL, 0, 0, pruned, 0};
  return s;
}

static inline bool str_is(const pv_t *v, const char *s, size_t n) {
  return n && v->kind == PV_STR && v->len == n && !memcmp(v->u.data, s, n);
}

/* Is the container being filled (the one under the MARK at `base`) pruned? */
static inline bool filling_pruned(const pv_t *stack, size_t depth, size_t base) {
  return base && base <= depth && stack[base - 1].kind == PV_LIST && stack[base - 1].u.seq->pruned;
}

/* Is a container pushed now pruned? Yes when it is the value of the pruned
 * key (the key is right below it), or when the container being filled (the
 * one under the latest MARK) is pruned: everything built inside a pruned
 * container is. */
static bool prune_new(const pickle_doc_t *doc, const pv_t *stack, size_t depth, const size_t *marks,
                      size_t mark_count) {
  if (!doc->pruned_len) return false;
  if (depth && str_is(&stack[depth - 1], doc->options.pruned_key, doc->pruned_len)) return true;
  if (mark_count) {
    size_t base = marks[mark_count - 1];
    if (base && base <= depth) {
      const pv_t *filling = &stack[base - 1];
      return (filling->kind == PV_LIST || filling->kind == PV_DICT) && filling->u.seq->pruned;
    }
  }
  return false;
}

/* Records (pickle_options): the list under the records key has role 1, a
 * list pushed into it role 2, and a dict pushed into one of those is a
 * record. "Into" is: the container being filled (under the latest MARK),
 * or, for a one-item list written with APPEND, the list right below. */
static inline unsigned list_role(const pv_t *v) { return v->kind == PV_LIST ? v->u.seq->role : 0; }

static bool inside_role(const pv_t *stack, size_t depth, const size_t *marks, size_t mark_count, unsigned role) {
  if (depth && list_role(&stack[depth - 1]) == role) return true;
  if (!mark_count) return false;
  size_t base = marks[mark_count - 1];
  return base && base <= depth && list_role(&stack[base - 1]) == role;
}

static uint8_t role_new(const pickle_doc_t *doc, const pv_t *stack, size_t depth, const size_t *marks,
                        size_t mark_count) {
  if (!doc->records_len || !depth) return 0;
  if (str_is(&stack[depth - 1], doc->options.records_key, doc->records_len)) return 1;
  return inside_role(stack, depth, marks, mark_count, 1) ? 2 : 0;
}

static bool holds_record(const pv_t *items, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (items[i].kind == PV_RECORD) return true;
  return false;
}

/* Appends n values. Growth allocates a new array from the arena and leaves
 * the old one there: at most as much again, and no per-container free. */
static bool seq_add(pickle_doc_t *doc, pv_seq_t *s, const pv_t *items, size_t n) {
  if (s->pruned || n == 0) return true;
  if (s->count + n > s->cap) {
    /* Most containers are filled by one batch: size the first exactly. */
    size_t cap = s->cap ? s->cap * 2 : n > 2 ? n : 2;
    while (cap < s->count + n) cap *= 2;
    pv_t *grown = arena_alloc(&doc->arena, cap * sizeof *grown);
    if (!grown) return false;
    if (s->count) memcpy(grown, s->items, s->count * sizeof *grown);
    s->items = grown;
    s->cap = cap;
  }
  memcpy(s->items + s->count, items, n * sizeof *items);
  s->count += n;
  return true;
}

static uint64_t read_le(const unsigned char *p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* Fixed widths, which compilers turn into one load. */
static uint32_t read_u32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Grows the memo (*cap entries, unstored ones PV_UNSET) to hold index
 * `need`. It is a big array (util.c): a snapshot's memo is a megabyte. */
static bool memo_grow(pv_t **memo, size_t *cap, size_t need) {
  size_t grown_cap = *cap ? *cap : 64;
  while (grown_cap <= need) grown_cap *= 2;
  pv_t *grown = big_rezalloc(*memo, *cap * sizeof **memo, grown_cap * sizeof **memo);
  if (!grown) return false;
  *memo = grown;
  *cap = grown_cap;
  return true;
}

/* The end of a run of memo references (BINGET, LONG_BINGET) starting at
 * pos whose indices are all below `stored`: where the first other opcode,
 * or the first reference to an index not below it, begins. The indices are
 * checked a run at a time, by their maximum, so that the loop has one
 * branch per reference and it is taken until the run ends. */
static inline size_t skip_refs(const unsigned char *buf, size_t len, size_t pos, size_t stored) {
  for (;;) {
    size_t run_start = pos;
    if (stored > 0xff) {
      while (len - pos >= 2 && buf[pos] == 'h') pos += 2;
    } else {
      while (len - pos >= 2 && buf[pos] == 'h' && buf[pos + 1] < stored) pos += 2;
    }
    size_t long_start = pos;
    uint32_t top = 0;
    while (len - pos >= 5 && buf[pos] == 'j') {
      uint32_t index = read_u32(buf + pos + 1);
      top = index > top ? index : top;
      pos += 5;
    }
    if (top >= stored) { /* one is not stored yet: stop right before it */
      pos = long_start;
      while (len - pos >= 5 && buf[pos] == 'j' && read_u32(buf + pos + 1) < stored) pos += 5;
      return pos;
    }
    if (pos == run_start) return pos;
  }
}

/* ---- flat dicts ----------------------------------------------------------
 * Most of a snapshot is dicts whose values are scalars, memo references
 * and the pruned key's list: each device_traces entry, each block, each
 * frame. The machine reads them an opcode at a time through the stack;
 * this reads such a dict, and the pruned list in it, in loops of their own
 * that put pairs straight into an array: each entry has the same layout, so
 * their branches are predicted. It is only a shortcut. Anything it does not
 * know (a tuple, a nested container off the pruned key, a memo store off
 * the next index, the memo with holes) ends the attempt, the
 * memo stores it made are undone, and the machine reads the dict from its
 * first opcode as if no attempt had been made, with the same result and the
 * same errors. An attempt goes at most three containers deep, so a byte is
 * read by at most three attempts and the machine: a hostile file costs a
 * constant factor more, not a power of its size. */

/* The flat readers' small steps are inlined where they are used: each use
 * then has its own branches, and a key's (nearly always a BINGET) is
 * predicted apart from a value's. */
#if defined(__GNUC__)
#define FLAT_STEP static inline __attribute__((always_inline))
#else
#define FLAT_STEP static inline
#endif

typedef struct flat {
  const unsigned char *buf;
  size_t len;
  pv_t *memo;         /* the machine's memo, dense below memo_len */
  size_t memo_len, memo_cap;
  pickle_doc_t *doc;
  pv_t *pairs;        /* keys and values of the dict being read, before they go to the arena */
  size_t pairs_cap;
} flat_t;

/* The memo store that may follow a value at pos: the position after it, pos
 * when there is none, 0 when it is one that only the machine handles. */
FLAT_STEP size_t flat_memo(flat_t *f, size_t pos, pv_t v) {
  if (pos >= f->len) return pos;
  unsigned op = f->buf[pos];
  size_t index, width;
  if (op == 0x94) {
    index = f->memo_len;
    width = 1;
  } else if (op == 'q' && f->len - pos >= 2) {
    index = f->buf[pos + 1];
    width = 2;
  } else if (op == 'r' && f->len - pos >= 5) {
    index = read_u32(f->buf + pos + 1);
    width = 5;
  } else {
    return op == 'q' || op == 'r' ? 0 : pos;
  }
  if (index != f->memo_len) return 0;
  if (index >= f->memo_cap && !memo_grow(&f->memo, &f->memo_cap, index)) return 0;
  f->memo[f->memo_len++] = v;
  return pos + width;
}

/* A scalar or a memo reference at *at, and its memo store: *at moves past
 * them. PV_UNSET when it is not one (or, with *at 0, a memo store only the
 * machine makes). The value is returned, not stored through a pointer: the
 * caller's 16-byte load of two 8-byte stores would wait for them to reach
 * the cache, many cycles per value. */
FLAT_STEP pv_t flat_scalar(flat_t *f, size_t *at) {
  const unsigned char *buf = f->buf;
  size_t len = f->len, index, n, pos = *at;
  pv_t v = {0};
  if (pos >= len) return v;
  unsigned op = buf[pos++];
  switch (op) {
    case 'h':
      if (pos >= len) return (pv_t){0};
      index = buf[pos++];
      goto reference;
    case 'j':
      if (len - pos < 4) return (pv_t){0};
      index = read_u32(buf + pos);
      pos += 4;
    reference:
      if (index >= f->memo_len) return (pv_t){0};
      v = f->memo[index];
      if (v.kind == PV_RECORD) return (pv_t){0}; /* the machine's: see records_escaped */
      break;
    case 'K':
      if (pos >= len) return (pv_t){0};
      v.kind = PV_INT;
      v.u.i = buf[pos++];
      break;
    case 'M':
      if (len - pos < 2) return (pv_t){0};
      v.kind = PV_INT;
      v.u.i = buf[pos] | buf[pos + 1] << 8;
      pos += 2;
      break;
    case 'J':
      if (len - pos < 4) return (pv_t){0};
      v.kind = PV_INT;
      v.u.i = (int32_t)read_u32(buf + pos);
      pos += 4;
      break;
    case 0x8a: { /* LONG1 */
      if (pos >= len || buf[pos] > 8 || len - pos - 1 < buf[pos]) return (pv_t){0};
      n = buf[pos++];
      uint64_t raw = read_le(buf + pos, n);
      pos += n;
      if (n && n < 8 && (raw >> (8 * n - 1)) & 1) raw |= ~(uint64_t)0 << (8 * n);
      v.kind = PV_INT;
      v.u.i = (int64_t)raw;
      break;
    }
    case 0x8c: /* SHORT_BINUNICODE */
    case 'X':  /* BINUNICODE */
      n = op == 0x8c ? 1 : 4;
      if (len - pos < n) return (pv_t){0};
      index = op == 0x8c ? buf[pos] : read_u32(buf + pos); /* the length */
      pos += n;
      if (index > len - pos) return (pv_t){0};
      v.kind = PV_STR;
      v.len = (uint32_t)index;
      v.u.data = (const char *)buf + pos;
      pos += index;
      break;
    case 'N':
      v.kind = PV_NONE;
      break;
    case 0x88:
    case 0x89:
      v.kind = PV_BOOL;
      v.u.i = op == 0x88;
      break;
    default:
      return (pv_t){0};
  }
  *at = flat_memo(f, pos, v);
  return v;
}

/* Past the FRAME opcodes at pos, if any. A pickler of protocol 4 ends a
 * frame (64 KiB) between two objects, so one can stand before any key,
 * value, item or closer: a snapshot has one every few hundred entries. A
 * truncated one is left for the machine to name. */
FLAT_STEP size_t flat_frames(const flat_t *f, size_t pos) {
  while (pos < f->len && f->buf[pos] == 0x95 && f->len - pos >= 9) pos += 9;
  return pos;
}

/* What flat_dict does with the pairs it reads. */
typedef enum flat_mode { FLAT_KEEP, FLAT_PRUNED, FLAT_RECORD } flat_mode;

static size_t flat_dict(flat_t *f, size_t pos, flat_mode mode, int depth, pv_t *out);

/* Would the machine prune a container pushed on this key? */
static inline bool is_pruned_key(const pickle_doc_t *doc, const pv_t *key) {
  return str_is(key, doc->options.pruned_key, doc->pruned_len);
}

/* Undoes the memo stores made since the memo held `memo_len` entries. */
static void flat_unstore(flat_t *f, size_t memo_len) {
  for (size_t i = memo_len; i < f->memo_len; i++) f->memo[i].kind = PV_UNSET;
  f->memo_len = memo_len;
}

static size_t flat_item(flat_t *f, size_t pos, int depth);

/* A list at pos (its ']') that the machine would prune: its items are
 * checked and dropped. Written in one of three forms: MARK items APPENDS;
 * one item and APPEND; or nothing, when what follows is the dict's next
 * key or its end. */
static size_t flat_pruned_list(flat_t *f, size_t pos, int depth) {
  const unsigned char *buf = f->buf;
  size_t len = f->len;
  pv_t list = {.kind = PV_LIST, .u.seq = &f->doc->pruned_seq};
  if (!(pos = flat_memo(f, pos + 1, list)) || (pos = flat_frames(f, pos)) >= len) return 0;
  if (buf[pos] != '(') {
    /* One item then APPEND, or else the list was empty and what was read
     * is the dict's: undone, and read again as that. */
    size_t memo_len = f->memo_len, end = flat_item(f, pos, depth);
    if (end && (end = flat_frames(f, end)) < len && buf[end] == 'a') return end + 1;
    flat_unstore(f, memo_len);
    return pos;
  }
  pos++;
  for (;;) {
    pos = flat_frames(f, pos);
    if (pos >= len) return 0;
    unsigned op = buf[pos];
    if (op == 'e') return pos + 1;
    if (op == 'h' || op == 'j') {
      size_t end = skip_refs(buf, len, pos, f->memo_len);
      /* (A reference stored again in the memo is the machine's.) */
      if (end < len && (buf[end] == 0x94 || buf[end] == 'q' || buf[end] == 'r')) return 0;
      if (end != pos) {
        pos = end;
        continue;
      }
    }
    if (!(pos = flat_item(f, pos, depth))) return 0;
  }
}

/* One item of a pruned list at pos, checked and dropped: a dict, a scalar
 * or a memo reference. */
static size_t flat_item(flat_t *f, size_t pos, int depth) {
  if (f->buf[pos] == '}') return flat_dict(f, pos, FLAT_PRUNED, depth + 1, NULL);
  return flat_scalar(f, &pos).kind == PV_UNSET ? 0 : pos;
}

/* A dict at pos (its '}'), read in the batched form (MARK ... SETITEMS):
 * its pairs go to a new dict, nowhere (pruned), or to the record reader.
 * A kept dict or a record is made once it is read, so that an attempt
 * given up allocates nothing; its memo slot is held empty (PV_UNSET) till
 * then, and a reference to it from inside itself ends the attempt. */
static size_t flat_dict(flat_t *f, size_t pos, flat_mode mode, int depth, pv_t *out) {
  const unsigned char *buf = f->buf;
  size_t len = f->len, count = 0;
  pv_t dict = {.kind = mode == FLAT_RECORD ? PV_RECORD : PV_DICT, .u.seq = &f->doc->pruned_seq};
  if (depth > 2) return 0; /* an entry, its frames, a frame: deeper is the machine's */
  size_t memo_at = f->memo_len;
  if (!(pos = flat_memo(f, pos + 1, mode == FLAT_PRUNED ? dict : (pv_t){0})) || pos >= len || buf[pos] != '(')
    return 0;
  bool stored = f->memo_len > memo_at; /* (its pairs may store more) */
  pos++;
  for (;;) {
    pos = flat_frames(f, pos);
    if (pos >= len) return 0;
    if (buf[pos] == 'u') break;
    pv_t key = flat_scalar(f, &pos), value;
    if (key.kind == PV_UNSET || !pos || (pos = flat_frames(f, pos)) >= len) return 0;
    unsigned op = buf[pos];
    if (op == ']' || op == '}') {
      /* A container: only where the machine would drop its contents. */
      if (mode != FLAT_PRUNED && !is_pruned_key(f->doc, &key)) return 0;
      /* (Built here, not returned through memory: see flat_scalar.) */
      value = (pv_t){.kind = op == ']' ? PV_LIST : PV_DICT, .u.seq = &f->doc->pruned_seq};
      pos = op == ']' ? flat_pruned_list(f, pos, depth + 1) : flat_dict(f, pos, FLAT_PRUNED, depth + 1, NULL);
    } else if ((value = flat_scalar(f, &pos)).kind == PV_UNSET) {
      return 0;
    }
    if (!pos) return 0;
    if (mode == FLAT_PRUNED) continue;
    if (count + 2 > f->pairs_cap) {
      size_t cap = f->pairs_cap ? f->pairs_cap * 2 : 32;
      pv_t *grown = realloc(f->pairs, cap * sizeof *grown);
      if (!grown) return 0;
      f->pairs = grown;
      f->pairs_cap = cap;
    }
    f->pairs[count++] = key;
    f->pairs[count++] = value;
  }
  if (mode == FLAT_RECORD) {
    /* Last, so that a record taken is never undone. */
    const pickle_options_t *o = &f->doc->options;
    int64_t id; /* (not &dict.u.i: dict stays in registers) */
    if (!o->record(o->record_ctx, f->pairs, count, &id)) return 0;
    dict.u.i = id;
  } else if (mode == FLAT_KEEP) {
    if (!(dict.u.seq = seq_new(f->doc, false)) || !seq_add(f->doc, dict.u.seq, f->pairs, count)) return 0;
  }
  if (mode != FLAT_PRUNED && stored) f->memo[memo_at] = dict;
  if (out) *out = dict;
  return pos + 1;
}

/* Reads the dict at pos as flat_dict does, or leaves the memo as it was
 * and returns 0. */
static size_t flat_try(flat_t *f, size_t pos, flat_mode mode, pv_t *out) {
  size_t memo_len = f->memo_len;
  size_t end = flat_dict(f, pos, mode, 0, out);
  if (!end) flat_unstore(f, memo_len);
  return end;
}

#define FAIL(...) do { set_error(GCA_ERR_INVALID, __VA_ARGS__); goto failed; } while (0)
#define NEED(n, what)                                                                             \
  do {                                                                                            \
    if (len - pos < (size_t)(n)) FAIL("pickle: truncated at offset %zu while reading %s", pos, what); \
  } while (0)
/* Grows array (cap entries) to hold `need`; written out here, not behind a
 * pointer to the locals, so that they can stay in registers. */
#define GROW(array, cap, need)                                      \
  do {                                                              \
    size_t grown_cap = (cap) ? (cap) : 64;                          \
    while (grown_cap < (need)) grown_cap *= 2;                      \
    void *grown = realloc((array), grown_cap * sizeof *(array));    \
    if (!grown) {                                                   \
      fail_memory(doc, at);                                         \
      goto failed;                                                  \
    }                                                               \
    (array) = grown;                                                \
    (cap) = grown_cap;                                              \
  } while (0)
#define PUSH(value)                                      \
  do {                                                   \
    if (unlikely(depth == stack_cap)) GROW(stack, stack_cap, depth + 1); \
    stack[depth++] = (value);                            \
  } while (0)

/* Parses the document's buffer. */
static pickle_doc_t *parse(pickle_doc_t *doc) {
  const unsigned char *buf = doc->buf;
  size_t len = doc->len;
  /* Chunks in proportion to the input: a small pickle should not cost a
   * 4 MiB chunk (the fuzzer parses thousands a second); a big one gets huge
   * pages. */
  size_t chunk = len * 4 < ((size_t)64 << 10) ? (size_t)64 << 10 : len * 4 > ARENA_CHUNK ? ARENA_CHUNK : len * 4;
  doc->arena = (arena_t){.chunk = chunk, .huge = chunk >= ((size_t)2 << 20),
                         .limit = len * GCA_PICKLE_BYTES_PER_INPUT_BYTE + 2 * ARENA_CHUNK};
  /* The machine's state, in locals so that it stays in registers. */
  pv_t *stack = NULL;
  size_t depth = 0, stack_cap = 0, memo_len = 0;
  /* A snapshot stores about one memo entry per 30 bytes: sized for that
   * at once, the memo is not copied as it grows. */
  size_t memo_cap = len / 32 > 64 ? len / 32 : 64;
  pv_t *memo = big_zalloc(memo_cap * sizeof *memo);
  if (!memo) {
    set_error(GCA_ERR_NOMEM, "pickle: out of host memory");
    pickle_free(doc);
    return NULL;
  }
  bool memo_dense = true; /* every index below memo_len is stored */
  size_t *marks = NULL, mark_count = 0, mark_cap = 0;
  size_t pos = 0, at = 0, run_read_to = 0;
  flat_t flat = {.buf = buf, .len = len, .doc = doc};
  for (;;) {
    if (pos >= len) FAIL("pickle: ended at offset %zu without a STOP opcode", pos);
    at = pos;
    unsigned op = buf[pos++];
    size_t n = 0, base;
    pv_t v = {0};
    switch (op) {
      case 0x80: /* PROTO */
        NEED(1, "the protocol");
        if (buf[pos] < 2 || buf[pos] > 5) FAIL("pickle: protocol %d is not supported (2 to 5 are)", buf[pos]);
        pos++;
        continue;
      case 0x95: /* FRAME: framing is only a hint to buffered readers */
        NEED(8, "a frame length");
        pos += 8;
        continue;
      case 'h': /* BINGET: the most common opcode by far */
      case 'j': /* LONG_BINGET */
        /* A snapshot's frames lists are runs of memo references appended
         * to a pruned list at once: a run that ends in APPENDS to a pruned
         * list only needs its indices checked, not its values pushed. */
        if (at >= run_read_to && mark_count && filling_pruned(stack, depth, marks[mark_count - 1])) {
          /* Stored? While the memo has no holes, the index alone tells,
           * without touching the memo (a megabyte, out of cache); with holes
           * nothing is skipped and the plain path below checks each. A run
           * that does not end in APPENDS is pushed one at a time, and not
           * scanned again from each of its references (run_read_to). */
          size_t scan = skip_refs(buf, len, at, memo_dense ? memo_len : 0);
          if (scan < len && buf[scan] == 'e') {
            pos = scan;
            continue;
          }
          run_read_to = scan;
        }
        if (op == 'j') goto long_binget;
        NEED(1, "a memo index");
        base = buf[pos++];
        goto memo_get;
      long_binget:
        NEED(4, "a memo index");
        base = (size_t)read_u32(buf + pos);
        pos += 4;
      memo_get:
        if (base >= memo_cap || memo[base].kind == PV_UNSET)
          FAIL("pickle: memo index %zu used before it was stored (offset %zu)", base, at);
        if (unlikely(memo[base].kind == PV_RECORD)) goto records_escaped;
        PUSH(memo[base]);
        continue;
      case 0x94: /* MEMOIZE */
      case 'q':  /* BINPUT */
      case 'r':  /* LONG_BINPUT */
        if (op == 0x94) {
          base = memo_len;
        } else {
          n = op == 'q' ? 1 : 4;
          NEED(n, "a memo index");
          base = op == 'q' ? buf[pos] : read_u32(buf + pos);
          pos += n;
        }
        if (!depth) FAIL("pickle: memo store with an empty stack at offset %zu", at);
        /* A pickler numbers the memo from 0, one entry per store, so an
         * index past the file's length can only be an attack on memory. */
        if (base > len) FAIL("pickle: memo index %zu at offset %zu is larger than the file", base, at);
        if (base >= memo_cap && !memo_grow(&memo, &memo_cap, base)) {
          fail_memory(doc, at);
          goto failed;
        }
        memo[base] = stack[depth - 1];
        if (base > memo_len) memo_dense = false; /* a hole below it */
        if (base >= memo_len) memo_len = base + 1;
        continue;
      case '(': /* MARK */
        if (mark_count == mark_cap) GROW(marks, mark_cap, mark_count + 1);
        marks[mark_count++] = depth;
        continue;
      case '}': /* EMPTY_DICT */
        if (memo_dense && !doc->options.machine_only) {
          flat_mode mode = prune_new(doc, stack, depth, marks, mark_count) ? FLAT_PRUNED
                           : doc->options.record && inside_role(stack, depth, marks, mark_count, 2) ? FLAT_RECORD
                                                                                                     : FLAT_KEEP;
          flat.memo = memo;
          flat.memo_len = memo_len;
          flat.memo_cap = memo_cap;
          size_t end = flat_try(&flat, at, mode, &v);
          memo = flat.memo; /* perhaps grown */
          memo_cap = flat.memo_cap;
          memo_len = flat.memo_len;
          if (end) {
            pos = end;
            PUSH(v);
            continue;
          }
        }
        /* fall through */
      case ']': /* EMPTY_LIST */
      case ')': /* EMPTY_TUPLE */
        v.kind = op == '}' ? PV_DICT : PV_LIST;
        if (!(v.u.seq = seq_new(doc, prune_new(doc, stack, depth, marks, mark_count)))) {
          fail_memory(doc, at);
          goto failed;
        }
        if (op == ']') v.u.seq->role = role_new(doc, stack, depth, marks, mark_count);
        PUSH(v);
        continue;
      case 'u': /* SETITEMS */
      case 'e': /* APPENDS */
      case 's': /* SETITEM */
      case 'a': /* APPEND */
        if (op == 'u' || op == 'e') {
          if (!mark_count) FAIL("pickle: no MARK before offset %zu", at);
          base = marks[--mark_count];
          if (base > depth) FAIL("pickle: MARK above the stack at offset %zu", at);
        } else {
          n = op == 's' ? 2 : 1;
          if (depth < n + 1) FAIL("pickle: %s with a short stack at offset %zu", op == 's' ? "SETITEM" : "APPEND", at);
          base = depth - n;
        }
        if (base == 0) FAIL("pickle: %s with no container at offset %zu", op == 'u' || op == 's' ? "SETITEMS" : "APPENDS", at);
        {
          const pv_t *container = &stack[base - 1];
          bool dict_op = op == 'u' || op == 's';
          /* A record may only go into the list it was read for. */
          if (unlikely(doc->records_len) && (dict_op || list_role(container) != 2) &&
              (container->kind == PV_RECORD || holds_record(stack + base, depth - base)))
            goto records_escaped;
          if (container->kind != (dict_op ? PV_DICT : PV_LIST))
            FAIL("pickle: %s on a non-%s at offset %zu", dict_op ? "SETITEM" : "APPEND", dict_op ? "dict" : "list", at);
          if (dict_op && (depth - base) % 2) FAIL("pickle: SETITEMS with odd items at offset %zu", at);
          if (!seq_add(doc, container->u.seq, stack + base, depth - base)) {
            fail_memory(doc, at);
            goto failed;
          }
        }
        depth = base;
        continue;
      case 0x8c: /* SHORT_BINUNICODE */
      case 'X':  /* BINUNICODE */
      case 0x8d: /* BINUNICODE8 */
      case 'C':  /* SHORT_BINBYTES */
      case 'B':  /* BINBYTES */
      case 0x8e: /* BINBYTES8 */ {
        n = op == 0x8c || op == 'C' ? 1 : op == 'X' || op == 'B' ? 4 : 8;
        NEED(n, "a length");
        uint64_t size = read_le(buf + pos, n);
        pos += n;
        if (size > len - pos) FAIL("pickle: truncated at offset %zu while reading a string of %llu bytes", pos,
                                   (unsigned long long)size);
        v.kind = op == 0x8c || op == 'X' || op == 0x8d ? PV_STR : PV_BYTES;
        if (size > UINT32_MAX) FAIL("pickle: string of %llu bytes at offset %zu is too long", (unsigned long long)size, at);
        v.len = (uint32_t)size;
        v.u.data = (const char *)buf + pos;
        pos += (size_t)size;
        PUSH(v);
        continue;
      }
      case 'K': /* BININT1 */
        NEED(1, "an integer");
        v.kind = PV_INT;
        v.u.i = buf[pos++];
        PUSH(v);
        continue;
      case 'M': /* BININT2 */
        NEED(2, "an integer");
        v.kind = PV_INT;
        v.u.i = buf[pos] | buf[pos + 1] << 8;
        pos += 2;
        PUSH(v);
        continue;
      case 'J': /* BININT */
        NEED(4, "an integer");
        v.kind = PV_INT;
        v.u.i = (int32_t)read_u32(buf + pos);
        pos += 4;
        PUSH(v);
        continue;
      case 0x8a: /* LONG1 */
      case 0x8b: /* LONG4 */ {
        n = op == 0x8a ? 1 : 4;
        NEED(n, "a length");
        uint64_t bytes = read_le(buf + pos, n);
        pos += n;
        if (bytes > 8)
          FAIL("pickle: integer of %llu bytes at offset %zu does not fit in 64 bits", (unsigned long long)bytes, at);
        NEED(bytes, "an integer");
        uint64_t raw = read_le(buf + pos, (size_t)bytes);
        pos += (size_t)bytes;
        if (bytes && bytes < 8 && (raw >> (8 * bytes - 1)) & 1) raw |= ~(uint64_t)0 << (8 * bytes);
        v.kind = PV_INT;
        v.u.i = (int64_t)raw;
        PUSH(v);
        continue;
      }
      case 'G': { /* BINFLOAT, big-endian */
        NEED(8, "a float");
        uint64_t bits = 0;
        for (int i = 0; i < 8; i++) bits = (bits << 8) | buf[pos + (size_t)i];
        pos += 8;
        v.kind = PV_FLOAT;
        memcpy(&v.u.f, &bits, sizeof bits);
        PUSH(v);
        continue;
      }
      case 'N':
        v.kind = PV_NONE;
        PUSH(v);
        continue;
      case 0x88: /* NEWTRUE */
      case 0x89: /* NEWFALSE */
        v.kind = PV_BOOL;
        v.u.i = op == 0x88;
        PUSH(v);
        continue;
      case 0x85: /* TUPLE1 */
      case 0x86: /* TUPLE2 */
      case 0x87: /* TUPLE3 */
      case 't':  /* TUPLE */
        if (op == 't') {
          if (!mark_count) FAIL("pickle: no MARK before offset %zu", at);
          base = marks[--mark_count];
          if (base > depth) FAIL("pickle: MARK above the stack at offset %zu", at);
          n = depth - base;
        } else {
          n = op - 0x85 + 1;
          if (depth < n) FAIL("pickle: tuple of %zu with %zu on the stack at offset %zu", n, depth, at);
        }
        if (unlikely(doc->records_len) && n && holds_record(stack + depth - n, n)) goto records_escaped;
        v.kind = PV_LIST;
        /* (An empty tuple may come before anything was pushed: no NULL + 0.) */
        if (!(v.u.seq = seq_new(doc, false)) || (n && !seq_add(doc, v.u.seq, stack + depth - n, n))) {
          fail_memory(doc, at);
          goto failed;
        }
        depth -= n;
        PUSH(v);
        continue;
      case '.': /* STOP */
        if (depth != 1) FAIL("pickle: STOP with %zu values on the stack", depth);
        if (unlikely(stack[0].kind == PV_RECORD)) goto records_escaped;
        doc->root = stack[0];
        free(flat.pairs);
        free(stack);
        free(marks);
        big_free(memo, memo_cap * sizeof *memo);
        return doc;
      case 'c':
      case 0x93:
      case 'R':
      case 'b':
      case 0x81:
      case 0x92:
      case 'i':
      case 'o':
        FAIL("pickle: opcode 0x%02x at offset %zu asks to build a Python object; only plain data "
             "(dict, list, str, int, float) is read", op, at);
      default:
        FAIL("pickle: unsupported opcode 0x%02x at offset %zu", op, at);
    }
  }
failed:
  free(flat.pairs);
  free(stack);
  free(marks);
  big_free(memo, memo_cap * sizeof *memo);
  pickle_free(doc);
  return NULL;
records_escaped:
  /* A record was referenced again, or put somewhere other than its list:
   * where the caller would find a dict, it would find a record. Read the
   * file again without records (once: none are made then), so that the
   * tree, and every error, is the dicts' one. The records already handed
   * over are not in that tree, so the caller ignores them. */
  free(flat.pairs);
  free(stack);
  free(marks);
  big_free(memo, memo_cap * sizeof *memo);
  arena_free(&doc->arena);
  doc->options.record = NULL;
  doc->records_len = 0;
  return parse(doc);
}

/* A document for buf (taken over: munmap'd or freed with the document). */
static pickle_doc_t *new_doc(unsigned char *buf, size_t len, bool mapped, const pickle_options_t *options) {
  pickle_doc_t *doc = calloc(1, sizeof *doc);
  if (!doc) {
    if (mapped) munmap(buf, len);
    else free(buf);
    set_error(GCA_ERR_NOMEM, "pickle: out of host memory");
    return NULL;
  }
  doc->buf = buf;
  doc->len = len;
  doc->mapped = mapped;
  if (options) doc->options = *options;
  if (!doc->options.record) doc->options.records_key = NULL;
  doc->pruned_len = doc->options.pruned_key ? strlen(doc->options.pruned_key) : 0;
  doc->records_len = doc->options.records_key ? strlen(doc->options.records_key) : 0;
  doc->pruned_seq.pruned = true;
  return doc;
}

pickle_doc_t *pickle_parse(const void *data, size_t len, const pickle_options_t *options) {
  unsigned char *buf = malloc(len ? len : 1);
  if (!buf) {
    set_error(GCA_ERR_NOMEM, "pickle: out of host memory");
    return NULL;
  }
  memcpy(buf, data, len);
  pickle_doc_t *doc = new_doc(buf, len, false, options);
  return doc ? parse(doc) : NULL;
}

pickle_doc_t *pickle_load(const char *path, const pickle_options_t *options) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    set_error(GCA_ERR_IO, "cannot open %s", path); /* callers add nothing: the path is named */
    return NULL;
  }
  /* A regular file is mapped (populated at once: the reader touches every
   * byte, and faulting it in a page at a time costs more than parsing it). */
  struct stat st;
  if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    int flags = MAP_PRIVATE;
#ifdef MAP_POPULATE
    flags |= MAP_POPULATE;
#endif
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, flags, fileno(f), 0);
    if (map != MAP_FAILED) {
      fclose(f);
      pickle_doc_t *doc = new_doc(map, (size_t)st.st_size, true, options);
      return doc ? parse(doc) : NULL;
    }
  }
  /* A pipe, or a file that cannot be mapped: read it. */
  size_t cap = (size_t)1 << 20, len = 0;
  unsigned char *buf = malloc(cap);
  while (buf) {
    size_t n = fread(buf + len, 1, cap - len, f);
    len += n;
    if (len < cap) break;
    unsigned char *bigger = realloc(buf, cap * 2);
    if (!bigger) {
      free(buf);
      buf = NULL;
      break;
    }
    buf = bigger;
    cap *= 2;
  }
  bool failed = ferror(f);
  fclose(f);
  if (!buf || failed) {
    free(buf);
    set_error(failed ? GCA_ERR_IO : GCA_ERR_NOMEM, "cannot read %s", path);
    return NULL;
  }
  pickle_doc_t *doc = new_doc(buf, len, false, options);
  return doc ? parse(doc) : NULL;
}


/* ---- walking ------------------------------------------------------------ */

static bool str_eq(const pv_t *v, const char *s, size_t n) {
  return v->kind == PV_STR && v->len == n && memcmp(v->u.data, s, n) == 0;
}

int pv_str_eq(const pv_t *v, const char *s) { return v && str_eq(v, s, strlen(s)); }

const pv_t *pv_get(const pv_t *dict, const char *key) {
  if (!dict || dict->kind != PV_DICT) return NULL;
  size_t n = strlen(key);
  const pv_seq_t *s = dict->u.seq;
  for (size_t i = 0; i + 1 < s->count; i += 2)
    if (str_eq(&s->items[i], key, n)) return &s->items[i + 1];
  return NULL;
}

size_t pv_len(const pv_t *v) {
  if (!v) return 0;
  if (v->kind == PV_LIST) return v->u.seq->count;
  if (v->kind == PV_DICT) return v->u.seq->count / 2;
  return 0;
}

const pv_t *pv_at(const pv_t *list, size_t index) {
  return list && list->kind == PV_LIST && index < list->u.seq->count ? &list->u.seq->items[index] : NULL;
}

const pv_t *pv_key_at(const pv_t *dict, size_t i) {
  return dict && dict->kind == PV_DICT && 2 * i + 1 < dict->u.seq->count ? &dict->u.seq->items[2 * i] : NULL;
}

const pv_t *pv_value_at(const pv_t *dict, size_t i) {
  return dict && dict->kind == PV_DICT && 2 * i + 1 < dict->u.seq->count ? &dict->u.seq->items[2 * i + 1] : NULL;
}

bool pv_equal(const pv_t *a, const pv_t *b, int depth, size_t *budget) {
  if (depth > 64 || !*budget) return true;
  --*budget;
  if (a->kind != b->kind) return false;
  switch (a->kind) {
    case PV_STR:
    case PV_BYTES:
      return a->len == b->len && !memcmp(a->u.data, b->u.data, a->len);
    case PV_FLOAT:
      return !memcmp(&a->u.f, &b->u.f, sizeof a->u.f);
    case PV_LIST:
    case PV_DICT:
      if (a->u.seq->count != b->u.seq->count || a->u.seq->pruned != b->u.seq->pruned) return false;
      for (size_t i = 0; i < a->u.seq->count; i++)
        if (!pv_equal(&a->u.seq->items[i], &b->u.seq->items[i], depth + 1, budget)) return false;
      return true;
    case PV_NONE:
      return true;
    default:
      return a->u.i == b->u.i;
  }
}
