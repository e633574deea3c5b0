/* One simulated device shared by several processes (label `sharing`):
 * real processes (fork) on "sim:shared=NAME" run out of memory together,
 * get back what another gave back, and what one that was killed held; a
 * region that is not gcalloc's, or a device asked for with other
 * dimensions, is refused by name. Pages created together are charged
 * exactly; and a process's liveness, kept with a pidfd between looks,
 * follows that process, not its pid or a descriptor's number. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"

static char spec[128];
static char name[64];

static int fresh_name(void **state) {
  (void)state;
  static int n;
  snprintf(name, sizeof name, "test-%d-%d", (int)getpid(), n++);
  snprintf(spec, sizeof spec, "sim:shared=%s,capacity=100MiB", name);
  return 0;
}

static void wait_byte(int fd) {
  char c;
  assert_int_equal(read(fd, &c, 1), 1);
}

static void send_byte(int fd) { assert_int_equal(write(fd, "x", 1), 1); }

static int child_status(pid_t pid) {
  int ws = 0;
  waitpid(pid, &ws, 0);
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : 100 + (WIFSIGNALED(ws) ? WTERMSIG(ws) : 0);
}

/* Two processes, one device of 100 MiB: the second cannot have 50 MiB
 * while the first holds 60, and can once it gave them back. */
static void test_processes_share_capacity(void **state) {
  (void)state;
  int to_child[2], to_parent[2];
  assert_int_equal(pipe(to_child), 0);
  assert_int_equal(pipe(to_parent), 0);
  gca_allocator_t *a = open_sim(spec, NULL);
  void *p = gca_malloc(a, 60 * MiB, 0, 0);
  assert_non_null(p);
  pid_t pid = fork();
  if (pid == 0) {
    gca_allocator_t *b = NULL;
    if (gca_open(spec, NULL, &b) != GCA_OK) _exit(2);
    size_t free_bytes = 0, total = 0;
    gca_mem_get_info(b, 0, &free_bytes, &total);
    if (total != 100 * MiB || free_bytes != 40 * MiB) _exit(3);
    void *q = gca_malloc(b, 50 * MiB, 0, 0);
    if (q || gca_last_status() != GCA_ERR_OOM || !strstr(gca_last_error(), "of which 40.00 MiB is free")) _exit(4);
    send_byte(to_parent[1]);
    wait_byte(to_child[0]); /* the parent gave its memory back */
    q = gca_malloc(b, 50 * MiB, 0, 0);
    if (!q) _exit(5);
    gca_free(b, q);
    gca_close(b);
    _exit(0);
  }
  wait_byte(to_parent[0]);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  send_byte(to_child[1]);
  assert_int_equal(child_status(pid), 0);
  size_t free_bytes = 0, total = 0;
  assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
  assert_int_equal(free_bytes, 100 * MiB); /* the child's went back with its close */
  gca_close(a);
  for (int i = 0; i < 2; i++) close(to_child[i]), close(to_parent[i]);
}

/* What a process killed with SIGKILL held comes back (its slot is
 * reclaimed when a request would not fit), as a driver frees a dead
 * process's memory. */
static void test_killed_process_memory_comes_back(void **state) {
  (void)state;
  int to_parent[2];
  assert_int_equal(pipe(to_parent), 0);
  gca_allocator_t *a = open_sim(spec, NULL);
  pid_t pid = fork();
  if (pid == 0) {
    gca_allocator_t *b = NULL;
    if (gca_open(spec, NULL, &b) != GCA_OK || !gca_malloc(b, 80 * MiB, 0, 0)) _exit(2);
    send_byte(to_parent[1]);
    pause(); /* killed here, holding 80 MiB */
    _exit(3);
  }
  wait_byte(to_parent[0]);
  size_t free_bytes = 0, total = 0;
  assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
  assert_int_equal(free_bytes, 20 * MiB);
  assert_null(gca_malloc(a, 60 * MiB, 0, 0));
  kill(pid, SIGKILL);
  assert_int_equal(child_status(pid), 100 + SIGKILL);
  void *p = gca_malloc(a, 60 * MiB, 0, 0);
  assert_non_null(p);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_consistent(a);
  gca_close(a);
  close(to_parent[0]), close(to_parent[1]);
}

