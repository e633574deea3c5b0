/* The lock hierarchy (label `hardening`): the order check of checked
 * builds aborts naming both locks and both sites; a pause with backup beside
 * gca_set_config, the pair that once closed a cycle, runs to the end; the
 * framework's queue drain runs with no lock held and may call anything; the
 * replay's segment observer, called under a device's lock, is refused
 * every call at once; every public call runs from several threads at once
 * for a bounded time.
 * A watchdog turns a hang into a failure. */
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/inspect.h"
#include "helpers.h"

#define S1 ((gca_stream_t)0x100)
#define S2 ((gca_stream_t)0x200)

/* ---- the order check ------------------------------------------------------ */

#ifdef GCALLOC_LOCK_CHECK
/* Run `body` in a child; its standard error and how it ended. */
typedef struct child_end {
  bool aborted;
  int exit_code;
  char err[2048];
} child_end_t;

static child_end_t in_child(void (*body)(void)) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  fflush(NULL);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    body();
    _exit(0);
  }
  close(fds[1]);
  child_end_t end = {0};
  size_t got = 0;
  ssize_t n;
  while ((n = read(fds[0], end.err + got, sizeof end.err - 1 - got)) > 0) got += (size_t)n;
  close(fds[0]);
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  end.aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  end.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return end;
}

/* Each child says first where it takes its two locks ("sites A B"). */
static void say_sites(int first, int second) {
  fprintf(stderr, "sites %d %d\n", first, second);
  fflush(stderr);
}

/* A device's lock, then the configuration lock: the wrong way round. */
static void config_under_device(void) {
  lock_t device;
  pthread_mutex_t config = PTHREAD_MUTEX_INITIALIZER;
  lock_init(&device, RANK_DEVICE);
  say_sites(__LINE__ + 1, __LINE__ + 2);
  lock_acquire(&device);
  mutex_lock(&config, RANK_CONFIG);
}

/* A device's lock taken twice by one thread. */
static void device_twice(void) {
  lock_t device;
  lock_init(&device, RANK_DEVICE);
  say_sites(__LINE__ + 1, __LINE__ + 2);
  lock_acquire(&device);
  lock_acquire(&device);
}

/* In order: the configuration lock, a device's, the settings' leaf. */
static void in_rank_order(void) {
  lock_t device;
  pthread_mutex_t config = PTHREAD_MUTEX_INITIALIZER, settings = PTHREAD_MUTEX_INITIALIZER;
  lock_init(&device, RANK_DEVICE);
  mutex_lock(&config, RANK_CONFIG);
  lock_acquire(&device);
  mutex_lock(&settings, RANK_SETTINGS);
  mutex_unlock(&settings);
  lock_release(&device);
  mutex_unlock(&config);
  if (LOCKS_HELD() != 0) _exit(4);
}

/* The message names both sites the child said. */
static void assert_sites(const char *err) {
  const char *said = strstr(err, "sites ");
  assert_non_null(said);
  int first = 0, second = 0;
  assert_int_equal(sscanf(said, "sites %d %d", &first, &second), 2);
  char site[64];
  snprintf(site, sizeof site, "tests/test_lock_order.c:%d", first);
  assert_contains(err, site);
  snprintf(site, sizeof site, "tests/test_lock_order.c:%d", second);
  assert_contains(err, site);
}

static void test_order_check_names_both_locks_and_sites(void **state) {
  (void)state;
  child_end_t end = in_child(config_under_device);
  assert_true(end.aborted);
  assert_contains(end.err, "lock order violated");
  assert_contains(end.err, "the configuration lock");
  assert_contains(end.err, "a device lock");
  assert_sites(end.err);

  end = in_child(device_twice);
  assert_true(end.aborted);
  assert_contains(end.err, "taken again");
  assert_sites(end.err);

  end = in_child(in_rank_order);
  assert_false(end.aborted);
  assert_int_equal(end.exit_code, 0);
  assert_string_equal(end.err, "");
}
#else
static void test_order_check_names_both_locks_and_sites(void **state) {
  (void)state;
  skip(); /* (release builds compile no check) */
}
#endif

