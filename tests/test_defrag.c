/* Expandable segments and stitching (label defrag): the sim's virtual memory
 * and its accounting; PyTorch's rules worked out by hand (2 MiB pages for
 * the small pool, 20 MiB for the large one, reserved = mapped, no `segment`
 * count, the lowest-address fit, best fit by the size a block could grow
 * to); the out-of-memory ladder with pages; stream safety of unmapping
 * (the sim's race detector); stitching; and seeded random sequences under
 * every option combination, checked by the invariant checker (which also
 * proves no physical page is mapped at two places).
 */
#include <inttypes.h>

#include "helpers.h"
#include "core/expandable.h"

#define S1 ((gca_stream_t)0x1000)
#define S2 ((gca_stream_t)0x2000)

/* ---- the sim's virtual memory ------------------------------------------ */

/* The sim's mappings live in a page table of leaves of 4096 pages: with a
 * 4 KiB granularity a leaf spans 16 MiB, so mappings of 6 MiB cross leaves,
 * and the rules must hold across them. */
static void test_sim_mappings_across_leaves(void **state) {
  (void)state;
  const size_t leaf = 16 * MiB;
  gca_allocator_t *a = open_sim("sim:capacity=256MiB,granularity=4KiB", NULL);
  const backend_ops_t *ops = a->backend.ops;
  void *st = a->backend.state;
  uintptr_t va = 0, h[8] = {0};
  assert_int_equal(ops->vm_reserve(st, 0, 96 * MiB, &va), GCA_OK);
  for (int i = 0; i < 8; i++) assert_int_equal(ops->vm_create(st, 0, 6 * MiB, &h[i]), GCA_OK);
  /* Back to back from the first leaf boundary above va: [b, b + 36 MiB). */
  uintptr_t b = (va / leaf + 1) * leaf - 3 * MiB;
  assert_true(b >= va + 4 * MiB && b + 42 * MiB <= va + 96 * MiB);
  for (int i = 0; i < 6; i++) assert_int_equal(ops->vm_map(st, 0, b + (uintptr_t)i * 6 * MiB, 6 * MiB, h[i]), GCA_OK);
  /* Over the mapping that crosses a leaf boundary, from either side of it. */
  assert_int_equal(ops->vm_map(st, 0, b + 2 * MiB, 6 * MiB, h[6]), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "is mapped there");
  assert_int_equal(ops->vm_map(st, 0, b - 4 * MiB, 6 * MiB, h[6]), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_map(st, 0, b + 36 * MiB - 4096, 6 * MiB, h[6]), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_map(st, 0, b + 36 * MiB, 6 * MiB, h[6]), GCA_OK);
  assert_int_equal(sim_counters(a, 0).vm_mapped, 42 * MiB);
  /* Unmaps: not from the middle of a mapping, not past the last one, but a
   * run of whole mappings across leaves in one call. */
  assert_int_equal(ops->vm_unmap(st, 0, b + 3 * MiB, 6 * MiB), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_unmap(st, 0, b + 30 * MiB, 18 * MiB), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_unmap(st, 0, b + 6 * MiB, SIZE_MAX - 4095), GCA_ERR_INVALID); /* wraps around */
  assert_contains(gca_last_error(), "wraps around");
  assert_int_equal(ops->vm_unmap(st, 0, b + 6 * MiB, 18 * MiB), GCA_OK);
  assert_int_equal(sim_counters(a, 0).vm_mapped, 24 * MiB);
  assert_int_equal(ops->vm_destroy(st, 0, h[2]), GCA_OK); /* unmapped: may go */
  assert_int_equal(ops->vm_destroy(st, 0, h[4]), GCA_ERR_INVALID); /* still mapped */
  /* The freed pages take a new mapping; the reservation cannot go while
   * anything is mapped, and the error names a mapping. */
  assert_int_equal(ops->vm_map(st, 0, b + 12 * MiB, 6 * MiB, h[7]), GCA_OK);
  assert_int_equal(ops->vm_unreserve(st, 0, va, 96 * MiB), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "is still mapped");
  assert_int_equal(ops->vm_unmap(st, 0, b, 6 * MiB), GCA_OK);
  assert_int_equal(ops->vm_unmap(st, 0, b + 12 * MiB, 6 * MiB), GCA_OK);
  assert_int_equal(ops->vm_unmap(st, 0, b + 24 * MiB, 18 * MiB), GCA_OK);
  assert_int_equal(sim_counters(a, 0).vm_mapped, 0);
  assert_int_equal(ops->vm_unreserve(st, 0, va, 96 * MiB), GCA_OK);
  for (int i = 0; i < 8; i++)
    if (i != 2) assert_int_equal(ops->vm_destroy(st, 0, h[i]), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  gca_close(a);
}

/* Runs of pages in one call (vm_create_many, vm_map_many,
 * vm_destroy_many): each what the calls one page at a time would do, and
 * a run mapped all or none. */
static void test_sim_runs_of_pages(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=64MiB,granularity=2MiB,fail_at=3", NULL);
  const backend_ops_t *ops = a->backend.ops;
  void *st = a->backend.state;
  uintptr_t h[40] = {0}, va = 0;
  size_t made = 99, refused = 99;
  /* Each page a call: the third fails as fail_at says, two are made. */
  assert_int_equal(ops->vm_create_many(st, 0, 2 * MiB, 4, h, &made), GCA_ERR_OOM);
  assert_int_equal(made, 2);
  assert_contains(gca_last_error(), "injected failure of allocation #3");
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.malloc_calls, 3);
  assert_int_equal(c.vm_handles, 2);
  /* Then the device's capacity: 60 MiB left is 30 pages of 2 MiB. */
  assert_int_equal(ops->vm_create_many(st, 0, 2 * MiB, 38, h + 2, &made), GCA_ERR_OOM);
  assert_int_equal(made, 30);
  assert_contains(gca_last_error(), "out of memory");
  assert_int_equal(sim_counters(a, 0).used, 64 * MiB);
  assert_int_equal(ops->vm_create_many(st, 0, 3 * MiB, 1, h + 32, &made), GCA_ERR_INVALID); /* not a multiple */
  assert_int_equal(made, 0);

  assert_int_equal(ops->vm_reserve(st, 0, 32 * MiB, &va), GCA_OK);
  /* All or none: a handle named twice, a page over a mapping, a run past
   * the reservation's end; nothing is mapped after any, and each handle
   * can be mapped after. */
  assert_int_equal(ops->vm_map(st, 0, va + 12 * MiB, 2 * MiB, h[10]), GCA_OK);
  uintptr_t twice[4] = {h[0], h[1], h[0], h[3]};
  assert_int_equal(ops->vm_map_many(st, 0, va, 2 * MiB, 4, twice), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "is mapped already");
  assert_int_equal(ops->vm_map_many(st, 0, va + 8 * MiB, 2 * MiB, 4, h), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "is mapped there");
  assert_int_equal(ops->vm_map_many(st, 0, va + 26 * MiB, 2 * MiB, 4, h), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "not inside a reserved range");
  uintptr_t stale[2] = {h[0], h[1] + ((uintptr_t)1 << 32)}; /* another generation */
  assert_int_equal(ops->vm_map_many(st, 0, va, 2 * MiB, 2, stale), GCA_ERR_BAD_POINTER);
  c = sim_counters(a, 0);
  assert_int_equal(c.vm_mapped, 2 * MiB);
  assert_int_equal(c.vm_maps, 1);
  assert_int_equal(ops->vm_map_many(st, 0, va, 2 * MiB, 0, h), GCA_OK); /* none: nothing to do */
  assert_int_equal(ops->vm_map_many(st, 0, va, 2 * MiB, 6, h), GCA_OK);
  c = sim_counters(a, 0);
  assert_int_equal(c.vm_mapped, 14 * MiB);
  assert_int_equal(c.vm_maps, 7);
  /* They are six mappings, each whole: unmapped as a run or one by one. */
  assert_int_equal(ops->vm_unmap(st, 0, va + 1 * MiB, 2 * MiB), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_unmap(st, 0, va, 4 * MiB), GCA_OK);
  assert_int_equal(ops->vm_unmap(st, 0, va + 4 * MiB, 2 * MiB), GCA_OK);
  assert_int_equal(ops->vm_unmap(st, 0, va + 6 * MiB, 8 * MiB), GCA_OK); /* and h[10]'s */
  assert_int_equal(sim_counters(a, 0).vm_mapped, 0);

  /* Destroyed each if it can be: a mapped one and a stale one are refused
   * and counted, the others go. */
  assert_int_equal(ops->vm_map(st, 0, va, 2 * MiB, h[1]), GCA_OK);
  uintptr_t some[4] = {h[0], h[1], h[2], h[0]};
  assert_int_equal(ops->vm_destroy_many(st, 0, some, 4, &refused), GCA_ERR_BAD_POINTER);
  assert_int_equal(refused, 2);
  assert_true(some[0] == h[1] && some[1] == h[0]); /* the refused, in order, at the front */
  assert_int_equal(sim_counters(a, 0).vm_handles, 30);
  assert_int_equal(ops->vm_unmap(st, 0, va, 2 * MiB), GCA_OK);
  assert_int_equal(ops->vm_destroy_many(st, 0, h + 1, 1, &refused), GCA_OK);
  assert_int_equal(refused, 0);
  assert_int_equal(ops->vm_destroy_many(st, 0, h + 3, 29, &refused), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_int_equal(ops->vm_unreserve(st, 0, va, 32 * MiB), GCA_OK);
  gca_close(a);
}

/* The sim's physical memory lives in chunks of 1,024 slots, each slot
 * written first when it is handed out: handles across chunks, freed slots
 * taken again (their old handles stale), mappings found from the page
 * table in every chunk, and a size of more pages than a slot counts. */
static void test_sim_physical_table(void **state) {
  (void)state;
  enum { N = 2500 }; /* three chunks */
  gca_allocator_t *a = open_sim("sim:capacity=8GiB,granularity=4KiB", NULL);
  const backend_ops_t *ops = a->backend.ops;
  void *st = a->backend.state;
  static uintptr_t h[N];
  size_t made = 0, refused = 0;
  assert_int_equal(ops->vm_create_many(st, 0, 8192, N, h, &made), GCA_OK);
  assert_int_equal(made, N);
  for (int i = 0; i < N; i++) assert_int_equal(h[i] & 0xffffffffu, (uintptr_t)i + 1); /* slots in order */
  uintptr_t va = 0;
  assert_int_equal(ops->vm_reserve(st, 0, (size_t)N * 8192, &va), GCA_OK);
  assert_int_equal(ops->vm_map_many(st, 0, va, 8192, N, h), GCA_OK);
  /* A page in the third chunk's mapping is found whole: half of it is refused. */
  assert_int_equal(ops->vm_unmap(st, 0, va + 2100 * 8192, 4096), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_unmap(st, 0, va + 1000 * 8192, 100 * 8192), GCA_OK); /* across chunks 0 and 1 */
  assert_int_equal(ops->vm_destroy_many(st, 0, h + 1000, 100, &refused), GCA_OK);
  assert_int_equal(sim_counters(a, 0).vm_handles, N - 100);
  /* The freed slots are taken again, the last freed first, in a new generation. */
  uintptr_t again[100];
  assert_int_equal(ops->vm_create_many(st, 0, 16384, 100, again, &made), GCA_OK);
  for (int i = 0; i < 100; i++) {
    assert_int_equal(again[i] & 0xffffffffu, (uintptr_t)(1100 - i));
    assert_int_equal(again[i] >> 32, 1);
  }
  uintptr_t one = 0;
  assert_int_equal(ops->vm_create(st, 0, 8192, &one), GCA_OK);
  assert_int_equal(one & 0xffffffffu, (uintptr_t)N + 1); /* then the slots never used */
  /* The old handles are stale; the new ones map with their own size. */
  assert_int_equal(ops->vm_map(st, 0, va + 1000 * 8192, 8192, h[1099]), GCA_ERR_BAD_POINTER);
  assert_int_equal(ops->vm_map(st, 0, va + 1000 * 8192, 8192, again[0]), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "cover its whole physical memory (16384 bytes)");
  assert_int_equal(ops->vm_map_many(st, 0, va + 1000 * 8192, 16384, 50, again), GCA_OK);
  assert_int_equal(ops->vm_map(st, 0, va + 1010 * 8192, 8192, one), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "(+16384) is mapped there");
  /* A handle past every slot handed out, and one of slot 0, are nobody's. */
  assert_int_equal(ops->vm_destroy(st, 0, (uintptr_t)N + 2), GCA_ERR_BAD_POINTER);
  assert_int_equal(ops->vm_destroy(st, 0, (uintptr_t)1 << 32), GCA_ERR_BAD_POINTER);
  assert_int_equal(ops->vm_destroy(st, 0, h[5]), GCA_ERR_INVALID); /* still mapped */
  assert_contains(gca_last_error(), "still mapped");
  /* 2^32 pages of 4 KiB do not fit a slot's count: refused by name. */
  assert_int_equal(ops->vm_create_many(st, 0, (size_t)1 << 44, 1, &one, &made), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "more than 2^32 - 1 pages");
  gca_close(a); /* (the sim gives back what is still made and mapped) */
}

static void test_sim_virtual_memory(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=64MiB,granularity=2MiB", NULL);
  const backend_ops_t *ops = a->backend.ops;
  void *st = a->backend.state;
  size_t g = 0;
  assert_int_equal(ops->vm_granularity(st, 0, &g), GCA_OK);
  assert_int_equal(g, 2 * MiB);
  uintptr_t va = 0, h1 = 0, h2 = 0, h3 = 0;
  assert_int_equal(ops->vm_reserve(st, 0, 16 * MiB, &va), GCA_OK);
  assert_int_equal(va % (2 * MiB), 0);
  assert_int_equal(ops->vm_reserve(st, 0, 3 * MiB, &h3), GCA_ERR_INVALID); /* not a multiple */
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.vm_reserved, 16 * MiB);
  assert_int_equal(c.used, 0); /* addresses cost no memory */
  assert_int_equal(ops->vm_create(st, 0, 4 * MiB, &h1), GCA_OK);
  assert_int_equal(ops->vm_create(st, 0, 2 * MiB, &h2), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 6 * MiB);
  /* Physical memory counts against capacity. */
  assert_int_equal(ops->vm_create(st, 0, 60 * MiB, &h3), GCA_ERR_OOM);
  assert_int_equal(ops->vm_map(st, 0, va, 4 * MiB, h1), GCA_OK);
  /* Refused: mapped twice, over a mapping, outside the reservation, unaligned, partial. */
  assert_int_equal(ops->vm_map(st, 0, va + 8 * MiB, 4 * MiB, h1), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_map(st, 0, va + 2 * MiB, 2 * MiB, h2), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_map(st, 0, va + 16 * MiB, 2 * MiB, h2), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_map(st, 0, va + 5 * MiB, 2 * MiB, h2), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_map(st, 0, va + 6 * MiB, 1 * MiB, h2), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_map(st, 0, va + 6 * MiB, 2 * MiB, h2), GCA_OK);
  c = sim_counters(a, 0);
  assert_int_equal(c.vm_mapped, 6 * MiB);
  assert_int_equal(c.vm_handles, 2);
  /* Cannot destroy mapped memory, nor give back a range with mappings. */
  assert_int_equal(ops->vm_destroy(st, 0, h1), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_unreserve(st, 0, va, 16 * MiB), GCA_ERR_INVALID);
  /* An unmap covers whole mappings, no holes. */
  assert_int_equal(ops->vm_unmap(st, 0, va, 2 * MiB), GCA_ERR_INVALID);
  assert_int_equal(ops->vm_unmap(st, 0, va, 8 * MiB), GCA_ERR_INVALID); /* a hole at [4, 6) MiB */
  assert_int_equal(ops->vm_unmap(st, 0, va, 4 * MiB), GCA_OK);
  assert_int_equal(ops->vm_unmap(st, 0, va + 6 * MiB, 2 * MiB), GCA_OK);
  assert_int_equal(sim_counters(a, 0).vm_mapped, 0);
  /* Unmapping memory that queued work uses is a hazard. */
  assert_int_equal(ops->vm_map(st, 0, va + 10 * MiB, 4 * MiB, h1), GCA_OK);
  assert_int_equal(gca__sim_launch(&a->backend, 0, S1, 1000, va + 10 * MiB, 4096), GCA_OK);
  assert_int_equal(ops->vm_unmap(st, 0, va + 10 * MiB, 4 * MiB), GCA_ERR_CORRUPT);
  assert_int_equal(sim_counters(a, 0).hazards, 1);
  assert_int_equal(ops->vm_destroy(st, 0, h1), GCA_OK);
  assert_int_equal(ops->vm_destroy(st, 0, h2), GCA_OK);
  assert_int_equal(ops->vm_destroy(st, 0, h2), GCA_ERR_BAD_POINTER); /* stale handle */
  assert_int_equal(ops->vm_unreserve(st, 0, va, 16 * MiB), GCA_OK);
  c = sim_counters(a, 0);
  assert_int_equal(c.used, 0);
  assert_int_equal(c.vm_reserved, 0);
  assert_int_equal(c.live, 0);
  gca_close(a);
  /* Fault injection reaches physical memory: it is an allocation. */
  a = open_sim("sim:fail_at=1", NULL);
  assert_int_equal(a->backend.ops->vm_create(a->backend.state, 0, 2 * MiB, &h1), GCA_ERR_OOM);
  gca_close(a);
  /* A device without it (vm=0): expandable segments fall back to ordinary ones. */
  a = open_sim("sim:vm=0,capacity=64MiB", "expandable_segments:True");
  void *p = gca_malloc(a, 1000, 0, 0);
  assert_non_null(p);
  assert_int_equal(stats_of(a, 0).segment[GCA_POOL_ALL].current, 1);
  assert_consistent(a);
  assert_int_equal(gca_free(a, p), GCA_OK);
  gca_close(a);
}

