/* Private pools: memory of a device that serves only the allocations routed
 * to it (PyTorch's private pools, as CUDA graphs and torch.cuda.MemPool use
 * them).
 *
 * A private pool is a pair of free indexes (small and large) of its own;
 * its segments point at them, so a block freed in the pool goes back to
 * them and is reused only there, and everything else (best fit, split and
 * merge, stream-ordered frees, the out-of-memory ladder) works on it as on
 * the default pools. Allocations reach a pool by a route: the calling
 * thread's stack of pushes (innermost first), else the stream's route.
 * While no route exists on a device (d->priv.routes is 0) an allocation pays one
 * branch for all this.
 *
 * The device's cache release (gca_empty_cache, the ladder) leaves private
 * pools alone: their memory is their graphs'. A pool's memory goes back when
 * its last reference is dropped, which is refused while anything in it is
 * live or routed there. Statistics per pool are counted from its segments
 * when asked, so the hot path keeps nothing per pool.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/coop.h"
#include "core/core.h"
#include "core/events.h"
#include "core/expandable.h"
#include "core/mempool.h"
#include "core/oom.h"

#define ROUTE_DEPTH 16

/* The calling thread's pushes. `device` NULL: pool 0 on every device of
 * the allocator. A push names its allocator by address and serial: an
 * allocator closed while a push to it is open leaves the entry stale, and
 * another allocator opened at the same address has another serial, so a
 * stale entry never routes, and pointers in it are never followed. */
typedef struct thread_route {
  gca_allocator_t *allocator;
  uint64_t serial;
  device_t *device;
  mempool_t *pool;
} thread_route_t;

static _Thread_local thread_route_t thread_routes[ROUTE_DEPTH];
static _Thread_local int thread_route_depth;

/* ---- the open allocators -------------------------------------------------
 * Which allocators are open, by serial, so a thread's push can be checked
 * for staleness without touching its allocator, and undone when its thread
 * exits (the key's destructor). The registry's lock comes before any
 * device lock; close unregisters first, so no route is undone on an
 * allocator that is going away. */

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
typedef struct open_allocator {
  uint64_t serial;
  gca_allocator_t *allocator; /* (what fork finds) */
} open_allocator_t;
static open_allocator_t *open_list;
static size_t open_count, open_cap;
static uint64_t last_serial;
static pthread_once_t exit_key_once = PTHREAD_ONCE_INIT;
static pthread_key_t exit_key;
static bool exit_key_made;

static void routes_at_exit(void *unused);
static void make_exit_key(void) { exit_key_made = pthread_key_create(&exit_key, routes_at_exit) == 0; }

int gca__allocator_register(gca_allocator_t *a) {
  mutex_lock(&registry_lock, RANK_POOL_REGISTRY);
  int rc = GCA_OK;
  if (open_count == open_cap) {
    open_allocator_t *grown = gca__grow_array(open_list, &open_cap, sizeof *grown, 8);
    if (grown) open_list = grown;
    else rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory opening the allocator");
  }
  if (rc == GCA_OK) open_list[open_count++] = (open_allocator_t){a->serial = ++last_serial, a};
  mutex_unlock(&registry_lock);
  return rc;
}

void gca__allocator_unregister(gca_allocator_t *a) {
  mutex_lock(&registry_lock, RANK_POOL_REGISTRY);
  for (size_t i = 0; i < open_count; i++)
    if (open_list[i].serial == a->serial) {
      open_list[i] = open_list[--open_count];
      break;
    }
  mutex_unlock(&registry_lock);
}

/* ---- fork ------------------------------------------------------------------
 * The books must be whole when fork copies them (src/api/allocator.c): the
 * registry's lock, then every device's of every open allocator, one at a
 * time in the registry's order under its lock (the one place device locks
 * nest), are taken before fork and let go after it in both processes; in
 * the child every allocator is marked forked. */

void gca__allocators_fork_prepare(void) {
  mutex_lock(&registry_lock, RANK_POOL_REGISTRY);
  for (size_t i = 0; i < open_count; i++)
    for (int k = 0; k < open_list[i].allocator->device_count; k++)
      lock_acquire_sibling(&open_list[i].allocator->devices[k].lock);
}

