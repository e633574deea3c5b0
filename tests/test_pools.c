/* Private pools (label `pools`): routing by thread (push/pop, nested) and
 * by stream, the default pool untouched; blocks reused only inside their
 * pool; reference counts and the release refused while anything is live or
 * routed, then done; statistics per pool; pool ids in snapshots and the
 * summary; the device's cache release leaving private pools alone, and the
 * out-of-memory ladder freeing the default cache for a pool; expandable
 * segments in a pool; threads routing to different pools at once; a seeded
 * random workload under the invariant checker after every step. */
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include "helpers.h"
#include "core/mempool.h"

#define S1 ((gca_stream_t)0x100)
#define S2 ((gca_stream_t)0x200)

static gca_pool_t new_pool(gca_allocator_t *a) {
  gca_pool_t id = 0;
  assert_int_equal(gca_pool_create(a, 0, &id), GCA_OK);
  assert_true(id > 0);
  return id;
}

static void test_default_untouched(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = new_pool(a);
  void *x = gca_malloc(a, 4 * MiB, 0, 0), *y = gca_malloc(a, 4 * KiB, 0, S1);
  assert_int_equal(pool_of(a, x), 0);
  assert_int_equal(pool_of(a, y), 0);
  gca_pool_stats_t s = pool_stats(a, p);
  assert_int_equal(s.segments, 0);
  assert_int_equal(s.reserved_bytes, 0);
  assert_int_equal(s.references, 1);
  gca_free(a, x);
  gca_free(a, y);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

static void test_thread_routes_nest(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = new_pool(a), q = new_pool(a);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 1 * MiB, 0, 0);
  assert_int_equal(gca_pool_push(a, q), GCA_OK);
  void *y = gca_malloc(a, 3 * MiB, 0, S1);
  assert_int_equal(gca_pool_push(a, 0), GCA_OK); /* the default pool, inside q */
  void *z = gca_malloc(a, 2 * KiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  void *w = gca_malloc(a, 2 * KiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  void *v = gca_malloc(a, 2 * KiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  void *u = gca_malloc(a, 2 * KiB, 0, 0);
  assert_int_equal(pool_of(a, x), p);
  assert_int_equal(pool_of(a, y), q);
  assert_int_equal(pool_of(a, z), 0);
  assert_int_equal(pool_of(a, w), q);
  assert_int_equal(pool_of(a, v), p);
  assert_int_equal(pool_of(a, u), 0);
  /* Nothing left to pop; a push of a pool that does not exist. */
  assert_int_equal(gca_pool_pop(a), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "it has none");
  assert_int_equal(gca_pool_push(a, 12345), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "pool 12345 does not exist");
  assert_consistent(a);
  for (void **b = (void *[]){x, y, z, w, v, u, NULL}; *b; b++) assert_int_equal(gca_free(a, *b), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(gca_pool_release(a, q), GCA_OK);
  gca_close(a);
}

static void test_stream_routes(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = new_pool(a), q = new_pool(a);
  assert_int_equal(gca_pool_route_stream(a, p, S1), GCA_OK);
  assert_int_equal(gca_pool_route_stream(a, q, S1), GCA_ERR_INVALID); /* one pool a stream */
  assert_contains(gca_last_error(), "is routed to pool");
  void *x = gca_malloc(a, 1 * MiB, 0, S1), *y = gca_malloc(a, 1 * MiB, 0, S2);
  assert_int_equal(pool_of(a, x), p);
  assert_int_equal(pool_of(a, y), 0);
  /* A thread's push wins over the stream's route. */
  assert_int_equal(gca_pool_push(a, q), GCA_OK);
  void *z = gca_malloc(a, 1 * MiB, 0, S1);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(pool_of(a, z), q);
  assert_int_equal(pool_stats(a, p).routes, 1);
  assert_int_equal(gca_pool_unroute_stream(a, q, S1), GCA_ERR_INVALID);
  assert_int_equal(gca_pool_unroute_stream(a, p, S1), GCA_OK);
  void *w = gca_malloc(a, 1 * MiB, 0, S1);
  assert_int_equal(pool_of(a, w), 0);
  for (void **b = (void *[]){x, y, z, w, NULL}; *b; b++) assert_int_equal(gca_free(a, *b), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(gca_pool_release(a, q), GCA_OK);
  gca_close(a);
}

/* A block freed in a pool serves only that pool's allocations. */
static void test_reuse_only_inside(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = new_pool(a);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 4 * MiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_free(a, x), GCA_OK);
  int64_t reserved = stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current;
  void *y = gca_malloc(a, 4 * MiB, 0, 0); /* the default pool: a segment of its own */
  assert_ptr_not_equal(x, y);
  assert_true(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current > reserved);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *z = gca_malloc(a, 4 * MiB, 0, 0); /* the pool's block again */
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_ptr_equal(x, z);
  gca_pool_stats_t s = pool_stats(a, p);
  assert_int_equal(s.segments, 1);
  assert_int_equal(s.reserved_bytes, 20 * MiB); /* a 4 MiB request takes a 20 MiB segment (kLargeBuffer) */
  assert_int_equal(s.allocations, 1);
  assert_int_equal(s.allocated_bytes, 4 * MiB);
  assert_int_equal(s.requested_bytes, 4 * MiB);
  assert_int_equal(s.cached_bytes, 16 * MiB);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_free(a, z), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  gca_close(a);
}

/* Release: refused while a block is live or a route leads to the pool (and
 * nothing changes), done once neither holds; references counted. */
static void test_release_refused_then_done(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = new_pool(a);
  assert_int_equal(gca_pool_retain(a, p), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 30 * MiB, 0, 0);
  void *y = gca_malloc(a, 100 * KiB, 0, 0);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK); /* 2 references: one goes */
  assert_int_equal(pool_stats(a, p).references, 1);
  gca_stats_t before = stats_of(a, 0);
  assert_int_equal(gca_pool_release(a, p), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "1 block (30.00 MiB) of it is live");
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "allocations are routed to it (1 thread push, 0 streams)");
  gca_stats_t after = stats_of(a, 0);
  assert_int_equal(before.reserved_bytes[GCA_POOL_ALL].current, after.reserved_bytes[GCA_POOL_ALL].current);
  assert_int_equal(pool_stats(a, p).references, 1);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  /* Its memory went back, and the pool is no more. */
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.used, 0);
  gca_pool_stats_t s;
  assert_int_equal(gca_pool_get_stats(a, p, &s), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "(it was released)");
  assert_int_equal(gca_pool_release(a, p), GCA_ERR_INVALID);
  assert_consistent(a);
  gca_close(a);
}

/* gca_empty_cache leaves a pool's cache (its graphs' memory); the ladder
 * frees the default pool's cache for a pool's request. */
static void test_cache_release_and_pressure(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", NULL);
  gca_pool_t p = new_pool(a);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 30 * MiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_free(a, x), GCA_OK);
  void *y = gca_malloc(a, 60 * MiB, 0, 0);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 30 * MiB);
  assert_int_equal(pool_stats(a, p).cached_bytes, 30 * MiB);
  /* Default cache of 60 MiB; the pool needs 50 more: the ladder frees the default cache. */
  void *big = gca_malloc(a, 60 * MiB, 0, 0);
  assert_int_equal(gca_free(a, big), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *z = gca_malloc(a, 50 * MiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_non_null(z);
  assert_int_equal(pool_of(a, z), p);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 80 * MiB);
  /* The pool's own cache is not given up for the default pool. */
  void *w = gca_malloc(a, 40 * MiB, 0, 0);
  assert_null(w);
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_int_equal(gca_free(a, z), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
  gca_close(a);
}

static void test_snapshot_and_summary_name_pools(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = new_pool(a);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 3 * MiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  void *y = gca_malloc(a, 1 * MiB, 0, 0);
  gca_snapshot_t *sn = NULL;
  assert_int_equal(gca_snapshot_take(a, &sn), GCA_OK);
  assert_int_equal(sn->segment_count, 2);
  int in_pool = 0;
  for (size_t i = 0; i < sn->segment_count; i++) in_pool += sn->segments[i].pool_id == p;
  assert_int_equal(in_pool, 1);
  char path[64], expect[64];
  snprintf(path, sizeof path, "/tmp/gcalloc-pools-%d.json", (int)getpid());
  assert_int_equal(gca_snapshot_write(sn, path, GCA_SNAPSHOT_JSON), GCA_OK);
  size_t len;
  char *json = (char *)read_whole(path, &len);
  snprintf(expect, sizeof expect, "\"segment_pool_id\":[%llu,0]", (unsigned long long)p);
  assert_contains(json, expect);
  assert_contains(json, "\"segment_pool_id\":[0,0]");
  free(json);
  unlink(path);
  gca_snapshot_free(sn);
  char text[8192];
  assert_true(gca_memory_summary(a, 0, 0, text, sizeof text) > 0);
  snprintf(expect, sizeof expect, "| pool %llu ", (unsigned long long)p);
  assert_contains(text, expect);
  assert_contains(text, "Private pool");
  gca_free(a, x);
  gca_free(a, y);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_true(gca_memory_summary(a, 0, 0, text, sizeof text) > 0);
  assert_null(strstr(text, "Private pool"));
  gca_close(a);
}

static void test_expandable_segments_in_a_pool(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "expandable_segments:True");
  gca_pool_t p = new_pool(a);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *b[8];
  for (int i = 0; i < 8; i++) b[i] = gca_malloc(a, (size_t)(i + 1) * 3 * MiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  void *d = gca_malloc(a, 5 * MiB, 0, 0);
  for (int i = 0; i < 8; i++) assert_int_equal(pool_of(a, b[i]), p);
  assert_int_equal(pool_of(a, d), 0);
  assert_consistent(a);
  for (int i = 0; i < 8; i += 2) assert_int_equal(gca_free(a, b[i]), GCA_OK);
  assert_consistent(a);
  for (int i = 1; i < 8; i += 2) assert_int_equal(gca_free(a, b[i]), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_free(a, d), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(sim_counters(a, 0).used, 0);
  gca_close(a);
}

/* Threads pushing their own pools at once each allocate in their own. */
typedef struct worker {
  gca_allocator_t *a;
  gca_pool_t pool;
  int wrong;
} worker_t;

static void *work(void *arg) {
  worker_t *w = arg;
  void *held[16] = {0};
  uint64_t seed = w->pool * 7919;
  if (gca_pool_push(w->a, w->pool) != GCA_OK) w->wrong++;
  for (int i = 0; i < 4000; i++) {
    int k = (int)(next_random(&seed) % 16);
    if (held[k]) {
      gca_pool_t id = 0;
      if (gca_pool_of(w->a, held[k], &id) != GCA_OK || id != w->pool) w->wrong++;
      if (gca_free(w->a, held[k]) != GCA_OK) w->wrong++;
      held[k] = NULL;
    } else {
      held[k] = gca_malloc(w->a, 512 + next_random(&seed) % (3 * MiB), 0, 0);
      if (!held[k]) w->wrong++;
    }
  }
  if (gca_pool_pop(w->a) != GCA_OK) w->wrong++;
  for (int k = 0; k < 16; k++)
    if (held[k] && gca_free(w->a, held[k]) != GCA_OK) w->wrong++;
  return NULL;
}

static void test_threads_route_to_their_pools(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  worker_t w[4];
  pthread_t t[4];
  for (int i = 0; i < 4; i++) {
    w[i] = (worker_t){a, new_pool(a), 0};
    assert_int_equal(pthread_create(&t[i], NULL, work, &w[i]), 0);
  }
  for (int i = 0; i < 4; i++) {
    assert_int_equal(pthread_join(t[i], NULL), 0);
    assert_int_equal(w[i].wrong, 0);
  }
  assert_consistent(a);
  for (int i = 0; i < 4; i++) assert_int_equal(gca_pool_release(a, w[i].pool), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
  gca_close(a);
}

/* A seeded random workload over the default pool and three private ones,
 * routed by pushes and by streams, with stream uses and pool releases, on a
 * small device (the ladder runs): the invariants hold after every step, and
 * at the end everything goes back. */
static void run_random(const char *conf) {
  gca_allocator_t *a = open_sim("sim:capacity=256MiB", conf);
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  gca_pool_t pools[3] = {new_pool(a), new_pool(a), new_pool(a)};
  void *held[64] = {0};
  gca_pool_t where[64] = {0};
  gca_stream_t streams[3] = {0, S1, S2};
  for (int step = 0; step < 3000; step++) {
    int k = (int)(next_random(&seed) % 64);
    uint64_t r = next_random(&seed);
    if (held[k]) {
      assert_int_equal(pool_of(a, held[k]), where[k]);
      if (r % 5 == 0) assert_int_equal(gca_record_stream(a, held[k], S2), GCA_OK);
      assert_int_equal(gca_free(a, held[k]), GCA_OK);
      held[k] = NULL;
    } else {
      int route = (int)(r % 5); /* 0: none, 1-3: push pools[route-1], 4: stream S1 routed to pools[0] */
      gca_stream_t stream = streams[(r >> 8) % 3];
      size_t size = (r >> 16) % 4 == 0 ? 1 + (r >> 20) % (24 * MiB) : 1 + (r >> 20) % (600 * KiB);
      if (route >= 1 && route <= 3) assert_int_equal(gca_pool_push(a, pools[route - 1]), GCA_OK);
      if (route == 4) {
        assert_int_equal(gca_pool_route_stream(a, pools[0], S1), GCA_OK);
        stream = S1;
      }
      held[k] = gca_malloc(a, size, 0, stream);
      if (route >= 1 && route <= 3) assert_int_equal(gca_pool_pop(a), GCA_OK);
      if (route == 4) assert_int_equal(gca_pool_unroute_stream(a, pools[0], S1), GCA_OK);
      where[k] = route >= 1 && route <= 3 ? pools[route - 1] : route == 4 ? pools[0] : 0;
      if (!held[k]) assert_int_equal(gca_last_status(), GCA_ERR_OOM);
    }
    if (step % 500 == 499) { /* a pool refuses to end while it holds blocks, then ends; another takes its place */
      int i = (int)(r % 3), live = 0;
      for (int j = 0; j < 64; j++) live += held[j] && where[j] == pools[i];
      if (live) {
        assert_int_equal(gca_pool_release(a, pools[i]), GCA_ERR_INVALID);
        assert_contains(gca_last_error(), "of it");
      }
      for (int j = 0; j < 64; j++)
        if (held[j] && where[j] == pools[i]) {
          assert_int_equal(gca_free(a, held[j]), GCA_OK);
          held[j] = NULL;
        }
      assert_int_equal(gca_synchronize(a, 0), GCA_OK); /* (frees waiting for S2's work complete) */
      assert_int_equal(gca_pool_release(a, pools[i]), GCA_OK);
      pools[i] = new_pool(a);
    }
    if (step % 700 == 0) assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
    assert_consistent(a);
  }
  for (int k = 0; k < 64; k++)
    if (held[k]) assert_int_equal(gca_free(a, held[k]), GCA_OK);
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  for (int i = 0; i < 3; i++) assert_int_equal(gca_pool_release(a, pools[i]), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_consistent(a);
  gca_close(a);
}

static void test_random_workload(void **state) {
  (void)state;
  run_random(NULL);
}

static void test_random_workload_expandable(void **state) {
  (void)state;
  run_random("expandable_segments:True");
}

/* ---- graph capture ------------------------------------------------------- */

static int64_t pending_frees(gca_allocator_t *a) {
  gca_stats_t s = stats_of(a, 0);
  return s.active[GCA_POOL_ALL].current - s.allocation[GCA_POOL_ALL].current;
}

/* Without the allocator told of the capture, the sim's model refuses what a
 * driver would: a cache release is a device free, refused and counted. */
static void test_sim_refuses_during_capture(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *p = gca_malloc(a, 4 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca__sim_set_capture(&a->backend, 0, true), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK); /* (the device's refusal is absorbed: the segment stays) */
  assert_true(sim_counters(a, 0).capture_violations > 0);
  assert_int_equal(gca__sim_set_capture(&a->backend, 0, false), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  gca_close(a);
}

/* A capture of a random alloc/free sequence on several streams (the
 * captured one, and two others with stream uses), on a device small enough
 * that requests miss and the ladder runs: the sim, modelling the capture,
 * refuses nothing because nothing forbidden is asked of it; calls that
 * would synchronize or free are refused by gcalloc; the frees of blocks
 * used on other streams wait until the capture ends, then complete. */
static void run_capture(const char *conf) {
  gca_allocator_t *a = open_sim("sim:capacity=192MiB", conf);
  gca_pool_t graph = new_pool(a), other = new_pool(a);
  uint64_t seed = 0x5851f42d4c957f2dull;
  /* Before the capture: cache in the default pool, and a free still waiting for S2's work. */
  void *warm = gca_malloc(a, 40 * MiB, 0, S2);
  assert_int_equal(gca__sim_launch(&a->backend, 0, S2, 1000000, (uintptr_t)warm, 40 * MiB), GCA_OK);
  assert_int_equal(gca_record_stream(a, warm, 0), GCA_OK);
  assert_int_equal(gca_free(a, warm), GCA_OK);
  assert_int_equal(pending_frees(a), 1);

  assert_int_equal(gca_capture_begin(a, graph, S1), GCA_OK);
  assert_int_equal(gca__sim_set_capture(&a->backend, 0, true), GCA_OK);
  assert_int_equal(gca_capture_begin(a, other, S1), GCA_ERR_INVALID); /* (one capture a stream) */
  void *held[48] = {0};
  gca_stream_t on[48];
  gca_stream_t streams[3] = {S1, S1, S2};
  int misses = 0, deferred = 0;
  for (int step = 0; step < 1500; step++) {
    int k = (int)(next_random(&seed) % 48);
    uint64_t r = next_random(&seed);
    if (held[k]) {
      if (r % 4 == 0) {
        assert_int_equal(gca_record_stream(a, held[k], on[k] == S1 ? S2 : S1), GCA_OK);
        deferred++;
      }
      assert_int_equal(gca_free(a, held[k]), GCA_OK);
      held[k] = NULL;
    } else {
      on[k] = streams[r % 3];
      size_t size = (r >> 8) % 3 == 0 ? 1 + (r >> 16) % (12 * MiB) : 1 + (r >> 16) % (300 * KiB);
      held[k] = gca_malloc(a, size, 0, on[k]);
      if (!held[k]) {
        assert_int_equal(gca_last_status(), GCA_ERR_OOM);
        misses++;
      } else if (on[k] == S1) {
        assert_int_equal(pool_of(a, held[k]), graph);
      }
    }
    if (step % 300 == 0) {
      assert_int_equal(gca_empty_cache(a, -1), GCA_ERR_INVALID);
      assert_contains(gca_last_error(), "captured into a graph");
      assert_int_equal(gca_synchronize(a, 0), GCA_ERR_INVALID);
      assert_int_equal(gca_pool_release(a, other), GCA_ERR_INVALID);
      assert_int_equal(gca_process_events(a, 0), GCA_OK); /* (queries nothing) */
    }
    assert_consistent(a);
    assert_int_equal(sim_counters(a, 0).capture_violations, 0);
  }
  assert_true(misses > 0); /* the device filled up: the ladder ran, under the capture's rules */
  assert_true(deferred > 0);
  int64_t waiting = pending_frees(a);
  assert_true(waiting > 1); /* the earlier free, and frees held for the capture's end */
  assert_int_equal(gca__sim_set_capture(&a->backend, 0, false), GCA_OK);
  assert_int_equal(gca_capture_end(a, graph, S1), GCA_OK);
  assert_int_equal(gca_capture_end(a, graph, S1), GCA_ERR_INVALID);
  /* After the end, the held frees record their events and complete with the streams' work. */
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  assert_int_equal(pending_frees(a), 0);
  assert_consistent(a);
  for (int k = 0; k < 48; k++)
    if (held[k]) assert_int_equal(gca_free(a, held[k]), GCA_OK);
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  assert_int_equal(gca_pool_release(a, graph), GCA_OK);
  assert_int_equal(gca_pool_release(a, other), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_int_equal(sim_counters(a, 0).capture_violations, 0);
  assert_consistent(a);
  gca_close(a);
}

static void test_capture_random_sequence(void **state) {
  (void)state;
  run_capture(NULL);
}

static void test_capture_random_sequence_expandable(void **state) {
  (void)state;
  run_capture("expandable_segments:True,stitching:True");
}

static void test_capture_random_sequence_cross_stream(void **state) {
  (void)state;
  run_capture("cross_stream_reuse:2,garbage_collection_threshold:0.5,per_process_memory_fraction:0.9");
}

/* ---- pause and resume ------------------------------------------------------ */

static void test_pause_refusals(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t plain = new_pool(a), p = 0;
  assert_int_equal(gca_pool_pause(a, plain, 0, NULL), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "cannot pause (create it with GCA_POOL_PAUSABLE)");
  assert_int_equal(gca_pool_create_ex(a, 0, 8, &p), GCA_ERR_INVALID);
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_ERR_INVALID); /* running */
  assert_contains(gca_last_error(), "is not paused");
  assert_int_equal(gca_pool_pause(a, p, 4, NULL), GCA_ERR_INVALID); /* unknown flag */
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 3 * MiB, 0, 0);
  assert_non_null(x);
  size_t released = 0, first_released;
  assert_int_equal(gca_pool_pause(a, p, 0, &released), GCA_OK);
  assert_true(released >= 3 * MiB);
  first_released = released;
  assert_null(gca_malloc(a, 1 * MiB, 0, 0)); /* routed to a paused pool */
  assert_int_equal(gca_last_status(), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "it is paused (resume it first)");
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  gca_stats_t before = stats_of(a, 0);
  assert_int_equal(gca_pool_pause(a, p, 0, &released), GCA_ERR_INVALID); /* paused already: nothing changes */
  assert_contains(gca_last_error(), "is paused already");
  assert_int_equal(released, 0);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, before.reserved_bytes[GCA_POOL_ALL].current);
  gca_pool_stats_t s = pool_stats(a, p);
  assert_true(s.pausable && s.paused);
  assert_int_equal(s.reserved_bytes, 0);
  assert_int_equal(s.allocations, 1);
  assert_consistent(a);
  /* Capture rules: no pause or resume during one. */
  gca_pool_t g = new_pool(a);
  assert_int_equal(gca_capture_begin(a, g, S1), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_ERR_INVALID);
  assert_int_equal(gca_capture_end(a, g, S1), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  assert_int_equal(pool_stats(a, p).reserved_bytes, first_released);
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(gca_pool_release(a, g), GCA_OK);
  assert_int_equal(gca_pool_release(a, plain), GCA_OK);
  gca_close(a);
  /* A device without virtual memory has no pausable pools. */
  a = open_sim("sim:vm=0", NULL);
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "has no virtual memory");
  gca_close(a);
}

/* A pause gives the pool's memory back: the device's free memory rises by
 * what it reported, another allocation can use it meanwhile; the host
 * copies are taken and written back; the addresses stay; a free while
 * paused gives nothing back twice and drops its copy. */
static void test_pause_gives_memory_back(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB", NULL);
  gca_pool_t p = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *big = gca_malloc(a, 600 * MiB, 0, 0), *mid = gca_malloc(a, 30 * MiB, 0, S1), *small = gca_malloc(a, 5000, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_true(big && mid && small);
  size_t free_before, total;
  assert_int_equal(gca_mem_get_info(a, 0, &free_before, &total), GCA_OK);
  uint64_t pool_reserved = pool_stats(a, p).reserved_bytes;
  sim_counters_t c0 = sim_counters(a, 0);
  size_t released = 0;
  assert_int_equal(gca_pool_pause(a, p, GCA_PAUSE_BACKUP, &released), GCA_OK);
  assert_int_equal(released, pool_reserved);
  size_t free_after;
  assert_int_equal(gca_mem_get_info(a, 0, &free_after, &total), GCA_OK);
  assert_int_equal(free_after - free_before, released);
  sim_counters_t c1 = sim_counters(a, 0);
  assert_int_equal(c0.used - c1.used, released);
  assert_int_equal(c1.copied_to_host - c0.copied_to_host, 600 * MiB + 30 * MiB + 5000);
  gca_pool_stats_t s = pool_stats(a, p);
  assert_int_equal(s.backup_bytes, 600 * MiB + 30 * MiB + 5000);
  assert_int_equal(host_stats(a).allocated_bytes.current >= (int64_t)(630 * MiB), 1);
  /* The memory is the device's again: the default pool takes most of it meanwhile. */
  void *other = gca_malloc(a, 900 * MiB, 0, 0);
  assert_non_null(other);
  assert_int_equal(gca_free(a, other), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  /* Freed while paused: its copy goes, nothing is given back twice. */
  assert_int_equal(gca_free(a, mid), GCA_OK);
  assert_int_equal(pool_stats(a, p).backup_bytes, 600 * MiB + 5000);
  assert_int_equal(sim_counters(a, 0).used, c1.used);
  assert_consistent(a);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  sim_counters_t c2 = sim_counters(a, 0);
  assert_int_equal(c2.used, c0.used); /* the same pages mapped again */
  assert_int_equal(c2.copied_to_device - c1.copied_to_device, 600 * MiB + 5000);
  assert_int_equal(pool_stats(a, p).backup_bytes, 0);
  assert_int_equal(host_stats(a).allocated_bytes.current, 0);
  assert_int_equal(pool_of(a, big), p);
  assert_int_equal(pool_of(a, small), p);
  assert_consistent(a);
  /* The pool works as before. */
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *again = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_ptr_equal(again, mid); /* its block, at its address */
  for (void **b = (void *[]){big, small, again, NULL}; *b; b++) assert_int_equal(gca_free(a, *b), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_consistent(a);
  gca_close(a);
}

/* GCA_POOL_FINE_PAGES: segments sized by the caller (PyTorch's MemPool
 * asks for 2 MiB, 20 MiB, or a request rounded to 2 MiB) map 2 MiB pages,
 * so that the pool holds what was asked and a pause gives back that; with
 * 20 MiB pages a 24 MiB segment held 40 MiB. */
static void test_fine_pages_hold_what_was_asked(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB", NULL);
  gca_pool_t fine = 0, coarse = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE | GCA_POOL_FINE_PAGES, &fine), GCA_OK);
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &coarse), GCA_OK);
  void *p[2][3];
  for (int k = 0; k < 2; k++) {
    assert_int_equal(gca_pool_push(a, k ? coarse : fine), GCA_OK);
    size_t sizes[3] = {24 * MiB, 2 * MiB, 20 * MiB};
    for (int i = 0; i < 3; i++) assert_non_null(p[k][i] = gca_malloc(a, sizes[i], 0, 0));
    assert_int_equal(gca_pool_pop(a), GCA_OK);
  }
  assert_int_equal(pool_stats(a, fine).reserved_bytes, 46 * MiB);
  assert_true(pool_stats(a, coarse).reserved_bytes > 46 * MiB);
  size_t released = 0;
  assert_int_equal(gca_pool_pause(a, fine, 0, &released), GCA_OK);
  assert_int_equal(released, 46 * MiB);
  assert_int_equal(gca_pool_resume(a, fine, 0), GCA_OK);
  assert_consistent(a);
  for (int k = 0; k < 2; k++)
    for (int i = 0; i < 3; i++) assert_int_equal(gca_free(a, p[k][i]), GCA_OK);
  assert_int_equal(gca_pool_release(a, fine), GCA_OK);
  assert_int_equal(gca_pool_release(a, coarse), GCA_OK);
  assert_int_equal(gca_pool_create_ex(a, 0, 4, &fine), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "unknown flags 0x4");
  gca_close(a);
}

/* The region functions PyTorch's MemPool calls (gca_torch_region_malloc
 * and _free) serve only the pool the calling thread pushed: outside a push,
 * on a device out of range, for a size of 2^63 or more, and into a paused
 * pool they refuse with NULL (PyTorch raises its own out-of-memory error),
 * keeping the reason for gca_torch_last_failure; nothing is thrown. */
static void test_region_functions_serve_only_a_pushed_pool(void **state) {
  (void)state;
  assert_int_equal(gca_torch_init("sim:capacity=256MiB", NULL), GCA_OK);
  gca_allocator_t *a = gca_torch_allocator();
  assert_non_null(a);
  char why[1024];
  assert_null(gca_torch_region_malloc(20 * (ptrdiff_t)MiB, 0, NULL));
  gca_torch_last_failure(why, sizeof why);
  assert_contains(why, "outside gcalloc.torch.region()");
  gca_pool_t p = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE | GCA_POOL_FINE_PAGES, &p), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *segment = gca_torch_region_malloc(20 * (ptrdiff_t)MiB, 0, NULL);
  assert_non_null(segment);
  assert_int_equal(pool_of(a, segment), p);
  assert_int_equal(pool_stats(a, p).reserved_bytes, 20 * MiB);
  assert_null(gca_torch_region_malloc((ptrdiff_t)MiB, 7, NULL));
  gca_torch_last_failure(why, sizeof why);
  assert_contains(why, "device 7");
  assert_null(gca_torch_region_malloc(-1, 0, NULL));
  gca_torch_last_failure(why, sizeof why);
  assert_contains(why, "more than any device holds");
  assert_int_equal(gca_pool_pause(a, p, 0, NULL), GCA_OK);
  assert_null(gca_torch_region_malloc(2 * (ptrdiff_t)MiB, 0, NULL));
  gca_torch_last_failure(why, sizeof why);
  assert_contains(why, "it is paused");
  gca_torch_region_free(segment, 20 * (ptrdiff_t)MiB, 0, NULL); /* (legal while paused: nothing given back twice) */
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_consistent(a);
  gca_torch_shutdown();
}

/* A paused pool with nothing live can end: its addresses go back. */
static void test_release_while_paused(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 40 * MiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_pause(a, p, GCA_PAUSE_BACKUP, NULL), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_ERR_INVALID); /* x is live */
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.used, 0);
  assert_int_equal(c.vm_reserved, 0);
  assert_int_equal(host_stats(a).allocated_bytes.current, 0);
  assert_consistent(a);
  gca_close(a);
}