/* ---- PyTorch's rules ----------------------------------------------------- */

static void test_pages_and_statistics(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=8GiB", "expandable_segments:True");
  /* A small request maps one 2 MiB page of the small pool's segment. */
  void *s1 = gca_malloc(a, 1000, 0, S1);
  assert_non_null(s1);
  gca_stats_t st = stats_of(a, 0);
  assert_int_equal(st.reserved_bytes[GCA_POOL_SMALL].current, 2 * MiB);
  assert_int_equal(st.segment[GCA_POOL_ALL].current, 0); /* PyTorch counts no segment for mappings */
  assert_int_equal(st.num_device_alloc, 1);
  assert_int_equal(st.inactive_split[GCA_POOL_ALL].current, 0); /* expandable blocks are never "split" */
  /* 25 MiB maps two 20 MiB pages; 10 MiB then fits in the 15 MiB left. */
  void *l1 = gca_malloc(a, 25 * MiB, 0, S1);
  void *l2 = gca_malloc(a, 10 * MiB, 0, S1);
  assert_non_null(l1);
  assert_non_null(l2);
  assert_int_equal((uintptr_t)l2, (uintptr_t)l1 + 25 * MiB); /* tiled in one range */
  st = stats_of(a, 0);
  assert_int_equal(st.reserved_bytes[GCA_POOL_LARGE].current, 40 * MiB);
  assert_int_equal(st.num_device_alloc, 2);
  /* 6 MiB more: 5 MiB are free at the end of the mapping; one more page. */
  void *l3 = gca_malloc(a, 6 * MiB, 0, S1);
  assert_int_equal((uintptr_t)l3, (uintptr_t)l2 + 10 * MiB);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 60 * MiB);
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.vm_mapped, 62 * MiB);
  assert_int_equal(c.vm_handles, 4);
  /* Two ranges of 1.125 x 8 GiB in whole pages: 4608 x 2 MiB and 461 x 20 MiB. */
  assert_int_equal(c.vm_reserved, (9216 + 9220) * MiB);
  assert_consistent(a);
  /* Frees keep the pages (a cache); empty_cache unmaps every whole free page. */
  assert_int_equal(gca_free(a, l2), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 60 * MiB);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  /* l2 covered [25, 35) MiB: no whole 20 MiB page is free; nothing goes. */
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 60 * MiB);
  assert_int_equal(gca_free(a, l3), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  /* Free from 25 MiB on: the page [40, 60) goes; [20, 40) holds l1's tail. */
  st = stats_of(a, 0);
  assert_int_equal(st.reserved_bytes[GCA_POOL_LARGE].current, 40 * MiB);
  assert_int_equal(st.num_device_free, 1);
  assert_consistent(a);
  assert_int_equal(gca_free(a, l1), GCA_OK);
  assert_int_equal(gca_free(a, s1), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  st = stats_of(a, 0);
  assert_int_equal(st.reserved_bytes[GCA_POOL_ALL].current, 0);
  c = sim_counters(a, 0);
  assert_int_equal(c.vm_reserved, 0); /* empty segments give their range back */
  assert_int_equal(c.vm_handles, 0);
  assert_int_equal(c.used, 0);
  assert_consistent(a);
  gca_close(a);
}

/* Splitting follows the setting: a large block splits off any rest of at least 512 bytes. */
static void test_split_rule(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=8GiB", "expandable_segments:True");
  void *x = gca_malloc(a, 19 * MiB + 512, 0, S1);
  void *y = gca_malloc(a, 2 * MiB, 0, S1);
  assert_int_equal((uintptr_t)y, (uintptr_t)x + 19 * MiB + 512);
  assert_int_equal(gca_usable_size(a, x), 19 * MiB + 512);
  assert_consistent(a);
  gca_close(a);
}

/* A miss maps at the lowest address with room; best fit prefers a block
 * that cannot grow over one next to unmapped space. */
static void test_lowest_address_and_best_fit(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=8GiB", "expandable_segments:True");
  void *p[6];
  for (int i = 0; i < 6; i++) assert_non_null(p[i] = gca_malloc(a, 20 * MiB, 0, S1));
  uintptr_t base = (uintptr_t)p[0];
  /* Free pages 1 and 2 and unmap them: a hole at [20, 60) MiB. */
  assert_int_equal(gca_free(a, p[1]), GCA_OK);
  assert_int_equal(gca_free(a, p[2]), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 80 * MiB);
  /* 30 MiB: the hole is the lowest address with room (not the end). */
  void *q = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal((uintptr_t)q, base + 20 * MiB);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 120 * MiB);
  /* 6 MiB: the smallest free block that fits is [50, 60) (10 MiB). */
  void *r = gca_malloc(a, 6 * MiB, 0, S1);
  assert_int_equal((uintptr_t)r, base + 50 * MiB);
  /* 12 MiB: after freeing the last one, only [100, 120) fits; it leaves
   * 8 MiB at [112, 120), right before unmapped space. */
  assert_int_equal(gca_free(a, p[5]), GCA_OK);
  void *t = gca_malloc(a, 12 * MiB, 0, S1);
  assert_int_equal((uintptr_t)t, base + 100 * MiB);
  /* Free q: [20, 50) is 30 MiB, walled in. A 5 MiB request: plain best fit
   * takes the 8 MiB block at 112; PyTorch's walk counts that one as 8 MiB
   * plus the unmapped space after it, and takes the walled 30 MiB one. */
  assert_int_equal(gca_free(a, q), GCA_OK);
  void *u = gca_malloc(a, 5 * MiB, 0, S1);
  assert_int_equal((uintptr_t)u, base + 20 * MiB);
  assert_consistent(a);
  gca_close(a);
}

