/* Observability (label `observability`): the memory summary against a
 * golden worked out by hand; snapshot contents after known sequences; the
 * history ring, its wrap-around and its context levels; the pickle and JSON
 * exports, checked by Python's own pickle (an unpickler that refuses every
 * global) and json modules against the schema; log levels, GCALLOC_LOG and
 * GCALLOC_LOG_FILE; and a recorded trace read back equal to the calls made. */
#include <dlfcn.h>
#include <json-c/json.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "replay/record.h"
#include "replay/replay.h"
#include "replay/trace.h"

#define S1 ((gca_stream_t)0x100)
#define S2 ((gca_stream_t)0x200)
#define S3 ((gca_stream_t)0x300)

static char temp_dir[256];

static const char *temp_path(const char *name) {
  static char path[512];
  if (!temp_dir[0]) {
    snprintf(temp_dir, sizeof temp_dir, "/tmp/gcalloc-observability-XXXXXX");
    assert_non_null(mkdtemp(temp_dir));
  }
  snprintf(path, sizeof path, "%s/%s", temp_dir, name);
  return path;
}

/* ---- summary ------------------------------------------------------------ */

/* max_split_size_mb:100. p: 1000 bytes -> 1024 in a 2 MiB small segment;
 * q: 5 MiB in a 20 MiB segment, split (15 MiB left); r: 200 MiB, its own
 * oversize segment. p and r freed. Worked out:
 *   allocated now 5 MiB = 5120 KiB; peak and total 1024 + 5 MiB + 200 MiB =
 *   214959104 B = 209921 KiB; freed 1024 + 200 MiB = 204801 KiB; the pool
 *   rows use the "all" row's unit (small pool peak 1024 B = 1 KiB);
 *   requested peak 1000 + 5 MiB + 200 MiB = 209920.98 KiB -> 209920;
 *   reserved 2 + 20 + 200 MiB = 227328 KiB, nothing freed: "0 B  ";
 *   non-releasable now 15 MiB; peak (all three live) 15 MiB + 2 MiB - 1024
 *   = 17407 KiB; small pool freed 2047 KiB when p merged back. */
static const char *const golden_full =
    "|===========================================================================|\n"
    "|              gcalloc memory summary, device 0 (sim backend)               |\n"
    "|---------------------------------------------------------------------------|\n"
    "|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |\n"
    "|===========================================================================|\n"
    "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Allocated memory      |   5120 KiB | 209921 KiB | 209921 KiB | 204801 KiB |\n"
    "|       from large pool |   5120 KiB | 209920 KiB | 209920 KiB | 204800 KiB |\n"
    "|       from small pool |      0 KiB |      1 KiB |      1 KiB |      1 KiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Active memory         |   5120 KiB | 209921 KiB | 209921 KiB | 204801 KiB |\n"
    "|       from large pool |   5120 KiB | 209920 KiB | 209920 KiB | 204800 KiB |\n"
    "|       from small pool |      0 KiB |      1 KiB |      1 KiB |      1 KiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Requested memory      |   5120 KiB | 209920 KiB | 209920 KiB | 204800 KiB |\n"
    "|       from large pool |   5120 KiB | 209920 KiB | 209920 KiB | 204800 KiB |\n"
    "|       from small pool |      0 KiB |      0 KiB |      0 KiB |      0 KiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| GPU reserved memory   | 227328 KiB | 227328 KiB | 227328 KiB |      0 B   |\n"
    "|       from large pool | 225280 KiB | 225280 KiB | 225280 KiB |      0 B   |\n"
    "|       from small pool |   2048 KiB |   2048 KiB |   2048 KiB |      0 B   |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Non-releasable memory |  15360 KiB |  17407 KiB |  17407 KiB |   2047 KiB |\n"
    "|       from large pool |  15360 KiB |  15360 KiB |  15360 KiB |      0 KiB |\n"
    "|       from small pool |      0 KiB |   2047 KiB |   2047 KiB |   2047 KiB |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Allocations           |       1    |       3    |       3    |       2    |\n"
    "|       from large pool |       1    |       2    |       2    |       1    |\n"
    "|       from small pool |       0    |       1    |       1    |       1    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Active allocs         |       1    |       3    |       3    |       2    |\n"
    "|       from large pool |       1    |       2    |       2    |       1    |\n"
    "|       from small pool |       0    |       1    |       1    |       1    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| GPU reserved segments |       3    |       3    |       3    |       0    |\n"
    "|       from large pool |       2    |       2    |       2    |       0    |\n"
    "|       from small pool |       1    |       1    |       1    |       0    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Non-releasable allocs |       1    |       2    |       2    |       1    |\n"
    "|       from large pool |       1    |       1    |       1    |       0    |\n"
    "|       from small pool |       0    |       1    |       1    |       1    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Oversize allocations  |       0    |       1    |       1    |       1    |\n"
    "|---------------------------------------------------------------------------|\n"
    "| Oversize GPU segments |       1    |       1    |       1    |       0    |\n"
    "|===========================================================================|\n";

