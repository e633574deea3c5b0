/* The pinned host allocator: a cache of page-locked host memory with the
 * semantics of PyTorch's CachingHostAllocator, the memory that pin_memory()
 * and asynchronous copies between host and device use.
 *
 * PyTorch's rules. A request rounds up to a power of two, and each power of
 * two has a free list of its own (the most recently freed block first, for
 * warm caches); blocks are never split or merged, so a cached block serves
 * exactly one size class. A block copied from or to on a stream is declared
 * used there (record_stream); when it is freed, an event is recorded on each
 * such stream, and the block goes back to its list only when every one of
 * them has completed: until then the copy may still read or write it.
 * Completed events are collected at every allocation, oldest first, up to
 * the first that has not completed. A miss pins new memory from the
 * backend, either directly (cudaHostAlloc) or, with
 * pinned_use_cuda_host_register, by malloc, touching every page (in
 * parallel with pinned_num_register_threads threads, since first touch is
 * what costs) and registering it (cudaHostRegister). empty_cache unpins
 * every cached block.
 *
 * Beyond PyTorch: on a miss, the pending blocks of the requested size are
 * asked about too before new memory is pinned (one slow stream at the head
 * of the queue no longer forces a new pinned allocation when a block of
 * the size is done); when pinning fails for want of memory, the cache is
 * given back and pinning tried once more; a pointer inside a block is
 * accepted by record_stream (a view of a pinned tensor), and frees of
 * pointers the allocator never gave are refused, not trusted; event
 * failures are absorbed as the device cache absorbs them (wait for the
 * stream instead; if even that fails, the block is quarantined, never
 * reused).
 *
 * With pinned_reserve_segment_size_mb (newer PyTorch), the first miss pins
 * one segment of that size, and misses carve their blocks from it, each
 * rounded to 4 KiB, one after another, until it is used up; then they pin
 * as before. A carved block cannot be unpinned alone: PyTorch drops it from
 * the cache at empty_cache and never reuses its memory; here it stays
 * cached (and pinned) through empty_cache, and the segment is unpinned at
 * close.
 *
 * With pinned_use_background_threads, a thread of the cache's own
 * collects completed events every 100 us (PyTorch's background thread), so
 * a freed block returns to its list without waiting for the next
 * allocation. Unlike PyTorch, allocations still collect too (one query
 * when the oldest event has not completed). Across fork, see host_caches.
 *
 * One lock guards the cache. The backend's pin and unpin calls, which take
 * milliseconds for large blocks, are made without it.
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "host/host.h"

#define HOST_BUCKETS 64 /* one free list per power of two */

enum { HOST_IN_USE, HOST_PENDING, HOST_CACHED, HOST_RELEASING, HOST_QUARANTINED };

typedef struct host_use {
  int device;
  gca_stream_t stream;
} host_use_t;

typedef struct host_block host_block_t;
struct host_block {
  uintptr_t addr;
  size_t size;             /* a power of two */
  host_use_t *uses;        /* streams it is used on (record_stream) */
  uint32_t use_count, use_cap;
  uint32_t events_pending; /* events recorded at its free, not yet completed */
  uint8_t state;
  bool registered;         /* malloc + register, not host_alloc */
  bool carved;             /* from the reserve segment: never unpinned alone */
  bool doomed;             /* a use could not be waited for: quarantine when settled */
  host_block_t *next_free;
};

/* A recorded event and the block waiting for it; block NULL: already
 * collected out of order (by a size-directed look), to be skipped. */
typedef struct host_event {
  uintptr_t event;
  host_block_t *block;
  int device;
  gca_stream_t stream;
} host_event_t;

struct host_cache {
  lock_t lock; /* lock.h: biased to the thread that uses it */
  gca_allocator_t *owner;
  host_block_t **blocks; /* every block, by address */
  size_t count, cap;
  host_block_t *free_lists[HOST_BUCKETS];
  host_event_t *events;  /* a ring, oldest at head */
  size_t head, queued, ring_cap;
  gca_host_stats_t stats;
  /* The reserve segment (pinned_reserve_segment_size_mb): pinned at the
   * first miss that finds it configured (tried: asked once, pinned or not),
   * carved from start up to used. */
  struct {
    uintptr_t start;
    size_t size, used;
    bool registered, tried;
  } reserve;
  /* pinned_use_background_threads: the collecting thread, started when a
   * block first waits for events with the key set, stopped at close (a
   * child of fork has none: host_after_fork_child). */
  pthread_t collector;
  bool collector_started;
  atomic_bool collector_stop;
  host_cache_t *next_cache; /* every cache, for fork (host_caches) */
  size_t absorbed;       /* failures absorbed since the last report */
  char absorbed_message[256]; /* the size of absorbed_t.last */
};

static inline int host_bucket_of(size_t pow2) { return __builtin_ctzll((unsigned long long)pow2); }

static const backend_ops_t *host_ops_of(const host_cache_t *h) { return h->owner->backend.ops; }
static void *host_state_of(const host_cache_t *h) { return h->owner->backend.state; }

static int64_t now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static void host_duration_add(gca_duration_stat_t *d, int64_t us) {
  d->total += us;
  d->count++;
  if (us > d->max) d->max = us;
  if (d->count == 1 || us < d->min) d->min = us;
}

/* ---- the block table (sorted by address; changes only on the slow paths,
 *      where a driver call dwarfs the memmove) ---------------------------- */

/* Index of the last block starting at or below addr, or -1. */
static ptrdiff_t host_last_at_or_below(const host_cache_t *h, uintptr_t addr) {
  size_t lo = 0, hi = h->count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (h->blocks[mid]->addr <= addr) lo = mid + 1;
    else hi = mid;
  }
  return (ptrdiff_t)lo - 1;
}

static host_block_t *host_block_containing(const host_cache_t *h, uintptr_t addr) {
  ptrdiff_t i = host_last_at_or_below(h, addr);
  if (i < 0) return NULL;
  host_block_t *b = h->blocks[i];
  return addr - b->addr < b->size ? b : NULL;
}

