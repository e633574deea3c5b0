/* The plain-data pickle reader (see pickle.h). A stack machine over the
 * opcodes PyTorch's snapshots use, every read bounds-checked. Values live in
 * an arena owned by the document, so the memo may share a value between many
 * parents and freeing is a walk over the arena, not over the tree.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../internal.h"
#include "pickle.h"

#define NODES_PER_CHUNK 4096

typedef struct node_chunk {
  struct node_chunk *next;
  size_t used;
  pv_t nodes[NODES_PER_CHUNK];
} node_chunk_t;

struct pickle_doc {
  unsigned char *buf;
  size_t len;
  node_chunk_t *chunks;
  const pv_t *root;
};

typedef struct reader {
  pickle_doc_t *doc;
  size_t pos;
  pv_t **stack;
  size_t depth, stack_cap;
  size_t *marks;
  size_t mark_count, mark_cap;
  pv_t **memo;
  size_t memo_cap;
  size_t memo_len; /* MEMOIZE appends here */
} reader_t;

static pv_t *new_node(pickle_doc_t *doc, pv_kind kind) {
  if (!doc->chunks || doc->chunks->used == NODES_PER_CHUNK) {
    node_chunk_t *c = malloc(sizeof *c);
    if (!c) return NULL;
    c->next = doc->chunks;
    c->used = 0;
    doc->chunks = c;
  }
  pv_t *v = &doc->chunks->nodes[doc->chunks->used++];
  memset(v, 0, sizeof *v);
  v->kind = kind;
  return v;
}

void pickle_free(pickle_doc_t *doc) {
  if (!doc) return;
  while (doc->chunks) {
    node_chunk_t *next = doc->chunks->next;
    for (size_t i = 0; i < doc->chunks->used; i++) {
      pv_t *v = &doc->chunks->nodes[i];
      if (v->kind == PV_LIST || v->kind == PV_DICT) free(v->u.seq.items);
    }
    free(doc->chunks);
    doc->chunks = next;
  }
  free(doc->buf);
  free(doc);
}

const pv_t *pickle_root(const pickle_doc_t *doc) { return doc ? doc->root : NULL; }

/* ---- reader helpers ----------------------------------------------------- */

#define FAIL(r, ...) ((void)(r), set_error(GCA_ERR_INVALID, __VA_ARGS__), -1)

static int need(reader_t *r, size_t n, const char *what) {
  if (r->doc->len - r->pos < n)
    return FAIL(r, "pickle: truncated at offset %zu while reading %s", r->pos, what);
  return 0;
}

static uint64_t read_le(reader_t *r, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) v |= (uint64_t)r->doc->buf[r->pos + i] << (8 * i);
  r->pos += n;
  return v;
}

static int push(reader_t *r, pv_t *v) {
  if (!v) return FAIL(r, "pickle: out of host memory");
  if (r->depth == r->stack_cap) {
    size_t cap = r->stack_cap ? r->stack_cap * 2 : 64;
    pv_t **s = realloc(r->stack, cap * sizeof *s);
    if (!s) return FAIL(r, "pickle: out of host memory");
    r->stack = s;
    r->stack_cap = cap;
  }
  r->stack[r->depth++] = v;
  return 0;
}


static int seq_append(reader_t *r, pv_t *seq, pv_t *item) {
  if (seq->u.seq.count == seq->u.seq.cap) {
    size_t cap = seq->u.seq.cap ? seq->u.seq.cap * 2 : 4;
    pv_t **items = realloc(seq->u.seq.items, cap * sizeof *items);
    if (!items) return FAIL(r, "pickle: out of host memory");
    seq->u.seq.items = items;
    seq->u.seq.cap = cap;
  }
  seq->u.seq.items[seq->u.seq.count++] = item;
  return 0;
}

static int memo_put(reader_t *r, size_t index, pv_t *v) {
  if (!v) return FAIL(r, "pickle: memo store with an empty stack at offset %zu", r->pos);
  if (index > 100000000) return FAIL(r, "pickle: memo index %zu is absurd", index);
  if (index >= r->memo_cap) {
    size_t cap = r->memo_cap ? r->memo_cap : 256;
    while (cap <= index) cap *= 2;
    pv_t **m = realloc(r->memo, cap * sizeof *m);
    if (!m) return FAIL(r, "pickle: out of host memory");
    memset(m + r->memo_cap, 0, (cap - r->memo_cap) * sizeof *m);
    r->memo = m;
    r->memo_cap = cap;
  }
  r->memo[index] = v;
  if (index >= r->memo_len) r->memo_len = index + 1;
  return 0;
}

static int memo_get(reader_t *r, size_t index) {
  if (index >= r->memo_cap || !r->memo[index])
    return FAIL(r, "pickle: memo index %zu used before it was stored (offset %zu)", index, r->pos);
  return push(r, r->memo[index]);
}

static int mark_pop(reader_t *r, size_t *base) {
  if (!r->mark_count) return FAIL(r, "pickle: no MARK before offset %zu", r->pos);
  *base = r->marks[--r->mark_count];
  if (*base > r->depth) return FAIL(r, "pickle: MARK above the stack at offset %zu", r->pos);
  return 0;
}