static void test_summary_golden(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB", "max_split_size_mb:100");
  void *p = gca_malloc(a, 1000, 0, 0), *q = gca_malloc(a, 5 * MiB, 0, 0), *r = gca_malloc(a, 200 * MiB, 0, 0);
  gca_free(a, p);
  gca_free(a, r);
  char buf[8192];
  int n = gca_memory_summary(a, 0, 0, buf, sizeof buf);
  assert_int_equal(n, (int)strlen(golden_full));
  assert_string_equal(buf, golden_full);
  /* Every line is 77 characters wide. */
  for (const char *line = buf; *line; line = strchr(line, '\n') + 1) assert_int_equal(strchr(line, '\n') - line, 77);
  /* Abbreviated: the per-pool rows go, nothing else changes. */
  n = gca_memory_summary(a, 0, 1, buf, sizeof buf);
  assert_int_equal(n, (int)strlen(golden_full) - 18 * 78);
  assert_null(strstr(buf, "from large pool"));
  assert_non_null(strstr(buf, "| GPU reserved memory   | 227328 KiB | 227328 KiB | 227328 KiB |      0 B   |\n"));
  /* Truncation still reports the full length; bad arguments are refused. */
  char small[10];
  assert_int_equal(gca_memory_summary(a, 0, 0, small, sizeof small), (int)strlen(golden_full));
  assert_int_equal(strlen(small), 9);
  assert_int_equal(gca_memory_summary(a, 3, 0, buf, sizeof buf), GCA_ERR_INVALID);
  assert_int_equal(gca_memory_summary(NULL, 0, 0, buf, sizeof buf), GCA_ERR_INVALID);
  gca_free(a, q);
  gca_close(a);
}

/* Larger values step to larger units: 900 MiB reserved is 921600 KiB, past
 * 768 x 1024 KiB, so MiB; 750,000 allocations show as 750 K. */
static void test_summary_units(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *big = gca_malloc(a, 900 * MiB, 0, 0);
  char buf[8192];
  gca_memory_summary(a, 0, 1, buf, sizeof buf);
  assert_non_null(strstr(buf, "| GPU reserved memory   |    900 MiB |    900 MiB |    900 MiB |      0 B   |"));
  for (int i = 0; i < 750000; i++) gca_free(a, gca_malloc(a, 512, 0, 0));
  gca_memory_summary(a, 0, 1, buf, sizeof buf);
  assert_non_null(strstr(buf, "| Allocations           |       1    |       2    |     750 K  |     750 K  |"));
  gca_free(a, big);
  gca_close(a);
}

/* ---- snapshot ----------------------------------------------------------- */

static const gca_snapshot_segment_t *segment_at(const gca_snapshot_t *s, void *p) {
  for (size_t i = 0; i < s->segment_count; i++) {
    const gca_snapshot_segment_t *seg = &s->segments[i];
    if ((uintptr_t)p >= seg->address && (uintptr_t)p < seg->address + seg->total_size) return seg;
  }
  return NULL;
}

static void test_snapshot_contents(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:devices=2", "max_split_size_mb:64");
  void *p = gca_malloc(a, 1000, 0, S1);        /* small segment of S1 */
  void *q = gca_malloc(a, 5 * MiB, 0, S2);     /* 20 MiB segment of S2, split */
  void *on1 = gca_malloc(a, 3 * MiB, 1, S1);   /* device 1 */
  assert_int_equal(gca_record_stream(a, q, S3), GCA_OK);
  assert_int_equal(gca__sim_launch(&a->backend, 0, S3, 1000, (uintptr_t)q, 5 * MiB), GCA_OK);
  assert_int_equal(gca_free(a, q), GCA_OK); /* pending */
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  assert_int_equal(s->segment_count, 3);
  assert_int_equal(s->device_count, 2);
  assert_string_equal(s->backend, "sim");
  assert_contains(s->settings, "max_split_size_mb:64");
  /* Sorted by device, then address; device 1's segment last. */
  assert_int_equal(s->segments[2].device, 1);
  assert_true(s->segments[0].address < s->segments[1].address);

  const gca_snapshot_segment_t *small = segment_at(s, p);
  assert_non_null(small);
  assert_int_equal(small->pool, GCA_POOL_SMALL);
  assert_int_equal(small->stream, S1);
  assert_int_equal(small->total_size, 2 * MiB);
  assert_int_equal(small->block_count, 2);
  assert_int_equal(small->blocks[0].state, GCA_BLOCK_ACTIVE_ALLOCATED);
  assert_int_equal(small->blocks[0].size, 1024);
  assert_int_equal(small->blocks[0].requested_size, 1000);
  assert_int_equal(small->blocks[1].state, GCA_BLOCK_INACTIVE);
  assert_int_equal(small->blocks[1].size, 2 * MiB - 1024);
  assert_int_equal(small->allocated_size, 1024);
  assert_int_equal(small->requested_size, 1000);

  const gca_snapshot_segment_t *large = segment_at(s, q);
  assert_int_equal(large->pool, GCA_POOL_LARGE);
  assert_int_equal(large->stream, S2);
  assert_int_equal(large->total_size, 20 * MiB);
  assert_int_equal(large->blocks[0].state, GCA_BLOCK_ACTIVE_PENDING_FREE);
  assert_int_equal(large->blocks[0].requested_size, 5 * MiB);
  assert_int_equal(large->allocated_size, 0);
  assert_int_equal(large->active_size, 5 * MiB);
  assert_int_equal(large->requested_size, 5 * MiB);
  /* History was off: no entries, no stacks. */
  assert_int_equal(s->trace_counts[0] + s->trace_counts[1], 0);
  assert_int_equal(large->blocks[0].frame_count, 0);
  gca_snapshot_free(s);
  assert_int_equal(gca_snapshot_take(NULL, &s), GCA_ERR_INVALID);
  gca_free(a, p);
  gca_free(a, on1);
  gca_close(a);
}