static host_block_t *host_block_at(const host_cache_t *h, uintptr_t addr) {
  host_block_t *b = host_block_containing(h, addr);
  return b && b->addr == addr ? b : NULL;
}

static bool host_table_insert(host_cache_t *h, host_block_t *b) {
  if (h->count == h->cap) {
    host_block_t **grown = gca__grow_array(h->blocks, &h->cap, sizeof *grown, 64);
    if (!grown) return false;
    h->blocks = grown;
  }
  size_t at = (size_t)(host_last_at_or_below(h, b->addr) + 1);
  memmove(&h->blocks[at + 1], &h->blocks[at], (h->count - at) * sizeof *h->blocks);
  h->blocks[at] = b;
  h->count++;
  return true;
}

/* ---- the backend's events (a backend without them is synchronous) ------- */

static int host_record_event(host_cache_t *h, const host_use_t *u, uintptr_t *event) {
  *event = 0;
  const backend_ops_t *ops = host_ops_of(h);
  return ops->event_record ? ops->event_record(host_state_of(h), u->device, u->stream, event) : GCA_OK;
}

static int host_wait_stream(host_cache_t *h, int device, gca_stream_t stream) {
  const backend_ops_t *ops = host_ops_of(h);
  return ops->stream_synchronize ? ops->stream_synchronize(host_state_of(h), device, stream) : GCA_OK;
}

static void host_destroy_event(host_cache_t *h, const host_event_t *e) {
  if (e->event) host_ops_of(h)->event_destroy(host_state_of(h), e->device, e->event);
}

/* A backend failure was absorbed: keep its message for the log. */
static void host_note_failure(host_cache_t *h) {
  h->absorbed++;
  snprintf(h->absorbed_message, sizeof h->absorbed_message, "%s", gca_last_error());
}

/* An event failed: wait for its stream instead; true if that worked. */
static bool host_wait_stream_instead(host_cache_t *h, int device, gca_stream_t stream) {
  h->stats.num_event_errors++;
  host_note_failure(h);
  if (host_wait_stream(h, device, stream) == GCA_OK) return true;
  host_note_failure(h);
  return false;
}

/* What was absorbed since the last report, into *a; with the lock held.
 * The message is copied only when there is one: the cached pair passes
 * here, and a returned absorbed_t was a 264-byte copy on every call. */
static void host_take_absorbed(host_cache_t *h, absorbed_t *a) {
  a->fresh = h->absorbed;
  h->absorbed = 0;
  if (unlikely(a->fresh)) memcpy(a->last, h->absorbed_message, sizeof a->last);
}

/* Log it (after the lock is dropped: a log handler may call back into the
 * library). */
static void host_report_absorbed(const absorbed_t *a) {
  if (a->fresh)
    gca__log_message(GCA_LOG_ERROR,
                     "pinned host allocator: %zu backend failure%s absorbed (waited for the stream instead, or "
                     "quarantined the block); the last: %s",
                     a->fresh, a->fresh == 1 ? "" : "s", a->last);
}

/* ---- block states ------------------------------------------------------- */

static void host_push_free(host_cache_t *h, host_block_t *b) {
  int k = host_bucket_of(b->size);
  b->state = HOST_CACHED;
  b->next_free = h->free_lists[k];
  h->free_lists[k] = b;
  stat_decrease(&h->stats.allocation, 1);
  stat_decrease(&h->stats.allocated_bytes, (int64_t)b->size);
  h->stats.cached_bytes += (int64_t)b->size;
}

static host_block_t *host_pop_free(host_cache_t *h, int k) {
  host_block_t *b = h->free_lists[k];
  if (!b) return NULL;
  h->free_lists[k] = b->next_free;
  b->next_free = NULL;
  b->state = HOST_IN_USE;
  stat_increase(&h->stats.allocation, 1);
  stat_increase(&h->stats.allocated_bytes, (int64_t)b->size);
  h->stats.cached_bytes -= (int64_t)b->size;
  return b;
}

/* The block's last event has completed (or could not be trusted). A
 * quarantined block keeps counting as allocated: its memory is not free. */
static void host_settle(host_cache_t *h, host_block_t *b, bool safe) {
  if (!safe) b->doomed = true;
  if (--b->events_pending) return;
  h->stats.pending_blocks--;
  if (b->doomed) {
    b->state = HOST_QUARANTINED;
    h->stats.quarantined_blocks++;
  } else {
    host_push_free(h, b);
  }
}

/* Ask about one queued event. Returns BACKEND_NOT_READY if it has not
 * completed; otherwise the event is done with and its block settled. */
static int host_collect(host_cache_t *h, host_event_t *e) {
  bool safe = true;
  if (e->event) {
    int rc = host_ops_of(h)->event_query(host_state_of(h), e->device, e->event);
    if (rc == BACKEND_NOT_READY) return rc;
    if (rc != GCA_OK) safe = host_wait_stream_instead(h, e->device, e->stream);
    host_destroy_event(h, e);
  }
  host_block_t *b = e->block;
  e->block = NULL;
  e->event = 0;
  host_settle(h, b, safe);
  return GCA_OK;
}

static host_event_t *host_queued(host_cache_t *h, size_t i) { return &h->events[(h->head + i) % h->ring_cap]; }

static void host_pop_head(host_cache_t *h) {
  h->head = (h->head + 1) % h->ring_cap;
  h->queued--;
}

/* PyTorch's collection: oldest first, up to the first event not complete. */
static void host_process_events(host_cache_t *h) {
  while (h->queued) {
    host_event_t *e = host_queued(h, 0);
    if (e->block && host_collect(h, e) == BACKEND_NOT_READY) return;
    host_pop_head(h);
  }
}

/* On a miss: ask about the pending blocks of this size wherever they are in
 * the queue, until one is free again. */
