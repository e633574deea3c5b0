/* Out-of-memory handling (label `oom`): each rung of the ladder taken
 * exactly when it should be, proven by the counters; garbage collection
 * oldest first; the memory fraction; waiting for memory another thread
 * frees, within and past the deadline; free-memory callbacks, OOM handlers
 * and observers; the message; transient device failures, a failure during
 * release and on the last retry. After every failure the invariant checker
 * runs and, at the end, nothing is left on the device. */
#include <math.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"

#define S1 ((gca_stream_t)0x100)
#define S2 ((gca_stream_t)0x200)
#define S3 ((gca_stream_t)0x300)

/* Free everything listed, empty the cache, and check nothing is left. */
static void close_empty(gca_allocator_t *a, void **ptrs, int n) {
  for (int i = 0; i < n; i++)
    if (ptrs[i]) assert_int_equal(gca_free(a, ptrs[i]), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(gca_reserved_bytes(a, 0), 0);
  assert_int_equal(sim_counters(a, 0).live, 0);
  gca_close(a);
}

static double elapsed_ms(const struct timespec *since) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)(now.tv_sec - since->tv_sec) * 1e3 + (double)(now.tv_nsec - since->tv_nsec) / 1e6;
}

/* throw_on_cudamalloc_oom (torch_npu's throw_on_npumalloc_oom): a request
 * the fraction refuses fails at once, the cache left as it was, counted in
 * num_oom_rejections; without it the ladder releases the cache and the
 * request succeeds. */
static void test_fraction_rejects_outright(void **state) {
  (void)state;
  const char *confs[] = {"per_process_memory_fraction:0.5", "per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True",
                         "per_process_memory_fraction:0.5,throw_on_npumalloc_oom:True"};
  for (int i = 0; i < 3; i++) {
    gca_allocator_t *a = open_sim("sim:capacity=128MiB", confs[i]);
    void *p = gca_malloc(a, 40 * MiB, 0, S1);
    assert_non_null(p);
    assert_int_equal(gca_free(a, p), GCA_OK); /* 40 MiB cached of the 64 allowed, for S1 */
    void *q = gca_malloc(a, 30 * MiB, 0, S2);
    gca_stats_t s = stats_of(a, 0);
    if (i == 0) {
      assert_non_null(q);
      assert_int_equal(s.num_oom_rejections, 0);
      assert_int_equal(s.num_device_free, 1);
    } else {
      assert_null(q);
      assert_int_equal(gca_last_status(), GCA_ERR_OOM);
      assert_contains(gca_last_error(), "rejected at once, the cache left alone");
      assert_int_equal(s.num_oom_rejections, 1);
      assert_int_equal(s.num_ooms, 1);
      assert_int_equal(s.num_device_free + s.num_alloc_retries + s.num_sync_all_streams, 0);
      assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 40 * MiB);
      gca_stat_item_t items[GCA_STATS_FLAT_COUNT];
      assert_int_equal(gca_stats_flatten(&s, items, GCA_STATS_FLAT_COUNT), GCA_STATS_FLAT_COUNT);
      bool found = false;
      for (size_t k = 0; k < GCA_STATS_FLAT_COUNT; k++)
        if (!strcmp(items[k].name, "num_oom_rejections")) found = items[k].value == 1;
      assert_true(found);
      char conf[1024];
      assert_true(gca_get_config(a, conf, sizeof conf) > 0);
      assert_contains(conf, "throw_on_cudamalloc_oom:True");
      assert_int_equal(gca_reset_accumulated_stats(a, 0), GCA_OK);
      assert_int_equal(stats_of(a, 0).num_oom_rejections, 0);
    }
    close_empty(a, &q, 1);
  }
}

/* ---- the ladder, rung by rung ------------------------------------------ */

