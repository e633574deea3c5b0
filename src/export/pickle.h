/* A reader for the plain-data subset of Python's pickle format (protocols 2
 * to 5): None, booleans, integers up to 64 bits, floats, strings, bytes,
 * lists, tuples and dicts, with the memo. This is what PyTorch's memory
 * snapshots (torch.cuda.memory._dump_snapshot) contain. Anything that would
 * make Python build an object (GLOBAL, REDUCE, BUILD, ...) is refused, so a
 * hostile file can at worst be rejected, never run.
 */
#ifndef GCALLOC_PICKLE_H
#define GCALLOC_PICKLE_H

#include <stddef.h>
#include <stdint.h>

typedef enum pv_kind { PV_NONE, PV_BOOL, PV_INT, PV_FLOAT, PV_STR, PV_BYTES, PV_LIST, PV_DICT } pv_kind;

typedef struct pv pv_t;
struct pv {
  pv_kind kind; /* tuples are read as lists */
  union {
    int64_t i;  /* PV_INT, PV_BOOL */
    double f;   /* PV_FLOAT */
    struct {
      const char *data; /* points into the document's buffer, not NUL-terminated */
      size_t len;
    } str;      /* PV_STR, PV_BYTES */
    struct {
      pv_t **items; /* PV_LIST: items; PV_DICT: key, value, key, value ... */
      size_t count; /* entries of items[] (a dict has two per pair) */
      size_t cap;
    } seq;
  } u;
};

typedef struct pickle_doc pickle_doc_t;

/* Parse `len` bytes (the document keeps its own copy). On failure returns
 * NULL with GCA_ERR_INVALID set and a message naming the offset and why. */
pickle_doc_t *pickle_parse(const void *data, size_t len);
/* Read a whole file and parse it; GCA_ERR_IO when it cannot be read. */
pickle_doc_t *pickle_load(const char *path);
void pickle_free(pickle_doc_t *doc);
const pv_t *pickle_root(const pickle_doc_t *doc);

/* Helpers for walking the tree. */
const pv_t *pv_get(const pv_t *dict, const char *key); /* NULL if absent or not a dict */
int pv_str_eq(const pv_t *v, const char *s);
size_t pv_len(const pv_t *v);                      /* list items or dict pairs; 0 otherwise */
const pv_t *pv_at(const pv_t *list, size_t index);

#endif /* GCALLOC_PICKLE_H */
