/* Hostile and re-entrant use of the library (label `hardening`): callbacks
 * and log handlers that call back into gcalloc, with trace recording on
 * (GCALLOC_TRACE_FILE, set by the second CTest entry of this file) and off;
 * device memory the device refuses to take back; a checker that holds the
 * books to the device. A watchdog turns a hang into a failure. */
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"

#define S1 ((gca_stream_t)0x100)
#define S2 ((gca_stream_t)0x200)

static bool tracing(void) {
  const char *t = getenv("GCALLOC_TRACE_FILE");
  return t && *t;
}

/* ---- every public call, from inside every kind of callback -------------- */

enum { FROM_FREE_MEMORY, FROM_OOM_OBSERVER, FROM_OOM_HANDLER, FROM_LOG, KINDS };

static _Thread_local bool inside_callback;
static int exercised[KINDS];
static int api_failures;
static gca_allocator_t *logged_allocator; /* what the log handler exercises */

static void note(bool ok, const char *what) {
  if (!ok) {
    fprintf(stderr, "from a callback: %s failed: %s\n", what, gca_last_error());
    api_failures++;
  }
}

static int dummy_free_memory(int device, size_t size, void *user) {
  (void)device, (void)size, (void)user;
  return 0;
}

static void dummy_observer(int device, size_t size, size_t limit, size_t free_bytes, void *user) {
  (void)device, (void)size, (void)limit, (void)free_bytes, (void)user;
}

static void log_handler(gca_log_level level, const char *message, void *user);

/* Calls every public function once (those that could not return on a
 * callback's thread, gca_close of `a` itself, excepted: a second allocator
 * is opened and closed instead). */