static void test_ladder_rungs(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", NULL);
  /* Room on the device: a miss asks it once and nothing else happens. */
  void *p = gca_malloc(a, 60 * MiB, 0, S1);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_device_alloc, 1);
  assert_int_equal(s.num_alloc_retries + s.num_sync_all_streams + s.num_ooms + s.num_device_free, 0);
  /* Full, with p's segment cached for S1: a request on S2 releases the
   * cache after synchronizing (one sync, one free), retries once. */
  assert_int_equal(gca_free(a, p), GCA_OK);
  void *q = gca_malloc(a, 50 * MiB, 0, S2);
  assert_non_null(q);
  s = stats_of(a, 0);
  assert_int_equal(s.num_sync_all_streams, 1);
  assert_int_equal(s.num_device_free, 1);
  assert_int_equal(s.num_alloc_retries, 1);
  assert_int_equal(s.num_device_alloc, 2);
  assert_int_equal(s.num_ooms, 0);
  assert_int_equal(sim_counters(a, 0).malloc_calls, 3); /* fresh, refused, retried */
  /* Nothing left to release: out of memory, counted once. */
  assert_null(gca_malloc(a, 60 * MiB, 0, S2));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  s = stats_of(a, 0);
  assert_int_equal(s.num_ooms, 1);
  assert_int_equal(s.num_alloc_retries, 2);
  assert_int_equal(s.num_sync_all_streams, 2);
  assert_consistent(a);
  close_empty(a, &q, 1);
}

/* With max_split_size_mb, a cached oversize block of the stream is given
 * back first, without synchronizing (PyTorch's release_available_cached_blocks). */
static void test_ladder_releases_oversize_first(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", "max_split_size_mb:40");
  void *big = gca_malloc(a, 80 * MiB, 0, S1);
  assert_int_equal(gca_free(a, big), GCA_OK); /* cached, oversize */
  void *q = gca_malloc(a, 30 * MiB, 0, S1);    /* below max_split: may not take the oversize block; 20 MiB free */
  assert_non_null(q);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_device_free, 1);
  assert_int_equal(s.num_sync_all_streams, 0);
  assert_int_equal(s.num_alloc_retries, 0);
  close_empty(a, &q, 1);
}

static int callback_calls;
static void *callback_spill;
static gca_allocator_t *callback_allocator;

static int free_one_block(int device, size_t size, void *user) {
  (void)device;
  (void)size;
  callback_calls++;
  if (!callback_spill) return 0;
  assert_ptr_equal(user, &callback_calls);
  gca_free(callback_allocator, callback_spill); /* calling back into gcalloc: no lock is held */
  callback_spill = NULL;
  return 1;
}

/* Free-memory callbacks run at every miss, before the device is asked; if
 * one freed memory, the cache is searched again. */
static void test_free_memory_callbacks(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  callback_allocator = a;
  callback_calls = 0;
  callback_spill = gca_malloc(a, 30 * MiB, 0, S1);
  void *spill_addr = callback_spill;
  assert_int_equal(gca_add_free_memory_callback(a, free_one_block, &callback_calls), GCA_OK);
  void *q = gca_malloc(a, 30 * MiB, 0, S1); /* miss: the callback frees the spill, which serves it */
  assert_ptr_equal(q, spill_addr);
  assert_int_equal(callback_calls, 1);
  assert_int_equal(stats_of(a, 0).num_device_alloc, 1);
  void *r = gca_malloc(a, 30 * MiB, 0, S1); /* miss again: nothing to free, the device serves it */
  assert_non_null(r);
  assert_int_equal(callback_calls, 2);
  assert_int_equal(stats_of(a, 0).num_device_alloc, 2);
  assert_int_equal(gca_remove_free_memory_callback(a, free_one_block, &callback_calls), GCA_OK);
  assert_int_equal(gca_remove_free_memory_callback(a, free_one_block, &callback_calls), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "no such callback");
  void *t = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(callback_calls, 2);
  void *all[] = {q, r, t};
  close_empty(a, all, 3);
}

/* ---- garbage collection ------------------------------------------------ */

/* Ages are best-fit searches of the large pool since a block became free.
 * a, b, c are freed 10 searches apart (the searches hit e, another stream's
 * block); then GC must give back 20 MiB: the average age splits a and b
 * (oldest) from c and e, and one round suffices. */
