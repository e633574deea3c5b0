/* Stream-ordered reuse under concurrency (labels `streams` and `threads`,
 * run under ThreadSanitizer in CI). Workers allocate on streams of their own,
 * launch simulated work on what they get, record uses on a stream they all
 * share, free, and advance time; one thread synchronizes, empties the cache,
 * flips cross_stream_reuse and runs the checker; one reads statistics. The
 * device is small enough that the out-of-memory path runs concurrently with
 * pending frees; the history records everything, with stacks, and the
 * maintainer takes snapshots and summaries as it goes. Any launch the sim finds unordered with other work on the
 * same memory is a failure; afterwards the books must balance exactly.
 * The same workload, smaller, runs again in a child process that records
 * its calls (GCALLOC_TRACE_FILE): frees left pending there complete on
 * whichever thread looks at the events, and the trace must still never
 * hand out memory before its free completed. */
#include <inttypes.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "helpers.h"
#include "replay/trace.h"

#define WORKERS 4
#define OPS_PER_WORKER 20000
#define SLOTS 64
#define COMM ((gca_stream_t)0xC0)

typedef struct worker {
  gca_allocator_t *a;
  int index;
  int ops;
  uint64_t seed;
  long mallocs, ooms, uses, failures;
} worker_t;

static atomic_int workers_running;

static bool launch(const backend_t *b, gca_stream_t s, void *p, size_t size, uint64_t ns) {
  return gca__sim_launch(b, 0, s, ns, (uintptr_t)p, size) == GCA_OK;
}

static void *work(void *arg) {
  worker_t *w = arg;
  const backend_t *b = &w->a->backend;
  gca_stream_t mine[2] = {(gca_stream_t)(0x10000 * (w->index + 1)), (gca_stream_t)(0x10000 * (w->index + 1) + 1)};
  struct {
    void *p;
    size_t size;
    gca_stream_t stream;
    bool shared;
  } live[SLOTS] = {{0}};
  uint64_t s = w->seed;
  for (int i = 0; i < w->ops; i++) {
    size_t slot = next_random(&s) % SLOTS;
    uint64_t r = next_random(&s) % 100;
    if (!live[slot].p && r < 50) {
      size_t size = (size_t)1 << (9 + next_random(&s) % 17);
      size += next_random(&s) % size;
      gca_stream_t st = mine[next_random(&s) % 2];
      void *p = gca_malloc(w->a, size, 0, st);
      if (!p) {
        if (gca_last_status() == GCA_ERR_OOM) w->ooms++;
        else w->failures++;
        continue;
      }
      w->mallocs++;
      live[slot].p = p;
      live[slot].size = size;
      live[slot].stream = st;
      live[slot].shared = false;
      if (!launch(b, st, p, size, next_random(&s) % 3000)) w->failures++;
    } else if (live[slot].p && r < 65 && !live[slot].shared) {
      /* Hand the memory to the shared stream, after its producer. */
      if (order_streams(b, live[slot].stream, COMM) != GCA_OK) w->failures++;
      if (gca_record_stream(w->a, live[slot].p, COMM) != GCA_OK) w->failures++;
      if (!launch(b, COMM, live[slot].p, live[slot].size, next_random(&s) % 2000)) w->failures++;
      live[slot].shared = true;
      w->uses++;
    } else if (live[slot].p) {
      if (gca_free(w->a, live[slot].p) != GCA_OK) w->failures++;
      live[slot].p = NULL;
    }
    if (r >= 90) gca__sim_advance(b, next_random(&s) % 2000);
    if (r == 99 && gca_process_events(w->a, 0) != GCA_OK) w->failures++;
  }
  for (int i = 0; i < SLOTS; i++)
    if (live[i].p && gca_free(w->a, live[i].p) != GCA_OK) w->failures++;
  atomic_fetch_sub(&workers_running, 1);
  return NULL;
}

static void *observe(void *arg) {
  gca_allocator_t *a = arg;
  while (atomic_load(&workers_running) > 0) {
    gca_stats_t s;
    CHECK(gca_get_stats(a, 0, &s) == GCA_OK);
    CHECK(s.allocated_bytes[GCA_POOL_ALL].current <= s.active_bytes[GCA_POOL_ALL].current);
    CHECK(s.active_bytes[GCA_POOL_ALL].current <= s.reserved_bytes[GCA_POOL_ALL].current);
    CHECK(s.active[GCA_POOL_ALL].peak >= s.allocation[GCA_POOL_ALL].peak);
    CHECK(gca_allocated_bytes(a, 0) >= 0);
  }
  return NULL;
}

static void *maintain(void *arg) {
  gca_allocator_t *a = arg;
  int round = 0;
  while (atomic_load(&workers_running) > 0) {
    switch (round % 4) {
      case 0: CHECK(gca_synchronize(a, 0) == GCA_OK); break;
      case 1: CHECK(gca_empty_cache(a, -1) == GCA_OK); break;
      case 2:
        CHECK(gca_set_config(a, round % 8 == 2 ? "cross_stream_reuse:True" : "cross_stream_reuse:False") ==
              GCA_OK);
        break;
      default: {
        CHECK(gca_check(a, 0) == GCA_OK);
        /* Observability under load: a snapshot (stacks resolved outside the
         * lock) and a summary while the workers run. */
        gca_snapshot_t *snap = NULL;
        CHECK(gca_snapshot_take(a, &snap) == GCA_OK);
        gca_snapshot_free(snap);
        char summary[8192];
        CHECK(gca_memory_summary(a, 0, 1, summary, sizeof summary) > 0);
        break;
      }
    }
    round++;
  }
  return NULL;
}

