/* Pausing and resuming a private pool (docs/pools.md): its physical
 * memory given back while its addresses stay reserved, optionally with a
 * host copy of what is live, then new memory mapped at the same addresses
 * and the copies written back.
 *
 * The front end does it because it needs both the core (the pool, its
 * pages) and the pinned host allocator, which sits above the core. All of
 * it runs under the device's lock, so nothing in the pool changes between
 * the copy and the unmap; the only waits are for the pool's own streams.
 * The core drops a copy when its block is freed while paused, through the
 * pool's drop_backup hook.
 */
#include <inttypes.h>
#include <stdlib.h>

#include "core/coop.h"
#include "core/core.h"
#include "core/events.h"
#include "core/mempool.h"
#include "core/oom.h"
#include "host/host.h"

/* A copy no longer wanted goes back to the system, not to the pinned
 * allocator's cache: it is as large as what was paused, and would stay
 * resident until gca_host_empty_cache. */
static void drop_backup(gca_allocator_t *a, void *host) { (void)gca__host_free_uncached(a, host); }

/* A copy kept from the last resume (GCA_RESUME_KEEP_BACKUP) for the block
 * at `addr` of `size` bytes, taken out of `kept`; NULL if none. */
static void *take_kept(pool_backup_t *kept, size_t count, uintptr_t addr, size_t size) {
  for (size_t i = 0; i < count; i++) {
    if (kept[i].host && kept[i].addr == addr && kept[i].size == size) {
      void *host = kept[i].host;
      kept[i].host = NULL;
      return host;
    }
  }
  return NULL;
}

/* remap_making_room's answer when another thread resumed the pool while the
 * peers were asked (not a gca_status). */
#define GCA_RESUMED_ELSEWHERE 1

/* Map a paused pool back, making room as an allocation does: out of
 * memory, this process's own cache is given back (the ladder's last step)
 * and the mapping tried again; then, with ipc_cooperation:True, the other
 * processes on the device are asked for `need` bytes, without the device's
 * lock, and the pool is looked up again by its id (*mp NULL: it was
 * released meanwhile, the error set, nothing locked). With the lock held. */
static int remap_making_room(gca_allocator_t *a, gca_pool_t pool, mempool_t **mp, size_t need) {
  device_t *d = (*mp)->device;
  int rc = gca__mempool_remap(d, *mp);
  if (rc != GCA_ERR_OOM) return rc;
  d->drain.wanted = false;
  gca__device_release_cache_locked(d);
  rc = gca__mempool_remap(d, *mp);
  if (rc == GCA_ERR_OOM && d->drain.wanted) {
    /* Cache held back until the framework's queue is drained: drained
     * with no lock held, and the pool looked up again. */
    lock_release(&d->lock);
    gca__drain_devices(a, false);
    *mp = gca__mempool_lock(a, pool, "gca_pool_resume");
    if (!*mp) return gca__prefix_error("gca_pool_resume: while the framework's queue was drained");
    if (!(*mp)->paused) return GCA_RESUMED_ELSEWHERE;
    gca__device_release_cache_locked(d);
    rc = gca__mempool_remap(d, *mp);
  }
  if (rc != GCA_ERR_OOM || !d->coop) return rc;
  atomic_store(&d->coop_waiting, (int64_t)need);
  uint64_t timeout_ms = d->config.ipc_release_timeout_ms; /* (read under the lock: gca_set_config writes it) */
  lock_release(&d->lock);
  coop_outcome_t got;
  gca__coop_ask(d->coop, need, 0, timeout_ms, &got);
  *mp = gca__mempool_lock(a, pool, "gca_pool_resume");
  atomic_store(&d->coop_waiting, 0);
  if (!*mp) return gca__prefix_error("gca_pool_resume: while the other processes were asked for memory");
  gca__device_peers_answered(d, need, 0, &got, NULL);
  if (!(*mp)->paused) return GCA_RESUMED_ELSEWHERE;
  return gca__mempool_remap(d, *mp);
}


/* Copy every live block of the pool to pinned host memory and wait for the
 * copies; on failure nothing is kept. Copies kept from the last resume
 * serve again the blocks still at their address and size (no new pinning:
 * a pool paused and resumed often keeps them); the others go back. */