/* ---- out of memory ------------------------------------------------------- */

static void test_oom_ladder_with_pages(void **state) {
  (void)state;
  /* 100 MiB device: five 20 MiB pages. Fill them, free two that are not
   * neighbours (a hole the next request cannot use as it is), then ask for
   * 40 MiB: the device is full, the ladder releases the cache (unmapping
   * the two free pages), and the retry maps two pages at the lowest room. */
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", "expandable_segments:True");
  void *p[5];
  for (int i = 0; i < 5; i++) assert_non_null(p[i] = gca_malloc(a, 20 * MiB, 0, S1));
  assert_int_equal(gca_free(a, p[1]), GCA_OK);
  assert_int_equal(gca_free(a, p[3]), GCA_OK);
  void *big = gca_malloc(a, 40 * MiB, 0, S1);
  assert_non_null(big);
  gca_stats_t st = stats_of(a, 0);
  assert_int_equal(st.num_alloc_retries, 1);
  assert_int_equal(st.num_ooms, 0);
  assert_int_equal(st.reserved_bytes[GCA_POOL_ALL].current, 100 * MiB);
  assert_consistent(a);
  /* Nothing left to release: the next one fails with PyTorch's message. */
  assert_null(gca_malloc(a, 20 * MiB, 0, S1));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "out of memory");
  assert_int_equal(stats_of(a, 0).num_ooms, 1);
  assert_consistent(a);
  gca_close(a);

  /* With stitching the same request moves the two free blocks' pages
   * (2 MiB pages with stitching: 20 of them): no retry, no cache released,
   * nothing new asked of the device. */
  a = open_sim("sim:capacity=100MiB", "expandable_segments:True,stitching:True");
  for (int i = 0; i < 5; i++) assert_non_null(p[i] = gca_malloc(a, 20 * MiB, 0, S1));
  assert_int_equal(gca_free(a, p[1]), GCA_OK);
  assert_int_equal(gca_free(a, p[3]), GCA_OK);
  uint64_t mallocs = sim_counters(a, 0).mallocs;
  big = gca_malloc(a, 40 * MiB, 0, S1);
  assert_non_null(big);
  st = stats_of(a, 0);
  assert_int_equal(st.num_alloc_retries, 0);
  assert_int_equal(st.num_sync_all_streams, 0);
  assert_int_equal(st.num_pages_moved, 20);
  assert_int_equal(st.num_stitch_waits, 1); /* one wait for the stream covers both donors */
  assert_int_equal(sim_counters(a, 0).mallocs, mallocs);
  assert_int_equal(st.reserved_bytes[GCA_POOL_ALL].current, 100 * MiB);
  assert_consistent(a);
  gca_close(a);
}

