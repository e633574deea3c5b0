/* The invariant checker. It recounts everything from the segments and
 * compares with the books:
 *   1. blocks tile each segment exactly: the head starts at the segment, each
 *      block starts where the previous ends, links agree both ways, sizes are
 *      multiples of 512, and the last block ends at the segment's end;
 *   2. no two free neighbours are left unmerged;
 *   3. every free block is in its pool's free index (and the index holds
 *      nothing else); every allocated block is in the allocation map (and the
 *      map holds nothing else); only allocated blocks have stream uses;
 *   4. every pending block waits for as many events as the per-stream queues
 *      hold for it, the queues hold nothing else, and every segment being
 *      released is whole and on the releasing list (and the list holds
 *      nothing else);
 *   5. every statistic's current value equals the recount (active counts
 *      allocated and pending blocks), "all" equals small + large, and no peak
 *      is below its current value;
 *   6. the backend never reported a segment free as a bookkeeping error (no
 *      such allocation, or memory still in use); a device that merely
 *      refused keeps the segment cached, which is not an error;
 *   7. expandable segments: unmapped blocks start and end on page
 *      boundaries, are never neighbours, have no page mapped and are all in
 *      their pool's unmapped index (which holds nothing else); every page
 *      under any other block is mapped; the segment's mapped bytes are its
 *      mapped pages; reserved bytes count mapped bytes, and such segments
 *      are not counted in `segment` (as PyTorch);
 *   8. the device's side: the bytes the backend handed out and has not
 *      taken back (by its own answers) are the reserved bytes plus the
 *      pages kept after a refused free, so nothing was dropped unreturned.
 * Tests call it after operations; it costs O(blocks).
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/mempool.h"

typedef struct recount {
  int64_t segment[3], reserved[3], allocation[3], allocated[3], requested[3];
  int64_t active[3], active_bytes[3];
  int64_t split[3], split_bytes[3];
  int64_t oversize_allocations, oversize_segments;
  size_t free_blocks[3];
  size_t unmapped_blocks[3];
  size_t allocated_blocks;
  size_t pending_blocks, quarantined_blocks, releasing_segments;
  uint64_t events_awaited; /* sum of pending blocks' event counts */
  size_t held_blocks;      /* pending with no event yet: held for a capture's end */
} recount_t;

#define BAD(...) return gca__set_error(GCA_ERR_CORRUPT, __VA_ARGS__)

/* The pages of an expandable segment against its blocks. */
static int check_pages(device_t *d, segment_t *seg, recount_t *r) {
  size_t page = seg->page_size, mapped = 0, top = 0;
  for (size_t i = 0; i < seg->page_cap; i++)
    if (seg->pages[i]) mapped++, top = i + 1;
  if (mapped * page != seg->mapped_bytes)
    BAD("device %d: expandable segment at %#" PRIxPTR " has %zu pages mapped but counts %zu bytes", d->index,
        seg->addr, mapped, seg->mapped_bytes);
  if (top != seg->mapped_top)
    BAD("device %d: expandable segment at %#" PRIxPTR " has its highest page mapped at %zu but keeps %zu",
        d->index, seg->addr, top, seg->mapped_top);
  r->reserved[seg->pool->kind] += (int64_t)seg->mapped_bytes;
  for (block_t *b = seg->head; b; b = b->next) {
    size_t offset = b->addr - seg->addr;
    size_t first = offset / page, end = (offset + b->size + page - 1) / page;
    bool unmapped = b->state == BLOCK_UNMAPPED;
    if (!b->expandable)
      BAD("device %d: block at %#" PRIxPTR " of an expandable segment is not marked expandable", d->index, b->addr);
    if (unmapped && (offset % page || b->size % page))
      BAD("device %d: unmapped block at %#" PRIxPTR " (+%zu) does not lie on page boundaries", d->index, b->addr,
          b->size);
    if (unmapped && b->next && b->next->state == BLOCK_UNMAPPED)
      BAD("device %d: unmapped blocks at %#" PRIxPTR " and %#" PRIxPTR " are neighbours but not merged", d->index,
          b->addr, b->next->addr);
    if (unmapped && !gca__pool_unmapped_contains(block_pool(b), b))
      BAD("device %d: unmapped block at %#" PRIxPTR " is missing from the unmapped index", d->index, b->addr);
    if (unmapped) r->unmapped_blocks[seg->pool->kind]++;
    for (size_t i = first; i < end; i++) {
      /* (a page of a paused pool counts as mapped: it is, again, at resume) */
      bool is_mapped = i < seg->page_cap && (seg->pages[i] != 0 || (seg->paused_pages && seg->paused_pages[i]));
      if (is_mapped == unmapped)
        BAD("device %d: page %zu of expandable segment at %#" PRIxPTR " is %s under the %s block at %#" PRIxPTR,
            d->index, i, seg->addr, is_mapped ? "mapped" : "unmapped", unmapped ? "unmapped" : "mapped", b->addr);
    }
  }
  return GCA_OK;
}

