/* The free index of a pool: free blocks ordered by (stream, size, address),
 * segregated by stream and size class. Each stream of the pool has its own
 * classes (stream_bins); each class keeps its free blocks in a red-black
 * tree (libbsd's sys/tree.h, intrusive, no allocation) by (size, address).
 * Sizes below 512 KiB have a class each (one size, so a class's first
 * block is its best fit); above, each power of two is cut in 16 classes; a
 * small pool, whose requests end at 1 MiB, keeps every block of 1 MiB or
 * more in one class, so that splitting a request off a large remainder and
 * merging it back leaves the remainder where it was. Classes grow with
 * size: a stream's order is its classes' in turn, and the pool's is its
 * streams' in turn (the bins are kept sorted by stream).
 *
 * A bitmap of a stream's non-empty classes, with a summary word over it,
 * finds the first class at or above a request's with two bit scans; the
 * search then descends a tree of the few blocks of one size, where one
 * tree of every free block took some ten levels of scattered descriptors,
 * most of them mispredicted.
 *
 * A stream's bins (8-14 KiB) are made when the first segment of the stream
 * joins the pool and freed when its last one leaves (gca__pool_reserve,
 * gca__pool_unreserve), so that a block coming back to its pool never
 * needs host memory: running out of it fails the segment's creation, which
 * the allocator reports as it reports any lack of host memory. A segment
 * of a private pool also reserves the device's pool of its kind, which
 * takes it in when the private pool ends while the device still holds it.
 *
 * Best fit is a lower bound on (stream, size, 0): the smallest block of the
 * same stream that is large enough, the lowest address among equals. On top
 * of it sit PyTorch's oversize rules, active only when max_split_size is set:
 * a request below max_split_size never takes a block that large (it would be
 * wasted, since such blocks are never split), and a request of at least
 * max_split_size takes a block no more than max_non_split_rounding larger.
 * Expandable segments bend the order a little (expandable.c, refit).
 */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/expandable.h"

/* Unmapped blocks of expandable segments, by (stream, address): the search
 * for room to map looks for the lowest address (PyTorch's pool.unmapped).
 * A block is in at most one index (this, or a class of the free index),
 * so they share its link. */
static int compare_unmapped(const block_t *a, const block_t *b) {
  gca_stream_t sa = block_stream(a), sb = block_stream(b);
  if (sa != sb) return sa < sb ? -1 : 1;
  if (a->addr != b->addr) return a->addr < b->addr ? -1 : 1;
  return 0;
}

RB_GENERATE_STATIC(unmapped_index, block, link, compare_unmapped)

void gca__pool_unmapped_insert(pool_t *pool, block_t *b) {
  RB_INSERT(unmapped_index, &pool->unmapped, b);
  pool->unmapped_count++;
}

void gca__pool_unmapped_remove(pool_t *pool, block_t *b) {
  RB_REMOVE(unmapped_index, &pool->unmapped, b);
  pool->unmapped_count--;
}

