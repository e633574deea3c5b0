/* The lock-order check of checked builds (lock.h, GCALLOC_LOCK_CHECK).
 *
 * Each thread keeps the locks it holds, with their ranks and the places
 * they were taken. Taking a lock while a lock of the same or a higher
 * rank is held is a possible deadlock whether or not another thread
 * happens to take the pair the other way round this time, so it aborts at
 * once, naming both locks and both sites: the test that takes the path
 * fails, not the rare run that hangs. Release builds compile none of it.
 */
#include <stdio.h>
#include <stdlib.h>

#include "base/base.h"

#ifdef GCALLOC_LOCK_CHECK

enum { HELD_MAX = 32 };

typedef struct held_lock {
  const void *lock;
  int rank;
  const char *file;
  int line;
} held_lock_t;

static _Thread_local held_lock_t order_held[HELD_MAX];
static _Thread_local int order_held_count;

static const char *const rank_names[RANK_COUNT] = {
    [RANK_TORCH] = "the drop-in's lock (torch.c)",
    [RANK_RECORD] = "the trace file's lock (record.c)",
    [RANK_POOL_REGISTRY] = "the private pools' registry lock (mempool.c)",
    [RANK_CONFIG] = "the configuration lock (gca_set_config)",
    [RANK_DEVICE] = "a device lock",
    [RANK_HOST] = "a pinned host cache's lock (host.c)",
    [RANK_HOST_REGISTRY] = "the pinned caches' registry lock (host.c)",
    [RANK_RENDEZVOUS] = "the rendezvous's lock (coop.c)",
    [RANK_CALLBACKS] = "the callback lists' lock (oom.c)",
    [RANK_DEVICE_WAIT] = "a device's waiting allocations' lock (oom.c)",
    [RANK_BACKEND] = "a backend's lock",
    [RANK_BACKEND_EVENTS] = "a backend's event pool lock",
    [RANK_BACKEND_CONTEXT] = "a backend's context lock",
    [RANK_SIM_SHARED] = "the shared simulated device's lock (sim_shared.c)",
    [RANK_PIDFDS] = "the known processes' lock (shm.c)",
    [RANK_SETTINGS] = "the master settings' lock (allocator.c)",
    [RANK_TORCH_FAILURE] = "the drop-in's failure message lock (torch.c)",
    [RANK_COMPLETIONS] = "the trace file's completions lock (record.c)",
    [RANK_HELPERS] = "the helper threads' lock (helpers.c)",
    [RANK_LOG] = "the log's lock (error.c)",
};

const char *gca__lock_rank_name(int rank) {
  return rank > 0 && rank < RANK_COUNT && rank_names[rank] ? rank_names[rank] : "a lock of no known rank";
}

/* Said with stdio's unbuffered stderr and no allocation: the process is
 * about to abort, possibly inside the allocator. */
GCA_COLD static void order_broken(const held_lock_t *had, const void *lock, int rank, const char *file, int line) {
  if (had->lock == lock)
    fprintf(stderr,
            "gcalloc: lock order violated: %s (rank %d) taken again at %s:%d by the thread that holds it since "
            "%s:%d (it would wait for itself)\n",
            gca__lock_rank_name(rank), rank, file, line, had->file, had->line);
  else
    fprintf(stderr,
            "gcalloc: lock order violated: %s (rank %d) taken at %s:%d while holding %s (rank %d) taken at %s:%d; "
            "locks are taken in increasing rank only (docs/design.md, \"Lock ranks\")\n",
            gca__lock_rank_name(rank), rank, file, line, gca__lock_rank_name(had->rank), had->rank, had->file,
            had->line);
  abort();
}

void gca__lock_order_take(const void *lock, int rank, const char *file, int line, int mode) {
  for (int i = 0; i < order_held_count; i++) {
    const held_lock_t *h = &order_held[i];
    if (h->lock == lock || h->rank > rank || (h->rank == rank && mode != ORDER_SIBLING))
      order_broken(h, lock, rank, file, line);
  }
  if (order_held_count == HELD_MAX) {
    fprintf(stderr, "gcalloc: lock order check: %d locks held at once at %s:%d\n", HELD_MAX, file, line);
    abort();
  }
  order_held[order_held_count++] = (held_lock_t){lock, rank, file, line};
}

void gca__lock_order_drop(const void *lock) {
  /* Usually the last taken; any order of release is allowed. */
  for (int i = order_held_count - 1; i >= 0; i--) {
    if (order_held[i].lock != lock) continue;
    for (int j = i; j + 1 < order_held_count; j++) order_held[j] = order_held[j + 1];
    order_held_count--;
    return;
  }
  fprintf(stderr, "gcalloc: lock order check: a lock released that this thread does not hold (%p)\n", lock);
  abort();
}

int gca__lock_order_depth(void) { return order_held_count; }

#endif /* GCALLOC_LOCK_CHECK */
