/* A reader for the plain-data subset of Python's pickle format (protocols 2
 * to 5): None, booleans, integers up to 64 bits, floats, strings, bytes,
 * lists, tuples and dicts, with the memo. This is what PyTorch's memory
 * snapshots (torch.cuda.memory._dump_snapshot) contain. Anything that would
 * make Python build an object (GLOBAL, REDUCE, BUILD, ...) is refused, so a
 * hostile file can at worst be rejected, never run. Memory is bounded by the
 * input: at most GCA_PICKLE_BYTES_PER_INPUT_BYTE bytes per byte read, or the
 * caller's pickle_options.memory_limit.
 */
#ifndef GCALLOC_PICKLE_H
#define GCALLOC_PICKLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* PV_UNSET is never seen by callers: it marks a memo slot not yet stored.
 * PV_RECORD is only seen by callers that ask for records (pickle_options). */
typedef enum pv_kind { PV_UNSET, PV_NONE, PV_BOOL, PV_INT, PV_FLOAT, PV_STR, PV_BYTES, PV_LIST, PV_DICT, PV_RECORD } pv_kind;

typedef struct pv_seq pv_seq_t;

/* A value, 16 bytes, copied by value: a snapshot holds hundreds of thousands
 * of them, mostly memo references, and copying two words is what makes
 * reading one cost a few nanoseconds. Containers are shared by pointer, as
 * the memo shares them in Python. */
typedef struct pv {
  uint32_t kind;    /* pv_kind; tuples are read as lists */
  uint32_t len;     /* PV_STR, PV_BYTES: length in bytes; PV_RECORD: its kind (0 records_key's, 1 block_key's) */
  union {
    int64_t i;        /* PV_INT, PV_BOOL; PV_RECORD: the id its reader gave it */
    double f;         /* PV_FLOAT */
    const char *data; /* PV_STR, PV_BYTES: into the document's buffer, not NUL-terminated */
    pv_seq_t *seq;    /* PV_LIST, PV_DICT */
  } u;
} pv_t;

struct pv_seq {
  pv_t *items;  /* PV_LIST: items; PV_DICT: key, value, key, value ... */
  size_t count; /* entries of items[] (a dict has two per pair) */
  size_t cap;
  bool pruned;  /* under the pruned key (pickle_options): its contents were dropped */
  /* Records (pickle_options): 1 the list under records_key, 2 a list in
   * it, 3 the list under block_key. */
  uint8_t role;
  /* A list of records and nothing else, with consecutive ids (a device's
   * entries, as read): held as the range record_base .. record_base +
   * count - 1, items NULL. Read it with pv_records; pv_at gives NULL. */
  bool record_range;
  int64_t record_base;
};

#define GCA_PICKLE_BYTES_PER_INPUT_BYTE 64

typedef struct pickle_doc pickle_doc_t;

/* A record reader (pickle_options), in two steps. `prepare` turns a dict's
 * pairs (key, value, key, value ...) into `record_size` bytes at `out` (at
 * most PICKLE_RECORD_MAX, aligned for any scalar), or declines (perhaps
 * with part of `out` written), and the dict is then read as any other; it
 * may run on the second reader's thread (see `split`), so it reads `ctx`
 * and writes `out`, nothing else. `take`
 * then takes prepared records one at a time in file order, on the thread
 * that called pickle_parse, setting *id, or declines (out of memory). */
typedef bool (*pickle_prepare_fn)(const void *ctx, const pv_t *pairs, size_t count, void *out);
typedef bool (*pickle_take_fn)(void *ctx, const void *prepared, int64_t *id);
#define PICKLE_RECORD_MAX 64

