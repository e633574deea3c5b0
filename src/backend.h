/* The backend interface: the device primitives the caching core needs.
 *
 * Like mimalloc's prim layer, this is the only way the core reaches a device.
 * A backend is a table of functions plus an opaque state; it is opened from a
 * spec "NAME:key=value,...". Calls may come from several threads at once (one
 * per device lock), so a backend guards its own state. Every call returns
 * GCA_OK or a negative gca_status and sets the error message on failure;
 * GCA_ERR_OOM means "no memory now" (the core may free cache and retry), any
 * other failure is final.
 *
 * Streams, events and virtual memory join this table with the issues that
 * use them; the caching core of this version needs only memory.
 */
#ifndef GCALLOC_BACKEND_H
#define GCALLOC_BACKEND_H

#include <stddef.h>
#include <stdint.h>

typedef struct backend_ops {
  const char *name;
  int (*device_count)(void *state);
  /* Allocate `size` bytes on `device`; the address is 512-byte aligned. */
  int (*malloc)(void *state, int device, size_t size, uintptr_t *addr);
  /* Free what malloc returned; `size` is the size it was asked for. */
  int (*free)(void *state, int device, uintptr_t addr, size_t size);
  int (*mem_get_info)(void *state, int device, size_t *free_bytes, size_t *total_bytes);
  void (*destroy)(void *state);
} backend_ops_t;

typedef struct backend {
  const backend_ops_t *ops;
  void *state;
} backend_t;

/* Open a backend from a spec ("sim", "sim:capacity=24GiB"). */
int backend_open(const char *spec, backend_t *out);
void backend_close(backend_t *b);

/* The sim backend (backend/sim.c). */
int sim_backend_create(const char *options, backend_t *out);

/* Ground truth kept by the sim device, for tests that check the allocator's
 * own counting against the device's. */
typedef struct sim_counters {
  uint64_t malloc_calls;     /* every request, failed ones included */
  uint64_t mallocs;          /* successful allocations */
  uint64_t frees;
  uint64_t live;             /* allocations not yet freed */
  size_t used;               /* bytes in live allocations */
  size_t capacity;
} sim_counters_t;

/* Fills *out for a sim backend; GCA_ERR_INVALID for any other backend. */
int sim_get_counters(const backend_t *b, int device, sim_counters_t *out);

#endif /* GCALLOC_BACKEND_H */
