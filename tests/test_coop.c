/* Processes on one device releasing cache for each other (label
 * `sharing`): real processes, forked and exec'ed (this program, as a
 * peer), on one shared sim device. A peer caches memory it does not use;
 * without cooperation the other process runs out of memory, with it the
 * peer's thread releases and the request succeeds, the bytes counted on
 * both sides; a stopped peer makes the requester fail within its deadline
 * naming it; several peers together; processes taking turns at needing
 * most of the device; a request no release can meet; a region that is not
 * one leaves cooperation off; the hot path makes no system call; the CUDA
 * and AscendCL stand-ins' device identities. */
#include <dlfcn.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>
#include <fcntl.h>

#include "helpers.h"

/* Cooperation with ordinary segments, of the sizes the tests allocate:
 * these tests are about the protocol. The default (expandable segments,
 * pages released from segments in use) has tests of its own. */
#define COOP "ipc_cooperation:True,expandable_segments:False"

static char name[64], spec[128];

static int fresh_name(void **state) {
  (void)state;
  static int n;
  snprintf(name, sizeof name, "coop-%d-%d", (int)getpid(), n++);
  snprintf(spec, sizeof spec, "sim:shared=%s,capacity=100MiB", name);
  return 0;
}

/* The rendezvous's name, as coop.c makes it from the device's identity. */
static void coop_path(char *out, size_t cap) {
  char identity[160];
  snprintf(identity, sizeof identity, "sim:/gcalloc-sim-%s:0", name);
  uint64_t h = 1469598103934665603ull;
  for (const char *s = identity; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  snprintf(out, cap, "/gcalloc-coop-%016llx", (unsigned long long)h);
}

/* A peer killed while the others had left keeps its regions: removed
 * after each test. */
static int remove_regions(void **state) {
  (void)state;
  char path[96];
  coop_path(path, sizeof path);
  shm_unlink(path);
  snprintf(path, sizeof path, "/gcalloc-sim-%s", name);
  shm_unlink(path);
  return 0;
}

/* With GCALLOC_TEST_PEER_HISTORY set, a peer records its history and,
 * once a request emptied its cache, tells on `out` what its last entries
 * say: "<action> <size> <requester pid> <segment_free entries before it>". */
static int report_release(gca_allocator_t *a, int out) {
  for (int tries = 0; tries < 1000 && stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current; tries++) usleep(10000);
  gca_snapshot_t *sn = NULL;
  if (gca_snapshot_take(a, &sn) != GCA_OK) return 5;
  const gca_trace_entry_t *e = sn->device_traces[0];
  size_t n = sn->trace_counts[0], last = n - 1, frees = 0;
  while (last > 0 && e[last].action == GCA_TRACE_SNAPSHOT) last--;
  for (size_t i = 0; i < last; i++) frees += e[i].action == GCA_TRACE_SEGMENT_FREE;
  dprintf(out, "%d %llu %d %zu\n", n ? e[last].action : -1, n ? (unsigned long long)e[last].size : 0ull,
          n ? e[last].ipc_requester : 0, frees);
  gca_snapshot_free(sn);
  return 0;
}

/* A peer: caches `mib` MiB (allocated, then freed) on the shared device
 * with cooperation on (COOP, or GCALLOC_TEST_PEER_CONF), says so on fd
 * `ready`, and waits to be killed. */
static int peer_main(const char *peer_spec, int mib, int ready) {
  gca_allocator_t *a = NULL;
  const char *conf = getenv("GCALLOC_TEST_PEER_CONF");
  if (gca_open(peer_spec, conf ? conf : COOP, &a) != GCA_OK) {
    fprintf(stderr, "peer: %s\n", gca_last_error());
    return 2;
  }
  if (getenv("GCALLOC_TEST_PEER_CHURN")) { /* a segment taken and given back every 2 ms */
    if (write(ready, "r", 1) != 1) return 4;
    for (unsigned k = 1;; k = k * 1103515245u + 12345u) {
      void *q = gca_malloc(a, (size_t)(k >> 16) % (10 * MiB) + MiB, 0, 0);
      usleep(1000); /* (held for a millisecond: about a thousand changes a second) */
      if (q && gca_free(a, q) != GCA_OK) return 3;
      if (gca_empty_cache(a, 0) != GCA_OK) return 3;
      usleep(1000); /* (and as long without) */
    }
  }
  const char *split = getenv("GCALLOC_TEST_PEER_SPLIT"); /* "80,40": 80 MiB cached, then 40 of it live */
  if (split) {
    void *whole = gca_malloc(a, (size_t)atoi(split) * MiB, 0, 0);
    if (!whole || gca_free(a, whole) != GCA_OK) return 3;
    if (!gca_malloc(a, (size_t)atoi(strchr(split, ',') + 1) * MiB, 0, 0) || write(ready, "r", 1) != 1) return 3;
    for (;;) pause();
  }
  bool history = getenv("GCALLOC_TEST_PEER_HISTORY") != NULL;
  if (history && gca_record_history(a, 1, GCA_CONTEXT_ALL, 1000) != GCA_OK) return 2;
  if (getenv("GCALLOC_TEST_PEER_PAUSE")) { /* the memory is held by a paused pool instead */
    gca_pool_t pool = 0;
    if (gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &pool) != GCA_OK || gca_pool_push(a, pool) != GCA_OK) return 3;
    void *held = gca_malloc(a, (size_t)mib * MiB, 0, 0);
    if (!held || gca_pool_pop(a) != GCA_OK || gca_pool_pause(a, pool, 0, NULL) != GCA_OK) return 3;
    const char *cache = getenv("GCALLOC_TEST_PEER_CACHE_MIB"); /* and this much cached beside it */
    void *cached = cache ? gca_malloc(a, (size_t)atoi(cache) * MiB, 0, 0) : NULL;
    if (cache && (!cached || gca_free(a, cached) != GCA_OK)) return 3;
    if (write(ready, "r", 1) != 1) return 4;
    for (;;) pause();
  }
  const char *segments = getenv("GCALLOC_TEST_PEER_SEGMENTS"); /* "12,20,40": a cached segment of each (MiB) */
  if (segments) {
    void *held[8];
    int n = 0;
    for (const char *s = segments; *s && n < 8; s += strspn(s, ",")) {
      char *end;
      held[n] = gca_malloc(a, (size_t)strtol(s, &end, 10) * MiB, 0, 0);
      if (!held[n++] || end == s) return 3;
      s = end;
    }
    while (n) if (gca_free(a, held[--n]) != GCA_OK) return 3;
    if (write(ready, "r", 1) != 1) return 4;
    for (;;) pause();
  }
  void *p = gca_malloc(a, (size_t)mib * MiB, 0, 0);
  const char *later = getenv("GCALLOC_TEST_PEER_FREE_AFTER_MS");
  if (later) { /* live at first, freed into the cache this much later */
    if (!p || write(ready, "r", 1) != 1) return 4;
    usleep((useconds_t)atoi(later) * 1000);
    if (gca_free(a, p) != GCA_OK) return 3;
    for (;;) pause();
  }
  if (!p || gca_free(a, p) != GCA_OK) return 3;
  if (write(ready, "r", 1) != 1) return 4;
  if (history && report_release(a, ready) != 0) return 5;
  const char *regrow = getenv("GCALLOC_TEST_PEER_REGROW_MS");
  while (regrow) { /* each time its cache is released, it grows it again this much later */
    while (gca_reserved_bytes(a, 0) != 0) usleep(1000);
    usleep((useconds_t)atoi(regrow) * 1000);
    p = gca_malloc(a, (size_t)mib * MiB, 0, 0);
    if (p && gca_free(a, p) != GCA_OK) return 3;
    if (!p) usleep(1000);
  }
  for (;;) pause();
}

/* A process taking turns: at each byte on `in` it allocates `mib` MiB and
 * frees it (the memory stays cached), answering 'd' (done) or 'o' (out of
 * memory) on `out`; at end of input it answers its requests and bytes
 * received, as statistics count them. */
static int phases_main(const char *peer_spec, const char *conf, int mib, int in, int out) {
  gca_allocator_t *a = NULL;
  if (gca_open(peer_spec, strcmp(conf, "-") ? conf : NULL, &a) != GCA_OK) {
    fprintf(stderr, "phases: %s\n", gca_last_error());
    return 2;
  }
  char c;
  while (read(in, &c, 1) == 1) {
    void *p = gca_malloc(a, (size_t)mib * MiB, 0, 0);
    if (!p && strcmp(conf, "-")) fprintf(stderr, "phases %d: %s\n", (int)getpid(), gca_last_error());
    if (p && gca_free(a, p) != GCA_OK) return 3;
    if (write(out, p ? "d" : "o", 1) != 1) return 4;
  }
  gca_stats_t s;
  if (gca_get_stats(a, 0, &s) != GCA_OK) return 5;
  dprintf(out, "%lld %lld\n", (long long)s.num_ipc_requests, (long long)s.ipc_bytes_received);
  gca_close(a);
  return 0;
}

/* The hot path under a seccomp filter that traps every system call but the
 * report's write and the exit: each trap is counted. */
#define REPORT_FD 100
static volatile sig_atomic_t trapped_calls, first_trapped = -1;

static void on_sigsys(int sig, siginfo_t *info, void *context) {
  (void)sig, (void)context;
  if (first_trapped < 0) first_trapped = info->si_syscall;
  trapped_calls++;
}

static int hot_path_main(const char *peer_spec) {
  gca_allocator_t *a = NULL;
  if (gca_open(peer_spec, COOP, &a) != GCA_OK) return 2;
  static const size_t sizes[] = {512, 4096, 1 << 20, 8 << 20, 24 << 20};
  void *p[5];
  for (int i = 0; i < 5; i++) p[i] = gca_malloc(a, sizes[i], 0, 0); /* the cache, made once */
  for (int i = 0; i < 5; i++)
    if (!p[i] || gca_free(a, p[i]) != GCA_OK) return 3;
  struct sigaction sa = {0};
  sa.sa_sigaction = on_sigsys;
  sa.sa_flags = SA_SIGINFO;
  if (sigaction(SIGSYS, &sa, NULL) != 0) return 4;
  struct sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_rt_sigreturn, 5, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_exit_group, 4, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_write, 0, 2),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, REPORT_FD, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_TRAP),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {sizeof filter / sizeof filter[0], filter};
  /* This thread only: the cooperation thread goes on answering. */
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
    return 5;
  for (int round = 0; round < 100000; round++)
    for (int i = 0; i < 5; i++) {
      void *q = gca_malloc(a, sizes[i], 0, 0);
      if (!q || gca_free(a, q) != GCA_OK) trapped_calls += 1000000; /* (a failure: reported as calls) */
    }
  char text[64];
  int n = snprintf(text, sizeof text, "%d %d\n", (int)trapped_calls, (int)first_trapped);
  if (write(REPORT_FD, text, (size_t)n) != n) return 6;
  syscall(SYS_exit_group, 0); /* (no close: it would make system calls) */
  return 0;
}

typedef struct peer {
  pid_t pid;
  int fd; /* what it tells after it is ready */
} peer_t;

/* fork(), the child killed when this process ends: a test that fails
 * half-way leaves no peer behind to hold its output open. */
static pid_t fork_child(void) {
  pid_t parent = getpid(), pid = fork();
  if (pid == 0 && (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)) _exit(125);
  return pid;
}