/* A process stopped while it holds the region's lock (SIGSTOP, a suspended
 * job) stops nobody for longer than a second: the free memory is read
 * without the lock, a release is kept back and counted free, and an
 * allocation fails naming the holder (every one of them waited for good
 * before). Once the holder runs again, all is settled. */
static void test_stopped_lock_holder_stops_nobody(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(spec, NULL);
  void *p = gca_malloc(a, 30 * MiB, 0, 0);
  assert_non_null(p);
  pid_t pid = fork();
  if (pid == 0) {
    setenv("GCALLOC_TEST_SIM_SHARED_STOP_LOCKED", "1", 1);
    gca_allocator_t *b = NULL;
    if (gca_open(spec, NULL, &b) != GCA_OK) _exit(2);
    void *q = gca_malloc(b, 10 * MiB, 0, 0); /* (stops itself inside, the lock held) */
    unsetenv("GCALLOC_TEST_SIM_SHARED_STOP_LOCKED");
    if (!q || gca_free(b, q) != GCA_OK) _exit(3);
    gca_close(b);
    _exit(0);
  }
  wait_stopped(pid);
  double t0 = now_ms();
  size_t free_bytes = 0, total = 0, freed_bytes = 0;
  int info = gca_mem_get_info(a, 0, &free_bytes, &total);
  double info_ms = now_ms() - t0;
  int freed = gca_free(a, p), emptied = gca_empty_cache(a, -1); /* (the release is kept back) */
  int info_after = gca_mem_get_info(a, 0, &freed_bytes, &total);
  if (info != GCA_OK || free_bytes != 70 * MiB || info_ms >= 500 || freed != GCA_OK || emptied != GCA_OK ||
      info_after != GCA_OK || freed_bytes != 100 * MiB) {
    kill(pid, SIGKILL);
    child_status(pid);
    fail_msg("free %zu MiB in %.0f ms, free/empty %d/%d, then %zu MiB free", free_bytes / MiB, info_ms, freed, emptied,
             freed_bytes / MiB);
  }
  t0 = now_ms();
  void *refused = gca_malloc(a, 20 * MiB, 0, 0);
  double took = now_ms() - t0;
  char message[2048], holder[64];
  snprintf(message, sizeof message, "%s", gca_last_error());
  kill(pid, SIGCONT); /* (before any check: a failed one must not leave it stopped) */
  assert_int_equal(child_status(pid), 0);
  assert_null(refused);
  assert_true(took < 5000);
  snprintf(holder, sizeof holder, "held by pid %d", (int)pid);
  assert_contains(message, holder);
  assert_contains(message, "(stopped?)");
  void *again = gca_malloc(a, 20 * MiB, 0, 0);
  assert_non_null(again);
  assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
  assert_int_equal(free_bytes, 80 * MiB); /* (the kept-back release settled: not counted twice) */
  assert_int_equal(gca_free(a, again), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

/* A region that is not a gcalloc sim region, or a device of other
 * dimensions, is refused, naming it; nothing is created or changed. */
static void test_bad_regions_refused(void **state) {
  (void)state;
  char path[96];
  snprintf(path, sizeof path, "/gcalloc-sim-%s", name);
  int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, "not a gcalloc region", 20), 20);
  close(fd);
  gca_allocator_t *a = NULL;
  assert_int_equal(gca_open(spec, NULL, &a), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "is 20 bytes, not a gcalloc region");
  assert_null(a);
  shm_unlink(path);
  /* The right size, the wrong magic. */
  a = open_sim(spec, NULL);
  fd = shm_open(path, O_RDWR, 0600);
  assert_true(fd >= 0);
  uint64_t bad = 0x1234;
  assert_int_equal(pwrite(fd, &bad, sizeof bad, 0), (ssize_t)sizeof bad);
  gca_allocator_t *b = NULL;
  assert_int_equal(gca_open(spec, NULL, &b), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "is not a gcalloc sim region (magic 0x1234)");
  uint64_t magic = 0x4843534d49534347ull;
  assert_int_equal(pwrite(fd, &magic, sizeof magic, 0), (ssize_t)sizeof magic);
  close(fd);
  /* Other dimensions. */
  char other[160];
  snprintf(other, sizeof other, "sim:shared=%s,capacity=200MiB", name);
  assert_int_equal(gca_open(other, NULL, &b), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "of 104857600 bytes; this one asks for 1 of 209715200");
  snprintf(other, sizeof other, "sim:shared=%s,devices=2", name);
  assert_int_equal(gca_open(other, NULL, &b), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "this one asks for 2");
  snprintf(other, sizeof other, "sim:shared=%s", name); /* no capacity given: the region's */
  b = open_sim(other, NULL);
  size_t free_bytes = 0, total = 0;
  assert_int_equal(gca_mem_get_info(b, 0, &free_bytes, &total), GCA_OK);
  assert_int_equal(total, 100 * MiB);
  gca_close(b);
  assert_int_equal(gca_open("sim:shared=a/b", NULL, &b), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "a name is 1 to 64 letters");
  gca_close(a);
  /* The last one out removed it. */
  assert_int_equal(shm_open(path, O_RDWR, 0600), -1);
}

