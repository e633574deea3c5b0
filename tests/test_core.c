/* The caching core's rules, each with values worked out from PyTorch's
 * allocator: split and merge, pools and segment sizes, best fit by (stream,
 * size, address), the large-pool split rule, the oversize rules, release of
 * cached blocks when the device is full, empty_cache. */
#include "helpers.h"

#define SMALL GCA_POOL_SMALL
#define LARGE GCA_POOL_LARGE

static void test_split_and_merge_small(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  char *p = gca_malloc(a, 4096, 0, 0);
  assert_non_null(p);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.segment[SMALL].current, 1);
  assert_int_equal(s.reserved_bytes[SMALL].current, 2 * MiB);
  assert_int_equal(s.allocated_bytes[SMALL].current, 4096);
  assert_int_equal(s.inactive_split[SMALL].current, 1);
  assert_int_equal(s.inactive_split_bytes[SMALL].current, 2 * MiB - 4096);
  assert_consistent(a);

  /* The next request splits the remainder again and takes its low end. */
  char *q = gca_malloc(a, 1000, 0, 0);
  assert_ptr_equal(q, p + 4096);
  s = stats_of(a, 0);
  assert_int_equal(s.inactive_split[SMALL].current, 1);
  assert_int_equal(s.inactive_split_bytes[SMALL].current, 2 * MiB - 5120);
  assert_int_equal(s.requested_bytes[SMALL].current, 4096 + 1000);
  assert_consistent(a);

  /* Freeing p leaves a second inactive piece (its neighbour is allocated). */
  assert_int_equal(gca_free(a, p), GCA_OK);
  s = stats_of(a, 0);
  assert_int_equal(s.inactive_split[SMALL].current, 2);
  assert_int_equal(s.inactive_split_bytes[SMALL].current, 2 * MiB - 1024);
  assert_consistent(a);

  /* Best fit takes the exact 4 KiB piece, not the big remainder. */
  char *r = gca_malloc(a, 4096, 0, 0);
  assert_ptr_equal(r, p);
  s = stats_of(a, 0);
  assert_int_equal(s.inactive_split[SMALL].current, 1);
  assert_int_equal(s.inactive_split_bytes[SMALL].current, 2 * MiB - 5120);

  /* q merges with the free remainder after it; r then merges everything. */
  assert_int_equal(gca_free(a, q), GCA_OK);
  s = stats_of(a, 0);
  assert_int_equal(s.inactive_split[SMALL].current, 1);
  assert_int_equal(s.inactive_split_bytes[SMALL].current, 2 * MiB - 4096);
  assert_consistent(a);
  assert_int_equal(gca_free(a, r), GCA_OK);
  s = stats_of(a, 0);
  assert_int_equal(s.inactive_split[SMALL].current, 0);
  assert_int_equal(s.inactive_split_bytes[SMALL].current, 0);
  assert_int_equal(s.inactive_split[SMALL].allocated, 2);
  assert_int_equal(s.segment[SMALL].current, 1); /* cached, not returned */
  assert_consistent(a);

  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  s = stats_of(a, 0);
  assert_int_equal(s.segment[GCA_POOL_ALL].current, 0);
  assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(s.num_device_free, 1);
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.frees, 1);
  assert_int_equal(c.live, 0);
  assert_int_equal(c.used, 0);
  gca_close(a);
}

static void test_merge_both_neighbours(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  char *x = gca_malloc(a, 8192, 0, 0), *y = gca_malloc(a, 8192, 0, 0), *z = gca_malloc(a, 8192, 0, 0);
  assert_ptr_equal(y, x + 8192);
  assert_ptr_equal(z, y + 8192);
  gca_free(a, x);
  gca_free(a, z); /* z merges with the remainder after it */
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.inactive_split[SMALL].current, 2);
  assert_consistent(a);
  gca_free(a, y); /* y merges with x before and z+rest after: one whole block */
  s = stats_of(a, 0);
  assert_int_equal(s.inactive_split[SMALL].current, 0);
  assert_int_equal(s.inactive_split_bytes[SMALL].current, 0);
  assert_int_equal(a->devices[0].small_pool.free_count, 1);
  assert_consistent(a);
  /* the whole segment is one block again: a 2 MiB-sized request fits at x */
  char *w = gca_malloc(a, MiB, 0, 0);
  assert_ptr_equal(w, x);
  gca_close(a);
}