static peer_t start_peer(int mib) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = fork_child();
  if (pid == 0) {
    close(fds[0]);
    char mib_text[16], fd_text[16];
    snprintf(mib_text, sizeof mib_text, "%d", mib);
    snprintf(fd_text, sizeof fd_text, "%d", fds[1]);
    execl("/proc/self/exe", "test_coop", "--peer", spec, mib_text, fd_text, (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  char c;
  assert_int_equal(read(fds[0], &c, 1), 1);
  return (peer_t){pid, fds[0]};
}

/* A peer started without waiting for it (it may be killed at any point). */
static pid_t spawn_peer(int mib) {
  pid_t pid = fork_child();
  if (pid == 0) {
    int devnull = open("/dev/null", O_WRONLY);
    char mib_text[16], fd_text[16];
    snprintf(mib_text, sizeof mib_text, "%d", mib);
    snprintf(fd_text, sizeof fd_text, "%d", devnull);
    execl("/proc/self/exe", "test_coop", "--peer", spec, mib_text, fd_text, (char *)NULL);
    _exit(127);
  }
  return pid;
}

static void stop_peer(peer_t p) {
  kill(p.pid, SIGKILL);
  waitpid(p.pid, NULL, 0);
  close(p.fd);
}

/* A peer started with the test variables NAME, VALUE, ... (NULL-ended) set
 * for it alone. */
static peer_t start_peer_with(int mib, ...) {
  const char *names[4];
  int n = 0;
  va_list ap;
  va_start(ap, mib);
  for (const char *variable; n < 4 && (variable = va_arg(ap, const char *)); n++) {
    names[n] = variable;
    setenv(variable, va_arg(ap, const char *), 1);
  }
  va_end(ap);
  peer_t peer = start_peer(mib);
  for (int i = 0; i < n; i++) unsetenv(names[i]);
  return peer;
}

/* Whether `a` sees the peer `want.pid` publish these reserved, allocated,
 * cached and paused bytes within a second (peers publish every 100 ms). */
static bool peer_publishes(gca_allocator_t *a, gca_ipc_peer_t want) {
  gca_ipc_peer_t peers[8];
  for (int tries = 0; tries < 100; tries++) {
    int n = gca_ipc_peers(a, 0, peers, 8);
    for (int i = 0; i < n && i < 8; i++)
      if (peers[i].pid == want.pid && peers[i].reserved_bytes == want.reserved_bytes &&
          peers[i].allocated_bytes == want.allocated_bytes && peers[i].cached_bytes == want.cached_bytes &&
          peers[i].paused_bytes == want.paused_bytes)
        return true;
    usleep(10000);
  }
  return false;
}

static void test_without_cooperation_one_runs_out(void **state) {
  (void)state;
  peer_t peer = start_peer(60);
  gca_allocator_t *a = open_sim(spec, NULL); /* cooperation off here */
  assert_null(gca_malloc(a, 60 * MiB, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  stop_peer(peer); /* (first: the last process out removes the region) */
  gca_close(a);
}

static void test_a_peer_releases_its_cache(void **state) {
  (void)state;
  peer_t peer = start_peer(60);
  gca_allocator_t *a = open_sim(spec, COOP);
  gca_ipc_peer_t peers[8];
  int n = 0;
  for (int tries = 0; tries < 100; tries++) { /* (the peer publishes every 100 ms) */
    n = gca_ipc_peers(a, 0, peers, 8);
    bool seen = false;
    for (int i = 0; i < n && i < 8; i++) seen |= peers[i].pid == peer.pid && peers[i].cached_bytes == 60 * MiB;
    if (seen) break;
    usleep(10000);
  }
  assert_int_equal(n, 2);
  /* The same from outside, as gcalloc top reads it. */
  static gca_ipc_device_t devices[16];
  int found = gca_ipc_scan(devices, 16);
  bool listed = false;
  for (int i = 0; i < found && i < 16; i++)
    for (int k = 0; k < devices[i].peer_count; k++)
      listed |= devices[i].peers[k].pid == peer.pid && devices[i].peers[k].cached_bytes == 60 * MiB &&
                strstr(devices[i].identity, name) != NULL;
  assert_true(listed);
#ifdef GCALLOC_TOOL_PATH
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s top --json > /tmp/gcalloc-top-%d.json", GCALLOC_TOOL_PATH, (int)getpid());
  assert_int_equal(system(cmd), 0);
  snprintf(cmd, sizeof cmd, "/tmp/gcalloc-top-%d.json", (int)getpid());
  size_t len;
  char *json = (char *)read_whole(cmd, &len);
  assert_non_null(json);
  char expect[64];
  snprintf(expect, sizeof expect, "\"pid\": %d, \"reserved_bytes\": %zu", (int)peer.pid, 60 * MiB);
  assert_contains(json, expect);
  free(json);
  unlink(cmd);
#endif
  void *p = gca_malloc(a, 60 * MiB, 0, 0);
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_ipc_requests, 1);
  assert_int_equal(s.num_ipc_peers_asked, 1);
  assert_int_equal(s.ipc_bytes_received, 60 * MiB); /* what the peer's statistics said it cached */
  assert_int_equal(s.num_ipc_timeouts, 0);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_consistent(a);
  stop_peer(peer); /* (first: the last process out removes the region) */
  gca_close(a);
}

/* Both histories tell what happened: the requester's an ipc_request entry
 * (what it needed, asked, received; its stack) before the segment it then
 * took, in the snapshot and its JSON; the peer's an ipc_release entry
 * (what it released, who asked) after its segment_free. */
static void test_history_records_cooperation(void **state) {
  (void)state;
  peer_t peer = start_peer_with(60, "GCALLOC_TEST_PEER_HISTORY", "1", NULL);
  gca_allocator_t *a = open_sim(spec, COOP);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_ALL, 1000), GCA_OK);
  void *p = gca_malloc(a, 60 * MiB, 0, 0);
  assert_non_null(p);
  gca_snapshot_t *sn = NULL;
  assert_int_equal(gca_snapshot_take(a, &sn), GCA_OK);
  const gca_trace_entry_t *e = sn->device_traces[0];
  size_t n = sn->trace_counts[0], at = n;
  for (size_t i = 0; i < n; i++)
    if (e[i].action == GCA_TRACE_IPC_REQUEST) at = i;
  assert_true(at + 2 < n);
  assert_int_equal(e[at].size, 20 * MiB); /* (what the request lacked: 40 MiB were free) */
  assert_int_equal(e[at].ipc_peers_asked, 1);
  assert_int_equal(e[at].ipc_peers_silent, 0);
  assert_int_equal(e[at].ipc_bytes_received, 60 * MiB);
  assert_true(e[at].frame_count > 0);
  assert_int_equal(e[at + 1].action, GCA_TRACE_SEGMENT_ALLOC);
  assert_int_equal(e[at + 2].action, GCA_TRACE_ALLOC);
  char path[64];
  snprintf(path, sizeof path, "/tmp/gcalloc-coop-history-%d.json", (int)getpid());
  assert_int_equal(gca_snapshot_write(sn, path, GCA_SNAPSHOT_JSON), GCA_OK);
  size_t len;
  char *json = (char *)read_whole(path, &len);
  assert_non_null(json);
  assert_contains(json, "\"action\":\"ipc_request\",\"addr\":0,\"size\":20971520,");
  assert_contains(json, "\"peers_asked\":1,\"peers_silent\":0,\"bytes_received\":62914560,\"frames\":[{");
  free(json);
  unlink(path);
#ifdef GCALLOC_TOOL_PATH
  /* The replay reads such a snapshot, passing over the new entries. */
  snprintf(path, sizeof path, "/tmp/gcalloc-coop-history-%d.pickle", (int)getpid());
  assert_int_equal(gca_snapshot_write(sn, path, GCA_SNAPSHOT_PICKLE), GCA_OK);
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s replay %s > /dev/null", GCALLOC_TOOL_PATH, path);
  assert_int_equal(system(cmd), 0);
  unlink(path);
#endif
  gca_snapshot_free(sn);
  /* The peer's last entry, after its one segment_free. */
  char line[128] = {0};
  size_t got = 0;
  while (got < sizeof line - 1 && read(peer.fd, line + got, 1) == 1 && line[got] != '\n') got++;
  char expect[128];
  snprintf(expect, sizeof expect, "%d %zu %d 1\n", GCA_TRACE_IPC_RELEASE, 60 * MiB, (int)getpid());
  assert_string_equal(line, expect);
  assert_int_equal(gca_free(a, p), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

/* A pool paused in another process gave its memory back to the device:
 * this process allocates it without asking anyone, and the peer publishes
 * its live block with nothing reserved under it. */
static void test_paused_pool_frees_memory_for_others(void **state) {
  (void)state;
  peer_t peer = start_peer_with(60, "GCALLOC_TEST_PEER_PAUSE", "1", NULL);
  gca_allocator_t *a = open_sim(spec, COOP);
  void *p = gca_malloc(a, 80 * MiB, 0, 0);
  assert_non_null(p);
  assert_int_equal(stats_of(a, 0).num_ipc_requests, 0);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = peer.pid, .paused_bytes = 60 * MiB}));
  assert_int_equal(gca_free(a, p), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

/* A resume makes room as an allocation does: with its own cache not
 * enough, the peers are asked for the pool's need. */
static void test_resume_asks_the_peers(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(spec, COOP);
  gca_pool_t pool = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &pool), GCA_OK);
  assert_int_equal(gca_pool_push(a, pool), GCA_OK);
  void *x = gca_malloc(a, 40 * MiB, 0, 0);
  assert_non_null(x);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_pause(a, pool, 0, NULL), GCA_OK);
  peer_t peer = start_peer(80); /* takes what the pause gave back, and caches it */
  assert_int_equal(gca_pool_resume(a, pool, 0), GCA_OK);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_ipc_requests, 1);
  assert_true(s.ipc_bytes_received >= (int64_t)(40 * MiB));
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_pool_release(a, pool), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

/* A peer's paused pool is not counted against its cache: 30 MiB cached
 * beside 60 MiB paused is published as 30 MiB cached, and served. */
static void test_paused_pool_leaves_the_cache_whole(void **state) {
  (void)state;
  peer_t peer = start_peer_with(60, "GCALLOC_TEST_PEER_PAUSE", "1", "GCALLOC_TEST_PEER_CACHE_MIB", "30", NULL);
  gca_allocator_t *a = open_sim(spec, COOP);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = peer.pid, .reserved_bytes = 30 * MiB, .cached_bytes = 30 * MiB,
                                                 .paused_bytes = 60 * MiB}));
  void *p = gca_malloc(a, 90 * MiB, 0, 0); /* 70 free, and the peer's 30 */
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  assert_int_equal(gca_free(a, p), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

static void test_several_peers(void **state) {
  (void)state;
  peer_t peers[3];
  for (int i = 0; i < 3; i++) peers[i] = start_peer(30);
  usleep(250000); /* every peer has published */
  gca_allocator_t *a = open_sim(spec, COOP);
  void *p = gca_malloc(a, 80 * MiB, 0, 0);
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_ipc_requests, 1); /* one request... */
  assert_true(s.num_ipc_peers_asked >= 3); /* ...to all three: the 10 MiB free and 30 + 30 cached are short of 80 */
  assert_true(s.ipc_bytes_received >= (int64_t)(70 * MiB));
  assert_int_equal(gca_free(a, p), GCA_OK);
  for (int i = 0; i < 3; i++) stop_peer(peers[i]);
  gca_close(a);
}

/* A stopped peer with the most cache does not block a request another
 * peer can serve: when it has not answered within a quarter of the
 * timeout (at most 100 ms), the others are asked too. */