static void exercise(gca_allocator_t *a, int kind) {
  if (inside_callback || !a) return;
  inside_callback = true;
  exercised[kind]++;
  char buf[4096];
  (void)gca_last_error();
  (void)gca_last_status();
  (void)gca_status_name(GCA_ERR_OOM);
  (void)gca_version();
  gca_set_log_level(gca_set_log_level(gca_get_log_level()));
  gca_set_log_handler(log_handler, NULL);
  gca_allocator_t *other = NULL;
  note(gca_open("sim:capacity=16MiB", NULL, &other) == GCA_OK, "gca_open");
  gca_close(other);
  note(gca_device_count(a) == 1, "gca_device_count");
  note(gca_backend_name(a)[0] != '\0', "gca_backend_name");
  gca_device_properties_t props;
  (void)gca_device_properties(a, 0, &props);
  int can = 0, least = 0, greatest = 0;
  (void)gca_can_access_peer(a, 0, 0, &can);
  (void)gca_enable_peer_access(a, 0, 0);
  (void)gca_disable_peer_access(a, 0, 0);
  (void)gca_stream_priority_range(a, 0, &least, &greatest);
  void *p = gca_malloc(a, 4096, 0, S1);
  if (p) {
    note(gca_usable_size(a, p) == 4096, "gca_usable_size");
    note(gca_record_stream(a, p, S2) == GCA_OK, "gca_record_stream");
    note(gca_free(a, p) == GCA_OK, "gca_free");
  }
  note(gca_process_events(a, -1) == GCA_OK, "gca_process_events");
  note(gca_synchronize(a, -1) == GCA_OK, "gca_synchronize");
  (void)gca_launch_blocking(a);
  note(gca_empty_cache(a, -1) == GCA_OK, "gca_empty_cache");
  size_t free_bytes = 0, total = 0;
  note(gca_mem_get_info(a, 0, &free_bytes, &total) == GCA_OK, "gca_mem_get_info");
  double fraction = 0;
  note(gca_get_memory_fraction(a, 0, &fraction) == GCA_OK, "gca_get_memory_fraction");
  note(gca_set_memory_fraction(a, 1.0, 0) == GCA_OK, "gca_set_memory_fraction");
  note(gca_add_free_memory_callback(a, dummy_free_memory, NULL) == GCA_OK, "gca_add_free_memory_callback");
  note(gca_remove_free_memory_callback(a, dummy_free_memory, NULL) == GCA_OK, "gca_remove_free_memory_callback");
  note(gca_add_oom_observer(a, dummy_observer, NULL) == GCA_OK, "gca_add_oom_observer");
  note(gca_remove_oom_observer(a, dummy_observer, NULL) == GCA_OK, "gca_remove_oom_observer");
  note(gca_add_oom_handler(a, dummy_free_memory, NULL) == GCA_OK, "gca_add_oom_handler");
  note(gca_remove_oom_handler(a, dummy_free_memory, NULL) == GCA_OK, "gca_remove_oom_handler");
  note(gca_set_config(a, "gca_test_unknown_key:1") == GCA_OK, "gca_set_config"); /* logs a warning */
  note(gca_get_config(a, buf, sizeof buf) > 0, "gca_get_config");
  gca_stats_t stats;
  note(gca_get_stats(a, 0, &stats) == GCA_OK, "gca_get_stats");
  note(gca_reset_peak_stats(a, 0) == GCA_OK, "gca_reset_peak_stats");
  note(gca_reset_accumulated_stats(a, 0) == GCA_OK, "gca_reset_accumulated_stats");
  (void)gca_allocated_bytes(a, 0);
  (void)gca_reserved_bytes(a, 0);
  gca_stat_item_t items[8];
  (void)gca_stats_flatten(&stats, items, 8);
  void *h = gca_host_malloc(a, 4096);
  note(h != NULL, "gca_host_malloc");
  if (h) {
    int pinned = 0;
    note(gca_host_is_pinned(a, h, &pinned) == GCA_OK && pinned, "gca_host_is_pinned");
    note(gca_host_usable_size(a, h) == 4096, "gca_host_usable_size");
    note(gca_host_record_stream(a, h, 0, S1) == GCA_OK, "gca_host_record_stream");
    note(gca_host_free(a, h) == GCA_OK, "gca_host_free");
  }
  note(gca_host_empty_cache(a) == GCA_OK, "gca_host_empty_cache");
  gca_host_stats_t hs;
  note(gca_host_stats(a, &hs) == GCA_OK, "gca_host_stats");
  note(gca_host_reset_peak_stats(a) == GCA_OK, "gca_host_reset_peak_stats");
  note(gca_host_reset_accumulated_stats(a) == GCA_OK, "gca_host_reset_accumulated_stats");
  note(gca_memory_summary(a, 0, 1, buf, sizeof buf) >= 0, "gca_memory_summary");
  note(gca_record_history(a, 1, GCA_CONTEXT_STATE, 64) == GCA_OK, "gca_record_history");
  gca_snapshot_t *snap = NULL;
  note(gca_snapshot_take(a, &snap) == GCA_OK, "gca_snapshot_take");
  if (snap) {
    char path[] = "/tmp/gcalloc_reentry_XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0) {
      close(fd);
      note(gca_snapshot_write(snap, path, GCA_SNAPSHOT_JSON) == GCA_OK, "gca_snapshot_write");
      unlink(path);
    }
    gca_snapshot_free(snap);
  }
  note(gca_record_history(a, 0, GCA_CONTEXT_NONE, 0) == GCA_OK, "gca_record_history (off)");
  note(gca_check(a, -1) == GCA_OK, "gca_check");
  note(gca_round_size(a, 1000) == 1024, "gca_round_size");
  note(gca_segment_size(1024) == 2 * MiB, "gca_segment_size");
  note(gca_torch_init(NULL, NULL) == GCA_OK, "gca_torch_init");
  note(gca_torch_allocator() != NULL, "gca_torch_allocator");
  void *t = gca_torch_malloc(4096, 0, NULL);
  note(t != NULL, "gca_torch_malloc");
  gca_torch_record_stream(t, NULL);
  gca_torch_free(t, 4096, 0, NULL);
  gca_torch_empty_cache();
  gca_torch_set_memory_fraction(1.0, 0);
  (void)gca_torch_last_failure(buf, sizeof buf);
  inside_callback = false;
}

static void log_handler(gca_log_level level, const char *message, void *user) {
  (void)level, (void)message, (void)user;
  exercise(logged_allocator, FROM_LOG);
}

static int free_memory_callback(int device, size_t size, void *user) {
  (void)device, (void)size;
  exercise(user, FROM_FREE_MEMORY);
  return 0;
}

