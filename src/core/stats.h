/* How a device keeps its statistics (stats.c), and their public view.
 */
#ifndef GCALLOC_CORE_STATS_H
#define GCALLOC_CORE_STATS_H

#include "base/base.h"

typedef struct device device_t;

static inline void stat_increase(gca_stat_t *s, int64_t n) {
  s->current += n;
  if (s->current > s->peak) s->peak = s->current;
  s->allocated += n;
}

static inline void stat_decrease(gca_stat_t *s, int64_t n) {
  s->current -= n;
  s->freed += n;
}

/* How a device keeps its statistics. Families are kept per pool (small,
 * large); the "all" entry is derived when read, since its current, allocated
 * and freed are sums of the two pools. Only its peak must be tracked as
 * things happen (the peak of a sum is not the sum of the peaks). A family's
 * two pool entries share one cache line, so an update finds the sibling's
 * current, needed for that peak, in the line it already holds; an
 * allocation touches a few lines of statistics plus the line of "all" peaks.
 *
 * "active" is not kept either, to spare the hot path two more families. By
 * PyTorch's definition it is what is allocated plus what was freed but whose
 * free has not completed (pending), so it is derived from the allocation
 * families and the pending ones (kept, moved only when a free is deferred):
 *   active.current   = allocation.current + pending.current
 *   active.allocated = allocation.allocated (both rise together, at malloc)
 *   active.freed     = allocation.freed - pending's rises + pending's falls
 *   active.peak      = max(allocation.peak, active_peak)
 * The sum can only rise at a malloc, and while nothing is pending it equals
 * allocation, whose peak covers it; so active_peak is raised at a malloc only
 * while some free is pending (one branch on the hot path). */
enum stat_family {
  FAM_ALLOCATION,
  FAM_ALLOCATED_BYTES,
  FAM_REQUESTED_BYTES,
  FAM_INACTIVE_SPLIT,
  FAM_INACTIVE_SPLIT_BYTES,
  FAM_SEGMENT,
  FAM_RESERVED_BYTES,
  FAM_PENDING,       /* blocks freed whose free has not completed */
  FAM_PENDING_BYTES,
  FAM_COUNT
};

/* A kept statistic. "allocated" (the total of increases) is not counted on
 * the hot path: since the last reset it equals current - base + freed. */
typedef struct kept_stat {
  int64_t current;
  int64_t peak;
  int64_t freed;
  int64_t base; /* current at the last reset of accumulated counts */
} kept_stat_t;

typedef struct family_stats {
  _Alignas(64) kept_stat_t pool[2]; /* [kind - 1]: small, large */
} family_stats_t;

/* The scalar counters, named as in gca_stats_t: one list, so that keeping,
 * publishing and resetting a counter cannot drift apart. */
#define KEPT_COUNTERS(X)                                                                                     \
  X(num_alloc_retries) X(num_ooms) X(num_sync_all_streams) X(num_device_alloc) X(num_device_free)              \
  X(num_cross_stream_reuses) X(num_device_free_failures) X(num_gc_releases) X(num_alloc_waits)                 \
  X(num_oom_handler_retries) X(num_pages_moved) X(num_ipc_requests) X(ipc_bytes_received) X(num_ipc_timeouts) \
  X(num_oom_rejections) X(num_ipc_peers_asked) X(num_avoidable_ooms) X(num_stitch_waits) X(num_ipc_rounds) \
  X(ipc_outside_bytes)

typedef struct kept_stats {
  family_stats_t family[FAM_COUNT];
  int64_t all_peak[FAM_COUNT];
  /* Peak of allocation + pending reached while frees were pending:
   * [0] blocks, [1] bytes; by pool index (GCA_POOL_ALL, SMALL, LARGE). */
  int64_t active_peak[2][GCA_POOL_KINDS];
  gca_stat_t oversize_allocations;
  gca_stat_t oversize_segments;
#define DECLARE_COUNTER(name) int64_t name;
  KEPT_COUNTERS(DECLARE_COUNTER)
#undef DECLARE_COUNTER
} kept_stats_t;

static inline int64_t family_current(const kept_stats_t *k, int fam) {
  return k->family[fam].pool[0].current + k->family[fam].pool[1].current;
}

static inline void family_increase(kept_stats_t *k, int fam, int kind, int64_t n) {
  kept_stat_t *st = &k->family[fam].pool[kind - 1];
  st->current += n;
  if (st->current > st->peak) st->peak = st->current;
  int64_t all = family_current(k, fam);
  if (all > k->all_peak[fam]) k->all_peak[fam] = all;
}

static inline void family_decrease(kept_stats_t *k, int fam, int kind, int64_t n) {
  kept_stat_t *st = &k->family[fam].pool[kind - 1];
  st->current -= n;
  st->freed += n;
}

/* After a malloc while frees are pending: raise the active peaks. */
void gca__stats_note_active_peak(kept_stats_t *k);

/* The public view of kept statistics, "all" entries filled in. */
void gca__stats_materialize(const kept_stats_t *kept, gca_stats_t *out);
/* The device's statistics in PyTorch's shape (gca_get_stats), under its lock. */
int gca__device_stats(device_t *d, gca_stats_t *out, const char *what);
void gca__stats_reset_peak(kept_stats_t *k);
void gca__stats_reset_accumulated(kept_stats_t *k);

#endif /* GCALLOC_CORE_STATS_H */