static void test_stopped_peer_does_not_block_the_others(void **state) {
  (void)state;
  peer_t big = start_peer(60), small = start_peer(30);
  usleep(250000); /* both have published: 60 MiB cached covers the need alone */
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:2000");
  kill(big.pid, SIGSTOP);
  wait_stopped(big.pid);
  double t0 = now_ms();
  void *p = gca_malloc(a, 30 * MiB, 0, 0); /* 10 MiB free: the small one's 30 serve it */
  double took = now_ms() - t0;
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  assert_true(took < 1000); /* well before the 2 s timeout */
  gca_stats_t st = stats_of(a, 0);
  assert_int_equal(st.num_ipc_requests, 1);
  assert_int_equal(st.num_ipc_peers_asked, 2);
  assert_int_equal(gca_free(a, p), GCA_OK);
  kill(big.pid, SIGCONT);
  stop_peer(big);
  stop_peer(small);
  gca_close(a);
}

/* What a peer released is used before it grows its cache again: the
 * request does not wait for a stopped peer once the answers cover it. */
static void test_released_memory_is_used_at_once(void **state) {
  (void)state;
  peer_t big = start_peer(60);
  peer_t small = start_peer_with(30, "GCALLOC_TEST_PEER_REGROW_MS", "200", NULL);
  usleep(250000);
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:1000");
  kill(big.pid, SIGSTOP);
  wait_stopped(big.pid);
  for (int i = 0; i < 3; i++) {
    void *p = gca_malloc(a, 30 * MiB, 0, 0);
    if (!p) fprintf(stderr, "round %d: %s\n", i, gca_last_error());
    assert_non_null(p);
    assert_int_equal(gca_free(a, p), GCA_OK);
    assert_int_equal(gca_empty_cache(a, 0), GCA_OK); /* (the small peer grows again 200 ms later) */
    usleep(400000);
  }
  kill(big.pid, SIGCONT);
  stop_peer(big);
  stop_peer(small);
  gca_close(a);
}

/* An allocation waiting for memory (oom_retry_timeout_ms) asks the peers
 * again: memory a peer frees into its cache while it waits serves it. */
static void test_waiting_asks_the_peers_again(void **state) {
  (void)state;
  /* 70 MiB live, freed into its cache 1 s later (well after the first round, on a loaded machine too) */
  peer_t peer = start_peer_with(70, "GCALLOC_TEST_PEER_FREE_AFTER_MS", "1000", NULL);
  gca_allocator_t *a = open_sim(spec, COOP ",oom_retry_timeout_ms:5000");
  double t0 = now_ms();
  void *p = gca_malloc(a, 50 * MiB, 0, 0); /* 30 MiB free until the peer's free */
  double took = now_ms() - t0;
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  assert_true(took < 4000); /* well before the 5 s wait runs out */
  gca_stats_t st = stats_of(a, 0);
  assert_int_equal(st.num_ipc_requests, 1); /* (one allocation asked) */
  assert_true(st.num_ipc_rounds >= 2);      /* (in rounds, while it waited) */
  assert_int_equal(gca_free(a, p), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

/* An observer (gcalloc top, gca_ipc_scan) survives a region truncated and
 * restored under it (a same-user process rewriting it): it copies the
 * region rather than mapping it, so a short read skips it where a mapping
 * would die of SIGBUS. (Members map the region: a process of the same user
 * that truncates or scribbles into it can still kill them; docs/sharing.md.) */
static void test_scan_survives_a_rewritten_region(void **state) {
  (void)state;
  peer_t peer = start_peer(10);
  char path[64], file[96];
  coop_path(path, sizeof path);
  snprintf(file, sizeof file, "/dev/shm%s", path);
  struct stat st;
  assert_int_equal(stat(file, &st), 0);
  pid_t cutter = fork_child();
  if (cutter == 0) {
    int fd = open(file, O_RDWR);
    for (int i = 0; fd >= 0 && i < 10000; i++)
      if (ftruncate(fd, st.st_size / 2) != 0 || ftruncate(fd, st.st_size) != 0) _exit(2);
    _exit(fd >= 0 ? 0 : 3);
  }
  pid_t reader = fork_child();
  if (reader == 0) {
    gca_ipc_device_t devices[16];
    for (int i = 0; i < 10000; i++) (void)gca_ipc_scan(devices, 16);
    _exit(0);
  }
  int ws = 0;
  assert_int_equal(waitpid(reader, &ws, 0), reader);
  if (WIFSIGNALED(ws)) fprintf(stderr, "the reader died of signal %d\n", WTERMSIG(ws));
  assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  assert_int_equal(waitpid(cutter, &ws, 0), cutter);
  assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  stop_peer(peer); /* (it may have died of the truncation itself) */
}

/* A peer in a pid namespace of its own that shares /dev/shm (a container
 * run with --ipc=host and its own /proc): its pid means nothing to this
 * process's /proc, so its slots must not be reclaimed as dead, in the
 * rendezvous nor in the shared sim. Needs root (unshare); skipped else. */
static pid_t start_peer_in_own_pid_namespace(int mib, int *ready) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t outer = fork_child();
  if (outer == 0) {
    if (unshare(CLONE_NEWPID | CLONE_NEWNS) != 0) _exit(77);
    pid_t inner = fork();
    if (inner == 0) {
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
          mount("proc", "/proc", "proc", 0, NULL) != 0)
        _exit(77);
      close(fds[0]);
      char mib_text[16], fd_text[16];
      snprintf(mib_text, sizeof mib_text, "%d", mib);
      snprintf(fd_text, sizeof fd_text, "%d", fds[1]);
      execl("/proc/self/exe", "test_coop", "--peer", spec, mib_text, fd_text, (char *)NULL);
      _exit(127);
    }
    int ws = 0;
    waitpid(inner, &ws, 0);
    _exit(WIFEXITED(ws) ? WEXITSTATUS(ws) : 1);
  }
  close(fds[1]);
  char c;
  *ready = read(fds[0], &c, 1) == 1;
  close(fds[0]);
  return outer;
}

static void test_peer_in_another_pid_namespace(void **state) {
  (void)state;
  if (geteuid() != 0) skip();
  int ready = 0;
  pid_t peer = start_peer_in_own_pid_namespace(60, &ready);
  if (!ready) { /* (no user namespaces or mounts allowed here) */
    kill(peer, SIGKILL);
    waitpid(peer, NULL, 0);
    skip();
  }
  gca_allocator_t *a = open_sim(spec, COOP);
  gca_ipc_peer_t peers[4];
  int n = 0;
  for (int tries = 0; tries < 100 && n != 2; tries++) {
    n = gca_ipc_peers(a, 0, peers, 4);
    if (n != 2) usleep(10000);
  }
  assert_int_equal(n, 2); /* the peer's slot was not reclaimed */
  void *p = gca_malloc(a, 80 * MiB, 0, 0); /* 40 free: the peer's 60 cached are asked for */
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_ipc_requests, 1);
  assert_int_equal(s.ipc_bytes_received, 60 * MiB);
  assert_null(gca_malloc(a, 30 * MiB, 0, 0)); /* the device's books are whole: 80 of 100 taken, nothing cached */
  assert_int_equal(gca_free(a, p), GCA_OK);
  kill(peer, SIGKILL);
  waitpid(peer, NULL, 0);
  gca_close(a);
}

/* A peer in a pid namespace of its own, killed (a container stopped with
 * docker kill): its pid means nothing here, but the kernel let go of its
 * slots' lock bytes, so its slots are reclaimed at once, in the
 * rendezvous and in the shared sim: its bytes come back, it is no longer
 * listed, and a request does not wait for it. */
