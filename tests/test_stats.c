/* Statistics after a known sequence, exact to the byte, with PyTorch's
 * meanings; peak and accumulated resets; the flat names; lock-free reads. */
#include "helpers.h"

#define ALL GCA_POOL_ALL
#define SMALL GCA_POOL_SMALL
#define LARGE GCA_POOL_LARGE

static void expect(const gca_stat_t *st, int64_t current, int64_t peak, int64_t allocated, int64_t freed) {
  assert_int_equal(st->current, current);
  assert_int_equal(st->peak, peak);
  assert_int_equal(st->allocated, allocated);
  assert_int_equal(st->freed, freed);
}

static void test_known_sequence(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *x = gca_malloc(a, 1000, 0, 0);    /* small: 1024 of a 2 MiB segment */
  void *y = gca_malloc(a, 3 * MiB, 0, 0); /* large: 3 MiB of a 20 MiB segment */
  gca_stats_t s = stats_of(a, 0);
  expect(&s.allocation[SMALL], 1, 1, 1, 0);
  expect(&s.allocation[LARGE], 1, 1, 1, 0);
  expect(&s.allocation[ALL], 2, 2, 2, 0);
  expect(&s.allocated_bytes[SMALL], 1024, 1024, 1024, 0);
  expect(&s.allocated_bytes[LARGE], 3 * MiB, 3 * MiB, 3 * MiB, 0);
  expect(&s.allocated_bytes[ALL], 3 * MiB + 1024, 3 * MiB + 1024, 3 * MiB + 1024, 0);
  expect(&s.requested_bytes[ALL], 3 * MiB + 1000, 3 * MiB + 1000, 3 * MiB + 1000, 0);
  expect(&s.active[ALL], 2, 2, 2, 0);
  expect(&s.active_bytes[ALL], 3 * MiB + 1024, 3 * MiB + 1024, 3 * MiB + 1024, 0);
  expect(&s.segment[ALL], 2, 2, 2, 0);
  expect(&s.reserved_bytes[SMALL], 2 * MiB, 2 * MiB, 2 * MiB, 0);
  expect(&s.reserved_bytes[LARGE], 20 * MiB, 20 * MiB, 20 * MiB, 0);
  expect(&s.inactive_split[ALL], 2, 2, 2, 0);
  expect(&s.inactive_split_bytes[SMALL], 2 * MiB - 1024, 2 * MiB - 1024, 2 * MiB - 1024, 0);
  expect(&s.inactive_split_bytes[LARGE], 17 * MiB, 17 * MiB, 17 * MiB, 0);
  assert_int_equal(s.num_device_alloc, 2);
  assert_int_equal(s.max_split_size, -1);

  gca_free(a, x);
  s = stats_of(a, 0);
  expect(&s.allocation[SMALL], 0, 1, 1, 1);
  expect(&s.allocated_bytes[SMALL], 0, 1024, 1024, 1024);
  expect(&s.allocated_bytes[ALL], 3 * MiB, 3 * MiB + 1024, 3 * MiB + 1024, 1024);
  expect(&s.requested_bytes[SMALL], 0, 1000, 1000, 1000);
  expect(&s.active_bytes[SMALL], 0, 1024, 1024, 1024);
  expect(&s.inactive_split[SMALL], 0, 1, 1, 1);
  expect(&s.inactive_split_bytes[SMALL], 0, 2 * MiB - 1024, 2 * MiB - 1024, 2 * MiB - 1024);
  expect(&s.segment[SMALL], 1, 1, 1, 0);

  assert_int_equal(gca_reset_peak_stats(a, 0), GCA_OK);
  s = stats_of(a, 0);
  expect(&s.allocated_bytes[ALL], 3 * MiB, 3 * MiB, 3 * MiB + 1024, 1024);
  expect(&s.allocation[ALL], 1, 1, 2, 1);
  expect(&s.inactive_split[SMALL], 0, 0, 1, 1);

  assert_int_equal(gca_reset_accumulated_stats(a, 0), GCA_OK);
  s = stats_of(a, 0);
  expect(&s.allocated_bytes[ALL], 3 * MiB, 3 * MiB, 0, 0);
  expect(&s.segment[ALL], 2, 2, 0, 0);
  assert_int_equal(s.num_device_alloc, 0);

  gca_free(a, y);
  gca_empty_cache(a, 0);
  s = stats_of(a, 0);
  expect(&s.segment[ALL], 0, 2, 0, 2);
  expect(&s.reserved_bytes[ALL], 0, 22 * MiB, 0, 22 * MiB);
  assert_int_equal(s.num_device_free, 2);
  assert_int_equal(s.num_sync_all_streams, 1);
  assert_int_equal(s.num_device_alloc, 0);
  assert_consistent(a);
  assert_int_equal(gca_reset_peak_stats(a, 9), GCA_ERR_INVALID);
  assert_int_equal(gca_reset_accumulated_stats(NULL, 0), GCA_ERR_INVALID);
  gca_close(a);
}