/* ---- history ------------------------------------------------------------ */

/* The wall clock's microseconds now. */
static int64_t wall_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

/* Entries carry the wall-clock time they were recorded at (a steady counter
 * read per entry, put on the clock's line when the snapshot is taken):
 * each lies within the clock readings around it, to a millisecond, across
 * pauses of 20 ms, in the counter's mode and in the clock's
 * (GCALLOC_TEST_TICKS_CLOCK=1: test_observability_clock). */
static void test_history_times_are_the_wall_clock(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_NONE, 100), GCA_OK);
  enum { PAIRS = 6 };
  int64_t before[PAIRS], after[PAIRS];
  for (int i = 0; i < PAIRS; i++) {
    usleep(20000);
    before[i] = wall_us();
    void *p = gca_malloc(a, 4096, 0, 0);
    assert_non_null(p);
    assert_int_equal(gca_free(a, p), GCA_OK);
    after[i] = wall_us();
  }
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  const gca_trace_entry_t *e = s->device_traces[0];
  int pair = -1;
  for (size_t k = 0; k < s->trace_counts[0]; k++) {
    if (e[k].action == GCA_TRACE_SNAPSHOT) continue;
    if (e[k].action == GCA_TRACE_ALLOC) pair++;
    int at = pair < 0 ? 0 : pair; /* (the first pair's segment comes before its block) */
    assert_in_range(at, 0, PAIRS - 1);
    if (e[k].time_us < before[at] - 1000 || e[k].time_us > after[at] + 1000)
      fail_msg("entry %zu (pair %d) at %lld us, recorded between %lld and %lld", k, at, (long long)e[k].time_us,
               (long long)before[at], (long long)after[at]);
  }
  assert_int_equal(pair, PAIRS - 1);
  gca_snapshot_free(s);
  gca_close(a);
}

/* An immediate free records its two entries at once; the ring keeps
 * exactly max_entries entries, forgetting one entry at a time, so a full
 * ring can keep the free_completed of a pair whose free_requested went
 * (with its stack). */
static void expect_actions(gca_allocator_t *a, const int *want, int n, bool stacks) {
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  assert_int_equal(s->trace_counts[0], n);
  for (int i = 0; i < n; i++) {
    const gca_trace_entry_t *e = &s->device_traces[0][i];
    assert_int_equal(e->action, want[i]);
    if (stacks && want[i] != GCA_TRACE_SNAPSHOT) assert_true(e->frame_count > 0);
  }
  gca_snapshot_free(s);
}

static void test_history_ring_splits_a_pair(void **state) {
  (void)state;
  for (int stacks = 0; stacks < 2; stacks++) {
    gca_context context = stacks ? GCA_CONTEXT_ALL : GCA_CONTEXT_NONE;
    gca_allocator_t *a = open_sim("sim", NULL);
    /* segment_alloc, alloc, free_requested + free_completed; alloc, the
     * pair again (the first two go); the snapshot's entry (the first
     * free_requested goes, its free_completed stays). */
    assert_int_equal(gca_record_history(a, 1, context, 5), GCA_OK);
    for (int i = 0; i < 2; i++) gca_free(a, gca_malloc(a, 4096, 0, S1));
    const int five[] = {GCA_TRACE_FREE_COMPLETED, GCA_TRACE_ALLOC, GCA_TRACE_FREE_REQUESTED, GCA_TRACE_FREE_COMPLETED,
                        GCA_TRACE_SNAPSHOT};
    expect_actions(a, five, 5, stacks);
    /* Two entries: the pair's free_completed and the snapshot. */
    assert_int_equal(gca_record_history(a, 1, context, 2), GCA_OK);
    gca_free(a, gca_malloc(a, 4096, 0, S1));
    const int two[] = {GCA_TRACE_FREE_COMPLETED, GCA_TRACE_SNAPSHOT};
    expect_actions(a, two, 2, stacks);
    /* One entry: no room for a pair; the snapshot's entry alone. */
    assert_int_equal(gca_record_history(a, 1, context, 1), GCA_OK);
    gca_free(a, gca_malloc(a, 4096, 0, S1));
    const int one[] = {GCA_TRACE_SNAPSHOT};
    expect_actions(a, one, 1, stacks);
    gca_close(a);
  }
}