typedef struct pickle_options {
  /* Every container stored under the dict key `pruned_key`, and every
   * container built inside one, is kept empty: a PyTorch snapshot's
   * "frames" are most of its values, and a replay never reads them. "Inside"
   * is: pushed while the pruned container is being filled (after its
   * MARK); a container written alone and put in with APPEND is built
   * (the reader sees APPEND only after it), then dropped from the list. */
  const char *pruned_key;
  /* Every dict in a list in the list stored under the dict key
   * `records_key` (a snapshot's device_traces entries) whose values are
   * scalars, memo references or pruned containers is handed to `prepare`
   * and `take` as it is read, and stands in the tree as a PV_RECORD with
   * the id it was given; there is no dict for it. A dict that does not have
   * that shape, or that they decline, is read as a dict. */
  const char *records_key;
  pickle_prepare_fn prepare;
  pickle_take_fn take;
  size_t record_size;
  void *record_ctx;
  /* A second kind of record, made the same way with these two steps and
   * record_ctx: every dict in the list stored under the dict key
   * `block_key` (a snapshot's segments' blocks), a PV_RECORD of kind 1
   * (pv_t.len) in the tree. Its ids are its own: block_take numbers them.
   * Only the caller's thread reads them (the second reader reads entries
   * alone), so both steps run there. */
  const char *block_key;
  pickle_prepare_fn block_prepare;
  pickle_take_fn block_take;
  size_t block_size;
  /* Tests: read every dict through the general machine, not the loop for
   * flat dicts (the two must give the same tree). */
  bool machine_only;
  /* With records, a second thread reads entries from past the middle of
   * the file on (pickle.c, "Reading on two cores"): 0 decides (files of
   * 512 KiB or more, framed by a protocol-4 pickler, with two processors
   * to run on); PICKLE_ONE_READER never; any other value starts it at that
   * offset, whatever the file (tests: the result must not depend on it;
   * and the first reader then waits for the second to the end rather than
   * reading on alone when it catches up, so that how many entries the
   * second reads does not depend on the timing).
   * `prepare` then runs on that thread for the entries it reads, while
   * `take` runs on the caller's: `prepare` must not read what `take`
   * changes, and may read a value's scalars and strings but not a
   * container's contents (the first reader may be filling it). An empty
   * pruned container (under the pruned key) may be given as another of its
   * kind: they are all alike but for where they are. */
  size_t split;
  /* When set, called now and then from the caller's thread with the bytes
   * read so far of `total`: about every 1/128 of the input and 1 MiB at
   * least, as a dict is met (a snapshot is dicts throughout). A reading
   * that goes back to the start (a record found elsewhere) counts again
   * from 0. */
  void (*progress)(void *ctx, size_t done, size_t total);
  void *progress_ctx;
  /* Bytes of host memory the reading may hold besides the input (0: at
   * most GCA_PICKLE_BYTES_PER_INPUT_BYTE per input byte): at most half of
   * it for containers, a sixteenth each for the stack, the marks and the
   * memo. The records' steps keep their own within what remains. */
  size_t memory_limit;
} pickle_options_t;

#define PICKLE_ONE_READER SIZE_MAX

/* Parse `len` bytes (the document keeps its own copy). On failure returns
 * NULL with GCA_ERR_INVALID set and a message naming the offset and why.
 * `options` may be NULL. */
pickle_doc_t *pickle_parse(const void *data, size_t len, const pickle_options_t *options);
/* pickle_parse of a buffer from malloc, which the document takes over
 * instead of copying (freed with it, or here when parsing fails): a pipe's
 * or a decompressed trace, read into memory already. */
pickle_doc_t *pickle_parse_owned(unsigned char *buf, size_t len, const pickle_options_t *options);
/* Input looked at as it arrives, before it is parsed: pickle_scan walks the
 * opcodes of buf[scan->at, len) (the bytes already looked at are not looked
 * at again; buf holds all the input so far) and refuses, as the parser
 * would, the first that the parser refuses whatever follows it: an opcode
 * it does not read, a protocol it does not read, a string or integer too
 * long to hold. An opcode cut short waits for more. At the STOP opcode it
 * sets `stopped`: the parser reads nothing after it. false with the error
 * set (the parser's message, offsets from the start). */
typedef struct pickle_scan {
  size_t at;    /* where the next opcode starts */
  bool stopped; /* STOP was read */
} pickle_scan_t;
bool pickle_scan(pickle_scan_t *scan, const unsigned char *buf, size_t len);
/* Read a whole file and parse it; GCA_ERR_IO when it cannot be read. */
pickle_doc_t *pickle_load(const char *path, const pickle_options_t *options);
void pickle_free(pickle_doc_t *doc);
const pv_t *pickle_root(const pickle_doc_t *doc);
/* Records the first reader took from the second (pickle_options.split):
 * tests use it to know that the second reader did its part. */
size_t pickle_split_taken(const pickle_doc_t *doc);

/* Helpers for walking the tree. */
const pv_t *pv_get(const pv_t *dict, const char *key); /* NULL if absent or not a dict */
int pv_str_eq(const pv_t *v, const char *s);
size_t pv_len(const pv_t *v);                      /* list items or dict pairs; 0 otherwise */
const pv_t *pv_at(const pv_t *list, size_t index); /* NULL past the end, and in a list of records held as a range */
/* A list of records held as a range (pv_seq.record_range): how many, and
 * in *first the id of the first; 0 for any other value. (Its records are
 * of kind 1 when the list is the block key's, role 3.) */
size_t pv_records(const pv_t *list, int64_t *first);
/* A list's index-th item whatever its form: pv_at's, or for a list of
 * records held as a range, the record, written to *scratch. NULL past
 * the end. */
const pv_t *pv_item(const pv_t *list, size_t index, pv_t *scratch);
/* Same values (tests, the fuzzer): compared through the memo's sharing, to
 * a depth of 64 and at most *budget values, beyond which they count as the
 * same (a tree shared by the memo may be exponential, a hostile one cyclic). */
bool pv_equal(const pv_t *a, const pv_t *b, int depth, size_t *budget);
/* A dict's i-th pair (in file order), or NULLs past the end. */
const pv_t *pv_key_at(const pv_t *dict, size_t i);
const pv_t *pv_value_at(const pv_t *dict, size_t i);

#endif /* GCALLOC_PICKLE_H */