/* The per-process fraction counts mapped bytes: only the pages a request adds. */
static void test_fraction_counts_new_pages(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1000MiB", "expandable_segments:True,per_process_memory_fraction:0.1");
  /* 100 MiB allowed: five pages. 90 MiB maps five; 8 MiB more fits in them. */
  void *x = gca_malloc(a, 90 * MiB, 0, S1);
  assert_non_null(x);
  void *y = gca_malloc(a, 8 * MiB, 0, S1);
  assert_non_null(y);
  assert_null(gca_malloc(a, 3 * MiB, 0, S1)); /* would need a sixth page */
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 100 * MiB);
  assert_consistent(a);
  gca_close(a);
}

/* ---- streams ------------------------------------------------------------- */

/* Unmapping waits for the segment's stream: pages freed to the cache while
 * work still uses them are not unmapped under it (empty_cache, stitching). */
static void test_unmap_waits_for_stream(void **state) {
  (void)state;
  static const char *const confs[] = {"expandable_segments:True", "expandable_segments:True,stitching:True"};
  for (int k = 0; k < 2; k++) {
    gca_allocator_t *a = open_sim("sim:capacity=100MiB", confs[k]);
    void *p[5];
    for (int i = 0; i < 5; i++) assert_non_null(p[i] = gca_malloc(a, 20 * MiB, 0, S1));
    assert_int_equal(gca__sim_launch(&a->backend, 0, S1, 5000, (uintptr_t)p[1], 20 * MiB), GCA_OK);
    assert_int_equal(gca__sim_launch(&a->backend, 0, S1, 5000, (uintptr_t)p[3], 20 * MiB), GCA_OK);
    /* Freed on their own stream: back in the cache at once, work pending. */
    assert_int_equal(gca_free(a, p[1]), GCA_OK);
    assert_int_equal(gca_free(a, p[3]), GCA_OK);
    uint64_t waits = sim_counters(a, 0).host_waits;
    void *big = gca_malloc(a, 40 * MiB, 0, S1); /* moves or releases the two pages */
    assert_non_null(big);
    sim_counters_t c = sim_counters(a, 0);
    assert_int_equal(c.hazards, 0);
    assert_true(c.host_waits > waits);
    assert_true(gca__sim_now(&a->backend) >= 10000); /* the host waited for the work */
    assert_consistent(a);
    gca_close(a);
  }
}