/* 1,000 cycles of a random workload, pausing (with and without copies,
 * freeing some blocks while paused) and resuming: after every cycle the
 * device holds exactly what the books say, nothing is left in pinned
 * memory, and the invariants hold; every 100 cycles, with the workload
 * freed and the pool paused, the device holds nothing at all (no page, no
 * allocation, no event left behind). */
/* A resume makes room as an allocation does: this process's own cache is
 * given back when the device is short (the peers are asked too, test_coop). */
static void test_resume_releases_own_cache(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=64MiB", NULL);
  gca_pool_t p = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 40 * MiB, 0, S1);
  assert_non_null(x);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_pause(a, p, 0, NULL), GCA_OK);
  void *y = gca_malloc(a, 40 * MiB, 0, S1); /* the default pool takes what the pause gave back */
  assert_non_null(y);
  assert_int_equal(gca_free(a, y), GCA_OK); /* ... and caches it */
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 40 * MiB);
  int64_t frees = stats_of(a, 0).num_device_free;
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  assert_int_equal(pool_stats(a, p).reserved_bytes, 40 * MiB);
  assert_int_equal(stats_of(a, 0).num_device_free, frees + 1); /* the cached segment */
  /* Short even with the cache given back: the pool's need in the message, and it stays paused. */
  assert_int_equal(gca_pool_pause(a, p, 0, NULL), GCA_OK);
  y = gca_malloc(a, 40 * MiB, 0, S1);
  assert_non_null(y);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "needs 40.00 MiB mapped back and stays paused");
  assert_true(pool_stats(a, p).paused);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