/* Pages created together are charged to the shared device in one visit
 * (as many as fit) and the rest one by one: a mapping that does not fit
 * fails at the first page too many, and leaves nothing charged behind. */
static void test_pages_created_together_charge_exactly(void **state) {
  (void)state;
  int to_parent[2];
  assert_int_equal(pipe(to_parent), 0);
  gca_allocator_t *a = open_sim(spec, NULL);
  void *p = gca_malloc(a, 60 * MiB, 0, 0);
  assert_non_null(p);
  pid_t pid = fork();
  if (pid == 0) {
    gca_allocator_t *b = NULL;
    if (gca_open(spec, "expandable_segments:True", &b) != GCA_OK) _exit(2);
    if (gca_malloc(b, 50 * MiB, 0, 0) || gca_last_status() != GCA_ERR_OOM) _exit(3);
    size_t free_bytes = 0, total = 0;
    gca_mem_get_info(b, 0, &free_bytes, &total);
    if (free_bytes != 40 * MiB) _exit(4); /* (the 20 pages made before the refusal went back) */
    void *q = gca_malloc(b, 40 * MiB, 0, 0);
    gca_mem_get_info(b, 0, &free_bytes, &total);
    if (!q || free_bytes != 0) _exit(5);
    if (gca_malloc(b, 2 * MiB, 0, 0)) _exit(6);
    gca_free(b, q);
    gca_empty_cache(b, -1);
    gca_mem_get_info(b, 0, &free_bytes, &total);
    if (free_bytes != 40 * MiB) _exit(7);
    send_byte(to_parent[1]);
    gca_close(b);
    _exit(0);
  }
  wait_byte(to_parent[0]);
  assert_int_equal(child_status(pid), 0);
  size_t free_bytes = 0, total = 0;
  assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
  assert_int_equal(free_bytes, 40 * MiB);
  assert_int_equal(gca_free(a, p), GCA_OK);
  gca_close(a);
  close(to_parent[0]), close(to_parent[1]);
}

/* The descriptors this process has open, as a bit set of the first 1024. */
static void open_fds(unsigned char set[128]) {
  memset(set, 0, 128);
  DIR *d = opendir("/proc/self/fd");
  assert_non_null(d);
  for (struct dirent *e; (e = readdir(d));) {
    int fd = atoi(e->d_name);
    if (e->d_name[0] != '.' && fd != dirfd(d) && fd < 1024) set[fd / 8] |= (unsigned char)(1u << (fd % 8));
  }
  closedir(d);
}

