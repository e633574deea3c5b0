/* Expandable segments (expandable_segments:True), with PyTorch's semantics,
 * and gcalloc's page stitching on top.
 *
 * An expandable segment is one range of addresses per (pool, stream),
 * reserved once (1.125 x the device's memory, as PyTorch does, so that pages
 * unmapped early in the range can be mapped again at its end) and backed by
 * physical pages mapped on demand: 2 MiB pages for the small pool, 20 MiB
 * for the large one (fewer, larger mappings: the driver's cost is per
 * mapping). Blocks tile the whole range as in any segment; the parts with
 * nothing mapped are UNMAPPED blocks, kept in the pool's unmapped index by
 * (stream, address). Reserved bytes are the mapped bytes.
 *
 * A miss maps memory at the lowest address where a free block followed by
 * unmapped space (or unmapped space alone) has room for the request, so
 * allocations tile one range and shape changes leave no unusable slivers.
 * Memory is unmapped only when the cache is released (empty_cache, or the
 * out-of-memory ladder): every whole free page, after waiting for the
 * segment's stream, since unmapping is not ordered with queued work.
 *
 * A page the device refuses to destroy after it was unmapped is kept (it is
 * still the process's memory) and offered back at every release after, as
 * an ordinary segment whose free was refused stays cached; gca_check holds
 * the books, kept pages included, to what the device has handed out.
 *
 * Stitching (stitching:True, gcalloc's own): both pools map 2 MiB pages,
 * and before creating new physical pages for a miss, whole free pages of
 * the same stream are moved from wherever they sit, in the pool's range
 * first, then in the device's other default pool (unmap there, map here).
 * The free memory of both pools is then used before the device is asked
 * for more, so fragmentation costs no more than the partly used pages
 * around live blocks. A move waits for the stream, like any unmap.
 *
 * Everything here runs with the device lock held.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/events.h"
#include "core/expandable.h"
#include "core/history.h"

#define VM(d, fn, ...) ((d)->backend->ops->fn((d)->backend->state, (d)->index, __VA_ARGS__))

/* Runs of pages: one backend call where it serves them (vm_create_many and
 * friends: the sim, whose per-call lock and look-ups were most of a replay
 * that maps thousands of pages), else one call per page. */

/* n pages of `page` bytes into handles: GCA_OK with all n, else the
 * error with *made of them created. */
static int create_pages(device_t *d, size_t page, size_t n, uintptr_t *handles, size_t *made) {
  int rc = GCA_OK;
  if (d->backend->ops->vm_create_many) {
    rc = VM(d, vm_create_many, page, n, handles, made);
  } else {
    *made = 0;
    while (*made < n && (rc = VM(d, vm_create, page, &handles[*made])) == GCA_OK) ++*made;
  }
  d->device_bytes += *made * page;
  return rc;
}

typedef struct kept_page {
  uintptr_t handle;
  size_t size;
} kept_page_t;

/* A page the device would not take back (or that may not be given back
 * during a graph capture: not `refused`) is still its memory and ours:
 * kept, to be offered again, rather than dropped (which would leak it). */
static void keep_page(device_t *d, uintptr_t handle, size_t size, bool refused) {
  if (refused) gca__note_refused_free(d);
  if (d->kept.page_count == d->kept.page_cap) {
    kept_page_t *grown = gca__grow_array(d->kept.pages, &d->kept.page_cap, sizeof *grown, 16);
    if (!grown) return; /* lost to the books: gca_check's device count says so */
    d->kept.pages = grown;
  }
  d->kept.pages[d->kept.page_count++] = (kept_page_t){handle, size};
  d->kept.page_bytes += size;
}

/* Back to the device, n pages of `page` bytes (handles[] may be reordered);
 * those it refuses are kept. */
static void destroy_pages(device_t *d, uintptr_t *handles, size_t n, size_t page) {
  size_t refused = 0;
  if (d->capture.count) { /* (nothing is destroyed during a graph capture: kept, offered back later) */
    refused = n;
  } else if (d->backend->ops->vm_destroy_many) {
    if (VM(d, vm_destroy_many, handles, n, &refused) == GCA_OK) refused = 0;
  } else {
    for (size_t i = 0; i < n; i++)
      if (VM(d, vm_destroy, handles[i]) != GCA_OK) handles[refused++] = handles[i];
  }
  d->device_bytes -= (n - refused) * page;
  for (size_t i = 0; i < refused; i++) keep_page(d, handles[i], page, !d->capture.count);
}

/* Offer the kept pages back (every release does, first). A page the device
 * says is not its memory at all is a bookkeeping error: dropped, counted
 * for gca_check. */
static void retry_kept_pages(device_t *d) {
  size_t kept = 0;
  for (size_t i = 0; i < d->kept.page_count; i++) {
    kept_page_t k = d->kept.pages[i];
    int rc = VM(d, vm_destroy, k.handle);
    if (rc == GCA_OK || rc == GCA_ERR_BAD_POINTER) {
      d->kept.page_bytes -= k.size;
      d->device_bytes -= k.size;
      if (rc == GCA_OK) {
        d->stats.num_device_free++;
        segment_observed(d, false, k.size);
      } else {
        d->kept.free_errors++;
      }
      continue;
    }
    gca__note_refused_free(d);
    d->kept.pages[kept++] = k;
  }
  d->kept.page_count = kept;
}