static void gc_frees_oldest_first_from(uint64_t lookups) {
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", "per_process_memory_fraction:0.5");
  a->devices[0].large_pool.lookups = a->devices[0].small_pool.lookups = lookups;
  void *x[4];
  for (int i = 0; i < 4; i++) x[i] = gca_malloc(a, 10 * MiB, 0, S1); /* a, b, c, d: 40 MiB */
  void *e = gca_malloc(a, 10 * MiB, 0, S2);                          /* 50 MiB: all that is allowed */
  assert_int_equal(gca_free(a, e), GCA_OK);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(gca_free(a, x[i]), GCA_OK);
    for (int k = 0; k < 10; k++) { /* ten searches, each a hit on e */
      void *hit = gca_malloc(a, 10 * MiB, 0, S2);
      assert_ptr_equal(hit, e);
      assert_int_equal(gca_free(a, hit), GCA_OK);
    }
  }
  assert_int_equal(stats_of(a, 0).num_gc_releases, 0); /* no threshold yet: no GC */
  /* Threshold 0.6 x 50 MiB = 30 MiB; reserved 50: 20 MiB to reclaim. */
  assert_int_equal(gca_set_config(a, "garbage_collection_threshold:0.6"), GCA_OK);
  void *big = gca_malloc(a, 20 * MiB, 0, S3); /* a miss: GC runs before the device is asked */
  assert_non_null(big);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_gc_releases, 2);
  assert_int_equal(s.num_device_free, 2);
  assert_int_equal(s.num_alloc_retries, 0); /* GC made room: no release of the whole cache */
  assert_int_equal(s.num_sync_all_streams, 0);
  /* c and e are still cached: S1 gets c back, S2 gets e, from the cache. */
  assert_ptr_equal(gca_malloc(a, 10 * MiB, 0, S1), x[2]);
  assert_ptr_equal(gca_malloc(a, 10 * MiB, 0, S2), e);
  assert_int_equal(stats_of(a, 0).num_device_alloc, 6);
  /* A block handed out again has the flags of a block in use, not its free age's high bits. */
  block_t *b = gca__block_map_find(&a->devices[0].allocated, (uintptr_t)x[2]);
  assert_non_null(b);
  assert_false(b->traced_pending);
  assert_false(b->oversize);
  void *all[] = {x[2], x[3], e, big};
  close_empty(a, all, 4);
}

static void test_gc_frees_oldest_first(void **state) {
  (void)state;
  gc_frees_oldest_first_from(0);
}

/* The same, with the pools' search counts where a free block's stored age
 * has both high bytes set (they share bytes with an in-use block's flags)
 * and its low half wraps in the middle. */
static void test_gc_frees_oldest_first_past_2_to_the_40(void **state) {
  (void)state;
  gc_frees_oldest_first_from(UINT64_C(0x0101) << 32 | (UINT32_MAX - 12));
}

/* A free block keeps the pool's search count when it became free in 48
 * bits split over two fields: its age must come out exact across the low
 * half's wrap, at the top of the range, and when the pool's count itself
 * passes 2^48. */
static void test_gc_age_is_exact_across_wraps(void **state) {
  (void)state;
  static const uint64_t bases[] = {0, 41, UINT32_MAX - 2, UINT32_MAX, UINT64_C(1) << 32,
                                   (UINT64_C(1) << 48) - 5, (UINT64_C(1) << 48) + 7, UINT64_MAX - 3};
  static const uint64_t ages[] = {0, 1, 3, 4, UINT32_MAX, UINT64_C(1) << 32, UINT64_C(3) << 40,
                                  (UINT64_C(1) << 48) - 1};
  pool_t pool = {0};
  block_t b = {0};
  for (size_t i = 0; i < sizeof bases / sizeof *bases; i++)
    for (size_t k = 0; k < sizeof ages / sizeof *ages; k++) {
      block_set_gc_base(&b, bases[i]);
      pool.lookups = bases[i] + ages[k];
      assert_int_equal(block_gc_age(&pool, &b), ages[k]);
    }
}

/* GC needs a fraction: a threshold alone does nothing. */
static void test_gc_needs_a_fraction(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", "garbage_collection_threshold:0.1");
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  gca_free(a, p);
  void *q = gca_malloc(a, 30 * MiB, 0, S2);
  assert_int_equal(stats_of(a, 0).num_gc_releases, 0);
  assert_int_equal(stats_of(a, 0).num_device_free, 0);
  close_empty(a, &q, 1);
}

/* ---- memory fraction ---------------------------------------------------- */