/* The one descriptor open now that was not in `before`; -1 if none. */
static int opened_since(const unsigned char before[128]) {
  unsigned char now[128];
  open_fds(now);
  int found = -1;
  for (int fd = 0; fd < 1024; fd++)
    if ((now[fd / 8] & (1u << (fd % 8))) && !(before[fd / 8] & (1u << (fd % 8)))) {
      assert_int_equal(found, -1);
      found = fd;
    }
  return found;
}

/* A child that waits until the pipe's writing end `go[1]` is closed (a
 * test that fails leaves no child behind once it exits). */
static pid_t waiting_child(const int go[2]) {
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    char c;
    close(go[1]);
    (void)!read(go[0], &c, 1);
    _exit(0);
  }
  return pid;
}

/* Killed, and a zombie: not reaped, so that its pid stays its own. */
static void kill_to_zombie(pid_t pid) {
  kill(pid, SIGKILL);
  siginfo_t info;
  assert_int_equal(waitid(P_PID, (id_t)pid, &info, WEXITED | WNOWAIT), 0);
}

/* A process found alive is kept with a pidfd: later looks ask it, and see
 * the process end (a zombie counts as ended, as by /proc), and the pidfd
 * is closed then. Asked about with another start time, the same pid is
 * another process, which has ended. */
static void test_liveness_follows_the_process(void **state) {
  (void)state;
  int go[2];
  assert_int_equal(pipe(go), 0);
  pid_t pid = waiting_child(go);
  uint64_t start = gca__process_start_time(pid);
  assert_true(start != 0);
  unsigned char before[128];
  open_fds(before);
  assert_true(gca__process_alive(pid, start)); /* (by /proc, then kept) */
  int kept = opened_since(before); /* (-1 where pidfd_open is refused: the proof by /proc each time) */
  assert_true(gca__process_alive(pid, start));
  assert_false(gca__process_alive(pid, start + 1));
  assert_true(gca__process_alive(pid, start));
  kill_to_zombie(pid);
  assert_false(gca__process_alive(pid, start));
  if (kept >= 0) assert_int_equal(opened_since(before), -1); /* (closed with its process) */
  assert_int_equal(child_status(pid), 100 + SIGKILL);
  close(go[0]), close(go[1]);
}

/* A program that closes descriptors it does not own (a daemon's
 * close_range) may reuse a kept pidfd's number for a file of its own:
 * gcalloc then neither trusts nor closes it. */
static void test_liveness_ignores_a_reused_descriptor(void **state) {
  (void)state;
  int go[2];
  assert_int_equal(pipe(go), 0);
  pid_t pid = waiting_child(go);
  uint64_t start = gca__process_start_time(pid);
  unsigned char before[128];
  open_fds(before);
  assert_true(gca__process_alive(pid, start));
  int kept = opened_since(before);
  if (kept < 0) { /* (no pidfd here: nothing to reuse) */
    kill_to_zombie(pid);
    assert_false(gca__process_alive(pid, start));
    assert_int_equal(child_status(pid), 100 + SIGKILL);
    close(go[0]), close(go[1]);
    skip();
  }
  close(kept);
  int mine = open("/dev/null", O_RDONLY); /* (the lowest free number: the pidfd's) */
  assert_int_equal(mine, kept);
  kill_to_zombie(pid);
  assert_false(gca__process_alive(pid, start));
  assert_int_not_equal(fcntl(mine, F_GETFD), -1); /* still the program's */
  close(mine);
  assert_int_equal(child_status(pid), 100 + SIGKILL);
  close(go[0]), close(go[1]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_processes_share_capacity, fresh_name),
      cmocka_unit_test_setup(test_killed_process_memory_comes_back, fresh_name),
      cmocka_unit_test_setup(test_bad_regions_refused, fresh_name),
      cmocka_unit_test_setup(test_stopped_lock_holder_stops_nobody, fresh_name),
      cmocka_unit_test_setup(test_pages_created_together_charge_exactly, fresh_name),
      cmocka_unit_test(test_liveness_follows_the_process),
      cmocka_unit_test(test_liveness_ignores_a_reused_descriptor),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
