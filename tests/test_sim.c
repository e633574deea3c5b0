/* The sim backend: options, capacity, address reuse, fault injection
 * (fail_at, fail_after, fail_rate with a seed), added latency, and the
 * checks it makes of the allocator's frees. */
#include <time.h>

#include "helpers.h"

static backend_t open_backend(const char *spec) {
  backend_t b;
  int rc = gca__backend_open(spec, &b);
  if (rc) fprintf(stderr, "%s: %s\n", spec, gca_last_error());
  assert_int_equal(rc, GCA_OK);
  return b;
}

static size_t total_of(const char *spec) {
  backend_t b = open_backend(spec);
  size_t f, t;
  assert_int_equal(b.ops->mem_get_info(b.state, 0, &f, &t), GCA_OK);
  assert_int_equal(f, t);
  gca__backend_close(&b);
  return t;
}

static void test_capacity_units(void **state) {
  (void)state;
  assert_int_equal(total_of("sim"), (size_t)80 << 30);
  assert_int_equal(total_of(""), (size_t)80 << 30);
  assert_int_equal(total_of("sim:capacity=24GiB"), (size_t)24 << 30);
  assert_int_equal(total_of("sim:capacity=1.5GB"), 1500000000);
  assert_int_equal(total_of("sim:capacity=512MiB"), 512 * MiB);
  assert_int_equal(total_of("sim:capacity=100"), 100);
  assert_int_equal(total_of("sim:capacity=2TiB,devices=2"), (size_t)2 << 40);
}

static void expect_bad(const char *spec, const char *fragment) {
  gca_allocator_t *a = (gca_allocator_t *)1;
  assert_int_equal(gca_open(spec, NULL, &a), GCA_ERR_BACKEND);
  assert_null(a);
  assert_contains(gca_last_error(), fragment);
}

static void test_bad_options(void **state) {
  (void)state;
  expect_bad("sim:capacity=0", "capacity");
  expect_bad("sim:capacity=lots", "'lots'");
  expect_bad("sim:capacity=9TiB", "8TiB");
  expect_bad("sim:capacity=5XB", "'5XB'");
  expect_bad("sim:devices=0", "devices");
  expect_bad("sim:devices=65", "1 to 64");
  expect_bad("sim:fail_rate=2", "probability");
  expect_bad("sim:fail_at=0", "fail_at");
  expect_bad("sim:backed=2", "0 or 1");
  expect_bad("sim:latency_ns=-1", "latency_ns");
  expect_bad("sim:bogus=1", "unknown option 'bogus'");
  expect_bad("sim:capacity", "needs a value");
  expect_bad("cuda:driver=/nonexistent/libcuda.so.1", "no CUDA driver");
  expect_bad("nope:x=1", "unknown backend 'nope' (available: sim, cuda, acl)");
}

static void test_capacity_and_address_reuse(void **state) {
  (void)state;
  backend_t b = open_backend("sim:capacity=10MiB,devices=2");
  uintptr_t p, q, r, d1;
  assert_int_equal(b.ops->malloc(b.state, 0, 4 * MiB, &p), GCA_OK);
  assert_int_equal(b.ops->malloc(b.state, 0, 4 * MiB, &q), GCA_OK);
  assert_int_equal(q, p + 4 * MiB);
  assert_int_equal(b.ops->malloc(b.state, 0, 4 * MiB, &r), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "out of memory");
  assert_int_equal(b.ops->malloc(b.state, 1, 4 * MiB, &d1), GCA_OK); /* other device, own capacity */
  assert_true(d1 >= q + 4 * MiB || d1 + 4 * MiB <= p);
  assert_int_equal(b.ops->free(b.state, 0, p, 4 * MiB), GCA_OK);
  assert_int_equal(b.ops->malloc(b.state, 0, 2 * MiB, &r), GCA_OK);
  assert_int_equal(r, p); /* first fit reuses the freed range */
  /* the sim catches frees the allocator should never make */
  assert_int_equal(b.ops->free(b.state, 0, p + 512, 2 * MiB), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "never allocated");
  assert_int_equal(b.ops->free(b.state, 0, r, 4 * MiB), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "with size");
  assert_int_equal(b.ops->free(b.state, 0, r, 2 * MiB), GCA_OK);
  assert_int_equal(b.ops->free(b.state, 0, r, 2 * MiB), GCA_ERR_BAD_POINTER);
  sim_counters_t c;
  assert_int_equal(gca__sim_get_counters(&b, 0, &c), GCA_OK);
  assert_int_equal(c.malloc_calls, 4);
  assert_int_equal(c.mallocs, 3);
  assert_int_equal(c.frees, 2);
  assert_int_equal(c.live, 1);
  assert_int_equal(c.used, 4 * MiB);
  gca__backend_close(&b);
}