static void test_memory_fraction(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB,devices=2", NULL);
  double f = 0;
  assert_int_equal(gca_get_memory_fraction(a, 0, &f), GCA_OK);
  assert_true(f == 1.0);
  assert_int_equal(gca_set_memory_fraction(a, 1.5, 0), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "invalid memory fraction 1.5 for device 0: it must be within [0, 1]");
  assert_int_equal(gca_set_memory_fraction(a, -0.1, 0), GCA_ERR_INVALID);
  assert_int_equal(gca_set_memory_fraction(a, NAN, 0), GCA_ERR_INVALID);
  assert_int_equal(gca_set_memory_fraction(a, 0.5, 2), GCA_ERR_INVALID);
  assert_int_equal(gca_set_memory_fraction(a, 0.25, 0), GCA_OK);
  assert_int_equal(gca_get_memory_fraction(a, 0, &f), GCA_OK);
  assert_true(f == 0.25);
  void *p = gca_malloc(a, 20 * MiB, 0, S1);
  assert_non_null(p);
  /* 20 + 10 > 25 MiB allowed: refused without asking the device. */
  assert_null(gca_malloc(a, 10 * MiB, 0, S1));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "25.00 MiB allowed; ");
  assert_contains(gca_last_error(), "raise the fraction");
  assert_int_equal(sim_counters(a, 0).malloc_calls, 1);
  /* Device 1 is not limited. */
  void *other = gca_malloc(a, 90 * MiB, 1, S1);
  assert_non_null(other);
  /* Raised, the same request fits. */
  assert_int_equal(gca_set_memory_fraction(a, 0.5, 0), GCA_OK);
  void *q = gca_malloc(a, 10 * MiB, 0, S1);
  assert_non_null(q);
  assert_int_equal(gca_free(a, other), GCA_OK);
  void *all[] = {p, q};
  close_empty(a, all, 2);
}

static void test_memory_fraction_from_configuration(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB,devices=2", "per_process_memory_fraction:0.3");
  double f = 0;
  assert_int_equal(gca_get_memory_fraction(a, 1, &f), GCA_OK);
  assert_true(f == 0.3);
  assert_null(gca_malloc(a, 40 * MiB, 1, S1));
  assert_int_equal(gca_set_memory_fraction(a, 0.9, 1), GCA_OK); /* per device, over the key */
  assert_int_equal(gca_set_config(a, "max_split_size_mb:64"), GCA_OK);
  assert_int_equal(gca_get_memory_fraction(a, 1, &f), GCA_OK);
  assert_true(f == 0.9); /* another key changed: the device's own setting stays */
  assert_int_equal(gca_set_config(a, "per_process_memory_fraction:0.6"), GCA_OK);
  assert_int_equal(gca_get_memory_fraction(a, 1, &f), GCA_OK);
  assert_true(f == 0.6); /* the key changed: every device follows */
  void *p = gca_malloc(a, 40 * MiB, 1, S1);
  assert_non_null(p);
  gca_free(a, p);
  close_empty(a, NULL, 0);
}

/* ---- waiting for memory to come back ---------------------------------- */

typedef struct freer {
  gca_allocator_t *a;
  void *p;
  unsigned delay_ms;
} freer_t;

static void *free_later(void *arg) {
  freer_t *f = arg;
  usleep(f->delay_ms * 1000u);
  gca_free(f->a, f->p);
  return NULL;
}

static void test_wait_for_memory_freed_by_another_thread(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", "oom_retry_timeout_ms:10000");
  freer_t f = {a, gca_malloc(a, 80 * MiB, 0, S1), 50};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, free_later, &f), 0);
  struct timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  void *q = gca_malloc(a, 60 * MiB, 0, S2); /* cannot fit until the other thread frees */
  double waited = elapsed_ms(&start);
  pthread_join(t, NULL);
  assert_non_null(q);
  assert_true(waited >= 40 && waited < 5000);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_alloc_waits, 1);
  assert_int_equal(s.num_ooms, 0);
  assert_int_equal(atomic_load(&a->devices[0].waiters), 0);
  close_empty(a, &q, 1);
}