static void host_process_events_of_size(host_cache_t *h, size_t size) {
  int k = host_bucket_of(size);
  for (size_t i = 0; i < h->queued && !h->free_lists[k]; i++) {
    host_event_t *e = host_queued(h, i);
    if (e->block && e->block->size == size) (void)host_collect(h, e);
  }
  while (h->queued && !host_queued(h, 0)->block) host_pop_head(h);
}

static bool host_reserve_events(host_cache_t *h, size_t more) {
  if (h->queued + more <= h->ring_cap) return true;
  size_t cap = h->ring_cap ? h->ring_cap : 32;
  while (cap < h->queued + more) cap *= 2;
  host_event_t *ring = malloc(cap * sizeof *ring);
  if (!ring) return false;
  for (size_t i = 0; i < h->queued; i++) ring[i] = *host_queued(h, i);
  free(h->events);
  h->events = ring;
  h->ring_cap = cap;
  h->head = 0;
  return true;
}

/* ---- pinning and unpinning ---------------------------------------------- */

typedef struct prefault {
  volatile char *start;
  size_t len, page;
} prefault_t;

static void host_touch_pages(void *arg) {
  prefault_t *p = arg;
  for (size_t off = 0; off < p->len; off += p->page) p->start[off] = 0;
}

/* Host memory to register. Blocks of 2 MiB or more are mapped on their
 * own, aligned to 2 MiB, with the kernel asked for huge pages
 * (MADV_HUGEPAGE; Linux's transparent huge pages are often in madvise
 * mode): touching, registering and unregistering a 16 MiB block then cost
 * half to two thirds as much (docs/pinned.md). PyTorch mallocs every
 * block. Smaller blocks still come from malloc, page-aligned: a
 * huge page would be mostly wasted on them. Under AddressSanitizer, which
 * checks the bounds of what malloc gives only, every block comes from
 * malloc (GCA_BIG_MAPPED, as for big arrays). */
static bool host_mapped(size_t bytes) { return GCA_BIG_MAPPED && bytes >= HUGE_PAGE_BYTES; }

static void *host_memory_get(size_t bytes, size_t page) {
  return host_mapped(bytes) ? gca__huge_map(bytes) : aligned_alloc(page, bytes);
}

static void host_memory_put(void *p, size_t bytes) {
  if (host_mapped(bytes)) munmap(p, bytes);
  else free(p);
}

/* Touch every page of [p, p + size) with `threads` threads (PyTorch does
 * when size >= page * threads): registering memory that is not yet backed
 * makes the kernel fault it in page by page under the driver's lock. The
 * parts go to the kept helper threads (helpers.c; PyTorch keeps a thread
 * pool for this too): starting threads for each block costs more than the
 * touching saves (docs/pinned.md). A part no helper has started when this
 * thread is done with its own is taken back and touched here. Parts of a
 * mapped block are whole huge pages, so that no two threads fault the
 * same one. */
static void host_prefault(char *p, size_t size, size_t threads, size_t page) {
  if (threads > 64) threads = 64;
  if (threads <= 1 || size < page * threads) {
    prefault_t all = {p, size, page};
    host_touch_pages(&all);
    return;
  }
  helper_job_t job[64];
  prefault_t part[64];
  bool queued[64] = {false};
  size_t grain = host_mapped(size) ? HUGE_PAGE_BYTES : page;
  size_t chunk = (size / threads + grain - 1) / grain * grain;
  for (size_t i = 0; i < threads; i++) {
    size_t from = i * chunk < size ? i * chunk : size;
    size_t to = from + chunk < size ? from + chunk : size;
    part[i] = (prefault_t){p + from, to - from, page};
    if (i > 0 && to > from) {
      job[i] = (helper_job_t){.run = host_touch_pages, .arg = &part[i]};
      queued[i] = gca__helper_submit(&job[i]);
    }
  }
  host_touch_pages(&part[0]);
  for (size_t i = 1; i < threads; i++)
    if (!queued[i] || !gca__helper_wait(&job[i])) host_touch_pages(&part[i]);
}

/* Pin `size` bytes: host_alloc, or malloc + touch + register. Called without the lock. */
static int host_pin(host_cache_t *h, size_t size, uintptr_t *addr, bool *registered) {
  gca_allocator_t *a = h->owner;
  const backend_ops_t *ops = host_ops_of(h);
  mutex_lock(&a->settings_lock, RANK_SETTINGS);
  bool use_register = a->config.pinned_use_host_register && ops->host_register;
  size_t threads = a->config.pinned_num_register_threads;
  mutex_unlock(&a->settings_lock);
  *registered = use_register;
  void *p = NULL;
  int rc;
  int64_t start = now_us();
  if (use_register) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t bytes = (size + page - 1) / page * page;
    p = host_memory_get(bytes, page);
    if (!p) {
      rc = gca__set_error(GCA_ERR_OOM, "out of host memory allocating %zu bytes to register", bytes);
    } else {
      host_prefault(p, size, threads, page);
      rc = ops->host_register(host_state_of(h), p, size);
      if (rc) host_memory_put(p, bytes);
    }
  } else {
    rc = ops->host_alloc(host_state_of(h), size, &p);
  }
  int64_t took = now_us() - start;
  lock_acquire(&h->lock);
  host_duration_add(&h->stats.host_alloc_time, took);
  lock_release(&h->lock);
  if (rc == GCA_OK) *addr = (uintptr_t)p;
  return rc;
}

/* Unpin a block's memory the way it was pinned. Called without the lock. */
static int host_unpin(host_cache_t *h, const host_block_t *b) {
  const backend_ops_t *ops = host_ops_of(h);
  int64_t start = now_us();
  int rc;
  if (b->registered) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    rc = ops->host_unregister(host_state_of(h), (void *)b->addr);
    if (rc == GCA_OK) host_memory_put((void *)b->addr, (b->size + page - 1) / page * page);
  } else {
    rc = ops->host_free(host_state_of(h), (void *)b->addr);
  }
  int64_t took = now_us() - start;
  lock_acquire(&h->lock);
  host_duration_add(&h->stats.host_free_time, took);
  lock_release(&h->lock);
  return rc;
}