static void oom_observer(int device, size_t size, size_t limit, size_t free_bytes, void *user) {
  (void)device, (void)size, (void)limit, (void)free_bytes;
  exercise(user, FROM_OOM_OBSERVER);
}

/* The OOM handler also frees what the test holds (its user data) and asks
 * for another try once. */
typedef struct held {
  gca_allocator_t *a;
  void *blocks[4];
  int n;
} held_t;

static int oom_handler(int device, size_t size, void *user) {
  (void)device, (void)size;
  held_t *h = user;
  exercise(h->a, FROM_OOM_HANDLER);
  if (h->n == 0) return 0;
  for (int i = 0; i < h->n; i++) gca_free(h->a, h->blocks[i]);
  h->n = 0;
  gca_empty_cache(h->a, -1);
  return 1;
}

static void test_every_call_from_every_callback(void **state) {
  (void)state;
  memset(exercised, 0, sizeof exercised);
  api_failures = 0;
  assert_int_equal(gca_torch_init("sim:capacity=64MiB", NULL), GCA_OK);
  /* event_fail_at: the device's refusals are logged from inside a malloc. */
  gca_allocator_t *a = open_sim("sim:capacity=256MiB,event_fail_at=3", NULL);
  logged_allocator = a;
  gca_set_log_handler(log_handler, NULL);
  held_t held = {.a = a};
  assert_int_equal(gca_add_free_memory_callback(a, free_memory_callback, a), GCA_OK);
  assert_int_equal(gca_add_oom_observer(a, oom_observer, a), GCA_OK);
  assert_int_equal(gca_add_oom_handler(a, oom_handler, &held), GCA_OK);

  /* A miss: the free-memory callback. */
  void *p = gca_malloc(a, 3 * MiB, 0, S1);
  assert_non_null(p);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* A full device: the handler frees what is held, and the retry fits. */
  for (int i = 0; i < 4; i++) assert_non_null(held.blocks[held.n++] = gca_malloc(a, 50 * MiB, 0, S1));
  void *big = gca_malloc(a, 100 * MiB, 0, S1);
  assert_non_null(big);
  assert_int_equal(held.n, 0);
  /* A request that can never fit: the handler (nothing left) and observers. */
  assert_null(gca_malloc(a, 1024 * MiB, 0, S1));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "out of memory");
  /* A warning logged under the configuration lock reaches the handler. */
  assert_int_equal(gca_set_config(a, "gca_test_other_unknown_key:1"), GCA_OK);

  for (int k = 0; k < KINDS; k++) {
    if (exercised[k] == 0) fprintf(stderr, "callback kind %d never ran\n", k);
    assert_true(exercised[k] > 0);
  }
  assert_int_equal(api_failures, 0);
  gca_set_log_handler(NULL, NULL);
  logged_allocator = NULL;
  assert_int_equal(gca_free(a, big), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(sim_counters(a, 0).live, 0);
  gca_close(a);
  gca_torch_shutdown();
}

/* ---- the cases as reported ---------------------------------------------- */

static int free_and_empty(int device, size_t size, void *user) {
  (void)device, (void)size;
  held_t *h = user;
  if (h->n == 0) return 0;
  for (int i = 0; i < h->n; i++) gca_free(h->a, h->blocks[i]);
  h->n = 0;
  gca_empty_cache(h->a, -1);
  return 1;
}

