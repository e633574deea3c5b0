/* Shared helpers for the cmocka tests: open an allocator on the sim
 * backend, read one statistic, and assert the invariants hold. */
#ifndef GCALLOC_TEST_HELPERS_H
#define GCALLOC_TEST_HELPERS_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "backends/sim_driver.h"
#include "core/core.h"
#include "host/host.h"
#include "observe/observe.h"

/* Which sanitizer the test is built with (1 or 0). */
#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
#ifndef UNDER_ASAN
#define UNDER_ASAN 0
#endif
#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif
#ifndef UNDER_TSAN
#define UNDER_TSAN 0
#endif

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)

/* Milliseconds on the monotonic clock. */
static inline double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* The next number of a seeded sequence (splitmix64). */
static inline uint64_t splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* The real PyTorch snapshots (a folder of them, one folder each, as
 * SOURCES.txt lists them), where GCALLOC_REAL_TRACES names one: CTest sets
 * it for the tests it registers only where ../shared/traces is there, and
 * those run the test programs' real-trace group; NULL otherwise. */
static inline const char *real_traces_dir(void) { return getenv("GCALLOC_REAL_TRACES"); }

/* real_traces_dir()/name, in one of four buffers that take turns. */
static inline const char *real_path(const char *name) {
  static char paths[4][1024];
  static int turn;
  char *p = paths[turn++ % 4];
  snprintf(p, sizeof paths[0], "%s/%s", real_traces_dir() ? real_traces_dir() : "(no real traces)", name);
  return p;
}

/* The big snapshots the readers and the replay are held to: the samples
 * (data/snapshots), or in the real-trace group the real PyTorch snapshots
 * (test programs that read GCALLOC_SAMPLES_DIR). */
#define BIG_SNAPSHOTS 3
#ifdef GCALLOC_SAMPLES_DIR
static inline const char *big_snapshot(size_t i) {
  static const char *const samples[BIG_SNAPSHOTS] = {GCALLOC_SAMPLES_DIR "/training/memory.pickle",
                                                     GCALLOC_SAMPLES_DIR "/inference/memory.pickle",
                                                     GCALLOC_SAMPLES_DIR "/cnn/memory.pickle"};
  static const char *const real[BIG_SNAPSHOTS] = {"ZidongLiu__DeComFL/memory.pickle",
                                                  "cranberrii__ftcourse/memory_snapshot.pickle",
                                                  "Constructor-Sun__code_location/memory_snapshot.pickle"};
  return real_traces_dir() ? real_path(real[i]) : samples[i];
}
#endif

static inline gca_allocator_t *open_sim(const char *backend, const char *conf) {
  gca_allocator_t *a = NULL;
  int rc = gca_open(backend, conf, &a);
  if (rc != GCA_OK) fprintf(stderr, "gca_open(%s, %s): %s\n", backend, conf ? conf : "", gca_last_error());
  assert_int_equal(rc, GCA_OK);
  assert_non_null(a);
  return a;
}

/* The pool of a live allocation, and a pool's statistics. */
static inline gca_pool_t pool_of(gca_allocator_t *a, void *p) {
  gca_pool_t id = 99;
  assert_int_equal(gca_pool_of(a, p, &id), GCA_OK);
  return id;
}

static inline gca_pool_stats_t pool_stats(gca_allocator_t *a, gca_pool_t id) {
  gca_pool_stats_t s;
  assert_int_equal(gca_pool_get_stats(a, id, &s), GCA_OK);
  return s;
}

static inline gca_stats_t stats_of(gca_allocator_t *a, int device) {
  gca_stats_t s;
  assert_int_equal(gca_get_stats(a, device, &s), GCA_OK);
  return s;
}

static inline gca_host_stats_t host_stats(gca_allocator_t *a) {
  gca_host_stats_t s;
  assert_int_equal(gca_host_stats(a, &s), GCA_OK);
  return s;
}

static inline void assert_consistent(gca_allocator_t *a) {
  int rc = gca_check(a, -1);
  if (rc != GCA_OK) fprintf(stderr, "invariant broken: %s\n", gca_last_error());
  assert_int_equal(rc, GCA_OK);
}