/* handles[i] mapped at addr + i * page: all of them, or none. */
static int map_pages(device_t *d, uintptr_t addr, size_t page, size_t n, const uintptr_t *handles) {
  if (d->backend->ops->vm_map_many) return VM(d, vm_map_many, addr, page, n, handles);
  int rc = GCA_OK;
  size_t mapped = 0;
  while (mapped < n && (rc = VM(d, vm_map, addr + mapped * page, page, handles[mapped])) == GCA_OK) mapped++;
  if (rc != GCA_OK && mapped) (void)VM(d, vm_unmap, addr, mapped * page);
  return rc;
}

bool gca__expandable_available(device_t *d) {
  if (d->vm.state == 0) {
    const backend_ops_t *ops = d->backend->ops;
    size_t granularity = 0;
    bool ok = ops->vm_granularity && ops->vm_reserve && ops->vm_unreserve && ops->vm_create && ops->vm_destroy &&
              ops->vm_map && ops->vm_unmap && ops->vm_granularity(d->backend->state, d->index, &granularity) == GCA_OK &&
              granularity >= MIN_BLOCK_SIZE && (granularity & (granularity - 1)) == 0;
    d->vm.granularity = granularity;
    d->vm.state = ok ? 1 : -1;
    d->vm.unwarned = !ok && d->config.expandable_segments; /* (said once, outside the lock: malloc_on_miss) */
    if (!ok) gca__clear_error();
  }
  return d->vm.state > 0;
}

/* The page size of the pool's segments: PyTorch's (2 MiB small, 20 MiB
 * large), rounded up to the device's granularity. With stitching, 2 MiB in
 * both pools: a large block then leaves less of its last page empty, more
 * free memory lies in whole pages that can be moved, and a page of either
 * pool can serve the other. */
static size_t page_size_of(const device_t *d, const pool_t *pool) {
  /* (A pool made with GCA_POOL_FINE_PAGES, 2 MiB too: its caller sizes
   * its own segments, as PyTorch's caching allocator behind a MemPool
   * does, and a 20 MiB page would keep up to 18 MiB beyond each mapped.) */
  /* (Cooperating, 2 MiB too: large blocks are whole multiples of it, so no
   * page holds memory that is neither live nor releasable, and "the live
   * memory of all processes fits" is what the device can hold.) */
  bool fine = pool->kind == GCA_POOL_SMALL || d->config.stitching || d->config.ipc_cooperation ||
              pool->fine_pages;
  size_t want = fine ? SMALL_BUFFER : LARGE_BUFFER;
  size_t g = d->vm.granularity;
  return (want + g - 1) / g * g;
}

size_t gca__expandable_page_size(const device_t *d, const pool_t *pool) { return page_size_of(d, pool); }

/* ---- segments ----------------------------------------------------------- */

/* A fresh segment for (pool, stream): its whole range one unmapped block. */
static block_t *new_segment(device_t *d, pool_t *pool, gca_stream_t stream, int *rc) {
  size_t free_bytes = 0, total = 0;
  *rc = d->backend->ops->mem_get_info(d->backend->state, d->index, &free_bytes, &total);
  if (*rc != GCA_OK) return NULL;
  size_t page = page_size_of(d, pool);
  size_t pages = (total + total / 8 + page - 1) / page;
  if (pages == 0) pages = 1;
  size_t size = pages * page;
  segment_t *seg;
  block_t *b;
  if (!gca__segment_descriptors_new(d, pool, stream, &seg, &b, rc)) return NULL;
  uintptr_t addr = 0;
  *rc = VM(d, vm_reserve, size, &addr);
  if (*rc != GCA_OK) {
    gca__segment_descriptors_drop(d, pool, stream, seg, b);
    return NULL;
  }
  gca__segment_start(d, seg, b, pool, stream, addr, size);
  seg->expandable = true;
  seg->page_size = page;
  pool->expandable_segments++;
  b->state = BLOCK_UNMAPPED;
  b->expandable = true;
  gca__pool_unmapped_insert(pool, b);
  gca__widen_span(d, addr, addr + size);
  return b;
}

/* Give back the range of a segment with nothing mapped (one unmapped block). */
static void release_segment(device_t *d, segment_t *seg) {
  block_t *b = seg->head;
  if (VM(d, vm_unreserve, seg->addr, seg->size) != GCA_OK) {
    /* Kept: an empty range costs no memory, may serve later, and is offered
     * again at the pool's next release while it stays empty. */
    gca__note_refused_free(d);
    return;
  }
  gca__pool_unmapped_remove(seg->pool, b);
  gca__segment_unlink(d, seg);
  gca__segment_unreserve(d, seg->pool, seg->stream);
  seg->pool->expandable_segments--;
  free(seg->pages);
  free(seg);
  gca__block_recycle(d, b);
}

/* At close, each call that gives something back is tried CLOSE_TRIES
 * times: whether it went (gca__given_back). */