static int check_segment(device_t *d, segment_t *seg, recount_t *r) {
  int kind = seg->pool->kind;
  if (seg->expandable) {
    int rc = check_pages(d, seg, r);
    if (rc) return rc;
  } else {
    r->segment[kind]++;
    r->reserved[kind] += (int64_t)seg->size;
  }
  if (seg->oversize) r->oversize_segments++;
  block_t *b = seg->head;
  if (!b || b->addr != seg->addr || b->prev)
    BAD("device %d: segment at %#" PRIxPTR " does not start with its head block", d->index, seg->addr);
  uintptr_t expect = seg->addr;
  bool split = b->next != NULL;
  for (; b; b = b->next) {
    if (b->addr != expect)
      BAD("device %d: block at %#" PRIxPTR " should start at %#" PRIxPTR " (gap or overlap)", d->index,
          b->addr, expect);
    if (b->size == 0 || b->size % MIN_BLOCK_SIZE)
      BAD("device %d: block at %#" PRIxPTR " has size %zu, not a positive multiple of 512", d->index,
          b->addr, b->size);
    if (b->segment != seg)
      BAD("device %d: block at %#" PRIxPTR " names another segment than the one it lies in", d->index,
          b->addr);
    if (b->next && b->next->prev != b)
      BAD("device %d: block at %#" PRIxPTR " and its next neighbour disagree on their link", d->index,
          b->addr);
    bool held = b->state == BLOCK_PENDING && b->event_count == 0; /* a free held for a capture's end */
    if (block_uses(b) && b->state != BLOCK_ALLOCATED && !held)
      BAD("device %d: block at %#" PRIxPTR " has stream uses but is not allocated", d->index, b->addr);
    if (held) r->held_blocks++;
    switch (b->state) {
      case BLOCK_ALLOCATED:
        if (gca__block_map_find(&d->allocated, b->addr) != b)
          BAD("device %d: allocated block at %#" PRIxPTR " is missing from the allocation map", d->index,
              b->addr);
        r->allocated_blocks++;
        r->allocation[kind]++;
        r->allocated[kind] += (int64_t)b->size;
        r->requested[kind] += (int64_t)b->requested;
        r->active[kind]++;
        r->active_bytes[kind] += (int64_t)b->size;
        if (b->oversize) r->oversize_allocations++;
        break;
      case BLOCK_FREE:
        if (b->next && b->next->state == BLOCK_FREE)
          BAD("device %d: free blocks at %#" PRIxPTR " and %#" PRIxPTR " are neighbours but not merged",
              d->index, b->addr, b->next->addr);
        if (!gca__pool_contains(block_pool(b), b))
          BAD("device %d: free block at %#" PRIxPTR " is missing from its free index", d->index, b->addr);
        r->free_blocks[kind]++;
        if (split && !b->expandable) {
          r->split[kind]++;
          r->split_bytes[kind] += (int64_t)b->size;
        }
        break;
      case BLOCK_PENDING:
      case BLOCK_QUARANTINED:
        if (held && !b->uses)
          BAD("device %d: pending block at %#" PRIxPTR " waits for no event", d->index, b->addr);
        if (b->state == BLOCK_QUARANTINED) r->quarantined_blocks++;
        r->pending_blocks++;
        r->events_awaited += b->event_count;
        r->requested[kind] += (int64_t)b->requested;
        r->active[kind]++;
        r->active_bytes[kind] += (int64_t)b->size;
        break;
      case BLOCK_UNMAPPED:
        if (!seg->expandable)
          BAD("device %d: block at %#" PRIxPTR " is unmapped in an ordinary segment", d->index, b->addr);
        break;
      case BLOCK_RELEASING:
        if (split || !seg->release_event)
          BAD("device %d: block at %#" PRIxPTR " is being released but is not a whole segment with an event",
              d->index, b->addr);
        r->releasing_segments++;
        break;
      default:
        BAD("device %d: block at %#" PRIxPTR " is in no known state (%d)", d->index, b->addr, b->state);
    }
    expect = b->addr + b->size;
  }
  if (expect != seg->addr + seg->size)
    BAD("device %d: blocks of segment at %#" PRIxPTR " cover %zu bytes, the segment has %zu", d->index,
        seg->addr, (size_t)(expect - seg->addr), seg->size);
  return GCA_OK;
}