void gca__allocators_fork_done(bool child) {
  for (size_t i = 0; i < open_count; i++) {
    gca_allocator_t *a = open_list[i].allocator;
    if (child) {
      if (!a->forked) gca__calls_guard(1); /* (lowered at its close) */
      a->forked = true;
      for (int k = 0; k < a->device_count; k++) gca__coop_after_fork_child(a->devices[k].coop);
      if (a->backend.ops->after_fork_child) a->backend.ops->after_fork_child(a->backend.state);
    }
    for (int k = a->device_count; k-- > 0;) lock_release(&a->devices[k].lock);
  }
  mutex_unlock(&registry_lock);
}

/* With the registry locked. */
static bool route_live(const thread_route_t *r) {
  for (size_t i = 0; i < open_count; i++)
    if (open_list[i].serial == r->serial) return true;
  return false;
}

/* Undo a live push's counts. With the registry locked. */
static void route_undo(const thread_route_t *r) {
  if (r->device) {
    lock_acquire(&r->device->lock);
    r->pool->thread_routes--;
    r->device->priv.routes--;
    lock_release(&r->device->lock);
    return;
  }
  for (int i = 0; i < r->allocator->device_count; i++) {
    lock_acquire(&r->allocator->devices[i].lock);
    r->allocator->devices[i].priv.routes--;
    lock_release(&r->allocator->devices[i].lock);
  }
}

/* Drop the stale entries of this thread's stack. With the registry locked. */
static void routes_compact(void) {
  int kept = 0;
  for (int i = 0; i < thread_route_depth; i++)
    if (route_live(&thread_routes[i])) thread_routes[kept++] = thread_routes[i];
  thread_route_depth = kept;
}

/* A thread that ends inside pushes would pin their pools for ever: its
 * pushes are undone, innermost first. */
static void routes_at_exit(void *unused) {
  (void)unused;
  mutex_lock(&registry_lock, RANK_POOL_REGISTRY);
  while (thread_route_depth > 0) {
    const thread_route_t *r = &thread_routes[--thread_route_depth];
    if (route_live(r)) route_undo(r);
  }
  mutex_unlock(&registry_lock);
}

static pool_t *pool_for(mempool_t *mp, size_t rounded) { return rounded <= SMALL_SIZE ? &mp->small : &mp->large; }
static pool_t *pool_open_for(mempool_t *mp, size_t rounded);

pool_t *gca__mempool_route(device_t *d, gca_stream_t stream, size_t rounded, pool_t *fallback) {
  for (int i = thread_route_depth - 1; i >= 0; i--) {
    const thread_route_t *r = &thread_routes[i];
    if (r->allocator != d->owner || r->serial != d->owner->serial || (r->device && r->device != d)) continue;
    return r->pool ? pool_open_for(r->pool, rounded) : fallback;
  }
  for (size_t i = 0; i < d->priv.stream_route_count; i++)
    if (d->priv.stream_routes[i].stream == stream) return pool_open_for(d->priv.stream_routes[i].pool, rounded);
  return fallback;
}

bool gca__mempool_thread_pushed(const gca_allocator_t *a, int device) {
  for (int i = thread_route_depth - 1; i >= 0; i--) {
    const thread_route_t *r = &thread_routes[i];
    if (r->allocator != a || r->serial != a->serial) continue;
    if (r->device && r->device != &a->devices[device]) continue;
    return r->pool != NULL;
  }
  return false;
}

/* pool_for, but a paused pool serves nothing. */
static pool_t *pool_open_for(mempool_t *mp, size_t rounded) {
  if (!mp->paused) return pool_for(mp, rounded);
  gca__set_error(GCA_ERR_INVALID, "cannot allocate %zu bytes in pool %" PRIu64 ": it is paused (resume it first)",
                 rounded, mp->id);
  return NULL;
}

mempool_t *gca__mempool_find(device_t *d, uint64_t id) {
  for (mempool_t *mp = d->priv.list; mp; mp = mp->next)
    if (mp->id == id) return mp;
  return NULL;
}

pool_t *gca__device_pool_next(device_t *d, pool_t *pool) {
  if (!pool) return &d->small_pool;
  if (pool->kind == GCA_POOL_SMALL) return pool->owner ? &pool->owner->large : &d->large_pool;
  mempool_t *next = pool->owner ? pool->owner->next : d->priv.list;
  return next ? &next->small : NULL;
}