static int take_backups(gca_allocator_t *a, device_t *d, mempool_t *mp) {
  const backend_ops_t *ops = d->backend->ops;
  if (!ops->copy_to_host || !ops->copy_to_device) {
    gca__mempool_drop_backups(d, mp);
    return gca__set_error(GCA_ERR_BACKEND, "gca_pool_pause: the %s backend cannot copy to host memory", ops->name);
  }
  mp->drop_backup = drop_backup;
  pool_backup_t *kept = mp->backups;
  size_t kept_count = mp->backup_count;
  mp->backups = NULL;
  mp->backup_count = mp->backup_cap = mp->backup_bytes = 0;
  int rc = GCA_OK;
  for (segment_t *seg = d->segments; seg && rc == GCA_OK; seg = seg->next) {
    if (seg->pool->owner != mp) continue;
    for (block_t *b = seg->head; b && rc == GCA_OK; b = b->next) {
      if (b->state != BLOCK_ALLOCATED) continue;
      if (mp->backup_count == mp->backup_cap) {
        pool_backup_t *grown = gca__grow_array(mp->backups, &mp->backup_cap, sizeof *grown, 16);
        if (!grown) {
          rc = gca__set_error(GCA_ERR_NOMEM, "gca_pool_pause: out of host memory for the list of copies");
          break;
        }
        mp->backups = grown;
      }
      size_t size = b->requested ? b->requested : b->size;
      void *host = take_kept(kept, kept_count, b->addr, size);
      if (!host) host = gca_host_malloc(a, size);
      if (!host) {
        rc = gca_last_status() ? gca_last_status() : GCA_ERR_NOMEM;
        gca__prefix_error("gca_pool_pause: no pinned host memory for the copy of %zu bytes at %#" PRIxPTR, size, b->addr);
        break;
      }
      mp->backups[mp->backup_count++] = (pool_backup_t){b->addr, size, block_stream(b), host};
      mp->backup_bytes += size;
      rc = ops->copy_to_host(d->backend->state, d->index, block_stream(b), host, b->addr, size);
    }
  }
  for (size_t i = 0; rc == GCA_OK && i < mp->backup_count; i++) rc = gca__events_wait_stream(d, mp->backups[i].stream);
  for (size_t i = 0; i < kept_count; i++)
    if (kept[i].host) drop_backup(a, kept[i].host);
  free(kept);
  if (rc != GCA_OK) gca__mempool_drop_backups(d, mp);
  return rc;
}

/* Write the copies back, each on its block's stream, and wait for them. */
static int restore_backups(device_t *d, mempool_t *mp) {
  const backend_ops_t *ops = d->backend->ops;
  int rc = GCA_OK;
  for (size_t i = 0; rc == GCA_OK && i < mp->backup_count; i++) {
    const pool_backup_t *k = &mp->backups[i];
    rc = ops->copy_to_device(d->backend->state, d->index, k->stream, k->addr, k->host, k->size);
  }
  for (size_t i = 0; rc == GCA_OK && i < mp->backup_count; i++) rc = gca__events_wait_stream(d, mp->backups[i].stream);
  return rc;
}