/* ---- a pause with backup beside gca_set_config ---------------------------- */

typedef struct pause_run {
  gca_allocator_t *a;
  gca_pool_t pool;
  _Atomic bool done;
  int cycles;
} pause_run_t;

static void *pause_and_resume(void *arg) {
  pause_run_t *r = arg;
  for (int i = 0; i < r->cycles; i++) {
    /* (An empty host cache: every backup copy misses it and pins anew.) */
    CHECK(gca_host_empty_cache(r->a) == GCA_OK);
    CHECK(gca_pool_pause(r->a, r->pool, GCA_PAUSE_BACKUP, NULL) == GCA_OK);
    CHECK(gca_pool_resume(r->a, r->pool, 0) == GCA_OK);
  }
  atomic_store(&r->done, true);
  return NULL;
}

static void *change_settings(void *arg) {
  pause_run_t *r = arg;
  char buf[1024];
  for (unsigned i = 0; !atomic_load(&r->done); i++) {
    CHECK(gca_set_config(r->a, i % 2 ? "pinned_use_cuda_host_register:True,pinned_num_register_threads:2"
                                     : "pinned_use_cuda_host_register:False,pinned_num_register_threads:1") == GCA_OK);
    CHECK(gca_get_config(r->a, buf, sizeof buf) > 0);
  }
  return NULL;
}

static void test_pause_with_backup_beside_set_config(void **state) {
  (void)state;
  atomic_store(&helper_failures, 0);
  pause_run_t r = {.a = open_sim("sim:capacity=256MiB", NULL), .cycles = UNDER_TSAN ? 150 : 400};
  assert_int_equal(gca_pool_create_ex(r.a, 0, GCA_POOL_PAUSABLE, &r.pool), GCA_OK);
  assert_int_equal(gca_pool_push(r.a, r.pool), GCA_OK);
  void *p = gca_malloc(r.a, 3 * MiB, 0, S1), *q = gca_malloc(r.a, 20000, 0, S1);
  assert_int_equal(gca_pool_pop(r.a), GCA_OK);
  assert_true(p && q);
  pthread_t pauser, setter;
  assert_int_equal(pthread_create(&pauser, NULL, pause_and_resume, &r), 0);
  assert_int_equal(pthread_create(&setter, NULL, change_settings, &r), 0);
  pthread_join(pauser, NULL);
  pthread_join(setter, NULL);
  assert_int_equal(atomic_load(&helper_failures), 0);
  assert_int_equal(gca_free(r.a, p), GCA_OK);
  assert_int_equal(gca_free(r.a, q), GCA_OK);
  assert_consistent(r.a);
  assert_int_equal(gca_pool_release(r.a, r.pool), GCA_OK);
  gca_close(r.a);
}

/* ---- callbacks under a device's lock -------------------------------------- */

typedef struct inside {
  gca_allocator_t *a;
  gca_pool_t pool;
  void *live;          /* an allocation the callback looks at */
  const char *name;    /* how the refusals name the callback */
  int calls, failures;
  int depth, nested;   /* the drain: how deep in itself it runs; the calls made inside one */
} inside_t;

static void expect(inside_t *c, bool ok, const char *what) {
  if (ok) return;
  fprintf(stderr, "inside %s: %s: %s\n", c->name, what, gca_last_error());
  c->failures++;
}

/* Refused at once, naming the callback. */
static void expect_refused(inside_t *c, bool failed, const char *what) {
  bool ok = failed && gca_last_status() == GCA_ERR_INVALID && strstr(gca_last_error(), what) &&
            strstr(gca_last_error(), c->name);
  if (!ok) fprintf(stderr, "inside %s: %s was not refused as it should: %s\n", c->name, what, gca_last_error());
  c->failures += !ok;
}

/* `anything` (the queue drain, called with no lock held): every call
 * works, reads and changes alike. false (the segment observer, under the
 * device's lock): every call that reaches the device is refused. */