/* A private pool's own host memory (its backups' host copies go with the
 * host allocator). */
static void mempool_free(mempool_t *mp) {
  gca__pool_destroy(&mp->small);
  gca__pool_destroy(&mp->large);
  free(mp->backups);
  free(mp);
}

void gca__mempools_destroy(device_t *d) {
  while (d->priv.list) {
    mempool_t *next = d->priv.list->next;
    mempool_free(d->priv.list);
    d->priv.list = next;
  }
  free(d->priv.stream_routes);
  d->priv.stream_routes = NULL;
  d->priv.stream_route_count = d->priv.stream_route_cap = 0;
}

/* ---- lookup ------------------------------------------------------------- */

/* The pool `id` and its device, for call `what`: the device locked, or
 * for a reading call (`reading`) reached as device_read_lock reaches it;
 * *how says which, for device_read_unlock. NULL (nothing held) with the
 * error set. */
static mempool_t *mempool_reach(gca_allocator_t *a, uint64_t id, const char *what, bool reading, int *how) {
  if (!a) {
    gca__set_error(GCA_ERR_INVALID, "%s: allocator is NULL", what);
    return NULL;
  }
  if (!allocator_usable(a, what)) return NULL;
  for (int i = 0; id && i < a->device_count; i++) {
    device_t *d = &a->devices[i];
    if (reading) {
      if ((*how = device_read_lock(d, what)) == DEVICE_REFUSED) return NULL;
    } else {
      lock_acquire(&d->lock);
      *how = DEVICE_LOCKED;
    }
    mempool_t *mp = gca__mempool_find(d, id);
    if (mp) return mp;
    device_read_unlock(d, *how);
  }
  gca__set_error(GCA_ERR_INVALID, "%s: pool %" PRIu64 " does not exist%s", what, id,
                 id && id <= atomic_load(&a->last_pool_id) ? " (it was released)" : "");
  return NULL;
}

mempool_t *gca__mempool_lock(gca_allocator_t *a, uint64_t id, const char *what) {
  if (in_locked_callback()) {
    gca__callback_refuses(what);
    return NULL;
  }
  int how;
  return mempool_reach(a, id, what, false, &how);
}

/* ---- life --------------------------------------------------------------- */

int gca_pool_create(gca_allocator_t *a, int device, gca_pool_t *out) {
  return gca_pool_create_ex(a, device, 0, out);
}

int gca_pool_create_ex(gca_allocator_t *a, int device, unsigned flags, gca_pool_t *out) {
  device_t *d = gca__device_of(a, device, "gca_pool_create");
  if (!d) return gca_last_status();
  if (!out) return gca__set_error(GCA_ERR_INVALID, "gca_pool_create: out is NULL");
  const unsigned known = GCA_POOL_PAUSABLE | GCA_POOL_FINE_PAGES;
  if (flags & ~known) return gca__set_error(GCA_ERR_INVALID, "gca_pool_create: unknown flags %#x", flags & ~known);
  mempool_t *mp = calloc(1, sizeof *mp);
  if (!mp) return gca__set_error(GCA_ERR_NOMEM, "gca_pool_create: out of host memory");
  gca__pool_init(&mp->small, GCA_POOL_SMALL);
  gca__pool_init(&mp->large, GCA_POOL_LARGE);
  mp->small.owner = mp->large.owner = mp;
  mp->pausable = mp->small.pausable = mp->large.pausable = (flags & GCA_POOL_PAUSABLE) != 0;
  mp->small.fine_pages = mp->large.fine_pages = (flags & GCA_POOL_FINE_PAGES) != 0;
  mp->device = d;
  mp->references = 1;
  lock_acquire(&d->lock);
  /* A pool that pauses keeps its addresses: it needs the device's virtual memory. */
  if (mp->pausable && !gca__expandable_available(d)) {
    lock_release(&d->lock);
    mempool_free(mp);
    return gca__set_error(GCA_ERR_BACKEND, "gca_pool_create: device %d of the %s backend has no virtual memory: a "
                          "pool there cannot pause", device, d->backend->ops->name);
  }
  mp->id = atomic_fetch_add(&a->last_pool_id, 1) + 1;
  mempool_t **tail = &d->priv.list; /* (in creation order) */
  while (*tail) tail = &(*tail)->next;
  *tail = mp;
  lock_release(&d->lock);
  *out = mp->id;
  return GCA_OK;
}