static void test_oom_handler_frees_and_empties(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=256MiB", NULL);
  held_t held = {.a = a};
  assert_int_equal(gca_add_oom_handler(a, free_and_empty, &held), GCA_OK);
  for (int i = 0; i < 4; i++) assert_non_null(held.blocks[held.n++] = gca_malloc(a, 50 * MiB, 0, S1));
  void *p = gca_malloc(a, 100 * MiB, 0, S1);
  assert_non_null(p);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

typedef struct config_reader {
  gca_allocator_t *a;
  int calls;
  char seen[512];
} config_reader_t;

static void read_config_from_handler(gca_log_level level, const char *message, void *user) {
  (void)level, (void)message;
  config_reader_t *r = user;
  r->calls++;
  gca_get_config(r->a, r->seen, sizeof r->seen);
}

static void test_log_handler_reads_config_during_set_config(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  config_reader_t r = {.a = a};
  gca_set_log_handler(read_config_from_handler, &r);
  assert_int_equal(gca_set_config(a, "some_unknown_key:1"), GCA_OK);
  assert_true(r.calls >= 1);
  assert_contains(r.seen, "oom_handler_retries");
  /* The warning for a device without virtual memory (vm=0), logged at the
   * device's first segment, after its lock is released. */
  gca_allocator_t *b = open_sim("sim:vm=0,capacity=64MiB", NULL);
  r.a = b;
  r.calls = 0;
  assert_int_equal(gca_set_config(b, "expandable_segments:True"), GCA_OK);
  void *p = gca_malloc(b, MiB, 0, 0);
  assert_non_null(p);
  assert_int_equal(gca_free(b, p), GCA_OK);
  assert_true(r.calls >= 1);
  assert_contains(r.seen, "expandable_segments:True");
  gca_set_log_handler(NULL, NULL);
  gca_close(b);
  gca_close(a);
}

/* A handler's calls must not change the error the caller is told of. */
static void fail_from_handler(gca_log_level level, const char *message, void *user) {
  (void)level, (void)message, (void)user;
  if (inside_callback) return; /* its own failure is logged too */
  inside_callback = true;
  (void)gca_free(NULL, (void *)1); /* sets its own error */
  inside_callback = false;
}

static void test_log_handler_keeps_the_callers_error(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=64MiB", NULL);
  gca_log_level old = gca_set_log_level(GCA_LOG_DEBUG); /* failures are logged at debug */
  gca_set_log_handler(fail_from_handler, NULL);
  assert_null(gca_malloc(a, 128 * MiB, 0, S1));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "out of memory");
  gca_set_log_handler(NULL, NULL);
  gca_set_log_level(old);
  gca_close(a);
}

/* A traced malloc waiting for memory must not keep a traced free on
 * another thread from giving it. */
typedef struct waiter {
  gca_allocator_t *a;
  void *got;
  double ms;
} waiter_t;

static void *wait_for_memory(void *arg) {
  waiter_t *w = arg;
  double start = now_ms();
  w->got = gca_malloc(w->a, 60 * MiB, 0, S1);
  w->ms = now_ms() - start;
  return NULL;
}