static bool destroy_at_close(device_t *d, uintptr_t handle) {
  bool done = false;
  for (int i = 0; i < CLOSE_TRIES && !done; i++) done = gca__given_back(VM(d, vm_destroy, handle));
  return done;
}

static bool unmap_at_close(device_t *d, uintptr_t addr, size_t size) {
  bool done = false;
  for (int i = 0; i < CLOSE_TRIES && !done; i++) done = gca__given_back(VM(d, vm_unmap, addr, size));
  return done;
}

size_t gca__expandable_kept_destroy(device_t *d, bool give_back) {
  size_t left = 0;
  for (size_t i = 0; give_back && i < d->kept.page_count; i++)
    if (!destroy_at_close(d, d->kept.pages[i].handle)) left += d->kept.pages[i].size;
  free(d->kept.pages);
  d->kept.pages = NULL;
  d->kept.page_count = d->kept.page_cap = d->kept.page_bytes = 0;
  return left;
}

size_t gca__expandable_segment_destroy(device_t *d, segment_t *seg, bool give_back) {
  size_t page = seg->page_size, left = 0;
  for (size_t i = 0; give_back && i < seg->page_cap; i++) {
    if (!seg->pages[i]) continue;
    /* (a page still mapped cannot be destroyed: it stays the device's) */
    if (!unmap_at_close(d, seg->addr + i * page, page) || !destroy_at_close(d, seg->pages[i])) left += page;
  }
  bool released = !give_back; /* (a range holds no memory: one refused for good is not counted) */
  for (int i = 0; i < CLOSE_TRIES && !released; i++) released = gca__given_back(VM(d, vm_unreserve, seg->addr, seg->size));
  free(seg->pages);
  seg->pages = NULL;
  free(seg->paused_pages);
  seg->paused_pages = NULL;
  return left;
}

static bool ensure_pages(segment_t *seg, size_t end) {
  if (end <= seg->page_cap) return true;
  size_t cap = seg->page_cap ? seg->page_cap : 16;
  while (cap < end) cap *= 2;
  uintptr_t *grown = realloc(seg->pages, cap * sizeof *grown);
  if (!grown) return false;
  memset(grown + seg->page_cap, 0, (cap - seg->page_cap) * sizeof *grown);
  seg->pages = grown;
  seg->page_cap = cap;
  return true;
}

/* The whole pages inside block b: how many, the first in *first. */
static size_t whole_pages(const block_t *b, size_t *first) {
  const segment_t *seg = b->segment;
  size_t page = seg->page_size, offset = b->addr - seg->addr;
  size_t begin = (offset + page - 1) / page, end = (offset + b->size) / page;
  *first = begin;
  return end > begin ? end - begin : 0;
}

/* ---- unmapping ---------------------------------------------------------- */

/* Unmap up to `max` whole pages of free expandable block b (the highest
 * ones), after waiting for its stream (unless the caller just did:
 * `waited`). The pages' physical memory goes into handles_out when given
 * (a move), else back to the device. b becomes the unmapped part, merged
 * with unmapped neighbours; the free parts around it get descriptors of
 * their own. Returns the pages unmapped (0: nothing changed). */
static size_t unmap_pages(device_t *d, block_t *b, size_t max, uintptr_t *handles_out, bool waited) {
  segment_t *seg = b->segment;
  pool_t *pool = block_pool(b);
  size_t page = seg->page_size, first;
  size_t n = whole_pages(b, &first);
  if (n > max) {
    first += n - max;
    n = max;
  }
  if (n == 0 || (!waited && !gca__segment_drained(d, seg))) return 0; /* (work may wait in the framework's queue) */
  uintptr_t at = seg->addr + first * page;
  size_t bytes = n * page;
  size_t before = at - b->addr, after = b->addr + b->size - (at + bytes);
  block_t *low = before ? gca__block_new(d) : NULL, *high = after ? gca__block_new(d) : NULL;
  if ((before && !low) || (after && !high)) {
    if (low) gca__block_recycle(d, low);
    if (high) gca__block_recycle(d, high);
    return 0;
  }
  /* Work queued on the stream may still use these pages through the block
   * freed to the cache; an unmap is not ordered behind it. */
  int rc = GCA_OK;
  if (!waited) rc = gca__events_wait_stream(d, seg->stream);
  if (rc == GCA_OK) rc = VM(d, vm_unmap, at, bytes);
  if (rc == GCA_ERR_CORRUPT) {
    d->kept.free_errors++; /* unmapped, but the device says it was in use */
  } else if (rc != GCA_OK) {
    gca__note_refused_free(d);
    if (low) gca__block_recycle(d, low);
    if (high) gca__block_recycle(d, high);
    return 0;
  }
  if (handles_out) memcpy(handles_out, seg->pages + first, n * sizeof *handles_out);
  else destroy_pages(d, seg->pages + first, n, page);
  memset(seg->pages + first, 0, n * sizeof *seg->pages);
  seg->mapped_bytes -= bytes;
  if (first + n == seg->mapped_top) { /* the top went: down to the next page mapped */
    size_t top = first;
    while (top && !seg->pages[top - 1]) top--;
    seg->mapped_top = top;
  }
  d->vm.pages_unmapped += n;

  gca__pool_remove(pool, b);
  if (low) {
    *low = *b;
    low->size = before;
    low->next = b;
    if (low->prev) low->prev->next = low;
    else seg->head = low;
    b->prev = low;
    gca__pool_insert(pool, low);
  }
  if (high) {
    block_split_tail(b, high, after);
    gca__pool_insert(pool, high);
  }
  b->addr = at;
  b->size = bytes;
  b->state = BLOCK_UNMAPPED;
  block_t *x = b->prev;
  if (x && x->state == BLOCK_UNMAPPED) {
    gca__pool_unmapped_remove(pool, x);
    block_absorb_prev(b);
    gca__block_recycle(d, x);
  }
  x = b->next;
  if (x && x->state == BLOCK_UNMAPPED) {
    gca__pool_unmapped_remove(pool, x);
    block_absorb_next(b);
    gca__block_recycle(d, x);
  }
  gca__pool_unmapped_insert(pool, b);

  family_decrease(&d->stats, FAM_RESERVED_BYTES, pool->kind, (int64_t)bytes);
  gca__mirror_reserved(d);
  if (unlikely(d->obs.recording)) gca__history_event(d, GCA_TRACE_SEGMENT_UNMAP, at, bytes, seg->stream);
  if (handles_out) {
    d->stats.num_pages_moved += (int64_t)n;
  } else {
    d->stats.num_device_free++;
    segment_observed(d, false, bytes);
  }
  return n;
}