int gca_pool_retain(gca_allocator_t *a, gca_pool_t pool) {
  mempool_t *mp = gca__mempool_lock(a, pool, "gca_pool_retain");
  if (!mp) return gca_last_status();
  mp->references++;
  lock_release(&mp->device->lock);
  return GCA_OK;
}

static size_t mapped_bytes_of(const device_t *d, const mempool_t *mp) {
  size_t bytes = 0;
  for (const segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->pool->owner == mp) bytes += seg->mapped_bytes;
  return bytes;
}

/* Give a segment left in an ending pool (its device refused the free) to
 * the default pool of its kind: the books stay whole. */
static void rehome(device_t *d, segment_t *seg) {
  pool_t *from = seg->pool, *to = home_pool(d, from);
  for (block_t *b = seg->head; b; b = b->next) {
    if (b->state == BLOCK_FREE) {
      gca__pool_remove(from, b);
      gca__pool_insert(to, b);
    } else if (b->state == BLOCK_UNMAPPED) {
      gca__pool_unmapped_remove(from, b);
      gca__pool_unmapped_insert(to, b);
    }
  }
  if (seg->expandable) {
    from->expandable_segments--;
    to->expandable_segments++;
  }
  gca__pool_unreserve(from, seg->stream); /* (`to` holds the reservation made with it: segment.c) */
  seg->pool = to;
}

/* What the pool holds, counted from its segments into *out (zeroed
 * first): its statistics but those kept on the pool itself. Returns the
 * pending blocks, which the statistics count only in bytes. */
static size_t count_pool(const mempool_t *mp, gca_pool_stats_t *out) {
  memset(out, 0, sizeof *out);
  size_t pending = 0;
  for (segment_t *seg = mp->device->segments; seg; seg = seg->next) {
    if (seg->pool->owner != mp) continue;
    out->segments++;
    out->reserved_bytes += seg->expandable ? seg->mapped_bytes : seg->size;
    for (block_t *b = seg->head; b; b = b->next) {
      if (b->state == BLOCK_ALLOCATED) {
        out->allocations++;
        out->allocated_bytes += b->size;
        out->requested_bytes += b->requested;
      } else if (b->state == BLOCK_PENDING || b->state == BLOCK_QUARANTINED) {
        pending++;
        out->pending_bytes += b->size;
      } else if (b->state == BLOCK_FREE && !seg->paused_pages) { /* (a paused pool caches nothing) */
        out->cached_bytes += b->size;
      }
    }
  }
  return pending;
}

/* What keeps the pool from ending, given what it holds (count_pool), or NULL. */
static const char *busy(const mempool_t *mp, const gca_pool_stats_t *held, size_t pending, char *why, size_t cap) {
  if (held->allocations) {
    char text[32];
    gca__format_bytes(held->allocated_bytes, text, sizeof text);
    snprintf(why, cap, "%" PRIu64 " block%s (%s) of it %s live", held->allocations, held->allocations == 1 ? "" : "s",
             text, held->allocations == 1 ? "is" : "are");
    return why;
  }
  if (pending) { /* (freed, but the device would not say when its streams are done with them) */
    char text[32];
    gca__format_bytes(held->pending_bytes, text, sizeof text);
    snprintf(why, cap, "%zu freed block%s (%s) of it still wait%s for work on %s streams", pending,
             pending == 1 ? "" : "s", text, pending == 1 ? "s" : "", pending == 1 ? "its" : "their");
    return why;
  }
  if (mp->thread_routes || mp->stream_routes) {
    snprintf(why, cap, "allocations are routed to it (%zu thread push%s, %zu stream%s)", mp->thread_routes,
             mp->thread_routes == 1 ? "" : "es", mp->stream_routes, mp->stream_routes == 1 ? "" : "s");
    return why;
  }
  return NULL;
}

int gca_pool_release(gca_allocator_t *a, gca_pool_t pool) {
  gca__drain_devices(a, false); /* (its segments go back to the device) */
  return gca__pool_release_drained(a, pool);
}