static void test_wait_deadline_passes_cleanly(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", "oom_retry_timeout_ms:100");
  void *p = gca_malloc(a, 80 * MiB, 0, S1);
  struct timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  assert_null(gca_malloc(a, 60 * MiB, 0, S2));
  double waited = elapsed_ms(&start);
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_true(waited >= 95);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_alloc_waits, 1);
  assert_int_equal(s.num_ooms, 1);
  assert_int_equal(s.allocated_bytes[GCA_POOL_ALL].current, 80 * MiB);
  assert_int_equal(atomic_load(&a->devices[0].waiters), 0);
  assert_consistent(a);
  /* A request larger than the device can never fit: it does not wait. */
  clock_gettime(CLOCK_MONOTONIC, &start);
  assert_null(gca_malloc(a, 200 * MiB, 0, S2));
  assert_true(elapsed_ms(&start) < 50);
  assert_int_equal(stats_of(a, 0).num_alloc_waits, 1);
  close_empty(a, &p, 1);
}

/* ---- OOM handlers and observers ---------------------------------------- */

typedef struct handler_state {
  gca_allocator_t *a;
  void *spill;
  int calls;
  int ask; /* what to return */
} handler_state_t;

static int spill_handler(int device, size_t size, void *user) {
  handler_state_t *h = user;
  (void)device;
  (void)size;
  h->calls++;
  if (h->spill) {
    gca_free(h->a, h->spill);
    h->spill = NULL;
  }
  return h->ask;
}

typedef struct observed {
  int calls;
  int device;
  size_t size, limit, free_bytes;
} observed_t;

static void observe_oom(int device, size_t size, size_t limit, size_t free_bytes, void *user) {
  observed_t *o = user;
  o->calls++;
  o->device = device;
  o->size = size;
  o->limit = limit;
  o->free_bytes = free_bytes;
  /* Overwrites this thread's error: the OOM message must survive. */
  assert_int_equal(gca_free(NULL, (void *)1), GCA_ERR_INVALID);
}

static void test_oom_handler_frees_and_retries(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", NULL);
  handler_state_t h = {a, gca_malloc(a, 80 * MiB, 0, S1), 0, 1};
  assert_int_equal(gca_add_oom_handler(a, spill_handler, &h), GCA_OK);
  void *q = gca_malloc(a, 60 * MiB, 0, S2);
  assert_non_null(q);
  assert_int_equal(h.calls, 1);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_oom_handler_retries, 1);
  assert_int_equal(s.num_ooms, 0);
  close_empty(a, &q, 1);
}

static void test_oom_handler_retries_are_bounded(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", NULL);
  void *p = gca_malloc(a, 80 * MiB, 0, S1);
  handler_state_t asks = {a, NULL, 0, 1}, passes = {a, NULL, 0, 0};
  observed_t seen = {0};
  assert_int_equal(gca_add_oom_handler(a, spill_handler, &asks), GCA_OK);
  assert_int_equal(gca_add_oom_observer(a, observe_oom, &seen), GCA_OK);
  assert_null(gca_malloc(a, 60 * MiB, 0, S2)); /* asks every time, frees nothing */
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "out of memory. Tried to allocate 60.00 MiB.");
  assert_int_equal(asks.calls, 3); /* oom_handler_retries defaults to 3 */
  assert_int_equal(stats_of(a, 0).num_oom_handler_retries, 3);
  assert_int_equal(seen.calls, 1);
  assert_int_equal(seen.device, 0);
  assert_int_equal(seen.size, 60 * MiB);
  assert_int_equal(seen.limit, 100 * MiB);
  assert_int_equal(seen.free_bytes, 20 * MiB);
  /* A handler that does not ask for a retry is called once. */
  assert_int_equal(gca_remove_oom_handler(a, spill_handler, &asks), GCA_OK);
  assert_int_equal(gca_add_oom_handler(a, spill_handler, &passes), GCA_OK);
  assert_int_equal(gca_set_config(a, "oom_handler_retries:5"), GCA_OK);
  assert_null(gca_malloc(a, 60 * MiB, 0, S2));
  assert_int_equal(passes.calls, 1);
  assert_int_equal(seen.calls, 2);
  assert_int_equal(gca_remove_oom_observer(a, observe_oom, &seen), GCA_OK);
  assert_null(gca_malloc(a, 60 * MiB, 0, S2));
  assert_int_equal(seen.calls, 2);
  assert_int_equal(stats_of(a, 0).num_ooms, 3);
  close_empty(a, &p, 1);
}

static int never(int device, size_t size, void *user) {
  (void)device;
  (void)size;
  (void)user;
  return 0;
}

