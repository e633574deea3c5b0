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
#include <errno.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/base.h"
#include "pickle.h"
#include "util.h"

#define ARENA_CHUNK ((size_t)4 << 20)

struct pickle_doc {
  unsigned char *buf;
  size_t len;
  bool mapped;   /* buf is the file, mapped; else malloc'd */
  pickle_options_t options;
  size_t pruned_len, records_len, blocks_len; /* of the three keys; 0 without them */
  arena_t arena; /* containers and their item arrays */
  size_t array_limit; /* bytes each growing array (stack, marks, memo) may take */
  bool over_limit;    /* one was refused for it */
  pv_t root;
  pv_seq_t pruned_seq; /* the contents of every container the flat reader prunes: none */
  size_t split_taken;  /* records taken from the second reader */
  size_t progress_at;  /* the offset past which options.progress is called next (SIZE_MAX: never) */
};

/* Tells options.progress how far the reading is, and when to next. Out of
 * the machine's loop, which only compares an offset with progress_at. */
#if defined(__GNUC__)
__attribute__((noinline, cold))
#endif
static void report_progress(pickle_doc_t *doc, size_t at) {
  size_t step = doc->len / 128 > ((size_t)1 << 20) ? doc->len / 128 : (size_t)1 << 20;
  doc->options.progress(doc->options.progress_ctx, at, doc->len);
  doc->progress_at = at + step;
}

static void unmap_doc(void *arg) {
  pickle_doc_t *doc = arg;
  munmap(doc->buf, doc->len);
  free(doc);
}

void pickle_free(pickle_doc_t *doc) {
  if (!doc) return;
  gca__arena_free(&doc->arena);
  /* Unmapping a file read takes 0.1 ms (its pages' entries, and the other
   * processor's, where the second reader read it): a kept helper thread
   * does it while the caller goes on with what it read. */
  if (doc->mapped && gca__helper_detach(unmap_doc, doc)) return;
  if (doc->mapped) munmap(doc->buf, doc->len);
  else free(doc->buf);
  free(doc);
}

const pv_t *pickle_root(const pickle_doc_t *doc) { return doc ? &doc->root : NULL; }

size_t pickle_split_taken(const pickle_doc_t *doc) { return doc ? doc->split_taken : 0; }

/* ---- the machine -------------------------------------------------------- */

static int fail_memory(const pickle_doc_t *doc, size_t at) {
  bool over = doc->arena.over_limit || doc->over_limit;
  if (over && doc->options.memory_limit)
    return gca__set_error(GCA_ERR_INVALID,
                          "pickle: at offset %zu the file needs more than the %zu bytes of host memory its reading may "
                          "take; refused as malformed", at, doc->options.memory_limit);
  if (over)
    return gca__set_error(GCA_ERR_INVALID,
                          "pickle: at offset %zu the file needs more than %d bytes of host memory per byte of input; "
                          "refused as malformed", at, GCA_PICKLE_BYTES_PER_INPUT_BYTE);
  return gca__set_error(GCA_ERR_NOMEM, "pickle: out of host memory at offset %zu", at);
}

static pv_seq_t *seq_new(pickle_doc_t *doc, bool pruned) {
  pv_seq_t *s = gca__arena_alloc(&doc->arena, sizeof *s);
  if (s) *s = (pv_seq_t){.pruned = pruned};
  return s;
}