static void test_pools_and_segment_sizes(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *small = gca_malloc(a, MiB, 0, 0);     /* exactly 1 MiB: small pool */
  void *large = gca_malloc(a, MiB + 1, 0, 0); /* rounded 1 MiB + 512: large pool, 20 MiB segment */
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.allocation[SMALL].current, 1);
  assert_int_equal(s.allocation[LARGE].current, 1);
  assert_int_equal(s.reserved_bytes[SMALL].current, 2 * MiB);
  assert_int_equal(s.reserved_bytes[LARGE].current, 20 * MiB);
  assert_int_equal(s.allocated_bytes[LARGE].current, MiB + 512);
  assert_int_equal(s.requested_bytes[LARGE].current, MiB + 1);
  /* a second 1 MiB takes the small segment's other half exactly: no split */
  void *small2 = gca_malloc(a, MiB, 0, 0);
  s = stats_of(a, 0);
  assert_int_equal(s.segment[SMALL].current, 1);
  assert_int_equal(s.inactive_split[SMALL].current, 0);
  /* 10 MiB + 512 fits in the remainder of the 20 MiB segment: no new segment */
  char *big = gca_malloc(a, 10 * MiB + 512, 0, 0);
  assert_ptr_equal(big, (char *)large + MiB + 512);
  s = stats_of(a, 0);
  assert_int_equal(s.reserved_bytes[LARGE].current, 20 * MiB);
  assert_int_equal(s.inactive_split_bytes[LARGE].current, 9 * MiB - 1024);
  /* on another stream it needs its own segment: >= 10 MiB rounds up to 2 MiB */
  void *big2 = gca_malloc(a, 10 * MiB + 512, 0, 1);
  s = stats_of(a, 0);
  assert_int_equal(s.reserved_bytes[LARGE].current, 32 * MiB);
  assert_int_equal(s.num_device_alloc, 3);
  gca_free(a, big2);
  gca_free(a, small);
  gca_free(a, large);
  gca_free(a, small2);
  gca_free(a, big);
  assert_consistent(a);
  gca_close(a);
}

static void test_large_split_rule(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  char *p = gca_malloc(a, 5 * MiB, 0, 0); /* 20 MiB segment, remainder 15 MiB > 1 MiB: split */
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.inactive_split_bytes[LARGE].current, 15 * MiB);
  /* 14 MiB from the 15 MiB remainder leaves exactly 1 MiB: not > 1 MiB, no split */
  char *q = gca_malloc(a, 14 * MiB, 0, 0);
  assert_ptr_equal(q, p + 5 * MiB);
  assert_int_equal(gca_usable_size(a, q), 15 * MiB);
  s = stats_of(a, 0);
  assert_int_equal(s.allocated_bytes[LARGE].current, 20 * MiB);
  assert_int_equal(s.requested_bytes[LARGE].current, 19 * MiB);
  assert_int_equal(s.inactive_split[LARGE].current, 0);
  assert_int_equal(s.segment[LARGE].current, 1);
  /* 11 MiB: 12 MiB segment, remainder exactly 1 MiB, not split */
  void *r = gca_malloc(a, 11 * MiB, 0, 0);
  assert_int_equal(gca_usable_size(a, r), 12 * MiB);
  /* 11 MiB - 512: 12 MiB segment, remainder 1 MiB + 512 > 1 MiB: split */
  void *t = gca_malloc(a, 11 * MiB - 512, 0, 0);
  assert_int_equal(gca_usable_size(a, t), 11 * MiB - 512);
  s = stats_of(a, 0);
  assert_int_equal(s.inactive_split[LARGE].current, 1);
  assert_int_equal(s.inactive_split_bytes[LARGE].current, MiB + 512);
  assert_consistent(a);
  gca_close(a);
}