int gca__pool_release_drained(gca_allocator_t *a, gca_pool_t pool) {
  mempool_t *mp = gca__mempool_lock(a, pool, "gca_pool_release");
  if (!mp) return gca_last_status();
  device_t *d = mp->device;
  if (mp->references > 1) {
    mp->references--;
    lock_release(&d->lock);
    return GCA_OK;
  }
  char why[160];
  if (d->capture.count) {
    lock_release(&d->lock);
    return gca__set_error(GCA_ERR_INVALID, "gca_pool_release: pool %" PRIu64 " cannot end while a stream of device %d "
                          "is captured (its memory would go back to the device)", pool, d->index);
  }
  /* Frees still waiting for their streams (those held during a capture
   * included) complete first, as PyTorch synchronizes a private pool's
   * events before it releases the pool. */
  gca_pool_stats_t held;
  size_t pending = count_pool(mp, &held);
  if (pending && !held.allocations) {
    if (gca__mempool_quiesce(d, mp) != GCA_OK) gca__clear_error();
    pending = count_pool(mp, &held);
  }
  if (busy(mp, &held, pending, why, sizeof why)) {
    lock_release(&d->lock);
    return gca__set_error(GCA_ERR_INVALID, "gca_pool_release: pool %" PRIu64 " cannot end: %s", pool, why);
  }
  if (mp->paused) {
    /* Pages the device would not unmap at the pause are offered again. */
    size_t unmapped = 0;
    (void)gca__mempool_unmap(d, mp, &unmapped);
    size_t mapped = mapped_bytes_of(d, mp);
    if (mapped) {
      char text[32];
      gca__format_bytes(mapped, text, sizeof text);
      lock_release(&d->lock);
      return gca__set_error(GCA_ERR_BACKEND, "gca_pool_release: pool %" PRIu64 " is paused, and the device refused "
                            "to unmap %s of it: try again later", pool, text);
    }
    /* Nothing mapped, nothing live: its addresses go back. */
    for (segment_t *seg = d->segments, *next; seg; seg = next) {
      next = seg->next;
      if (seg->pool->owner == mp && seg->paused_pages) gca__expandable_release_paused(d, seg);
    }
    mp->paused = false;
    d->priv.paused--;
  }
  gca__mempool_drop_backups(d, mp);
  /* Its cache goes back after the work queued on its streams (a segment
   * whose stream is busy is released when that work completes). */
  gca__segment_release_pool(d, &mp->small);
  gca__segment_release_pool(d, &mp->large);
  gca__expandable_release_pool(d, &mp->small);
  gca__expandable_release_pool(d, &mp->large);
  gca__events_finish_releases(d, true);
  for (segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->pool->owner == mp) rehome(d, seg);
  for (mempool_t **p = &d->priv.list; *p; p = &(*p)->next)
    if (*p == mp) {
      *p = mp->next;
      break;
    }
  lock_release(&d->lock);
  mempool_free(mp);
  device_wake_waiters(d); /* (memory came back) */
  return GCA_OK;
}

/* ---- pausing (the front end's gca_pool_pause and gca_pool_resume) --------- */

/* A set of streams, in an array that grows. */
typedef struct stream_set {
  gca_stream_t *items;
  size_t count, cap;
} stream_set_t;

static int stream_set_add(stream_set_t *set, gca_stream_t s) {
  for (size_t i = 0; i < set->count; i++)
    if (set->items[i] == s) return GCA_OK;
  if (set->count == set->cap) {
    gca_stream_t *grown = gca__grow_array(set->items, &set->cap, sizeof *grown, 16);
    if (!grown) return gca__set_error(GCA_ERR_NOMEM, "out of host memory for allocator bookkeeping");
    set->items = grown;
  }
  set->items[set->count++] = s;
  return GCA_OK;
}