static int string_op(reader_t *r, size_t len_bytes, pv_kind kind) {
  if (need(r, len_bytes, "a length")) return -1;
  uint64_t n = read_le(r, len_bytes);
  if (need(r, n, "a string")) return -1;
  pv_t *v = new_node(r->doc, kind);
  if (v) {
    v->u.str.data = (const char *)r->doc->buf + r->pos;
    v->u.str.len = (size_t)n;
  }
  r->pos += n;
  return push(r, v);
}

static int int_op(reader_t *r, int64_t value) {
  pv_t *v = new_node(r->doc, PV_INT);
  if (v) v->u.i = value;
  return push(r, v);
}

static int long_op(reader_t *r, size_t len_bytes) {
  if (need(r, len_bytes, "a length")) return -1;
  uint64_t n = read_le(r, len_bytes);
  if (n > 8) return FAIL(r, "pickle: integer of %llu bytes at offset %zu does not fit in 64 bits",
                         (unsigned long long)n, r->pos);
  if (need(r, n, "an integer")) return -1;
  uint64_t raw = read_le(r, (size_t)n);
  int64_t value;
  if (n == 0) value = 0;
  else if (n < 8 && (raw >> (8 * n - 1)) & 1) value = (int64_t)(raw | (~(uint64_t)0 << (8 * n)));
  else value = (int64_t)raw;
  return int_op(r, value);
}

static int tuple_of(reader_t *r, size_t n) {
  if (r->depth < n) return FAIL(r, "pickle: tuple of %zu with %zu on the stack at offset %zu", n, r->depth, r->pos);
  pv_t *t = new_node(r->doc, PV_LIST);
  if (!t) return FAIL(r, "pickle: out of host memory");
  size_t base = r->depth - n;
  for (size_t i = base; i < r->depth; i++)
    if (seq_append(r, t, r->stack[i])) return -1;
  r->depth = base;
  return push(r, t);
}

static int set_items(reader_t *r, size_t base) {
  if (base == 0 || (r->depth - base) % 2) return FAIL(r, "pickle: SETITEMS with odd items at offset %zu", r->pos);
  pv_t *dict = r->stack[base - 1];
  if (dict->kind != PV_DICT) return FAIL(r, "pickle: SETITEM on a non-dict at offset %zu", r->pos);
  for (size_t i = base; i < r->depth; i++)
    if (seq_append(r, dict, r->stack[i])) return -1;
  r->depth = base;
  return 0;
}

static int append_items(reader_t *r, size_t base) {
  if (base == 0) return FAIL(r, "pickle: APPENDS with no list at offset %zu", r->pos);
  pv_t *list = r->stack[base - 1];
  if (list->kind != PV_LIST) return FAIL(r, "pickle: APPEND on a non-list at offset %zu", r->pos);
  for (size_t i = base; i < r->depth; i++)
    if (seq_append(r, list, r->stack[i])) return -1;
  r->depth = base;
  return 0;
}

/* ---- the machine -------------------------------------------------------- */