static void test_best_fit_by_size_then_address(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  char *x1 = gca_malloc(a, 12 * MiB, 0, 0);
  char *x2 = gca_malloc(a, 14 * MiB, 0, 0);
  char *x3 = gca_malloc(a, 16 * MiB, 0, 0);
  gca_free(a, x2);
  gca_free(a, x1);
  gca_free(a, x3);
  assert_ptr_equal(gca_malloc(a, 13 * MiB, 0, 0), x2); /* 14 is the smallest that fits */
  assert_ptr_equal(gca_malloc(a, 12 * MiB, 0, 0), x1);
  assert_ptr_equal(gca_malloc(a, 15 * MiB, 0, 0), x3);
  assert_int_equal(stats_of(a, 0).num_device_alloc, 3);

  char *y1 = gca_malloc(a, 18 * MiB, 0, 0);
  char *y2 = gca_malloc(a, 18 * MiB, 0, 0);
  gca_free(a, y2);
  gca_free(a, y1);
  assert_ptr_equal(gca_malloc(a, 18 * MiB, 0, 0), y1 < y2 ? y1 : y2); /* equal sizes: lowest address */
  assert_consistent(a);
  gca_close(a);
}

static void test_blocks_cached_per_stream(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *s1 = gca_malloc(a, 4096, 0, 1);
  gca_free(a, s1);
  void *s2 = gca_malloc(a, 4096, 0, 2);
  assert_ptr_not_equal(s1, s2);
  assert_int_equal(stats_of(a, 0).segment[SMALL].current, 2);
  void *again = gca_malloc(a, 4096, 0, 1);
  assert_ptr_equal(again, s1);
  /* a stream's blocks are never given to another, whatever their size */
  void *big1 = gca_malloc(a, 40 * MiB, 0, 7);
  gca_free(a, big1);
  void *big2 = gca_malloc(a, 40 * MiB, 0, 8);
  assert_ptr_not_equal(big1, big2);
  assert_consistent(a);
  gca_close(a);
}

static void test_oversize_rules(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "max_split_size_mb:100");
  char *o = gca_malloc(a, 150 * MiB, 0, 0);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.oversize_allocations.current, 1);
  assert_int_equal(s.oversize_segments.current, 1);
  assert_int_equal(s.max_split_size, 100 * MiB);
  gca_free(a, o);
  s = stats_of(a, 0);
  assert_int_equal(s.oversize_allocations.current, 0);
  assert_int_equal(s.oversize_allocations.freed, 1);
  assert_int_equal(s.oversize_segments.current, 1);

  /* below max_split_size: never takes an oversize block */
  char *m = gca_malloc(a, 50 * MiB, 0, 0);
  assert_ptr_not_equal(m, o);
  /* at least max_split_size: only a block < request + 20 MiB (150 >= 140: no) */
  char *n = gca_malloc(a, 120 * MiB, 0, 0);
  assert_ptr_not_equal(n, o);
  assert_int_equal(stats_of(a, 0).num_device_alloc, 3);
  gca_free(a, n);
  /* 135 MiB: 150 < 155, taken whole, not split */
  char *p = gca_malloc(a, 135 * MiB, 0, 0);
  assert_ptr_equal(p, o);
  assert_int_equal(gca_usable_size(a, p), 150 * MiB);
  assert_int_equal(stats_of(a, 0).inactive_split[LARGE].current, 0);
  /* a wider rounding lets 100 MiB take the cached 120 MiB block */
  assert_int_equal(gca_set_config(a, "max_non_split_rounding_mb:40"), GCA_OK);
  char *q = gca_malloc(a, 100 * MiB, 0, 0);
  assert_ptr_equal(q, n);
  s = stats_of(a, 0);
  assert_int_equal(s.oversize_allocations.current, 2);
  assert_int_equal(s.oversize_segments.current, 2);
  assert_consistent(a);
  /* changing max_split_size later does not unbalance the books */
  assert_int_equal(gca_set_config(a, "max_split_size_mb:1000"), GCA_OK);
  gca_free(a, p);
  gca_free(a, q);
  gca_free(a, m);
  s = stats_of(a, 0);
  assert_int_equal(s.oversize_allocations.current, 0);
  assert_consistent(a);
  gca_empty_cache(a, -1);
  assert_int_equal(stats_of(a, 0).oversize_segments.current, 0);
  assert_consistent(a);
  gca_close(a);
}