static void test_dead_peer_in_another_pid_namespace(void **state) {
  (void)state;
  if (geteuid() != 0) {
    fprintf(stderr, "skipped: a pid namespace of its own needs root (unshare)\n");
    skip();
  }
  int ready = 0;
  pid_t peer = start_peer_in_own_pid_namespace(60, &ready);
  if (!ready) {
    kill(peer, SIGKILL);
    waitpid(peer, NULL, 0);
    fprintf(stderr, "skipped: unshare(CLONE_NEWPID | CLONE_NEWNS) or mounting /proc was refused here\n");
    skip();
  }
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:5000");
  gca_ipc_peer_t peers[4];
  int n = 0;
  for (int tries = 0; tries < 100 && n != 2; tries++) {
    n = gca_ipc_peers(a, 0, peers, 4);
    if (n != 2) usleep(10000);
  }
  assert_int_equal(n, 2);
  size_t f = 0, t = 0;
  assert_int_equal(gca_mem_get_info(a, 0, &f, &t), GCA_OK);
  assert_int_equal(f, 40 * MiB); /* the peer's 60 MiB held */
  kill(peer, SIGKILL); /* (its child, the namespace's first process, dies with it: PR_SET_PDEATHSIG) */
  waitpid(peer, NULL, 0);
  double t0 = now_ms();
  for (int tries = 0; tries < 200 && n != 1; tries++) {
    n = gca_ipc_peers(a, 0, peers, 4);
    if (n != 1) usleep(10000);
  }
  assert_int_equal(n, 1);
  assert_int_equal(peers[0].pid, getpid());
  assert_int_equal(gca_mem_get_info(a, 0, &f, &t), GCA_OK);
  assert_int_equal(f, 100 * MiB);
  /* Nobody to ask: a request that cannot fit fails at once, not after 5 s. */
  assert_null(gca_malloc(a, 120 * MiB, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_true(now_ms() - t0 < 2500);
  assert_int_equal(stats_of(a, 0).num_ipc_timeouts, 0);
  static gca_ipc_device_t devices[16];
  int found = gca_ipc_scan(devices, 16);
  for (int i = 0; i < found && i < 16; i++)
    if (strstr(devices[i].identity, name)) assert_int_equal(devices[i].peer_count, 1);
  gca_close(a);
}

/* Cooperation on a private sim device, which only this process uses: it
 * works alone, saying why, and leaves no rendezvous behind (a killed
 * process's would be litter nobody reuses). */
static int count_regions(void) {
  DIR *dir = opendir("/dev/shm");
  int n = 0;
  for (struct dirent *e; dir && (e = readdir(dir));) n += strncmp(e->d_name, "gcalloc-coop-", 13) == 0;
  if (dir) closedir(dir);
  return n;
}

static void test_private_sim_works_alone(void **state) {
  (void)state;
  int before = count_regions();
  log_capture_t cap = {0};
  gca_set_log_handler(capture_log, &cap);
  gca_allocator_t *a = open_sim("sim", COOP);
  gca_set_log_handler(NULL, NULL);
  assert_contains(cap.all, "ipc_cooperation:True: device 0 works alone: sim device 0 is this process's alone");
  assert_int_equal(count_regions(), before);
  gca_ipc_peer_t peers[2];
  assert_int_equal(gca_ipc_peers(a, 0, peers, 2), GCA_ERR_INVALID);
  gca_close(a);
}

/* A process stopped while it holds the rendezvous's lock (SIGSTOP: Ctrl-Z,
 * a suspended job) is not dead, and a robust mutex waits for it for ever:
 * every wait on the lock has a deadline. Opening then works alone, saying
 * who holds the lock; a member's request names it; closing does not hang.
 * (The peer holds the lock nearly all the time; a stop that catches it
 * outside is tried again.) */
static void test_stopped_lock_holder(void **state) {
  (void)state;
  peer_t peer = start_peer_with(10, "GCALLOC_TEST_COOP_HOLD_US", "1000000", NULL);
  char holder[64];
  snprintf(holder, sizeof holder, "held by pid %d", (int)peer.pid);
  bool alone = false, named = false;
  for (int tries = 0; tries < 5 && !(alone && named); tries++) {
    gca_allocator_t *member = open_sim(spec, COOP); /* (may join between holds, or not) */
    usleep(100000); /* (the peer has the lock again: the member's join took it as the peer let it go) */
    log_capture_t cap = {0};
    gca_set_log_handler(capture_log, &cap);
    kill(peer.pid, SIGSTOP);
    wait_stopped(peer.pid);
    double t0 = now_ms();
    gca_allocator_t *a = open_sim(spec, COOP);
    assert_true(now_ms() - t0 < 5000);
    gca_ipc_peer_t peers[4];
    if (gca_ipc_peers(a, 0, peers, 4) == GCA_ERR_INVALID) {
      alone = true;
      assert_contains(cap.all, "works alone");
      assert_contains(cap.all, holder);
    }
    gca_set_log_handler(NULL, NULL);
    if (gca_ipc_peers(member, 0, peers, 4) >= 0 || strstr(gca_last_error(), holder)) {
      t0 = now_ms();
      assert_null(gca_malloc(member, 200 * MiB, 0, 0)); /* (more than the device: the peers are asked) */
      assert_true(now_ms() - t0 < 5000);
      if (strstr(gca_last_error(), holder)) named = true;
    }
    t0 = now_ms();
    gca_close(a);
    gca_close(member);
    assert_true(now_ms() - t0 < 5000);
    kill(peer.pid, SIGCONT);
    usleep(50000);
  }
  assert_true(alone);
  assert_true(named);
  stop_peer(peer);
}

/* ipc_cooperation and ipc_group_access are read at open only: a change
 * later is refused, not reported by gca_get_config and ignored. */
static void test_cooperation_read_at_open(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(spec, "ipc_cooperation:True");
  assert_int_equal(gca_set_config(a, "ipc_cooperation:False"), GCA_ERR_CONFIG);
  assert_contains(gca_last_error(), "ipc_cooperation is read at gca_open only (the allocator is open with it)");
  assert_int_equal(gca_set_config(a, "ipc_group_access:True"), GCA_ERR_CONFIG);
  assert_int_equal(gca_set_config(a, "ipc_cooperation:True,ipc_release_timeout_ms:300"), GCA_OK);
  char conf[1024];
  assert_true(gca_get_config(a, conf, sizeof conf) > 0);
  assert_contains(conf, "ipc_cooperation:True,ipc_release_timeout_ms:300");
  gca_close(a);
  a = open_sim(spec, NULL);
  assert_int_equal(gca_set_config(a, "ipc_cooperation:True"), GCA_ERR_CONFIG);
  assert_contains(gca_last_error(), "ipc_cooperation is read at gca_open only (the allocator is open without it)");
  assert_true(gca_get_config(a, conf, sizeof conf) > 0);
  assert_null(strstr(conf, "ipc_cooperation"));
  gca_close(a);
}

static void test_stopped_peer_times_out(void **state) {
  (void)state;
  peer_t peer = start_peer(60);
  usleep(250000);
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:300");
  kill(peer.pid, SIGSTOP);
  wait_stopped(peer.pid);
  double t0 = now_ms();
  assert_null(gca_malloc(a, 60 * MiB, 0, 0));
  double took = now_ms() - t0;
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  char expect[128];
  snprintf(expect, sizeof expect, "pid %d (caching 60.00 MiB) did not answer within 300 ms", (int)peer.pid);
  assert_contains(gca_last_error(), expect);
  assert_true(took >= 250 && took < 3000);
  assert_int_equal(stats_of(a, 0).num_ipc_timeouts, 1);
  /* The peer's 60 MiB were only cache: an avoidable out-of-memory. */
  assert_int_equal(stats_of(a, 0).num_avoidable_ooms, 1);
  kill(peer.pid, SIGCONT);
  stop_peer(peer);
  gca_close(a);
}

/* Two threads of one process out of memory at once ask the peers at once
 * (each without the device's lock), while a third changes the settings:
 * each failure's message is whole, and ThreadSanitizer sees no race (the
 * request's message and its read of the timeout were shared). */
typedef struct asking {
  gca_allocator_t *a;
  _Atomic bool done;
  char message[2][2048];
  int status[2];
} asking_t;

static asking_t asking;

static void *ask_at_once(void *arg) {
  int k = (int)(intptr_t)arg;
  CHECK(gca_malloc(asking.a, 60 * MiB, 0, 0) == NULL);
  asking.status[k] = gca_last_status();
  snprintf(asking.message[k], sizeof asking.message[k], "%s", gca_last_error());
  return NULL;
}

static void *set_config_meanwhile(void *arg) {
  (void)arg;
  while (!atomic_load(&asking.done)) {
    CHECK(gca_set_config(asking.a, "ipc_release_timeout_ms:300") == GCA_OK);
    usleep(1000);
  }
  return NULL;
}

static void test_two_threads_ask_at_once(void **state) {
  (void)state;
  atomic_store(&helper_failures, 0);
  peer_t peer = start_peer(60);
  usleep(250000);
  asking.a = open_sim(spec, COOP ",ipc_release_timeout_ms:300");
  atomic_store(&asking.done, false);
  kill(peer.pid, SIGSTOP);
  wait_stopped(peer.pid);
  pthread_t askers[2], setter;
  assert_int_equal(pthread_create(&setter, NULL, set_config_meanwhile, NULL), 0);
  for (int k = 0; k < 2; k++) assert_int_equal(pthread_create(&askers[k], NULL, ask_at_once, (void *)(intptr_t)k), 0);
  for (int k = 0; k < 2; k++) pthread_join(askers[k], NULL);
  atomic_store(&asking.done, true);
  pthread_join(setter, NULL);
  assert_int_equal(atomic_load(&helper_failures), 0);
  char expect[128];
  snprintf(expect, sizeof expect, "pid %d (caching 60.00 MiB) did not answer within 300 ms.", (int)peer.pid);
  for (int k = 0; k < 2; k++) {
    assert_int_equal(asking.status[k], GCA_ERR_OOM);
    assert_contains(asking.message[k], expect);
  }
  assert_true(stats_of(asking.a, 0).num_ipc_timeouts >= 2);
  kill(peer.pid, SIGCONT);
  stop_peer(peer);
  gca_close(asking.a);
}

/* A peer that dies while asked (killed, not yet reaped: a zombie) is not
 * waited for until the deadline: the request goes on as soon as it is seen
 * dead, and the memory it held is the device's again. */
static void test_peer_dying_while_asked(void **state) {
  (void)state;
  peer_t peer = start_peer(60);
  usleep(250000);
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:5000");
  kill(peer.pid, SIGSTOP); /* (it cannot answer) */
  wait_stopped(peer.pid);
  pid_t killer = fork_child();
  if (killer == 0) {
    usleep(200000);
    _exit(kill(peer.pid, SIGKILL) == 0 ? 0 : 1);
  }
  double t0 = now_ms();
  void *p = gca_malloc(a, 60 * MiB, 0, 0);
  double took = now_ms() - t0;
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  assert_true(took >= 150 && took < 2500);
  assert_int_equal(stats_of(a, 0).num_ipc_timeouts, 0);
  int ws = 0;
  assert_int_equal(waitpid(killer, &ws, 0), killer);
  assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  assert_int_equal(gca_free(a, p), GCA_OK);
  waitpid(peer.pid, NULL, 0);
  close(peer.fd);
  gca_close(a);
}

/* A peer asked before its answering thread first ran (a loaded machine
 * may start a thread late): the request made in between is answered once
 * the thread runs, not missed. */
static void test_peer_whose_thread_starts_late(void **state) {
  (void)state;
  /* (ready: it caches 60 MiB; its thread has not run yet) */
  peer_t peer = start_peer_with(60, "GCALLOC_TEST_COOP_LATE_US", "300000", NULL);
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:5000");
  void *p = gca_malloc(a, 60 * MiB, 0, 0);
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.ipc_bytes_received, 60 * MiB);
  assert_int_equal(s.num_ipc_timeouts, 0);
  assert_int_equal(gca_free(a, p), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

/* `procs` processes taking turns, `rounds` each, every turn needing 60% of
 * the device: the turns that ran out of memory, and the requests and bytes
 * received the processes' statistics count. */
typedef struct turns {
  int ooms;
  long long requests, bytes_received;
} turns_t;

static turns_t take_turns(int procs, int rounds, const char *conf) {
  int to[8], from[8];
  pid_t pids[8];
  for (int i = 0; i < procs; i++) {
    int down[2], up[2];
    /* (close-on-exec: a later child must not hold an earlier one's pipes) */
    assert_int_equal(pipe2(down, O_CLOEXEC), 0);
    assert_int_equal(pipe2(up, O_CLOEXEC), 0);
    pids[i] = fork_child();
    if (pids[i] == 0) {
      if (fcntl(down[0], F_SETFD, 0) != 0 || fcntl(up[1], F_SETFD, 0) != 0) _exit(126);
      char in_text[16], out_text[16];
      snprintf(in_text, sizeof in_text, "%d", down[0]);
      snprintf(out_text, sizeof out_text, "%d", up[1]);
      execl("/proc/self/exe", "test_coop", "--phases", spec, conf, "60", in_text, out_text, (char *)NULL);
      _exit(127);
    }
    close(down[0]), close(up[1]);
    to[i] = down[1], from[i] = up[0];
  }
  turns_t t = {0};
  for (int r = 0; r < rounds; r++)
    for (int i = 0; i < procs; i++) {
      char c = 0;
      assert_int_equal(write(to[i], "g", 1), 1);
      assert_int_equal(read(from[i], &c, 1), 1);
      assert_true(c == 'd' || c == 'o');
      t.ooms += c == 'o';
    }
  for (int i = 0; i < procs; i++) {
    close(to[i]);
    char line[64] = {0};
    size_t n = 0;
    while (n < sizeof line - 1 && read(from[i], line + n, 1) == 1 && line[n] != '\n') n++;
    long long requests = 0, bytes = 0;
    assert_int_equal(sscanf(line, "%lld %lld", &requests, &bytes), 2);
    t.requests += requests, t.bytes_received += bytes;
    close(from[i]);
    int ws = 0;
    assert_int_equal(waitpid(pids[i], &ws, 0), pids[i]);
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  }
  return t;
}

/* Two and four processes taking turns at needing 60% of the device: alone,
 * every turn after the first process's runs out of memory (its cache holds
 * the device); cooperating, every turn completes, and each turn after the
 * first received exactly what the previous turn left cached. */
static void test_processes_taking_turns(void **state) {
  (void)state;
  turns_t alone = take_turns(2, 5, "-");
  assert_int_equal(alone.ooms, 5);
  assert_int_equal(alone.requests, 0);
  for (int procs = 2; procs <= 4; procs += 2) {
    /* (a deadline no load on a shared test machine reaches) */
    turns_t together = take_turns(procs, 5, COOP ",ipc_release_timeout_ms:10000");
    assert_int_equal(together.ooms, 0);
    if (together.requests < procs * 5 - 1) fprintf(stderr, "%d processes: %lld requests, %lld bytes received\n", procs, together.requests, together.bytes_received);
    assert_true(together.requests >= procs * 5 - 1);
    assert_int_equal(together.bytes_received, (long long)(procs * 5 - 1) * 60 * (long long)MiB);
  }
}

static void test_request_no_release_can_meet(void **state) {
  (void)state;
  peer_t peer = start_peer(20);
  usleep(250000);
  gca_allocator_t *a = open_sim(spec, COOP);
  assert_null(gca_malloc(a, 150 * MiB, 0, 0)); /* more than the device */
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "out of memory. Tried to allocate 150.00 MiB");
  assert_int_equal(stats_of(a, 0).num_avoidable_ooms, 0); /* (it never fits: not avoidable) */
  stop_peer(peer); /* (first: the last process out removes the region) */
  gca_close(a);
}

/* The request asks for what it lacks beyond the device's free memory: a
 * live peer whose cache covers that ends the wait, with a stopped peer
 * beside it (asked for the whole request, the live peer's answer fell
 * short, and the request waited the whole timeout for the stopped one). */
static void test_request_asks_for_the_shortfall(void **state) {
  (void)state;
  peer_t live = start_peer(50), stopped = start_peer(24); /* 26 MiB of the device free */
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:4000");
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = live.pid, .reserved_bytes = 50 * MiB, .cached_bytes = 50 * MiB}));
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = stopped.pid, .reserved_bytes = 24 * MiB, .cached_bytes = 24 * MiB}));
  kill(stopped.pid, SIGSTOP);
  wait_stopped(stopped.pid);
  double t0 = now_ms();
  void *p = gca_malloc(a, 60 * MiB, 0, 0); /* lacks 34 MiB */
  double took = now_ms() - t0;
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  assert_true(took < 2000); /* (not the 4 s timeout; on a loaded machine too) */
  gca_stats_t st = stats_of(a, 0);
  assert_int_equal(st.num_ipc_peers_asked, 1);
  assert_int_equal(st.num_ipc_timeouts, 0);
  assert_int_equal(gca_free(a, p), GCA_OK);
  kill(stopped.pid, SIGCONT);
  stop_peer(live);
  stop_peer(stopped);
  gca_close(a);
}

