/* One device's caching allocator: the malloc and free paths and the cache
 * release, under the device's single lock.
 *
 * malloc, as PyTorch does it: round the size, pick the pool, take the best
 * fit. On a miss: ask the device for a segment; if the device is full, free
 * cached oversize blocks that could cover the request and ask again; then
 * free every whole cached segment and ask once more (num_alloc_retries);
 * then fail with an out-of-memory message in PyTorch's form (num_ooms).
 * The cached path makes no system call and allocates nothing (descriptors
 * come from a recycled list); its cost is a tree lookup and a hash insert.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int device_init(device_t *d, int index, backend_t *backend, const config_t *cfg) {
  memset(d, 0, sizeof *d);
  if (lock_init(&d->lock) != 0)
    return set_error(GCA_ERR_NOMEM, "cannot create the lock of device %d", index);
  d->index = index;
  d->backend = backend;
  d->config = *cfg;
  pool_init(&d->small_pool, GCA_POOL_SMALL);
  pool_init(&d->large_pool, GCA_POOL_LARGE);
  if (block_map_init(&d->allocated) != GCA_OK) {
    lock_destroy(&d->lock);
    return set_error(GCA_ERR_NOMEM, "out of host memory creating device %d", index);
  }
  atomic_init(&d->allocated_now, 0);
  atomic_init(&d->reserved_now, 0);
  atomic_init(&d->span_lo, UINTPTR_MAX);
  atomic_init(&d->span_hi, 0);
  return GCA_OK;
}

void device_destroy(device_t *d) {
  /* Give every segment back, live blocks included: the allocator is going
   * away and nothing may leak on the device. */
  segment_t *seg = d->segments;
  while (seg) {
    segment_t *next = seg->next;
    d->backend->ops->free(d->backend->state, d->index, seg->addr, seg->size);
    free(seg);
    seg = next;
  }
  d->segments = NULL;
  block_chunks_free(d);
  block_map_destroy(&d->allocated);
  lock_destroy(&d->lock);
}

GCA_COLD static void explain_oom(device_t *d, size_t rounded) {
  size_t free_bytes = 0, total = 0;
  d->backend->ops->mem_get_info(d->backend->state, d->index, &free_bytes, &total);
  char want[32], cap[32], avail[32], alloc[32], unalloc[32];
  format_bytes(segment_size_for(rounded), want, sizeof want);
  format_bytes(total, cap, sizeof cap);
  format_bytes(free_bytes, avail, sizeof avail);
  int64_t allocated = family_current(&d->stats, FAM_ALLOCATED_BYTES);
  int64_t reserved = family_current(&d->stats, FAM_RESERVED_BYTES);
  format_bytes((uint64_t)allocated, alloc, sizeof alloc);
  format_bytes((uint64_t)(reserved - allocated), unalloc, sizeof unalloc);
  set_error(GCA_ERR_OOM,
            "out of memory. Tried to allocate %s. Device %d has a total capacity of %s of which %s is "
            "free. Of the allocated memory %s is allocated by gcalloc, and %s is reserved by gcalloc but "
            "unallocated.",
            want, d->index, cap, avail, alloc, unalloc);
}

/* The miss path: get a new segment, freeing cache when the device is full. */
GCA_COLD static block_t *allocate_on_miss(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded) {
  int rc;
  block_t *b = segment_alloc(d, pool, stream, rounded, &rc);
  if (b || rc != GCA_ERR_OOM) return b;

  if (segment_release_available(d, pool, stream, rounded)) {
    b = segment_alloc(d, pool, stream, rounded, &rc);
    if (b || rc != GCA_ERR_OOM) return b;
  }

  d->stats.num_sync_all_streams++;
  segment_release_all_cached(d);
  d->stats.num_alloc_retries++;
  b = segment_alloc(d, pool, stream, rounded, &rc);
  if (b || rc != GCA_ERR_OOM) return b;

  d->stats.num_ooms++;
  explain_oom(d, rounded);
  return NULL;
}

void *device_malloc(device_t *d, size_t size, gca_stream_t stream) {
  lock_acquire(&d->lock);
  size_t rounded = round_size(&d->config, size);
  if (unlikely(rounded == 0)) {
    lock_release(&d->lock);
    set_error(GCA_ERR_INVALID, "cannot allocate %zu bytes: the size overflows when rounded", size);
    return NULL;
  }
  pool_t *pool = rounded <= SMALL_SIZE ? &d->small_pool : &d->large_pool;
  block_t *pred = NULL;
  block_t *b = pool_best_fit(pool, &d->config, stream, rounded, &pred);
  bool in_index = b != NULL;
  if (unlikely(!in_index)) {
    b = allocate_on_miss(d, pool, stream, rounded);
    if (unlikely(b == NULL)) {
      lock_release(&d->lock);
      return NULL;
    }
  }
  uintptr_t addr = block_take(d, b, pred, in_index, rounded, size)->addr;
  lock_release(&d->lock);
  return (void *)addr;
}

int device_free_locked(device_t *d, uintptr_t addr) {
  block_t *b = block_map_take(&d->allocated, addr);
  if (unlikely(b == NULL)) return GCA_ERR_BAD_POINTER;
  int kind = pool_kind_of(b);
  family_decrease(&d->stats, FAM_ALLOCATION, kind, 1);
  family_decrease(&d->stats, FAM_ALLOCATED_BYTES, kind, (int64_t)b->size);
  atomic_store_explicit(&d->allocated_now, family_current(&d->stats, FAM_ALLOCATED_BYTES), memory_order_relaxed);
  block_give_back(d, b);
  return GCA_OK;
}

GCA_COLD bool device_explain_bad_pointer(device_t *d, uintptr_t addr) {
  for (segment_t *seg = d->segments; seg; seg = seg->next) {
    if (addr < seg->addr || addr - seg->addr >= seg->size) continue;
    for (block_t *b = seg->head; b; b = b->next) {
      if (addr < b->addr || addr - b->addr >= b->size) continue;
      if (b->allocated) {
        set_error(GCA_ERR_BAD_POINTER,
                  "cannot free %p: it points %zu bytes inside the allocation at %p (%zu bytes) on device %d; "
                  "free the pointer gca_malloc returned",
                  (void *)addr, (size_t)(addr - b->addr), (void *)b->addr, b->size, d->index);
      } else {
        set_error(GCA_ERR_BAD_POINTER,
                  "cannot free %p: it is not allocated (it lies in free cached memory of device %d; "
                  "was it freed twice?)",
                  (void *)addr, d->index);
      }
      return true;
    }
  }
  return false;
}

void device_empty_cache(device_t *d) {
  lock_acquire(&d->lock);
  /* PyTorch counts a synchronization of all streams here, before releasing;
   * with stream events (a later issue) it really waits for them. */
  d->stats.num_sync_all_streams++;
  segment_release_all_cached(d);
  lock_release(&d->lock);
}