static void host_drop_block(host_block_t *b) {
  free(b->uses);
  free(b);
}

/* Take every cached block not carved from the reserve segment out of the
 * free lists and the table (they become
 * RELEASING: no lookup finds them while they are unpinned, so an address
 * the backend hands out again is never found twice), chained through
 * next_free. With the lock held. The statistics still count them until
 * host_release() knows whether the backend took them. */
static host_block_t *host_take_cached(host_cache_t *h) {
  host_block_t *taken = NULL;
  for (int k = 0; k < HOST_BUCKETS; k++) {
    host_block_t **at = &h->free_lists[k];
    while (*at) {
      host_block_t *b = *at;
      if (b->carved) { /* (stays cached: it cannot be unpinned alone) */
        at = &b->next_free;
        continue;
      }
      *at = b->next_free;
      b->state = HOST_RELEASING;
      h->stats.cached_bytes -= (int64_t)b->size;
      b->next_free = taken;
      taken = b;
    }
  }
  if (taken) {
    size_t kept = 0;
    for (size_t i = 0; i < h->count; i++)
      if (h->blocks[i]->state != HOST_RELEASING) h->blocks[kept++] = h->blocks[i];
    h->count = kept;
  }
  return taken;
}

/* Unpin the blocks take_cached took; the ones the backend refuses go back
 * to their lists. Returns the number unpinned, and the first refusal's
 * status in *status. Called without the lock. */
static size_t host_release(host_cache_t *h, host_block_t *taken, int *status) {
  *status = GCA_OK;
  size_t released = 0;
  for (host_block_t *b = taken; b; b = b->next_free) {
    int rc = host_unpin(h, b);
    if (rc == GCA_OK) released++;
    else if (*status == GCA_OK) *status = rc;
    if (rc) b->state = HOST_CACHED; /* refused: still pinned, still ours */
  }
  lock_acquire(&h->lock);
  size_t lost = 0;
  for (host_block_t *b = taken, *next; b; b = next) {
    next = b->next_free;
    /* Refused: back in the table and its list. The table had room for it a
     * moment ago, but other threads may have filled it since; if it cannot
     * grow, the block stays pinned, untracked (out of host memory). */
    if (b->state == HOST_CACHED && host_table_insert(h, b)) {
      int k = host_bucket_of(b->size);
      b->next_free = h->free_lists[k];
      h->free_lists[k] = b;
      h->stats.cached_bytes += (int64_t)b->size;
      continue;
    }
    lost += b->state == HOST_CACHED;
    stat_decrease(&h->stats.segment, 1);
    stat_decrease(&h->stats.reserved_bytes, (int64_t)b->size);
    host_drop_block(b);
  }
  lock_release(&h->lock);
  if (lost)
    gca__log_message(GCA_LOG_ERROR, "pinned host allocator: out of host memory: %zu block%s the backend refused to unpin "
                     "left pinned and untracked", lost, lost == 1 ? "" : "s");
  return released;
}

/* ---- the public calls --------------------------------------------------- */

static host_cache_t *host_of(gca_allocator_t *a, const char *what) {
  if (unlikely(!a)) {
    gca__set_error(GCA_ERR_INVALID, "%s: allocator is NULL", what);
    return NULL;
  }
  return allocator_usable(a, what) ? a->host : NULL;
}

/* What a block of `size` takes of the reserve segment: PyTorch rounds to
 * 4 KiB, so a small block takes a page. */
static size_t reserve_take(size_t size) { return (size + 4095) & ~(size_t)4095; }

/* A block of `size` carved from the reserve segment, which the first miss
 * that finds pinned_reserve_segment_size_mb set pins: false when none is
 * configured, it could not be pinned, or it has no room left (the caller
 * pins the block alone). Called without the lock. */
static bool host_carve(host_cache_t *h, size_t size, uintptr_t *addr) {
  size_t take = reserve_take(size);
  lock_acquire(&h->lock);
  if (!h->reserve.tried) {
    gca_allocator_t *a = h->owner;
    mutex_lock(&a->settings_lock, RANK_SETTINGS);
    size_t mb = a->config.pinned_reserve_segment_mb;
    mutex_unlock(&a->settings_lock);
    if (mb) {
      /* Pinned without the lock; a miss meanwhile pins its block alone. */
      h->reserve.tried = true;
      lock_release(&h->lock);
      uintptr_t start = 0;
      bool registered = false;
      int rc = host_pin(h, mb << 20, &start, &registered);
      if (rc != GCA_OK)
        gca__log_message(GCA_LOG_WARNING, "pinned host allocator: the reserve segment (%zu MiB) could not be pinned, "
                         "blocks are pinned one by one: %s", mb, gca_last_error());
      lock_acquire(&h->lock);
      if (rc == GCA_OK) {
        h->reserve.start = start;
        h->reserve.size = mb << 20;
        h->reserve.registered = registered;
      }
    }
  }
  bool carved = h->reserve.start && take >= size && h->reserve.size - h->reserve.used >= take;
  if (carved) {
    *addr = h->reserve.start + h->reserve.used;
    h->reserve.used += take;
  }
  lock_release(&h->lock);
  return carved;
}

