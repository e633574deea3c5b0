/* Segments and blocks: getting memory from the device and giving it back,
 * splitting a block to hand out part of it, merging a freed block with its
 * free neighbours. The statistics move here, in PyTorch's exact steps
 * (alloc_found_block, free_block, alloc_block, release_block), so that every
 * counter equals what a walk over the segments would count.
 *
 * All functions run with the device lock held.
 */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/events.h"
#include "core/coop.h"
#include "core/expandable.h"
#include "core/history.h"

/* ---- block descriptors -------------------------------------------------- */

#define BLOCKS_PER_CHUNK 128

struct block_chunk {
  block_chunk_t *next;
  _Alignas(64) block_t blocks[BLOCKS_PER_CHUNK]; /* 96 bytes each (core.h) */
};

GCA_COLD static bool add_block_chunk(device_t *d) {
  block_chunk_t *chunk = aligned_alloc(64, sizeof *chunk);
  if (!chunk) return false;
  chunk->next = d->chunks;
  d->chunks = chunk;
  for (int i = BLOCKS_PER_CHUNK - 1; i >= 0; i--) {
    chunk->blocks[i].next = d->spare_blocks;
    d->spare_blocks = &chunk->blocks[i];
  }
  return true;
}

block_t *gca__block_new(device_t *d) {
  if (unlikely(!d->spare_blocks) && !add_block_chunk(d)) return NULL;
  block_t *b = d->spare_blocks;
  d->spare_blocks = b->next;
  /* Callers set addr, size, segment and the links; the rest starts clear.
   * Cheaper than clearing the whole descriptor. The in-use fields are not
   * among them: a new block is free, and account_taken sets them when one
   * is handed out (until then they are the index node's and the age's). */
  b->prev = b->next = NULL;
  b->state = BLOCK_FREE;
  b->expandable = false;
  return b;
}

void gca__block_chunks_free(device_t *d) {
  while (d->chunks) {
    block_chunk_t *next = d->chunks->next;
    free(d->chunks);
    d->chunks = next;
  }
  d->spare_blocks = NULL;
}

void gca__block_recycle(device_t *d, block_t *b) {
  b->next = d->spare_blocks;
  d->spare_blocks = b;
}

/* ---- segments ----------------------------------------------------------- */

void gca__mirror_reserved(device_t *d) {
  atomic_store_explicit(&d->reserved_now, family_current(&d->stats, FAM_RESERVED_BYTES), memory_order_relaxed);
  if (d->coop) gca__coop_reserved(d->coop, family_current(&d->stats, FAM_RESERVED_BYTES));
}

void gca__widen_span(device_t *d, uintptr_t lo, uintptr_t hi) {
  if (lo < atomic_load_explicit(&d->span_lo, memory_order_relaxed))
    atomic_store_explicit(&d->span_lo, lo, memory_order_relaxed);
  if (hi > atomic_load_explicit(&d->span_hi, memory_order_relaxed))
    atomic_store_explicit(&d->span_hi, hi, memory_order_relaxed);
}

bool gca__segment_reserve(device_t *d, pool_t *pool, gca_stream_t stream) {
  if (!gca__pool_reserve(pool, stream)) return false;
  if (pool->owner && !gca__pool_reserve(home_pool(d, pool), stream)) {
    gca__pool_unreserve(pool, stream);
    return false;
  }
  return true;
}

void gca__segment_unreserve(device_t *d, pool_t *pool, gca_stream_t stream) {
  if (pool->owner) gca__pool_unreserve(home_pool(d, pool), stream);
  gca__pool_unreserve(pool, stream);
}

bool gca__segment_descriptors_new(device_t *d, pool_t *pool, gca_stream_t stream, segment_t **seg, block_t **b,
                                  int *status) {
  *seg = malloc(sizeof **seg);
  *b = gca__block_new(d);
  if (*seg && *b && gca__segment_reserve(d, pool, stream)) return true;
  free(*seg);
  if (*b) gca__block_recycle(d, *b);
  *status = gca__set_error(GCA_ERR_NOMEM, "out of host memory for allocator bookkeeping");
  return false;
}

void gca__segment_descriptors_drop(device_t *d, pool_t *pool, gca_stream_t stream, segment_t *seg, block_t *b) {
  gca__segment_unreserve(d, pool, stream);
  free(seg);
  gca__block_recycle(d, b);
}