static void release_empty_ranges(device_t *d, pool_t *pool);

void gca__expandable_release_pool(device_t *d, pool_t *pool) {
  if (!pool->expandable_segments) return;
  release_empty_ranges(d, pool); /* (first: a range refused now waits for the next release) */
  /* Gather first: unmapping changes the index under a walk. Unmapping one
   * free block never touches another free block's descriptor. */
  size_t count = 0;
  for (block_t *b = gca__pool_first(pool); b; b = gca__pool_next(pool, b)) count += b->expandable;
  block_t **list = count ? malloc(count * sizeof *list) : NULL;
  if (count && !list) return;
  size_t n = 0;
  for (block_t *b = gca__pool_first(pool); b; b = gca__pool_next(pool, b))
    if (b->expandable) list[n++] = b;
  for (size_t i = 0; i < n; i++) {
    block_t *b = list[i];
    unmap_pages(d, b, SIZE_MAX, NULL, false);
    if (b->state == BLOCK_UNMAPPED && !b->prev && !b->next) release_segment(d, b->segment);
  }
  free(list);
}

/* The pool's ranges with nothing mapped, given back: those the device
 * would not release before (offered again; one that served since holds
 * pages, or was released then) and those stitching emptied (every page
 * moved out: no free block left in them for the walk over the index). */
static void release_empty_ranges(device_t *d, pool_t *pool) {
  for (segment_t *seg = d->segments, *next; seg; seg = next) {
    next = seg->next;
    if (seg->pool != pool || !seg->expandable) continue;
    if (seg->head->state == BLOCK_UNMAPPED && !seg->head->next && !seg->paused_pages) release_segment(d, seg);
  }
}

/* Free runs of pages, for gca__expandable_release_upto: largest first. */
typedef struct free_run {
  block_t *b;
  size_t bytes;
} free_run_t;

static int by_run_bytes(const void *x, const void *y) {
  const free_run_t *a = x, *b = y;
  return a->bytes < b->bytes ? 1 : a->bytes > b->bytes ? -1 : 0;
}

size_t gca__expandable_release_upto(device_t *d, size_t need) {
  if (d->kept.page_count) retry_kept_pages(d);
  pool_t *pools[2] = {&d->large_pool, &d->small_pool};
  size_t count = 0;
  for (int k = 0; k < 2; k++)
    if (pools[k]->expandable_segments)
      for (block_t *b = gca__pool_first(pools[k]); b; b = gca__pool_next(pools[k], b)) count += b->expandable;
  free_run_t *runs = count ? malloc(count * sizeof *runs) : NULL;
  if (count && !runs) return 0;
  size_t n = 0;
  for (int k = 0; k < 2; k++) {
    if (!pools[k]->expandable_segments) continue;
    for (block_t *b = gca__pool_first(pools[k]); b; b = gca__pool_next(pools[k], b)) {
      size_t first, pages = b->expandable ? whole_pages(b, &first) : 0;
      if (pages) runs[n++] = (free_run_t){b, pages * b->segment->page_size};
    }
  }
  if (n > 1) qsort(runs, n, sizeof *runs, by_run_bytes); /* (runs is NULL when there is none) */
  /* (Unmapping one free block never touches another's descriptor; a
   * segment goes only with its one block.) */
  size_t released = 0;
  for (size_t i = 0; i < n && released < need; i++) {
    block_t *b = runs[i].b;
    size_t page = b->segment->page_size;
    released += unmap_pages(d, b, SIZE_MAX, NULL, false) * page; /* (the whole run: see above) */
    if (b->state == BLOCK_UNMAPPED && !b->prev && !b->next) release_segment(d, b->segment);
  }
  free(runs);
  return released;
}

void gca__expandable_release_all(device_t *d) {
  if (d->kept.page_count) retry_kept_pages(d);
  gca__expandable_release_pool(d, &d->large_pool);
  gca__expandable_release_pool(d, &d->small_pool);
}