int gca__mempool_quiesce(device_t *d, mempool_t *mp) {
  stream_set_t set = {0};
  int rc = GCA_OK;
  /* (Work on live blocks may still wait in the framework's queue: the
   * callers drained it, with no lock held, before they took the lock.) */
  for (segment_t *seg = d->segments; seg && rc == GCA_OK; seg = seg->next) {
    if (seg->pool->owner != mp) continue;
    rc = stream_set_add(&set, seg->stream);
    for (block_t *b = seg->head; b && rc == GCA_OK; b = b->next)
      for (uint32_t k = 0; block_uses(b) && k < b->uses->count && rc == GCA_OK; k++) rc = stream_set_add(&set, b->uses->streams[k]);
  }
  for (size_t q = 0; q < d->ev.queue_count && rc == GCA_OK; q++) {
    const event_queue_t *eq = &d->ev.queues[q];
    for (size_t j = 0; j < eq->count && rc == GCA_OK; j++)
      if (block_pool(eq->items[(eq->head + j) % eq->cap].block)->owner == mp) rc = stream_set_add(&set, eq->stream);
  }
  for (size_t i = 0; rc == GCA_OK && i < set.count; i++) rc = gca__events_wait_stream(d, set.items[i]);
  free(set.items);
  if (rc == GCA_OK) gca__events_process(d); /* (the pool's pending frees are done now) */
  return rc;
}

int gca__mempool_unmap(device_t *d, mempool_t *mp, size_t *released) {
  *released = 0;
  int rc = GCA_OK;
  for (segment_t *seg = d->segments; seg; seg = seg->next) {
    if (seg->pool->owner != mp) continue;
    int one = gca__expandable_pause(d, seg, released);
    if (rc == GCA_OK) rc = one;
  }
  return rc;
}

/* All of the pool's pages mapped again, or none: a resume that runs out of
 * memory part way unmaps what it mapped, so the pool is paused exactly as
 * before (and can be resumed, released or freed into later). */
int gca__mempool_remap(device_t *d, mempool_t *mp) {
  int rc = GCA_OK;
  for (segment_t *seg = d->segments; seg && rc == GCA_OK; seg = seg->next)
    if (seg->pool->owner == mp) rc = gca__expandable_resume(d, seg);
  if (rc == GCA_OK) return GCA_OK;
  size_t undone = 0;
  for (segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->pool->owner == mp) (void)gca__expandable_pause(d, seg, &undone);
  return rc;
}

size_t gca__mempool_live_bytes(const device_t *d, const mempool_t *mp) {
  size_t bytes = 0;
  for (const segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->pool->owner == mp)
      for (const block_t *b = seg->head; b; b = b->next) bytes += b->state == BLOCK_ALLOCATED ? b->size : 0;
  return bytes;
}

size_t gca__mempool_paused_bytes(const device_t *d, const mempool_t *mp) {
  size_t bytes = 0;
  for (const segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->pool->owner == mp && seg->paused_pages)
      for (size_t i = 0; i < seg->page_cap; i++) bytes += seg->paused_pages[i] ? seg->page_size : 0;
  return bytes;
}

size_t gca__mempool_trim(device_t *d, mempool_t *mp) {
  size_t before = mapped_bytes_of(d, mp);
  gca__expandable_release_pool(d, &mp->small);
  gca__expandable_release_pool(d, &mp->large);
  return before - mapped_bytes_of(d, mp);
}

void gca__mempool_drop_backups(device_t *d, mempool_t *mp) {
  for (size_t i = 0; i < mp->backup_count; i++) mp->drop_backup(d->owner, mp->backups[i].host);
  mp->backup_count = 0;
  mp->backup_bytes = 0;
}

void gca__mempool_drop_backup_of(device_t *d, mempool_t *mp, uintptr_t addr) {
  for (size_t i = 0; i < mp->backup_count; i++) {
    if (mp->backups[i].addr != addr) continue;
    mp->drop_backup(d->owner, mp->backups[i].host);
    mp->backup_bytes -= mp->backups[i].size;
    mp->backups[i] = mp->backups[--mp->backup_count];
    return;
  }
}

/* ---- routes ------------------------------------------------------------- */