static void test_history_ring_wraps(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_NONE, 4), GCA_OK);
  /* segment_alloc, alloc, free_requested, free_completed; then a hit:
   * alloc, free_requested, free_completed; then the snapshot's entry. */
  for (int i = 0; i < 2; i++) gca_free(a, gca_malloc(a, 4096, 0, S1));
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  assert_int_equal(s->trace_counts[0], 4);
  const gca_trace_entry_t *e = s->device_traces[0];
  const int want[] = {GCA_TRACE_ALLOC, GCA_TRACE_FREE_REQUESTED, GCA_TRACE_FREE_COMPLETED, GCA_TRACE_SNAPSHOT};
  for (int i = 0; i < 4; i++) {
    assert_int_equal(e[i].action, want[i]);
    assert_int_equal(e[i].frame_count, 0);
    if (i) assert_true(e[i].time_us >= e[i - 1].time_us);
  }
  assert_int_equal(e[0].size, 4096);
  assert_int_equal(e[0].stream, S1);
  assert_true(e[0].time_us > 1700000000000000ll); /* microseconds since the epoch */
  gca_snapshot_free(s);
  /* Stopping keeps what was recorded; starting again drops it. */
  assert_int_equal(gca_record_history(a, 0, GCA_CONTEXT_NONE, 0), GCA_OK);
  gca_free(a, gca_malloc(a, 4096, 0, S1));
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  assert_int_equal(s->trace_counts[0], 4);
  gca_snapshot_free(s);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_NONE, 100), GCA_OK);
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  assert_int_equal(s->trace_counts[0], 1); /* only the snapshot */
  gca_snapshot_free(s);
  assert_int_equal(gca_record_history(a, 1, (gca_context)7, 10), GCA_ERR_INVALID);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_ALL, 0), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "max_entries");
  assert_int_equal(gca_record_history_ex(a, 1, GCA_CONTEXT_ALL, (gca_stacks)3, 10), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "stacks 3");
  /* No Python in this process: every choice of stacks records the native
   * frames, and the calls keep their plain entry. */
  for (int stacks = GCA_STACKS_NATIVE; stacks <= GCA_STACKS_ALL; stacks++) {
    assert_int_equal(gca_record_history_ex(a, 1, GCA_CONTEXT_ALL, (gca_stacks)stacks, 10), GCA_OK);
    assert_int_equal(atomic_load(&gca__calls_observed) & GCA_OBSERVED_PYTHON, 0);
    gca_free(a, gca_malloc(a, 4096, 0, S1));
    assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
    assert_int_equal(s->device_traces[0][0].action, GCA_TRACE_ALLOC);
    assert_true(s->device_traces[0][0].frame_count > 0);
    for (size_t k = 0; k < s->device_traces[0][0].frame_count; k++)
      assert_null(strstr(s->device_traces[0][0].frames[k].filename, ".py"));
    gca_snapshot_free(s);
  }
  gca_close(a);
}

/* Which entries and blocks carry stacks, by context level. */
static void check_context(gca_context context, bool block_frames, bool alloc_frames, bool free_frames) {
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(gca_record_history(a, 1, context, 100), GCA_OK);
  void *live = gca_malloc(a, 4096, 0, S1);
  gca_free(a, gca_malloc(a, 8192, 0, S1));
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  const gca_snapshot_block_t *b = &segment_at(s, live)->blocks[0];
  assert_int_equal(b->frame_count > 0, block_frames);
  for (size_t i = 0; i < s->trace_counts[0]; i++) {
    const gca_trace_entry_t *e = &s->device_traces[0][i];
    if (e->action == GCA_TRACE_ALLOC) assert_int_equal(e->frame_count > 0, alloc_frames);
    if (e->action == GCA_TRACE_FREE_REQUESTED) assert_int_equal(e->frame_count > 0, free_frames);
    for (size_t k = 0; k < e->frame_count; k++) {
      assert_true(strlen(e->frames[k].filename) > 0);
      assert_non_null(e->frames[k].name);
    }
  }
  gca_snapshot_free(s);
  gca_free(a, live);
  gca_close(a);
}

static void test_history_context_levels(void **state) {
  (void)state;
  check_context(GCA_CONTEXT_NONE, false, false, false);
  check_context(GCA_CONTEXT_STATE, true, false, false);
  check_context(GCA_CONTEXT_ALLOC, true, true, false);
  check_context(GCA_CONTEXT_ALL, true, true, true);
}

static void test_history_records_oom_and_segments(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", NULL);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_ALLOC, 100), GCA_OK);
  void *p = gca_malloc(a, 60 * MiB, 0, S1);
  gca_free(a, p);
  assert_null(gca_malloc(a, 200 * MiB, 0, S1)); /* frees the cache, then fails */
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  int segment_allocs = 0, segment_frees = 0, ooms = 0;
  for (size_t i = 0; i < s->trace_counts[0]; i++) {
    const gca_trace_entry_t *e = &s->device_traces[0][i];
    segment_allocs += e->action == GCA_TRACE_SEGMENT_ALLOC;
    segment_frees += e->action == GCA_TRACE_SEGMENT_FREE;
    if (e->action == GCA_TRACE_OOM) {
      ooms++;
      assert_int_equal(e->size, 200 * MiB);
      assert_int_equal(e->device_free, 100 * MiB);
      assert_int_equal(e->addr, 0);
      assert_true(e->frame_count > 0);
    }
  }
  assert_int_equal(segment_allocs, 1);
  assert_int_equal(segment_frees, 1);
  assert_int_equal(ooms, 1);
  gca_snapshot_free(s);
  gca_close(a);
}