static void test_pause_resume_cycles(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=512MiB", NULL);
  gca_pool_t p = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_OK);
  uint64_t seed = 0xd1b54a32d192ed03ull;
  void *held[32] = {0};
  for (int cycle = 0; cycle < 1000; cycle++) {
    assert_int_equal(gca_pool_push(a, p), GCA_OK);
    for (int op = 0; op < 12; op++) {
      int k = (int)(next_random(&seed) % 32);
      uint64_t r = next_random(&seed);
      if (held[k]) {
        assert_int_equal(gca_free(a, held[k]), GCA_OK);
        held[k] = NULL;
      } else {
        held[k] = gca_malloc(a, 1 + r % ((r >> 40) % 4 == 0 ? 24 * MiB : 400 * KiB), 0, (r >> 20) % 2 ? S1 : 0);
        if (!held[k]) assert_int_equal(gca_last_status(), GCA_ERR_OOM);
      }
    }
    assert_int_equal(gca_pool_pop(a), GCA_OK);
    uint64_t reserved = pool_stats(a, p).reserved_bytes;
    size_t released = 0;
    assert_int_equal(gca_pool_pause(a, p, cycle % 2 ? GCA_PAUSE_BACKUP : 0, &released), GCA_OK);
    assert_int_equal(released, reserved);
    for (int k = 0; k < 32; k += 7)
      if (held[k] && next_random(&seed) % 3 == 0) {
        assert_int_equal(gca_free(a, held[k]), GCA_OK);
        held[k] = NULL;
      }
    assert_consistent(a);
    /* The free cache went for good at the pause: the resume maps back the pages that held live blocks. */
    size_t paused = gca__mempool_paused_bytes(&a->devices[0], gca__mempool_find(&a->devices[0], p));
    assert_true(paused <= reserved);
    assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
    assert_int_equal(pool_stats(a, p).reserved_bytes, paused);
    sim_counters_t c = sim_counters(a, 0);
    gca_stats_t st = stats_of(a, 0);
    assert_int_equal(c.used, (size_t)st.reserved_bytes[GCA_POOL_ALL].current); /* the device holds what the books say */
    assert_int_equal(host_stats(a).allocated_bytes.current, 0);
    assert_int_equal(gca_host_empty_cache(a), GCA_OK);
    assert_int_equal(host_stats(a).reserved_bytes.current, 0);
    assert_consistent(a);
    if (cycle % 100 == 99) { /* everything freed: the same counts as the first time */
      for (int k = 0; k < 32; k++)
        if (held[k]) assert_int_equal(gca_free(a, held[k]), GCA_OK), held[k] = NULL;
      assert_int_equal(gca_synchronize(a, 0), GCA_OK);
      assert_int_equal(gca_pool_pause(a, p, GCA_PAUSE_BACKUP, NULL), GCA_OK);
      sim_counters_t now = sim_counters(a, 0);
      assert_int_equal(now.used, 0);
      assert_int_equal(now.live, 0);
      assert_int_equal(now.vm_handles, 0);
      assert_int_equal(now.vm_mapped, 0);
      assert_int_equal(now.events_live, 0);
      assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
      assert_int_equal(pool_stats(a, p).backup_bytes, 0);
      assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
    }
  }
  for (int k = 0; k < 32; k++)
    if (held[k]) assert_int_equal(gca_free(a, held[k]), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  sim_counters_t end = sim_counters(a, 0);
  assert_int_equal(end.used, 0);
  assert_int_equal(end.vm_handles, 0);
  assert_int_equal(end.vm_reserved, 0);
  assert_consistent(a);
  gca_close(a);
}