void gca__segment_start(device_t *d, segment_t *seg, block_t *b, pool_t *pool, gca_stream_t stream, uintptr_t addr,
                        size_t size) {
  /* Every field not named starts clear, so a field added later cannot be forgotten here. */
  *seg = (segment_t){.addr = addr, .size = size, .stream = stream, .pool = pool, .head = b};
  gca__segment_link(d, seg);
  b->addr = addr;
  b->size = size;
  b->segment = seg;
}

void gca__segment_link(device_t *d, segment_t *seg) {
  seg->prev = NULL;
  seg->next = d->segments;
  if (d->segments) d->segments->prev = seg;
  d->segments = seg;
  d->segment_count++;
}

void gca__segment_unlink(device_t *d, segment_t *seg) {
  if (seg->prev) seg->prev->next = seg->next;
  else d->segments = seg->next;
  if (seg->next) seg->next->prev = seg->prev;
  d->segment_count--;
}

block_t *gca__segment_alloc(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, int *status) {
  size_t size = gca__segment_size_for(rounded);
  if (size == 0) {
    *status = gca__set_error(GCA_ERR_INVALID, "a segment for %zu bytes would overflow the address space", rounded);
    return NULL;
  }
  if (gca__device_limit_refuses(d, size)) { /* PyTorch's alloc_block: refused without asking the device */
    *status = GCA_ERR_OOM;
    return NULL;
  }
  segment_t *seg;
  block_t *b;
  if (!gca__segment_descriptors_new(d, pool, stream, &seg, &b, status)) return NULL;
  uintptr_t addr = 0;
  int rc = d->backend->ops->malloc(d->backend->state, d->index, size, &addr);
  if (rc != GCA_OK) {
    gca__segment_descriptors_drop(d, pool, stream, seg, b);
    *status = rc;
    return NULL;
  }
  d->device_bytes += size;
  gca__segment_start(d, seg, b, pool, stream, addr, size);
  seg->oversize = size >= d->config.max_split_size;

  kept_stats_t *s = &d->stats;
  if (unlikely(d->obs.recording)) gca__history_event(d, GCA_TRACE_SEGMENT_ALLOC, addr, size, stream);
  segment_observed(d, true, size);
  family_increase(s, FAM_SEGMENT, pool->kind, 1);
  family_increase(s, FAM_RESERVED_BYTES, pool->kind, (int64_t)size);
  s->num_device_alloc++;
  if (seg->oversize) stat_increase(&s->oversize_segments, 1);
  gca__mirror_reserved(d);
  gca__widen_span(d, addr, addr + size);
  *status = GCA_OK;
  return b;
}

bool gca__segment_release(device_t *d, block_t *b) {
  segment_t *seg = b->segment;
  /* Work on its blocks may wait in the framework's queue, to be launched
   * after the stream's event would be recorded: kept until it is drained. */
  if (!gca__segment_drained(d, seg)) return false;
  gca__pool_remove(block_pool(b), b);
  /* Blocks freed on their own stream came back to the pool at once, while
   * work queued on that stream may still use them (reuse on the stream is
   * ordered after it; a device free is not). So the device free waits for
   * the stream. Other streams' uses were waited for before the blocks came
   * back (events.c). */
  uintptr_t event;
  if (gca__events_ready_to_free(d, seg->stream, &event)) return gca__segment_free_now(d, seg);
  if (!event) {
    /* Cannot know when the stream is done with it: keep it cached. */
    gca__pool_insert(block_pool(b), b);
    return false;
  }
  b->state = BLOCK_RELEASING;
  seg->release_event = event;
  seg->release_next = d->ev.releasing;
  d->ev.releasing = seg;
  d->ev.releasing_count++;
  return true;
}