int gca_pool_push(gca_allocator_t *a, gca_pool_t pool) {
  if (call_refused(a, "gca_pool_push")) return gca_last_status();
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_pool_push: allocator is NULL");
  pthread_once(&exit_key_once, make_exit_key);
  mutex_lock(&registry_lock, RANK_POOL_REGISTRY);
  routes_compact();
  int rc = GCA_OK;
  if (thread_route_depth == ROUTE_DEPTH)
    rc = gca__set_error(GCA_ERR_INVALID, "gca_pool_push: this thread has %d pushes already", ROUTE_DEPTH);
  else if (!exit_key_made || pthread_setspecific(exit_key, thread_routes) != 0)
    rc = gca__set_error(GCA_ERR_NOMEM, "gca_pool_push: cannot arrange for this thread's pushes to end with it");
  thread_route_t r = {a, a->serial, NULL, NULL};
  if (rc == GCA_OK && pool) {
    mempool_t *mp = gca__mempool_lock(a, pool, "gca_pool_push");
    if (mp) {
      r.device = mp->device;
      r.pool = mp;
      mp->thread_routes++;
      mp->device->priv.routes++;
      lock_release(&mp->device->lock);
    } else {
      rc = gca_last_status();
    }
  } else if (rc == GCA_OK) {
    for (int i = 0; i < a->device_count; i++) {
      lock_acquire(&a->devices[i].lock);
      a->devices[i].priv.routes++;
      lock_release(&a->devices[i].lock);
    }
  }
  if (rc == GCA_OK) thread_routes[thread_route_depth++] = r;
  mutex_unlock(&registry_lock);
  return rc;
}

/* `a` is only compared until the top entry is known to be a live push to
 * it: a pop after a concurrent close finds the push stale and says so. */
int gca_pool_pop(gca_allocator_t *a) {
  if (in_locked_callback()) return gca__callback_refuses("gca_pool_pop");
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_pool_pop: allocator is NULL");
  mutex_lock(&registry_lock, RANK_POOL_REGISTRY);
  bool stale = false;
  while (thread_route_depth > 0 && !route_live(&thread_routes[thread_route_depth - 1])) {
    stale |= thread_routes[thread_route_depth - 1].allocator == a;
    thread_route_depth--;
  }
  int rc = GCA_OK;
  if (thread_route_depth == 0 || thread_routes[thread_route_depth - 1].allocator != a)
    rc = gca__set_error(GCA_ERR_INVALID, "gca_pool_pop: this thread's last push was not to this allocator%s",
                        stale ? " (its push ended when the allocator was closed)"
                        : thread_route_depth ? "" : " (it has none)");
  else if (!allocator_usable(a, "gca_pool_pop")) /* (live: its push is, under the registry's lock) */
    rc = GCA_ERR_INVALID;
  else
    route_undo(&thread_routes[--thread_route_depth]);
  mutex_unlock(&registry_lock);
  return rc;
}

/* Route `stream` to the pool (a capture's route if `capture`). */
static int route_stream(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream, bool capture, const char *what) {
  mempool_t *mp = gca__mempool_lock(a, pool, what);
  if (!mp) return gca_last_status();
  device_t *d = mp->device;
  int rc = GCA_OK;
  for (size_t i = 0; i < d->priv.stream_route_count && rc == GCA_OK; i++)
    if (d->priv.stream_routes[i].stream == stream)
      rc = gca__set_error(GCA_ERR_INVALID, "%s: stream %#" PRIxPTR " is routed to pool %" PRIu64 " already%s", what,
                          (uintptr_t)stream, d->priv.stream_routes[i].pool->id,
                          d->priv.stream_routes[i].capture ? " (captured)" : "");
  if (rc == GCA_OK && d->priv.stream_route_count == d->priv.stream_route_cap) {
    stream_route_t *grown = gca__grow_array(d->priv.stream_routes, &d->priv.stream_route_cap, sizeof *grown, 4);
    if (grown) d->priv.stream_routes = grown;
    else rc = gca__set_error(GCA_ERR_NOMEM, "%s: out of host memory", what);
  }
  if (rc == GCA_OK) {
    d->priv.stream_routes[d->priv.stream_route_count++] = (stream_route_t){stream, mp, capture};
    mp->stream_routes++;
    d->priv.routes++;
    d->capture.count += capture;
  }
  lock_release(&d->lock);
  return rc;
}

static int unroute_stream(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream, bool capture, const char *what) {
  mempool_t *mp = gca__mempool_lock(a, pool, what);
  if (!mp) return gca_last_status();
  device_t *d = mp->device;
  for (size_t i = 0; i < d->priv.stream_route_count; i++) {
    stream_route_t *r = &d->priv.stream_routes[i];
    if (r->stream != stream || r->pool != mp || r->capture != capture) continue;
    *r = d->priv.stream_routes[--d->priv.stream_route_count];
    mp->stream_routes--;
    d->priv.routes--;
    /* The last capture ended: the frees held meanwhile record their events. */
    if (capture && --d->capture.count == 0) gca__events_after_capture(d);
    lock_release(&d->lock);
    return GCA_OK;
  }
  lock_release(&d->lock);
  return gca__set_error(GCA_ERR_INVALID, "%s: stream %#" PRIxPTR " is not %s pool %" PRIu64, what, (uintptr_t)stream,
                        capture ? "captured into" : "routed to", pool);
}

