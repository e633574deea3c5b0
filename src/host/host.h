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
void gca__host_cache_destroy(gca_allocator_t *a);
int gca__host_cache_check(gca_allocator_t *a);

#endif /* GCALLOC_HOST_H */