bool gca__segment_free_now(device_t *d, segment_t *seg) {
  block_t *b = seg->head;
  /* Only a whole segment, nothing allocated in it, goes back to the device. */
  GCA_ASSERT(b && !b->prev && !b->next && b->addr == seg->addr && b->size == seg->size);
  GCA_ASSERT(b->state == BLOCK_FREE || b->state == BLOCK_RELEASING);
  int rc = d->backend->ops->free(d->backend->state, d->index, seg->addr, seg->size);
  if (rc == GCA_ERR_BAD_POINTER || rc == GCA_ERR_CORRUPT) {
    /* The device says our books were wrong (no such allocation, or it was
     * still in use): the segment leaves them anyway, since keeping it would
     * keep a block nobody can use, and gca_check reports the error. */
    d->kept.free_errors++;
  } else if (rc != GCA_OK) {
    /* The device refused and still holds the memory: keep the segment
     * cached, whole, to be given back another time. */
    gca__note_refused_free(d);
    b->state = BLOCK_FREE;
    gca__pool_insert(block_pool(b), b);
    return false;
  }
  d->device_bytes -= seg->size;

  if (unlikely(d->obs.recording)) gca__history_event(d, GCA_TRACE_SEGMENT_FREE, seg->addr, seg->size, seg->stream);
  segment_observed(d, false, seg->size);
  kept_stats_t *s = &d->stats;
  family_decrease(s, FAM_SEGMENT, seg->pool->kind, 1);
  family_decrease(s, FAM_RESERVED_BYTES, seg->pool->kind, (int64_t)seg->size);
  s->num_device_free++;
  if (seg->oversize) stat_decrease(&s->oversize_segments, 1);
  gca__mirror_reserved(d);

  gca__segment_unlink(d, seg);
  gca__segment_unreserve(d, seg->pool, seg->stream);
  free(seg);
  gca__block_recycle(d, b);
  return true;
}

/* A whole ordinary segment (an expandable segment's memory goes back page by page instead). */
static bool unsplit(const block_t *b) { return !b->prev && !b->next && !b->expandable; }

bool gca__segment_release_available(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded) {
  size_t max_split = d->config.max_split_size;
  if (max_split == SIZE_MAX) return false;
  size_t want = rounded < max_split ? max_split : rounded;
  block_t *b = gca__pool_lower_bound(pool, stream, want);
  /* As PyTorch: an expandable block found here sends the search to the
   * loop below, which skips expandable blocks. */
  if (b && unsplit(b)) {
    gca__segment_release(d, b);
    return true;
  }
  /* No single block is large enough: free oversize blocks of this stream,
   * largest first, until enough is released. */
  block_t *cur = gca__pool_last_on_stream(pool, stream);
  size_t released = 0;
  while (cur && released < want && cur->size >= max_split && block_stream(cur) == stream) {
    block_t *prev = gca__pool_prev(pool, cur);
    if (unsplit(cur)) {
      released += cur->size;
      gca__segment_release(d, cur);
    }
    cur = prev;
  }
  return released >= want;
}

void gca__segment_release_pool(device_t *d, pool_t *pool) {
  block_t *b = gca__pool_first(pool);
  while (b) {
    block_t *next = gca__pool_next(pool, b);
    if (unsplit(b)) gca__segment_release(d, b);
    b = next;
  }
}

static int by_size_down(const void *x, const void *y) {
  size_t a = (*(block_t *const *)x)->size, b = (*(block_t *const *)y)->size;
  return (a < b) - (a > b);
}

/* The whole cached segments of `pool`, largest first, given back until
 * *released reaches `need`. */
static void release_largest(device_t *d, pool_t *pool, size_t need, size_t *released) {
  size_t n = 0, cap = 0;
  block_t **all = NULL;
  for (block_t *b = gca__pool_first(pool); b; b = gca__pool_next(pool, b)) {
    if (!unsplit(b)) continue;
    if (n == cap) {
      block_t **grown = realloc(all, (cap = cap ? 2 * cap : 16) * sizeof *all);
      if (!grown) break; /* (out of host memory: what was gathered is released) */
      all = grown;
    }
    all[n++] = b;
  }
  if (n) qsort(all, n, sizeof *all, by_size_down);
  for (size_t i = 0; i < n && *released < need; i++) {
    size_t size = all[i]->size;
    if (gca__segment_release(d, all[i])) *released += size;
  }
  free(all);
}

size_t gca__segment_release_cached_upto(device_t *d, size_t need) {
  size_t released = 0;
  release_largest(d, &d->large_pool, need, &released);
  if (released < need) release_largest(d, &d->small_pool, need, &released);
  if (released < need) released += gca__expandable_release_upto(d, need - released);
  return released;
}

void gca__segment_release_all_cached(device_t *d) {
  gca__segment_release_pool(d, &d->large_pool);
  gca__segment_release_pool(d, &d->small_pool);
  gca__expandable_release_all(d);
}

/* ---- split and merge ---------------------------------------------------- */

static bool should_split(const device_t *d, const block_t *b, size_t size) {
  size_t remaining = b->size - size;
  /* PyTorch decides by the setting, not by the block's segment. */
  if (block_pool(b)->kind == GCA_POOL_SMALL || d->config.expandable_segments || block_pool(b)->pausable)
    return remaining >= MIN_BLOCK_SIZE;
  return size < d->config.max_split_size && remaining > SMALL_SIZE;
}