/* Each stream has its own segment; a record_stream'd block keeps its pages. */
static void test_streams_have_own_segments(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=8GiB", "expandable_segments:True");
  void *x = gca_malloc(a, 4 * MiB, 0, S1);
  void *y = gca_malloc(a, 4 * MiB, 0, S2);
  assert_true((uintptr_t)y - (uintptr_t)x >= 9 * 1024 * MiB || (uintptr_t)x - (uintptr_t)y >= 9 * 1024 * MiB);
  assert_int_equal(gca_record_stream(a, x, S2), GCA_OK);
  assert_int_equal(gca__sim_launch(&a->backend, 0, S2, 1000, (uintptr_t)x, 4 * MiB), GCA_OK);
  assert_int_equal(gca_free(a, x), GCA_OK); /* pending: an event on S2 */
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK); /* waits for it, then unmaps */
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.hazards, 0);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 20 * MiB); /* y's page */
  assert_consistent(a);
  assert_int_equal(gca_free(a, y), GCA_OK);
  gca_close(a);
}

/* ---- history and snapshots ---------------------------------------------- */

static void test_history_and_snapshot(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=8GiB", "expandable_segments:True");
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_STATE, 1000), GCA_OK);
  void *p[3];
  for (int i = 0; i < 3; i++) assert_non_null(p[i] = gca_malloc(a, 20 * MiB, 0, S1));
  assert_int_equal(gca_free(a, p[1]), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  gca_snapshot_t *sn = NULL;
  assert_int_equal(gca_snapshot_take(a, &sn), GCA_OK);
  /* Two mapped runs with a hole between: two segments, as PyTorch reports them. */
  assert_int_equal(sn->segment_count, 2);
  assert_int_equal(sn->segments[0].total_size, 20 * MiB);
  assert_int_equal(sn->segments[1].total_size, 20 * MiB);
  assert_true(sn->segments[0].is_expandable && sn->segments[1].is_expandable);
  size_t maps = 0, unmaps = 0;
  for (size_t i = 0; i < sn->trace_counts[0]; i++) {
    maps += sn->device_traces[0][i].action == GCA_TRACE_SEGMENT_MAP;
    unmaps += sn->device_traces[0][i].action == GCA_TRACE_SEGMENT_UNMAP;
  }
  assert_int_equal(maps, 3);
  assert_int_equal(unmaps, 1);
  gca_snapshot_free(sn);
  for (int i = 0; i < 3; i += 2) assert_int_equal(gca_free(a, p[i]), GCA_OK);
  gca_close(a);
}

