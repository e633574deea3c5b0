/* Private pools (mempool.c), with the device lock held: the pools
 * themselves, the routes that lead allocations to them, pause and resume,
 * and the registry of open allocators that threads' pushes check.
 */
#ifndef GCALLOC_CORE_MEMPOOL_H
#define GCALLOC_CORE_MEMPOOL_H

#include "core/core.h"

/* ---- private pools (mempool.c), with the device lock held ---- */
/* A live block's copy in pinned host memory, taken at a pause. */
typedef struct pool_backup {
  uintptr_t addr;
  size_t size;
  gca_stream_t stream;
  void *host;
} pool_backup_t;

typedef struct mempool {
  pool_t small, large;
  uint64_t id;
  device_t *device;
  int64_t references;        /* gca_pool_retain / gca_pool_release */
  size_t thread_routes;      /* threads' pushes naming it, not yet popped */
  size_t stream_routes;      /* streams routed to it */
  bool pausable, paused;
  pool_backup_t *backups;    /* host copies (a pause's, or kept at resume) */
  size_t backup_count, backup_cap, backup_bytes;
  /* Gives a host copy back (the front end's: the host allocator is above
   * the core). Set with the first copy. */
  void (*drop_backup)(gca_allocator_t *a, void *host);
  struct mempool *next;      /* the device's list */
} mempool_t;

typedef struct stream_route {
  gca_stream_t stream;
  mempool_t *pool;
  bool capture;              /* made by gca_capture_begin */
} stream_route_t;

/* The pool an allocation of `rounded` bytes on `stream` goes to, when some
 * route exists (d->priv.routes): the calling thread's innermost push for this
 * device, else the stream's route, else `fallback`; NULL, with the error
 * set, when that pool is paused. */
pool_t *gca__mempool_route(device_t *d, gca_stream_t stream, size_t rounded, pool_t *fallback);
mempool_t *gca__mempool_find(device_t *d, uint64_t id);
/* Whether the calling thread's innermost push on allocator `a` for
 * `device` names a private pool (not pool 0). No lock: a thread's pushes
 * are its own, and `a` is open. */
bool gca__mempool_thread_pushed(const gca_allocator_t *a, int device);
/* The bytes of the pool's live allocations. */
size_t gca__mempool_live_bytes(const device_t *d, const mempool_t *mp);
/* The pool `id` with its device locked; NULL (nothing locked) with the
 * error set. */
mempool_t *gca__mempool_lock(gca_allocator_t *a, uint64_t id, const char *what);
/* Wait for the pool's own streams (its segments', its live blocks' other
 * uses, its pending frees') and complete the frees they held back. */
int gca__mempool_quiesce(device_t *d, mempool_t *mp);
/* Unmap and give back every page of a pool's segments, remembering them;
 * and map new memory at the remembered pages. */
int gca__mempool_unmap(device_t *d, mempool_t *mp, size_t *released);
int gca__mempool_remap(device_t *d, mempool_t *mp);
/* The pool's free cache given back (whole free pages unmapped, empty
 * ranges released) before a pause, so a resume maps back only pages that
 * hold live blocks. Returns the bytes unmapped. */
size_t gca__mempool_trim(device_t *d, mempool_t *mp);
/* The bytes a resume of the paused pool maps back. */
size_t gca__mempool_paused_bytes(const device_t *d, const mempool_t *mp);
/* Drop the pool's host copies (all, or the one of the block at addr). */
void gca__mempool_drop_backups(device_t *d, mempool_t *mp);
void gca__mempool_drop_backup_of(device_t *d, mempool_t *mp, uintptr_t addr);
/* GCA_OK, or GCA_ERR_INVALID naming `what` while a capture runs on the
 * device (calls that would synchronize or free are refused then). */
int gca__device_capturing(device_t *d, const char *what);
/* A graph capture about to begin (hold) or ended (release) on the pool's
 * device, before its stream is known: the device is capture-safe meanwhile
 * (as gca_capture_begin, without routing a stream; the PyTorch drop-in
 * routes the capturing stream at its first allocation). */
int gca__capture_hold(gca_allocator_t *a, gca_pool_t pool, bool hold);
/* Give every segment of the device's private pools back (at destroy). */
void gca__mempools_destroy(device_t *d);
/* An allocator opens (takes its serial) and closes, for the threads' pool
 * pushes: a push to a closed allocator goes stale, one open when its
 * thread exits is undone. */
int gca__allocator_register(gca_allocator_t *a);
void gca__allocator_unregister(gca_allocator_t *a);
/* Around fork (src/api/allocator.c): every open allocator's devices
 * locked, and after it let go, in the child each allocator marked forked. */
void gca__allocators_fork_prepare(void);
void gca__allocators_fork_done(bool child);
/* Every free index of the device, one after another: the default pools,
 * then each private pool's small and large. The first for NULL; NULL
 * after the last. */
pool_t *gca__device_pool_next(device_t *d, pool_t *pool);

#endif /* GCALLOC_CORE_MEMPOOL_H */