/* Placement (sim_set_placement): an allocation of the next entry's size
 * goes at its address, made this device's (the origin at the device's
 * first address); an entry whose range is taken is used up and the
 * allocation goes first fit; other sizes go first fit and leave the list
 * where it is. */
static void test_placement(void **state) {
  (void)state;
  backend_t b = open_backend("sim:capacity=1GiB,devices=2");
  uintptr_t first, at, fit, again, other;
  assert_int_equal(b.ops->malloc(b.state, 1, 2 * MiB, &first), GCA_OK); /* device 1's first address */
  assert_int_equal(b.ops->free(b.state, 1, first, 2 * MiB), GCA_OK);
  const uint64_t origin = 0x7f0000000000ull;
  const sim_place_t places[] = {{20 * MiB, origin + 64 * MiB}, {2 * MiB, origin}, {4 * MiB, origin + 64 * MiB}};
  assert_int_equal(gca__sim_set_placement(&b, 1, places, 3, origin), GCA_OK);
  assert_int_equal(b.ops->malloc(b.state, 1, 6 * MiB, &fit), GCA_OK); /* not the next entry's size */
  assert_int_equal(fit, first);
  assert_int_equal(b.ops->malloc(b.state, 1, 20 * MiB, &at), GCA_OK);
  assert_int_equal(at, first + 64 * MiB);
  assert_int_equal(b.ops->malloc(b.state, 1, 2 * MiB, &again), GCA_OK); /* its place is taken: first fit */
  assert_int_equal(again, first + 6 * MiB);
  assert_int_equal(b.ops->malloc(b.state, 1, 4 * MiB, &other), GCA_OK); /* inside the 20 MiB: taken too */
  assert_int_equal(other, first + 8 * MiB);
  /* Freed ranges merge around a placed one as around any other. */
  assert_int_equal(b.ops->free(b.state, 1, at, 20 * MiB), GCA_OK);
  const sim_place_t back[] = {{8 * MiB, origin + 70 * MiB}};
  assert_int_equal(gca__sim_set_placement(&b, 1, back, 1, origin), GCA_OK);
  assert_int_equal(b.ops->malloc(b.state, 1, 8 * MiB, &at), GCA_OK);
  assert_int_equal(at, first + 70 * MiB);
  /* An address below the origin is left to first fit. */
  const sim_place_t below[] = {{2 * MiB, origin - 4 * MiB}};
  assert_int_equal(gca__sim_set_placement(&b, 1, below, 1, origin), GCA_OK);
  assert_int_equal(b.ops->malloc(b.state, 1, 2 * MiB, &again), GCA_OK);
  assert_int_equal(again, first + 12 * MiB);
  sim_counters_t c;
  assert_int_equal(gca__sim_get_counters(&b, 1, &c), GCA_OK);
  assert_int_equal(c.live, 5);
  gca__backend_close(&b);
  backend_t one;
  assert_int_equal(gca__backend_open("sim", &one), GCA_OK);
  assert_int_equal(gca__sim_set_placement(&one, 5, places, 1, origin), GCA_ERR_INVALID); /* no device 5 */
  gca__backend_close(&one);
}