/* ---- the page census (what the replay report shows) --------------------- */

/* The census's counts kept up to date (what the replay takes at each new
 * peak) are the walk's, field by field. */
static void assert_counts_match(gca_allocator_t *a, const page_census_t *walked) {
  page_census_t kept;
  gca__expandable_census_counts(&a->devices[0], &kept);
  assert_null(kept.maps);
  assert_census_counts_equal(&kept, walked);
}

static page_census_t census_of(gca_allocator_t *a) {
  page_census_t c;
  assert_int_equal(gca__expandable_census(&a->devices[0], true, &c), GCA_OK);
  assert_counts_match(a, &c);
  return c;
}

static void test_page_census(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=8GiB", "expandable_segments:True");
  /* 30 MiB maps pages 0-1 of the large range; 50 MiB goes on at 30 MiB and
   * maps pages 2-3; 20 MiB takes page 4. */
  void *pa = gca_malloc(a, 30 * MiB, 0, S1), *pb = gca_malloc(a, 50 * MiB, 0, S1), *pc = gca_malloc(a, 20 * MiB, 0, S1);
  assert_non_null(pa);
  assert_int_equal((uintptr_t)pb, (uintptr_t)pa + 30 * MiB);
  assert_int_equal((uintptr_t)pc, (uintptr_t)pa + 80 * MiB);
  /* Freeing the middle and releasing the cache unmaps its whole pages, 2
   * and 3: [40, 80) MiB; [30, 40) shares page 1 with the first block. */
  assert_int_equal(gca_free(a, pb), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  page_census_t c = census_of(a);
  assert_int_equal(c.ranges, 1);
  assert_int_equal(c.reserved_bytes, 461 * 20 * MiB); /* 1.125 x 8 GiB in 20 MiB pages */
  assert_int_equal(c.mapped_pages, 3);
  assert_int_equal(c.mapped_bytes, 60 * MiB);
  assert_int_equal(c.mapped_bytes, (uint64_t)stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current);
  assert_int_equal(c.unmapped_pages, 2);
  assert_int_equal(c.unmapped_bytes, 40 * MiB);
  assert_int_equal(c.free_pages, 0);
  const page_range_t *r = &c.maps[0];
  assert_int_equal(r->addr, (uintptr_t)pa);
  assert_int_equal(r->extent, 100 * MiB);
  assert_int_equal(r->page_size, 20 * MiB);
  assert_int_equal(r->pool, GCA_POOL_LARGE);
  assert_true(r->stream == S1);
  const page_run_t want[] = {{30 * MiB, GCA_BLOCK_ACTIVE_ALLOCATED}, {10 * MiB, GCA_BLOCK_INACTIVE},
                             {40 * MiB, PAGE_RUN_UNMAPPED}, {20 * MiB, GCA_BLOCK_ACTIVE_ALLOCATED}};
  assert_int_equal(r->run_count, 4);
  for (size_t i = 0; i < 4; i++) {
    assert_int_equal(r->runs[i].size, want[i].size);
    assert_int_equal(r->runs[i].state, want[i].state);
  }
  gca__page_census_free(&c);
  assert_int_equal(a->devices[0].vm.pages_mapped, 5);
  assert_int_equal(a->devices[0].vm.pages_unmapped, 2);
  /* Freeing the first block leaves pages 0 and 1 mapped and wholly free:
   * what the next empty_cache gives back. The map ends at page 4 still. */
  assert_int_equal(gca_free(a, pa), GCA_OK);
  c = census_of(a);
  assert_int_equal(c.free_pages, 2);
  assert_int_equal(c.free_bytes, 40 * MiB);
  assert_int_equal(c.maps[0].run_count, 3);
  assert_int_equal(c.maps[0].runs[0].size, 40 * MiB);
  gca__page_census_free(&c);
  /* Without maps: the same counts, no runs. */
  assert_int_equal(gca__expandable_census(&a->devices[0], false, &c), GCA_OK);
  assert_null(c.maps);
  assert_int_equal(c.mapped_pages, 3);
  assert_int_equal(c.unmapped_pages, 2);
  gca__page_census_free(&c);
  /* Everything released: the range is given back, nothing to count. */
  assert_int_equal(gca_free(a, pc), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  c = census_of(a);
  assert_int_equal(c.ranges, 0);
  assert_int_equal(c.mapped_pages + c.unmapped_pages, 0);
  gca__page_census_free(&c);
  assert_int_equal(a->devices[0].vm.pages_unmapped, 5);
  assert_consistent(a);
  gca_close(a);
}

/* ---- random sequences under every option combination ------------------- */

#define SLOTS 96
#define STREAMS 3

static uint64_t rng;
static uint64_t below(uint64_t n) { return next_random(&rng) % n; }

typedef struct slot {
  void *ptr;
  size_t usable;
  gca_stream_t streams[STREAMS]; /* [0] allocated on, then those recorded */
  int stream_count;
} slot_t;

static size_t random_size(void) {
  switch (below(4)) {
    case 0: return 1 + below(64 * KiB);
    case 1: return 256 * KiB + below(768 * KiB);
    case 2: return 1 * MiB + below(19 * MiB);
    default: return 20 * MiB + below(100 * MiB);
  }
}

static void launch(gca_allocator_t *a, gca_stream_t s, const slot_t *sl) {
  int rc = gca__sim_launch(&a->backend, 0, s, below(3000), (uintptr_t)sl->ptr, sl->usable);
  if (rc) fprintf(stderr, "%s\n", gca_last_error());
  assert_int_equal(rc, GCA_OK);
}

/* The page census agrees with the sim's books and with itself: each range's
 * runs tile its extent, the extent is its mapped and unmapped pages. */
static void assert_census_agrees(gca_allocator_t *a) {
  page_census_t c = census_of(a);
  assert_int_equal(c.mapped_bytes, sim_counters(a, 0).vm_mapped);
  assert_int_equal(c.mapped_pages, a->devices[0].vm.pages_mapped - a->devices[0].vm.pages_unmapped);
  for (size_t i = 0; i < c.ranges; i++) {
    const page_range_t *r = &c.maps[i];
    uint64_t runs = 0, holes = 0;
    for (size_t k = 0; k < r->run_count; k++) {
      runs += r->runs[k].size;
      if (r->runs[k].state == PAGE_RUN_UNMAPPED) holes += r->runs[k].size;
    }
    assert_int_equal(runs, r->extent);
    assert_int_equal(holes, r->unmapped_pages * r->page_size);
    assert_int_equal(r->extent, (r->mapped_pages + r->unmapped_pages) * r->page_size);
    assert_true(r->free_pages <= r->mapped_pages);
  }
  gca__page_census_free(&c);
}

static void run(const char *conf, uint64_t seed, int ops) {
  rng = seed;
  gca_allocator_t *a = open_sim("sim:capacity=2GiB", conf);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_STATE, 4096), GCA_OK);
  slot_t slots[SLOTS];
  memset(slots, 0, sizeof slots);
  int ooms = 0, mallocs = 0;
  for (int op = 0; op < ops; op++) {
    slot_t *sl = &slots[below(SLOTS)];
    uint64_t r = below(100);
    if (r < 45) {
      if (sl->ptr) continue;
      gca_stream_t s = (gca_stream_t)(0x1000 * (below(STREAMS) + 1));
      sl->ptr = gca_malloc(a, random_size(), 0, s);
      if (!sl->ptr) {
        assert_int_equal(gca_last_status(), GCA_ERR_OOM);
        ooms++;
        continue;
      }
      mallocs++;
      sl->usable = gca_usable_size(a, sl->ptr);
      sl->streams[0] = s;
      sl->stream_count = 1;
      launch(a, s, sl);
    } else if (r < 52) {
      if (!sl->ptr || sl->stream_count == STREAMS) continue;
      gca_stream_t s = (gca_stream_t)(0x1000 * (below(STREAMS) + 1));
      /* The new stream uses the memory after every stream that did. */
      for (int i = 0; i < sl->stream_count; i++) assert_int_equal(order_streams(&a->backend, sl->streams[i], s), GCA_OK);
      assert_int_equal(gca_record_stream(a, sl->ptr, s), GCA_OK);
      sl->streams[sl->stream_count++] = s;
      launch(a, s, sl);
    } else if (r < 88) {
      if (!sl->ptr) continue;
      assert_int_equal(gca_free(a, sl->ptr), GCA_OK);
      sl->ptr = NULL;
    } else if (r < 97) {
      gca__sim_advance(&a->backend, below(4000));
    } else if (r < 99) {
      assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
    } else {
      /* Turned off and on while blocks live in expandable segments. */
      assert_int_equal(gca_set_config(a, below(2) ? "expandable_segments:False" : "expandable_segments:True"),
                       GCA_OK);
    }
    if (op % 64 == 0) {
      assert_consistent(a);
      assert_census_agrees(a);
    }
  }
  assert_consistent(a);
  for (int i = 0; i < SLOTS; i++)
    if (slots[i].ptr) assert_int_equal(gca_free(a, slots[i].ptr), GCA_OK);
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  gca_stats_t s = stats_of(a, 0);
  sim_counters_t c = sim_counters(a, 0);
  printf("%-88s %d mallocs, %d OOMs, %" PRId64 " retries, %" PRId64 " pages moved, %" PRIu64 " maps\n", conf, mallocs,
         ooms, s.num_alloc_retries, s.num_pages_moved, c.vm_maps);
  assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(c.hazards, 0);
  assert_int_equal(c.live, 0);
  assert_int_equal(c.vm_mapped, 0);
  assert_int_equal(c.vm_reserved, 0);
  /* The workload reaches what it is meant to test. */
  assert_true(c.vm_maps > 100 && c.vm_unmaps > 10);
  assert_true(ooms > 0 || s.num_alloc_retries > 0);
  if (strstr(conf, "stitching")) assert_true(s.num_pages_moved > 0);
  assert_consistent(a);
  gca_close(a);
}

