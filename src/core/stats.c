/* Statistics: resets, and the flat form with torch.cuda.memory_stats() names.
 *
 * The counters themselves move in segment.c and device.c, at the same steps
 * as PyTorch's, in the kept form internal.h describes. Here: turning the kept
 * form into the public one, the two resets, and the flattening, whose key
 * list is built once (pthread_once) in the sorted order memory_stats()
 * returns.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

/* Where each kept family lands in the public struct (NULL: not public). */
static gca_stat_t *public_family(gca_stats_t *s, int fam) {
  switch (fam) {
    case FAM_ALLOCATION: return s->allocation;
    case FAM_ALLOCATED_BYTES: return s->allocated_bytes;
    case FAM_REQUESTED_BYTES: return s->requested_bytes;
    case FAM_INACTIVE_SPLIT: return s->inactive_split;
    case FAM_INACTIVE_SPLIT_BYTES: return s->inactive_split_bytes;
    case FAM_SEGMENT: return s->segment;
    case FAM_RESERVED_BYTES: return s->reserved_bytes;
    default: return NULL;
  }
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* active = allocation + pending, as internal.h explains. */
static void derive_active(const kept_stats_t *k, const gca_stat_t *alloc, int pending_fam, const int64_t *peak,
                          gca_stat_t *active) {
  for (int p = GCA_POOL_SMALL; p <= GCA_POOL_LARGE; p++) {
    const kept_stat_t *pend = &k->family[pending_fam].pool[p - 1];
    active[p].current = alloc[p].current + pend->current;
    active[p].allocated = alloc[p].allocated;
    active[p].freed = alloc[p].freed - (pend->current - pend->base);
    active[p].peak = max64(alloc[p].peak, peak[p]);
  }
  gca_stat_t *all = &active[GCA_POOL_ALL];
  all->current = active[GCA_POOL_SMALL].current + active[GCA_POOL_LARGE].current;
  all->allocated = active[GCA_POOL_SMALL].allocated + active[GCA_POOL_LARGE].allocated;
  all->freed = active[GCA_POOL_SMALL].freed + active[GCA_POOL_LARGE].freed;
  all->peak = max64(alloc[GCA_POOL_ALL].peak, peak[GCA_POOL_ALL]);
}

/* The current value of allocation + pending: [0] blocks, [1] bytes. */
static void active_now(const kept_stats_t *k, int m, int64_t *by_pool) {
  int fa = m ? FAM_ALLOCATED_BYTES : FAM_ALLOCATION;
  int fp = m ? FAM_PENDING_BYTES : FAM_PENDING;
  by_pool[GCA_POOL_ALL] = 0;
  for (int p = GCA_POOL_SMALL; p <= GCA_POOL_LARGE; p++) {
    by_pool[p] = k->family[fa].pool[p - 1].current + k->family[fp].pool[p - 1].current;
    by_pool[GCA_POOL_ALL] += by_pool[p];
  }
}

void gca__stats_note_active_peak(kept_stats_t *k) {
  for (int m = 0; m < 2; m++) {
    int64_t now[GCA_POOL_KINDS];
    active_now(k, m, now);
    for (int p = 0; p < GCA_POOL_KINDS; p++) k->active_peak[m][p] = max64(k->active_peak[m][p], now[p]);
  }
}

void gca__stats_materialize(const kept_stats_t *k, gca_stats_t *out) {
  memset(out, 0, sizeof *out);
  for (int fam = 0; fam < FAM_COUNT; fam++) {
    gca_stat_t *dst = public_family(out, fam);
    if (!dst) continue;
    for (int p = 0; p < 2; p++) {
      const kept_stat_t *src = &k->family[fam].pool[p];
      gca_stat_t *pub = &dst[p == 0 ? GCA_POOL_SMALL : GCA_POOL_LARGE];
      pub->current = src->current;
      pub->peak = src->peak;
      pub->freed = src->freed;
      pub->allocated = src->current - src->base + src->freed;
      dst[GCA_POOL_ALL].current += pub->current;
      dst[GCA_POOL_ALL].allocated += pub->allocated;
      dst[GCA_POOL_ALL].freed += pub->freed;
    }
    dst[GCA_POOL_ALL].peak = k->all_peak[fam];
  }
  derive_active(k, out->allocation, FAM_PENDING, k->active_peak[0], out->active);
  derive_active(k, out->allocated_bytes, FAM_PENDING_BYTES, k->active_peak[1], out->active_bytes);
  out->oversize_allocations = k->oversize_allocations;
  out->oversize_segments = k->oversize_segments;
#define COPY_COUNTER(name) out->name = k->name;
  KEPT_COUNTERS(COPY_COUNTER)
#undef COPY_COUNTER
}

void gca__stats_reset_peak(kept_stats_t *k) {
  for (int fam = 0; fam < FAM_COUNT; fam++) {
    for (int p = 0; p < 2; p++) k->family[fam].pool[p].peak = k->family[fam].pool[p].current;
    k->all_peak[fam] = family_current(k, fam);
  }
  for (int m = 0; m < 2; m++) active_now(k, m, k->active_peak[m]);
  k->oversize_allocations.peak = k->oversize_allocations.current;
  k->oversize_segments.peak = k->oversize_segments.current;
}

void gca__stats_reset_accumulated(kept_stats_t *k) {
  for (int fam = 0; fam < FAM_COUNT; fam++)
    for (int p = 0; p < 2; p++) {
      k->family[fam].pool[p].base = k->family[fam].pool[p].current;
      k->family[fam].pool[p].freed = 0;
    }
  k->oversize_allocations.allocated = k->oversize_allocations.freed = 0;
  k->oversize_segments.allocated = k->oversize_segments.freed = 0;
#define ZERO_COUNTER(name) k->name = 0;
  KEPT_COUNTERS(ZERO_COUNTER)
#undef ZERO_COUNTER
}

/* ---- flat form ---------------------------------------------------------- */

typedef struct flat_key {
  char name[48];
  size_t offset; /* of the int64_t inside gca_stats_t */
} flat_key_t;

static flat_key_t flat_keys[GCA_STATS_FLAT_COUNT];
static pthread_once_t flat_once = PTHREAD_ONCE_INIT;

static int compare_keys(const void *a, const void *b) {
  return strcmp(((const flat_key_t *)a)->name, ((const flat_key_t *)b)->name);
}

static void build_flat_keys(void) {
  static const struct { const char *name; size_t offset; } families[] = {
      {"allocation", offsetof(gca_stats_t, allocation)},
      {"segment", offsetof(gca_stats_t, segment)},
      {"active", offsetof(gca_stats_t, active)},
      {"inactive_split", offsetof(gca_stats_t, inactive_split)},
      {"allocated_bytes", offsetof(gca_stats_t, allocated_bytes)},
      {"reserved_bytes", offsetof(gca_stats_t, reserved_bytes)},
      {"active_bytes", offsetof(gca_stats_t, active_bytes)},
      {"inactive_split_bytes", offsetof(gca_stats_t, inactive_split_bytes)},
      {"requested_bytes", offsetof(gca_stats_t, requested_bytes)},
  };
  static const char *const pools[] = {"all", "small_pool", "large_pool"};
  static const struct { const char *name; size_t offset; } measures[] = {
      {"current", offsetof(gca_stat_t, current)},
      {"peak", offsetof(gca_stat_t, peak)},
      {"allocated", offsetof(gca_stat_t, allocated)},
      {"freed", offsetof(gca_stat_t, freed)},
  };
  static const struct { const char *name; size_t offset; } singles[] = {
      {"oversize_allocations", offsetof(gca_stats_t, oversize_allocations)},
      {"oversize_segments", offsetof(gca_stats_t, oversize_segments)},
  };
  static const struct { const char *name; size_t offset; } scalars[] = {
      {"num_alloc_retries", offsetof(gca_stats_t, num_alloc_retries)},
      {"num_ooms", offsetof(gca_stats_t, num_ooms)},
      {"num_sync_all_streams", offsetof(gca_stats_t, num_sync_all_streams)},
      {"num_device_alloc", offsetof(gca_stats_t, num_device_alloc)},
      {"num_device_free", offsetof(gca_stats_t, num_device_free)},
      {"num_oom_rejections", offsetof(gca_stats_t, num_oom_rejections)},
      {"max_split_size", offsetof(gca_stats_t, max_split_size)},
  };
  size_t n = 0;
  for (size_t f = 0; f < sizeof families / sizeof families[0]; f++)
    for (int p = 0; p < GCA_POOL_KINDS; p++)
      for (size_t m = 0; m < 4; m++) {
        snprintf(flat_keys[n].name, sizeof flat_keys[n].name, "%s.%s.%s", families[f].name, pools[p],
                 measures[m].name);
        flat_keys[n++].offset = families[f].offset + (size_t)p * sizeof(gca_stat_t) + measures[m].offset;
      }
  for (size_t s = 0; s < 2; s++)
    for (size_t m = 0; m < 4; m++) {
      snprintf(flat_keys[n].name, sizeof flat_keys[n].name, "%s.%s", singles[s].name, measures[m].name);
      flat_keys[n++].offset = singles[s].offset + measures[m].offset;
    }
  for (size_t s = 0; s < sizeof scalars / sizeof scalars[0]; s++) {
    snprintf(flat_keys[n].name, sizeof flat_keys[n].name, "%s", scalars[s].name);
    flat_keys[n++].offset = scalars[s].offset;
  }
  /* torch.cuda.memory_stats() returns its keys sorted. */
  qsort(flat_keys, n, sizeof flat_keys[0], compare_keys);
}

size_t gca_stats_flatten(const gca_stats_t *stats, gca_stat_item_t *items, size_t cap) {
  pthread_once(&flat_once, build_flat_keys);
  if (!stats || !items) return GCA_STATS_FLAT_COUNT;
  for (size_t i = 0; i < GCA_STATS_FLAT_COUNT && i < cap; i++) {
    items[i].name = flat_keys[i].name;
    memcpy(&items[i].value, (const char *)stats + flat_keys[i].offset, sizeof(int64_t));
  }
  return GCA_STATS_FLAT_COUNT;
}

int gca__device_stats(device_t *d, gca_stats_t *out, const char *what) {
  int how = device_read_lock(d, what);
  if (how == DEVICE_REFUSED) return gca_last_status();
  gca__stats_materialize(&d->stats, out);
  /* -1: unlimited, or past what any block can be (PyTorch's clamp of a huge
   * max_split_size_mb leaves a value no int64 holds). */
  out->max_split_size = d->config.max_split_size > (size_t)INT64_MAX ? -1 : (int64_t)d->config.max_split_size;
  device_read_unlock(d, how);
  return GCA_OK;
}