GCA_COLD static void note_taken(device_t *d, block_t *b, size_t requested) {
  if (d->ev.pending_blocks) gca__stats_note_active_peak(&d->stats);
  if (d->obs.recording) gca__history_alloc(d, b, requested);
}

/* Enter the handed-out block in the books (PyTorch's alloc_found_block tail). */
static void account_taken(device_t *d, block_t *b, size_t requested) {
  kept_stats_t *s = &d->stats;
  int kind = pool_kind_of(b);
  b->state = BLOCK_ALLOCATED;
  b->requested = requested;
  b->uses = NULL; /* (the in-use fields were the index node and the age */
  b->stack = NULL; /*  until now; hash_next is set by the map, event_count */
  b->traced_pending = false; /* when the free is deferred) */
  gca__block_map_insert(&d->allocated, b);
  family_increase(s, FAM_ALLOCATION, kind, 1);
  family_increase(s, FAM_ALLOCATED_BYTES, kind, (int64_t)b->size);
  family_increase(s, FAM_REQUESTED_BYTES, kind, (int64_t)requested);
  b->oversize = b->size >= d->config.max_split_size;
  if (b->oversize) stat_increase(&s->oversize_allocations, 1);
  atomic_store_explicit(&d->allocated_now, family_current(s, FAM_ALLOCATED_BYTES), memory_order_relaxed);
  /* One branch for both rare cases: frees are pending, or history records. */
  if (unlikely(d->ev.pending_blocks | (size_t)d->obs.recording)) note_taken(d, b, requested);
}

/* Make `low` the first `size` bytes of b, linked before it; b keeps the rest. */
static void carve_below(block_t *b, block_t *low, size_t size) {
  low->addr = b->addr;
  low->size = size;
  low->segment = b->segment;
  low->prev = b->prev;
  low->next = b;
  if (low->prev) low->prev->next = low;
  else b->segment->head = low;
  b->prev = low;
  b->addr += size;
  b->size -= size;
}

/* torch_npu's base_addr_aligned_kb: with expandable segments, a request of
 * 2 MiB or more starts at a multiple of the alignment where the block has
 * room for it; the bytes below stay a free block of their own (merged back
 * when the request is freed). Blocks of ordinary segments are left as they
 * are (torch_npu aligns them too, and its inactive-split statistics then
 * drift). Returns b, out of the index when it moved. */
GCA_COLD static block_t *align_base(device_t *d, block_t *b, bool *in_index, size_t rounded) {
  size_t align = d->config.base_align, off = b->addr % align;
  size_t below = off ? align - off : 0;
  if (!below || below + rounded > b->size) return b;
  block_t *low = gca__block_new(d);
  if (!low) return b; /* (no host memory for a descriptor: unaligned rather than failing) */
  if (*in_index) gca__pool_remove(block_pool(b), b);
  *in_index = false;
  carve_below(b, low, below);
  low->expandable = true;
  block_set_gc_base(low, block_gc_base(b));
  gca__pool_insert(block_pool(low), low);
  return b;
}

block_t *gca__block_take(device_t *d, block_t *b, bool in_index, size_t rounded, size_t requested) {
  /* Only a free block large enough is handed out, in whole 512-byte units. */
  GCA_ASSERT(b->state == BLOCK_FREE && b->size >= rounded && rounded % MIN_BLOCK_SIZE == 0);
  if (unlikely(d->config.base_align != 0) && b->expandable && rounded >= ROUND_LARGE && d->config.expandable_segments)
    b = align_base(d, b, &in_index, rounded);
  kept_stats_t *s = &d->stats;
  int kind = pool_kind_of(b);
  bool already_split = !unsplit(b);

  block_t *piece = should_split(d, b, rounded) ? gca__block_new(d) : NULL;
  if (piece) {
    /* The request takes the low end as a new block; `b` stays the free
     * remainder. Its key only shrinks, so it usually keeps its place in the
     * index and the tree is not touched. */
    carve_below(b, piece, rounded);
    pool_t *pool = block_pool(b);
    block_set_gc_base(b, pool->lookups); /* a remainder is newly free, as PyTorch re-inserts it */
    if (in_index) gca__pool_resized(pool, b, b->size + rounded);
    else gca__pool_insert(pool, b);
    /* PyTorch keeps expandable blocks out of inactive_split: their whole
     * free pages can always be given back. */
    piece->expandable = b->expandable;
    if (unlikely(b->expandable)) {
      /* nothing to count */
    } else if (already_split) {
      /* An inactive split piece shrinks by what was handed out. */
      family_decrease(s, FAM_INACTIVE_SPLIT_BYTES, kind, (int64_t)rounded);
    } else {
      /* A whole block becomes split: its rest is a new inactive piece. */
      family_increase(s, FAM_INACTIVE_SPLIT_BYTES, kind, (int64_t)b->size);
      family_increase(s, FAM_INACTIVE_SPLIT, kind, 1);
    }
    GCA_ASSERT(piece->addr + piece->size == b->addr && b->size % MIN_BLOCK_SIZE == 0); /* still tiled */
    account_taken(d, piece, requested);
    return piece;
  }
  /* No split (or no host memory for a descriptor: then the whole block is
   * handed out, a looser fit rather than a failure). */
  if (in_index) gca__pool_remove(block_pool(b), b);
  if (already_split && !b->expandable) {
    family_decrease(s, FAM_INACTIVE_SPLIT_BYTES, kind, (int64_t)b->size);
    family_decrease(s, FAM_INACTIVE_SPLIT, kind, 1);
  }
  account_taken(d, b, requested);
  return b;
}

