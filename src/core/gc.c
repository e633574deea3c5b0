/* Garbage collection of cached blocks, PyTorch's garbage_collect_cached_blocks.
 *
 * It runs on a cache miss, before the device is asked for memory, only when a
 * per-process memory fraction is set and garbage_collection_threshold t is
 * in (0, 1); and acts only when reserved memory is above t x allowed. The
 * target is that excess. Candidates are whole (unsplit) free blocks of the
 * large pool, of any stream. Each has an age: how many best-fit searches of
 * the pool have happened since it became free (block_gc_age). In
 * rounds, every candidate at least as old as the candidates' average age is
 * given back, until the target is met or a round frees nothing. The oldest go
 * first; a round does not stop at the target, so that GC does not run again
 * at once. It waits for no event: a segment whose stream still has queued work
 * is given back once that work completes (segment_release).
 */
#include "core/core.h"

/* PyTorch's GC leaves expandable segments alone: their memory goes back
 * page by page when the cache is released. */
static bool whole(const block_t *b) { return !b->prev && !b->next && !b->expandable; }

void gca__gc_collect(device_t *d) {
  if (!limit_on(d) || d->config.gc_threshold <= 0) return;
  double threshold = d->config.gc_threshold * (double)d->limit.allowed;
  double reserved = (double)family_current(&d->stats, FAM_RESERVED_BYTES);
  if (reserved <= threshold) return;
  double target = reserved - threshold;

  pool_t *pool = &d->large_pool;
  double total_age = 0;
  size_t candidates = 0;
  for (block_t *b = gca__pool_first(pool); b; b = gca__pool_next(pool, b)) {
    if (!whole(b)) continue;
    total_age += (double)block_gc_age(pool, b);
    candidates++;
  }
  double reclaimed = 0;
  bool freed = true;
  while (reclaimed < target && freed && candidates > 0) {
    double average = total_age / (double)candidates;
    freed = false;
    block_t *b = gca__pool_first(pool);
    while (b) {
      block_t *next = gca__pool_next(pool, b);
      if (whole(b) && (double)block_gc_age(pool, b) >= average) {
        double age = (double)block_gc_age(pool, b), size = (double)b->size;
        if (gca__segment_release(d, b)) {
          freed = true;
          reclaimed += size;
          total_age -= age;
          candidates--;
          d->stats.num_gc_releases++;
        }
      }
      b = next;
    }
  }
}
