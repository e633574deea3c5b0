/* The pinned host allocator (host.c), as the front ends see it: one per
 * allocator, made at open and destroyed at close (before the backend
 * closes). host_cache_check tests its invariants (call it when no other
 * thread uses the host allocator). The public calls are gca_host_* in
 * gcalloc.h.
 */
#ifndef GCALLOC_HOST_H
#define GCALLOC_HOST_H

#include "core/core.h"

int gca__host_cache_create(gca_allocator_t *a);
/* Close the allocator's pinned host cache. `forked`: the allocator was
 * inherited across fork; only this process's books are freed (no backend
 * call: the pinned memory and its events are the parent's). */
void gca__host_cache_destroy(gca_allocator_t *a, bool forked);
/* The fork handler's steps for the pinned caches (mempool.c). */
void gca__host_before_fork(void);
void gca__host_after_fork_parent(void);
void gca__host_after_fork_child(void);
int gca__host_cache_check(gca_allocator_t *a);
/* gca_host_free, then the block given back to the system at once instead of
 * cached (unless a stream still uses it, or it is carved from the reserve
 * segment): a paused pool's copy, not wanted again soon. */
int gca__host_free_uncached(gca_allocator_t *a, void *ptr);

#endif /* GCALLOC_HOST_H */
