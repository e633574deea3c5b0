/* Out of memory (oom.c): the user's callbacks and handlers, waiting for
 * memory to come back, and the message that explains a failure.
 */
#ifndef GCALLOC_CORE_OOM_H
#define GCALLOC_CORE_OOM_H

#include "core/core.h"

int gca__callbacks_add(gca_allocator_t *a, int kind, void (*fn)(void), void *user, const char *what);
int gca__callbacks_remove(gca_allocator_t *a, int kind, void (*fn)(void), void *user, const char *what);
/* Without any device lock: run the free-memory callbacks (true if one freed
 * memory) or the OOM handlers (true if one asked for another try). */
bool gca__oom_run_callbacks(device_t *d, int kind, size_t size);
/* With the lock held, on a request the device cannot serve: true if waiting
 * for memory to come back may help (something this allocator holds could be
 * freed, and the request fits in what the device or the fraction allows). */
bool gca__oom_worth_waiting(device_t *d, size_t rounded);
/* With the lock held: release it and wait until a free wakes this thread or
 * `ns` pass, then take it again. `generation` is the value read before the
 * last attempt (oom_generation). */
void gca__oom_wait(device_t *d, uint64_t generation, uint64_t ns);
uint64_t gca__oom_generation(device_t *d);
/* Wake allocations waiting on `d` (called after frees, without the lock). */
void gca__oom_wake(device_t *d);
static inline void device_wake_waiters(device_t *d) {
  if (unlikely(atomic_load_explicit(&d->waiters, memory_order_relaxed))) gca__oom_wake(d);
}
/* What the failed allocation tells observers. */
typedef struct oom_report {
  size_t size, limit, free_bytes;
  size_t total; /* the device's capacity */
  size_t outside; /* cooperating: in use by no member (processes without cooperation, the driver) */
} oom_report_t;
/* With the lock held: set the out-of-memory error (PyTorch's message plus
 * what it lacks) and fill *report for the observers. */
void gca__oom_explain(device_t *d, gca_stream_t stream, size_t rounded, oom_report_t *report);
/* Without any device lock: tell the observers. Keeps the error message. */
void gca__oom_notify(device_t *d, const oom_report_t *report);

#endif /* GCALLOC_CORE_OOM_H */
