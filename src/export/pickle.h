/* A reader for the plain-data subset of Python's pickle format (protocols 2
 * to 5): None, booleans, integers up to 64 bits, floats, strings, bytes,
 * lists, tuples and dicts, with the memo. This is what PyTorch's memory
 * snapshots (torch.cuda.memory._dump_snapshot) contain. Anything that would
 * make Python build an object (GLOBAL, REDUCE, BUILD, ...) is refused, so a
 * hostile file can at worst be rejected, never run. Memory is bounded by the
 * input: at most GCA_PICKLE_BYTES_PER_INPUT_BYTE bytes per byte read.
 */
#ifndef GCALLOC_PICKLE_H
#define GCALLOC_PICKLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* PV_UNSET is never seen by callers: it marks a memo slot not yet stored. */
typedef enum pv_kind { PV_UNSET, PV_NONE, PV_BOOL, PV_INT, PV_FLOAT, PV_STR, PV_BYTES, PV_LIST, PV_DICT } pv_kind;

typedef struct pv_seq pv_seq_t;

/* A value, 16 bytes, copied by value: a snapshot holds hundreds of thousands
 * of them, mostly memo references, and copying two words is what makes
 * reading one cost a few nanoseconds. Containers are shared by pointer, as
 * the memo shares them in Python. */
typedef struct pv {
  uint32_t kind;    /* pv_kind; tuples are read as lists */
  uint32_t len;     /* PV_STR, PV_BYTES: length in bytes */
  union {
    int64_t i;        /* PV_INT, PV_BOOL */
    double f;         /* PV_FLOAT */
    const char *data; /* PV_STR, PV_BYTES: into the document's buffer, not NUL-terminated */
    pv_seq_t *seq;    /* PV_LIST, PV_DICT */
  } u;
} pv_t;

struct pv_seq {
  pv_t *items;  /* PV_LIST: items; PV_DICT: key, value, key, value ... */
  size_t count; /* entries of items[] (a dict has two per pair) */
  size_t cap;
  bool pruned;  /* under the pruned key (pickle_load_pruned): its contents were dropped */
};

#define GCA_PICKLE_BYTES_PER_INPUT_BYTE 64

typedef struct pickle_doc pickle_doc_t;

/* Parse `len` bytes (the document keeps its own copy). On failure returns
 * NULL with GCA_ERR_INVALID set and a message naming the offset and why. */
pickle_doc_t *pickle_parse(const void *data, size_t len);
/* Read a whole file and parse it; GCA_ERR_IO when it cannot be read. */
pickle_doc_t *pickle_load(const char *path);
/* The same, but every container stored under the dict key `pruned_key`, and
 * every container built inside one, is kept empty: a PyTorch snapshot's
 * "frames" are most of its values, and a replay never reads them. */
pickle_doc_t *pickle_load_pruned(const char *path, const char *pruned_key);
pickle_doc_t *pickle_parse_pruned(const void *data, size_t len, const char *pruned_key);
void pickle_free(pickle_doc_t *doc);
const pv_t *pickle_root(const pickle_doc_t *doc);

/* Helpers for walking the tree. */
const pv_t *pv_get(const pv_t *dict, const char *key); /* NULL if absent or not a dict */
int pv_str_eq(const pv_t *v, const char *s);
size_t pv_len(const pv_t *v);                      /* list items or dict pairs; 0 otherwise */
const pv_t *pv_at(const pv_t *list, size_t index);
/* A dict's i-th pair (in file order), or NULLs past the end. */
const pv_t *pv_key_at(const pv_t *dict, size_t i);
const pv_t *pv_value_at(const pv_t *dict, size_t i);

#endif /* GCALLOC_PICKLE_H */