GCA_COLD static void *host_malloc_miss(host_cache_t *h, size_t size, size_t asked) {
  const backend_ops_t *ops = host_ops_of(h);
  if (!ops->host_alloc) {
    gca__set_error(GCA_ERR_BACKEND, "gca_host_malloc: the %s backend has no pinned host memory", ops->name);
    return NULL;
  }
  uintptr_t addr = 0;
  bool registered = false, carved = host_carve(h, size, &addr);
  int rc = carved ? GCA_OK : host_pin(h, size, &addr, &registered);
  if (rc == GCA_ERR_OOM) {
    /* Give the cache back and try once more. */
    lock_acquire(&h->lock);
    host_process_events(h);
    host_block_t *taken = host_take_cached(h);
    int64_t cached = 0;
    for (host_block_t *b = taken; b; b = b->next_free) cached += (int64_t)b->size;
    lock_release(&h->lock);
    int refused;
    if (taken && host_release(h, taken, &refused) > 0) {
      lock_acquire(&h->lock);
      h->stats.num_alloc_retries++;
      lock_release(&h->lock);
      rc = host_pin(h, size, &addr, &registered);
    }
    if (rc == GCA_ERR_OOM) {
      gca__prefix_error("gca_host_malloc: out of pinned host memory");
      char why[512];
      snprintf(why, sizeof why, "%s", gca_last_error());
      gca__set_error(GCA_ERR_OOM, "%s (asked %zu bytes, rounded to %zu; %" PRId64 " cached bytes were given back first)",
                     why, asked, size, cached);
      return NULL;
    }
  }
  if (rc) {
    gca__prefix_error("gca_host_malloc");
    return NULL;
  }
  host_block_t *b = calloc(1, sizeof *b);
  lock_acquire(&h->lock);
  if (b) {
    b->addr = addr;
    b->size = size;
    b->registered = registered;
    b->carved = carved;
    b->state = HOST_IN_USE;
  }
  if (!b || !host_table_insert(h, b)) {
    /* A carved block goes back to the reserve if it was the last carved. */
    size_t take = reserve_take(size);
    if (carved && addr + take == h->reserve.start + h->reserve.used) h->reserve.used -= take;
    lock_release(&h->lock);
    free(b);
    host_block_t tmp = {.addr = addr, .size = size, .registered = registered};
    if (!carved) (void)host_unpin(h, &tmp);
    gca__set_error(GCA_ERR_NOMEM, "gca_host_malloc: out of host memory for the block's record");
    return NULL;
  }
  stat_increase(&h->stats.segment, 1);
  stat_increase(&h->stats.reserved_bytes, (int64_t)size);
  stat_increase(&h->stats.allocation, 1);
  stat_increase(&h->stats.allocated_bytes, (int64_t)size);
  absorbed_t absorbed;
  host_take_absorbed(h, &absorbed);
  lock_release(&h->lock);
  host_report_absorbed(&absorbed);
  gca__clear_error();
  return (void *)addr;
}

void *gca_host_malloc(gca_allocator_t *a, size_t size) {
  host_cache_t *h = host_of(a, "gca_host_malloc");
  if (!h) return NULL;
  if (size == 0) {
    gca__clear_error();
    return NULL;
  }
  if (size > ((size_t)1 << 62)) {
    gca__set_error(GCA_ERR_INVALID, "gca_host_malloc: size %zu is too large to round to a power of two", size);
    return NULL;
  }
  size_t rounded = (size_t)1 << (size == 1 ? 0 : 64 - __builtin_clzll((unsigned long long)(size - 1)));
  lock_acquire(&h->lock);
  host_process_events(h);
  host_block_t *b = host_pop_free(h, host_bucket_of(rounded));
  if (!b && h->queued) {
    host_process_events_of_size(h, rounded);
    b = host_pop_free(h, host_bucket_of(rounded));
  }
  if (b) {
    absorbed_t absorbed;
    host_take_absorbed(h, &absorbed);
    lock_release(&h->lock);
    host_report_absorbed(&absorbed);
    gca__clear_error();
    return (void *)b->addr;
  }
  lock_release(&h->lock);
  return host_malloc_miss(h, rounded, size);
}

#define HOST_COLLECT_EVERY_NS 100000 /* PyTorch's background thread sleeps 100 us between rounds */

static void *host_collector_main(void *arg) {
  host_cache_t *h = arg;
  while (!atomic_load_explicit(&h->collector_stop, memory_order_relaxed)) {
    lock_acquire(&h->lock);
    host_process_events(h);
    absorbed_t absorbed;
    host_take_absorbed(h, &absorbed);
    lock_release(&h->lock);
    host_report_absorbed(&absorbed);
    struct timespec pause = {0, HOST_COLLECT_EVERY_NS};
    nanosleep(&pause, NULL);
  }
  return NULL;
}

/* With the lock held (and a log hold): the collecting thread, if the
 * configuration asks for one and it is not running. A thread that cannot
 * start is logged; the allocations' own collection goes on. */
static void host_start_collector(host_cache_t *h) {
  if (h->collector_started) return;
  gca_allocator_t *a = h->owner;
  mutex_lock(&a->settings_lock, RANK_SETTINGS);
  bool wanted = a->config.pinned_use_background_threads;
  mutex_unlock(&a->settings_lock);
  if (!wanted) return;
  h->collector_started = true;
  int rc = pthread_create(&h->collector, NULL, host_collector_main, h);
  if (rc != 0) {
    h->collector_started = false;
    gca__log_message(GCA_LOG_WARNING, "pinned host allocator: the background thread for pinned_use_background_threads "
                     "could not start (%s); events are collected at each allocation", strerror(rc));
  }
}

/* Order the block's reuse after the work of the streams it was used on. */
static void host_defer_reuse(host_cache_t *h, host_block_t *b) {
  /* Launch-blocking mode, or no room to queue events: wait here instead. */
  bool queue = !h->owner->launch_blocking && host_reserve_events(h, b->use_count);
  b->state = HOST_PENDING;
  b->events_pending = 1; /* held until every use is handled */
  h->stats.pending_blocks++;
  for (uint32_t i = 0; i < b->use_count; i++) {
    const host_use_t *u = &b->uses[i];
    uintptr_t event;
    if (queue && host_record_event(h, u, &event) == GCA_OK) {
      b->events_pending++;
      *host_queued(h, h->queued++) = (host_event_t){event, b, u->device, u->stream};
      continue;
    }
    bool waited;
    if (queue) {
      waited = host_wait_stream_instead(h, u->device, u->stream);
    } else {
      waited = host_wait_stream(h, u->device, u->stream) == GCA_OK;
      if (!waited) host_note_failure(h);
    }
    if (!waited) b->doomed = true;
  }
  b->use_count = 0;
  host_settle(h, b, true);
  if (h->queued) host_start_collector(h);
}