/* ---- export ------------------------------------------------------------- */

static void test_export_pickle_and_json(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:devices=2", "roundup_power2_divisions:4");
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_ALL, 1000), GCA_OK);
  void *p = gca_malloc(a, 1000, 0, S1), *q = gca_malloc(a, 5 * MiB, 0, S2), *r = gca_malloc(a, 3 * MiB, 1, S1);
  assert_int_equal(gca_record_stream(a, q, S3), GCA_OK);
  assert_int_equal(gca__sim_launch(&a->backend, 0, S3, 1000, (uintptr_t)q, 5 * MiB), GCA_OK);
  gca_free(a, q);
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  size_t entries = s->trace_counts[0] + s->trace_counts[1];
  char pickle_path[512], json_path[512];
  snprintf(pickle_path, sizeof pickle_path, "%s", temp_path("snapshot.pickle"));
  snprintf(json_path, sizeof json_path, "%s", temp_path("snapshot.json"));
  assert_int_equal(gca_snapshot_write(s, pickle_path, GCA_SNAPSHOT_PICKLE), GCA_OK);
  assert_int_equal(gca_snapshot_write(s, json_path, GCA_SNAPSHOT_JSON), GCA_OK);
  assert_int_equal(gca_snapshot_write(s, "/nonexistent/dir/x.pickle", GCA_SNAPSHOT_PICKLE), GCA_ERR_IO);
  assert_contains(gca_last_error(), "/nonexistent/dir/x.pickle");
  assert_int_equal(gca_snapshot_write(s, json_path, (gca_snapshot_format)9), GCA_ERR_INVALID);

  /* The JSON, read back with json-c. */
  json_object *root = json_object_from_file(json_path);
  assert_non_null(root);
  json_object *segments, *traces, *settings, *seg0, *blocks, *b0, *v;
  assert_true(json_object_object_get_ex(root, "segments", &segments));
  assert_int_equal(json_object_array_length(segments), s->segment_count);
  assert_true(json_object_object_get_ex(root, "device_traces", &traces));
  assert_int_equal(json_object_array_length(traces), 2);
  assert_true(json_object_object_get_ex(root, "allocator_settings", &settings));
  assert_true(json_object_object_get_ex(settings, "roundup_power2_divisions", &v));
  json_object *one;
  assert_true(json_object_object_get_ex(v, "1", &one));
  assert_int_equal(json_object_get_int(one), 4);
  seg0 = json_object_array_get_idx(segments, 0);
  assert_true(json_object_object_get_ex(seg0, "address", &v));
  assert_int_equal((uint64_t)json_object_get_int64(v), s->segments[0].address);
  assert_true(json_object_object_get_ex(seg0, "blocks", &blocks));
  b0 = json_object_array_get_idx(blocks, 0);
  assert_true(json_object_object_get_ex(b0, "state", &v));
  assert_string_equal(json_object_get_string(v), "active_allocated");
  json_object_put(root);

  /* The pickle, by Python's own pickle and json modules. */
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "python3 %s/tests/check_snapshot.py %s %s %zu %zu", GCALLOC_SOURCE_DIR, pickle_path,
           json_path, s->segment_count, entries);
  assert_int_equal(system(cmd), 0);
  /* gcalloc's own trace reader (the replay tool's) reads it back too. */
  trace_t t;
  assert_int_equal(trace_load(pickle_path, &t), GCA_OK);
  assert_int_equal(t.count, entries);
  assert_int_equal(t.device_count, 2);
  trace_free(&t);
  gca_snapshot_free(s);
  gca_free(a, p);
  gca_free(a, r);
  gca_close(a);
}

/* Past 256 memoized objects the pickle refers to them with 4-byte indexes
 * (LONG_BINPUT, LONG_BINGET): 300 distinct frames, each used three times. */