/* The books of pages [first, first + n) of seg, just mapped with handles
 * (`created` of them new from the device, the rest moved there). */
static void note_mapped(device_t *d, segment_t *seg, size_t first, size_t n, const uintptr_t *handles, size_t created) {
  size_t page = seg->page_size, bytes = n * page;
  memcpy(seg->pages + first, handles, n * sizeof *handles);
  seg->mapped_bytes += bytes;
  if (first + n > seg->mapped_top) seg->mapped_top = first + n;
  d->vm.pages_mapped += n;
  family_increase(&d->stats, FAM_RESERVED_BYTES, seg->pool->kind, (int64_t)bytes);
  gca__mirror_reserved(d);
  if (created) d->stats.num_device_alloc++;
  if (unlikely(d->obs.recording)) gca__history_event(d, GCA_TRACE_SEGMENT_MAP, seg->addr + first * page, bytes, seg->stream);
  if (created) segment_observed(d, true, created * page);
}

/* ---- pausing a pool ----------------------------------------------------- */

/* One past the highest page mapped. */
static size_t top_page(const segment_t *seg) {
  size_t top = seg->page_cap;
  while (top && !seg->pages[top - 1]) top--;
  return top;
}

int gca__expandable_pause(device_t *d, segment_t *seg, size_t *released) {
  size_t page = seg->page_size;
  if (!seg->paused_pages && !(seg->paused_pages = calloc(seg->page_cap ? seg->page_cap : 1, 1)))
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory for allocator bookkeeping");
  int status = GCA_OK;
  size_t unmapped = 0;
  for (size_t i = 0; i < seg->page_cap;) {
    size_t n = 0;
    while (i + n < seg->page_cap && seg->pages[i + n]) n++;
    if (!n) {
      i++;
      continue;
    }
    uintptr_t at = seg->addr + i * page;
    int rc = VM(d, vm_unmap, at, n * page);
    if (rc == GCA_ERR_CORRUPT) {
      d->kept.free_errors++; /* unmapped, but the device says it was in use */
    } else if (rc != GCA_OK) { /* still mapped: it stays, and is not given back */
      gca__note_refused_free(d);
      if (status == GCA_OK) status = rc;
      i += n;
      continue;
    }
    destroy_pages(d, seg->pages + i, n, page);
    memset(seg->pages + i, 0, n * sizeof *seg->pages);
    memset(seg->paused_pages + i, 1, n);
    unmapped += n;
    if (unlikely(d->obs.recording)) gca__history_event(d, GCA_TRACE_SEGMENT_UNMAP, at, n * page, seg->stream);
    i += n;
  }
  size_t bytes = unmapped * page;
  seg->mapped_bytes -= bytes;
  seg->mapped_top = top_page(seg);
  d->vm.pages_unmapped += unmapped;
  if (unmapped) {
    family_decrease(&d->stats, FAM_RESERVED_BYTES, seg->pool->kind, (int64_t)bytes);
    gca__mirror_reserved(d);
    d->stats.num_device_free++;
    segment_observed(d, false, bytes);
  }
  *released += bytes;
  return status;
}

int gca__expandable_resume(device_t *d, segment_t *seg) {
  if (!seg->paused_pages) return GCA_OK;
  size_t page = seg->page_size;
  for (size_t i = 0; i < seg->page_cap;) {
    size_t n = 0;
    while (i + n < seg->page_cap && seg->paused_pages[i + n] && !seg->pages[i + n]) n++;
    if (!n) {
      seg->paused_pages[i++] = 0; /* (not marked, or still mapped: nothing to do) */
      continue;
    }
    if (gca__device_limit_refuses(d, n * page)) return GCA_ERR_OOM;
    uintptr_t *handles = malloc(n * sizeof *handles);
    if (!handles) return gca__set_error(GCA_ERR_NOMEM, "out of host memory for allocator bookkeeping");
    size_t made = 0;
    uintptr_t at = seg->addr + i * page;
    int rc = create_pages(d, page, n, handles, &made);
    if (rc == GCA_OK) rc = map_pages(d, at, page, n, handles);
    if (rc != GCA_OK) {
      destroy_pages(d, handles, made, page);
      free(handles);
      return rc;
    }
    note_mapped(d, seg, i, n, handles, n);
    free(handles);
    memset(seg->paused_pages + i, 0, n);
    i += n;
  }
  free(seg->paused_pages);
  seg->paused_pages = NULL;
  return GCA_OK;
}

void gca__expandable_release_paused(device_t *d, segment_t *seg) {
  free(seg->paused_pages);
  seg->paused_pages = NULL;
  /* Nothing mapped and nothing live: one unmapped block over it all. */
  pool_t *pool = seg->pool;
  block_t *head = seg->head;
  for (block_t *b = head; b; b = b->next) {
    if (b->state == BLOCK_FREE) gca__pool_remove(pool, b);
    else if (b->state == BLOCK_UNMAPPED) gca__pool_unmapped_remove(pool, b);
  }
  while (head->next) {
    block_t *next = head->next;
    block_absorb_next(head);
    gca__block_recycle(d, next);
  }
  head->state = BLOCK_UNMAPPED;
  gca__pool_unmapped_insert(pool, head);
  release_segment(d, seg);
}