/* Two page censuses count the same, field by field (their maps aside). */
static inline void assert_census_counts_equal(const page_census_t *a, const page_census_t *b) {
  assert_int_equal(a->ranges, b->ranges);
  assert_int_equal(a->reserved_bytes, b->reserved_bytes);
  assert_int_equal(a->mapped_pages, b->mapped_pages);
  assert_int_equal(a->mapped_bytes, b->mapped_bytes);
  assert_int_equal(a->free_pages, b->free_pages);
  assert_int_equal(a->free_bytes, b->free_bytes);
  assert_int_equal(a->unmapped_pages, b->unmapped_pages);
  assert_int_equal(a->unmapped_bytes, b->unmapped_bytes);
}

static inline sim_counters_t sim_counters(gca_allocator_t *a, int device) {
  sim_counters_t c;
  assert_int_equal(gca__sim_get_counters(&a->backend, device, &c), GCA_OK);
  return c;
}

/* Log capture: tests install this handler to see warnings. */
typedef struct log_capture {
  int count;
  char last[1024];
  char all[8192];
} log_capture_t;

static inline void capture_log(gca_log_level level, const char *message, void *user) {
  (void)level;
  log_capture_t *c = user;
  c->count++;
  snprintf(c->last, sizeof c->last, "%s", message);
  size_t len = strlen(c->all);
  snprintf(c->all + len, sizeof c->all - len, "%s\n", message);
}

/* Threaded tests: helper threads count failures rather than assert, since
 * cmocka's asserts may only fail on the test's own thread. */
static atomic_int helper_failures __attribute__((unused));
#define CHECK(cond)                                                                                 \
  do {                                                                                              \
    if (!(cond)) {                                                                                  \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond,     \
              gca_last_error());                                                                    \
      atomic_fetch_add(&helper_failures, 1);                                                        \
    }                                                                                               \
  } while (0)

/* xorshift64: a small seeded generator for test workloads. */
static inline uint64_t next_random(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* Make work queued on sim stream `to` from now on wait for the work queued
 * so far on `from` (what a program does before using, on `to`, memory
 * produced on `from`). */
static inline int order_streams(const backend_t *b, gca_stream_t from, gca_stream_t to) {
  uintptr_t e;
  int rc = b->ops->event_record(b->state, 0, from, &e);
  if (rc != GCA_OK) return rc;
  rc = b->ops->stream_wait_event(b->state, 0, to, e);
  b->ops->event_destroy(b->state, 0, e);
  return rc;
}

/* A watchdog: a test program that has not ended `seconds` from now (a
 * deadlock) says so on stderr, naming `program`, and exits 3. */
static const char *watchdog_program;
static inline void watchdog_fired(int sig) {
  (void)sig;
  static const char tail[] = ": watchdog: a call hung (deadlock?)\n";
  (void)!write(2, watchdog_program, strlen(watchdog_program));
  (void)!write(2, tail, sizeof tail - 1);
  _exit(3);
}
static inline void start_watchdog(const char *program, unsigned seconds) {
  watchdog_program = program;
  signal(SIGALRM, watchdog_fired);
  alarm(seconds);
}

/* Until the kernel shows the process stopped (state T): a signal is
 * delivered when the process next runs. */
static inline void wait_stopped(pid_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  for (int tries = 0; tries < 5000; tries++) {
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    const char *at = strrchr(buf, ')');
    if (at && at[1] == ' ' && at[2] == 'T') return;
    usleep(1000);
  }
  fail_msg("process %d did not stop", (int)pid);
}

static inline void assert_contains(const char *haystack, const char *needle) {
  if (!strstr(haystack, needle)) fprintf(stderr, "expected \"%s\" in \"%s\"\n", needle, haystack);
  assert_non_null(strstr(haystack, needle));
}

/* A file's bytes, NUL-terminated (*len without the NUL); NULL (and *len 0)
 * when it cannot be opened. The caller frees them. */
static inline unsigned char *read_whole(const char *path, size_t *len) {
  *len = 0;
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  unsigned char *data = malloc((size_t)n + 1);
  assert_non_null(data);
  assert_int_equal(fread(data, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  data[n] = 0;
  *len = (size_t)n;
  return data;
}

#endif