/* Free and in the index: a pending neighbour is not merged with (PyTorch's
 * try_merge_blocks skips blocks with events outstanding). */
static bool is_free(const block_t *b) { return b && b->state == BLOCK_FREE; }

void gca__history_free_completed(device_t *d, block_t *b) {
  if (d->obs.recording) gca__history_event(d, GCA_TRACE_FREE_COMPLETED, b->addr, b->requested, block_stream(b));
  gca__history_drop_stack(b);
}

void gca__block_give_back(device_t *d, block_t *b) {
  /* A block comes back from use (a free, or a pending free completing),
   * never twice, and still tiles its segment with its neighbours. */
  GCA_ASSERT(b->state == BLOCK_ALLOCATED || b->state == BLOCK_PENDING);
  GCA_ASSERT((!b->prev || b->prev->addr + b->prev->size == b->addr) &&
             (!b->next || b->addr + b->size == b->next->addr));
  kept_stats_t *s = &d->stats;
  int kind = pool_kind_of(b);
  size_t requested = b->requested;
  block_t *prev = is_free(b->prev) ? b->prev : NULL;
  block_t *next = is_free(b->next) ? b->next : NULL;
  int64_t split_blocks = 0, split_bytes = 0;

  /* Merge with free neighbours. The surviving descriptor is one already in
   * the index when there is one: its key only grows, so it usually keeps its
   * place and the tree is not touched. */
  block_t *survivor;
  if (prev) {
    survivor = prev;
    size_t old_size = prev->size;
    split_blocks -= 1;
    split_bytes -= (int64_t)prev->size;
    block_absorb_next(prev);
    gca__block_recycle(d, b);
    if (next) {
      split_blocks -= 1;
      split_bytes -= (int64_t)next->size;
      gca__pool_remove(block_pool(next), next);
      block_absorb_next(prev);
      gca__block_recycle(d, next);
    }
    gca__pool_resized(block_pool(prev), prev, old_size);
  } else if (next) {
    survivor = next;
    size_t old_size = next->size;
    split_blocks -= 1;
    split_bytes -= (int64_t)next->size;
    block_absorb_prev(next);
    gca__block_recycle(d, b);
    gca__pool_resized(block_pool(next), next, old_size);
  } else {
    survivor = b;
    b->state = BLOCK_FREE; /* (its in-use fields become the index node) */
    gca__pool_insert(block_pool(b), b);
  }
  block_set_gc_base(survivor, block_pool(survivor)->lookups);
  if (survivor->prev || survivor->next) {
    split_blocks += 1;
    split_bytes += (int64_t)survivor->size;
  }
  if (survivor->expandable) split_blocks = split_bytes = 0;
  if (split_blocks > 0) family_increase(s, FAM_INACTIVE_SPLIT, kind, split_blocks);
  else if (split_blocks < 0) family_decrease(s, FAM_INACTIVE_SPLIT, kind, -split_blocks);
  if (split_bytes > 0) family_increase(s, FAM_INACTIVE_SPLIT_BYTES, kind, split_bytes);
  else if (split_bytes < 0) family_decrease(s, FAM_INACTIVE_SPLIT_BYTES, kind, -split_bytes);

  family_decrease(s, FAM_REQUESTED_BYTES, kind, (int64_t)requested);
}