/* ---- mapping ------------------------------------------------------------ */

/* Stitching: free expandable blocks of (pool, stream) outside [keep_lo,
 * keep_hi) holding two whole pages of `page` bytes or more, smallest first
 * (a small free block is the least likely to serve a request as it is),
 * until `want` pages are found. (A block around a single whole page is
 * left alone: taking its page strands the partial pages on both sides
 * around a hole, where the block as it was often serves the next request
 * of its size; on the real snapshots taking them cost up to 0.3% of the
 * peak and a third more waits.) Not a neighbour of `target`, the unmapped block
 * being mapped: the unmapped part of a donor merges with unmapped
 * neighbours, which would swallow the target. Appends to list (room for
 * `want` more) and returns the pages found. */
static size_t find_donors(pool_t *pool, gca_stream_t stream, size_t page, size_t want, uintptr_t keep_lo,
                          uintptr_t keep_hi, const block_t *target, block_t **list, size_t *listed) {
  size_t found = 0;
  for (block_t *b = gca__pool_lower_bound(pool, stream, page); b && block_stream(b) == stream && found < want;
       b = gca__pool_next(pool, b)) {
    if (!b->expandable || b->segment->page_size != page || (b->addr < keep_hi && keep_lo < b->addr + b->size))
      continue;
    if (b->prev == target || b->next == target) continue;
    size_t first, n = whole_pages(b, &first);
    if (n < 2) continue;
    found += n < want - found ? n : want - found;
    list[(*listed)++] = b;
  }
  return found;
}

/* Physical pages for a mapping of `n` pages: moved from free blocks of the
 * pool (stitching) first, then created. Returns GCA_OK with all n in
 * handles, or an error with nothing held (moved pages then went back to the
 * device). *created counts the new ones. */
static int gather_pages(device_t *d, const block_t *target, size_t page, size_t n, uintptr_t keep_lo,
                        uintptr_t keep_hi, uintptr_t *handles, size_t *created) {
  pool_t *pool = block_pool(target);
  size_t movable = 0, listed = 0;
  block_t **donors = NULL;
  if (d->config.stitching && !d->capture.count && (donors = malloc(n * sizeof *donors))) {
    movable = find_donors(pool, block_stream(target), page, n, keep_lo, keep_hi, target, donors, &listed);
    /* Then the device's other default pool: its free pages are the same
     * size (a private pool's memory stays its own). */
    pool_t *other = pool == &d->small_pool ? &d->large_pool : pool == &d->large_pool ? &d->small_pool : NULL;
    if (other && movable < n)
      movable += find_donors(other, block_stream(target), page, n - movable, keep_lo, keep_hi, target, donors, &listed);
  }
  /* Work on the donors may wait in the framework's queue: with one
   * undrained, nothing is gathered; the ladder drains the queue (with no
   * lock held) and asks again. */
  for (size_t i = 0; i < listed; i++)
    if (!gca__segment_drained(d, donors[i]->segment)) {
      free(donors);
      return GCA_ERR_OOM;
    }
  size_t fresh = n - movable;
  if (gca__device_limit_refuses(d, fresh * page)) {
    free(donors);
    return GCA_ERR_OOM;
  }
  /* Create first: it is the step that can run out of memory, and nothing
   * has moved yet if it does. */
  size_t have = 0;
  int rc = create_pages(d, page, fresh, handles, &have);
  size_t moved = 0;
  if (rc == GCA_OK && listed) {
    /* Every donor is on the target's stream: one wait covers them all. */
    d->stats.num_stitch_waits++;
    if (gca__events_wait_stream(d, block_stream(target)) == GCA_OK)
      for (size_t i = 0; i < listed && moved < movable; i++)
        moved += unmap_pages(d, donors[i], movable - moved, handles + have + moved, true);
  }
  have += moved;
  /* A move that could not be made (the wait or an unmap failed) leaves a
   * shortfall: create it. */
  if (rc == GCA_OK && have < n) {
    size_t more = 0;
    rc = create_pages(d, page, n - have, handles + have, &more);
    have += more;
  }
  free(donors);
  *created = have - moved;
  if (rc == GCA_OK) return GCA_OK;
  destroy_pages(d, handles, have, page);
  if (moved) {
    /* The moved pages went back to the device after all. */
    d->stats.num_device_free++;
    segment_observed(d, false, moved * page);
  }
  return rc;
}

/* Map memory over the start of unmapped block b: whole pages covering
 * `size` bytes. The mapped part becomes free and merges with free
 * neighbours; the survivor (in the free index) is returned. NULL with *rc
 * set if the memory could not be had (nothing changed but moved pages, which
 * went back to the device). Pages for stitching are not taken from
 * [keep_lo, keep_hi), the range the caller is assembling. */