int gca_pool_pause(gca_allocator_t *a, gca_pool_t pool, unsigned flags, size_t *released) {
  if (released) *released = 0;
  if (flags & ~(unsigned)GCA_PAUSE_BACKUP)
    return gca__set_error(GCA_ERR_INVALID, "gca_pool_pause: unknown flags %#x", flags & ~(unsigned)GCA_PAUSE_BACKUP);
  /* Work on the pool's live blocks may still wait in the framework's
   * queue: drained first, with no lock held. */
  if (!in_locked_callback()) gca__drain_devices(a, true);
  mempool_t *mp = gca__mempool_lock(a, pool, "gca_pool_pause");
  if (!mp) return gca_last_status();
  device_t *d = mp->device;
  int rc = GCA_OK;
  if (!mp->pausable)
    rc = gca__set_error(GCA_ERR_INVALID, "gca_pool_pause: pool %" PRIu64 " cannot pause (create it with "
                        "GCA_POOL_PAUSABLE)", pool);
  else if (mp->paused)
    rc = gca__set_error(GCA_ERR_INVALID, "gca_pool_pause: pool %" PRIu64 " is paused already", pool);
  else if (d->capture.count)
    rc = gca__set_error(GCA_ERR_INVALID, "gca_pool_pause: device %d has a stream captured into a graph", d->index);
  if (rc == GCA_OK) rc = gca__mempool_quiesce(d, mp);
  /* (copies kept from a resume are out of date: taken again, or dropped) */
  if (rc == GCA_OK && (flags & GCA_PAUSE_BACKUP)) rc = take_backups(a, d, mp);
  else if (rc == GCA_OK) gca__mempool_drop_backups(d, mp);
  size_t bytes = 0;
  if (rc == GCA_OK) {
    /* The free cache goes back for good: the resume maps only what is live. */
    size_t trimmed = gca__mempool_trim(d, mp);
    mp->paused = true;
    d->priv.paused++;
    atomic_fetch_add(&d->paused_now, (int64_t)gca__mempool_live_bytes(d, mp));
    rc = gca__mempool_unmap(d, mp, &bytes);
    bytes += trimmed;
  }
  lock_release(&d->lock);
  if (bytes) device_wake_waiters(d); /* (memory came back) */
  if (released) *released = bytes;
  return rc;
}

int gca_pool_resume(gca_allocator_t *a, gca_pool_t pool, unsigned flags) {
  if (flags & ~(unsigned)GCA_RESUME_KEEP_BACKUP)
    return gca__set_error(GCA_ERR_INVALID, "gca_pool_resume: unknown flags %#x",
                          flags & ~(unsigned)GCA_RESUME_KEEP_BACKUP);
  mempool_t *mp = gca__mempool_lock(a, pool, "gca_pool_resume");
  if (!mp) return gca_last_status();
  device_t *d = mp->device;
  int rc = GCA_OK;
  if (!mp->paused)
    rc = gca__set_error(GCA_ERR_INVALID, "gca_pool_resume: pool %" PRIu64 " is not paused", pool);
  else if (d->capture.count)
    rc = gca__set_error(GCA_ERR_INVALID, "gca_pool_resume: device %d has a stream captured into a graph", d->index);
  if (rc == GCA_OK) {
    size_t need = gca__mempool_paused_bytes(d, mp);
    rc = remap_making_room(a, pool, &mp, need);
    if (!mp) return rc; /* (released by another thread while the peers were asked) */
    d = mp->device;
    if (rc == GCA_RESUMED_ELSEWHERE) {
      lock_release(&d->lock);
      return GCA_OK;
    }
    if (rc != GCA_OK) {
      char text[32];
      gca__format_bytes(need, text, sizeof text);
      gca__prefix_error("gca_pool_resume: pool %" PRIu64 " needs %s mapped back and stays paused", pool, text);
      if (rc == GCA_ERR_OOM && d->coop) {
        char others[1024];
        gca__coop_describe_others(d->coop, others, sizeof others);
        const char *asked = gca__coop_last(d->coop);
        gca__append_error(". Processes sharing the device: %s; asked to release their cache: %s.", others,
                          asked[0] ? asked : "none caches anything");
      }
    }
  }
  if (rc == GCA_OK) {
    mp->paused = false;
    d->priv.paused--;
    atomic_fetch_sub(&d->paused_now, (int64_t)gca__mempool_live_bytes(d, mp));
    rc = restore_backups(d, mp);
    if (rc != GCA_OK) gca__prefix_error("gca_pool_resume: pool %" PRIu64 " runs, but its data was not restored", pool);
    else if (!(flags & GCA_RESUME_KEEP_BACKUP)) gca__mempool_drop_backups(d, mp);
  }
  lock_release(&d->lock);
  return rc;
}

/* The pausable pools of `device` (-1: every device) that are paused (or
 * not, per `paused`), into a malloc'ed array; -1 with the error set. */