static void test_release_cached_when_full(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=400MiB", "max_split_size_mb:100");
  void *A = gca_malloc(a, 150 * MiB, 0, 0), *B = gca_malloc(a, 200 * MiB, 0, 0);
  gca_free(a, A);
  gca_free(a, B);
  /* 180 MiB: the cached 200 MiB is too big to take (>= 180 + 20), the device
   * has 50 MiB free: release the smallest cached oversize block that covers
   * the request (B) and ask again. */
  void *C = gca_malloc(a, 180 * MiB, 0, 0);
  assert_non_null(C);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_device_free, 1);
  assert_int_equal(s.num_alloc_retries, 0);
  assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 330 * MiB);
  assert_consistent(a);
  /* 300 MiB: releasing A is not enough, then everything cached is released,
   * one retry, and out of memory. */
  void *D = gca_malloc(a, 300 * MiB, 0, 0);
  assert_null(D);
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  s = stats_of(a, 0);
  assert_int_equal(s.num_alloc_retries, 1);
  assert_int_equal(s.num_ooms, 1);
  assert_int_equal(s.num_sync_all_streams, 1);
  assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 180 * MiB);
  const char *msg = gca_last_error();
  assert_contains(msg, "out of memory. Tried to allocate 300.00 MiB");
  assert_contains(msg, "total capacity of 400.00 MiB of which 220.00 MiB is free");
  assert_contains(msg, "180.00 MiB is allocated by gcalloc, and 0 bytes is reserved by gcalloc but unallocated");
  assert_consistent(a);
  /* after the release, the memory that came back serves the next request */
  void *E = gca_malloc(a, 200 * MiB, 0, 0);
  assert_non_null(E);
  gca_close(a);
}

static void test_empty_cache_only_whole_free_segments(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:devices=2", NULL);
  void *keep = gca_malloc(a, 4096, 0, 0);
  void *b = gca_malloc(a, 2 * MiB + 1, 0, 0);
  void *c = gca_malloc(a, 12 * MiB, 0, 1); /* own stream: own segment */
  void *other = gca_malloc(a, 12 * MiB, 1, 0);
  gca_free(a, b);
  gca_free(a, c);
  gca_free(a, other);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.segment[GCA_POOL_ALL].current, 1); /* the segment holding `keep` */
  assert_int_equal(s.num_device_free, 2);
  assert_int_equal(s.num_sync_all_streams, 1);
  assert_int_equal(stats_of(a, 1).segment[GCA_POOL_ALL].current, 1); /* device 1 untouched */
  sim_counters_t c0 = sim_counters(a, 0);
  assert_int_equal(c0.mallocs, 3);
  assert_int_equal(c0.frees, 2);
  assert_int_equal(c0.live, 1);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 1).segment[GCA_POOL_ALL].current, 0);
  assert_int_equal(gca_free(a, keep), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 5), GCA_ERR_INVALID);
  assert_consistent(a);
  gca_close(a);
}

static void test_devices_are_separate(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:devices=3,capacity=1GiB", NULL);
  assert_int_equal(gca_device_count(a), 3);
  void *p = gca_malloc(a, 64 * MiB, 2, 0);
  assert_non_null(p);
  assert_int_equal(stats_of(a, 2).allocation[GCA_POOL_ALL].current, 1);
  assert_int_equal(stats_of(a, 0).allocation[GCA_POOL_ALL].current, 0);
  assert_int_equal(gca_allocated_bytes(a, 2), 64 * MiB);
  size_t f, t;
  assert_int_equal(gca_mem_get_info(a, 2, &f, &t), GCA_OK);
  assert_int_equal(t, (size_t)1 << 30);
  assert_int_equal(f, ((size_t)1 << 30) - 64 * MiB);
  assert_int_equal(gca_mem_get_info(a, 0, &f, &t), GCA_OK);
  assert_int_equal(f, (size_t)1 << 30);
  assert_int_equal(gca_free(a, p), GCA_OK); /* found on device 2 without naming it */
  assert_int_equal(stats_of(a, 2).allocation[GCA_POOL_ALL].current, 0);
  assert_consistent(a);
  gca_close(a);
}