static block_t *map_block(device_t *d, block_t *b, size_t size, uintptr_t keep_lo, uintptr_t keep_hi, int *rc) {
  segment_t *seg = b->segment;
  pool_t *pool = block_pool(b);
  size_t page = seg->page_size;
  size_t first = (b->addr - seg->addr) / page, n = (size + page - 1) / page;
  size_t bytes = n * page;
  block_t *rest = bytes < b->size ? gca__block_new(d) : NULL;
  uintptr_t *handles = malloc(n * sizeof *handles);
  if (!ensure_pages(seg, first + n) || !handles || (bytes < b->size && !rest)) {
    free(handles);
    if (rest) gca__block_recycle(d, rest);
    *rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory for allocator bookkeeping");
    return NULL;
  }
  size_t created = 0;
  *rc = gather_pages(d, b, page, n, keep_lo, keep_hi, handles, &created);
  if (*rc == GCA_OK && (*rc = map_pages(d, b->addr, page, n, handles)) != GCA_OK) destroy_pages(d, handles, n, page);
  if (*rc != GCA_OK) {
    free(handles);
    if (rest) gca__block_recycle(d, rest);
    return NULL;
  }
  note_mapped(d, seg, first, n, handles, created);
  free(handles);

  gca__pool_unmapped_remove(pool, b);
  if (rest) {
    block_split_tail(b, rest, b->size - bytes);
    gca__pool_unmapped_insert(pool, rest);
  }
  b->state = BLOCK_FREE;

  /* Merge with free neighbours: the one before, already in the index,
   * survives (its key only grows). */
  block_t *survivor = b;
  size_t old_size = 0;
  if (b->prev && b->prev->state == BLOCK_FREE) {
    survivor = b->prev;
    old_size = survivor->size;
    block_absorb_next(survivor);
    gca__block_recycle(d, b);
  }
  block_t *next = survivor->next;
  if (next && next->state == BLOCK_FREE) {
    gca__pool_remove(pool, next);
    block_absorb_next(survivor);
    gca__block_recycle(d, next);
  }
  if (survivor == b) gca__pool_insert(pool, b);
  else gca__pool_resized(pool, survivor, old_size);
  block_set_gc_base(survivor, pool->lookups);
  *rc = GCA_OK;
  return survivor;
}

/* Free and unmapped bytes from b on, counted until `size` is reached. */
static size_t room_from(const block_t *b, size_t size) {
  size_t bytes = 0;
  for (; b && bytes < size && (b->state == BLOCK_FREE || b->state == BLOCK_UNMAPPED); b = b->next) bytes += b->size;
  return bytes;
}

/* PyTorch's find_expandable_block: the lowest address, over the stream's
 * unmapped blocks, where a free block before it (if any) and what follows
 * have room for `size`; else a new segment. */
static block_t *find_room(device_t *d, pool_t *pool, gca_stream_t stream, size_t size, int *rc) {
  for (block_t *u = gca__pool_unmapped_first(pool, stream); u && block_stream(u) == stream; u = gca__pool_unmapped_next(pool, u)) {
    block_t *c = u->prev && u->prev->state == BLOCK_FREE ? u->prev : u;
    if (room_from(c, size) >= size) return c;
  }
  return new_segment(d, pool, stream, rc);
}

block_t *gca__expandable_take(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested, int *rc) {
  block_t *c = find_room(d, pool, stream, rounded, rc);
  if (!c) return NULL;
  uintptr_t keep_lo = c->addr, keep_hi = c->addr + rounded + c->segment->page_size;
  if (c->state == BLOCK_UNMAPPED) {
    c = map_block(d, c, c->size < rounded ? c->size : rounded, keep_lo, keep_hi, rc);
    if (!c) return NULL;
  }
  /* Now free, followed by unmapped space while it is too small: free
   * neighbours are always merged, so what follows is unmapped. */
  while (c->size < rounded) {
    block_t *u = c->next;
    if (!u || u->state != BLOCK_UNMAPPED) {
      *rc = gca__set_error(GCA_ERR_CORRUPT, "device %d: expandable block at %#" PRIxPTR " is not followed by unmapped space",
                           d->index, c->addr);
      return NULL;
    }
    size_t more = rounded - c->size;
    c = map_block(d, u, u->size < more ? u->size : more, keep_lo, keep_hi, rc);
    if (!c) return NULL;
  }
  gca__pool_remove(pool, c);
  *rc = GCA_OK;
  return gca__block_take(d, c, false, rounded, requested);
}

/* ---- best fit ----------------------------------------------------------- */

/* For best fit, an expandable block counts as large as it could grow: its
 * size plus the unmapped space right after it. */
static size_t expandable_size(const block_t *b) {
  return b->size + (b->next && b->next->state == BLOCK_UNMAPPED ? b->next->size : 0);
}

block_t *gca__expandable_refit(pool_t *pool, const config_t *cfg, gca_stream_t stream, block_t *b) {
  if (cfg->expandable_segments || pool->pausable) {
    for (block_t *next = gca__pool_next(pool, b);
         b->expandable && next && block_stream(next) == stream && expandable_size(next) < expandable_size(b);
         next = gca__pool_next(pool, next))
      b = next;
    return b;
  }
  /* Turned off after expandable segments were made: new allocations stay out of them. */
  while (b && block_stream(b) == stream && b->expandable) b = gca__pool_next(pool, b);
  return b && block_stream(b) == stream ? b : NULL;
}