int gca_host_free(gca_allocator_t *a, void *ptr) {
  host_cache_t *h = host_of(a, "gca_host_free");
  if (!h) return GCA_ERR_INVALID;
  if (!ptr) return GCA_OK;
  gca__log_hold(); /* starting the collector may log, under the lock */
  lock_acquire(&h->lock);
  host_block_t *b = host_block_containing(h, (uintptr_t)ptr);
  int rc = GCA_OK;
  if (!b) {
    rc = gca__set_error(GCA_ERR_BAD_POINTER, "gca_host_free: %p is not pinned memory from this allocator", ptr);
  } else if (b->addr != (uintptr_t)ptr) {
    rc = gca__set_error(GCA_ERR_BAD_POINTER, "gca_host_free: %p is inside the pinned block %p (+%zu bytes), not its start",
                        ptr, (void *)b->addr, (size_t)((uintptr_t)ptr - b->addr));
  } else if (b->state != HOST_IN_USE) {
    rc = gca__set_error(GCA_ERR_BAD_POINTER, "gca_host_free: the pinned block %p was freed already", ptr);
  } else if (b->use_count == 0) {
    host_push_free(h, b);
  } else {
    host_defer_reuse(h, b);
  }
  absorbed_t absorbed;
  host_take_absorbed(h, &absorbed);
  lock_release(&h->lock);
  gca__log_release();
  host_report_absorbed(&absorbed);
  return rc;
}

int gca__host_free_uncached(gca_allocator_t *a, void *ptr) {
  int rc = gca_host_free(a, ptr);
  if (rc != GCA_OK || !ptr) return rc;
  host_cache_t *h = a->host;
  lock_acquire(&h->lock);
  host_block_t *b = host_block_at(h, (uintptr_t)ptr), *taken = NULL;
  if (b && b->state == HOST_CACHED && !b->carved) { /* (not taken again meanwhile, nor waiting for a stream) */
    host_block_t **at = &h->free_lists[host_bucket_of(b->size)];
    while (*at && *at != b) at = &(*at)->next_free;
    if (*at) {
      *at = b->next_free;
      b->next_free = NULL;
      b->state = HOST_RELEASING;
      h->stats.cached_bytes -= (int64_t)b->size;
      size_t i = (size_t)host_last_at_or_below(h, b->addr);
      memmove(&h->blocks[i], &h->blocks[i + 1], (h->count - i - 1) * sizeof *h->blocks);
      h->count--;
      taken = b;
    }
  }
  lock_release(&h->lock);
  if (taken) (void)host_release(h, taken, &rc);
  gca__clear_error();
  return GCA_OK;
}

int gca_host_record_stream(gca_allocator_t *a, void *ptr, int device, gca_stream_t stream) {
  host_cache_t *h = host_of(a, "gca_host_record_stream");
  if (!h) return GCA_ERR_INVALID;
  if (!gca__device_of(a, device, "gca_host_record_stream")) return gca_last_status();
  lock_acquire(&h->lock);
  host_block_t *b = host_block_containing(h, (uintptr_t)ptr);
  int rc = GCA_OK;
  if (!b || b->state != HOST_IN_USE) {
    rc = gca__set_error(GCA_ERR_BAD_POINTER, "gca_host_record_stream: %p is not in a live pinned block of this allocator",
                        ptr);
  } else {
    bool known = false;
    for (uint32_t i = 0; i < b->use_count && !known; i++)
      known = b->uses[i].device == device && b->uses[i].stream == stream;
    if (!known && b->use_count == b->use_cap) {
      size_t cap = b->use_cap;
      host_use_t *grown = gca__grow_array(b->uses, &cap, sizeof *grown, 2);
      if (!grown) rc = gca__set_error(GCA_ERR_NOMEM, "gca_host_record_stream: out of host memory recording a stream use");
      else b->uses = grown, b->use_cap = (uint32_t)cap;
    }
    if (!known && rc == GCA_OK) b->uses[b->use_count++] = (host_use_t){device, stream};
  }
  lock_release(&h->lock);
  return rc;
}

int gca_host_empty_cache(gca_allocator_t *a) {
  host_cache_t *h = host_of(a, "gca_host_empty_cache");
  if (!h) return GCA_ERR_INVALID;
  lock_acquire(&h->lock);
  host_process_events(h);
  host_block_t *taken = host_take_cached(h);
  absorbed_t absorbed;
  host_take_absorbed(h, &absorbed);
  lock_release(&h->lock);
  host_report_absorbed(&absorbed);
  int rc = GCA_OK;
  if (taken) {
    (void)host_release(h, taken, &rc);
    if (rc) gca__prefix_error("gca_host_empty_cache: a cached block stays pinned");
  }
  return rc;
}

int gca_host_is_pinned(gca_allocator_t *a, const void *ptr, int *pinned) {
  host_cache_t *h = host_of(a, "gca_host_is_pinned");
  if (!h) return GCA_ERR_INVALID;
  if (!pinned) return gca__set_error(GCA_ERR_INVALID, "gca_host_is_pinned: pinned is NULL");
  lock_acquire(&h->lock);
  uintptr_t at = (uintptr_t)ptr;
  *pinned = host_block_containing(h, at) != NULL ||
            (h->reserve.start && at >= h->reserve.start && at - h->reserve.start < h->reserve.size);
  lock_release(&h->lock);
  if (*pinned || !ptr || !host_ops_of(h)->host_is_pinned) return GCA_OK;
  return host_ops_of(h)->host_is_pinned(host_state_of(h), ptr, pinned);
}

size_t gca_host_usable_size(gca_allocator_t *a, void *ptr) {
  host_cache_t *h = host_of(a, "gca_host_usable_size");
  if (!h) return 0;
  lock_acquire(&h->lock);
  host_block_t *b = host_block_at(h, (uintptr_t)ptr);
  size_t size = b && b->state == HOST_IN_USE ? b->size : 0;
  lock_release(&h->lock);
  if (!size) gca__set_error(GCA_ERR_BAD_POINTER, "gca_host_usable_size: %p is not a live pinned block", ptr);
  return size;
}