static void test_zero_size_and_usable_size(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca__set_error(GCA_ERR_IO, "stale");
  assert_null(gca_malloc(a, 0, 0, 0));
  assert_int_equal(gca_last_status(), GCA_OK);
  void *p = gca_malloc(a, 1000, 0, 0);
  assert_int_equal((uintptr_t)p % 512, 0);
  assert_int_equal(gca_usable_size(a, p), 1024);
  gca_free(a, p);
  assert_int_equal(gca_usable_size(a, p), 0);
  assert_int_equal(gca_last_status(), GCA_ERR_BAD_POINTER);
  gca_close(a);
}

/* PyTorch's getBaseAllocation: the segment an allocation was carved from;
 * in an expandable segment, the allocation itself; refused for anything but
 * the start of a live allocation. */
static void test_base_allocation(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:devices=2", NULL);
  char *p = gca_malloc(a, 1000, 1, 0), *q = gca_malloc(a, 3000, 1, 0); /* one 2 MiB small segment */
  void *base = NULL;
  size_t size = 0;
  assert_int_equal(gca_base_allocation(a, q, &base, &size), GCA_OK);
  assert_ptr_equal(base, p);
  assert_int_equal(size, 2 * MiB);
  assert_int_equal(gca_base_allocation(a, p, &base, NULL), GCA_OK);
  assert_ptr_equal(base, p);
  assert_int_equal(gca_base_allocation(a, q + 512, &base, &size), GCA_ERR_BAD_POINTER); /* inside, not a start */
  assert_non_null(strstr(gca_last_error(), "not the start of a live allocation"));
  gca_free(a, q);
  assert_int_equal(gca_base_allocation(a, q, &base, &size), GCA_ERR_BAD_POINTER); /* freed */
  assert_int_equal(gca_base_allocation(a, NULL, &base, &size), GCA_ERR_INVALID);
  assert_int_equal(gca_base_allocation(a, p, NULL, &size), GCA_ERR_INVALID);
  assert_int_equal(gca_base_allocation(NULL, p, &base, &size), GCA_ERR_INVALID);
  gca_free(a, p);
  gca_close(a);
  a = open_sim("sim", "expandable_segments:True");
  p = gca_malloc(a, 30 * MiB, 0, 0);
  q = gca_malloc(a, 30 * MiB, 0, 0);
  assert_int_equal(gca_base_allocation(a, q, &base, &size), GCA_OK);
  assert_ptr_equal(base, q);
  assert_int_equal(size, gca_usable_size(a, q));
  gca_free(a, p);
  gca_free(a, q);
  gca_close(a);
}

static void test_backed_memory_is_usable(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:backed=1,capacity=64MiB", NULL);
  unsigned char *p = gca_malloc(a, MiB, 0, 0);
  unsigned char *q = gca_malloc(a, 3 * MiB, 0, 0);
  assert_non_null(p);
  assert_non_null(q);
  memset(p, 0xAB, MiB);
  memset(q, 0xCD, 3 * MiB);
  for (size_t i = 0; i < MiB; i += 4093) assert_int_equal(p[i], 0xAB);
  for (size_t i = 0; i < 3 * MiB; i += 4093) assert_int_equal(q[i], 0xCD);
  gca_free(a, p);
  gca_free(a, q);
  assert_consistent(a);
  gca_close(a);
}

static void test_close_with_live_blocks(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:backed=1,capacity=64MiB,devices=2", NULL);
  for (int i = 0; i < 50; i++) {
    assert_non_null(gca_malloc(a, (size_t)(i + 1) * 4096, i % 2, (gca_stream_t)(i % 3)));
  }
  gca_close(a); /* everything goes back; ASan reports any leak */
  gca_close(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_split_and_merge_small),
      cmocka_unit_test(test_merge_both_neighbours),
      cmocka_unit_test(test_pools_and_segment_sizes),
      cmocka_unit_test(test_large_split_rule),
      cmocka_unit_test(test_best_fit_by_size_then_address),
      cmocka_unit_test(test_blocks_cached_per_stream),
      cmocka_unit_test(test_oversize_rules),
      cmocka_unit_test(test_release_cached_when_full),
      cmocka_unit_test(test_empty_cache_only_whole_free_segments),
      cmocka_unit_test(test_devices_are_separate),
      cmocka_unit_test(test_zero_size_and_usable_size),
      cmocka_unit_test(test_base_allocation),
      cmocka_unit_test(test_backed_memory_is_usable),
      cmocka_unit_test(test_close_with_live_blocks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