static int compare_family(const device_t *d, const char *name, const gca_stat_t *family,
                          const int64_t *counted) {
  for (int k = 0; k < GCA_POOL_KINDS; k++) {
    int64_t want = k == GCA_POOL_ALL ? counted[GCA_POOL_SMALL] + counted[GCA_POOL_LARGE] : counted[k];
    static const char *const pool_names[] = {"all", "small_pool", "large_pool"};
    if (family[k].current != want)
      BAD("device %d: %s.%s.current is %" PRId64 " but the segments hold %" PRId64, d->index, name,
          pool_names[k], family[k].current, want);
    if (family[k].peak < family[k].current)
      BAD("device %d: %s.%s.peak %" PRId64 " is below current %" PRId64, d->index, name, pool_names[k],
          family[k].peak, family[k].current);
  }
  return GCA_OK;
}

/* The pending frees and releases against the recount of the segments. */
static int check_events(device_t *d, const recount_t *r) {
  uint64_t queued = 0;
  for (size_t i = 0; i < d->ev.queue_count; i++) {
    const event_queue_t *q = &d->ev.queues[i];
    for (size_t j = 0; j < q->count; j++) {
      const block_t *b = q->items[(q->head + j) % q->cap].block;
      if (b->state != BLOCK_PENDING && b->state != BLOCK_QUARANTINED)
        BAD("device %d: the event queue of stream %#" PRIxPTR " holds the block at %#" PRIxPTR
            ", which is not pending", d->index, (uintptr_t)q->stream, b->addr);
    }
    queued += q->count;
  }
  if (queued != d->ev.pending_events || queued != r->events_awaited)
    BAD("device %d: the event queues hold %" PRIu64 " events, the device counts %zu, pending blocks await %" PRIu64,
        d->index, queued, d->ev.pending_events, r->events_awaited);
  size_t held = 0;
  for (const block_t *b = d->capture.held; b; b = b->hash_next) held++;
  if (held != r->held_blocks || (held && !d->capture.count))
    BAD("device %d: %zu frees held for a capture's end, %zu pending blocks without events, %zu captures", d->index,
        held, r->held_blocks, d->capture.count);
  if (r->pending_blocks != d->ev.pending_blocks || r->quarantined_blocks != d->ev.quarantined_blocks)
    BAD("device %d: %zu pending blocks (%zu quarantined) counted, the device has %zu (%zu)", d->index,
        r->pending_blocks, r->quarantined_blocks, d->ev.pending_blocks, d->ev.quarantined_blocks);
  size_t listed = 0;
  for (const segment_t *seg = d->ev.releasing; seg; seg = seg->release_next) {
    if (seg->head->state != BLOCK_RELEASING)
      BAD("device %d: segment at %#" PRIxPTR " is on the releasing list but not being released", d->index,
          seg->addr);
    listed++;
  }
  if (listed != r->releasing_segments || listed != d->ev.releasing_count)
    BAD("device %d: %zu segments being released, %zu listed, the device counts %zu", d->index,
        r->releasing_segments, listed, d->ev.releasing_count);
  return GCA_OK;
}