/* ---- snapshots ---------------------------------------------------------- */

size_t gca__expandable_snapshot_count(const device_t *d) {
  size_t n = 0;
  for (const segment_t *seg = d->segments; seg; seg = seg->next) {
    if (!seg->expandable) {
      n++;
      continue;
    }
    for (const block_t *b = seg->head; b; b = b->next)
      if (b->state != BLOCK_UNMAPPED && (!b->prev || b->prev->state == BLOCK_UNMAPPED)) n++;
  }
  return n;
}

/* ---- census ------------------------------------------------------------- */

/* One range's counts, and with `map` its runs up to the extent. */
static int census_range(const segment_t *seg, page_range_t *r, bool map) {
  uint64_t page = seg->page_size;
  size_t top = 0, mapped = 0; /* top: one past the highest mapped page */
  for (size_t i = 0; i < seg->page_cap; i++)
    if (seg->pages[i]) {
      mapped++;
      top = i + 1;
    }
  *r = (page_range_t){.addr = seg->addr, .reserved = seg->size, .extent = top * page, .page_size = page,
                      .pool = seg->pool->kind, .stream = seg->stream, .mapped_pages = mapped,
                      .unmapped_pages = top - mapped};
  size_t runs = 0;
  for (const block_t *b = seg->head; b && b->addr - seg->addr < r->extent; b = b->next) {
    runs++;
    size_t first;
    if (b->state == BLOCK_FREE) r->free_pages += whole_pages(b, &first);
  }
  if (!map || !runs) return GCA_OK;
  r->runs = malloc(runs * sizeof *r->runs);
  if (!r->runs) return gca__set_error(GCA_ERR_NOMEM, "out of host memory for the page census");
  for (const block_t *b = seg->head; b && b->addr - seg->addr < r->extent; b = b->next) {
    uint64_t size = b->addr + b->size - seg->addr > r->extent ? seg->addr + r->extent - b->addr : b->size;
    r->runs[r->run_count++] = (page_run_t){size, b->state == BLOCK_UNMAPPED ? PAGE_RUN_UNMAPPED : block_state_of(b)};
  }
  return GCA_OK;
}

int gca__expandable_census(const device_t *d, bool maps, page_census_t *out) {
  memset(out, 0, sizeof *out);
  size_t n = 0;
  for (const segment_t *seg = d->segments; seg; seg = seg->next) n += seg->expandable;
  if (!n) return GCA_OK;
  page_range_t *ranges = calloc(n, sizeof *ranges);
  if (!ranges) return gca__set_error(GCA_ERR_NOMEM, "out of host memory for the page census");
  out->maps = ranges;
  for (const segment_t *seg = d->segments; seg; seg = seg->next) {
    if (!seg->expandable) continue;
    page_range_t *r = &ranges[out->ranges++];
    int rc = census_range(seg, r, maps);
    if (rc) {
      gca__page_census_free(out);
      return rc;
    }
    out->reserved_bytes += r->reserved;
    out->mapped_pages += r->mapped_pages;
    out->mapped_bytes += r->mapped_pages * r->page_size;
    out->free_pages += r->free_pages;
    out->free_bytes += r->free_pages * r->page_size;
    out->unmapped_pages += r->unmapped_pages;
    out->unmapped_bytes += r->unmapped_pages * r->page_size;
  }
  if (!maps) {
    free(ranges);
    out->maps = NULL;
  }
  return GCA_OK;
}

/* expandable_census's totals, from the kept counts instead of a walk over
 * every page and block: a range's pages mapped are its mapped bytes, its
 * holes those below its top not mapped, and the free pages are those of
 * the free blocks, every one of which is in its pool's free index (often
 * a few, where a range has thousands of blocks). The replay takes it at
 * every new peak of reserved memory rather than running again up to the
 * peak (replay.c); test_replay holds it to expandable_census. */
void gca__expandable_census_counts(device_t *d, page_census_t *out) {
  memset(out, 0, sizeof *out);
  if (!device_has_expandable(d)) return;
  for (const segment_t *seg = d->segments; seg; seg = seg->next) {
    if (!seg->expandable) continue;
    uint64_t page = seg->page_size, mapped = seg->mapped_bytes / page;
    out->ranges++;
    out->reserved_bytes += seg->size;
    out->mapped_pages += mapped;
    out->mapped_bytes += mapped * page;
    out->unmapped_pages += seg->mapped_top - mapped;
    out->unmapped_bytes += (seg->mapped_top - mapped) * page;
  }
  pool_t *pools[] = {&d->small_pool, &d->large_pool};
  for (size_t k = 0; k < 2; k++) {
    if (!pools[k]->expandable_segments) continue;
    for (block_t *b = gca__pool_first(pools[k]); b; b = gca__pool_next(pools[k], b)) {
      if (!b->expandable) continue;
      size_t first, n = whole_pages(b, &first);
      out->free_pages += n;
      out->free_bytes += n * b->segment->page_size;
    }
  }
}

void gca__page_census_free(page_census_t *c) {
  if (c->maps)
    for (size_t i = 0; i < c->ranges; i++) free(c->maps[i].runs);
  free(c->maps);
  memset(c, 0, sizeof *c);
}
