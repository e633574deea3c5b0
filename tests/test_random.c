/* Randomized operation sequences (seeded, 1.1 million operations in all)
 * checked by the invariant checker and by an independent model of what must
 * be live: every allocation is 512-aligned, at least the rounded size, never
 * overlaps another, and the statistics count exactly the live set. Phases
 * cover the default settings, oversize rules with division rounding, and a
 * small device with injected failures so the release-and-retry path and
 * out-of-memory failures happen often. */
#include "helpers.h"

typedef struct live {
  uintptr_t addr;
  size_t requested;
  size_t usable;
  int device;
} live_t;

typedef struct phase {
  const char *backend;
  const char *config;
  long ops;
  uint64_t seed;
  int devices;
} phase_t;

static uint64_t rng_state;

static uint64_t next_u64(void) { return splitmix64(&rng_state); }

/* Sizes spread over both pools and every segment rule: 40% small
 * (1 B .. 1 MiB), 45% medium (1 .. 64 MiB), 15% large (64 MiB .. 1 GiB),
 * log-uniform in each band. */
static size_t random_size(void) {
  uint64_t r = next_u64() % 100;
  int lo, hi;
  if (r < 40) lo = 0, hi = 20;
  else if (r < 85) lo = 20, hi = 26;
  else lo = 26, hi = 30;
  int bits = lo + (int)(next_u64() % (uint64_t)(hi - lo + 1));
  size_t base = (size_t)1 << bits;
  return base + (size_t)(next_u64() % base);
}

static int compare_addr(const void *a, const void *b) {
  const live_t *x = a, *y = b;
  if (x->device != y->device) return x->device - y->device;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

static void check_model(gca_allocator_t *a, live_t *live, size_t n, int devices) {
  assert_consistent(a);
  int64_t requested[8] = {0}, count[8] = {0};
  for (size_t i = 0; i < n; i++) {
    requested[live[i].device] += (int64_t)live[i].requested;
    count[live[i].device]++;
  }
  for (int d = 0; d < devices; d++) {
    gca_stats_t s = stats_of(a, d);
    assert_int_equal(s.requested_bytes[GCA_POOL_ALL].current, requested[d]);
    assert_int_equal(s.allocation[GCA_POOL_ALL].current, count[d]);
    sim_counters_t c = sim_counters(a, d);
    assert_int_equal((int64_t)c.used, s.reserved_bytes[GCA_POOL_ALL].current);
    assert_int_equal((int64_t)c.live, s.segment[GCA_POOL_ALL].current);
  }
  /* no two live allocations overlap */
  live_t *sorted = malloc((n ? n : 1) * sizeof *sorted);
  memcpy(sorted, live, n * sizeof *live);
  qsort(sorted, n, sizeof *sorted, compare_addr);
  for (size_t i = 1; i < n; i++)
    if (sorted[i].device == sorted[i - 1].device) assert_true(sorted[i - 1].addr + sorted[i - 1].usable <= sorted[i].addr);
  free(sorted);
}

static void run_phase(const phase_t *ph) {
  rng_state = ph->seed;
  gca_allocator_t *a = open_sim(ph->backend, ph->config);
  size_t cap = 4096, n = 0;
  live_t *live = malloc(cap * sizeof *live);
  long ooms = 0, allocs = 0;
  for (long op = 0; op < ph->ops; op++) {
    /* Allocate more than free while fewer than ~1500 blocks live, then less:
     * the live set hovers there, large enough for deep free indexes. */
    uint64_t r = next_u64() % 1000;
    uint64_t alloc_share = n < 1500 ? 600 : 400;
    if (r < alloc_share || n == 0) {
      size_t size = random_size();
      int device = (int)(next_u64() % (uint64_t)ph->devices);
      gca_stream_t stream = (gca_stream_t)(next_u64() % 4);
      void *p = gca_malloc(a, size, device, stream);
      allocs++;
      if (!p) {
        assert_int_equal(gca_last_status(), GCA_ERR_OOM);
        ooms++;
        continue;
      }
      size_t usable = gca_usable_size(a, p);
      assert_int_equal((uintptr_t)p % 512, 0);
      assert_true(usable >= gca_round_size(a, size));
      if (n == cap) live = realloc(live, (cap *= 2) * sizeof *live);
      live[n++] = (live_t){(uintptr_t)p, size, usable, device};
    } else if (r < 995) {
      size_t i = (size_t)(next_u64() % n);
      assert_int_equal(gca_free(a, (void *)live[i].addr), GCA_OK);
      live[i] = live[--n];
    } else if (r < 998) {
      assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
    } else {
      /* a bad free in the middle of it all changes nothing */
      if (n) assert_int_equal(gca_free(a, (void *)(live[0].addr + 256)), GCA_ERR_BAD_POINTER);
    }
    if (op % 2000 == 0) check_model(a, live, n, ph->devices);
  }
  check_model(a, live, n, ph->devices);
  while (n) assert_int_equal(gca_free(a, (void *)live[--n].addr), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  for (int d = 0; d < ph->devices; d++) {
    gca_stats_t s = stats_of(a, d);
    assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 0);
    assert_int_equal(s.inactive_split[GCA_POOL_ALL].current, 0);
    assert_int_equal(sim_counters(a, d).live, 0);
  }
  assert_consistent(a);
  printf("phase %s [%s]: %ld ops, %ld allocations, %ld out of memory\n", ph->backend, ph->config ? ph->config : "",
         ph->ops, allocs, ooms);
  free(live);
  gca_close(a);
}

static void test_default_settings(void **state) {
  (void)state;
  phase_t ph = {"sim:capacity=2TiB,devices=2", NULL, 400000, 1, 2};
  run_phase(&ph);
}

static void test_oversize_and_divisions(void **state) {
  (void)state;
  phase_t ph = {"sim:capacity=2TiB", "max_split_size_mb:64,max_non_split_rounding_mb:32,"
                                     "roundup_power2_divisions:[1:2,64:4,>:8]", 400000, 2, 1};
  run_phase(&ph);
}

static void test_small_device_with_faults(void **state) {
  (void)state;
  phase_t ph = {"sim:capacity=24GiB,fail_rate=0.02,seed=3", "max_split_size_mb:256", 300000, 3, 1};
  run_phase(&ph);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_default_settings),
      cmocka_unit_test(test_oversize_and_divisions),
      cmocka_unit_test(test_small_device_with_faults),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