static void call_everything(inside_t *c, bool anything) {
  gca_allocator_t *a = c->a;
  c->calls++;
  char buf[16384];
  if (!anything) {
    gca_stats_t s;
    expect_refused(c, gca_get_stats(a, 0, &s) != GCA_OK, "gca_get_stats");
    expect_refused(c, gca_check(a, 0) != GCA_OK, "gca_check");
    expect_refused(c, gca_usable_size(a, c->live) == 0, "gca_usable_size");
    gca_snapshot_t *snap = NULL;
    expect_refused(c, gca_snapshot_take(a, &snap) != GCA_OK && !snap, "gca_snapshot_take");
    expect_refused(c, gca_memory_summary(a, 0, 1, buf, sizeof buf) < 0, "gca_memory_summary");
    expect_refused(c, gca_malloc(a, 4096, 0, S1) == NULL, "gca_malloc");
    expect_refused(c, gca_free(a, c->live) != GCA_OK, "gca_free");
    expect_refused(c, gca_set_config(a, "max_split_size_mb:100") != GCA_OK, "gca_set_config");
    return;
  }
  gca_stats_t s;
  expect(c, gca_get_stats(a, 0, &s) == GCA_OK, "gca_get_stats");
  expect(c, s.allocated_bytes[GCA_POOL_ALL].current == gca_allocated_bytes(a, 0), "the statistics and the mirror");
  expect(c, gca_memory_summary(a, 0, 1, buf, sizeof buf) > 0, "gca_memory_summary");
  expect(c, gca_check(a, 0) == GCA_OK && gca_check(a, -1) == GCA_OK, "gca_check");
  expect(c, gca_usable_size(a, c->live) == 4096, "gca_usable_size");
  void *base = NULL;
  expect(c, gca_base_allocation(a, c->live, &base, NULL) == GCA_OK && base, "gca_base_allocation");
  double fraction = 0;
  expect(c, gca_get_memory_fraction(a, 0, &fraction) == GCA_OK && fraction == 1.0, "gca_get_memory_fraction");
  size_t free_bytes = 0, total = 0;
  expect(c, gca_mem_get_info(a, 0, &free_bytes, &total) == GCA_OK && total > 0, "gca_mem_get_info");
  gca_device_properties_t props;
  expect(c, gca_device_properties(a, 0, &props) == GCA_OK, "gca_device_properties");
  expect(c, gca_get_config(a, buf, sizeof buf) > 0, "gca_get_config");
  expect(c, gca_round_size(a, 1000) == 1024, "gca_round_size");
  gca_snapshot_t *snap = NULL;
  expect(c, gca_snapshot_take(a, &snap) == GCA_OK && snap, "gca_snapshot_take");
  gca_snapshot_free(snap);
  gca_pool_t pools[4], of = 99;
  expect(c, gca_pool_list(a, 0, pools, 4) == 1 && pools[0] == c->pool, "gca_pool_list");
  gca_pool_stats_t ps;
  expect(c, gca_pool_get_stats(a, c->pool, &ps) == GCA_OK && ps.id == c->pool, "gca_pool_get_stats");
  expect(c, gca_pool_of(a, c->live, &of) == GCA_OK && of == 0, "gca_pool_of");
  gca_host_stats_t hs;
  expect(c, gca_host_stats(a, &hs) == GCA_OK, "gca_host_stats");
  expect(c, gca_reserved_bytes(a, 0) >= gca_allocated_bytes(a, 0), "gca_reserved_bytes");

  void *p = gca_malloc(a, 4096, 0, S1);
  expect(c, p != NULL, "gca_malloc");
  expect(c, gca_record_stream(a, p, S2) == GCA_OK, "gca_record_stream");
  expect(c, gca_erase_stream(a, p, S2) == GCA_OK, "gca_erase_stream");
  expect(c, gca_free(a, p) == GCA_OK, "gca_free");
  expect(c, gca_process_events(a, 0) == GCA_OK, "gca_process_events");
  expect(c, gca_synchronize(a, -1) == GCA_OK, "gca_synchronize");
  expect(c, gca_empty_cache(a, 0) == GCA_OK, "gca_empty_cache"); /* (a drain in the drain: one level is allowed) */
  expect(c, gca_reset_peak_stats(a, 0) == GCA_OK, "gca_reset_peak_stats");
  expect(c, gca_set_memory_fraction(a, 1.0, 0) == GCA_OK, "gca_set_memory_fraction");
  expect(c, gca_set_config(a, "garbage_collection_threshold:0.9") == GCA_OK, "gca_set_config");
  gca_pool_t pool = 0;
  expect(c, gca_pool_create(a, 0, &pool) == GCA_OK && gca_pool_release(a, pool) == GCA_OK, "a pool's life");
}