/* Patterns written before a pause read back the same, at the same
 * addresses, after the resume, though another allocation took the memory
 * and overwrote it meanwhile; the device's use fell by what the pause
 * reported (`used` reads it). */
static void patterns_survive(gca_allocator_t *a, size_t (*used)(gca_allocator_t *)) {
  gca_pool_t p = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  size_t sizes[5] = {4096, 100 * KiB, 3 * MiB, 21 * MiB + 12345, 64 * MiB};
  unsigned char *blocks[5];
  uint64_t seed = 42;
  for (int i = 0; i < 5; i++) {
    blocks[i] = gca_malloc(a, sizes[i], 0, 0);
    assert_non_null(blocks[i]);
    for (size_t j = 0; j < sizes[i]; j++) blocks[i][j] = (unsigned char)(next_random(&seed) >> 56);
  }
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  size_t before = used(a), released = 0;
  assert_int_equal(gca_pool_pause(a, p, GCA_PAUSE_BACKUP, &released), GCA_OK);
  assert_true(released > 0);
  assert_int_equal(before - used(a), released);
  void *other = gca_malloc(a, released, 0, 0);
  assert_non_null(other);
  memset(other, 0xA5, released);
  assert_int_equal(gca_free(a, other), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  assert_int_equal(used(a), before);
  seed = 42;
  for (int i = 0; i < 5; i++)
    for (size_t j = 0; j < sizes[i]; j++)
      if (blocks[i][j] != (unsigned char)(next_random(&seed) >> 56)) fail_msg("block %d byte %zu differs", i, j);
  /* Without copies the addresses come back, their contents do not matter. */
  assert_int_equal(gca_pool_pause(a, p, 0, NULL), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  blocks[0][0] = 1; /* (mapped again: writable) */
  for (int i = 0; i < 5; i++) assert_int_equal(gca_free(a, blocks[i]), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(used(a), 0);
}

static size_t (*fake_used)(int);
static size_t cuda_used(gca_allocator_t *a) {
  (void)a;
  return fake_used(0);
}

/* On the CUDA driver stand-in, whose mappings are real. */
static void test_pause_resume_on_cuda_stand_in(void **state) {
  (void)state;
  void *fake = dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
  assert_non_null(fake);
  void (*fake_reset)(void), (*fake_set_capacity)(size_t);
  *(void **)&fake_reset = dlsym(fake, "fakecuda_reset");
  *(void **)&fake_set_capacity = dlsym(fake, "fakecuda_set_capacity");
  *(void **)&fake_used = dlsym(fake, "fakecuda_used");
  fake_reset();
  fake_set_capacity((size_t)1 << 30);
  gca_allocator_t *a = open_sim("cuda:driver=" FAKE_CUDA_PATH, NULL);
  patterns_survive(a, cuda_used);
  gca_close(a);
  dlclose(fake);
}

static size_t sim_used(gca_allocator_t *a) { return sim_counters(a, 0).used; }

/* On the sim in backed mode, whose mappings are real too. */
static void test_pause_resume_on_backed_sim(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:backed=1,capacity=1GiB", NULL);
  patterns_survive(a, sim_used);
  sim_counters_t c = sim_counters(a, 0);
  assert_int_equal(c.copied_to_host, c.copied_to_device);
  assert_true(c.copied_to_host >= 88 * MiB);
  assert_int_equal(c.vm_reserved, 0);
  gca_close(a);
}

/* A block with a pattern of its own, in pool p. */
static unsigned char *patterned(gca_allocator_t *a, gca_pool_t p, int device, size_t size, unsigned char seed) {
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  unsigned char *b = gca_malloc(a, size, device, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_non_null(b);
  for (size_t i = 0; i < size; i++) b[i] = (unsigned char)(seed + i * 7);
  return b;
}

static void assert_pattern(const unsigned char *b, size_t size, unsigned char seed) {
  for (size_t i = 0; i < size; i++)
    if (b[i] != (unsigned char)(seed + i * 7)) fail_msg("byte %zu differs", i);
}

/* Every pool of every device (or of one) paused and resumed in one call;
 * a paused block's copy read in place; the copies given back to the system
 * at resume, or kept and pinned again for nothing at the next pause. */
static void test_pause_all_and_read_copies(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:backed=1,devices=2,capacity=256MiB", NULL);
  gca_pool_t p0, p0b, p1, plain;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p0), GCA_OK);
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p0b), GCA_OK);
  assert_int_equal(gca_pool_create_ex(a, 1, GCA_POOL_PAUSABLE, &p1), GCA_OK);
  assert_int_equal(gca_pool_create(a, 0, &plain), GCA_OK); /* (cannot pause: left alone) */
  const size_t size = 3 * MiB;
  unsigned char *b0 = patterned(a, p0, 0, size, 1), *b0b = patterned(a, p0b, 0, size, 2);
  unsigned char *b1 = patterned(a, p1, 1, size, 3), *bp = patterned(a, plain, 0, size, 4);
  int64_t pinned_before = host_stats(a).reserved_bytes.current;

  size_t released = 0;
  assert_int_equal(gca_pool_pause_all(a, -1, GCA_PAUSE_BACKUP, &released), GCA_OK);
  assert_true(pool_stats(a, p0).paused && pool_stats(a, p0b).paused && pool_stats(a, p1).paused);
  assert_false(pool_stats(a, plain).paused);
  assert_true(released >= 3 * size);
  const void *copy = NULL;
  size_t left = 0;
  assert_int_equal(gca_pool_backup(a, b1 + 100, &copy, &left), GCA_OK);
  assert_int_equal(left, size - 100);
  assert_int_equal(memcmp(copy, (unsigned char[]){(unsigned char)(3 + 700), (unsigned char)(3 + 707)}, 2), 0);
  assert_int_equal(gca_pool_backup(a, bp, &copy, &left), GCA_ERR_BAD_POINTER); /* a running pool */
  assert_contains(gca_last_error(), "has no host copy");
  assert_null(copy);
  assert_int_equal(gca_pool_pause_all(a, -1, 0, NULL), GCA_OK); /* (nothing runs: nothing to do) */
  assert_int_equal(gca_pool_resume_all(a, -1, 0), GCA_OK);
  assert_pattern(b0, size, 1), assert_pattern(b0b, size, 2), assert_pattern(b1, size, 3);
  /* The copies went back to the system, not to the pinned cache. */
  assert_int_equal(host_stats(a).reserved_bytes.current, pinned_before);
  assert_int_equal(gca_pool_backup(a, b0, &copy, &left), GCA_ERR_BAD_POINTER);

  /* One device; the copies kept at resume serve the next pause. */
  assert_int_equal(gca_pool_pause_all(a, 0, GCA_PAUSE_BACKUP, NULL), GCA_OK);
  assert_false(pool_stats(a, p1).paused);
  assert_int_equal(gca_pool_resume_all(a, 0, GCA_RESUME_KEEP_BACKUP), GCA_OK);
  assert_int_equal(gca_pool_backup(a, b0b, &copy, &left), GCA_OK); /* (as at the pause) */
  assert_pattern(copy, size, 2);
  int64_t pinnings = host_stats(a).num_host_alloc;
  b0[0] ^= 0xFF; /* (written since: the next copy must be taken again) */
  assert_int_equal(gca_pool_pause_all(a, 0, GCA_PAUSE_BACKUP, NULL), GCA_OK);
  assert_int_equal(host_stats(a).num_host_alloc, pinnings);
  assert_int_equal(gca_pool_backup(a, b0, &copy, &left), GCA_OK);
  assert_int_equal(((const unsigned char *)copy)[0], (unsigned char)(1 ^ 0xFF));
  assert_int_equal(gca_pool_resume_all(a, -1, 0), GCA_OK);
  assert_int_equal(b0[0], (unsigned char)(1 ^ 0xFF));
  assert_int_equal(host_stats(a).reserved_bytes.current, pinned_before);

  assert_int_equal(gca_pool_pause_all(a, 7, 0, NULL), GCA_ERR_INVALID); /* no device 7 */
  assert_int_equal(gca_free(a, b0), GCA_OK);
  assert_int_equal(gca_free(a, b0b), GCA_OK);
  assert_int_equal(gca_free(a, b1), GCA_OK);
  assert_int_equal(gca_free(a, bp), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

/* Faults: a resume without memory fails, the pool paused and consistent,
 * the pages it mapped before running out given back, and completes once memory is
 * back; a pause whose copies find no pinned memory changes nothing. */
static void test_pause_resume_faults(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB,host_capacity=16MiB", NULL);
  gca_pool_t p = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *x = gca_malloc(a, 300 * MiB, 0, 0), *y = gca_malloc(a, 300 * MiB, 0, S1);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_true(x && y);
  uint64_t reserved = pool_stats(a, p).reserved_bytes;
  /* Copies of 600 MiB do not fit 16 MiB of pinned memory: refused, nothing changed. */
  size_t released = 1;
  assert_int_equal(gca_pool_pause(a, p, GCA_PAUSE_BACKUP, &released), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "gca_pool_pause: no pinned host memory for the copy");
  assert_int_equal(released, 0);
  gca_pool_stats_t s = pool_stats(a, p);
  assert_true(!s.paused && s.reserved_bytes == reserved && s.backup_bytes == 0);
  assert_int_equal(host_stats(a).allocated_bytes.current, 0);
  assert_consistent(a);
  /* Paused without copies; the device fills up meanwhile (all but 100 MiB). */
  assert_int_equal(gca_pool_pause(a, p, 0, &released), GCA_OK);
  assert_int_equal(released, reserved);
  void *filler = gca_malloc(a, 1024 * MiB - 100 * MiB - 20 * MiB, 0, 0);
  assert_non_null(filler);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "gca_pool_resume: pool");
  assert_contains(gca_last_error(), "stays paused");
  s = pool_stats(a, p);
  assert_true(s.paused);
  assert_int_equal(s.reserved_bytes, 0); /* (what it mapped before running out went back) */
  assert_consistent(a);
  assert_int_equal(gca_free(a, filler), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  assert_int_equal(pool_stats(a, p).reserved_bytes, reserved);
  assert_int_equal(sim_counters(a, 0).used, (size_t)stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current);
  assert_consistent(a);
  /* Past the memory fraction: the same. */
  assert_int_equal(gca_pool_pause(a, p, 0, NULL), GCA_OK);
  assert_int_equal(gca_set_memory_fraction(a, 0.25, 0), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "per_process_memory_fraction");
  assert_int_equal(gca_set_memory_fraction(a, 1.0, 0), GCA_OK);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_consistent(a);
  gca_close(a);
  /* The device refuses to destroy a page at the pause: kept, off the books' reserved bytes, given back
   * at a later release; the pool pauses and resumes all the same. */
  a = open_sim("sim:free_fail_at=1", NULL);
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &p), GCA_OK);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  x = gca_malloc(a, 10 * MiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_pause(a, p, GCA_PAUSE_BACKUP, NULL), GCA_OK);
  assert_int_equal(stats_of(a, 0).num_device_free_failures, 1);
  assert_consistent(a);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_consistent(a);
  gca_close(a);
}

