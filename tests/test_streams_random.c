/* Randomized stream workloads (label `streams`), seeded: allocations on
 * several streams, uses recorded on other streams, frees, time advancing,
 * event processing, synchronize and empty_cache, on a device small enough
 * to run the out-of-memory path, with cross-stream reuse off and on.
 *
 * Every allocation is used at once on its stream, and every recorded use is
 * launched on its stream, through the sim, which fails the launch if the
 * memory is still used by work not ordered before it: so a block handed out
 * too early, or a device free under queued work, fails the test. The
 * invariant checker runs every 128 operations; the allocated bytes are
 * compared with a model at every step.
 */
#include <inttypes.h>

#include "helpers.h"

#define STREAMS 4
#define SLOTS 256
#define MAX_USES 4

typedef struct slot {
  char *ptr;
  size_t size;
  size_t usable;
  gca_stream_t streams[MAX_USES]; /* [0]: allocated on; then recorded uses */
  int stream_count;
} slot_t;

static uint64_t rng;
static uint64_t below(uint64_t n) { return next_random(&rng) % n; }

static gca_stream_t stream_at(uint64_t i) { return (gca_stream_t)(0x1000 * (i + 1)); }

static size_t random_size(void) {
  switch (below(4)) {
    case 0: return 1 + below(64 * KiB);         /* small pool */
    case 1: return 512 * KiB + below(512 * KiB); /* small pool, near its top */
    case 2: return 1 * MiB + below(9 * MiB);    /* 20 MiB segments, split */
    default: return 10 * MiB + below(90 * MiB); /* own segments */
  }
}

static void launch(gca_allocator_t *a, gca_stream_t s, const slot_t *sl, uint64_t ns) {
  int rc = gca__sim_launch(&a->backend, 0, s, ns, (uintptr_t)sl->ptr, sl->size);
  if (rc) fprintf(stderr, "%s\n", gca_last_error());
  assert_int_equal(rc, GCA_OK);
}

static void run(const char *conf, uint64_t seed, int ops) {
  rng = seed;
  gca_allocator_t *a = open_sim("sim:capacity=3GiB", conf);
  slot_t slots[SLOTS];
  memset(slots, 0, sizeof slots);
  int64_t model_allocated = 0;
  int ooms = 0, mallocs = 0, recorded = 0;

  for (int op = 0; op < ops; op++) {
    slot_t *sl = &slots[below(SLOTS)];
    uint64_t r = below(100);
    if (r < 40) {
      if (sl->ptr) continue;
      gca_stream_t s = stream_at(below(STREAMS));
      size_t size = random_size();
      sl->ptr = gca_malloc(a, size, 0, s);
      if (!sl->ptr) {
        assert_int_equal(gca_last_status(), GCA_ERR_OOM);
        ooms++;
        continue;
      }
      mallocs++;
      sl->size = size;
      sl->usable = gca_usable_size(a, sl->ptr);
      sl->streams[0] = s;
      sl->stream_count = 1;
      model_allocated += (int64_t)sl->usable;
      launch(a, s, sl, below(2000));
    } else if (r < 55) {
      if (!sl->ptr || sl->stream_count == MAX_USES) continue;
      gca_stream_t s = stream_at(below(STREAMS));
      /* The new stream uses the memory after every stream that did. */
      for (int i = 0; i < sl->stream_count; i++)
        assert_int_equal(order_streams(&a->backend, sl->streams[i], s), GCA_OK);
      assert_int_equal(gca_record_stream(a, sl->ptr, s), GCA_OK);
      sl->streams[sl->stream_count++] = s;
      recorded++;
      launch(a, s, sl, below(4000));
    } else if (r < 85) {
      if (!sl->ptr) continue;
      assert_int_equal(gca_free(a, sl->ptr), GCA_OK);
      model_allocated -= (int64_t)sl->usable;
      sl->ptr = NULL;
    } else if (r < 96) {
      gca__sim_advance(&a->backend, below(3000));
    } else if (r < 98) {
      assert_int_equal(gca_process_events(a, 0), GCA_OK);
    } else if (r < 99) {
      assert_int_equal(gca_synchronize(a, 0), GCA_OK);
      gca_stats_t s = stats_of(a, 0);
      assert_int_equal(s.active_bytes[GCA_POOL_ALL].current, s.allocated_bytes[GCA_POOL_ALL].current);
    } else {
      assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
    }
    assert_int_equal(gca_allocated_bytes(a, 0), model_allocated);
    if (op % 128 == 0) assert_consistent(a);
  }
  assert_consistent(a);
  for (int i = 0; i < SLOTS; i++)
    if (slots[i].ptr) assert_int_equal(gca_free(a, slots[i].ptr), GCA_OK);
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.active[GCA_POOL_ALL].current, 0);
  assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 0);
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.hazards, 0);
  assert_int_equal(c.events_live, 0);
  assert_int_equal(c.live, 0);
  printf("%-60s %d mallocs, %d OOMs, %d stream uses, %" PRIu64 " events, %" PRId64 " cross-stream reuses, %" PRId64
         " retries\n",
         *conf ? conf : "(PyTorch defaults)", mallocs, ooms, recorded, c.events_recorded, s.num_cross_stream_reuses,
         s.num_alloc_retries);
  /* The workload must reach the paths it is meant to test. */
  assert_true(ooms > 0 || s.num_alloc_retries > 0);
  assert_true(c.events_recorded > 1000);
  assert_consistent(a);
  gca_close(a);
}

static void test_pytorch_semantics(void **state) {
  (void)state;
  run("", 42, 400000);
}

static void test_cross_stream_reuse(void **state) {
  (void)state;
  run("cross_stream_reuse:True", 43, 400000);
}

static void test_cross_stream_reuse_oversize(void **state) {
  (void)state;
  run("cross_stream_reuse:True,max_split_size_mb:40,roundup_power2_divisions:4", 44, 400000);
}

static void test_cross_stream_reuse_ratio(void **state) {
  (void)state;
  run("cross_stream_reuse:1", 46, 400000);
}

static void test_launch_blocking(void **state) {
  (void)state;
  setenv("GCALLOC_LAUNCH_BLOCKING", "1", 1);
  run("max_split_size_mb:40", 45, 100000);
  unsetenv("GCALLOC_LAUNCH_BLOCKING");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pytorch_semantics),
      cmocka_unit_test(test_cross_stream_reuse),
      cmocka_unit_test(test_cross_stream_reuse_oversize),
      cmocka_unit_test(test_cross_stream_reuse_ratio),
      cmocka_unit_test(test_launch_blocking),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
