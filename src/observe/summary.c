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

#include "observe/observe.h"

#define WIDTH 75

/* How a column of one kind shows its numbers (PyTorch's _format_size and
 * _format_count). */
typedef struct unit_scheme {
  const char *const *units;
  int count;
  double step_at; /* move to the next unit while the reference is at least this */
  int64_t divisor;
  int width;      /* of the number */
  const char *suffix;
} unit_scheme_t;

static const char *const size_units[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
static const char *const count_units[] = {" ", "K", "M"};
static const unit_scheme_t sizes = {size_units, 6, 768.0 * 1024, 1024, 6, ""};
static const unit_scheme_t counts = {count_units, 3, 750.0 * 1000, 1000, 7, " "};

/* A cell's room: the table's columns are narrower, but a value far above
 * its reference is written whole (20 digits and a sign) rather than cut. */
#define CELL_SIZE 32

static void format_cell(char *out, const unit_scheme_t *u, int64_t value, int64_t reference) {
  int i = 0;
  double ref = (double)reference;
  while (i + 1 < u->count && ref >= u->step_at) {
    value /= u->divisor;
    ref /= (double)u->divisor;
    i++;
  }
  snprintf(out, CELL_SIZE, "%*lld %s%s", u->width, (long long)value, u->units[i], u->suffix);
}

static void rule(text_t *t, char c) {
  char line[WIDTH + 1];
  memset(line, c, WIDTH);
  line[WIDTH] = '\0';
  gca__text_put(t, "|%s|\n", line);
}

static void row(text_t *t, const char *name, const gca_stat_t *st, const gca_stat_t *ref, const unit_scheme_t *u) {
  char cur[CELL_SIZE], peak[CELL_SIZE], alloc[CELL_SIZE], freed[CELL_SIZE];
  format_cell(cur, u, st->current, ref->current);
  format_cell(peak, u, st->peak, ref->peak);
  format_cell(alloc, u, st->allocated, ref->allocated);
  format_cell(freed, u, st->freed, ref->freed);
  gca__text_put(t, "| %-21s | %s | %s | %s | %s |\n", name, cur, peak, alloc, freed);
}

/* gcalloc's own rows, when the device has private pools: what each holds
 * now (their memory is inside the rows above too). */
static void pools(gca_allocator_t *a, int device, text_t *t) {
  gca_pool_t ids[64];
  int n = gca_pool_list(a, device, ids, 64);
  if (n <= 0) return;
  gca__text_put(t, "|     Private pool      |  Reserved  | Allocated  |   Cached   |   Allocs   |\n");
  for (int i = 0; i < n && i < 64; i++) {
    gca_pool_stats_t p;
    if (gca_pool_get_stats(a, ids[i], &p) != GCA_OK) continue;
    char name[24], cells[4][CELL_SIZE];
    snprintf(name, sizeof name, "pool %llu", (unsigned long long)p.id);
    format_cell(cells[0], &sizes, (int64_t)p.reserved_bytes, (int64_t)p.reserved_bytes);
    format_cell(cells[1], &sizes, (int64_t)p.allocated_bytes, (int64_t)p.allocated_bytes);
    format_cell(cells[2], &sizes, (int64_t)p.cached_bytes, (int64_t)p.cached_bytes);
    format_cell(cells[3], &counts, (int64_t)p.allocations, (int64_t)p.allocations);
    rule(t, '-');
    gca__text_put(t, "| %-21s | %s | %s | %s | %s |\n", name, cells[0], cells[1], cells[2], cells[3]);
  }
  if (n > 64) gca__text_put(t, "| %-73s |\n", "(and more pools)");
  rule(t, '=');
}

int gca_memory_summary(gca_allocator_t *a, int device, int abbreviated, char *buf, size_t cap) {
  device_t *d = gca__device_of_reading(a, device, "gca_memory_summary");
  if (!d) return gca_last_status();
  if (!buf && cap) return gca__set_error(GCA_ERR_INVALID, "gca_memory_summary: buf is NULL");
  gca_stats_t s;
  if (gca__device_stats(d, &s, "gca_memory_summary") != GCA_OK) return gca_last_status();
  text_t t = {buf, cap, 0};
  if (cap) buf[0] = '\0';

  char title[WIDTH + 1];
  int n = snprintf(title, sizeof title, "gcalloc memory summary, device %d (%s backend)", device,
                   a->backend.ops->name);
  if (n > WIDTH) n = WIDTH;
  int left = (WIDTH - n) / 2;
  rule(&t, '=');
  gca__text_put(&t, "|%*s%.*s%*s|\n", left, "", n, title, WIDTH - n - left, "");
  rule(&t, '-');
  gca__text_put(&t, "|  %9s CUDA OOMs: %-12lld | %6s cudaMalloc retries: %-8lld  |\n", "", (long long)s.num_ooms, "",
                (long long)s.num_alloc_retries);
  rule(&t, '=');
  gca__text_put(&t, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n");

  const struct {
    const gca_stat_t *family;
    const char *name;
    const unit_scheme_t *units;
  } metrics[] = {
      {s.allocated_bytes, "Allocated memory", &sizes},
      {s.active_bytes, "Active memory", &sizes},
      {s.requested_bytes, "Requested memory", &sizes},
      {s.reserved_bytes, "GPU reserved memory", &sizes},
      {s.inactive_split_bytes, "Non-releasable memory", &sizes},
      {s.allocation, "Allocations", &counts},
      {s.active, "Active allocs", &counts},
      {s.segment, "GPU reserved segments", &counts},
      {s.inactive_split, "Non-releasable allocs", &counts},
  };
  for (size_t m = 0; m < sizeof metrics / sizeof metrics[0]; m++) {
    const gca_stat_t *f = metrics[m].family;
    rule(&t, '-');
    row(&t, metrics[m].name, &f[GCA_POOL_ALL], &f[GCA_POOL_ALL], metrics[m].units);
    if (abbreviated) continue;
    row(&t, "      from large pool", &f[GCA_POOL_LARGE], &f[GCA_POOL_ALL], metrics[m].units);
    row(&t, "      from small pool", &f[GCA_POOL_SMALL], &f[GCA_POOL_ALL], metrics[m].units);
  }
  rule(&t, '-');
  row(&t, "Oversize allocations", &s.oversize_allocations, &s.oversize_allocations, &counts);
  rule(&t, '-');
  row(&t, "Oversize GPU segments", &s.oversize_segments, &s.oversize_segments, &counts);
  rule(&t, '=');
  pools(a, device, &t);
  return (int)t.len;
}