static void test_export_long_memo(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_STATE, 1000), GCA_OK);
  for (int i = 0; i < 300; i++) gca_free(a, gca_malloc(a, 4096, 0, 0));
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  const size_t count = s->trace_counts[0]; /* alloc, free_requested, free_completed each, and the segment */
  assert_true(count >= 600);
  enum { DISTINCT = 300 };
  static char files[DISTINCT][32], names[DISTINCT][32];
  static gca_frame_t frames[DISTINCT];
  for (int i = 0; i < DISTINCT; i++) {
    snprintf(files[i], sizeof files[i], "model/layer%03d.py", i);
    snprintf(names[i], sizeof names[i], "forward_%03d", i);
    frames[i] = (gca_frame_t){files[i], names[i], i};
  }
  /* The test's own frames in place of the recorded ones (the snapshot's
   * arena still owns those, and is freed as usual). */
  gca_trace_entry_t *entries = (gca_trace_entry_t *)s->device_traces[0];
  for (size_t i = 0; i < count; i++) {
    entries[i].frames = &frames[i % DISTINCT];
    entries[i].frame_count = 1;
  }
  char pickle_path[512], json_path[512], cmd[2048];
  snprintf(pickle_path, sizeof pickle_path, "%s", temp_path("long-memo.pickle"));
  snprintf(json_path, sizeof json_path, "%s", temp_path("long-memo.json"));
  assert_int_equal(gca_snapshot_write(s, pickle_path, GCA_SNAPSHOT_PICKLE), GCA_OK);
  assert_int_equal(gca_snapshot_write(s, json_path, GCA_SNAPSHOT_JSON), GCA_OK);
  snprintf(cmd, sizeof cmd, "python3 %s/tests/check_snapshot.py %s %s %zu %zu LONG_BINPUT,LONG_BINGET",
           GCALLOC_SOURCE_DIR, pickle_path, json_path, s->segment_count, count);
  assert_int_equal(system(cmd), 0);
  trace_t t;
  assert_int_equal(trace_load(pickle_path, &t), GCA_OK);
  assert_int_equal(t.count, count);
  trace_free(&t);
  gca_snapshot_free(s);
  gca_close(a);
}

/* C++ names in stacks read as PyTorch's do, once the process has the C++
 * runtime (a PyTorch process has; this test loads it, locally, as Python
 * loads PyTorch's extension modules), and as they were without it. */
static void test_cxx_names_demangled(void **state) {
  (void)state;
  const char *mangled = "_ZN5torch4cuda22CUDAPluggableAllocator22CUDAPluggableAllocator6mallocEmaP11CUstream_st";
  arena_t ar = {0};
  if (!gca__find_demangler()) { /* not loaded yet: names stay as they are */
    assert_string_equal(gca__readable_name(&ar, NULL, mangled), mangled);
  }
  void *cxx = dlopen("libstdc++.so.6", RTLD_NOW | RTLD_LOCAL);
  if (!cxx) fprintf(stderr, "cannot load the C++ runtime: %s\n", dlerror());
  assert_non_null(cxx);
  demangle_fn demangle = gca__find_demangler();
  assert_non_null(demangle);
  assert_string_equal(gca__readable_name(&ar, demangle, mangled),
                      "torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator::malloc(unsigned long, signed char, "
                      "CUstream_st*)");
  /* C names, and what is not a valid mangled name, are kept. */
  assert_string_equal(gca__readable_name(&ar, demangle, "gca_torch_malloc"), "gca_torch_malloc");
  assert_string_equal(gca__readable_name(&ar, demangle, "_Zbroken"), "_Zbroken");
  assert_string_equal(gca__readable_name(&ar, demangle, "??"), "??");
  gca__arena_free(&ar);
}

/* ---- logging ------------------------------------------------------------ */

static void test_log_levels(void **state) {
  (void)state;
  log_capture_t log = {0};
  gca_set_log_handler(capture_log, &log);
  gca_log_level before = gca_set_log_level(GCA_LOG_TRACE);
  gca_allocator_t *a = open_sim("sim", NULL);
  void *p = gca_malloc(a, 4096, 0, S1);
  gca_free(a, p);
  assert_contains(log.all, "malloc(4096 bytes, device 0, stream 0x100) = ");
  assert_contains(log.all, "free(");
  assert_contains(log.all, "opened on sim");
  /* Debug: failed calls, nothing else. */
  gca_set_log_level(GCA_LOG_DEBUG);
  memset(&log, 0, sizeof log);
  p = gca_malloc(a, 4096, 0, S1);
  gca_free(a, p);
  assert_int_equal(log.count, 0);
  assert_int_equal(gca_free(a, p), GCA_ERR_BAD_POINTER);
  assert_int_equal(log.count, 1);
  assert_contains(log.last, "gca_free failed: cannot free");
  /* Error: only failures gcalloc absorbed. A refused device free is one. */
  gca_set_log_level(GCA_LOG_ERROR);
  assert_int_equal(gca_free(a, p), GCA_ERR_BAD_POINTER);
  assert_int_equal(log.count, 1);
  gca_allocator_t *refusing = open_sim("sim:free_fail_at=1", NULL);
  gca_free(refusing, gca_malloc(refusing, 4096, 0, S1));
  assert_int_equal(gca_empty_cache(refusing, 0), GCA_OK);
  assert_int_equal(log.count, 2);
  assert_contains(log.last, "device 0: 1 device failures handled");
  gca_close(refusing);
  /* Off: nothing at all. */
  assert_int_equal(gca_set_log_level(GCA_LOG_OFF), GCA_LOG_ERROR);
  assert_int_equal(gca_free(a, p), GCA_ERR_BAD_POINTER);
  assert_int_equal(log.count, 2);
  assert_int_equal(gca_get_log_level(), GCA_LOG_OFF);
  gca_set_log_level(before);
  gca_set_log_handler(NULL, NULL);
  gca_close(a);
}