static void test_callback_registry_errors(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(gca_add_oom_handler(NULL, never, NULL), GCA_ERR_INVALID);
  assert_int_equal(gca_add_oom_handler(a, NULL, NULL), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "gca_add_oom_handler: function is NULL");
  int users[MAX_CALLBACKS + 1];
  for (int i = 0; i < MAX_CALLBACKS; i++) assert_int_equal(gca_add_oom_handler(a, never, &users[i]), GCA_OK);
  assert_int_equal(gca_add_oom_handler(a, never, &users[MAX_CALLBACKS]), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "32 callbacks");
  assert_int_equal(gca_remove_oom_handler(a, never, &users[5]), GCA_OK);
  assert_int_equal(gca_add_oom_handler(a, never, &users[MAX_CALLBACKS]), GCA_OK);
  gca_close(a);
}

/* ---- the message -------------------------------------------------------- */

/* Worked out by hand: a 100 MiB device; S1 holds a 20 MiB segment split
 * into a live 4 MiB block and 16 MiB free; S2 holds 70 MiB live. A 20 MiB
 * request on S2 cannot fit: 10 MiB is free on the device, and S1's 16 MiB
 * piece cannot move (split). */
static void test_message(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", NULL);
  void *keep = gca_malloc(a, 4 * MiB, 0, S1);
  void *big = gca_malloc(a, 70 * MiB, 0, S2);
  assert_null(gca_malloc(a, 20 * MiB, 0, S2));
  const char *m = gca_last_error();
  assert_contains(m, "out of memory. Tried to allocate 20.00 MiB. Device 0 has a total capacity of 100.00 MiB of "
                     "which 10.00 MiB is free. Of the allocated memory 74.00 MiB is allocated by gcalloc, and "
                     "16.00 MiB is reserved by gcalloc but unallocated.");
  assert_contains(m, "Cached free: the largest block 16.00 MiB; small pool 0 bytes in 0 blocks, large pool "
                     "16.00 MiB in 1 blocks; by stream: 0x100 16.00 MiB.");
  assert_contains(m, "16.00 MiB of it is cached for other streams, which this stream cannot use.");
  assert_contains(m, "To help: if other threads are about to free memory, set oom_retry_timeout_ms");
  void *all[] = {keep, big};
  close_empty(a, all, 2);
}

/* ---- faults from the device -------------------------------------------- */

/* The device fails twice, then recovers: with a wait configured, the
 * allocation succeeds on a retry after the wait. */
static void test_transient_failures(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:fail_at=2,fail_count=2", "oom_retry_timeout_ms:2000");
  void *p = gca_malloc(a, 4 * MiB, 0, S1);
  void *q = gca_malloc(a, 30 * MiB, 0, S1); /* device calls 2 and 3 fail, 4 succeeds */
  assert_non_null(q);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_alloc_waits, 1);
  assert_int_equal(s.num_alloc_retries, 1); /* the ladder's retry (call 3); call 4 came after the wait */
  assert_int_equal(s.num_ooms, 0);
  assert_int_equal(sim_counters(a, 0).malloc_calls, 4);
  void *all[] = {p, q};
  close_empty(a, all, 2);
}

/* Without a wait the same failures are a clean OOM, and the next request
 * works. */
static void test_transient_failures_without_waiting(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:fail_at=1,fail_count=2", NULL);
  assert_null(gca_malloc(a, 30 * MiB, 0, S1));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "out of memory");
  assert_consistent(a);
  void *q = gca_malloc(a, 30 * MiB, 0, S1);
  assert_non_null(q);
  close_empty(a, &q, 1);
}

/* The device refuses a free while the cache is released: the segment stays
 * cached and counted, nothing is lost, and a later release gives it back. */
static void test_failure_during_release(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB,free_fail_at=1", NULL);
  void *p = gca_malloc(a, 60 * MiB, 0, S1);
  gca_free(a, p);
  assert_null(gca_malloc(a, 60 * MiB, 0, S2)); /* the only cached segment cannot be given back */
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_device_free_failures, 1);
  assert_int_equal(s.num_device_free, 0);
  assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 60 * MiB);
  assert_int_equal(s.num_ooms, 1);
  assert_consistent(a);
  void *q = gca_malloc(a, 60 * MiB, 0, S2); /* the next release works */
  assert_non_null(q);
  assert_int_equal(stats_of(a, 0).num_device_free, 1);
  close_empty(a, &q, 1);
}