static void test_wait_lets_other_threads_free(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", "oom_retry_timeout_ms:20000");
  void *p = gca_malloc(a, 60 * MiB, 0, S1);
  assert_non_null(p);
  waiter_t w = {.a = a};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, wait_for_memory, &w), 0);
  struct timespec pause = {0, 50 * 1000 * 1000};
  nanosleep(&pause, NULL);
  assert_int_equal(gca_free(a, p), GCA_OK);
  pthread_join(t, NULL);
  assert_non_null(w.got);
  assert_true(w.ms < 10000); /* freed at 50 ms; the deadline is 20 s */
  assert_int_equal(gca_free(a, w.got), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

/* ---- device memory the device refuses to take back ---------------------- */

static void assert_device_matches_books(gca_allocator_t *a) {
  assert_consistent(a);
  device_t *d = &a->devices[0];
  assert_int_equal(sim_counters(a, 0).used, (size_t)gca_reserved_bytes(a, 0) + d->kept.page_bytes);
}

static void test_refused_page_free_is_kept_and_given_back(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB,free_fail_at=1", "expandable_segments:True");
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_non_null(p);
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* The first page's destroy is refused: kept, not dropped. */
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(gca_reserved_bytes(a, 0), 0);
  assert_int_equal(a->devices[0].kept.page_bytes, 20 * MiB);
  assert_int_equal(stats_of(a, 0).num_device_free_failures, 1);
  assert_device_matches_books(a);
  /* The next release gives it back. */
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(a->devices[0].kept.page_bytes, 0);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_device_matches_books(a);
  gca_close(a);
}

/* Pages created for a mapping that cannot be completed go back too, and a
 * refusal there is kept and counted as well. */
static void test_refused_free_of_unused_new_pages(void **state) {
  (void)state;
  /* 60 MiB: three 20 MiB pages; the second create fails (a full device),
   * and giving back the first is refused. */
  gca_allocator_t *a = open_sim("sim:capacity=1GiB,fail_at=2,free_fail_at=1", "expandable_segments:True");
  void *p = gca_malloc(a, 60 * MiB, 0, S1);
  assert_device_matches_books(a);
  assert_true(stats_of(a, 0).num_device_free_failures >= 1);
  if (p) assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_device_matches_books(a);
  gca_close(a);
}

/* The checker sees memory dropped from the books while the device still
 * holds it. */
static void test_checker_compares_with_the_device(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB,free_fail_at=1", "expandable_segments:True");
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  device_t *d = &a->devices[0];
  assert_int_equal(d->kept.page_count, 1);
  /* Forget the kept page, as a path that dropped its handle would. */
  size_t bytes = d->kept.page_bytes;
  d->kept.page_bytes = 0;
  assert_int_equal(gca_check(a, 0), GCA_ERR_CORRUPT);
  assert_contains(gca_last_error(), "memory was lost");
  d->kept.page_bytes = bytes;
  assert_consistent(a);
  gca_close(a);
}

static void watchdog(int sig) {
  (void)sig;
  static const char msg[] = "test_hardening: watchdog: a call hung (deadlock?)\n";
  (void)!write(2, msg, sizeof msg - 1);
  _exit(3);
}

static void keep_last_message(gca_log_level level, const char *message, void *user) {
  if (level == GCA_LOG_WARNING) snprintf(user, 512, "%s", message);
}

/* A huge max_split_size_mb is unlimited in the statistics (-1), not a
 * negative size; an empty configuration variable hides the later ones, as
 * PyTorch decides (set is set), for each of the five alike, and says so
 * when a later one says something. */
static void test_huge_split_size_and_empty_variables(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "max_split_size_mb:99999999999999999");
  assert_int_equal(stats_of(a, 0).max_split_size, -1);
  gca_close(a);
  a = open_sim("sim", "max_split_size_mb:20");
  assert_int_equal(stats_of(a, 0).max_split_size, 20 * MiB);
  gca_close(a);
  static const char *const names[] = {"GCALLOC_ALLOC_CONF", "MINDTORCH_NPU_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF",
                                      "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"};
  char seen[512] = "";
  gca_set_log_handler(keep_last_message, seen);
  for (int empty = 0; empty < 4; empty++) {
    for (int i = 0; i < 5; i++) unsetenv(names[i]);
    setenv(names[empty], "", 1);
    setenv(names[empty + 1], "max_split_size_mb:40", 1);
    seen[0] = '\0';
    a = open_sim("acl:library=" FAKE_ACL_PATH, NULL);
    assert_int_equal(stats_of(a, 0).max_split_size, -1); /* the defaults: the empty one won */
    assert_contains(seen, names[empty]);
    assert_contains(seen, "is set but empty");
    assert_contains(seen, names[empty + 1]);
    gca_close(a);
  }
  for (int i = 0; i < 5; i++) unsetenv(names[i]);
  setenv("PYTORCH_CUDA_ALLOC_CONF", "", 1); /* the last, empty, hides nothing: no warning */
  seen[0] = '\0';
  a = open_sim("sim", NULL);
  assert_string_equal(seen, "");
  gca_close(a);
  unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  gca_set_log_handler(NULL, NULL);
}

int main(void) {
  signal(SIGALRM, watchdog);
  alarm(240);
  if (tracing()) fprintf(stderr, "trace recording on: %s\n", getenv("GCALLOC_TRACE_FILE"));
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_call_from_every_callback),
      cmocka_unit_test(test_oom_handler_frees_and_empties),
      cmocka_unit_test(test_log_handler_reads_config_during_set_config),
      cmocka_unit_test(test_log_handler_keeps_the_callers_error),
      cmocka_unit_test(test_wait_lets_other_threads_free),
      cmocka_unit_test(test_refused_page_free_is_kept_and_given_back),
      cmocka_unit_test(test_refused_free_of_unused_new_pages),
      cmocka_unit_test(test_checker_compares_with_the_device),
      cmocka_unit_test(test_huge_split_size_and_empty_variables),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