/* Its calls free and then empty the cache: the drain may be called inside
 * itself, which is counted and returns. */
static void drain_calls_everything(int device, void *user) {
  (void)device;
  inside_t *c = user;
  if (c->depth) {
    c->nested++;
    return;
  }
  c->depth++;
  call_everything(c, true);
  c->depth--;
}

/* A drain that frees and empties the cache every time it runs: it would
 * recurse without end; one drain inside another is allowed, no deeper. */
static void drain_recursing(int device, void *user) {
  (void)device;
  inside_t *c = user;
  c->calls++;
  c->depth++;
  if (c->depth > c->nested) c->nested = c->depth; /* (the deepest) */
  void *p = gca_malloc(c->a, 2 * MiB, 0, S1);
  if (!p || gca_free(c->a, p) != GCA_OK || gca_empty_cache(c->a, 0) != GCA_OK) c->failures++;
  c->depth--;
}

static void count_drain(int device, void *user) {
  (void)device;
  ++*(int *)user;
}

/* Stitching moves pages of freed blocks only once the queue was drained:
 * the ladder drains it (with no lock held) and asks again, and the pages
 * move rather than new ones being made. */
static void test_stitching_waits_for_the_drain(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=64MiB", "expandable_segments:True,stitching:True");
  int drains = 0;
  assert_int_equal(gca_set_queue_drain(a, count_drain, &drains), GCA_OK);
  void *blocks[6];
  for (int i = 0; i < 6; i++) assert_non_null(blocks[i] = gca_malloc(a, 6 * MiB, 0, S1));
  for (int i = 0; i < 6; i += 2) assert_int_equal(gca_free(a, blocks[i]), GCA_OK);
  int64_t reserved = gca_reserved_bytes(a, 0);
  void *p = gca_malloc(a, 18 * MiB, 0, S1);
  assert_non_null(p);
  assert_int_equal(drains, 1);
  assert_true(stats_of(a, 0).num_pages_moved > 0);
  assert_true(gca_reserved_bytes(a, 0) == reserved); /* (moved, none made) */
  assert_int_equal(gca_free(a, p), GCA_OK);
  for (int i = 1; i < 6; i += 2) assert_int_equal(gca_free(a, blocks[i]), GCA_OK);
  assert_int_equal(gca_set_queue_drain(a, NULL, NULL), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

static void test_drain_inside_itself_is_bounded(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=64MiB", NULL);
  inside_t c = {.a = a, .name = "the queue drain (gca_set_queue_drain)"};
  assert_int_equal(gca_set_queue_drain(a, drain_recursing, &c), GCA_OK);
  void *p = gca_malloc(a, 4 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(c.failures, 0);
  assert_int_equal(c.nested, 2); /* (the drain, and one inside it) */
  assert_true(c.calls <= 16);     /* (each of the retries, bounded) */
  assert_int_equal(gca_set_queue_drain(a, NULL, NULL), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK); /* (what the drain freed last goes back now) */
  assert_int_equal(gca_reserved_bytes(a, 0), 0);
  gca_close(a);
}

static void observer_calls_everything(void *ctx, bool alloc, size_t size) {
  (void)alloc, (void)size;
  call_everything(ctx, false);
}

static void test_drain_may_call_anything(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=64MiB", *state);
  inside_t c = {.a = a, .name = "the queue drain (gca_set_queue_drain)"};
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &c.pool), GCA_OK);
  assert_non_null(c.live = gca_malloc(a, 4096, 0, S1));
  assert_int_equal(gca_set_queue_drain(a, drain_calls_everything, &c), GCA_OK);
  /* gca_empty_cache: a cached segment goes back. */
  void *p = gca_malloc(a, 4 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(c.calls, 1);
  /* The out-of-memory ladder: the cache goes back for a larger block. */
  p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  p = gca_malloc(a, 50 * MiB, 0, S1);
  assert_non_null(p);
  if (!*state) assert_int_equal(c.calls, 2); /* (an expandable segment grows in place instead) */
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* Expandable segments: pages unmapped for a larger block, and moved
   * into place (stitching). */
  if (*state) {
    void *blocks[6];
    for (int i = 0; i < 6; i++) assert_non_null(blocks[i] = gca_malloc(a, 6 * MiB, 0, S1));
    for (int i = 0; i < 6; i += 2) assert_int_equal(gca_free(a, blocks[i]), GCA_OK);
    int before = c.calls;
    p = gca_malloc(a, 30 * MiB, 0, S1);
    assert_non_null(p);
    assert_true(c.calls > before);
    /* (Whether pages moved depends on the drain: this one empties the cache.) */
    assert_int_equal(gca_free(a, p), GCA_OK);
    for (int i = 1; i < 6; i += 2) assert_int_equal(gca_free(a, blocks[i]), GCA_OK);
    assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  }
  int before_pause = c.calls;
  /* A pause: drained even with nothing freed since. */
  assert_int_equal(gca_pool_push(a, c.pool), GCA_OK);
  void *q = gca_malloc(a, 8192, 0, S1);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_pause(a, c.pool, 0, NULL), GCA_OK);
  assert_int_equal(c.calls, before_pause + 1);
  assert_int_equal(gca_pool_resume(a, c.pool, 0), GCA_OK);
  assert_int_equal(c.failures, 0);
  /* Nothing was left half done: the allocator goes on. */
  assert_int_equal(gca_set_queue_drain(a, NULL, NULL), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_int_equal(gca_free(a, c.live), GCA_OK);
  assert_int_equal(gca_pool_release(a, c.pool), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(gca_reserved_bytes(a, 0), 0);
  assert_int_equal(gca_malloc(a, 4096, 0, S1) != NULL, 1); /* (a later call is not refused) */
  gca_close(a);
}

static void test_segment_observer_reads_and_is_refused_the_rest(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=64MiB", NULL);
  inside_t c = {.a = a, .name = "the segment observer"};
  assert_int_equal(gca_pool_create(a, 0, &c.pool), GCA_OK);
  assert_non_null(c.live = gca_malloc(a, 4096, 0, S1));
  assert_int_equal(gca__inspect_observe_segments(a, 0, observer_calls_everything, &c), GCA_OK);
  void *p = gca_malloc(a, 12 * MiB, 0, S1); /* a segment given */
  assert_int_equal(c.calls, 1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK); /* and taken back */
  assert_int_equal(c.calls, 2);
  assert_int_equal(c.failures, 0);
  assert_int_equal(gca__inspect_observe_segments(a, 0, NULL, NULL), GCA_OK);
  assert_int_equal(gca_free(a, c.live), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

/* ---- every public call from several threads ------------------------------- */

typedef struct stress {
  gca_allocator_t *a;
  gca_pool_t pausable;
  double until_ms;
  atomic_int calls_in_drain; /* (drains run on several threads at once) */
} stress_t;

static bool running(const stress_t *s, int i, int most) { return i < most && now_ms() < s->until_ms; }

static void stress_drain(int device, void *user) {
  (void)device;
  stress_t *s = user;
  gca_stats_t st;
  CHECK(gca_get_stats(s->a, 0, &st) == GCA_OK);
  /* No lock is held: it may allocate. A drain inside a drain cannot drain
   * again, so cache freed into since the outer one began stays held back
   * from it, and with the device full its allocation may fail. */
  void *p = gca_malloc(s->a, 512, 0, S1);
  CHECK(p ? gca_free(s->a, p) == GCA_OK : gca_last_status() == GCA_ERR_OOM);
  s->calls_in_drain++;
}

static void *stress_allocations(void *arg) {
  stress_t *s = arg;
  uint64_t seed = 0x5eed;
  void *held[32] = {0};
  for (int i = 0; running(s, i, 20000); i++) {
    int k = (int)(next_random(&seed) % 32);
    if (held[k]) {
      if (next_random(&seed) % 4 == 0) CHECK(gca_record_stream(s->a, held[k], S2) == GCA_OK);
      CHECK(gca_free(s->a, held[k]) == GCA_OK);
      held[k] = NULL;
    } else {
      size_t size = (size_t)(next_random(&seed) % (4 * MiB)) + 1;
      held[k] = gca_malloc(s->a, size, 0, k % 2 ? S1 : S2);
      CHECK(held[k] || gca_last_status() == GCA_ERR_OOM);
    }
    if (i % 64 == 0) CHECK(gca_process_events(s->a, -1) == GCA_OK);
  }
  for (int k = 0; k < 32; k++) CHECK(gca_free(s->a, held[k]) == GCA_OK);
  return NULL;
}

static void *stress_pauses(void *arg) {
  stress_t *s = arg;
  for (int i = 0; running(s, i, 400); i++) {
    if (i % 3 == 0) CHECK(gca_host_empty_cache(s->a) == GCA_OK);
    CHECK(gca_pool_pause(s->a, s->pausable, i % 2 ? GCA_PAUSE_BACKUP : 0, NULL) == GCA_OK);
    /* A resume may meet out-of-memory while the allocating thread holds the
     * device; it then stays paused and is tried again. The allocating thread
     * gives everything back when the run ends, so this ends too. */
    int rc;
    while ((rc = gca_pool_resume(s->a, s->pausable, 0)) != GCA_OK && now_ms() < s->until_ms + 20000) {
      CHECK(rc == GCA_ERR_OOM);
      nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    }
    CHECK(rc == GCA_OK);
  }
  return NULL;
}

static void *stress_settings(void *arg) {
  stress_t *s = arg;
  char buf[2048];
  for (int i = 0; running(s, i, 4000); i++) {
    CHECK(gca_set_config(s->a, i % 2 ? "max_split_size_mb:64,pinned_num_register_threads:2"
                                     : "max_split_size_mb:1024,pinned_num_register_threads:1") == GCA_OK);
    CHECK(gca_get_config(s->a, buf, sizeof buf) > 0);
    CHECK(gca_round_size(s->a, 1000) == 1024);
    CHECK(gca_set_memory_fraction(s->a, i % 3 ? 1.0 : 0.9, 0) == GCA_OK);
  }
  CHECK(gca_set_memory_fraction(s->a, 1.0, 0) == GCA_OK);
  return NULL;
}

static void *stress_observers(void *arg) {
  stress_t *s = arg;
  char buf[16384];
  for (int i = 0; running(s, i, 2000); i++) {
    CHECK(gca_empty_cache(s->a, -1) == GCA_OK || gca_last_status() == GCA_ERR_INVALID);
    gca_snapshot_t *snap = NULL;
    CHECK(gca_snapshot_take(s->a, &snap) == GCA_OK);
    gca_snapshot_free(snap);
    CHECK(gca_memory_summary(s->a, 0, i % 2, buf, sizeof buf) > 0);
    CHECK(gca_check(s->a, -1) == GCA_OK);
    CHECK(gca_record_history(s->a, i % 4 != 3, GCA_CONTEXT_STATE, 256) == GCA_OK);
    CHECK(gca_reset_peak_stats(s->a, 0) == GCA_OK);
    gca_stats_t st;
    CHECK(gca_get_stats(s->a, 0, &st) == GCA_OK);
  }
  return NULL;
}

static void *stress_host_and_pools(void *arg) {
  stress_t *s = arg;
  for (int i = 0; running(s, i, 2000); i++) {
    void *h = gca_host_malloc(s->a, (size_t)(i % 7 + 1) * 4096);
    CHECK(h != NULL);
    CHECK(gca_host_record_stream(s->a, h, 0, S1) == GCA_OK);
    CHECK(gca_host_free(s->a, h) == GCA_OK);
    gca_pool_t p = 0;
    CHECK(gca_pool_create(s->a, 0, &p) == GCA_OK);
    CHECK(gca_pool_push(s->a, p) == GCA_OK);
    void *d = gca_malloc(s->a, 4096, 0, S1);
    CHECK(gca_pool_pop(s->a) == GCA_OK);
    CHECK(d == NULL || gca_free(s->a, d) == GCA_OK);
    CHECK(gca_pool_release(s->a, p) == GCA_OK);
  }
  return NULL;
}

static void *stress_open_close(void *arg) {
  stress_t *s = arg;
  for (int i = 0; running(s, i, 200); i++) {
    gca_allocator_t *b = NULL;
    CHECK(gca_open("sim:capacity=16MiB", "pinned_reserve_segment_size_mb:1", &b) == GCA_OK);
    void *p = gca_malloc(b, 4096, 0, S1);
    void *h = gca_host_malloc(b, 4096);
    CHECK(p && h);
    gca_close(b); /* (with both still held: close takes them back) */
  }
  return NULL;
}

static void test_every_call_from_several_threads(void **state) {
  (void)state;
  atomic_store(&helper_failures, 0);
  stress_t s = {.a = open_sim("sim:capacity=128MiB", NULL)};
  assert_int_equal(gca_pool_create_ex(s.a, 0, GCA_POOL_PAUSABLE, &s.pausable), GCA_OK);
  assert_int_equal(gca_pool_push(s.a, s.pausable), GCA_OK);
  void *kept = gca_malloc(s.a, 2 * MiB, 0, S1);
  assert_int_equal(gca_pool_pop(s.a), GCA_OK);
  assert_non_null(kept);
  assert_int_equal(gca_set_queue_drain(s.a, stress_drain, &s), GCA_OK);
  s.until_ms = now_ms() + (UNDER_TSAN ? 3000 : 1500);
  void *(*bodies[])(void *) = {stress_allocations, stress_pauses,         stress_settings,
                               stress_observers,   stress_host_and_pools, stress_open_close};
  enum { N = sizeof bodies / sizeof bodies[0] };
  pthread_t threads[N];
  for (int i = 0; i < N; i++) assert_int_equal(pthread_create(&threads[i], NULL, bodies[i], &s), 0);
  for (int i = 0; i < N; i++) pthread_join(threads[i], NULL);
  assert_int_equal(atomic_load(&helper_failures), 0);
  assert_int_equal(gca_set_queue_drain(s.a, NULL, NULL), GCA_OK);
  assert_true(s.calls_in_drain > 0);
  assert_int_equal(gca_free(s.a, kept), GCA_OK);
  assert_int_equal(gca_pool_release(s.a, s.pausable), GCA_OK);
  assert_consistent(s.a);
  assert_int_equal(gca_empty_cache(s.a, -1), GCA_OK);
  assert_int_equal(gca_reserved_bytes(s.a, 0), 0);
  gca_close(s.a);
}

int main(void) {
  start_watchdog("test_lock_order", 120);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_order_check_names_both_locks_and_sites),
      cmocka_unit_test(test_pause_with_backup_beside_set_config),
      cmocka_unit_test_prestate(test_drain_may_call_anything, NULL),
      cmocka_unit_test_prestate(test_drain_may_call_anything, "expandable_segments:True,stitching:True"),
      cmocka_unit_test(test_drain_inside_itself_is_bounded),
      cmocka_unit_test(test_stitching_waits_for_the_drain),
      cmocka_unit_test(test_segment_observer_reads_and_is_refused_the_rest),
      cmocka_unit_test(test_every_call_from_several_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