static void test_fail_at_is_transient(void **state) {
  (void)state;
  /* The 2nd device allocation fails once: the allocator empties its cache,
   * retries, and the 3rd call succeeds. */
  gca_allocator_t *a = open_sim("sim:fail_at=2", NULL);
  assert_non_null(gca_malloc(a, 4096, 0, 0));
  assert_non_null(gca_malloc(a, 20 * MiB, 0, 0));
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_alloc_retries, 1);
  assert_int_equal(s.num_ooms, 0);
  assert_int_equal(sim_counters(a, 0).malloc_calls, 3);
  assert_consistent(a);
  gca_close(a);
}

static void test_fail_after(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:fail_after=1", NULL);
  void *p = gca_malloc(a, 4096, 0, 0);
  assert_non_null(p);
  assert_null(gca_malloc(a, 20 * MiB, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_int_equal(stats_of(a, 0).num_ooms, 1);
  /* cached memory still serves: the small segment has room */
  assert_non_null(gca_malloc(a, 4096, 0, 0));
  assert_consistent(a);
  gca_close(a);
}

static int failure_pattern(const char *spec, char *pattern, int n) {
  backend_t b = open_backend(spec);
  int failures = 0;
  for (int i = 0; i < n; i++) {
    uintptr_t addr;
    int rc = b.ops->malloc(b.state, 0, 512, &addr);
    pattern[i] = rc == GCA_OK ? '.' : 'x';
    failures += rc != GCA_OK;
  }
  pattern[n] = '\0';
  gca__backend_close(&b);
  return failures;
}

static void test_fail_rate_is_seeded(void **state) {
  (void)state;
  char a[401], b[401], c[401];
  int fa = failure_pattern("sim:fail_rate=0.25,seed=7", a, 400);
  int fb = failure_pattern("sim:fail_rate=0.25,seed=7", b, 400);
  failure_pattern("sim:fail_rate=0.25,seed=8", c, 400);
  assert_string_equal(a, b);
  assert_string_not_equal(a, c);
  assert_int_equal(fa, fb);
  assert_in_range(fa, 60, 140); /* 100 expected */
  assert_int_equal(failure_pattern("sim:fail_rate=0", a, 50), 0);
  assert_int_equal(failure_pattern("sim:fail_rate=1", a, 50), 50);
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void test_latency(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:latency_ns=5000000", NULL); /* 5 ms per device call */
  double t0 = seconds();
  void *p = gca_malloc(a, 4096, 0, 0); /* a miss: one device call */
  double miss = seconds() - t0;
  t0 = seconds();
  gca_free(a, p);
  void *q = gca_malloc(a, 4096, 0, 0); /* a hit: no device call */
  double hit = seconds() - t0;
  assert_true(miss >= 0.005);
  assert_true(hit < 0.005);
  gca_free(a, q);
  gca_close(a);
}

static void test_refused_free_is_reported(void **state) {
  (void)state;
  /* Free a segment behind the allocator's back: when the cache later gives
   * it back, the sim refuses, and the checker says so. */
  gca_allocator_t *a = open_sim("sim", NULL);
  void *p = gca_malloc(a, 4096, 0, 0);
  gca_free(a, p);
  segment_t *seg = a->devices[0].segments;
  assert_int_equal(a->backend.ops->free(a->backend.state, 0, seg->addr, seg->size), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(gca_check(a, 0), GCA_ERR_CORRUPT);
  assert_contains(gca_last_error(), "reported 1 segment frees as wrong");
  gca_close(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_capacity_units),     cmocka_unit_test(test_bad_options),
      cmocka_unit_test(test_capacity_and_address_reuse), cmocka_unit_test(test_placement),
      cmocka_unit_test(test_fail_at_is_transient),
      cmocka_unit_test(test_fail_after),         cmocka_unit_test(test_fail_rate_is_seeded),
      cmocka_unit_test(test_latency),            cmocka_unit_test(test_refused_free_is_reported),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