/* One job of `ops` allocations and frees on one stream, with no memory
 * limit: its peak reserved. Kind 0: mostly 1-200 MiB with small ones;
 * kind 1: half under 64 KiB, half 1-31 MiB (both pools in play). */
static int64_t job_peak(const char *conf, uint64_t seed, int kind, int ops) {
  rng = seed;
  gca_allocator_t *a = open_sim("sim:capacity=1TiB", conf);
  void *live[256] = {0};
  for (int op = 0; op < ops; op++) {
    void **p = &live[below(256)];
    if (*p) {
      assert_int_equal(gca_free(a, *p), GCA_OK);
      *p = NULL;
      continue;
    }
    bool small = kind == 0 ? below(4) == 0 : below(2) == 0;
    size_t size = kind == 0 ? (small ? 1 + below(MiB) : MiB + below(200 * MiB))
                            : (small ? 1 + below(64 * KiB) : MiB + below(30 * MiB));
    assert_non_null(*p = gca_malloc(a, size, 0, S1));
  }
  int64_t peak = stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].peak;
  assert_consistent(a);
  gca_close(a);
  return peak;
}

/* Stitching never reserves more than expandable segments alone: on 1,000
 * random jobs (two kinds, 500 seeds each) its peak is at most the other's,
 * and lower in most. */
