/* Statistics: resets, and the flat form with torch.cuda.memory_stats() names.
 *
 * The counters themselves move in segment.c and device.c, at the same steps
 * as PyTorch's. Here: the two resets, and the flattening, whose key list is
 * built once (pthread_once) in the sorted order memory_stats() returns.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define FAMILY_COUNT 9

static void families_of(gca_stats_t *s, gca_stat_t *families[FAMILY_COUNT]) {
  gca_stat_t *list[FAMILY_COUNT] = {s->allocation,     s->segment,         s->active,
                                    s->inactive_split, s->allocated_bytes, s->reserved_bytes,
                                    s->active_bytes,   s->inactive_split_bytes, s->requested_bytes};
  memcpy(families, list, sizeof list);
}

void stats_materialize(const gca_stats_t *kept, gca_stats_t *out) {
  *out = *kept;
  gca_stat_t *families[FAMILY_COUNT];
  families_of(out, families);
  for (int f = 0; f < FAMILY_COUNT; f++) {
    gca_stat_t *fam = families[f];
    fam[GCA_POOL_ALL].current = fam[GCA_POOL_SMALL].current + fam[GCA_POOL_LARGE].current;
    fam[GCA_POOL_ALL].allocated = fam[GCA_POOL_SMALL].allocated + fam[GCA_POOL_LARGE].allocated;
    fam[GCA_POOL_ALL].freed = fam[GCA_POOL_SMALL].freed + fam[GCA_POOL_LARGE].freed;
  }
}

void stats_reset_peak(gca_stats_t *s) {
  gca_stat_t *families[FAMILY_COUNT];
  families_of(s, families);
  for (int f = 0; f < FAMILY_COUNT; f++) {
    gca_stat_t *fam = families[f];
    fam[GCA_POOL_SMALL].peak = fam[GCA_POOL_SMALL].current;
    fam[GCA_POOL_LARGE].peak = fam[GCA_POOL_LARGE].current;
    fam[GCA_POOL_ALL].peak = stat_all_current(fam);
  }
  s->oversize_allocations.peak = s->oversize_allocations.current;
  s->oversize_segments.peak = s->oversize_segments.current;
}

void stats_reset_accumulated(gca_stats_t *s) {
  gca_stat_t *families[FAMILY_COUNT];
  families_of(s, families);
  for (int f = 0; f < FAMILY_COUNT; f++)
    for (int k = 0; k < GCA_POOL_KINDS; k++) families[f][k].allocated = families[f][k].freed = 0;
  s->oversize_allocations.allocated = s->oversize_allocations.freed = 0;
  s->oversize_segments.allocated = s->oversize_segments.freed = 0;
  s->num_alloc_retries = 0;
  s->num_ooms = 0;
  s->num_sync_all_streams = 0;
  s->num_device_alloc = 0;
  s->num_device_free = 0;
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