static int pausable_pools(gca_allocator_t *a, int device, bool paused, gca_pool_t **out, const char *what) {
  *out = NULL;
  int first = device, last = device;
  if (device == -1) first = 0, last = gca_device_count(a) - 1;
  else if (!gca__device_of(a, device, what)) return -1;
  size_t n = 0, cap = 0;
  for (int i = first; i <= last; i++) {
    device_t *d = gca__device_of(a, i, what);
    if (!d) continue;
    lock_acquire(&d->lock);
    for (mempool_t *mp = d->priv.list; mp; mp = mp->next) {
      if (!mp->pausable || mp->paused != paused) continue;
      if (n == cap) {
        gca_pool_t *grown = gca__grow_array(*out, &cap, sizeof *grown, 8);
        if (!grown) {
          lock_release(&d->lock);
          free(*out);
          *out = NULL;
          gca__set_error(GCA_ERR_NOMEM, "%s: out of host memory listing the pools", what);
          return -1;
        }
        *out = grown;
      }
      (*out)[n++] = mp->id;
    }
    lock_release(&d->lock);
  }
  return (int)n;
}

typedef int (*pool_action_t)(gca_allocator_t *a, gca_pool_t pool, unsigned flags, size_t *bytes);

static int pause_one(gca_allocator_t *a, gca_pool_t pool, unsigned flags, size_t *bytes) {
  return gca_pool_pause(a, pool, flags, bytes);
}

static int resume_one(gca_allocator_t *a, gca_pool_t pool, unsigned flags, size_t *bytes) {
  *bytes = 0;
  return gca_pool_resume(a, pool, flags);
}

/* `act` on every pausable pool of `device` (-1: every device) that is
 * paused (or not, per `paused`): every one is tried, the first failure
 * returned with its message; *sum (may be NULL) adds up what each gave. */
static int every_pool(gca_allocator_t *a, int device, bool paused, pool_action_t act, unsigned flags, size_t *sum,
                      const char *what) {
  if (sum) *sum = 0;
  if (!a) return gca__set_error(GCA_ERR_INVALID, "%s: allocator is NULL", what);
  gca_pool_t *ids;
  int n = pausable_pools(a, device, paused, &ids, what);
  if (n < 0) return gca_last_status();
  int rc = GCA_OK;
  char first[1024] = "";
  for (int i = 0; i < n; i++) {
    size_t bytes = 0;
    int one = act(a, ids[i], flags, &bytes);
    if (sum) *sum += bytes;
    if (one != GCA_OK && rc == GCA_OK) rc = one, snprintf(first, sizeof first, "%s", gca_last_error());
  }
  free(ids);
  if (rc != GCA_OK) gca__set_error(rc, "%s: %s", what, first);
  return rc;
}

int gca_pool_pause_all(gca_allocator_t *a, int device, unsigned flags, size_t *released) {
  return every_pool(a, device, false, pause_one, flags, released, "gca_pool_pause_all");
}

int gca_pool_resume_all(gca_allocator_t *a, int device, unsigned flags) {
  return every_pool(a, device, true, resume_one, flags, NULL, "gca_pool_resume_all");
}

int gca_pool_backup(gca_allocator_t *a, const void *ptr, const void **host, size_t *size) {
  if (host) *host = NULL;
  if (size) *size = 0;
  if (!a || !host || !size) return gca__set_error(GCA_ERR_INVALID, "gca_pool_backup: a, host or size is NULL");
  uintptr_t addr = (uintptr_t)ptr;
  for (int i = 0; i < gca_device_count(a); i++) {
    device_t *d = gca__device_of(a, i, "gca_pool_backup");
    if (!d) continue;
    lock_acquire(&d->lock);
    for (mempool_t *mp = d->priv.list; mp; mp = mp->next)
      for (size_t k = 0; k < mp->backup_count; k++) {
        const pool_backup_t *c = &mp->backups[k];
        if (addr - c->addr < c->size) {
          *host = (const char *)c->host + (addr - c->addr);
          *size = c->size - (addr - c->addr);
          lock_release(&d->lock);
          return GCA_OK;
        }
      }
    lock_release(&d->lock);
  }
  return gca__set_error(GCA_ERR_BAD_POINTER, "gca_pool_backup: %p has no host copy (not in a block of a pool paused "
                        "with GCA_PAUSE_BACKUP, or resumed with GCA_RESUME_KEEP_BACKUP)", ptr);
}