/* A search key: a descriptor whose segment says only the stream. */
#define KEY(name, stream_, size_, addr_) \
  segment_t name##_segment = {.stream = (stream_)}; \
  block_t name = {.segment = &name##_segment, .size = (size_), .addr = (addr_)}

block_t *gca__pool_unmapped_first(pool_t *pool, gca_stream_t stream) {
  KEY(key, stream, 0, 0);
  block_t *b = RB_NFIND(unmapped_index, &pool->unmapped, &key);
  return b && block_stream(b) == stream ? b : NULL;
}

block_t *gca__pool_unmapped_next(pool_t *pool, block_t *b) {
  (void)pool;
  return RB_NEXT(unmapped_index, &pool->unmapped, b);
}

bool gca__pool_unmapped_contains(pool_t *pool, block_t *b) { return RB_FIND(unmapped_index, &pool->unmapped, b) == b; }

/* ---- size classes ------------------------------------------------------------ */

#define CLASS_SHIFT 9 /* classes count 512-byte units */
#define EXACT_CLASSES 1024
#define SUB_BITS 4
#define NO_CLASS UINT_MAX
_Static_assert(POOL_CLASSES == EXACT_CLASSES + (64 - CLASS_SHIFT - 10) * (1 << SUB_BITS), "POOL_CLASSES");
_Static_assert(POOL_CLASS_WORDS < 64, "one summary word covers every class word, with a bit to spare");

static inline unsigned class_of_size(size_t size) {
  uint64_t u = (uint64_t)size >> CLASS_SHIFT;
  if (u < EXACT_CLASSES) return (unsigned)u;
  unsigned top = 63u - (unsigned)__builtin_clzll(u); /* 10 .. 54 */
  return EXACT_CLASSES + (top - 10) * (1u << SUB_BITS) + (unsigned)((u >> (top - SUB_BITS)) & ((1u << SUB_BITS) - 1));
}

static inline unsigned class_of(const pool_t *pool, size_t size) {
  return size >= pool->cap_size ? pool->class_cap : class_of_size(size);
}

static int compare_blocks(const block_t *a, const block_t *b) {
  if (a->size != b->size) return a->size < b->size ? -1 : 1;
  if (a->addr != b->addr) return a->addr < b->addr ? -1 : 1;
  return 0;
}

RB_GENERATE_STATIC(free_index, block, link, compare_blocks)

/* One stream's free blocks in one pool. */
struct stream_bins {
  gca_stream_t stream;
  uint64_t summary;                 /* bit w: words[w] is not zero */
  uint64_t words[POOL_CLASS_WORDS]; /* bit c: roots[c] holds a block */
  size_t segments;                  /* the pool's segments of the stream, and reservations for them */
  struct free_index roots[];        /* class_cap + 1 classes */
};

static inline void bin_set(stream_bins_t *sb, unsigned c) {
  sb->words[c >> 6] |= UINT64_C(1) << (c & 63);
  sb->summary |= UINT64_C(1) << (c >> 6);
}

static inline void bin_clear(stream_bins_t *sb, unsigned c) {
  unsigned w = c >> 6;
  sb->words[w] &= ~(UINT64_C(1) << (c & 63));
  if (!sb->words[w]) sb->summary &= ~(UINT64_C(1) << w);
}

/* The first non-empty class >= from (< POOL_CLASSES), or NO_CLASS. */
static inline unsigned bins_next_below_end(const stream_bins_t *sb, unsigned from) {
  unsigned w = from >> 6;
  uint64_t m = sb->words[w] & (~UINT64_C(0) << (from & 63));
  if (m) return w * 64 + (unsigned)__builtin_ctzll(m);
  uint64_t rest = sb->summary & (~UINT64_C(0) << (w + 1)); /* (w + 1 < 64) */
  if (!rest) return NO_CLASS;
  w = (unsigned)__builtin_ctzll(rest);
  return w * 64 + (unsigned)__builtin_ctzll(sb->words[w]);
}

/* The first non-empty class >= from, or NO_CLASS. */
static inline unsigned bins_next(const stream_bins_t *sb, unsigned from) {
  return from < POOL_CLASSES ? bins_next_below_end(sb, from) : NO_CLASS;
}

/* The last non-empty class <= from, or NO_CLASS. */
static unsigned bins_prev(const stream_bins_t *sb, unsigned from) {
  if (from == NO_CLASS) return NO_CLASS;
  unsigned w = from >> 6;
  uint64_t m = sb->words[w] & (~UINT64_C(0) >> (63 - (from & 63)));
  if (m) return w * 64 + 63u - (unsigned)__builtin_clzll(m);
  uint64_t rest = sb->summary & ((UINT64_C(1) << w) - 1);
  if (!rest) return NO_CLASS;
  w = 63u - (unsigned)__builtin_clzll(rest);
  return w * 64 + 63u - (unsigned)__builtin_clzll(sb->words[w]);
}

/* ---- the streams' bins, sorted by stream ------------------------------------- */

/* Where `stream` is, or would go, in pool->streams. */
static size_t bins_position(const pool_t *pool, gca_stream_t stream) {
  size_t lo = 0, hi = pool->stream_count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (pool->streams[mid]->stream < stream) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

GCA_NOINLINE static stream_bins_t *bins_find(pool_t *pool, gca_stream_t stream) {
  size_t i = bins_position(pool, stream);
  if (i == pool->stream_count || pool->streams[i]->stream != stream) return NULL;
  return pool->hot = pool->streams[i];
}

static inline stream_bins_t *bins_of(pool_t *pool, gca_stream_t stream) {
  stream_bins_t *hot = pool->hot;
  return likely(hot && hot->stream == stream) ? hot : bins_find(pool, stream);
}

/* The stream's bins with `held` more reservations, made if it has none;
 * false: no host memory. */
static bool bins_hold(pool_t *pool, gca_stream_t stream, size_t held) {
  stream_bins_t *sb = bins_of(pool, stream);
  if (!sb) {
    if (pool->stream_count == pool->stream_cap) {
      size_t cap = pool->stream_cap ? 2 * pool->stream_cap : 4;
      stream_bins_t **grown = realloc(pool->streams, cap * sizeof *grown);
      if (!grown) return false;
      pool->streams = grown;
      pool->stream_cap = cap;
    }
    sb = calloc(1, sizeof *sb + (pool->class_cap + 1) * sizeof sb->roots[0]); /* (all trees empty) */
    if (!sb) return false;
    sb->stream = stream;
    size_t i = bins_position(pool, stream);
    memmove(&pool->streams[i + 1], &pool->streams[i], (pool->stream_count - i) * sizeof pool->streams[0]);
    pool->streams[i] = sb;
    pool->stream_count++;
  }
  sb->segments += held;
  return true;
}

bool gca__pool_reserve(pool_t *pool, gca_stream_t stream) { return bins_hold(pool, stream, 1); }

void gca__pool_unreserve(pool_t *pool, gca_stream_t stream) {
  stream_bins_t *sb = bins_of(pool, stream);
  GCA_ASSERT(sb && sb->segments > 0);
  if (!sb || --sb->segments > 0) return;
  GCA_ASSERT(sb->summary == 0); /* (no segment, no block) */
  size_t i = bins_position(pool, stream);
  memmove(&pool->streams[i], &pool->streams[i + 1], (pool->stream_count - i - 1) * sizeof pool->streams[0]);
  pool->stream_count--;
  if (pool->hot == sb) pool->hot = NULL;
  free(sb);
}

bool gca__pool_stream_at(const pool_t *pool, size_t i, gca_stream_t *stream, size_t *held) {
  if (i >= pool->stream_count) return false;
  *stream = pool->streams[i]->stream;
  *held = pool->streams[i]->segments;
  return true;
}

bool gca__pool_stream_held(pool_t *pool, gca_stream_t stream) { return bins_of(pool, stream) != NULL; }

/* A block of a stream with no bins: the books are broken (every segment
 * reserves its stream's), so bins are made now, and without host memory
 * for them the process stops rather than lose the block. */
GCA_COLD static stream_bins_t *bins_missing(pool_t *pool, gca_stream_t stream) {
  if (!bins_hold(pool, stream, 0)) {
    fprintf(stderr, "gcalloc: a free block of stream %#" PRIxPTR " has no place in its pool's index and no host memory "
            "is left to make one\n", (uintptr_t)stream);
    abort();
  }
  return bins_of(pool, stream);
}

/* ---- one class's tree --------------------------------------------------------- */

/* The first block of the tree whose size is >= size, or NULL. The
 * comparison and the step are computed without branches (conditional
 * moves): a search down a tree mispredicts about every other branch. */
static inline block_t *class_lower_bound(const struct free_index *tree, size_t size) {
  block_t *node = RB_ROOT(tree), *best = NULL;
  while (node) {
    bool below = node->size < size;
    best = below ? best : node;
    node = below ? RB_RIGHT(node, link) : RB_LEFT(node, link);
  }
  return best;
}

/* ---- the pool ----------------------------------------------------------------- */

void gca__pool_init(pool_t *pool, int kind) {
  RB_INIT(&pool->unmapped);
  pool->free_count = 0;
  pool->unmapped_count = 0;
  pool->expandable_segments = 0;
  pool->lookups = 0;
  pool->kind = kind;
  pool->owner = NULL;
  pool->streams = NULL;
  pool->stream_count = pool->stream_cap = 0;
  pool->hot = NULL;
  pool->class_cap = kind == GCA_POOL_SMALL ? class_of_size(SMALL_SIZE) : POOL_CLASSES - 1;
  pool->cap_size = kind == GCA_POOL_SMALL ? SMALL_SIZE : SIZE_MAX;
}

void gca__pool_destroy(pool_t *pool) {
  for (size_t i = 0; i < pool->stream_count; i++) free(pool->streams[i]);
  free(pool->streams);
  pool->streams = NULL;
  pool->stream_count = pool->stream_cap = 0;
  pool->hot = NULL;
}

void gca__pool_insert(pool_t *pool, block_t *b) {
  block_set_gc_base(b, pool->lookups);
  gca_stream_t stream = block_stream(b);
  stream_bins_t *sb = bins_of(pool, stream);
  if (unlikely(!sb)) sb = bins_missing(pool, stream);
  unsigned c = class_of(pool, b->size);
  RB_INSERT(free_index, &sb->roots[c], b);
  bin_set(sb, c);
  pool->free_count++;
}

static inline void class_remove(stream_bins_t *sb, unsigned c, block_t *b) {
  RB_REMOVE(free_index, &sb->roots[c], b);
  if (!RB_ROOT(&sb->roots[c])) bin_clear(sb, c);
}

void gca__pool_remove(pool_t *pool, block_t *b) {
  class_remove(bins_of(pool, block_stream(b)), class_of(pool, b->size), b);
  pool->free_count--;
}

GCA_NOINLINE static void reorder(pool_t *pool, block_t *b, unsigned was, unsigned now) {
  stream_bins_t *sb = bins_of(pool, block_stream(b));
  struct free_index *tree = &sb->roots[now];
  if (was == now) {
    block_t *before = RB_PREV(free_index, tree, b), *after = RB_NEXT(free_index, tree, b);
    if ((!before || compare_blocks(before, b) < 0) && (!after || compare_blocks(b, after) < 0)) return;
    RB_REMOVE(free_index, tree, b);
    RB_INSERT(free_index, tree, b);
    return;
  }
  class_remove(sb, was, b);
  RB_INSERT(free_index, tree, b);
  bin_set(sb, now);
}

void gca__pool_resized(pool_t *pool, block_t *b, size_t old_size) {
  /* The common case: a small pool's large remainder, alone in the top
   * class, which it keeps. */
  bool alone = !RB_PARENT(b, link) && !RB_LEFT(b, link) && !RB_RIGHT(b, link);
  if (alone && old_size >= pool->cap_size && b->size >= pool->cap_size) return;
  unsigned was = class_of(pool, old_size), now = class_of(pool, b->size);
  if (was == now && alone) return;
  reorder(pool, b, was, now);
}

/* The first block of the stream's classes from `from` up, or NULL. */
static block_t *first_from(const stream_bins_t *sb, unsigned from) {
  unsigned c = bins_next(sb, from);
  return c == NO_CLASS ? NULL : RB_MIN(free_index, (struct free_index *)&sb->roots[c]);
}

/* The last block of the stream's classes from `from` down, or NULL. */
static block_t *last_from(const stream_bins_t *sb, unsigned from) {
  unsigned c = bins_prev(sb, from);
  return c == NO_CLASS ? NULL : RB_MAX(free_index, (struct free_index *)&sb->roots[c]);
}

/* Lower bound on (stream, size, 0): in the request's own class the stream
 * may have only smaller blocks (a class cut from a power of two); every
 * class above holds only larger ones, so there its first block is the answer. */
static inline block_t *lower_bound(pool_t *pool, gca_stream_t stream, size_t size) {
  stream_bins_t *sb = bins_of(pool, stream);
  if (unlikely(!sb)) return NULL;
  unsigned c = class_of(pool, size); /* (<= class_cap < POOL_CLASSES) */
  unsigned k = bins_next_below_end(sb, c);
  if (unlikely(k == NO_CLASS)) return NULL;
  block_t *b = class_lower_bound(&sb->roots[k], size);
  return likely(b != NULL) ? b : first_from(sb, k + 1);
}

block_t *gca__pool_lower_bound(pool_t *pool, gca_stream_t stream, size_t size) {
  return lower_bound(pool, stream, size);
}

bool gca__pool_fits(const config_t *cfg, size_t size, const block_t *b) {
  size_t max_split = cfg->max_split_size;
  if (size < max_split && b->size >= max_split) return false;
  if (size >= max_split && b->size - size >= cfg->max_non_split_rounding) return false;
  return true;
}

block_t *gca__pool_best_fit(pool_t *pool, const config_t *cfg, gca_stream_t stream, size_t size) {
  block_t *b = lower_bound(pool, stream, size);
  if (unlikely(pool->expandable_segments != 0) && b && b->expandable) b = gca__expandable_refit(pool, cfg, stream, b);
  return b && gca__pool_fits(cfg, size, b) ? b : NULL;
}

/* The first block of the first stream at or after bins index i, or NULL. */
static block_t *first_of_streams_from(const pool_t *pool, size_t i) {
  for (; i < pool->stream_count; i++)
    if (pool->streams[i]->summary) return first_from(pool->streams[i], 0);
  return NULL;
}

block_t *gca__pool_last_on_stream(pool_t *pool, gca_stream_t stream) {
  stream_bins_t *sb = bins_of(pool, stream);
  return sb ? last_from(sb, pool->class_cap) : NULL;
}

block_t *gca__pool_first(pool_t *pool) { return first_of_streams_from(pool, 0); }

block_t *gca__pool_first_after_stream(pool_t *pool, gca_stream_t stream) {
  return stream == UINTPTR_MAX ? NULL : first_of_streams_from(pool, bins_position(pool, stream + 1));
}

block_t *gca__pool_next(pool_t *pool, block_t *b) {
  block_t *next = RB_NEXT(free_index, NULL, b);
  if (next) return next;
  gca_stream_t stream = block_stream(b);
  stream_bins_t *sb = bins_of(pool, stream);
  unsigned c = class_of(pool, b->size);
  if (c < pool->class_cap && (next = first_from(sb, c + 1))) return next;
  return gca__pool_first_after_stream(pool, stream);
}

block_t *gca__pool_prev(pool_t *pool, block_t *b) {
  block_t *prev = RB_PREV(free_index, NULL, b);
  if (prev) return prev;
  gca_stream_t stream = block_stream(b);
  stream_bins_t *sb = bins_of(pool, stream);
  unsigned c = class_of(pool, b->size);
  if (c > 0 && (prev = last_from(sb, c - 1))) return prev;
  for (size_t i = bins_position(pool, stream); i-- > 0;)
    if (pool->streams[i]->summary) return last_from(pool->streams[i], pool->class_cap);
  return NULL;
}

bool gca__pool_contains(pool_t *pool, block_t *b) {
  stream_bins_t *sb = bins_of(pool, block_stream(b));
  return sb && RB_FIND(free_index, &sb->roots[class_of(pool, b->size)], b) == b;
}
