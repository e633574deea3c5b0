/* fork (label `hardening`): a child of fork inherits its parent's open
 * allocators detached. Every call on the copy is refused but gca_close,
 * which frees the child's own books and never its parent's slot in the
 * rendezvous, its share of a shared simulated device, nor the region
 * itself; the child opens its own. A fork while other threads allocate
 * copies whole books (the child closes its copy without hanging or
 * crashing). Real processes; a watchdog turns a hang into a failure. */
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"

static char name[64], spec[128];

static int fresh_name(void **state) {
  (void)state;
  static int n;
  snprintf(name, sizeof name, "fork-%d-%d", (int)getpid(), n++);
  snprintf(spec, sizeof spec, "sim:shared=%s,capacity=100MiB", name);
  return 0;
}

/* The regions a failed test may leave behind: the shared sim's, and the
 * rendezvous's (named as coop.c names it, from the device's identity). */
static int remove_regions(void **state) {
  (void)state;
  char identity[160], path[96];
  snprintf(identity, sizeof identity, "sim:/gcalloc-sim-%s:0", name);
  uint64_t h = 1469598103934665603ull;
  for (const char *c = identity; *c; c++) h = (h ^ (unsigned char)*c) * 1099511628211ull;
  snprintf(path, sizeof path, "/gcalloc-coop-%016llx", (unsigned long long)h);
  shm_unlink(path);
  snprintf(path, sizeof path, "/gcalloc-sim-%s", name);
  shm_unlink(path);
  return 0;
}

/* Whether the device's rendezvous lists `pid`. */
static bool listed(gca_allocator_t *a, int pid) {
  gca_ipc_peer_t peers[16];
  int n = gca_ipc_peers(a, 0, peers, 16);
  for (int i = 0; i < n && i < 16; i++)
    if (peers[i].pid == pid) return true;
  return false;
}

static size_t free_bytes(gca_allocator_t *a) {
  size_t f = 0, t = 0;
  assert_int_equal(gca_mem_get_info(a, 0, &f, &t), GCA_OK);
  return f;
}

/* In the child: exit 0 when every check held, else the number of the first
 * that failed (said on stderr). */
#define CHILD_CHECK(n, cond)                                                   \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "child check %d failed: %s (%s)\n", n, #cond, gca_last_error()); \
      exit(n);                                                                 \
    }                                                                          \
  } while (0)

static int wait_child(pid_t pid) {
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  if (WIFSIGNALED(status)) fprintf(stderr, "child ended by signal %d\n", WTERMSIG(status));
  assert_true(WIFEXITED(status));
  return WEXITSTATUS(status);
}

static void test_child_leaves_the_parents_share_alone(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(spec, "ipc_cooperation:True");
  void *p = gca_malloc(a, 40 * MiB, 0, 0);
  assert_non_null(p);
  size_t before = free_bytes(a);
  assert_true(before <= 60 * MiB);
  assert_true(listed(a, getpid()));
  int parent = getpid();
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    /* The copy is refused everything but gca_close, naming the parent. */
    CHILD_CHECK(10, gca_malloc(a, 4096, 0, 0) == NULL && gca_last_status() == GCA_ERR_INVALID);
    char expect[64];
    snprintf(expect, sizeof expect, "opened by process %d", parent);
    CHILD_CHECK(11, strstr(gca_last_error(), expect) && strstr(gca_last_error(), "fork"));
    CHILD_CHECK(12, gca_free(a, p) == GCA_ERR_INVALID);
    CHILD_CHECK(13, gca_empty_cache(a, -1) == GCA_ERR_INVALID);
    gca_stats_t s;
    CHILD_CHECK(14, gca_get_stats(a, 0, &s) == GCA_ERR_INVALID);
    CHILD_CHECK(15, gca_host_malloc(a, 4096) == NULL);
    gca_close(a);
    /* Its own allocator on the same device: a slot of its own, its own
     * share; the parent's 40 MiB still held. */
    gca_allocator_t *b = NULL;
    CHILD_CHECK(20, gca_open(spec, "ipc_cooperation:True", &b) == GCA_OK);
    size_t f = 0, t = 0;
    CHILD_CHECK(21, gca_mem_get_info(b, 0, &f, &t) == GCA_OK && f == before);
    void *q = gca_malloc(b, 10 * MiB, 0, 0);
    CHILD_CHECK(22, q != NULL);
    CHILD_CHECK(23, listed(b, parent) && listed(b, getpid()));
    CHILD_CHECK(24, gca_free(b, q) == GCA_OK);
    gca_close(b);
    exit(0); /* (a normal exit: atexit handlers and all) */
  }
  assert_int_equal(wait_child(pid), 0);
  /* The parent's slot, share and region are as they were. */
  assert_true(listed(a, getpid()));
  assert_false(listed(a, pid));
  assert_int_equal(free_bytes(a), before);
  static gca_ipc_device_t devices[16];
  int n = gca_ipc_scan(devices, 16);
  bool found = false;
  for (int i = 0; i < n && i < 16; i++)
    if (strstr(devices[i].identity, name))
      for (int k = 0; k < devices[i].peer_count; k++) found |= devices[i].peers[k].pid == getpid();
  assert_true(found);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

