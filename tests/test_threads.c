/* Many threads on one allocator at once (run under ThreadSanitizer in CI):
 * workers allocate and free on two devices and several streams, one thread
 * reads statistics and the lock-free counters, one empties the cache and
 * changes the configuration. Afterwards the books must balance exactly. */
#include <pthread.h>

#include "helpers.h"
#include <time.h>

#define WORKERS 4
#define OPS_PER_WORKER 60000

typedef struct worker {
  gca_allocator_t *a;
  uint64_t seed;
  long frees;
  long failures;
} worker_t;

static atomic_int workers_running;

static void *work(void *arg) {
  worker_t *w = arg;
  void *live[256] = {0};
  uint64_t s = w->seed;
  for (int i = 0; i < OPS_PER_WORKER; i++) {
    size_t slot = next_random(&s) % 256;
    if (live[slot]) {
      if (gca_free(w->a, live[slot]) != GCA_OK) w->failures++;
      live[slot] = NULL;
      w->frees++;
    } else {
      size_t size = (size_t)1 << (next_random(&s) % 26);
      size += next_random(&s) % size;
      live[slot] = gca_malloc(w->a, size, (int)(next_random(&s) % 2), (gca_stream_t)(next_random(&s) % 3));
      if (!live[slot]) w->failures++;
    }
  }
  for (size_t i = 0; i < 256; i++)
    if (live[i] && gca_free(w->a, live[i]) != GCA_OK) w->failures++;
  atomic_fetch_sub(&workers_running, 1);
  return NULL;
}

static void *observe(void *arg) {
  gca_allocator_t *a = arg;
  long reads = 0;
  while (atomic_load(&workers_running) > 0) {
    int64_t allocated = gca_allocated_bytes(a, reads % 2);
    int64_t reserved = gca_reserved_bytes(a, reads % 2);
    CHECK(allocated >= 0 && reserved >= 0);
    gca_stats_t s;
    CHECK(gca_get_stats(a, (int)(reads % 2), &s) == GCA_OK);
    CHECK(s.allocated_bytes[GCA_POOL_ALL].current <= s.reserved_bytes[GCA_POOL_ALL].current);
    reads++;
  }
  return NULL;
}

static void *maintain(void *arg) {
  gca_allocator_t *a = arg;
  int round = 0;
  while (atomic_load(&workers_running) > 0) {
    CHECK(gca_empty_cache(a, -1) == GCA_OK);
    CHECK(gca_set_config(a, round % 2 ? "roundup_power2_divisions:4" : "roundup_power2_divisions:1") == GCA_OK);
    CHECK(gca_check(a, round % 2) == GCA_OK);
    round++;
  }
  return NULL;
}

static void test_concurrent_use(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:devices=2,capacity=1TiB", NULL);
  pthread_t threads[WORKERS + 2];
  worker_t workers[WORKERS];
  atomic_store(&workers_running, WORKERS);
  for (int i = 0; i < WORKERS; i++) {
    workers[i] = (worker_t){a, 0x1234567ull * (uint64_t)(i + 1), 0, 0};
    assert_int_equal(pthread_create(&threads[i], NULL, work, &workers[i]), 0);
  }
  assert_int_equal(pthread_create(&threads[WORKERS], NULL, observe, a), 0);
  assert_int_equal(pthread_create(&threads[WORKERS + 1], NULL, maintain, a), 0);
  for (int i = 0; i < WORKERS + 2; i++) pthread_join(threads[i], NULL);
  assert_int_equal(atomic_load(&helper_failures), 0);

  long frees = 0;
  for (int i = 0; i < WORKERS; i++) {
    assert_int_equal(workers[i].failures, 0);
    frees += workers[i].frees;
  }
  assert_true(frees > 0);
  assert_consistent(a);
  int64_t total_allocs = 0, total_frees = 0;
  for (int d = 0; d < 2; d++) {
    gca_stats_t s = stats_of(a, d);
    assert_int_equal(s.allocation[GCA_POOL_ALL].current, 0);
    assert_int_equal(s.allocated_bytes[GCA_POOL_ALL].current, 0);
    assert_int_equal(gca_allocated_bytes(a, d), 0);
    total_allocs += s.allocation[GCA_POOL_ALL].allocated;
    total_frees += s.allocation[GCA_POOL_ALL].freed;
  }
  assert_int_equal(total_allocs, total_frees);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(gca_reserved_bytes(a, 0) + gca_reserved_bytes(a, 1), 0);
  gca_close(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_concurrent_use)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
