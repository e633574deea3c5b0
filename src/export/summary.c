/* The memory summary: torch.cuda.memory_summary()'s table, built from a
 * device's statistics with the same rows, columns, widths and unit rules
 * (torch/cuda/memory.py), under a title that names gcalloc, the device and
 * its backend.
 *
 * Units: a byte cell shows the value in the largest of B, KiB, MiB, GiB,
 * TiB, PiB in which the row's reference value (its "all" entry, for the
 * per-pool rows below it) stays under 768 x 1024 of the unit below; a count
 * cell likewise in (blank), K, M at 750,000. Integer division, as Python's
 * // does for these non-negative values.
 */
#include <stdio.h>
#include <string.h>

#include "../internal.h"

#define WIDTH 75

static void format_size(char *out, int64_t value, int64_t reference) {
  static const char *const units[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double ref = (double)reference;
  while (u < 5 && ref >= 768.0 * 1024) {
    value /= 1024;
    ref /= 1024;
    u++;
  }
  snprintf(out, 16, "%6lld %s", (long long)value, units[u]);
}

static void format_count(char *out, int64_t value, int64_t reference) {
  static const char *const units[] = {" ", "K", "M"};
  int u = 0;
  double ref = (double)reference;
  while (u < 2 && ref >= 750.0 * 1000) {
    value /= 1000;
    ref /= 1000;
    u++;
  }
  snprintf(out, 16, "%7lld %s ", (long long)value, units[u]);
}

typedef void (*formatter_t)(char *, int64_t, int64_t);

static void rule(text_t *t, char c) {
  char line[WIDTH + 1];
  memset(line, c, WIDTH);
  line[WIDTH] = '\0';
  text_put(t, "|%s|\n", line);
}

static void row(text_t *t, const char *name, const gca_stat_t *st, const gca_stat_t *ref, formatter_t fmt) {
  char cur[16], peak[16], alloc[16], freed[16];
  fmt(cur, st->current, ref->current);
  fmt(peak, st->peak, ref->peak);
  fmt(alloc, st->allocated, ref->allocated);
  fmt(freed, st->freed, ref->freed);
  text_put(t, "| %-21s | %s | %s | %s | %s |\n", name, cur, peak, alloc, freed);
}

int gca_memory_summary(gca_allocator_t *a, int device, int abbreviated, char *buf, size_t cap) {
  gca_stats_t s;
  int rc = gca_get_stats(a, device, &s);
  if (rc) return rc;
  if (!buf && cap) return set_error(GCA_ERR_INVALID, "gca_memory_summary: buf is NULL");
  text_t t = {buf, cap, 0};
  if (cap) buf[0] = '\0';

  char title[WIDTH + 1];
  int n = snprintf(title, sizeof title, "gcalloc memory summary, device %d (%s backend)", device,
                   gca_backend_name(a));
  if (n > WIDTH) n = WIDTH;
  int left = (WIDTH - n) / 2;
  rule(&t, '=');
  text_put(&t, "|%*s%.*s%*s|\n", left, "", n, title, WIDTH - n - left, "");
  rule(&t, '-');
  text_put(&t, "|  %9s CUDA OOMs: %-12lld | %6s cudaMalloc retries: %-8lld  |\n", "", (long long)s.num_ooms, "",
           (long long)s.num_alloc_retries);
  rule(&t, '=');
  text_put(&t, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n");

  const struct {
    const gca_stat_t *family;
    const char *name;
    formatter_t fmt;
  } metrics[] = {
      {s.allocated_bytes, "Allocated memory", format_size},
      {s.active_bytes, "Active memory", format_size},
      {s.requested_bytes, "Requested memory", format_size},
      {s.reserved_bytes, "GPU reserved memory", format_size},
      {s.inactive_split_bytes, "Non-releasable memory", format_size},
      {s.allocation, "Allocations", format_count},
      {s.active, "Active allocs", format_count},
      {s.segment, "GPU reserved segments", format_count},
      {s.inactive_split, "Non-releasable allocs", format_count},
  };
  for (size_t m = 0; m < sizeof metrics / sizeof metrics[0]; m++) {
    const gca_stat_t *f = metrics[m].family;
    rule(&t, '-');
    row(&t, metrics[m].name, &f[GCA_POOL_ALL], &f[GCA_POOL_ALL], metrics[m].fmt);
    if (abbreviated) continue;
    row(&t, "      from large pool", &f[GCA_POOL_LARGE], &f[GCA_POOL_ALL], metrics[m].fmt);
    row(&t, "      from small pool", &f[GCA_POOL_SMALL], &f[GCA_POOL_ALL], metrics[m].fmt);
  }
  rule(&t, '-');
  row(&t, "Oversize allocations", &s.oversize_allocations, &s.oversize_allocations, format_count);
  rule(&t, '-');
  row(&t, "Oversize GPU segments", &s.oversize_segments, &s.oversize_segments, format_count);
  rule(&t, '=');
  return (int)t.len;
}