/* A process stopped before its thread first publishes is stale as one
 * stopped after: joining counts as publishing (it was seen as never having
 * published, waited for the whole timeout, and shown as just seen). */
static void test_peer_stopped_before_it_publishes_is_stale(void **state) {
  (void)state;
  peer_t peer = start_peer_with(30, "GCALLOC_TEST_COOP_LATE_US", "1000000", NULL); /* (its thread waits 1 s) */
  kill(peer.pid, SIGSTOP);
  wait_stopped(peer.pid);
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:5000");
  usleep(1300000);
  gca_ipc_peer_t peers[8];
  int n = gca_ipc_peers(a, 0, peers, 8);
  bool stale = false;
  for (int i = 0; i < n && i < 8; i++)
    if (peers[i].pid == peer.pid) stale = peers[i].silent_ms > 1000;
  assert_true(stale);
  double t0 = now_ms();
  assert_null(gca_malloc(a, 80 * MiB, 0, 0)); /* (70 MiB free: only its cache would cover it) */
  assert_true(now_ms() - t0 < 2500);     /* (not the 5 s timeout) */
  assert_contains(gca_last_error(), "ms (stopped?)");
  kill(peer.pid, SIGCONT);
  stop_peer(peer);
  gca_close(a);
}

/* A peer stopped for longer than it takes to publish ten times is not
 * waited for: without cache it is not asked at all, with cache it is asked
 * and the message says it stopped answering (each request waited the whole
 * timeout for it). */
static void test_stale_peer_is_not_waited_for(void **state) {
  (void)state;
  peer_t holder = start_peer_with(60, "GCALLOC_TEST_PEER_FREE_AFTER_MS", "1000000", NULL); /* 60 MiB live */
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:5000");
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = holder.pid, .reserved_bytes = 60 * MiB, .allocated_bytes = 60 * MiB}));
  kill(holder.pid, SIGSTOP);
  wait_stopped(holder.pid);
  usleep(1300000); /* (stale after 1 s) */
  double t0 = now_ms();
  assert_null(gca_malloc(a, 50 * MiB, 0, 0));
  assert_true(now_ms() - t0 < 2500); /* (not the 5 s timeout) */
  assert_int_equal(stats_of(a, 0).num_ipc_timeouts, 0); /* (not asked: nothing to release) */
  kill(holder.pid, SIGCONT);
  stop_peer(holder);
  peer_t cacher = start_peer(30);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = cacher.pid, .reserved_bytes = 30 * MiB, .cached_bytes = 30 * MiB}));
  void *held = gca_malloc(a, 70 * MiB, 0, 0); /* the rest of the device */
  assert_non_null(held);
  kill(cacher.pid, SIGSTOP);
  wait_stopped(cacher.pid);
  usleep(1300000);
  gca_ipc_peer_t peers[8];
  int n = gca_ipc_peers(a, 0, peers, 8);
  bool marked = false;
  for (int i = 0; i < n && i < 8; i++) {
    if (peers[i].pid == cacher.pid) marked = peers[i].silent_ms > 1000;
    else assert_true(peers[i].silent_ms < 1000); /* (this process: it publishes) */
  }
  assert_true(marked);
#ifdef GCALLOC_TOOL_PATH
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s top --json > /tmp/gcalloc-top-%d.json", GCALLOC_TOOL_PATH, (int)getpid());
  assert_int_equal(system(cmd), 0);
  snprintf(cmd, sizeof cmd, "/tmp/gcalloc-top-%d.json", (int)getpid());
  size_t len;
  char *json = (char *)read_whole(cmd, &len);
  assert_non_null(json);
  char row[96];
  snprintf(row, sizeof row, "\"pid\": %d, ", (int)cacher.pid);
  const char *at = strstr(json, row);
  assert_non_null(at);
  const char *stopped = strstr(at, "\"stopped\": ");
  assert_non_null(stopped);
  assert_true(strncmp(stopped, "\"stopped\": true,", 16) == 0);
  free(json);
  unlink(cmd);
#endif
  t0 = now_ms();
  assert_null(gca_malloc(a, 20 * MiB, 0, 0));
  assert_true(now_ms() - t0 < 2500); /* (not the 5 s timeout) */
  char expect[160];
  snprintf(expect, sizeof expect, "pid %d (caching 30.00 MiB) has not answered for ", (int)cacher.pid);
  assert_contains(gca_last_error(), expect);
  assert_contains(gca_last_error(), " ms (stopped?)");
  kill(cacher.pid, SIGCONT);
  assert_int_equal(gca_free(a, held), GCA_OK);
  stop_peer(cacher);
  gca_close(a);
}

/* One out-of-memory asks in rounds while the peers still release: its
 * message sums each peer's releases over them (it said "released 0 bytes"
 * of a peer that released in the first), and it counts one request. */
static void test_message_sums_every_round(void **state) {
  (void)state;
  peer_t cacher = start_peer(30);
  peer_t holder = start_peer_with(60, "GCALLOC_TEST_PEER_FREE_AFTER_MS", "1000000", NULL); /* 10 MiB free */
  gca_allocator_t *a = open_sim(spec, COOP);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = cacher.pid, .reserved_bytes = 30 * MiB, .cached_bytes = 30 * MiB}));
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = holder.pid, .reserved_bytes = 60 * MiB, .allocated_bytes = 60 * MiB}));
  assert_null(gca_malloc(a, 60 * MiB, 0, 0));
  char expect[96];
  snprintf(expect, sizeof expect, "pid %d released 30.00 MiB over ", (int)cacher.pid);
  assert_contains(gca_last_error(), expect);
  gca_stats_t st = stats_of(a, 0);
  assert_int_equal(st.num_ipc_requests, 1);
  assert_true(st.num_ipc_rounds >= 2);
  assert_int_equal(st.ipc_bytes_received, 30 * MiB);
  stop_peer(cacher);
  stop_peer(holder);
  gca_close(a);
}

/* With the default settings a peer gives back the free memory inside a
 * segment it still uses (cooperation implies expandable segments: its
 * free runs of pages unmap, largest first, until the request's shortfall
 * is covered). With ordinary segments it gave back nothing: only whole
 * free segments could go. */
static void test_peer_releases_free_pages_of_a_segment_in_use(void **state) {
  (void)state;
  peer_t peer = start_peer_with(0, "GCALLOC_TEST_PEER_CONF", "ipc_cooperation:True", "GCALLOC_TEST_PEER_SPLIT",
                                "80,40", NULL);
  gca_allocator_t *a = open_sim(spec, "ipc_cooperation:True");
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = peer.pid, .reserved_bytes = 80 * MiB,
                                                 .allocated_bytes = 40 * MiB, .cached_bytes = 40 * MiB}));
  void *p = gca_malloc(a, 30 * MiB, 0, 0); /* 30 MiB of pages; 20 MiB free: lacks 10 */
  if (!p) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(p);
  gca_stats_t st = stats_of(a, 0);
  assert_int_equal(st.ipc_bytes_received, 40 * MiB); /* (its one free run) */
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = peer.pid, .reserved_bytes = 40 * MiB,
                                                 .allocated_bytes = 40 * MiB, .cached_bytes = 0}));
  assert_int_equal(gca_free(a, p), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

/* Cooperation sets expandable segments unless they were set; without
 * cooperation, and set either way, the setting is the user's. */
static void test_cooperation_implies_expandable_segments(void **state) {
  (void)state;
  char conf[1024];
  const struct {
    const char *conf;
    const char *expect;
  } cases[] = {
      {"ipc_cooperation:True", "expandable_segments:True"},
      {"ipc_cooperation:True,expandable_segments:False", "expandable_segments:False"},
      {"expandable_segments:False,ipc_cooperation:True", "expandable_segments:False"},
      {NULL, "expandable_segments:False"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    gca_allocator_t *a = open_sim(spec, cases[i].conf);
    assert_true(gca_get_config(a, conf, sizeof conf) > 0);
    assert_contains(conf, cases[i].expect);
    gca_close(a);
  }
}

static pid_t start_outsider(void);

/* gcalloc top's device figures while two peers take and give back
 * segments every 2 ms: every view it calls settled shows exactly what
 * the process that does not cooperate holds outside the members (it showed
 * memory that did not exist in about half the samples), and most views
 * settle. */
static void test_accounting_holds_while_peers_churn(void **state) {
  (void)state;
  pid_t outsider = start_outsider(); /* 20 MiB */
  peer_t churn1 = start_peer_with(0, "GCALLOC_TEST_PEER_CHURN", "1", NULL);
  peer_t churn2 = start_peer_with(0, "GCALLOC_TEST_PEER_CHURN", "1", NULL);
  gca_allocator_t *a = open_sim(spec, COOP);
  void *mine = gca_malloc(a, 8 * MiB, 0, 0); /* (a member that has held memory publishes the device's) */
  assert_non_null(mine);
  usleep(200000);
  int settled = 0, samples = 200;
  for (int i = 0; i < samples; i++) {
    gca_ipc_device_t devices[4];
    int n = gca_ipc_scan(devices, 4);
    for (int k = 0; k < n && k < 4; k++) {
      if (!strstr(devices[k].identity, name)) continue;
      if (devices[k].settled) {
        settled++;
        if (devices[k].other_bytes != 20 * MiB)
          fail_msg("sample %d: %llu bytes outside, not 20 MiB (total %llu, free %llu)", i,
                   (unsigned long long)devices[k].other_bytes, (unsigned long long)devices[k].total_bytes,
                   (unsigned long long)devices[k].free_bytes);
      }
    }
    usleep(2000);
  }
  fprintf(stderr, "[ accounting ] %d of %d views settled\n", settled, samples);
  assert_true(settled >= samples / 2);
  assert_int_equal(gca_free(a, mine), GCA_OK);
  stop_peer(churn1);
  stop_peer(churn2);
  kill(outsider, SIGKILL);
  waitpid(outsider, NULL, 0);
  gca_close(a);
}

/* Memory held by a process that does not cooperate is named in the
 * out-of-memory message and left out of what could have fit: the failure
 * is not counted avoidable (it was, comparing with the device's total). */
static void test_memory_held_outside_is_named(void **state) {
  (void)state;
  pid_t outsider = start_outsider(); /* 20 MiB */
  peer_t holder = start_peer_with(60, "GCALLOC_TEST_PEER_FREE_AFTER_MS", "1000000", NULL); /* 60 MiB live */
  gca_allocator_t *a = open_sim(spec, COOP);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = holder.pid, .reserved_bytes = 60 * MiB, .allocated_bytes = 60 * MiB}));
  assert_null(gca_malloc(a, 30 * MiB, 0, 0)); /* 60 live + 30 fit 100 MiB, but 20 are outside */
  assert_contains(gca_last_error(), "20.00 MiB of the device is held outside them");
  gca_stats_t st = stats_of(a, 0);
  assert_int_equal(st.num_avoidable_ooms, 0);
  assert_int_equal(st.ipc_outside_bytes, 20 * MiB);
  stop_peer(holder);
  kill(outsider, SIGKILL);
  waitpid(outsider, NULL, 0);
  gca_close(a);
}