int gca_pool_route_stream(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream) {
  return route_stream(a, pool, stream, false, "gca_pool_route_stream");
}

int gca_pool_unroute_stream(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream) {
  return unroute_stream(a, pool, stream, false, "gca_pool_unroute_stream");
}

int gca_capture_begin(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream) {
  return route_stream(a, pool, stream, true, "gca_capture_begin");
}

int gca_capture_end(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream) {
  return unroute_stream(a, pool, stream, true, "gca_capture_end");
}

int gca__capture_hold(gca_allocator_t *a, gca_pool_t pool, bool hold) {
  mempool_t *mp = gca__mempool_lock(a, pool, "a graph capture");
  if (!mp) return gca_last_status();
  device_t *d = mp->device;
  if (hold) d->capture.count++;
  else if (d->capture.count && --d->capture.count == 0) gca__events_after_capture(d);
  lock_release(&d->lock);
  return GCA_OK;
}

int gca__device_capturing(device_t *d, const char *what) {
  lock_acquire(&d->lock);
  size_t captures = d->capture.count;
  lock_release(&d->lock);
  if (!captures) return GCA_OK;
  return gca__set_error(GCA_ERR_INVALID, "%s: device %d has %zu stream%s captured into a graph: nothing may be "
                        "synchronized or given back until the capture ends", what, d->index, captures,
                        captures == 1 ? "" : "s");
}

/* ---- looking ------------------------------------------------------------ */

int gca_pool_get_stats(gca_allocator_t *a, gca_pool_t pool, gca_pool_stats_t *out) {
  if (!out) return gca__set_error(GCA_ERR_INVALID, "gca_pool_get_stats: out is NULL");
  int how;
  mempool_t *mp = mempool_reach(a, pool, "gca_pool_get_stats", true, &how);
  if (!mp) return gca_last_status();
  (void)count_pool(mp, out);
  out->id = mp->id;
  out->device = mp->device->index;
  out->references = mp->references;
  out->routes = mp->thread_routes + mp->stream_routes;
  out->pausable = mp->pausable;
  out->paused = mp->paused;
  out->backup_bytes = mp->backup_bytes;
  device_read_unlock(mp->device, how);
  return GCA_OK;
}

int gca_pool_of(gca_allocator_t *a, void *ptr, gca_pool_t *out) {
  if (!a || !ptr || !out)
    return gca__set_error(GCA_ERR_INVALID, "gca_pool_of: %s is NULL", !a ? "allocator" : !ptr ? "pointer" : "out");
  for (int i = 0; i < a->device_count; i++) {
    device_t *d = &a->devices[i];
    int how = device_read_lock(d, "gca_pool_of");
    if (how == DEVICE_REFUSED) return gca_last_status();
    block_t *b = gca__block_map_find(&d->allocated, (uintptr_t)ptr);
    if (b) *out = block_pool(b)->owner ? block_pool(b)->owner->id : 0;
    device_read_unlock(d, how);
    if (b) return GCA_OK;
  }
  return gca__set_error(GCA_ERR_BAD_POINTER, "gca_pool_of: %p is not a live allocation", ptr);
}

int gca_pool_list(gca_allocator_t *a, int device, gca_pool_t *out, size_t cap) {
  device_t *d = gca__device_of_reading(a, device, "gca_pool_list");
  if (!d) return gca_last_status();
  if (!out && cap) return gca__set_error(GCA_ERR_INVALID, "gca_pool_list: out is NULL");
  int n = 0;
  int how = device_read_lock(d, "gca_pool_list");
  if (how == DEVICE_REFUSED) return gca_last_status();
  for (mempool_t *mp = d->priv.list; mp; mp = mp->next, n++)
    if ((size_t)n < cap) out[n] = mp->id;
  device_read_unlock(d, how);
  return n;
}