int gca_host_stats(gca_allocator_t *a, gca_host_stats_t *out) {
  host_cache_t *h = host_of(a, "gca_host_stats");
  if (!h) return GCA_ERR_INVALID;
  if (!out) return gca__set_error(GCA_ERR_INVALID, "gca_host_stats: out is NULL");
  lock_acquire(&h->lock);
  *out = h->stats;
  lock_release(&h->lock);
  /* As PyTorch derives them: the slow path's counts. */
  out->num_host_alloc = out->segment.allocated;
  out->num_host_free = out->segment.freed;
  return GCA_OK;
}

int gca_host_reset_peak_stats(gca_allocator_t *a) {
  host_cache_t *h = host_of(a, "gca_host_reset_peak_stats");
  if (!h) return GCA_ERR_INVALID;
  lock_acquire(&h->lock);
  gca_stat_t *stats[] = {&h->stats.allocation, &h->stats.segment, &h->stats.allocated_bytes,
                         &h->stats.reserved_bytes};
  for (size_t i = 0; i < sizeof stats / sizeof stats[0]; i++) stats[i]->peak = stats[i]->current;
  h->stats.host_alloc_time.max = h->stats.host_alloc_time.min = 0;
  h->stats.host_free_time.max = h->stats.host_free_time.min = 0;
  lock_release(&h->lock);
  return GCA_OK;
}

int gca_host_reset_accumulated_stats(gca_allocator_t *a) {
  host_cache_t *h = host_of(a, "gca_host_reset_accumulated_stats");
  if (!h) return GCA_ERR_INVALID;
  lock_acquire(&h->lock);
  gca_stat_t *stats[] = {&h->stats.allocation, &h->stats.segment, &h->stats.allocated_bytes,
                         &h->stats.reserved_bytes};
  for (size_t i = 0; i < sizeof stats / sizeof stats[0]; i++) stats[i]->allocated = stats[i]->freed = 0;
  h->stats.host_alloc_time = (gca_duration_stat_t){0, 0, 0, 0};
  h->stats.host_free_time = (gca_duration_stat_t){0, 0, 0, 0};
  h->stats.num_alloc_retries = 0;
  h->stats.num_event_errors = 0;
  lock_release(&h->lock);
  return GCA_OK;
}

/* ---- life and checking -------------------------------------------------- */

/* Every cache, so that fork finds them: a child must not inherit a cache
 * whose lock the collecting thread held at that moment, nor a thread it
 * does not have. Before fork every cache's lock is taken (so no collector
 * is inside one, nor inside the backend for it); after, the locks are
 * released in both processes, and the child's caches have no collector
 * (one starts again when wanted). The process's fork handler (mempool.c)
 * calls these, after the devices' locks. */
static pthread_mutex_t host_caches_lock = PTHREAD_MUTEX_INITIALIZER;
static host_cache_t *host_caches;

void gca__host_before_fork(void) {
  mutex_lock(&host_caches_lock, RANK_HOST_REGISTRY);
  /* (The one place two caches' locks nest: in the registry's order, under
   * its lock, and no thread holds two otherwise.) */
  for (host_cache_t *h = host_caches; h; h = h->next_cache) lock_acquire_sibling(&h->lock);
}

void gca__host_after_fork_parent(void) {
  for (host_cache_t *h = host_caches; h; h = h->next_cache) lock_release(&h->lock);
  mutex_unlock(&host_caches_lock);
}

void gca__host_after_fork_child(void) {
  for (host_cache_t *h = host_caches; h; h = h->next_cache) {
    h->collector_started = false;
    atomic_store(&h->collector_stop, false);
    lock_release(&h->lock);
  }
  mutex_unlock(&host_caches_lock);
}

static void host_caches_add(host_cache_t *h) {
  mutex_lock(&host_caches_lock, RANK_HOST_REGISTRY);
  h->next_cache = host_caches;
  host_caches = h;
  mutex_unlock(&host_caches_lock);
}

static void host_caches_remove(host_cache_t *h) {
  mutex_lock(&host_caches_lock, RANK_HOST_REGISTRY);
  host_cache_t **at = &host_caches;
  while (*at && *at != h) at = &(*at)->next_cache;
  if (*at) *at = h->next_cache;
  mutex_unlock(&host_caches_lock);
}

int gca__host_cache_create(gca_allocator_t *a) {
  host_cache_t *h = calloc(1, sizeof *h);
  if (!h) return gca__set_error(GCA_ERR_NOMEM, "out of host memory opening the pinned host allocator");
  if (lock_init(&h->lock, RANK_HOST) != 0) {
    free(h);
    return gca__set_error(GCA_ERR_NOMEM, "cannot create the pinned host allocator's lock");
  }
  h->owner = a;
  a->host = h;
  host_caches_add(h);
  return GCA_OK;
}

/* Wait for the pending blocks' events, then unpin everything, blocks still
 * in use included (as closing frees device memory still allocated). A
 * block whose events cannot be waited for stays pinned: the device may
 * still copy into it, so giving it back to the host heap is not safe. */