static void test_foreign_region_leaves_cooperation_off(void **state) {
  (void)state;
  char path[64];
  coop_path(path, sizeof path);
  int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, "garbage", 7), 7);
  close(fd);
  log_capture_t cap = {0};
  gca_set_log_handler(capture_log, &cap);
  gca_allocator_t *a = open_sim(spec, COOP);
  gca_set_log_handler(NULL, NULL);
  assert_contains(cap.all, "ipc_cooperation:True: device 0 works alone");
  assert_contains(cap.all, "is 7 bytes, not a gcalloc region");
  gca_ipc_peer_t peers[2];
  assert_int_equal(gca_ipc_peers(a, 0, peers, 2), GCA_ERR_INVALID);
  void *p = gca_malloc(a, MiB, 0, 0); /* the allocator works */
  assert_non_null(p);
  assert_int_equal(gca_free(a, p), GCA_OK);
  gca_close(a);
  shm_unlink(path);
}

/* A region of the right size with the wrong magic, and one cut short, are
 * refused by name. */
static void test_bad_magic_and_truncated_region(void **state) {
  (void)state;
  char path[64], file[96];
  coop_path(path, sizeof path);
  snprintf(file, sizeof file, "/dev/shm%s", path);
  gca_allocator_t *a = open_sim(spec, COOP);
  struct stat st;
  assert_int_equal(stat(file, &st), 0);
  size_t size = (size_t)st.st_size;
  gca_close(a); /* (the last process out removes the region) */
  assert_int_not_equal(access(file, F_OK), 0);
  for (int kind = 0; kind < 2; kind++) {
    int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    size_t cut = kind == 0 ? size : size / 2;
    unsigned char *junk = malloc(cut);
    memset(junk, 0xa5, cut);
    assert_int_equal(write(fd, junk, cut), (ssize_t)cut);
    free(junk);
    close(fd);
    log_capture_t cap = {0};
    gca_set_log_handler(capture_log, &cap);
    a = open_sim(spec, COOP);
    gca_set_log_handler(NULL, NULL);
    assert_contains(cap.all, "device 0 works alone");
    assert_contains(cap.all, kind == 0 ? "its magic is wrong" : "not a gcalloc region");
    if (kind == 0) assert_contains(cap.all, file); /* (the file to remove, named) */
    void *p = gca_malloc(a, MiB, 0, 0);
    assert_non_null(p);
    assert_int_equal(gca_free(a, p), GCA_OK);
    gca_close(a);
    shm_unlink(path);
  }
}

/* With cooperation on and a peer present, a cache hit and a free make no
 * system call: a child runs them under a seccomp filter that traps every
 * call but its report. */
static void test_hot_path_makes_no_system_call(void **state) {
  (void)state;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  skip(); /* (the sanitizers' runtimes make calls of their own) */
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  skip();
#endif
#endif
  peer_t peer = start_peer(20);
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = fork_child();
  if (pid == 0) {
    close(fds[0]);
    if (dup2(fds[1], REPORT_FD) < 0) _exit(126);
    execl("/proc/self/exe", "test_coop", "--hot-path", spec, (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  char text[64] = {0};
  size_t n = 0;
  ssize_t got;
  while (n < sizeof text - 1 && (got = read(fds[0], text + n, sizeof text - 1 - n)) > 0) n += (size_t)got;
  close(fds[0]);
  int ws = 0;
  waitpid(pid, &ws, 0);
  stop_peer(peer);
  assert_true(WIFEXITED(ws));
  assert_int_equal(WEXITSTATUS(ws), 0);
  int calls = -1, first = -1;
  assert_int_equal(sscanf(text, "%d %d", &calls, &first), 2);
  if (calls) fprintf(stderr, "the hot path made %d system calls, the first number %d\n", calls, first);
  assert_int_equal(calls, 0);
}

/* Peers killed with SIGKILL at random points, 200 times, many inside the
 * region's lock (the test hook holds it 2 ms of every round): the
 * survivor's requests go on (a lock whose owner died is repaired), its
 * invariants hold, and no slot is left behind. */
static void test_peers_killed_at_random_points(void **state) {
  (void)state;
  setenv("GCALLOC_TEST_COOP_HOLD_US", "2000", 1);
  gca_allocator_t *a = open_sim(spec, COOP ",ipc_release_timeout_ms:50");
  uint64_t seed = 0x2545f4914f6cdd1dull;
  for (int i = 0; i < 200; i++) {
    pid_t pid = spawn_peer(30);
    usleep((useconds_t)(next_random(&seed) % 6000));
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    if (i % 20 == 19) {
      void *p = gca_malloc(a, 90 * MiB, 0, 0); /* needs the dead peers' memory back */
      if (!p) fprintf(stderr, "round %d: %s\n", i, gca_last_error());
      assert_non_null(p);
      assert_int_equal(gca_free(a, p), GCA_OK);
      assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
      assert_consistent(a);
    }
  }
  gca_ipc_peer_t peers[8];
  assert_int_equal(gca_ipc_peers(a, 0, peers, 8), 1); /* only this process */
  assert_int_equal(peers[0].pid, getpid());
  gca_close(a);
  unsetenv("GCALLOC_TEST_COOP_HOLD_US");
}

/* A peer asked for 40 MiB gives back its largest cached segment, 40 MiB,
 * and keeps the 12 and 20 MiB ones: only what is needed is released. */
static void test_a_peer_releases_only_what_is_needed(void **state) {
  (void)state;
  peer_t peer = start_peer_with(0, "GCALLOC_TEST_PEER_SEGMENTS", "12,20,40", NULL);
  gca_allocator_t *a = open_sim(spec, COOP);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = peer.pid, .reserved_bytes = 72 * MiB, .cached_bytes = 72 * MiB}));
  void *p = gca_malloc(a, 40 * MiB, 0, 0); /* 28 MiB are free */
  assert_non_null(p);
  assert_int_equal(stats_of(a, 0).ipc_bytes_received, 40 * MiB);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = peer.pid, .reserved_bytes = 32 * MiB, .cached_bytes = 32 * MiB}));
  assert_int_equal(gca_free(a, p), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

/* A process that does not cooperate, holding 20 MiB of the device. */
static pid_t start_outsider(void) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = fork_child();
  if (pid == 0) {
    gca_allocator_t *a = NULL;
    if (gca_open(spec, NULL, &a) != GCA_OK || !gca_malloc(a, 20 * MiB, 0, 0) || write(fds[1], "r", 1) != 1) _exit(3);
    for (;;) pause();
  }
  char c;
  assert_int_equal(read(fds[0], &c, 1), 1);
  close(fds[0]), close(fds[1]);
  return pid;
}

/* gcalloc top's view: the device's total and free memory, what a process
 * that does not cooperate holds, and each member's requests so far. */
static void test_scan_shows_the_device_and_the_requests(void **state) {
  (void)state;
  pid_t outsider = start_outsider();
  peer_t peer = start_peer(30);
  gca_allocator_t *a = open_sim(spec, COOP);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = peer.pid, .reserved_bytes = 30 * MiB, .cached_bytes = 30 * MiB}));
  void *p = gca_malloc(a, 60 * MiB, 0, 0); /* 50 MiB free: the peer's 30 are asked for */
  assert_non_null(p);
  static gca_ipc_device_t devices[16];
  const gca_ipc_device_t *dev = NULL;
  const gca_ipc_peer_t *me = NULL, *lender = NULL;
  /* (until a publication after the request: each process publishes every 100 ms) */
  for (int tries = 0; tries < 100 && !(dev && dev->free_bytes == 20 * MiB && me && me->requests == 1 &&
                                       me->reserved_bytes == 60 * MiB && lender && lender->bytes_released == 30 * MiB);
       tries++) {
    usleep(20000);
    int found = gca_ipc_scan(devices, 16);
    dev = NULL;
    me = lender = NULL;
    for (int i = 0; i < found && i < 16; i++)
      if (strstr(devices[i].identity, name)) dev = &devices[i];
    for (int k = 0; dev && k < dev->peer_count; k++) {
      if (dev->peers[k].pid == getpid()) me = &dev->peers[k];
      if (dev->peers[k].pid == peer.pid) lender = &dev->peers[k];
    }
  }
  assert_non_null(dev);
  assert_int_equal(dev->total_bytes, 100 * MiB);
  assert_int_equal(dev->free_bytes, 20 * MiB);
  assert_int_equal(dev->other_bytes, 20 * MiB); /* the outsider's */
  assert_non_null(me);
  assert_int_equal(me->requests, 1);
  assert_int_equal(me->bytes_received, 30 * MiB);
  assert_int_equal(me->avoidable_ooms, 0);
  assert_non_null(lender);
  assert_int_equal(lender->bytes_released, 30 * MiB);
  assert_int_equal(lender->requests, 0);
  assert_int_equal(gca_free(a, p), GCA_OK);
  stop_peer(peer);
  kill(outsider, SIGKILL);
  waitpid(outsider, NULL, 0);
  gca_close(a);
}

/* Requests that keep coming release twice as much each time: a process
 * growing block by block costs a few round trips, not one per block. */
static void test_requests_in_a_row_release_more(void **state) {
  (void)state;
  peer_t peer = start_peer_with(0, "GCALLOC_TEST_PEER_SEGMENTS", "12,12,12,12,12,12", NULL);
  gca_allocator_t *a = open_sim(spec, COOP);
  assert_true(peer_publishes(a, (gca_ipc_peer_t){.pid = peer.pid, .reserved_bytes = 72 * MiB, .cached_bytes = 72 * MiB}));
  void *held[4];
  for (int i = 0; i < 4; i++) assert_non_null(held[i] = gca_malloc(a, 12 * MiB, 0, 0)); /* 28 MiB free */
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_ipc_requests, 2);
  assert_int_equal(s.ipc_bytes_received, 12 * MiB + 24 * MiB); /* the second released twice the first */
  for (int i = 0; i < 4; i++) assert_int_equal(gca_free(a, held[i]), GCA_OK);
  stop_peer(peer);
  gca_close(a);
}