static int64_t flat_value(const gca_stat_item_t *items, size_t n, const char *name) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(items[i].name, name) == 0) return items[i].value;
  fail_msg("no flat statistic named %s", name);
  return 0;
}

static void test_flat_names(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "max_split_size_mb:64");
  void *p = gca_malloc(a, 100 * MiB, 0, 0);
  gca_stats_t s = stats_of(a, 0);
  gca_stat_item_t items[GCA_STATS_FLAT_COUNT + 5];
  assert_int_equal(gca_stats_flatten(&s, items, sizeof items / sizeof items[0]), GCA_STATS_FLAT_COUNT);
  assert_int_equal(gca_stats_flatten(NULL, NULL, 0), 123); /* PyTorch's keys, num_oom_rejections among them */
  for (size_t i = 1; i < GCA_STATS_FLAT_COUNT; i++) assert_true(strcmp(items[i - 1].name, items[i].name) < 0);
  assert_string_equal(items[0].name, "active.all.allocated");
  assert_string_equal(items[GCA_STATS_FLAT_COUNT - 1].name, "segment.small_pool.peak");
  size_t n = GCA_STATS_FLAT_COUNT;
  assert_int_equal(flat_value(items, n, "allocated_bytes.all.current"), 100 * MiB);
  assert_int_equal(flat_value(items, n, "allocated_bytes.large_pool.peak"), 100 * MiB);
  assert_int_equal(flat_value(items, n, "reserved_bytes.all.current"), 100 * MiB);
  assert_int_equal(flat_value(items, n, "inactive_split_bytes.small_pool.freed"), 0);
  assert_int_equal(flat_value(items, n, "requested_bytes.all.allocated"), 100 * MiB);
  assert_int_equal(flat_value(items, n, "oversize_allocations.current"), 1);
  assert_int_equal(flat_value(items, n, "oversize_segments.peak"), 1);
  assert_int_equal(flat_value(items, n, "num_device_alloc"), 1);
  assert_int_equal(flat_value(items, n, "num_ooms"), 0);
  assert_int_equal(flat_value(items, n, "num_alloc_retries"), 0);
  assert_int_equal(flat_value(items, n, "num_sync_all_streams"), 0);
  assert_int_equal(flat_value(items, n, "num_device_free"), 0);
  assert_int_equal(flat_value(items, n, "max_split_size"), 64 * MiB);
  /* a short buffer gets a prefix of the same order */
  gca_stat_item_t few[3];
  assert_int_equal(gca_stats_flatten(&s, few, 3), GCA_STATS_FLAT_COUNT);
  assert_string_equal(few[2].name, items[2].name);
  gca_free(a, p);
  gca_close(a);
}

static void test_lock_free_reads(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(gca_allocated_bytes(a, 0), 0);
  void *p = gca_malloc(a, 5000, 0, 0);
  assert_int_equal(gca_allocated_bytes(a, 0), 5120);
  assert_int_equal(gca_reserved_bytes(a, 0), 2 * MiB);
  gca_free(a, p);
  assert_int_equal(gca_allocated_bytes(a, 0), 0);
  assert_int_equal(gca_reserved_bytes(a, 0), 2 * MiB);
  gca_empty_cache(a, 0);
  assert_int_equal(gca_reserved_bytes(a, 0), 0);
  assert_int_equal(gca_allocated_bytes(a, 7), 0);
  assert_int_equal(gca_reserved_bytes(NULL, 0), 0);
  gca_close(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_known_sequence),
      cmocka_unit_test(test_flat_names),
      cmocka_unit_test(test_lock_free_reads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