/* The workers, the observer and the maintainer, each `ops` operations a
 * worker; false if any check failed. */
static bool run_workload(gca_allocator_t *a, int ops, long *mallocs, long *uses, long *ooms) {
  pthread_t threads[WORKERS + 2];
  worker_t workers[WORKERS];
  atomic_store(&workers_running, WORKERS);
  for (int i = 0; i < WORKERS; i++) {
    workers[i] = (worker_t){.a = a, .index = i, .ops = ops, .seed = 0x9E3779B9ull * (uint64_t)(i + 1)};
    if (pthread_create(&threads[i], NULL, work, &workers[i]) != 0) return false;
  }
  if (pthread_create(&threads[WORKERS], NULL, observe, a) != 0 ||
      pthread_create(&threads[WORKERS + 1], NULL, maintain, a) != 0)
    return false;
  for (int i = 0; i < WORKERS + 2; i++) pthread_join(threads[i], NULL);
  bool ok = atomic_load(&helper_failures) == 0;
  *mallocs = *uses = *ooms = 0;
  for (int i = 0; i < WORKERS; i++) {
    if (workers[i].failures) fprintf(stderr, "worker %d: %ld failures; last: %s\n", i, workers[i].failures,
                                     gca_last_error());
    ok &= workers[i].failures == 0;
    *mallocs += workers[i].mallocs;
    *uses += workers[i].uses;
    *ooms += workers[i].ooms;
  }
  return ok && *mallocs > 0 && *uses > 0;
}

static void test_concurrent_streams(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=2GiB", "cross_stream_reuse:True");
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_ALL, 4096), GCA_OK);
  long mallocs, uses, ooms;
  assert_true(run_workload(a, OPS_PER_WORKER, &mallocs, &uses, &ooms));
  assert_consistent(a);
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.allocation[GCA_POOL_ALL].current, 0);
  assert_int_equal(s.active[GCA_POOL_ALL].current, 0);
  assert_int_equal(s.allocation[GCA_POOL_ALL].allocated, s.allocation[GCA_POOL_ALL].freed);
  assert_int_equal(s.active[GCA_POOL_ALL].allocated, s.active[GCA_POOL_ALL].freed);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(gca_reserved_bytes(a, 0), 0);
  sim_counters_t c = sim_counters(a, 0);
  printf("%ld mallocs, %ld OOMs, %ld shared uses, %" PRIu64 " events, %" PRId64 " cross-stream reuses, %" PRId64
         " retries\n",
         mallocs, ooms, uses, c.events_recorded, s.num_cross_stream_reuses, s.num_alloc_retries);
  assert_int_equal(c.hazards, 0);
  assert_int_equal(c.events_live, 0);
  assert_consistent(a);
  gca_close(a);
}

/* The child: the workload recorded, then every pending free completed
 * (synchronize) before the close. */
#define RECORDED_OPS 3000
static int recording_child(void) {
  gca_allocator_t *a = NULL;
  if (gca_open("sim:capacity=2GiB", "cross_stream_reuse:True", &a) != GCA_OK) return 1;
  long mallocs, uses, ooms;
  bool ok = run_workload(a, RECORDED_OPS, &mallocs, &uses, &ooms) && gca_synchronize(a, 0) == GCA_OK;
  gca_close(a);
  return ok ? 0 : 1;
}

static void test_recorded_under_concurrency(void **state) {
  (void)state;
  char path[] = "/tmp/gcalloc-streams-trace-XXXXXX", cmd[1024];
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  snprintf(cmd, sizeof cmd, "GCALLOC_TRACE_FILE=%s %s --recording-child", path, GCALLOC_SELF_PATH);
  assert_int_equal(system(cmd), 0);
  /* As the replay reads it: memory is handed out only once its last free
   * completed, and each pending free completes. */
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_OK);
  addr_map_t live; /* address -> 1 allocated, 2 its free pending */
  assert_true(gca__addr_map_init(&live));
  size_t requested = 0, allocs = 0, live_count = 0;
  for (size_t i = 0; i < t.count; i++) {
    const trace_event_t *e = &t.events[i];
    uint64_t *state_of = gca__addr_map_get(&live, e->addr);
    if (e->action == TA_ALLOC) {
      if (state_of) fail_msg("event %zu: %#" PRIx64 " allocated again before its free completed", i, e->addr);
      assert_true(gca__addr_map_put(&live, e->addr, 1));
      allocs++;
      live_count++;
    } else if (e->action == TA_FREE_REQUESTED) {
      assert_non_null(state_of);
      assert_int_equal(*state_of, 1);
      *state_of = 2;
      requested++;
    } else if (e->action == TA_FREE_COMPLETED) {
      assert_non_null(state_of);
      gca__addr_map_del(&live, e->addr);
      live_count--;
    }
  }
  assert_int_equal(live_count, 0);
  assert_true(allocs > 0 && requested > 0);
  printf("%zu events recorded, %zu allocations, %zu frees left pending\n", t.count, allocs, requested);
  gca__addr_map_free(&live);
  trace_free(&t);
  remove(path);
}

int main(int argc, char **argv) {
  if (argc == 2 && !strcmp(argv[1], "--recording-child")) return recording_child();
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_concurrent_streams),
                                     cmocka_unit_test(test_recorded_under_concurrency)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