/* ---- a seeded random workload whose live memory always fits ---------------- */

/* What the workload's processes and the test share (a memfd each child
 * maps): the process that may hold much live memory now, the handing over
 * of that right, and each process's results. */
#define WORK_PROCS 4
#define WORK_BLOCK (30 * MiB)
#define WORK_SMALL 3  /* blocks a process may hold live: 90 MiB */
#define WORK_BIG 20   /* the holder: 600 MiB; 600 + 3 x 90 < 1 GiB */
typedef struct {
  /* The holder and whether its right is being handed over, in one word
   * (holder * 2 + moving), read at once: read apart, an old holder could
   * see itself holder and the handing over done, and grow beside the new. */
  _Atomic int right;
  _Atomic int shrunk, stop;
  _Atomic int generation[WORK_PROCS]; /* bumped when the test starts a process anew */
  _Atomic long steps[WORK_PROCS], ooms[WORK_PROCS];
  char first_oom[512];
  _Atomic int oom_said;
} work_board_t;

static work_board_t *map_board(int fd) {
  void *m = mmap(NULL, sizeof(work_board_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return m == MAP_FAILED ? NULL : m;
}

/* One process of the workload: random allocations and frees of one block
 * size, never holding more live than its right (WORK_BIG blocks while it is
 * the holder, else WORK_SMALL), so the live memory of all of them always fits
 * the device: every out-of-memory would be avoidable. */
static int work_main(const char *work_spec, const char *conf, int me, uint64_t seed, int board_fd) {
  work_board_t *board = map_board(board_fd);
  gca_allocator_t *a = NULL;
  if (!board || gca_open(work_spec, conf, &a) != GCA_OK) {
    fprintf(stderr, "work %d: %s\n", me, gca_last_error());
    return 2;
  }
  void *held[WORK_BIG];
  int live = 0;
  while (!atomic_load(&board->stop)) {
    int right = atomic_load(&board->right);
    bool holder = right / 2 == me, moving = right & 1;
    int cap = holder && !moving ? WORK_BIG : WORK_SMALL;
    while (live > cap) { /* (a random one) */
      int k = (int)(next_random(&seed) % (uint64_t)live);
      if (gca_free(a, held[k]) != GCA_OK) return 3;
      held[k] = held[--live];
    }
    if (holder && moving) atomic_store(&board->shrunk, 1);
    if (next_random(&seed) % 3 < 2 && live < cap) {
      void *p = gca_malloc(a, WORK_BLOCK, 0, 0);
      if (p) {
        held[live++] = p;
      } else {
        atomic_fetch_add(&board->ooms[me], 1);
        if (!atomic_exchange(&board->oom_said, 1))
          snprintf(board->first_oom, sizeof board->first_oom, "%s", gca_last_error());
      }
    } else if (live) {
      int k = (int)(next_random(&seed) % (uint64_t)live);
      if (gca_free(a, held[k]) != GCA_OK) return 3;
      held[k] = held[--live];
    }
    atomic_fetch_add(&board->steps[me], 1);
    usleep((useconds_t)(50 + next_random(&seed) % 400));
  }
  while (live) gca_free(a, held[--live]);
  gca_close(a);
  return 0;
}

static pid_t start_worker(const char *work_spec, const char *conf, int me, uint64_t seed, int board_fd) {
  pid_t pid = fork_child();
  if (pid == 0) {
    char me_text[16], seed_text[32], fd_text[16];
    snprintf(me_text, sizeof me_text, "%d", me);
    snprintf(seed_text, sizeof seed_text, "%llu", (unsigned long long)seed);
    snprintf(fd_text, sizeof fd_text, "%d", board_fd);
    execl("/proc/self/exe", "test_coop", "--work", work_spec, conf, me_text, seed_text, fd_text, (char *)NULL);
    _exit(127);
  }
  return pid;
}

/* Hand the right to hold much to another process: the holder shrinks
 * first (unless it is gone). */
static void move_holder(work_board_t *board, int to, bool holder_alive) {
  atomic_store(&board->shrunk, 0);
  atomic_store(&board->right, atomic_load(&board->right) / 2 * 2 + 1);
  for (int tries = 0; holder_alive && !atomic_load(&board->shrunk) && tries < 20000; tries++) usleep(500);
  assert_true(!holder_alive || atomic_load(&board->shrunk));
  atomic_store(&board->right, to * 2);
}

/* WORK_PROCS processes for `seconds`, the right to hold much moved at
 * random, processes stopped (SIGSTOP, up to 300 ms) at random, and with
 * `kills`, killed (SIGKILL) at random and started anew: no out-of-memory at
 * all, since the live memory always fits and no stop outlasts the bounded
 * wait; afterwards the device is whole again and nobody is left in the
 * rendezvous. */
static void random_workload(double seconds, bool kills) {
  char work_spec[160];
  snprintf(work_spec, sizeof work_spec, "sim:shared=%s,capacity=1GiB", name);
  /* (deadlines a loaded test machine does not reach: what is measured is
   * whether memory that was only cache was had at all) */
  const char *conf = COOP ",ipc_release_timeout_ms:5000";
  int fd = memfd_create("work-board", 0);
  assert_true(fd >= 0);
  assert_int_equal(ftruncate(fd, sizeof(work_board_t)), 0);
  work_board_t *board = map_board(fd);
  assert_non_null(board);
  uint64_t seed = kills ? 0x9e3779b97f4a7c15ull : 0xd1b54a32d192ed03ull;
  pid_t pids[WORK_PROCS];
  for (int i = 0; i < WORK_PROCS; i++) pids[i] = start_worker(work_spec, conf, i, next_random(&seed), fd);
  int stops = 0, moves = 0, killed = 0;
  double until = now_ms() + seconds * 1000;
  while (now_ms() < until) {
    usleep((useconds_t)(20000 + next_random(&seed) % 60000));
    int who = (int)(next_random(&seed) % WORK_PROCS), action = (int)(next_random(&seed) % 4);
    if (action < 2) {
      move_holder(board, (atomic_load(&board->right) / 2 + 1 + who % (WORK_PROCS - 1)) % WORK_PROCS, true);
      moves++;
    } else if (action == 2 || !kills) {
      kill(pids[who], SIGSTOP);
      usleep((useconds_t)(10000 + next_random(&seed) % 290000));
      kill(pids[who], SIGCONT);
      stops++;
    } else {
      kill(pids[who], SIGKILL);
      assert_int_equal(waitpid(pids[who], NULL, 0), pids[who]);
      if (atomic_load(&board->right) / 2 == who) move_holder(board, (who + 1) % WORK_PROCS, false);
      pids[who] = start_worker(work_spec, conf, who, next_random(&seed), fd);
      killed++;
    }
  }
  atomic_store(&board->stop, 1);
  long steps = 0, ooms = 0;
  for (int i = 0; i < WORK_PROCS; i++) {
    int ws = 0;
    assert_int_equal(waitpid(pids[i], &ws, 0), pids[i]);
    assert_true(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    steps += atomic_load(&board->steps[i]);
    ooms += atomic_load(&board->ooms[i]);
  }
  fprintf(stderr, "[ workload ] %ld steps, %d moves, %d stops, %d kills: %ld out of memory%s%s\n", steps, moves, stops,
          killed, ooms, ooms ? "; the first: " : "", ooms ? board->first_oom : "");
  assert_true(steps >= 2000);
  assert_int_equal(ooms, 0);
  /* Nothing leaked: the whole device for one process, which is alone. */
  gca_allocator_t *a = open_sim(work_spec, COOP);
  void *all = gca_malloc(a, 1000 * MiB, 0, 0);
  if (!all) fprintf(stderr, "%s\n", gca_last_error());
  assert_non_null(all);
  gca_ipc_peer_t peers[8];
  assert_int_equal(gca_ipc_peers(a, 0, peers, 8), 1);
  assert_int_equal(peers[0].pid, getpid());
  assert_int_equal(gca_free(a, all), GCA_OK);
  gca_close(a);
  munmap(board, sizeof *board);
  close(fd);
}

static void test_random_workload_with_stopped_peers(void **state) {
  (void)state;
  random_workload(4, false);
}

static void test_random_workload_with_killed_peers(void **state) {
  (void)state;
  random_workload(4, true);
}

/* A rendezvous another user made (mode 0600) cannot be joined: the process
 * works alone and says why. */
/* Another user's rendezvous is not joined: closed to this user (0600), or
 * open to all (made 0666 by its owner, who could then hold its lock or
 * rewrite it): refused, and the process works alone, saying why. */
static void test_region_of_another_user(void **state) {
  (void)state;
  if (geteuid() != 0) skip(); /* (a root test process makes the region and drops to nobody) */
  char path[64];
  coop_path(path, sizeof path);
  gca_allocator_t *a = open_sim(spec, COOP); /* root's region, 0600 */
  char shm_path[96];
  snprintf(shm_path, sizeof shm_path, "/dev/shm%s", path);
  const char *why[] = {"Permission denied", "belongs to uid 0, not to this user (uid 65534)"};
  for (int round = 0; round < 2; round++) {
    if (round == 1) assert_int_equal(chmod(shm_path, 0666), 0); /* open to all by its owner */
    pid_t pid = fork_child();
    if (pid == 0) {
      /* The sim region must be nobody's to share: a copy of the name for the
       * device the child joins would be root's too. Only the rendezvous is
       * tested here: give the child the sim region, keep the rendezvous root's. */
      char sim_path[96];
      snprintf(sim_path, sizeof sim_path, "/dev/shm/gcalloc-sim-%s", name);
      if (chown(sim_path, 65534, 65534) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
      log_capture_t cap = {0};
      gca_set_log_handler(capture_log, &cap);
      gca_allocator_t *b = NULL;
      if (gca_open(spec, COOP, &b) != GCA_OK) _exit(3);
      bool said = strstr(cap.all, "works alone") && strstr(cap.all, why[round]);
      if (!said) fprintf(stderr, "round %d: %s\n", round, cap.all);
      gca_close(b);
      _exit(said ? 0 : 4);
    }
    int ws = 0;
    waitpid(pid, &ws, 0);
    assert_true(WIFEXITED(ws));
    assert_int_equal(WEXITSTATUS(ws), 0);
  }
  gca_close(a);
}

#ifdef GCALLOC_TOOL_PATH
/* Run `gcalloc top ARGS`; its output, NUL-terminated (freed by the caller). */
static char *run_top(const char *args, size_t *len) {
  char out[128], cmd[512];
  snprintf(out, sizeof out, "/tmp/gcalloc-top-%d.out", (int)getpid());
  snprintf(cmd, sizeof cmd, "%s top %s > %s", GCALLOC_TOOL_PATH, args, out);
  assert_int_equal(system(cmd), 0);
  char *text = (char *)read_whole(out, len);
  unlink(out);
  assert_non_null(text);
  return text;
}

/* Whether text[0, len) is valid UTF-8 with no byte below 0x20 but '\n'. */
static bool valid_utf8_text(const char *text, size_t len) {
  const unsigned char *s = (const unsigned char *)text, *end = s + len;
  while (s < end) {
    if (*s < 0x20 && *s != '\n') return false;
    size_t n = gca__utf8_length(s);
    if (n == 0 || (size_t)(end - s) < n) return false;
    s += n;
  }
  return true;
}

/* A member's region says what its processes wrote, and a process of this
 * user can write anything there: an identity with escape sequences and
 * bytes that are not UTF-8, figures no allocator publishes. `gcalloc top`
 * prints the identity escaped and marks the figures; --json stays valid
 * UTF-8 (the bytes escaped as \udcNN). The region is rewritten in place:
 * the identity at offset 16 (after the magic, version and size), and a
 * stopped peer's slot (which no longer republishes), found by its pid and
 * start time (the slot's first fields; coop.c, version 7). */
static void test_top_shows_a_hostile_region_escaped(void **state) {
  (void)state;
  peer_t peer = start_peer(20);
  gca_allocator_t *a = open_sim(spec, COOP);
  kill(peer.pid, SIGSTOP);
  wait_stopped(peer.pid);
  char path[64], file[96];
  coop_path(path, sizeof path);
  snprintf(file, sizeof file, "/dev/shm%s", path);
  int fd = open(file, O_RDWR);
  assert_true(fd >= 0);
  static const char hostile[] = "\033]0;owned\007\033[2J\233" "2J\xff\xfe fake";
  assert_int_equal(pwrite(fd, hostile, sizeof hostile, 16), (ssize_t)sizeof hostile);
  struct stat st;
  assert_int_equal(fstat(fd, &st), 0);
  unsigned char *bytes = malloc((size_t)st.st_size);
  assert_int_equal(pread(fd, bytes, (size_t)st.st_size, 0), st.st_size);
  uint64_t start = gca__process_start_time(peer.pid);
  off_t slot = -1;
  for (off_t at = 0; at + 16 <= st.st_size && slot < 0; at += 8)
    if (!memcmp(bytes + at, &(int32_t){peer.pid}, 4) && !memcmp(bytes + at + 8, &start, 8)) slot = at;
  free(bytes);
  assert_true(slot >= 0);
  uint64_t absurd = UINT64_MAX;
  assert_int_equal(pwrite(fd, &absurd, 8, slot + 40), 8); /* allocated: more than reserved */
  close(fd);

  size_t len = 0;
  char *table = run_top("", &len);
  assert_null(memchr(table, 0x1b, len));
  assert_null(memchr(table, 0x9b, len));
  assert_null(memchr(table, 0x07, len));
  assert_contains(table, "\\x1b]0;owned\\x07\\x1b[2J\\x9b2J\\xff\\xfe fake");
  char expect[96];
  snprintf(expect, sizeof expect, "%8d implausible figures (allocated_bytes > reserved_bytes): not shown", (int)peer.pid);
  assert_contains(table, expect);
  assert_null(strstr(table, "17592186044416.0")); /* (2^64-1 bytes in MiB: not shown as a figure) */
  free(table);

  char *json = run_top("--json", &len);
  assert_true(valid_utf8_text(json, len));
  assert_contains(json, "\"identity\": \"\\u001b]0;owned\\u0007\\u001b[2J\\udc9b2J\\udcff\\udcfe fake\"");
  assert_contains(json, "\"implausible\": \"allocated_bytes \\u003e reserved_bytes\""); /* (JSON text: \u003e is ">") */
  free(json);
  kill(peer.pid, SIGCONT);
  stop_peer(peer);
  gca_close(a);
}

/* Another user's region is not read at all (its identity and figures may
 * say anything): scan skips it, counting it, and top says so. */
static void test_top_skips_another_users_region(void **state) {
  (void)state;
  if (geteuid() != 0) {
    fprintf(stderr, "skipped: making a region another user's needs root (chown)\n");
    skip();
  }
  gca_allocator_t *a = open_sim(spec, COOP);
  char path[64], file[96];
  coop_path(path, sizeof path);
  snprintf(file, sizeof file, "/dev/shm%s", path);
  static gca_ipc_device_t devices[16];
  int skipped = -1, n = gca_ipc_scan_ex(devices, 16, &skipped);
  bool mine = false;
  for (int i = 0; i < n && i < 16; i++) mine |= strstr(devices[i].identity, name) != NULL;
  assert_true(mine);
  int skipped_before = skipped;
  assert_int_equal(chown(file, 65534, 65534), 0);
  n = gca_ipc_scan_ex(devices, 16, &skipped);
  for (int i = 0; i < n && i < 16; i++) assert_null(strstr(devices[i].identity, name));
  assert_int_equal(skipped, skipped_before + 1);
  size_t len = 0;
  char *table = run_top("", &len);
  char expect[96];
  snprintf(expect, sizeof expect, "%d region%s of other users or groups skipped", skipped,
           skipped == 1 ? "" : "s");
  assert_contains(table, expect);
  free(table);
  char *json = run_top("--json", &len);
  snprintf(expect, sizeof expect, "{\"skipped_regions\": %d,", skipped);
  assert_contains(json, expect);
  free(json);
  assert_int_equal(chown(file, 0, 0), 0);
  gca_close(a);
}
#endif

/* Two processes opening `backend_spec` with cooperation on meet in the
 * rendezvous named `identity`; the other one's pid is returned, running,
 * and the bytes it caches (60 MiB as the backend rounds it) in `cached`. */
static pid_t meet_on(const char *backend_spec, const char *identity, gca_allocator_t *a, uint64_t *cached) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = fork_child();
  if (pid == 0) {
    close(fds[0]);
    char fd_text[16];
    snprintf(fd_text, sizeof fd_text, "%d", fds[1]);
    execl("/proc/self/exe", "test_coop", "--peer", backend_spec, "60", fd_text, (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  char c;
  assert_int_equal(read(fds[0], &c, 1), 1);
  close(fds[0]);
  static gca_ipc_device_t devices[16];
  int found = -1;
  for (int tries = 0; tries < 100 && found < 0; tries++) { /* (the peer publishes every 100 ms) */
    int n = gca_ipc_scan(devices, 16);
    for (int i = 0; i < n && i < 16; i++)
      if (!strcmp(devices[i].identity, identity) && devices[i].peer_count == 2)
        for (int k = 0; k < 2; k++)
          if (devices[i].peers[k].pid == pid && devices[i].peers[k].cached_bytes >= 60 * MiB) {
            found = i;
            *cached = devices[i].peers[k].cached_bytes;
          }
    if (found < 0) usleep(10000);
  }
  if (found < 0) kill(pid, SIGKILL), waitpid(pid, NULL, 0);
  assert_true(found >= 0);
  gca_ipc_peer_t peers[4];
  assert_int_equal(gca_ipc_peers(a, 0, peers, 4), 2);
  return pid;
}

/* The devices of the CUDA driver stand-in are named by their UUID. */
static void test_cuda_identity(void **state) {
  (void)state;
  char cuda_spec[300];
  snprintf(cuda_spec, sizeof cuda_spec, "cuda:driver=%s", FAKE_CUDA_PATH);
  gca_allocator_t *a = open_sim(cuda_spec, COOP);
  uint64_t cached = 0;
  pid_t pid = meet_on(cuda_spec, "cuda:GPU-a0a1a2a3a4a5a6a7a8a9aaabacadaeaf", a, &cached);
  assert_int_equal(cached, 60 * MiB);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  gca_close(a);
}

/* The AscendCL stand-in's devices are named by SoC and index; a request
 * made when aclrtMalloc* reports out of memory reaches the peer, which
 * releases what it cached (every process has its own stand-in memory, so
 * the retry is refused again: the statistics show the exchange). */
static void test_acl_identity_and_request(void **state) {
  (void)state;
  const char *acl_spec = "acl:library=" FAKE_ACL_PATH;
  gca_allocator_t *a = open_sim(acl_spec, COOP);
  uint64_t cached = 0;
  pid_t pid = meet_on(acl_spec, "acl:Ascend910B3:0", a, &cached); /* (60 MiB + the 32-byte pad, rounded) */
  void *lib = dlopen(FAKE_ACL_PATH, RTLD_NOW | RTLD_NOLOAD);
  assert_non_null(lib);
  void (*inject)(const char *, unsigned, unsigned, int) =
      (void (*)(const char *, unsigned, unsigned, int))dlsym(lib, "fakeacl_fail");
  void (*reset)(void) = (void (*)(void))dlsym(lib, "fakeacl_reset");
  assert_true(inject && reset);
  inject("aclrtMallocAlign32", 0, 1000, 207001); /* ACL_ERROR_RT_MEMORY_ALLOCATION */
  assert_null(gca_malloc(a, 60 * MiB, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  gca_stats_t s = stats_of(a, 0);
  assert_true(s.num_ipc_requests >= 1);
  assert_int_equal(s.ipc_bytes_received, cached);
  gca_ipc_peer_t peers[4];
  int n = gca_ipc_peers(a, 0, peers, 4);
  for (int i = 0; i < n && i < 4; i++)
    if (peers[i].pid == pid) assert_int_equal(peers[i].reserved_bytes, 0);
  reset();
  dlclose(lib);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  gca_close(a);
}

int main(int argc, char **argv) {
  if (argc == 5 && !strcmp(argv[1], "--peer")) return peer_main(argv[2], atoi(argv[3]), atoi(argv[4]));
  if (argc == 7 && !strcmp(argv[1], "--phases"))
    return phases_main(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]), atoi(argv[6]));
  if (argc == 3 && !strcmp(argv[1], "--hot-path")) return hot_path_main(argv[2]);
  if (argc == 7 && !strcmp(argv[1], "--work"))
    return work_main(argv[2], argv[3], atoi(argv[4]), strtoull(argv[5], NULL, 10), atoi(argv[6]));
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_without_cooperation_one_runs_out, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_a_peer_releases_its_cache, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_history_records_cooperation, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_paused_pool_frees_memory_for_others, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_resume_asks_the_peers, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_paused_pool_leaves_the_cache_whole, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_several_peers, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_cooperation_read_at_open, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_two_threads_ask_at_once, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_dead_peer_in_another_pid_namespace, fresh_name, remove_regions),
#ifdef GCALLOC_TOOL_PATH
      cmocka_unit_test_setup_teardown(test_top_shows_a_hostile_region_escaped, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_top_skips_another_users_region, fresh_name, remove_regions),
#endif
      cmocka_unit_test_setup_teardown(test_stopped_lock_holder, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_private_sim_works_alone, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_peer_in_another_pid_namespace, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_scan_survives_a_rewritten_region, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_stopped_peer_times_out, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_stopped_peer_does_not_block_the_others, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_waiting_asks_the_peers_again, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_released_memory_is_used_at_once, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_peer_dying_while_asked, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_peer_whose_thread_starts_late, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_processes_taking_turns, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_request_no_release_can_meet, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_request_asks_for_the_shortfall, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_peer_stopped_before_it_publishes_is_stale, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_stale_peer_is_not_waited_for, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_message_sums_every_round, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_peer_releases_free_pages_of_a_segment_in_use, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_cooperation_implies_expandable_segments, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_accounting_holds_while_peers_churn, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_memory_held_outside_is_named, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_foreign_region_leaves_cooperation_off, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_bad_magic_and_truncated_region, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_hot_path_makes_no_system_call, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_peers_killed_at_random_points, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_a_peer_releases_only_what_is_needed, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_scan_shows_the_device_and_the_requests, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_requests_in_a_row_release_more, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_random_workload_with_stopped_peers, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_random_workload_with_killed_peers, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_region_of_another_user, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_cuda_identity, fresh_name, remove_regions),
      cmocka_unit_test_setup_teardown(test_acl_identity_and_request, fresh_name, remove_regions),
  };
  if (getenv("GCALLOC_TEST_ONLY")) cmocka_set_test_filter(getenv("GCALLOC_TEST_ONLY"));
  return cmocka_run_group_tests(tests, NULL, NULL);
}
