/* Bad input is refused with a status and a message naming the problem, and
 * leaves every structure intact: unknown pointers, pointers inside blocks,
 * double frees, absurd sizes, bad devices, bad handles. */
#include "helpers.h"

static gca_stats_t snapshot;

static void remember(gca_allocator_t *a) { snapshot = stats_of(a, 0); }

static void assert_unchanged(gca_allocator_t *a) {
  gca_stats_t now = stats_of(a, 0);
  assert_memory_equal(&now, &snapshot, sizeof now);
  assert_consistent(a);
}

static void test_free_null_and_null_handles(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(gca_free(a, NULL), GCA_OK);
  assert_int_equal(gca_free(NULL, NULL), GCA_OK);
  assert_int_equal(gca_free(NULL, (void *)0x1000), GCA_ERR_INVALID);
  assert_null(gca_malloc(NULL, 10, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_INVALID);
  assert_int_equal(gca_open("sim", NULL, NULL), GCA_ERR_INVALID);
  assert_int_equal(gca_device_count(NULL), GCA_ERR_INVALID);
  assert_int_equal(gca_check(NULL, 0), GCA_ERR_INVALID);
  assert_int_equal(gca_empty_cache(NULL, 0), GCA_ERR_INVALID);
  assert_int_equal(gca_get_stats(a, 0, NULL), GCA_ERR_INVALID);
  gca_close(a);
}

static void test_unknown_inside_and_double_free(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  char *p = gca_malloc(a, 8192, 0, 0);
  char *keep = gca_malloc(a, 8192, 0, 0);
  remember(a);

  assert_int_equal(gca_free(a, (void *)0x1234), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "was not allocated by this allocator");
  assert_unchanged(a);

  assert_int_equal(gca_free(a, p + 512), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "512 bytes inside the allocation at");
  assert_unchanged(a);

  /* the end of the segment is past every block: not ours */
  assert_int_equal(gca_free(a, p + 2 * MiB), GCA_ERR_BAD_POINTER);
  assert_unchanged(a);

  assert_int_equal(gca_free(a, p), GCA_OK);
  remember(a);
  assert_int_equal(gca_free(a, p), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "freed twice?");
  assert_unchanged(a);

  /* once its segment is gone, the pointer is simply unknown */
  assert_int_equal(gca_free(a, keep), GCA_OK);
  gca_empty_cache(a, 0);
  assert_int_equal(gca_free(a, keep), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "was not allocated");
  /* still fully usable */
  assert_non_null(gca_malloc(a, 8192, 0, 0));
  assert_consistent(a);
  gca_close(a);
}

static void test_absurd_sizes(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB", NULL);
  void *keep = gca_malloc(a, 4096, 0, 0);
  remember(a);
  assert_null(gca_malloc(a, SIZE_MAX, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "overflows");
  assert_unchanged(a);
  assert_null(gca_malloc(a, SIZE_MAX - 1024, 0, 0)); /* rounds, but no segment size fits */
  assert_int_equal(gca_last_status(), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "overflow");
  assert_unchanged(a);

  /* beyond the device: the ladder runs, then out of memory */
  assert_null(gca_malloc(a, 2ull << 30, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "Tried to allocate 2.00 GiB");
  assert_null(gca_malloc(a, SIZE_MAX / 2, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_ooms, 2);
  assert_int_equal(s.allocation[GCA_POOL_ALL].current, 1);
  assert_int_equal(gca_free(a, keep), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

static void test_bad_devices(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_null(gca_malloc(a, 10, 1, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "device 1 does not exist");
  assert_null(gca_malloc(a, 10, -1, 0));
  assert_contains(gca_last_error(), "device -1 does not exist");
  gca_stats_t s;
  assert_int_equal(gca_get_stats(a, 3, &s), GCA_ERR_INVALID);
  size_t f, t;
  assert_int_equal(gca_mem_get_info(a, 2, &f, &t), GCA_ERR_INVALID);
  assert_int_equal(gca_check(a, 4), GCA_ERR_INVALID);
  assert_consistent(a);
  gca_close(a);
}

static void test_status_names(void **state) {
  (void)state;
  assert_string_equal(gca_status_name(GCA_OK), "GCA_OK");
  assert_string_equal(gca_status_name(GCA_ERR_BAD_POINTER), "GCA_ERR_BAD_POINTER");
  assert_string_equal(gca_status_name(-99), "GCA_ERR_UNKNOWN");
  assert_string_equal(gca_version(), GCALLOC_VERSION_STRING);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_free_null_and_null_handles),
      cmocka_unit_test(test_unknown_inside_and_double_free),
      cmocka_unit_test(test_absurd_sizes),
      cmocka_unit_test(test_bad_devices),
      cmocka_unit_test(test_status_names),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