/* GCALLOC_LOG and GCALLOC_LOG_FILE are read once per process: check them in
 * a child, the gcalloc tool's demo. */
static void test_log_environment(void **state) {
  (void)state;
  const char *path = temp_path("log.txt");
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "GCALLOC_LOG=trace GCALLOC_LOG_FILE=%s %s demo --steps 1 >/dev/null", path,
           GCALLOC_TOOL_PATH);
  assert_int_equal(system(cmd), 0);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  char text[4096] = {0};
  assert_true(fread(text, 1, sizeof text - 1, f) > 0);
  fclose(f);
  assert_contains(text, "gcalloc: info: allocator ");
  assert_contains(text, "gcalloc: trace: malloc(");
  /* A bad level is named in a warning, and the level stays warn. */
  snprintf(cmd, sizeof cmd, "GCALLOC_LOG=loud %s demo --steps 1 2>&1 >/dev/null | grep -q 'GCALLOC_LOG=loud'",
           GCALLOC_TOOL_PATH);
  assert_int_equal(system(cmd), 0);
}

/* ---- trace recording ---------------------------------------------------- */

typedef struct expected_call {
  int call;
  uint64_t ptr, size, stream;
  int device, status;
  int pending; /* a free that left its block pending */
} expected_call_t;

/* The calls both this process and the recording child make: on the sim,
 * addresses are the same in both. */
static size_t run_sequence(expected_call_t *out) {
  size_t n = 0;
  gca_allocator_t *a = NULL;
  if (gca_open("sim:capacity=64MiB", NULL, &a) != GCA_OK) return 0;
  out[n++] = (expected_call_t){RC_OPEN, 0, 0, 0, 0, 0, 0};
  void *p = gca_malloc(a, 1000, 0, S1);
  out[n++] = (expected_call_t){RC_MALLOC, (uintptr_t)p, 1000, S1, 0, 0, 0};
  void *q = gca_malloc(a, 5 * MiB, 0, S2);
  out[n++] = (expected_call_t){RC_MALLOC, (uintptr_t)q, 5 * MiB, S2, 0, 0, 0};
  void *none = gca_malloc(a, 100 * MiB, 0, S1); /* out of memory: recorded with pointer 0 */
  out[n++] = (expected_call_t){RC_MALLOC, (uintptr_t)none, 100 * MiB, S1, 0, 0, 0};
  int rc = gca_record_stream(a, q, S3);
  out[n++] = (expected_call_t){RC_RECORD_STREAM, (uintptr_t)q, 0, S3, 0, rc, 0};
  /* Used on S3: the free leaves q pending on an event there ... */
  rc = gca_free(a, q);
  out[n++] = (expected_call_t){RC_FREE, (uintptr_t)q, 0, 0, 0, rc, 1};
  rc = gca_free(a, q); /* a double free is recorded with its status */
  out[n++] = (expected_call_t){RC_FREE, (uintptr_t)q, 0, 0, 0, rc, 0};
  /* ... which empty_cache waits for: q's completion goes before its line. */
  out[n++] = (expected_call_t){RC_FREE_COMPLETED, (uintptr_t)q, 0, 0, 0, 0, 0};
  rc = gca_empty_cache(a, 0);
  out[n++] = (expected_call_t){RC_EMPTY_CACHE, 0, 0, 0, 0, rc, 0};
  rc = gca_free(a, p);
  out[n++] = (expected_call_t){RC_FREE, (uintptr_t)p, 0, 0, 0, rc, 0};
  gca_close(a);
  out[n++] = (expected_call_t){RC_CLOSE, 0, 0, 0, 0, 0, 0};
  return n;
}

/* Runs this test program as a child in `mode` with GCALLOC_TRACE_FILE set
 * to the temporary file `name`, and reads back what it recorded. */
static const char *record_child(const char *name, const char *mode, recorded_calls_t *got) {
  const char *path = temp_path(name);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "GCALLOC_TRACE_FILE=%s %s %s", path, GCALLOC_SELF_PATH, mode);
  assert_int_equal(system(cmd), 0);
  assert_int_equal(record_read(path, got), GCA_OK);
  return path;
}

static void test_trace_recording(void **state) {
  (void)state;
  expected_call_t want[16];
  size_t n = run_sequence(want);
  assert_int_equal(n, 11);
  recorded_calls_t got;
  const char *path = record_child("trace.txt", "--record-child", &got);
  assert_int_equal(got.count, n);
  for (size_t i = 0; i < n; i++) {
    const recorded_call_t *c = &got.calls[i];
    assert_int_equal(c->call, want[i].call);
    assert_int_equal(c->allocator, 0);
    if (i) assert_true(c->time_us >= got.calls[i - 1].time_us);
    switch (c->call) {
      case RC_OPEN:
        assert_string_equal(c->text[0], "sim:capacity=64MiB");
        assert_string_equal(c->text[1], "-");
        break;
      case RC_MALLOC:
        assert_int_equal(c->ptr, want[i].ptr);
        assert_int_equal(c->size, want[i].size);
        assert_int_equal(c->stream, want[i].stream);
        assert_int_equal(c->device, 0);
        break;
      case RC_FREE:
      case RC_FREE_COMPLETED: assert_int_equal(c->ptr, want[i].ptr); break;
      case RC_RECORD_STREAM:
        assert_int_equal(c->ptr, want[i].ptr);
        assert_int_equal(c->stream, want[i].stream);
        break;
      default: break;
    }
    assert_int_equal(c->status, want[i].status);
    assert_int_equal(c->pending, want[i].pending);
  }
  assert_int_equal(want[3].ptr, 0);
  assert_int_equal(want[6].status, GCA_ERR_BAD_POINTER);
  record_free(&got);
  /* A malformed file is refused, naming the line. */
  FILE *f = fopen(path, "w");
  fputs("# gcalloc trace 1\n1 2 malloc 0 0 100 10\nnonsense\n", f);
  fclose(f);
  assert_int_equal(record_read(path, &got), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "line 2");
  assert_int_equal(record_read("/nonexistent/trace", &got), GCA_ERR_IO);
}