/* ---- fork while other threads allocate ------------------------------------ */

typedef struct busy {
  gca_allocator_t *a;
  _Atomic bool stop;
} busy_t;

static void *allocate_until_stopped(void *arg) {
  busy_t *b = arg;
  uint64_t seed = (uint64_t)(uintptr_t)&arg | 1;
  void *held[16] = {0};
  while (!atomic_load(&b->stop)) {
    int k = (int)(next_random(&seed) % 16);
    if (held[k]) {
      CHECK(gca_free(b->a, held[k]) == GCA_OK);
      held[k] = NULL;
    } else {
      held[k] = gca_malloc(b->a, (size_t)(next_random(&seed) % (3 * MiB)) + 1, 0, (gca_stream_t)(uintptr_t)(k % 3));
    }
    if (k == 0) CHECK(gca_empty_cache(b->a, -1) == GCA_OK);
    void *h = gca_host_malloc(b->a, 8192);
    CHECK(gca_host_free(b->a, h) == GCA_OK);
  }
  for (int k = 0; k < 16; k++) CHECK(gca_free(b->a, held[k]) == GCA_OK);
  return NULL;
}

static void test_fork_while_threads_allocate(void **state) {
  (void)state;
  atomic_store(&helper_failures, 0);
  busy_t b = {.a = open_sim("sim:capacity=512MiB", "expandable_segments:True")};
  pthread_t threads[3];
  for (int i = 0; i < 3; i++) assert_int_equal(pthread_create(&threads[i], NULL, allocate_until_stopped, &b), 0);
  for (int round = 0; round < (UNDER_TSAN ? 5 : 20); round++) {
    usleep(2000);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      gca_close(b.a); /* (whole books to walk, though threads were inside calls) */
      gca_allocator_t *own = NULL;
      CHILD_CHECK(30, gca_open("sim:capacity=64MiB", NULL, &own) == GCA_OK);
      void *p = gca_malloc(own, 4096, 0, 0);
      CHILD_CHECK(31, p && gca_free(own, p) == GCA_OK && gca_check(own, -1) == GCA_OK);
      gca_close(own);
      _exit(0);
    }
    assert_int_equal(wait_child(pid), 0);
  }
  atomic_store(&b.stop, true);
  for (int i = 0; i < 3; i++) pthread_join(threads[i], NULL);
  assert_int_equal(atomic_load(&helper_failures), 0);
  assert_consistent(b.a);
  gca_close(b.a);
}

int main(void) {
  start_watchdog("test_fork", 120);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_child_leaves_the_parents_share_alone, fresh_name, remove_regions),
      cmocka_unit_test(test_fork_while_threads_allocate),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