/* On the CUDA driver stand-in during a capture in the driver's global
 * mode: a request that needs a new segment (plain, then expandable) gets
 * one, its driver calls made in relaxed mode, as a driver demands; the
 * stand-in itself refuses the same call outside relaxed mode. */
static void test_capture_on_cuda_stand_in(void **state) {
  (void)state;
  void *fake = dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
  assert_non_null(fake);
  void (*fake_reset)(void), (*fake_capture)(int);
  unsigned long (*fake_calls)(const char *);
  int (*mem_alloc)(uint64_t *, size_t);
  *(void **)&fake_reset = dlsym(fake, "fakecuda_reset");
  *(void **)&fake_capture = dlsym(fake, "fakecuda_capture");
  *(void **)&fake_calls = dlsym(fake, "fakecuda_calls");
  *(void **)&mem_alloc = dlsym(fake, "cuMemAlloc_v2");
  fake_reset();
  for (int expandable = 0; expandable < 2; expandable++) {
    gca_allocator_t *a = open_sim("cuda:driver=" FAKE_CUDA_PATH, expandable ? "expandable_segments:True" : NULL);
    gca_pool_t g = new_pool(a);
    assert_int_equal(gca_capture_begin(a, g, S1), GCA_OK);
    fake_capture(1);
    uint64_t raw = 0;
    assert_int_equal(mem_alloc(&raw, 4096), 900); /* (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) */
    unsigned long exchanges = fake_calls("cuThreadExchangeStreamCaptureMode");
    void *p = gca_malloc(a, 30 * MiB, 0, S1);
    if (!p) fprintf(stderr, "%s\n", gca_last_error());
    assert_non_null(p);
    assert_int_equal(pool_of(a, p), g);
    assert_true(fake_calls("cuThreadExchangeStreamCaptureMode") >= exchanges + 2);
    assert_int_equal(gca_free(a, p), GCA_OK);
    fake_capture(0);
    assert_int_equal(gca_capture_end(a, g, S1), GCA_OK);
    assert_int_equal(gca_pool_release(a, g), GCA_OK);
    gca_close(a);
  }
  dlclose(fake);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_default_untouched),
      cmocka_unit_test(test_thread_routes_nest),
      cmocka_unit_test(test_stream_routes),
      cmocka_unit_test(test_reuse_only_inside),
      cmocka_unit_test(test_release_refused_then_done),
      cmocka_unit_test(test_cache_release_and_pressure),
      cmocka_unit_test(test_snapshot_and_summary_name_pools),
      cmocka_unit_test(test_expandable_segments_in_a_pool),
      cmocka_unit_test(test_threads_route_to_their_pools),
      cmocka_unit_test(test_random_workload),
      cmocka_unit_test(test_random_workload_expandable),
      cmocka_unit_test(test_sim_refuses_during_capture),
      cmocka_unit_test(test_capture_random_sequence),
      cmocka_unit_test(test_capture_random_sequence_expandable),
      cmocka_unit_test(test_capture_random_sequence_cross_stream),
      cmocka_unit_test(test_pause_refusals),
      cmocka_unit_test(test_pause_gives_memory_back),
      cmocka_unit_test(test_fine_pages_hold_what_was_asked),
      cmocka_unit_test(test_region_functions_serve_only_a_pushed_pool),
      cmocka_unit_test(test_release_while_paused),
      cmocka_unit_test(test_resume_releases_own_cache),
      cmocka_unit_test(test_pause_resume_cycles),
      cmocka_unit_test(test_pause_resume_faults),
      cmocka_unit_test(test_pause_resume_on_cuda_stand_in),
      cmocka_unit_test(test_pause_resume_on_backed_sim),
      cmocka_unit_test(test_pause_all_and_read_copies),
      cmocka_unit_test(test_capture_on_cuda_stand_in),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