/* The device is full; the cache is released; the last retry fails too. */
static void test_failure_on_the_last_retry(void **state) {
  (void)state;
  /* Device calls: 1 (p), 2 (q: refused, full), 3 (q after release: injected). */
  gca_allocator_t *a = open_sim("sim:capacity=100MiB,fail_at=3", NULL);
  void *p = gca_malloc(a, 60 * MiB, 0, S1);
  gca_free(a, p);
  assert_null(gca_malloc(a, 60 * MiB, 0, S2));
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_alloc_retries, 1);
  assert_int_equal(s.num_device_free, 1);
  assert_int_equal(s.num_ooms, 1);
  assert_int_equal(s.reserved_bytes[GCA_POOL_ALL].current, 0);
  assert_consistent(a);
  close_empty(a, NULL, 0);
}

/* ---- random pressure ---------------------------------------------------- */

/* Seeded random allocations against a small device with faults injected,
 * a fraction, GC, a spilling handler and observers: every failure is a
 * clean OOM, the books always balance, nothing leaks. */
static void test_random_pressure(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=512MiB,fail_rate=0.05,seed=7",
                                "per_process_memory_fraction:0.8,garbage_collection_threshold:0.5,"
                                "max_split_size_mb:64,oom_handler_retries:2");
  void *slots[128] = {0};
  handler_state_t h = {a, NULL, 0, 1};
  observed_t seen = {0};
  assert_int_equal(gca_add_oom_handler(a, spill_handler, &h), GCA_OK);
  assert_int_equal(gca_add_oom_observer(a, observe_oom, &seen), GCA_OK);
  uint64_t rng = 99;
  int ooms = 0;
  for (int op = 0; op < 40000; op++) {
    int i = (int)(next_random(&rng) % 128);
    if (slots[i]) {
      assert_int_equal(gca_free(a, slots[i]), GCA_OK);
      slots[i] = NULL;
      continue;
    }
    size_t size = (size_t)1 << (9 + next_random(&rng) % 19);
    size += next_random(&rng) % size;
    gca_stream_t s = (gca_stream_t)(1 + next_random(&rng) % 3);
    slots[i] = gca_malloc(a, size, 0, s);
    if (!slots[i]) {
      assert_int_equal(gca_last_status(), GCA_ERR_OOM);
      ooms++;
      /* Give the handler something to spill next time. */
      int j = (int)(next_random(&rng) % 128);
      if (!h.spill && slots[j]) {
        h.spill = slots[j];
        slots[j] = NULL;
      }
    }
    if (op % 512 == 0) assert_consistent(a);
  }
  gca_stats_t s = stats_of(a, 0);
  assert_true(ooms > 0 && s.num_gc_releases > 0 && s.num_oom_handler_retries > 0);
  assert_int_equal(seen.calls, ooms);
  assert_int_equal(s.num_ooms, ooms);
  if (h.spill) gca_free(a, h.spill);
  close_empty(a, slots, 128);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ladder_rungs),
      cmocka_unit_test(test_ladder_releases_oversize_first),
      cmocka_unit_test(test_free_memory_callbacks),
      cmocka_unit_test(test_gc_frees_oldest_first),
      cmocka_unit_test(test_gc_frees_oldest_first_past_2_to_the_40),
      cmocka_unit_test(test_gc_age_is_exact_across_wraps),
      cmocka_unit_test(test_gc_needs_a_fraction),
      cmocka_unit_test(test_memory_fraction),
      cmocka_unit_test(test_memory_fraction_from_configuration),
      cmocka_unit_test(test_wait_for_memory_freed_by_another_thread),
      cmocka_unit_test(test_wait_deadline_passes_cleanly),
      cmocka_unit_test(test_oom_handler_frees_and_retries),
      cmocka_unit_test(test_oom_handler_retries_are_bounded),
      cmocka_unit_test(test_callback_registry_errors),
      cmocka_unit_test(test_message),
      cmocka_unit_test(test_transient_failures),
      cmocka_unit_test(test_transient_failures_without_waiting),
      cmocka_unit_test(test_fraction_rejects_outright),
      cmocka_unit_test(test_failure_during_release),
      cmocka_unit_test(test_failure_on_the_last_retry),
      cmocka_unit_test(test_random_pressure),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