/* A block used on another stream is reused only once that stream's work
 * is done. The job below needed two 12 MiB segments because of it (B came
 * while A waited for S2), and a replay of its trace must say so: the free
 * of A is recorded as pending and its completion when it came, and the
 * replay releases A there. Returns the job's peak reserved bytes. */
static int64_t run_pending_job(void) {
  gca_allocator_t *a = NULL;
  if (gca_open("sim:capacity=256MiB", NULL, &a) != GCA_OK) return -1;
  void *first = gca_malloc(a, 12 * MiB, 0, S1);
  if (!first || gca__sim_launch(&a->backend, 0, S2, 1000, (uintptr_t)first, 12 * MiB) != GCA_OK ||
      gca_record_stream(a, first, S2) != GCA_OK || gca_free(a, first) != GCA_OK)
    return -1;
  void *second = gca_malloc(a, 12 * MiB, 0, S1); /* S2's work runs on: a segment of its own */
  if (!second || second == first || gca_free(a, second) != GCA_OK) return -1;
  gca__sim_advance(&a->backend, 2000);
  void *third = gca_malloc(a, 12 * MiB, 0, S1); /* done now: either segment will do */
  gca_stats_t st;
  if (!third || gca_free(a, third) != GCA_OK || gca_get_stats(a, 0, &st) != GCA_OK) return -1;
  gca_close(a);
  return st.reserved_bytes[GCA_POOL_ALL].peak;
}

static void test_trace_pending_frees_replayed(void **state) {
  (void)state;
  int64_t peak = run_pending_job();
  assert_int_equal(peak, 24 * MiB);
  recorded_calls_t got;
  const char *path = record_child("pending.trace", "--pending-child", &got);
  size_t pending_frees = 0, completions = 0, completed_at = 0, third_at = 0;
  for (size_t i = 0; i < got.count; i++) {
    const recorded_call_t *c = &got.calls[i];
    pending_frees += c->call == RC_FREE && c->pending;
    if (c->call == RC_FREE_COMPLETED) completed_at = i, completions++;
    if (c->call == RC_MALLOC) third_at = i;
  }
  assert_int_equal(pending_frees, 1);
  assert_int_equal(completions, 1);
  assert_true(completed_at < third_at); /* before the malloc that could reuse it */
  record_free(&got);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_OK);
  replay_options_t o = {.device = -1, .infer_empty_cache = true, .match_segments = true};
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].peak_reserved, (uint64_t)peak);
  replay_result_free(&r);
  trace_free(&t);
}

static int cleanup(void **state) {
  (void)state;
  if (temp_dir[0]) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", temp_dir);
    if (system(cmd) != 0) return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 2 && !strcmp(argv[1], "--record-child")) {
    expected_call_t calls[16];
    return run_sequence(calls) == 11 ? 0 : 1;
  }
  if (argc == 2 && !strcmp(argv[1], "--pending-child")) return run_pending_job() == 24 * MiB ? 0 : 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_summary_golden),
      cmocka_unit_test(test_summary_units),
      cmocka_unit_test(test_snapshot_contents),
      cmocka_unit_test(test_export_long_memo),
      cmocka_unit_test(test_cxx_names_demangled),
      cmocka_unit_test(test_history_ring_wraps),
      cmocka_unit_test(test_history_ring_splits_a_pair),
      cmocka_unit_test(test_history_times_are_the_wall_clock),
      cmocka_unit_test(test_history_context_levels),
      cmocka_unit_test(test_history_records_oom_and_segments),
      cmocka_unit_test(test_export_pickle_and_json),
      cmocka_unit_test(test_log_levels),
      cmocka_unit_test(test_log_environment),
      cmocka_unit_test(test_trace_recording),
      cmocka_unit_test(test_trace_pending_frees_replayed),
  };
  /* CTest runs the history's times apart too, on the clock instead of the
   * counter (tests/CMakeLists.txt: test_observability_clock). */
  if (getenv("GCALLOC_TEST_ONLY")) cmocka_set_test_filter(getenv("GCALLOC_TEST_ONLY"));
  return cmocka_run_group_tests(tests, NULL, cleanup);
}