static inline bool str_is(const pv_t *v, const char *s, size_t n) {
  /* (The first byte first: most keys of the same length differ there, and
   * memcmp is a call.) */
  return n && v->kind == PV_STR && v->len == n && v->u.data[0] == s[0] && !memcmp(v->u.data, s, n);
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
 * record; the list under the block key has role 3, and a dict pushed into
 * it is a record of kind 1. "Into" is: the container being filled (under
 * the latest MARK), or, for a one-item list written with APPEND, the list
 * right below. */
static inline unsigned list_role(const pv_t *v) { return v->kind == PV_LIST ? v->u.seq->role : 0; }

static bool inside_role(const pv_t *stack, size_t depth, const size_t *marks, size_t mark_count, unsigned role) {
  if (depth && list_role(&stack[depth - 1]) == role) return true;
  if (!mark_count) return false;
  size_t base = marks[mark_count - 1];
  return base && base <= depth && list_role(&stack[base - 1]) == role;
}

static uint8_t role_new(const pickle_doc_t *doc, const pv_t *stack, size_t depth, const size_t *marks,
                        size_t mark_count) {
  if (!depth) return 0;
  if (str_is(&stack[depth - 1], doc->options.block_key, doc->blocks_len)) return 3;
  if (!doc->records_len) return 0;
  if (str_is(&stack[depth - 1], doc->options.records_key, doc->records_len)) return 1;
  return inside_role(stack, depth, marks, mark_count, 1) ? 2 : 0;
}

static bool holds_record(const pv_t *items, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (items[i].kind == PV_RECORD) return true;
  return false;
}

/* Whether adding items to container would put a record where its reader
 * did not make it: anywhere but a list of its kind's role (2 for kind 0,
 * 3 for kind 1), or into a record. */
static bool records_misplaced(const pv_t *container, bool dict_op, const pv_t *items, size_t n) {
  if (container->kind == PV_RECORD) return true;
  unsigned role = dict_op ? 0 : list_role(container);
  for (size_t i = 0; i < n; i++)
    if (items[i].kind == PV_RECORD && !(items[i].len ? role == 3 : role == 2)) return true;
  return false;
}

/* Whether items are the records first, first + 1, ... (of the kind the
 * list holds: records_misplaced saw to it). */
static bool records_from(const pv_t *items, size_t n, int64_t first) {
  for (size_t i = 0; i < n; i++)
    if (items[i].kind != PV_RECORD || items[i].u.i != first + (int64_t)i) return false;
  return true;
}

/* The kind of the records a list of that role holds. */
static inline uint32_t record_kind(unsigned role) { return role == 3; }

/* Appends n values. Growth extends the array where it is when nothing was
 * allocated after it (a long list, which a pickler appends to in batches
 * of a thousand: abandoned copies of a long list are hundreds of KiB of
 * the arena, each page a fault in a new process); else it allocates a new
 * array from the arena and leaves the old one there: at most as much
 * again, and no per-container free. */
static bool seq_add(pickle_doc_t *doc, pv_seq_t *s, const pv_t *items, size_t n) {
  if (s->pruned || n == 0) return true;
  /* A device's entries (or a segment's blocks), records in the order they
   * were taken: held as a range, not as 16 bytes each (hundreds of KiB
   * for a long history, a page fault per 4 KiB in a new process). Anything else in
   * the list makes it items. */
  if ((s->role == 2 || s->role == 3) && (s->record_range || !s->count)) {
    int64_t first = s->record_range ? s->record_base + (int64_t)s->count : items[0].u.i;
    if (records_from(items, n, first)) {
      if (!s->record_range) s->record_base = first;
      s->record_range = true;
      s->count += n;
      return true;
    }
    if (s->record_range) {
      size_t cap = s->count + n > 2 * s->count ? s->count + n : 2 * s->count;
      if (cap > SIZE_MAX / sizeof *s->items) return false;
      pv_t *held = gca__arena_alloc(&doc->arena, cap * sizeof *held);
      if (!held) return false;
      for (size_t i = 0; i < s->count; i++)
        held[i] = (pv_t){.kind = PV_RECORD, .len = record_kind(s->role), .u.i = s->record_base + (int64_t)i};
      s->items = held;
      s->cap = cap;
      s->record_range = false;
    }
  }
  if (s->count + n > s->cap) {
    /* Most containers are filled by one batch: size the first exactly. */
    size_t cap = s->cap ? s->cap * 2 : n > 2 ? n : 2;
    while (cap < s->count + n) cap *= 2;
    if (cap > SIZE_MAX / sizeof *s->items) return false;
    if (!gca__arena_extend(&doc->arena, s->items, s->cap * sizeof *s->items, cap * sizeof *s->items)) {
      pv_t *grown = gca__arena_alloc(&doc->arena, cap * sizeof *grown);
      if (!grown) return false;
      if (s->count) memcpy(grown, s->items, s->count * sizeof *grown);
      s->items = grown;
    }
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

/* Grows the memo (*cap entries) to hold index `need`. It is a big array
 * (util.c): a snapshot's memo is a megabyte. Below the memo's count a slot
 * is stored or PV_UNSET (a hole); from the count up nothing is read, so the
 * new part is not zeroed, as the memo first allocated is not. */
static bool memo_grow(pickle_doc_t *doc, pv_t **memo, size_t *cap, size_t need) {
  size_t grown_cap = *cap ? *cap : 64;
  while (grown_cap <= need) grown_cap *= 2;
  if (grown_cap > doc->array_limit / sizeof **memo) {
    doc->over_limit = true;
    return false;
  }
  pv_t *grown = gca__big_regrow(*memo, *cap * sizeof **memo, grown_cap * sizeof **memo);
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

/* The end of a run of memo references at pos, and in *top the largest
 * index in it: what the second reader, which has no count to check them
 * by, keeps to check later, and the first reader's quick test (all below
 * its count: the run is good to its end). */
static inline size_t scan_refs(const unsigned char *buf, size_t len, size_t pos, uint32_t *top) {
  uint32_t max = 0;
  for (;;) {
    size_t run_start = pos;
    while (len - pos >= 2 && buf[pos] == 'h') {
      max = buf[pos + 1] > max ? buf[pos + 1] : max;
      pos += 2;
    }
    while (len - pos >= 5 && buf[pos] == 'j') {
      uint32_t index = read_u32(buf + pos + 1);
      max = index > max ? index : max;
      pos += 5;
    }
    if (pos == run_start) break;
  }
  *top = max;
  return pos;
}

/* ---- runs seen before -----------------------------------------------------
 * A snapshot's frames lists repeat: a training loop allocates from the same
 * call stacks step after step, and PyTorch's pickler writes each frame once
 * and refers to it by memo index after, so the same stack is the same bytes
 * (over 90% of the bytes in a real snapshot's runs are a run seen before).
 * Decoding a run reference by reference mispredicts a branch wherever
 * BINGET and LONG_BINGET alternate (about 100,000 times in a 10,000-event
 * snapshot); comparing its bytes
 * with a run seen before goes tens of bytes a cycle. Two guesses, from what
 * a reader learned of the runs it decoded: the run that followed the
 * previous run the last time that one was read (a program repeats its
 * order), and the last KNOWN_RUN_WAYS runs that began with the same 64
 * bytes, most recently seen first. A run is known by where it was learned
 * (its start): stacks share their innermost frames (the allocator's own)
 * and their outermost (the training loop), so an identity hashed from a
 * few words at each end would name different runs alike and send the
 * first guess wrong, and with one run kept a head (real snapshots have up
 * to 20, and up to 133, distinct runs a head) the second would miss too:
 * known by their start, 77-85% of the bytes in runs are recognised, not
 * 31-38% (the rest are first sightings, each reader learning its own, and
 * runs under 48 bytes). Eight ways are slower than four (more compares
 * where none matches, a bigger table to clear). A guess is taken
 * only if its bytes are the same, the run here ends where it ended, and
 * its largest index is below the count stored: exactly when decoding would
 * have gone over the same bytes to the same place (tests compare the two).
 * Guesses are only a way to read faster: a wrong one costs a compare,
 * which stops at the first byte that differs. */
typedef struct known_run {
  uint32_t start, len; /* where its bytes were decoded (its identity); 0 len: none */
  uint32_t top;        /* its largest memo index */
} known_run_t;

#define KNOWN_RUN_BITS 9
#define KNOWN_RUN_WAYS 4
#define KNOWN_RUN_MIN 48 /* bytes: shorter runs decode as fast as they compare */
#define KNOWN_RUN_HEAD 64

typedef struct known_runs {
  uint32_t previous;                        /* the run before (its start) */
  known_run_t next[1u << KNOWN_RUN_BITS];    /* by the run before it */
  known_run_t by_head[1u << KNOWN_RUN_BITS][KNOWN_RUN_WAYS]; /* by its first KNOWN_RUN_HEAD bytes */
} known_runs_t;

static uint64_t read_u64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static uint32_t known_slot(uint64_t key) {
  return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - KNOWN_RUN_BITS));
}

/* Hashes of a run's bytes with independent multiplies (a chained hash over
 * a whole run of 300 bytes was a quarter of the time of the runs it had to
 * decode). Collisions only cost a guess that fails its compare. */
static uint64_t head_hash(const unsigned char *p) { /* KNOWN_RUN_HEAD bytes */
  uint64_t a = read_u64(p) * 0x9E3779B97F4A7C15ull + read_u64(p + 8);
  uint64_t b = read_u64(p + 16) * 0xC2B2AE3D27D4EB4Full + read_u64(p + 24);
  uint64_t c = read_u64(p + 32) * 0x165667B19E3779F9ull + read_u64(p + 40);
  uint64_t d = read_u64(p + 48) * 0x27D4EB2F165667C5ull + read_u64(p + 56);
  uint64_t h = (a ^ (b >> 17)) * 0xFF51AFD7ED558CCDull + (c ^ (d >> 23));
  return h ^ (h >> 29);
}

static inline bool is_known_here(const unsigned char *buf, size_t len, size_t pos, const known_run_t *k,
                                 size_t stored) {
  /* (c | 2) == 'j' for BINGET and LONG_BINGET alone: the run goes on. */
  return k->len && len - pos > k->len && (buf[pos + k->len] | 2) != 'j' && k->top < stored &&
         read_u64(buf + pos) == read_u64(buf + k->start) && !memcmp(buf + pos, buf + k->start, k->len);
}

/* The end of the run of memo references at pos, with its largest index in
 * *top, when a known run is there: else 0, and *head is the set of ways
 * where to learn it. The way that served moves to the front of its set. */
static inline size_t known_run_at(known_runs_t *r, const unsigned char *buf, size_t len, size_t pos, size_t stored,
                                  uint32_t *top, known_run_t **head) {
  known_run_t *next = &r->next[known_slot(r->previous)], *k = next;
  *head = NULL;
  if (!is_known_here(buf, len, pos, k, stored)) {
    if (len - pos < KNOWN_RUN_HEAD) return 0;
    known_run_t *ways = *head = r->by_head[known_slot(head_hash(buf + pos))];
    int w = 0;
    while (w < KNOWN_RUN_WAYS && !is_known_here(buf, len, pos, &ways[w], stored)) w++;
    if (w == KNOWN_RUN_WAYS) return 0;
    known_run_t found = ways[w];
    memmove(ways + 1, ways, (size_t)w * sizeof *ways);
    ways[0] = found;
    k = &ways[0];
    *next = found;
  }
  r->previous = k->start;
  *top = k->top;
  return pos + k->len;
}

/* A run decoded at [pos, end) becomes known: first of its head's ways, the
 * least recently seen one dropped. */
static inline void known_run_learn(known_runs_t *r, size_t pos, size_t end, uint32_t top, known_run_t *head) {
  if (!head || end - pos < KNOWN_RUN_MIN || end > UINT32_MAX) return;
  known_run_t k = {(uint32_t)pos, (uint32_t)(end - pos), top};
  r->next[known_slot(r->previous)] = k;
  memmove(head + 1, head, (KNOWN_RUN_WAYS - 1) * sizeof *head);
  head[0] = k;
  r->previous = k.start;
}

/* The end of the run of memo references at pos: all of it with *top its
 * largest index, when every index is below `stored` (SIZE_MAX: the second
 * reader, which checks later); else, the first reader's, where skip_refs
 * stops. */
static inline size_t skip_run(known_runs_t *r, const unsigned char *buf, size_t len, size_t pos, size_t stored,
                              uint32_t *top) {
  known_run_t *head;
  size_t end = known_run_at(r, buf, len, pos, stored, top, &head);
  if (end) return end;
  end = scan_refs(buf, len, pos, top);
  if (*top >= stored) return skip_refs(buf, len, pos, stored);
  known_run_learn(r, pos, end, *top, head);
  return end;
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
 * constant factor more, not a power of its size.
 *
 * The same code is the second reader's (see "Reading on two cores" below),
 * compiled a second time with `sym` true: there the memo before its start
 * is not known, so a memo reference is kept as its index (PV_REF), with
 * what must hold of it (stored before it was read, not a record), for the
 * first reader to check when it gets there. */

/* The flat readers' small steps are inlined where they are used: each use
 * then has its own branches, and a key's (nearly always a BINGET) is
 * predicted apart from a value's; and `sym` is a constant in each copy. */
#if defined(__GNUC__)
#define FLAT_STEP static inline __attribute__((always_inline))
#else
#define FLAT_STEP static inline
#endif

/* A memo reference the second reader did not look up: u.i is its index.
 * It never leaves this file. */
#define PV_REF ((uint32_t)PV_RECORD + 1)

typedef struct split split_t;
static void split_join(split_t *s);

typedef struct flat {
  const unsigned char *buf;
  size_t len;
  pv_t *memo;         /* the machine's memo, dense below memo_len; sym: the current entry's stores */
  size_t memo_len, memo_cap;
  pickle_doc_t *doc;
  pv_t *pairs;        /* keys and values of the dict being read, before they go to the arena */
  size_t pairs_cap, pairs_count;
  /* sym only: memo indices are the second reader's own count, memo[0] is
   * index memo_base; excess is the largest (index - memo_len) of the
   * references read; checks, every reference read (a record or an
   * unfinished dict there ends the attempt); had_container, whether a
   * dict read at depth 0 held a container (an entry's frames). */
  size_t memo_base;
  int64_t excess;
  uint32_t *checks;
  size_t checks_len, checks_cap;
  bool had_container;
  known_runs_t *known; /* runs of memo references this reader decoded (see skip_run) */
  split_t *split; /* the first reader's: the second reader, which must not see the memo move */
} flat_t;

/* The memo store that may follow a value at pos: the position after it, pos
 * when there is none, 0 when it is one that only the machine handles. The
 * second reader knows only MEMOIZE (an explicit index cannot be checked
 * against a count it does not know) and does not store references. */
FLAT_STEP size_t flat_memo(flat_t *f, size_t pos, pv_t v, const bool sym) {
  if (pos >= f->len) return pos;
  unsigned op = f->buf[pos];
  size_t index, width;
  if (op == 0x94) {
    index = f->memo_len;
    width = 1;
  } else if (op == 'q' && f->len - pos >= 2 && !sym) {
    index = f->buf[pos + 1];
    width = 2;
  } else if (op == 'r' && f->len - pos >= 5 && !sym) {
    index = read_u32(f->buf + pos + 1);
    width = 5;
  } else {
    return op == 'q' || op == 'r' ? 0 : pos;
  }
  if (sym) {
    if (v.kind == PV_REF || index - f->memo_base >= f->memo_cap) return 0;
    f->memo[index - f->memo_base] = v;
    f->memo_len++;
    return pos + width;
  }
  if (index != f->memo_len) return 0;
  if (index >= f->memo_cap) {
    split_join(f->split);
    if (!memo_grow(f->doc, &f->memo, &f->memo_cap, index)) return 0;
  }
  f->memo[f->memo_len++] = v;
  return pos + width;
}

/* A scalar or a memo reference at *at, and its memo store: *at moves past
 * them. PV_UNSET when it is not one (or, with *at 0, a memo store only the
 * machine makes). The value is returned, not stored through a pointer: the
 * caller's 16-byte load of two 8-byte stores would wait for them to reach
 * the cache, many cycles per value. */
FLAT_STEP pv_t flat_scalar(flat_t *f, size_t *at, const bool sym) {
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
      if (sym) {
        if (index > INT32_MAX) return (pv_t){0}; /* (its checks keep a flag in the top bit) */
        int64_t excess = (int64_t)index - (int64_t)f->memo_len;
        f->excess = excess > f->excess ? excess : f->excess;
        if (f->checks_len == f->checks_cap) return (pv_t){0};
        f->checks[f->checks_len++] = (uint32_t)index;
        v.kind = PV_REF;
        v.u.i = (int64_t)index;
        break;
      }
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
  *at = flat_memo(f, pos, v, sym);
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

/* What flat_dict does with the pairs it reads: a dict, nothing, a record
 * (an entry), a record of kind 1 (a block). */
typedef enum flat_mode { FLAT_KEEP, FLAT_PRUNED, FLAT_RECORD, FLAT_BLOCK } flat_mode;

/* The two copies of the flat reader: the first reader's and the second's. */
static size_t flat_dict(flat_t *f, size_t pos, flat_mode mode, int depth, pv_t *out);
static size_t flat_dict_sym(flat_t *f, size_t pos, flat_mode mode, int depth);

/* Would the machine prune a container pushed on this key? */
static inline bool is_pruned_key(const pickle_doc_t *doc, const pv_t *key) {
  return str_is(key, doc->options.pruned_key, doc->pruned_len);
}

/* Undoes the memo stores made since the memo held `memo_len` entries. */
FLAT_STEP void flat_unstore(flat_t *f, size_t memo_len, const bool sym) {
  if (!sym)
    for (size_t i = memo_len; i < f->memo_len; i++) f->memo[i].kind = PV_UNSET;
  f->memo_len = memo_len;
}

/* One item of a pruned list at pos, checked and dropped: a dict, a scalar
 * or a memo reference. Out of line: it is rare (a frame first seen), and
 * the lists' loop is tighter without it. */
FLAT_STEP size_t flat_item_body(flat_t *f, size_t pos, int depth, const bool sym) {
  if (f->buf[pos] == '}') return sym ? flat_dict_sym(f, pos, FLAT_PRUNED, depth + 1)
                                     : flat_dict(f, pos, FLAT_PRUNED, depth + 1, NULL);
  return flat_scalar(f, &pos, sym).kind == PV_UNSET ? 0 : pos;
}

#if defined(__GNUC__)
__attribute__((noinline))
#endif
static size_t flat_item_one(flat_t *f, size_t pos, int depth) {
  return flat_item_body(f, pos, depth, false);
}

#if defined(__GNUC__)
__attribute__((noinline))
#endif
static size_t flat_item_sym(flat_t *f, size_t pos, int depth) {
  return flat_item_body(f, pos, depth, true);
}

FLAT_STEP size_t flat_item(flat_t *f, size_t pos, int depth, const bool sym) {
  return sym ? flat_item_sym(f, pos, depth) : flat_item_one(f, pos, depth);
}

/* A list at pos (its ']') that the machine would prune: its items are
 * checked and dropped. Written in one of three forms: MARK items APPENDS;
 * one item and APPEND; or nothing, when what follows is the dict's next
 * key or its end. */
FLAT_STEP size_t flat_pruned_list(flat_t *f, size_t pos, int depth, const bool sym) {
  const unsigned char *buf = f->buf;
  size_t len = f->len;
  pv_t list = {.kind = PV_LIST, .u.seq = &f->doc->pruned_seq};
  if (!(pos = flat_memo(f, pos + 1, list, sym)) || (pos = flat_frames(f, pos)) >= len) return 0;
  if (buf[pos] != '(') {
    /* One item then APPEND, or else the list was empty and what was read
     * is the dict's: undone, and read again as that. A dict as the one
     * item is the machine's: it cannot tell, when the dict is pushed,
     * that APPEND will put it in the pruned list, so it builds it (and
     * its memo slot holds it whole). */
    if (buf[pos] == '}') return 0;
    size_t memo_len = f->memo_len, checks_len = f->checks_len;
    int64_t excess = f->excess;
    size_t end = flat_item(f, pos, depth, sym);
    if (end && (end = flat_frames(f, end)) < len && buf[end] == 'a') return end + 1;
    flat_unstore(f, memo_len, sym);
    if (sym) {
      f->checks_len = checks_len;
      f->excess = excess;
    }
    return pos;
  }
  pos++;
  for (;;) {
    pos = flat_frames(f, pos);
    if (pos >= len) return 0;
    unsigned op = buf[pos];
    if (op == 'e') return pos + 1;
    if (op == 'h' || op == 'j') {
      size_t end;
      uint32_t top;
      end = skip_run(f->known, buf, len, pos, sym ? SIZE_MAX : f->memo_len, &top);
      if (sym) {
        int64_t excess = (int64_t)top - (int64_t)f->memo_len;
        if (end != pos && excess > f->excess) f->excess = excess;
      }
      /* (A reference stored again in the memo is the machine's.) */
      if (end < len && (buf[end] == 0x94 || buf[end] == 'q' || buf[end] == 'r')) return 0;
      if (end != pos) {
        pos = end;
        continue;
      }
    }
    if (!(pos = flat_item(f, pos, depth, sym))) return 0;
  }
}

/* A dict at pos (its '}'), read in the batched form (MARK ... SETITEMS):
 * its pairs go to a new dict, nowhere (pruned), or to the record reader.
 * A kept dict or a record is made once it is read, so that an attempt
 * given up allocates nothing; its memo slot is held empty (PV_UNSET) till
 * then, and a reference to it from inside itself ends the attempt. The
 * second reader (sym) leaves a record's pairs in f->pairs (pairs_count)
 * for the first, and a container under a key it cannot see marked (len 1)
 * for the first to check the key of. */
FLAT_STEP size_t flat_dict_body(flat_t *f, size_t pos, flat_mode mode, int depth, pv_t *out, const bool sym) {
  const unsigned char *buf = f->buf;
  size_t len = f->len, count = 0;
  bool record = mode == FLAT_RECORD || mode == FLAT_BLOCK;
  pv_t dict = {.kind = record ? PV_RECORD : PV_DICT, .len = mode == FLAT_BLOCK, .u.seq = &f->doc->pruned_seq};
  if (depth > 2) return 0; /* an entry, its frames, a frame: deeper is the machine's */
  size_t memo_at = f->memo_len;
  if (!(pos = flat_memo(f, pos + 1, mode == FLAT_PRUNED ? dict : (pv_t){0}, sym)) || pos >= len || buf[pos] != '(')
    return 0;
  bool stored = f->memo_len > memo_at; /* (its pairs may store more) */
  pos++;
  for (;;) {
    pos = flat_frames(f, pos);
    if (pos >= len) return 0;
    if (buf[pos] == 'u') break;
    pv_t key = flat_scalar(f, &pos, sym), value;
    if (key.kind == PV_UNSET || !pos || (pos = flat_frames(f, pos)) >= len) return 0;
    unsigned op = buf[pos];
    if (op == ']' || op == '}') {
      /* A container: only where the machine would drop its contents. */
      bool unseen_key = sym && key.kind == PV_REF;
      if (mode != FLAT_PRUNED && !unseen_key && !is_pruned_key(f->doc, &key)) return 0;
      if (sym && mode != FLAT_PRUNED) f->had_container = true;
      /* (Built here, not returned through memory: see flat_scalar.) */
      value = (pv_t){.kind = op == ']' ? PV_LIST : PV_DICT, .len = unseen_key && mode != FLAT_PRUNED,
                     .u.seq = &f->doc->pruned_seq};
      pos = op == ']' ? flat_pruned_list(f, pos, depth + 1, sym)
            : sym     ? flat_dict_sym(f, pos, FLAT_PRUNED, depth + 1)
                      : flat_dict(f, pos, FLAT_PRUNED, depth + 1, NULL);
    } else if ((value = flat_scalar(f, &pos, sym)).kind == PV_UNSET) {
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
  if (sym) {
    /* A record's slot stays empty: the first reader fills it. */
    f->pairs_count = count;
    return pos + 1;
  }
  if (record) {
    /* Last, so that a record taken is never undone. */
    const pickle_options_t *o = &f->doc->options;
    union { unsigned char bytes[PICKLE_RECORD_MAX]; max_align_t align; } prepared;
    int64_t id; /* (not &dict.u.i: dict stays in registers) */
    pickle_prepare_fn prepare = mode == FLAT_BLOCK ? o->block_prepare : o->prepare;
    pickle_take_fn take = mode == FLAT_BLOCK ? o->block_take : o->take;
    if (!prepare(o->record_ctx, f->pairs, count, prepared.bytes) || !take(o->record_ctx, prepared.bytes, &id))
      return 0;
    dict.u.i = id;
  } else if (mode == FLAT_KEEP) {
    if (!(dict.u.seq = seq_new(f->doc, false)) || !seq_add(f->doc, dict.u.seq, f->pairs, count)) return 0;
  }
  if (mode != FLAT_PRUNED && stored) f->memo[memo_at] = dict;
  if (out) *out = dict;
  return pos + 1;
}

static size_t flat_dict(flat_t *f, size_t pos, flat_mode mode, int depth, pv_t *out) {
  return flat_dict_body(f, pos, mode, depth, out, false);
}

static size_t flat_dict_sym(flat_t *f, size_t pos, flat_mode mode, int depth) {
  return flat_dict_body(f, pos, mode, depth, NULL, true);
}

/* Reads the dict at pos as flat_dict does, or leaves the memo as it was
 * and returns 0. */
static size_t flat_try(flat_t *f, size_t pos, flat_mode mode, pv_t *out) {
  size_t memo_len = f->memo_len;
  size_t end = flat_dict(f, pos, mode, 0, out);
  if (!end) flat_unstore(f, memo_len, false);
  return end;
}

/* ---- reading on two cores -----------------------------------------------
 * One core reads a snapshot no faster than its opcodes can be decoded in
 * sequence, and pickle has no lengths to skip by. So with records on and a
 * second processor, a second reader starts at a protocol-4 FRAME boundary
 * past the middle of the file (frames hold whole opcodes, and their lengths
 * chain from the start), walks opcodes to the first dict that reads as a
 * device_traces entry, and reads entries from there with the flat reader's
 * second copy, which keeps memo references as indices: it knows neither
 * the memo nor the stack before its start. For each entry it leaves, in a
 * stream, where it starts and ends, its memo stores, its references, and
 * its record prepared when every reference in its pairs is to a slot the
 * first reader has shown it (memo_shown: slots stored that will not
 * change), else its pairs as read; entries it could not prepare it tries
 * again as more is shown, until the first reader wants the stream.
 *
 * The first reader, when its own reading gets to that entry's '}' in the
 * state where it would read it as a record, checks that its memo is where
 * the second reader's count says, that every reference was stored before
 * it was read and is neither a record nor a dict being read (a pruned
 * list, where the second reader took one for it), and that a container was
 * under the pruned key, then takes the entry as flat_try would have: the
 * same memo, the same record, the same position. Everything between
 * entries (MARK, APPENDS, a device's new list) it still reads itself. The
 * first time anything does not hold, or when it catches up with the second
 * reader, the second is stopped and the first reads on alone, as without
 * it: the result is the one reader's by construction, and test_trace and
 * the fuzzer compare the two anyway.
 *
 * The memo the second reader looks at never moves or changes below what
 * was shown while it runs: before the first reader grows it, or stores
 * into a slot below its count (only an explicit BINPUT can), it stops the
 * second reader and waits for it (split_join). */

#define SPLIT_MIN_LEN ((size_t)512 << 10) /* below this a thread costs more than it saves */
#define SPLIT_SCRATCH 4096                /* memo stores and references one entry may hold */

/* An entry in the second reader's stream, followed there by its pairs or,
 * in their place, its prepared record, its memo stores, and the references
 * left to check (four to a unit). Two units (32 bytes), not three: in a
 * new process each 4 KiB of the stream is a page fault on the second
 * reader's path (an entry took about 150 bytes with a 48-byte header and
 * its own slot stored). An entry
 * that does not fit it (a dict of 65,536 values or more, a reference far
 * past the memo) ends the second reader's part: the first reads on. */
typedef struct split_entry {
  uint64_t start;        /* its '}' */
  uint32_t length;       /* to past its SETITEMS */
  int32_t excess;        /* the largest index - stores at the time, of its references (at least INT32_MIN) */
  uint32_t units;        /* its length in the stream, this header included */
  uint32_t memo_start;   /* the second reader's count of memo stores before it */
  uint16_t memo_count;   /* its stores, its own slot included when a MEMOIZE follows its '}' (not written out:
                          * that slot is empty until the first reader fills it) */
  uint16_t pair_count;   /* its pairs' values, as read */
  uint16_t check_count;
  uint8_t prepared;
  uint8_t pairs_kept;    /* its pairs take more room than a record: the payload is pair_count units */
} split_entry_t;

#define SPLIT_HEADER_UNITS (sizeof(split_entry_t) / sizeof(pv_t))
_Static_assert(sizeof(split_entry_t) == 2 * sizeof(pv_t), "an entry's header is two units");
_Static_assert(SPLIT_SCRATCH <= UINT16_MAX, "memo_count and check_count hold the stores and checks");

struct split {
  pickle_doc_t *doc;
  size_t at;                  /* where the second reader starts (it finds it when not given) */
  pv_t *stream;               /* its entries, one after another (allocated on its thread) */
  size_t cap;                 /* units */
  size_t record_units;        /* of a prepared record */
  const pv_t *memo;           /* the first reader's memo ... */
  helper_job_t job;           /* split_main on a kept thread (helpers.c) */
  bool patient;               /* started where asked (tests): wait for it rather than read on alone */
  /* ... stored and final below this. Each reader writes one of these two,
   * and each has a cache line of its own, so that the other's reads do
   * not take it away from the writer on every write. */
  alignas(64) _Atomic size_t memo_shown;
  alignas(64) _Atomic size_t published; /* units of whole entries in the stream */
  /* What the second reads at every step and the first writes once: a
   * line of their own too (beside the first's counters below, every entry
   * merged took the line from the second, and its next step took it back). */
  alignas(64) atomic_bool wanted; /* the first reader is at the split: publish */
  atomic_bool done, stop;
  /* The first reader's: */
  alignas(64) size_t shown_next; /* when to show more, */
  size_t next;                   /* the position of the next '}' to ask about (SIZE_MAX: none), */
  size_t seen;                   /* published, as last read (read again when taken catches up) */
  bool running;                  /* submitted, not waited for */
  size_t taken;                  /* units merged */
  size_t base;                   /* its memo index of the second reader's count 0, once one is merged */
  bool merging;
  size_t merged;                 /* entries */
};

/* Units of an entry's pairs, or of its record in their place. */
static inline size_t entry_payload(const split_t *s, const split_entry_t *e) {
  return e->pairs_kept ? e->pair_count : s->record_units;
}

/* Whether an entry has its own memo slot (a MEMOIZE right after its '}'),
 * which the stream does not hold: its stores there are the others. */
static inline size_t entry_own_slot(const split_t *s, const split_entry_t *e) {
  return s->doc->buf[e->start + 1] == 0x94;
}

/* The arguments of an opcode the reader knows: `fixed` bytes, or a length
 * of `counted` bytes (little-endian) and that many bytes. false for any
 * other opcode. */
static bool opcode_shape(unsigned op, size_t *fixed, size_t *counted) {
  *fixed = *counted = 0;
  switch (op) {
    case 0x94: case '(': case '}': case ']': case ')': case 'u': case 'e': case 's': case 'a':
    case 'N': case 0x88: case 0x89: case 0x85: case 0x86: case 0x87: case 't': case '.':
      return true;
    case 0x80: case 'h': case 'q': case 'K':
      *fixed = 1;
      return true;
    case 'M':
      *fixed = 2;
      return true;
    case 'j': case 'r': case 'J':
      *fixed = 4;
      return true;
    case 0x95: case 'G':
      *fixed = 8;
      return true;
    case 0x8c: case 'C': case 0x8a:
      *counted = 1;
      return true;
    case 'X': case 'B': case 0x8b:
      *counted = 4;
      return true;
    case 0x8d: case 0x8e:
      *counted = 8;
      return true;
    default:
      return false;
  }
}

/* Where the opcode at pos (< len) ends, arguments included; 0 when it is
 * not one the reader knows, or is cut short. */
static size_t opcode_end(const unsigned char *buf, size_t len, size_t pos) {
  size_t n, width;
  if (!opcode_shape(buf[pos], &n, &width)) return 0;
  if (width) {
    if (len - pos - 1 < width) return 0;
    uint64_t size = read_le(buf + pos + 1, width);
    if (size > len - pos - 1 - width) return 0;
    return pos + 1 + width + (size_t)size;
  }
  return len - pos - 1 >= n ? pos + 1 + n : 0;
}

/* The parser's refusal of an opcode it does not read (set as the error). */
static void refuse_opcode(unsigned op, size_t at) {
  if (op == 'c' || op == 0x93 || op == 'R' || op == 'b' || op == 0x81 || op == 0x92 || op == 'i' || op == 'o')
    gca__set_error(GCA_ERR_INVALID, "pickle: opcode 0x%02x at offset %zu asks to build a Python object; only plain "
                   "data (dict, list, str, int, float) is read", op, at);
  else
    gca__set_error(GCA_ERR_INVALID, "pickle: unsupported opcode 0x%02x at offset %zu", op, at);
}

bool pickle_scan(pickle_scan_t *scan, const unsigned char *buf, size_t len) {
  size_t pos = scan->at;
  while (!scan->stopped && pos < len) {
    unsigned op = buf[pos];
    size_t n, width;
    if (!opcode_shape(op, &n, &width)) {
      refuse_opcode(op, pos);
      return false;
    }
    if (len - pos - 1 < n + width) break; /* (cut short: more may come) */
    if (op == 0x80 && (buf[pos + 1] < 2 || buf[pos + 1] > 5)) {
      gca__set_error(GCA_ERR_INVALID, "pickle: protocol %d is not supported (2 to 5 are)", buf[pos + 1]);
      return false;
    }
    if (width) {
      uint64_t size = read_le(buf + pos + 1, width);
      if ((op == 0x8a || op == 0x8b) && size > 8) {
        gca__set_error(GCA_ERR_INVALID, "pickle: integer of %llu bytes at offset %zu does not fit in 64 bits",
                       (unsigned long long)size, pos);
        return false;
      }
      if (size > UINT32_MAX) {
        gca__set_error(GCA_ERR_INVALID, "pickle: string of %llu bytes at offset %zu is too long",
                       (unsigned long long)size, pos);
        return false;
      }
      if (size > len - pos - 1 - width) break;
      n = width + (size_t)size;
    }
    scan->stopped = op == '.';
    pos += 1 + n;
  }
  scan->at = pos;
  return true;
}

/* A check on a reference that must name a pruned list, empty (flag set),
 * not only a slot flat_scalar would take. */
#define SPLIT_PRUNED_LIST 0x80000000u

/* Whether the memo slots an entry's references name that are below
 * `shown` hold what flat_scalar would take there: not a record, not a dict
 * being read; and for one flagged SPLIT_PRUNED_LIST, a pruned list (which
 * is empty: one is as good as another, pickle.h). */
static bool checks_hold(const pv_t *memo, size_t shown, const uint32_t *checks, size_t count) {
  for (size_t i = 0; i < count; i++) {
    uint32_t index = checks[i] & ~SPLIT_PRUNED_LIST;
    if (index >= shown) continue;
    const pv_t *v = &memo[index];
    if (checks[i] & SPLIT_PRUNED_LIST ? v->kind != PV_LIST || !v->u.seq->pruned
                                      : v->kind == PV_UNSET || v->kind == PV_RECORD)
      return false;
  }
  return true;
}

/* An entry's pairs as the second reader read them, into `resolved` as
 * flat_dict would have given them to `prepare`: references looked up in
 * `memo` below `shown`. A reference to a slot not shown yet under the
 * pruned key (a free_completed entry names the list of the entry it frees)
 * is taken to be a pruned list, given as the flat reader's (pickle.h: any
 * empty pruned container stands for another of its kind), and its check
 * in checks[0 .. check_count) is flagged so that the first reader makes
 * sure of it. Returns 0; or the memo count another reference
 * needs shown; or SIZE_MAX when flat_dict would not have made it a record
 * (a container under another key). */
static size_t resolve_pairs(const pickle_doc_t *doc, const pv_t *memo, size_t shown, const pv_t *pairs, size_t count,
                            pv_t *resolved, uint32_t *checks, size_t check_count) {
  size_t need = 0;
  for (size_t i = 0; i < count; i++) {
    pv_t v = pairs[i];
    if ((v.kind == PV_LIST || v.kind == PV_DICT) && v.len) {
      /* A container under a key the second reader could not see: it must
       * be the pruned one. */
      if (!(i & 1)) return SIZE_MAX;
      if (resolved[i - 1].kind != PV_REF) {
        if (!is_pruned_key(doc, &resolved[i - 1])) return SIZE_MAX;
        v.len = 0;
      }
    } else if (v.kind == PV_REF) {
      size_t index = (size_t)v.u.i;
      if (index < shown) {
        v = memo[index]; /* (checked among the checks) */
      } else if (i & 1 && resolved[i - 1].kind != PV_REF && is_pruned_key(doc, &resolved[i - 1]) &&
                 index < SPLIT_PRUNED_LIST) {
        size_t c = 0;
        while (c < check_count && checks[c] != index) c++;
        if (c == check_count) return SIZE_MAX; /* (every value's reference is there) */
        checks[c] |= SPLIT_PRUNED_LIST;
        v = (pv_t){.kind = PV_LIST, .u.seq = (pv_seq_t *)&doc->pruned_seq};
      } else {
        need = index + 1 > need ? index + 1 : need;
      }
    }
    resolved[i] = v;
  }
  return need;
}

/* An entry's record prepared into `out` from its pairs, their references
 * looked up in the first reader's memo below `shown`, and the checks it
 * could make dropped from checks[0 .. *check_count). Returns 0 when it
 * was; else the memo count shown that it waits for (SIZE_MAX: none will
 * do, the first reader is to read it), and `out` may hold part of a record
 * that declined: never the pairs' own room. */
static size_t split_prepare(split_t *s, size_t shown, const pv_t *pairs, size_t count, uint32_t *checks,
                            size_t *check_count, pv_t *resolved, void *out) {
  /* (Flags are this attempt's: one that failed leaves none, so that the
   * first reader, reading the pairs itself, checks them plainly.) */
  for (size_t i = 0; i < *check_count; i++) checks[i] &= ~SPLIT_PRUNED_LIST;
  if (!checks_hold(s->memo, shown, checks, *check_count)) return SIZE_MAX;
  size_t need = resolve_pairs(s->doc, s->memo, shown, pairs, count, resolved, checks, *check_count);
  const pickle_options_t *o = &s->doc->options;
  if (!need && !o->prepare(o->record_ctx, resolved, count, out)) need = SIZE_MAX;
  if (need) {
    for (size_t i = 0; i < *check_count; i++) checks[i] &= ~SPLIT_PRUNED_LIST;
    return need;
  }
  size_t kept = 0;
  for (size_t i = 0; i < *check_count; i++)
    if ((checks[i] & ~SPLIT_PRUNED_LIST) >= shown) checks[kept++] = checks[i];
  *check_count = kept;
  return 0;
}

/* The second reader's entries not prepared yet, none published: where
 * they are in the stream, and the memo count shown each waits for. */
typedef struct split_pending {
  struct {
    size_t at, need;
  } *entries;
  size_t count, cap;
  size_t need; /* the least of theirs */
} split_pending_t;

/* Prepares in place the pending entries that what is shown now allows. */
static void split_retry(split_t *s, split_pending_t *p, size_t shown, pv_t *resolved) {
  size_t kept = 0;
  p->need = SIZE_MAX;
  for (size_t i = 0; i < p->count; i++) {
    pv_t *at = s->stream + p->entries[i].at;
    if (p->entries[i].need <= shown) {
      split_entry_t e;
      memcpy(&e, at, sizeof e);
      pv_t *payload = at + SPLIT_HEADER_UNITS;
      uint32_t *checks = (uint32_t *)(payload + entry_payload(s, &e) + e.memo_count - entry_own_slot(s, &e));
      size_t check_count = e.check_count;
      /* Prepared apart, and put where its pairs were only once it is: a
       * record that declines may have written part of itself, and the
       * pairs must stay as read for the first reader. */
      union { unsigned char bytes[PICKLE_RECORD_MAX]; max_align_t align; } ready;
      size_t need = split_prepare(s, shown, payload, e.pair_count, checks, &check_count, resolved, ready.bytes);
      if (!need) { /* the record now stands where its pairs were */
        memcpy(payload, ready.bytes, s->doc->options.record_size);
        e.prepared = 1;
        e.check_count = (uint16_t)check_count;
        memcpy(at, &e, sizeof e);
        continue;
      }
      if (need == SIZE_MAX) continue; /* (stays as read) */
      p->entries[i].need = need;
    }
    p->need = p->entries[i].need < p->need ? p->entries[i].need : p->need;
    p->entries[kept++] = p->entries[i];
  }
  p->count = kept;
}

/* The second reader: reads entries into the stream, and publishes them
 * once the first reader wants them (till then it may still prepare them
 * in place, as the first reader shows more of its memo). */
/* The least offset the second reader may start at on its own: 62% of the
 * file. It does more per byte (it prepares and writes out each entry, the
 * first merges it), 1.5-1.8 times as much on these snapshots, and the
 * first catches up with it before the end from anywhere under 60%. On
 * real snapshots (load and replay, best of 400, builds alternating), 61-64%
 * is 4-7% faster than 55% for most, 5% slower for one whose later entries
 * are smaller (still 7.5 M events/s); 67% is slower on all. */
static size_t split_least(size_t len) { return len / 50 * 31; }

/* The second reader's start when it was not given: the first FRAME that
 * starts at split_least or past it (frames hold whole opcodes, and their
 * lengths chain from the start in about 20 hops); 0 if the file is not
 * framed so. */
static size_t split_find(const unsigned char *buf, size_t len) {
  size_t at = 2;
  while (at < split_least(len)) {
    if (len - at < 9 || buf[at] != 0x95) return 0;
    uint64_t frame = read_le(buf + at + 1, 8);
    if (frame > len - at - 9) return 0;
    at += 9 + (size_t)frame;
  }
  return at < len ? at : 0;
}

static void split_main(void *arg) {
  split_t *s = arg;
  if (!s->at) s->at = split_find(s->doc->buf, s->doc->len);
  /* Units: 2.7 bytes per byte of input (small entries take 1.8),
   * and 64 KiB at least (a tiny test file's take up to 6). When it is
   * full, the second reader stops and the first reads the rest. */
  s->cap = (s->doc->len - s->at) / 6 > 4096 ? (s->doc->len - s->at) / 6 : 4096;
  /* Its stream is allocated here, not before the thread starts: the first
   * reader would wait for it (0.08 ms when the mapping is new). The first
   * reads it only once something is published; without it, nothing is. */
  if (!s->at || !(s->stream = gca__big_alloc(s->cap * sizeof *s->stream))) {
    atomic_store_explicit(&s->done, true, memory_order_release);
    return;
  }
  pv_t memo[SPLIT_SCRATCH], *resolved = NULL;
  uint32_t checks[SPLIT_SCRATCH];
  known_runs_t known = {0};
  flat_t f = {.buf = s->doc->buf, .len = s->doc->len, .memo = memo, .memo_cap = SPLIT_SCRATCH, .doc = s->doc,
              .checks = checks, .checks_cap = SPLIT_SCRATCH, .known = &known};
  split_pending_t pending = {.need = SIZE_MAX};
  size_t pos = s->at, used = 0, resolved_cap = 0;
  bool synced = false;  /* an entry was read: from here on, only entries and what lies between them */
  bool reading = true;  /* till the end of what it can read */
  bool published = false;
  while (!atomic_load_explicit(&s->stop, memory_order_relaxed)) {
    if (!published && atomic_load_explicit(&s->wanted, memory_order_acquire)) {
      /* Not at an entry yet when the first reader gets here: it is of no
       * use (unless a test asked for it to read on). */
      if (!synced && !s->patient) break;
      published = true;
      pending.count = 0;
      atomic_store_explicit(&s->published, used, memory_order_release);
    }
    size_t shown = atomic_load_explicit(&s->memo_shown, memory_order_acquire);
    if (!published && shown >= pending.need) split_retry(s, &pending, shown, resolved);
    if (!reading) {
      if (published) break;
      gca__spin_pause(); /* waiting for the first reader to show more, or to want them */
      continue;
    }
    if ((pos = flat_frames(&f, pos)) >= f.len) {
      reading = false;
      continue;
    }
    unsigned op = f.buf[pos];
    if (op == '}') {
      f.memo_base = f.memo_len;
      f.excess = INT64_MIN;
      f.checks_len = 0;
      f.had_container = false;
      f.pairs_count = 0;
      size_t end = flat_dict_sym(&f, pos, FLAT_RECORD, 0);
      /* The first is taken for an entry when it holds a container (its
       * frames) or four pairs or more: a frame (filename, line, name), the
       * dict most likely where it starts, has neither. A wrong guess only
       * costs time: the first reader never meets it where it looks. */
      if (end && (synced || f.had_container || f.pairs_count >= 8)) {
        if (f.pairs_count > resolved_cap) {
          free(resolved);
          resolved_cap = f.pairs_count * 2;
          if (!(resolved = malloc(resolved_cap * sizeof *resolved))) {
            resolved_cap = 0;
            reading = false;
            continue;
          }
        }
        /* Prepared now, the record takes its own room; else the pairs',
         * where the record can be put later. */
        union { unsigned char bytes[PICKLE_RECORD_MAX]; max_align_t align; } ready;
        size_t need = split_prepare(s, shown, f.pairs, f.pairs_count, checks, &f.checks_len, resolved, ready.bytes);
        split_entry_t e = {.start = pos, .length = (uint32_t)(end - pos), .memo_start = (uint32_t)f.memo_base,
                           .excess = f.excess < INT32_MIN ? INT32_MIN : (int32_t)f.excess,
                           .memo_count = (uint16_t)(f.memo_len - f.memo_base), .pair_count = (uint16_t)f.pairs_count,
                           .check_count = (uint16_t)f.checks_len, .prepared = !need,
                           .pairs_kept = need && f.pairs_count > s->record_units};
        size_t payload_units = entry_payload(s, &e), own = entry_own_slot(s, &e);
        size_t units = SPLIT_HEADER_UNITS + payload_units + e.memo_count - own + (e.check_count + 3u) / 4;
        e.units = (uint32_t)units; /* (kept when it is prepared later, with fewer checks) */
        if (units > s->cap - used || f.memo_len > UINT32_MAX || end - pos > UINT32_MAX || f.excess > INT32_MAX ||
            f.pairs_count > UINT16_MAX) { /* full, or it does not fit: the first reader reads the rest */
          reading = false;
          continue;
        }
        pv_t *out = s->stream + used, *payload = out + SPLIT_HEADER_UNITS;
        memcpy(out, &e, sizeof e);
        if (need) memcpy(payload, f.pairs, e.pair_count * sizeof *payload);
        else memcpy(payload, ready.bytes, s->doc->options.record_size);
        memcpy(payload + payload_units, memo + own, (e.memo_count - own) * sizeof *payload);
        memcpy(payload + payload_units + e.memo_count - own, checks, e.check_count * sizeof *checks);
        if (published) {
          atomic_store_explicit(&s->published, used + units, memory_order_release);
        } else if (need && need != SIZE_MAX) {
          if (pending.count == pending.cap) {
            size_t cap = pending.cap ? 2 * pending.cap : 256;
            void *grown = realloc(pending.entries, cap * sizeof *pending.entries);
            if (!grown) {
              reading = false;
              continue;
            }
            pending.entries = grown;
            pending.cap = cap;
          }
          pending.entries[pending.count].at = used;
          pending.entries[pending.count++].need = need;
          pending.need = need < pending.need ? need : pending.need;
        }
        used += units;
        synced = true;
        pos = end;
        continue;
      }
      if (synced) {
        reading = false;
        continue;
      }
      f.memo_len = f.memo_base; /* not an entry: walk on into it */
      pos++;
      continue;
    }
    if (synced) {
      if (op == '(' || op == 'e') {
        pos++;
      } else if (op == ']' && f.len - pos >= 2 && f.buf[pos + 1] == 0x94) { /* the next device's list */
        f.memo_len++;
        pos += 2;
      } else {
        reading = false;
      }
      continue;
    }
    if (!(pos = opcode_end(f.buf, f.len, pos))) reading = false;
  }
  free(f.pairs);
  free(resolved);
  free(pending.entries);
  atomic_store_explicit(&s->done, true, memory_order_release);
}

static bool two_processors(void) { return gca__processors_usable() >= 2; }

/* Starts the second reader when it is worth it (pickle_options.split),
 * looking at `memo` (which the first reader shows it through memo_shown);
 * NULL when it does not. It lives on the heap, not in parse's frame: its
 * cache-line alignment there would cost the machine's loop its registers. */
static split_t *split_start(pickle_doc_t *doc, const pv_t *memo) {
  const unsigned char *buf = doc->buf;
  size_t len = doc->len, at = doc->options.split;
  if (!doc->options.take || doc->options.machine_only || at == PICKLE_ONE_READER) return NULL;
  if (!at && (len < SPLIT_MIN_LEN || buf[0] != 0x80 || buf[2] != 0x95 || !two_processors())) return NULL;
  if (at >= len) return NULL;
  split_t *s = aligned_alloc(alignof(split_t), sizeof *s);
  if (!s) return NULL;
  memset(s, 0, sizeof *s);
  s->doc = doc;
  s->patient = doc->options.split != 0;
  /* Where the second reader starts is found on its thread (split_find):
   * the walk there touches a page every 64 KiB, and faulting them in
   * delayed the first reader by 0.05-0.1 ms. The first asks about no
   * entry before the least it can be. */
  s->at = at;
  s->next = at ? at : split_least(len);
  s->memo = memo;
  s->record_units = (doc->options.record_size + sizeof(pv_t) - 1) / sizeof(pv_t);
  atomic_init(&s->memo_shown, 0);
  atomic_init(&s->published, 0);
  atomic_init(&s->wanted, false);
  atomic_init(&s->done, false);
  atomic_init(&s->stop, false);
  s->job = (helper_job_t){.run = split_main, .arg = s};
  if (!gca__helper_submit(&s->job)) {
    free(s);
    return NULL;
  }
  s->running = true;
  return s;
}

/* Stops the second reader and waits for it: it looks at nothing after.
 * What it published stays. */
static void split_join(split_t *s) {
  if (!s || !s->running) return;
  atomic_store_explicit(&s->stop, true, memory_order_relaxed);
  /* Taken back if it never started: then nothing was published, and it is
   * done as a stopped one would be. */
  if (!gca__helper_wait(&s->job)) atomic_store_explicit(&s->done, true, memory_order_release);
  s->running = false;
}

static void split_finish(split_t *s) {
  if (!s) return;
  split_join(s);
  s->doc->split_taken += s->merged;
  gca__big_free(s->stream, s->cap * sizeof *s->stream);
  free(s);
}

/* The dict at `at`, which the first reader would read with flat_try in
 * `mode`, taken from the second reader's stream when it read it: returns
 * its end as flat_try would, or 0 to read it here. Sets s->next. */
#if defined(__GNUC__)
__attribute__((noinline)) /* (kept out of the machine's loop) */
#endif
static size_t split_take(split_t *s, flat_t *f, size_t at, flat_mode mode, pv_t *out) {
  /* (published is read again only when what was seen is merged: each read
   * after the second reader's store takes its cache line.) */
  size_t published = s->seen;
  if (s->taken == published) published = s->seen = atomic_load_explicit(&s->published, memory_order_acquire);
  if (s->taken == published && s->merging && !s->patient) {
    /* Caught up with it: reading on alone is faster than waiting for it
     * (it prepares and writes out each entry, the first only reads). What
     * it publishes while it stops is still taken. (Where a test started
     * it, the first waits, so that what the second reads does not depend
     * on the timing.) */
    split_join(s);
    published = s->seen = atomic_load_explicit(&s->published, memory_order_acquire);
    if (s->taken == published) goto abandon;
  }
  if (s->taken == published) {
    /* At the split: all of the memo so far is final. */
    atomic_store_explicit(&s->memo_shown, f->memo_len, memory_order_release);
    atomic_store_explicit(&s->wanted, true, memory_order_release);
  }
  while (s->taken == published) {
    /* Behind: wait while it reads on (it is on the other processor). */
    if (atomic_load_explicit(&s->done, memory_order_acquire)) {
      published = s->seen = atomic_load_explicit(&s->published, memory_order_acquire);
      if (s->taken == published) goto abandon;
      break;
    }
    gca__spin_pause();
    published = s->seen = atomic_load_explicit(&s->published, memory_order_acquire);
  }
  split_entry_t e;
  memcpy(&e, s->stream + s->taken, sizeof e);
  if (at < e.start) { /* not there yet */
    s->next = e.start;
    return 0;
  }
  if (at > e.start || mode != FLAT_RECORD) goto abandon;
  size_t memo_len = f->memo_len;
  if (!s->merging) {
    if (memo_len < e.memo_start) goto abandon;
    s->base = memo_len - e.memo_start;
    s->merging = true;
  } else if (memo_len != s->base + e.memo_start) {
    goto abandon;
  }
  /* Each reference to an index stored before it: index < base + count.
   * (The memo count above cannot differ while both read the same bytes;
   * it guards the base this relies on.) */
  if (e.excess >= (int64_t)s->base) goto abandon;
  const pv_t *payload = s->stream + s->taken + SPLIT_HEADER_UNITS;
  const pv_t *stores = payload + entry_payload(s, &e);
  size_t own = entry_own_slot(s, &e);
  const uint32_t *checks = (const uint32_t *)(stores + e.memo_count - own);
  if (e.memo_count) {
    size_t last = memo_len + e.memo_count - 1;
    if (last >= f->memo_cap) {
      split_join(s); /* it must not look at a memo that moves */
      if (!memo_grow(f->doc, &f->memo, &f->memo_cap, last)) goto abandon;
    }
    if (own) f->memo[memo_len] = (pv_t){0}; /* empty while the record is not taken, as flat_dict holds it */
    memcpy(f->memo + memo_len + own, stores, (e.memo_count - own) * sizeof *stores);
    f->memo_len = memo_len + e.memo_count;
  }
  if (!checks_hold(f->memo, f->memo_len, checks, e.check_count)) goto undo;
  const pickle_options_t *o = &f->doc->options;
  const void *prepared = payload;
  union { unsigned char bytes[PICKLE_RECORD_MAX]; max_align_t align; } here;
  if (!e.prepared) {
    if (e.pair_count > f->pairs_cap) {
      pv_t *grown = realloc(f->pairs, e.pair_count * sizeof *grown);
      if (!grown) goto undo;
      f->pairs = grown;
      f->pairs_cap = e.pair_count;
    }
    if (resolve_pairs(f->doc, f->memo, f->memo_len, payload, e.pair_count, f->pairs, NULL, 0) ||
        !o->prepare(o->record_ctx, f->pairs, e.pair_count, here.bytes))
      goto undo;
    prepared = here.bytes;
  }
  int64_t id;
  if (!o->take(o->record_ctx, prepared, &id)) goto undo;
  pv_t dict = {.kind = PV_RECORD, .u.i = id};
  if (f->buf[at + 1] == 0x94) f->memo[memo_len] = dict; /* its own slot */
  s->merged++;
  *out = dict;
  size_t end = e.start + e.length;
  s->taken += e.units;
  if (s->taken < published) {
    memcpy(&e, s->stream + s->taken, sizeof e);
    s->next = e.start;
  } else {
    s->next = end;
  }
  return end;
undo:
  flat_unstore(f, memo_len, false);
abandon:
  split_join(s);
  s->next = SIZE_MAX;
  return 0;
}

#define FAIL(...) do { gca__set_error(GCA_ERR_INVALID, __VA_ARGS__); goto failed; } while (0)
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
    void *grown = grown_cap <= doc->array_limit / sizeof *(array)   \
                      ? realloc((array), grown_cap * sizeof *(array)) \
                      : NULL;                                       \
    if (!grown) {                                                   \
      doc->over_limit = grown_cap > doc->array_limit / sizeof *(array); \
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
   * 4 MiB chunk (the fuzzer parses thousands a second); a big one's are big
   * arrays (util.c). */
  size_t chunk = len * 4 < ((size_t)64 << 10) ? (size_t)64 << 10 : len * 4 > ARENA_CHUNK ? ARENA_CHUNK : len * 4;
  size_t arena_limit = len * GCA_PICKLE_BYTES_PER_INPUT_BYTE + 2 * ARENA_CHUNK;
  doc->array_limit = SIZE_MAX;
  doc->over_limit = false;
  if (doc->options.memory_limit) { /* half for containers, a sixteenth for each array */
    if (arena_limit > doc->options.memory_limit / 2) arena_limit = doc->options.memory_limit / 2;
    doc->array_limit = doc->options.memory_limit / 16;
  }
  doc->arena = (arena_t){.chunk = chunk, .limit = arena_limit};
  if (chunk >= BIG_PAGE) {
    /* An arena filled at once: its chunks are big arrays, whose mappings
     * are kept and handed to the next parse (a tuning loop, the
     * benchmark), already faulted in. */
    doc->arena.chunk_alloc = gca__big_alloc;
    doc->arena.chunk_free = gca__big_free;
    doc->arena.chunk_round = BIG_PAGE;
  }
  /* The machine's state, in locals so that it stays in registers. */
  pv_t *stack = NULL;
  size_t depth = 0, stack_cap = 0, memo_len = 0;
  /* A snapshot stores about one memo entry per 30 bytes: sized for that
   * at once, the memo is not copied as it grows. */
  size_t memo_cap = len / 32 > 64 ? len / 32 : 64;
  /* The second reader stops when the memo it looks at has to grow (it
   * would move): forced on a small file (tests), the memo is sized for
   * the most a file can store, so that it never does. */
  if (doc->options.split && doc->options.split != PICKLE_ONE_READER && len < SPLIT_MIN_LEN) memo_cap = len + 1;
  /* Not zeroed: slots from memo_len up are never read (a get checks the
   * index against memo_len, and a store past it marks the hole below), and
   * zeroing the megabyte was 20-50 us on the first reader's path before it
   * read a byte. */
  pv_t *memo = gca__big_alloc(memo_cap * sizeof *memo);
  if (!memo) {
    gca__set_error(GCA_ERR_NOMEM, "pickle: out of host memory");
    pickle_free(doc);
    return NULL;
  }
  bool memo_dense = true; /* every index below memo_len is stored */
  size_t *marks = NULL, mark_count = 0, mark_cap = 0;
  size_t pos = 0, at = 0, run_read_to = 0;
  /* The second reader, when there is one: the '}' at split->next or past
   * it is asked about. */
  doc->split_taken = 0; /* (a second reading counts afresh) */
  doc->progress_at = doc->options.progress ? 0 : SIZE_MAX;
  split_t *split = split_start(doc, memo);
  known_runs_t known = {0};
  flat_t flat = {.buf = buf, .len = len, .doc = doc, .split = split, .known = &known};
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
        if (base >= memo_len || memo[base].kind == PV_UNSET)
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
        /* A pickler numbers the memo from 0, one entry per store of at
         * least a byte, so an index past the bytes read so far can only be
         * an attack on memory (16 bytes a slot): refused at once. */
        if (base > at)
          FAIL("pickle: memo index %zu at offset %zu is larger than the stores that can come before it", base, at);
        /* (The second reader looks at the memo below memo_len: it must see
         * it neither move nor change.) */
        if (unlikely(split != NULL) && (base < memo_len || base >= memo_cap)) split_join(split);
        if (base >= memo_cap && !memo_grow(doc, &memo, &memo_cap, base)) {
          fail_memory(doc, at);
          goto failed;
        }
        if (base > memo_len) { /* a hole below it */
          memo_dense = false;
          for (size_t i = memo_len; i < base; i++) memo[i].kind = PV_UNSET;
        }
        memo[base] = stack[depth - 1];
        if (base >= memo_len) memo_len = base + 1;
        continue;
      case '(': /* MARK */
        if (mark_count == mark_cap) GROW(marks, mark_cap, mark_count + 1);
        marks[mark_count++] = depth;
        continue;
      case '}': /* EMPTY_DICT */
        if (unlikely(at >= doc->progress_at)) report_progress(doc, at);
        if (memo_dense && !doc->options.machine_only) {
          flat_mode mode = prune_new(doc, stack, depth, marks, mark_count)                                ? FLAT_PRUNED
                           : doc->options.take && inside_role(stack, depth, marks, mark_count, 2)       ? FLAT_RECORD
                           : doc->options.block_take && inside_role(stack, depth, marks, mark_count, 3) ? FLAT_BLOCK
                                                                                                          : FLAT_KEEP;
          flat.memo = memo;
          flat.memo_len = memo_len;
          flat.memo_cap = memo_cap;
          size_t end = 0;
          if (unlikely(split != NULL)) {
            if (memo_len >= split->shown_next && split->running) {
              atomic_store_explicit(&split->memo_shown, memo_len, memory_order_release);
              split->shown_next = memo_len + 256;
            }
            if (at >= split->next) end = split_take(split, &flat, at, mode, &v);
          }
          if (!end) end = flat_try(&flat, at, mode, &v);
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
          if (unlikely(doc->records_len | doc->blocks_len) &&
              records_misplaced(container, dict_op, stack + base, depth - base))
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
        if (unlikely(doc->records_len | doc->blocks_len) && n && holds_record(stack + depth - n, n))
          goto records_escaped;
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
        split_finish(split);
        free(flat.pairs);
        free(stack);
        free(marks);
        gca__big_free(memo, memo_cap * sizeof *memo);
        return doc;
      default:
        refuse_opcode(op, at);
        goto failed;
    }
  }
failed:
  split_finish(split);
  free(flat.pairs);
  free(stack);
  free(marks);
  gca__big_free(memo, memo_cap * sizeof *memo);
  pickle_free(doc);
  return NULL;
records_escaped:
  /* A record was referenced again, or put somewhere other than its list:
   * where the caller would find a dict, it would find a record. Read the
   * file again without records (once: none are made then), so that the
   * tree, and every error, is the dicts' one. The records already handed
   * over are not in that tree, so the caller ignores them. */
  split_finish(split);
  free(flat.pairs);
  free(stack);
  free(marks);
  gca__big_free(memo, memo_cap * sizeof *memo);
  gca__arena_free(&doc->arena);
  doc->options.take = doc->options.block_take = NULL;
  doc->records_len = doc->blocks_len = 0;
  return parse(doc);
}

/* A document for buf (taken over: munmap'd or freed with the document). */
static pickle_doc_t *new_doc(unsigned char *buf, size_t len, bool mapped, const pickle_options_t *options) {
  pickle_doc_t *doc = calloc(1, sizeof *doc);
  if (!doc) {
    if (mapped) munmap(buf, len);
    else free(buf);
    gca__set_error(GCA_ERR_NOMEM, "pickle: out of host memory");
    return NULL;
  }
  doc->buf = buf;
  doc->len = len;
  doc->mapped = mapped;
  if (options) doc->options = *options;
  if (!doc->options.take || !doc->options.prepare || doc->options.record_size > PICKLE_RECORD_MAX)
    doc->options.take = NULL;
  if (!doc->options.take) doc->options.records_key = NULL;
  if (!doc->options.block_take || !doc->options.block_prepare || doc->options.block_size > PICKLE_RECORD_MAX)
    doc->options.block_take = NULL;
  if (!doc->options.block_take) doc->options.block_key = NULL;
  doc->pruned_len = doc->options.pruned_key ? strlen(doc->options.pruned_key) : 0;
  doc->records_len = doc->options.records_key ? strlen(doc->options.records_key) : 0;
  doc->blocks_len = doc->options.block_key ? strlen(doc->options.block_key) : 0;
  doc->pruned_seq.pruned = true;
  return doc;
}

pickle_doc_t *pickle_parse(const void *data, size_t len, const pickle_options_t *options) {
  unsigned char *buf = malloc(len ? len : 1);
  if (!buf) {
    gca__set_error(GCA_ERR_NOMEM, "pickle: out of host memory");
    return NULL;
  }
  memcpy(buf, data, len);
  return pickle_parse_owned(buf, len, options);
}

pickle_doc_t *pickle_parse_owned(unsigned char *buf, size_t len, const pickle_options_t *options) {
  pickle_doc_t *doc = new_doc(buf, len, false, options);
  return doc ? parse(doc) : NULL;
}

pickle_doc_t *pickle_load(const char *path, const pickle_options_t *options) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    gca__set_error(GCA_ERR_IO, "cannot open %s", path); /* callers add nothing: the path is named */
    return NULL;
  }
  /* A regular file is read whole into memory of ours, not mapped: a
   * snapshot being rewritten by a running job may shrink while it is read,
   * and a mapping would then kill the process with SIGBUS. */
  struct stat st;
  if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
    size_t size = (size_t)st.st_size, got = 0;
    unsigned char *buf = malloc(size + 1);
    if (!buf) {
      fclose(f);
      gca__set_error(GCA_ERR_NOMEM, "pickle: out of host memory for %s (%zu bytes)", path, size);
      return NULL;
    }
    int err = 0;
    while (got < size) {
      ssize_t n = pread(fileno(f), buf + got, size - got, (off_t)got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) err = errno;
      if (n <= 0) break;
      got += (size_t)n;
    }
    fclose(f);
    if (got < size) {
      free(buf);
      if (err)
        gca__set_error(GCA_ERR_IO, "cannot read %s: %s", path, strerror(err));
      else
        gca__set_error(GCA_ERR_IO, "%s shrank while it was read (%zu bytes when opened, %zu there to read): "
                       "was it being rewritten?", path, size, got);
      return NULL;
    }
    pickle_doc_t *doc = new_doc(buf, size, false, options);
    return doc ? parse(doc) : NULL;
  }
  /* A pipe, or a file that cannot be mapped: read it. */
  size_t len = 0;
  unsigned char *buf = gca__read_stream(f, path, &len);
  fclose(f);
  if (!buf) return NULL;
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
  return list && list->kind == PV_LIST && !list->u.seq->record_range && index < list->u.seq->count
             ? &list->u.seq->items[index]
             : NULL;
}

size_t pv_records(const pv_t *list, int64_t *first) {
  if (!list || list->kind != PV_LIST || !list->u.seq->record_range) return 0;
  *first = list->u.seq->record_base;
  return list->u.seq->count;
}

const pv_t *pv_item(const pv_t *list, size_t index, pv_t *scratch) {
  int64_t first;
  size_t held = pv_records(list, &first);
  if (!held) return pv_at(list, index);
  if (index >= held) return NULL;
  *scratch = (pv_t){.kind = PV_RECORD, .len = record_kind(list->u.seq->role), .u.i = first + (int64_t)index};
  return scratch;
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
      if (a->u.seq->count != b->u.seq->count || a->u.seq->pruned != b->u.seq->pruned ||
          a->u.seq->record_range != b->u.seq->record_range)
        return false;
      if (a->u.seq->record_range)
        return a->u.seq->record_base == b->u.seq->record_base &&
               record_kind(a->u.seq->role) == record_kind(b->u.seq->role);
      for (size_t i = 0; i < a->u.seq->count; i++)
        if (!pv_equal(&a->u.seq->items[i], &b->u.seq->items[i], depth + 1, budget)) return false;
      return true;
    case PV_NONE:
      return true;
    case PV_RECORD:
      return a->len == b->len && a->u.i == b->u.i;
    default:
      return a->u.i == b->u.i;
  }
}