void gca__host_cache_destroy(gca_allocator_t *a, bool forked) {
  host_cache_t *h = a->host;
  if (!h) return;
  host_caches_remove(h);
  if (forked) { /* (its collector is the parent's: a child has none) */
    for (size_t i = 0; i < h->count; i++) host_drop_block(h->blocks[i]);
    free(h->blocks);
    free(h->events);
    lock_destroy(&h->lock);
    free(h);
    a->host = NULL;
    return;
  }
  if (h->collector_started) {
    atomic_store(&h->collector_stop, true);
    pthread_join(h->collector, NULL);
  }
  size_t in_use = 0, kept = 0;
  for (size_t i = 0; i < h->queued; i++) {
    host_event_t *e = host_queued(h, i);
    if (!e->block) continue;
    if (e->block->doomed ||
        (e->event && host_ops_of(h)->event_synchronize(host_state_of(h), e->device, e->event) != GCA_OK))
      e->block->state = HOST_QUARANTINED;
    host_destroy_event(h, e);
  }
  bool reserve_doomed = false; /* a carved block the device may still copy into */
  for (size_t i = 0; i < h->count; i++) {
    host_block_t *b = h->blocks[i];
    in_use += b->state == HOST_IN_USE;
    for (uint32_t k = 0; k < b->use_count; k++)
      if (host_wait_stream(h, b->uses[k].device, b->uses[k].stream) != GCA_OK) b->state = HOST_QUARANTINED;
    if (b->carved) reserve_doomed |= b->state == HOST_QUARANTINED;
    else if (b->state == HOST_QUARANTINED || host_unpin(h, b) != GCA_OK) kept++;
    host_drop_block(b);
  }
  if (h->reserve.start) {
    host_block_t whole = {.addr = h->reserve.start, .size = h->reserve.size, .registered = h->reserve.registered};
    if (reserve_doomed || host_unpin(h, &whole) != GCA_OK)
      gca__log_message(GCA_LOG_WARNING, "pinned host allocator: the reserve segment (%zu bytes) left pinned at close",
                       h->reserve.size);
  }
  if (in_use)
    gca__log_message(GCA_LOG_INFO, "pinned host allocator: %zu block%s still in use at close unpinned", in_use,
                     in_use == 1 ? "" : "s");
  if (kept)
    gca__log_message(GCA_LOG_WARNING, "pinned host allocator: %zu block%s left pinned at close (the device could not "
                     "be shown done with them, or the backend refused)", kept, kept == 1 ? "" : "s");
  free(h->blocks);
  free(h->events);
  lock_destroy(&h->lock);
  free(h);
  a->host = NULL;
}

/* The invariants, for tests: the table is sorted and disjoint; every cached
 * block is in the free list of its size exactly once; the statistics agree
 * with the blocks; the queue holds exactly the pending events. */
int gca__host_cache_check(gca_allocator_t *a) {
  host_cache_t *h = host_of(a, "host_cache_check");
  if (!h) return GCA_ERR_INVALID;
  lock_acquire(&h->lock);
  int rc = GCA_OK;
  int64_t in_lists = 0, reserved = 0, allocated = 0, allocations = 0, pending = 0, quarantined = 0;
  size_t listed = 0;
  uint64_t events = 0;
  for (int k = 0; k < HOST_BUCKETS && rc == GCA_OK; k++)
    for (host_block_t *b = h->free_lists[k]; b && rc == GCA_OK; b = b->next_free) {
      if (b->state != HOST_CACHED || host_bucket_of(b->size) != k || host_block_at(h, b->addr) != b)
        rc = gca__set_error(GCA_ERR_CORRUPT, "host cache: block %p in free list %d is not a cached block of that size",
                            (void *)b->addr, k);
      in_lists += (int64_t)b->size;
      if (++listed > h->count) rc = gca__set_error(GCA_ERR_CORRUPT, "host cache: free list %d loops", k);
    }
  for (size_t i = 0; i < h->count && rc == GCA_OK; i++) {
    const host_block_t *b = h->blocks[i];
    if (b->size == 0 || (b->size & (b->size - 1)))
      rc = gca__set_error(GCA_ERR_CORRUPT, "host cache: block %p has size %zu, not a power of two", (void *)b->addr,
                          b->size);
    else if (i > 0 && h->blocks[i - 1]->addr + h->blocks[i - 1]->size > b->addr)
      rc = gca__set_error(GCA_ERR_CORRUPT, "host cache: blocks %p and %p overlap or are out of order",
                          (void *)h->blocks[i - 1]->addr, (void *)b->addr);
    else if (b->carved != (h->reserve.start && b->addr >= h->reserve.start &&
                           b->addr - h->reserve.start < h->reserve.size) ||
             (b->carved && b->addr + b->size > h->reserve.start + h->reserve.used))
      rc = gca__set_error(GCA_ERR_CORRUPT, "host cache: block %p is %s the reserve segment's carved part",
                          (void *)b->addr, b->carved ? "carved, but not in" : "not carved, but in");
    reserved += (int64_t)b->size;
    if (b->state != HOST_CACHED) allocated += (int64_t)b->size, allocations++;
    if (b->state == HOST_PENDING) pending++, events += b->events_pending;
    if (b->state == HOST_QUARANTINED) quarantined++;
    if ((b->state == HOST_PENDING) != (b->events_pending > 0) || (b->state != HOST_IN_USE && b->use_count))
      rc = gca__set_error(GCA_ERR_CORRUPT, "host cache: block %p in state %d has %u pending events and %u uses",
                          (void *)b->addr, b->state, b->events_pending, b->use_count);
  }
  uint64_t in_queue = 0;
  for (size_t i = 0; i < h->queued; i++) in_queue += host_queued(h, i)->block != NULL;
  const gca_host_stats_t *s = &h->stats;
  if (rc == GCA_OK && (s->reserved_bytes.current != reserved || s->segment.current != (int64_t)h->count ||
                       s->allocated_bytes.current != allocated || s->allocation.current != allocations ||
                       s->cached_bytes != in_lists || in_lists + allocated != reserved ||
                       s->pending_blocks != pending || s->quarantined_blocks != quarantined || in_queue != events))
    rc = gca__set_error(GCA_ERR_CORRUPT,
                        "host cache: statistics disagree with the blocks (reserved %" PRId64 "/%" PRId64
                        ", allocated %" PRId64 "/%" PRId64 ", cached %" PRId64 "/%" PRId64 ", pending %" PRId64
                        "/%" PRId64 ", events %" PRIu64 "/%" PRIu64 ")",
                        s->reserved_bytes.current, reserved, s->allocated_bytes.current, allocated, s->cached_bytes,
                        in_lists, s->pending_blocks, pending, in_queue, events);
  lock_release(&h->lock);
  return rc;
}
