/* PyTorch's expandable segments (expandable.c), with the lock held:
 * mapping and unmapping pages, pause and resume of a pool's pages, and the
 * page census.
 */
#ifndef GCALLOC_CORE_EXPANDABLE_H
#define GCALLOC_CORE_EXPANDABLE_H

#include "core/core.h"

/* expandable.c, with the lock held: PyTorch's expandable segments. */
/* Whether the backend has virtual memory (asked once; logs once if not). */
bool gca__expandable_available(device_t *d);
/* Unmap the free runs of pages of expandable segments, largest first,
 * until `need` bytes went back (for a peer: ipc_cooperation); the bytes.
 * Each run goes whole (unmapping only its top pages was measured to leave
 * memory neither live nor released under churn: bench-sharing, 8
 * processes, 1-7 avoidable out-of-memory errors in 24 turns; whole runs,
 * none). */
size_t gca__expandable_release_upto(device_t *d, size_t need);
/* The page an expandable segment of `pool` maps at a time. */
size_t gca__expandable_page_size(const device_t *d, const pool_t *pool);
/* A block for `rounded` bytes from an expandable segment of (pool, stream),
 * mapping memory as needed (PyTorch's try_allocate_expandable_block), handed
 * out with block_take; NULL with *rc set. */
block_t *gca__expandable_take(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested, int *rc);
/* Best fit among expandable blocks: from the lower bound `b`, PyTorch's walk
 * to the block whose size plus the unmapped space after it is smallest (or,
 * with expandable segments off, past expandable blocks). */
block_t *gca__expandable_refit(pool_t *pool, const config_t *cfg, gca_stream_t stream, block_t *b);
/* Unmap every whole free page of every expandable segment, after waiting
 * for the segment's stream, and give back the address range of segments
 * left with nothing mapped (PyTorch's release_blocks for them). */
void gca__expandable_release_all(device_t *d);
/* The same for one pool's free expandable blocks. */
void gca__expandable_release_pool(device_t *d, pool_t *pool);
/* Pause: unmap and destroy every mapped page of seg, marked in
 * seg->paused_pages; the bytes given back are added to *released. Pages
 * the device will not unmap stay mapped (the first error is returned). */
int gca__expandable_pause(device_t *d, segment_t *seg, size_t *released);
/* Resume: new memory at every marked page not mapped yet; on failure the
 * pages mapped so far stay, the rest stay marked. */
int gca__expandable_resume(device_t *d, segment_t *seg);
/* A paused segment of an ending pool, nothing mapped in it: give its
 * addresses back. */
void gca__expandable_release_paused(device_t *d, segment_t *seg);
/* At device destruction: unmap and destroy everything and give the range
 * back (when give_back: see device_destroy), and free the page table.
 * Returns the bytes the device would not take back. */
size_t gca__expandable_segment_destroy(device_t *d, segment_t *seg, bool give_back);
/* At close: the kept pages given back (with give_back) and forgotten;
 * returns the bytes the device would not take back. */
size_t gca__expandable_kept_destroy(device_t *d, bool give_back);
/* How many snapshot segments the device's segments make (one per mapped run of an expandable one). */
size_t gca__expandable_snapshot_count(const device_t *d);

/* The page census (inspect.h), from the device. */
int gca__expandable_census(const device_t *d, bool maps, page_census_t *out);
/* The same counts without maps, from what the device keeps up to date
 * (each range's mapped bytes and top, the free indexes): cheap enough to
 * take at every new peak of a replay. Nothing to free. */
void gca__expandable_census_counts(device_t *d, page_census_t *out);
static inline bool device_has_expandable(const device_t *d) {
  return d->small_pool.expandable_segments || d->large_pool.expandable_segments;
}

#endif /* GCALLOC_CORE_EXPANDABLE_H */