static int step(reader_t *r, bool *done) {
  size_t at = r->pos;
  unsigned char op = r->doc->buf[r->pos++];
  size_t base;
  switch (op) {
    case 0x80: /* PROTO */
      if (need(r, 1, "the protocol")) return -1;
      if (r->doc->buf[r->pos] < 2 || r->doc->buf[r->pos] > 5)
        return FAIL(r, "pickle: protocol %d is not supported (2 to 5 are)", r->doc->buf[r->pos]);
      r->pos++;
      return 0;
    case 0x95: /* FRAME */
      if (need(r, 8, "a frame length")) return -1;
      r->pos += 8;
      return 0;
    case '}': return push(r, new_node(r->doc, PV_DICT));
    case ']':
    case ')': return push(r, new_node(r->doc, PV_LIST));
    case 'N': return push(r, new_node(r->doc, PV_NONE));
    case 0x88:
    case 0x89: {
      pv_t *v = new_node(r->doc, PV_BOOL);
      if (v) v->u.i = op == 0x88;
      return push(r, v);
    }
    case '(':
      if (r->mark_count == r->mark_cap) {
        size_t cap = r->mark_cap ? r->mark_cap * 2 : 32;
        size_t *m = realloc(r->marks, cap * sizeof *m);
        if (!m) return FAIL(r, "pickle: out of host memory");
        r->marks = m;
        r->mark_cap = cap;
      }
      r->marks[r->mark_count++] = r->depth;
      return 0;
    case 0x94: return memo_put(r, r->memo_len, r->depth ? r->stack[r->depth - 1] : NULL);
    case 'q':
      if (need(r, 1, "a memo index")) return -1;
      return memo_put(r, (size_t)read_le(r, 1), r->depth ? r->stack[r->depth - 1] : NULL);
    case 'r':
      if (need(r, 4, "a memo index")) return -1;
      return memo_put(r, (size_t)read_le(r, 4), r->depth ? r->stack[r->depth - 1] : NULL);
    case 'h':
      if (need(r, 1, "a memo index")) return -1;
      return memo_get(r, (size_t)read_le(r, 1));
    case 'j':
      if (need(r, 4, "a memo index")) return -1;
      return memo_get(r, (size_t)read_le(r, 4));
    case 0x8c: return string_op(r, 1, PV_STR);
    case 'X': return string_op(r, 4, PV_STR);
    case 0x8d: return string_op(r, 8, PV_STR);
    case 'C': return string_op(r, 1, PV_BYTES);
    case 'B': return string_op(r, 4, PV_BYTES);
    case 0x8e: return string_op(r, 8, PV_BYTES);
    case 'K':
      if (need(r, 1, "an integer")) return -1;
      return int_op(r, (int64_t)read_le(r, 1));
    case 'M':
      if (need(r, 2, "an integer")) return -1;
      return int_op(r, (int64_t)read_le(r, 2));
    case 'J':
      if (need(r, 4, "an integer")) return -1;
      return int_op(r, (int64_t)(int32_t)(uint32_t)read_le(r, 4));
    case 0x8a: return long_op(r, 1);
    case 0x8b: return long_op(r, 4);
    case 'G': {
      if (need(r, 8, "a float")) return -1;
      uint64_t bits = 0;
      for (int i = 0; i < 8; i++) bits = (bits << 8) | r->doc->buf[r->pos + (size_t)i];
      r->pos += 8;
      pv_t *v = new_node(r->doc, PV_FLOAT);
      if (v) memcpy(&v->u.f, &bits, sizeof bits);
      return push(r, v);
    }
    case 0x85: return tuple_of(r, 1);
    case 0x86: return tuple_of(r, 2);
    case 0x87: return tuple_of(r, 3);
    case 't':
      if (mark_pop(r, &base)) return -1;
      return tuple_of(r, r->depth - base);
    case 's':
      if (r->depth < 3) return FAIL(r, "pickle: SETITEM with a short stack at offset %zu", at);
      return set_items(r, r->depth - 2);
    case 'u':
      if (mark_pop(r, &base)) return -1;
      return set_items(r, base);
    case 'a':
      if (r->depth < 2) return FAIL(r, "pickle: APPEND with a short stack at offset %zu", at);
      return append_items(r, r->depth - 1);
    case 'e':
      if (mark_pop(r, &base)) return -1;
      return append_items(r, base);
    case '.':
      if (r->depth != 1) return FAIL(r, "pickle: STOP with %zu values on the stack", r->depth);
      *done = true;
      return 0;
    case 'c':
    case 0x93:
    case 'R':
    case 'b':
    case 0x81:
    case 0x92:
    case 'i':
    case 'o':
      return FAIL(r, "pickle: opcode 0x%02x at offset %zu asks to build a Python object; only plain data "
                     "(dict, list, str, int, float) is read", op, at);
    default:
      return FAIL(r, "pickle: unsupported opcode 0x%02x at offset %zu", op, at);
  }
}

pickle_doc_t *pickle_parse(const void *data, size_t len) {
  pickle_doc_t *doc = calloc(1, sizeof *doc);
  if (!doc || !(doc->buf = malloc(len ? len : 1))) {
    free(doc);
    set_error(GCA_ERR_NOMEM, "pickle: out of host memory");
    return NULL;
  }
  memcpy(doc->buf, data, len);
  doc->len = len;
  reader_t r = {.doc = doc};
  bool done = false;
  int rc = 0;
  while (!done && rc == 0) {
    if (r.pos >= len) {
      rc = FAIL(&r, "pickle: ended at offset %zu without a STOP opcode", r.pos);
      break;
    }
    rc = step(&r, &done);
  }
  if (rc == 0) doc->root = r.stack[0];
  free(r.stack);
  free(r.marks);
  free(r.memo);
  if (rc != 0) {
    pickle_free(doc);
    return NULL;
  }
  return doc;
}

pickle_doc_t *pickle_load(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    set_error(GCA_ERR_IO, "cannot open %s", path);  /* callers add nothing: the path is named */
    return NULL;
  }
  size_t cap = 1 << 20, len = 0;
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
  pickle_doc_t *doc = pickle_parse(buf, len);
  free(buf);
  return doc;
}

/* ---- walking ------------------------------------------------------------ */

int pv_str_eq(const pv_t *v, const char *s) {
  return v && v->kind == PV_STR && v->u.str.len == strlen(s) && memcmp(v->u.str.data, s, v->u.str.len) == 0;
}

const pv_t *pv_get(const pv_t *dict, const char *key) {
  if (!dict || dict->kind != PV_DICT) return NULL;
  for (size_t i = 0; i < dict->u.seq.count / 2; i++)
    if (pv_str_eq(dict->u.seq.items[2 * i], key)) return dict->u.seq.items[2 * i + 1];
  return NULL;
}

size_t pv_len(const pv_t *v) {
  if (!v) return 0;
  if (v->kind == PV_LIST) return v->u.seq.count;
  if (v->kind == PV_DICT) return v->u.seq.count / 2;
  return 0;
}

const pv_t *pv_at(const pv_t *list, size_t index) {
  return list && list->kind == PV_LIST && index < list->u.seq.count ? list->u.seq.items[index] : NULL;
}
