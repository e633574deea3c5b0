/* The free index of a pool: free blocks ordered by (stream, size, address),
 * kept in a red-black tree (libbsd's sys/tree.h, intrusive, no allocation).
 *
 * Best fit is a lower bound on (stream, size, 0): the smallest block of the
 * same stream that is large enough, the lowest address among equals. On top
 * of it sit PyTorch's oversize rules, active only when max_split_size is set:
 * a request below max_split_size never takes a block that large (it would be
 * wasted, since such blocks are never split), and a request of at least
 * max_split_size takes a block no more than max_non_split_rounding larger.
 * Expandable segments bend the order a little (expandable.c, refit).
 */
#include "core/core.h"
#include "core/expandable.h"

static int compare_blocks(const block_t *a, const block_t *b) {
  gca_stream_t sa = block_stream(a), sb = block_stream(b);
  if (sa != sb) return sa < sb ? -1 : 1;
  if (a->size != b->size) return a->size < b->size ? -1 : 1;
  if (a->addr != b->addr) return a->addr < b->addr ? -1 : 1;
  return 0;
}

RB_GENERATE_STATIC(free_index, block, link, compare_blocks)

/* Unmapped blocks of expandable segments, by (stream, address): the search
 * for room to map looks for the lowest address (PyTorch's pool.unmapped).
 * A block is in at most one of the two trees, so they share its link. */
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

void gca__pool_init(pool_t *pool, int kind) {
  RB_INIT(&pool->index);
  RB_INIT(&pool->unmapped);
  pool->free_count = 0;
  pool->unmapped_count = 0;
  pool->expandable_segments = 0;
  pool->lookups = 0;
  pool->kind = kind;
  pool->owner = NULL;
}

void gca__pool_insert(pool_t *pool, block_t *b) {
  block_set_gc_base(b, pool->lookups);
  RB_INSERT(free_index, &pool->index, b);
  pool->free_count++;
}

void gca__pool_remove(pool_t *pool, block_t *b) {
  RB_REMOVE(free_index, &pool->index, b);
  pool->free_count--;
}

void gca__pool_key_decreased(pool_t *pool, block_t *b, block_t *before) {
  if (before && compare_blocks(before, b) >= 0) {
    RB_REMOVE(free_index, &pool->index, b);
    RB_INSERT(free_index, &pool->index, b);
  }
}

void gca__pool_key_increased(pool_t *pool, block_t *b) {
  block_t *after = RB_NEXT(free_index, &pool->index, b);
  if (after && compare_blocks(after, b) <= 0) {
    RB_REMOVE(free_index, &pool->index, b);
    RB_INSERT(free_index, &pool->index, b);
  }
}

/* (stream, size) as one number, so "node below key" is a single comparison. */
#if defined(__SIZEOF_INT128__)
typedef unsigned __int128 search_key_t;
static inline search_key_t search_key(gca_stream_t stream, size_t size) {
  return ((search_key_t)stream << 64) | size;
}
#define KEY_BELOW(node, key) (search_key(block_stream(node), (node)->size) < (key))
#else
typedef struct { gca_stream_t stream; size_t size; } search_key_t;
static inline search_key_t search_key(gca_stream_t stream, size_t size) {
  search_key_t k = {stream, size};
  return k;
}
#define KEY_BELOW(node, key) \
  ((block_stream(node) < (key).stream) | ((block_stream(node) == (key).stream) & ((node)->size < (key).size)))
#endif

/* Lower bound on (stream, size, 0), written out rather than RB_NFIND: the
 * comparison and the step are computed without branches (conditional moves),
 * because a search down a tree mispredicts about every other branch, and that
 * was the largest cost of replaying real traces. *pred receives the found
 * block's predecessor: the last node the descent passed on its right. */
static block_t *lower_bound(pool_t *pool, gca_stream_t stream, size_t size, block_t **pred) {
  block_t *node = RB_ROOT(&pool->index), *best = NULL, *below_best = NULL;
  search_key_t key = search_key(stream, size);
  while (node) {
    bool below = KEY_BELOW(node, key);
    best = below ? best : node;
    below_best = below ? node : below_best; /* the last node passed on the right: best's predecessor */
    node = below ? RB_RIGHT(node, link) : RB_LEFT(node, link);
  }
  *pred = below_best;
  return (best && block_stream(best) == stream) ? best : NULL;
}

block_t *gca__pool_lower_bound(pool_t *pool, gca_stream_t stream, size_t size) {
  block_t *pred;
  return lower_bound(pool, stream, size, &pred);
}

bool gca__pool_fits(const config_t *cfg, size_t size, const block_t *b) {
  size_t max_split = cfg->max_split_size;
  if (size < max_split && b->size >= max_split) return false;
  if (size >= max_split && b->size - size >= cfg->max_non_split_rounding) return false;
  return true;
}

block_t *gca__pool_best_fit(pool_t *pool, const config_t *cfg, gca_stream_t stream, size_t size, block_t **pred) {
  block_t *b = lower_bound(pool, stream, size, pred);
  if (unlikely(pool->expandable_segments != 0) && b && b->expandable) {
    block_t *chosen = gca__expandable_refit(pool, cfg, stream, b);
    if (chosen != b) *pred = chosen ? RB_PREV(free_index, &pool->index, chosen) : NULL;
    b = chosen;
  }
  return b && gca__pool_fits(cfg, size, b) ? b : NULL;
}

block_t *gca__pool_last_on_stream(pool_t *pool, gca_stream_t stream) {
  KEY(key, stream, SIZE_MAX, UINTPTR_MAX);
  block_t *after = RB_NFIND(free_index, &pool->index, &key);
  block_t *b = after ? RB_PREV(free_index, &pool->index, after) : RB_MAX(free_index, &pool->index);
  return (b && block_stream(b) == stream) ? b : NULL;
}

block_t *gca__pool_first(pool_t *pool) { return RB_MIN(free_index, &pool->index); }

block_t *gca__pool_first_after_stream(pool_t *pool, gca_stream_t stream) {
  if (stream == UINTPTR_MAX) return NULL;
  KEY(key, stream + 1, 0, 0);
  return RB_NFIND(free_index, &pool->index, &key);
}

/* libbsd's RB_NEXT and RB_PREV walk from the node alone and ignore the head. */
block_t *gca__pool_next(pool_t *pool, block_t *b) {
  (void)pool;
  return RB_NEXT(free_index, &pool->index, b);
}

block_t *gca__pool_prev(pool_t *pool, block_t *b) {
  (void)pool;
  return RB_PREV(free_index, &pool->index, b);
}

bool gca__pool_contains(pool_t *pool, block_t *b) { return RB_FIND(free_index, &pool->index, b) == b; }