static void test_stitching_never_above_expandable(void **state) {
  (void)state;
  int lower = 0, jobs = 0;
  double saved = 0;
  for (int kind = 0; kind < 2; kind++)
    for (uint64_t seed = 1; seed <= 500; seed++) {
      int64_t alone = job_peak("expandable_segments:True", seed, kind, 1500);
      int64_t stitched = job_peak("expandable_segments:True,stitching:True", seed, kind, 1500);
      if (stitched > alone)
        fail_msg("kind %d seed %" PRIu64 ": stitching reserves %" PRId64 " MiB at its peak, expandable segments "
                 "alone %" PRId64, kind, seed, stitched / (int64_t)MiB, alone / (int64_t)MiB);
      lower += stitched < alone;
      saved += 1.0 - (double)stitched / (double)alone;
      jobs++;
    }
  printf("%d jobs: stitching lower in %d, by %.2f%% on average, never higher\n", jobs, lower, 100 * saved / jobs);
  assert_true(lower > jobs / 2); /* (a stitching that changed nothing would pass the rest) */
}

static void test_random_every_option(void **state) {
  (void)state;
  static const char *const extras[] = {
      "",
      "max_split_size_mb:64",
      "roundup_power2_divisions:4",
      "per_process_memory_fraction:0.8,garbage_collection_threshold:0.6",
      "cross_stream_reuse:True",
      ("max_split_size_mb:40,roundup_power2_divisions:[256:1,512:2,>:8],cross_stream_reuse:True,"
       "per_process_memory_fraction:0.9,garbage_collection_threshold:0.7"),
  };
  /* Each combination with and without stitching on the same sequence (one
   * seed for both), so that their out-of-memory counts compare. */
  for (size_t i = 0; i < sizeof extras / sizeof extras[0]; i++) {
    uint64_t seed = 700 + i;
    for (int stitch = 0; stitch < 2; stitch++) {
      char conf[512];
      snprintf(conf, sizeof conf, "expandable_segments:True%s%s%s", stitch ? ",stitching:True" : "",
               *extras[i] ? "," : "", extras[i]);
      run(conf, seed, 100000);
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sim_virtual_memory),
      cmocka_unit_test(test_sim_mappings_across_leaves),
      cmocka_unit_test(test_sim_runs_of_pages),
      cmocka_unit_test(test_sim_physical_table),
      cmocka_unit_test(test_pages_and_statistics),
      cmocka_unit_test(test_split_rule),
      cmocka_unit_test(test_lowest_address_and_best_fit),
      cmocka_unit_test(test_oom_ladder_with_pages),
      cmocka_unit_test(test_fraction_counts_new_pages),
      cmocka_unit_test(test_unmap_waits_for_stream),
      cmocka_unit_test(test_streams_have_own_segments),
      cmocka_unit_test(test_history_and_snapshot),
      cmocka_unit_test(test_page_census),
      cmocka_unit_test(test_random_every_option),
      cmocka_unit_test(test_stitching_never_above_expandable),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