static int compare_handles(const void *x, const void *y) {
  uintptr_t a = *(const uintptr_t *)x, b = *(const uintptr_t *)y;
  return a < b ? -1 : a > b;
}

/* No physical page is mapped at two places (stitching moves pages around). */
static int check_pages_unique(device_t *d) {
  size_t count = 0;
  for (segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->expandable) count += seg->mapped_bytes / seg->page_size;
  if (count < 2) return GCA_OK;
  uintptr_t *all = malloc(count * sizeof *all);
  if (!all) return GCA_OK; /* no host memory to check with: not a broken invariant */
  size_t n = 0;
  for (segment_t *seg = d->segments; seg; seg = seg->next)
    for (size_t i = 0; seg->expandable && i < seg->page_cap; i++)
      if (seg->pages[i] && n < count) all[n++] = seg->pages[i];
  qsort(all, n, sizeof *all, compare_handles);
  for (size_t i = 1; i < n; i++) {
    if (all[i] == all[i - 1]) {
      uintptr_t h = all[i];
      free(all);
      BAD("device %d: physical memory %#" PRIxPTR " is mapped at two places", d->index, h);
    }
  }
  free(all);
  return GCA_OK;
}

int gca__device_check_locked(device_t *d) {
  recount_t r;
  memset(&r, 0, sizeof r);
  size_t segments = 0;
  for (segment_t *seg = d->segments; seg; seg = seg->next) {
    int rc = check_segment(d, seg, &r);
    if (rc) return rc;
    segments++;
  }
  if (d->kept.free_errors)
    BAD("device %d: the backend reported %zu segment frees as wrong (no such allocation, or memory still in use)",
        d->index, d->kept.free_errors);
  if (segments != d->segment_count)
    BAD("device %d: %zu segments listed, %zu counted", d->index, segments, d->segment_count);
  /* The indexes of every pool, private ones included, by kind. */
  size_t indexed[GCA_POOL_KINDS] = {0}, unmapped_indexed[GCA_POOL_KINDS] = {0};
  for (pool_t *pool = gca__device_pool_next(d, NULL); pool; pool = gca__device_pool_next(d, pool)) {
    indexed[pool->kind] += pool->free_count;
    unmapped_indexed[pool->kind] += pool->unmapped_count;
  }
  if (r.free_blocks[GCA_POOL_SMALL] != indexed[GCA_POOL_SMALL])
    BAD("device %d: small free indexes hold %zu blocks, the segments have %zu free", d->index,
        indexed[GCA_POOL_SMALL], r.free_blocks[GCA_POOL_SMALL]);
  if (r.free_blocks[GCA_POOL_LARGE] != indexed[GCA_POOL_LARGE])
    BAD("device %d: large free indexes hold %zu blocks, the segments have %zu free", d->index,
        indexed[GCA_POOL_LARGE], r.free_blocks[GCA_POOL_LARGE]);
  if (r.unmapped_blocks[GCA_POOL_SMALL] != unmapped_indexed[GCA_POOL_SMALL] ||
      r.unmapped_blocks[GCA_POOL_LARGE] != unmapped_indexed[GCA_POOL_LARGE])
    BAD("device %d: the unmapped indexes hold %zu and %zu blocks, the segments have %zu and %zu unmapped", d->index,
        unmapped_indexed[GCA_POOL_SMALL], unmapped_indexed[GCA_POOL_LARGE], r.unmapped_blocks[GCA_POOL_SMALL],
        r.unmapped_blocks[GCA_POOL_LARGE]);
  for (segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->paused_pages && !(seg->pool->owner && seg->pool->owner->paused))
      BAD("device %d: segment at %#" PRIxPTR " keeps pages for a resume but its pool is not paused", d->index,
          seg->addr);
  for (segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->pool->owner && gca__mempool_find(d, seg->pool->owner->id) != seg->pool->owner)
      BAD("device %d: segment at %#" PRIxPTR " belongs to a private pool the device does not list", d->index,
          seg->addr);
  /* Each stream's place in a pool's free index is held by its segments
   * there, and a device pool's also by the private pools' segments it is
   * home to (gca__segment_reserve). */
  for (pool_t *pool = gca__device_pool_next(d, NULL); pool; pool = gca__device_pool_next(d, pool)) {
    gca_stream_t stream;
    size_t held;
    for (size_t i = 0; gca__pool_stream_at(pool, i, &stream, &held); i++) {
      size_t want = 0;
      for (segment_t *seg = d->segments; seg; seg = seg->next)
        want += seg->stream == stream && (seg->pool == pool || (seg->pool->owner && home_pool(d, seg->pool) == pool));
      if (held != want)
        BAD("device %d: a %s pool holds %zu places for stream %#" PRIxPTR " in its free index, its segments need %zu",
            d->index, pool->kind == GCA_POOL_SMALL ? "small" : "large", held, (uintptr_t)stream, want);
    }
  }
  for (segment_t *seg = d->segments; seg; seg = seg->next)
    if (!gca__pool_stream_held(seg->pool, seg->stream))
      BAD("device %d: segment at %#" PRIxPTR " has no place for its stream in its pool's free index", d->index,
          seg->addr);
  if (r.allocated_blocks != d->allocated.count)
    BAD("device %d: allocation map holds %zu blocks, the segments have %zu allocated", d->index,
        d->allocated.count, r.allocated_blocks);
  int rc = check_events(d, &r);
  if (rc) return rc;
  if ((rc = check_pages_unique(d))) return rc;

  gca_stats_t materialized;
  gca__stats_materialize(&d->stats, &materialized);
  const gca_stats_t *s = &materialized;
  if ((rc = compare_family(d, "segment", s->segment, r.segment))) return rc;
  if ((rc = compare_family(d, "reserved_bytes", s->reserved_bytes, r.reserved))) return rc;
  if ((rc = compare_family(d, "allocation", s->allocation, r.allocation))) return rc;
  if ((rc = compare_family(d, "allocated_bytes", s->allocated_bytes, r.allocated))) return rc;
  if ((rc = compare_family(d, "active", s->active, r.active))) return rc;
  if ((rc = compare_family(d, "active_bytes", s->active_bytes, r.active_bytes))) return rc;
  if ((rc = compare_family(d, "requested_bytes", s->requested_bytes, r.requested))) return rc;
  if ((rc = compare_family(d, "inactive_split", s->inactive_split, r.split))) return rc;
  if ((rc = compare_family(d, "inactive_split_bytes", s->inactive_split_bytes, r.split_bytes))) return rc;
  if (s->oversize_allocations.current != r.oversize_allocations)
    BAD("device %d: oversize_allocations.current is %" PRId64 " but %" PRId64 " blocks are oversize",
        d->index, s->oversize_allocations.current, r.oversize_allocations);
  if (s->oversize_segments.current != r.oversize_segments)
    BAD("device %d: oversize_segments.current is %" PRId64 " but %" PRId64 " segments are oversize",
        d->index, s->oversize_segments.current, r.oversize_segments);
  /* The books against the device's answers: every byte it handed out and
   * has not taken back is a segment, a mapped page or a kept page. */
  size_t booked = (size_t)s->reserved_bytes[GCA_POOL_ALL].current + d->kept.page_bytes;
  if (d->device_bytes != booked)
    BAD("device %d: the device has handed out %zu bytes not taken back, but the books hold %zu (%zu reserved, "
        "%zu in pages kept after a refused free): memory was lost",
        d->index, d->device_bytes, booked, booked - d->kept.page_bytes, d->kept.page_bytes);
  if (atomic_load(&d->allocated_now) != s->allocated_bytes[GCA_POOL_ALL].current ||
      atomic_load(&d->reserved_now) != s->reserved_bytes[GCA_POOL_ALL].current)
    BAD("device %d: the lock-free byte counters disagree with the statistics", d->index);
  return GCA_OK;
}
