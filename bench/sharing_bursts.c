/* `gcalloc bench-sharing`'s bursts: the promise of cooperation stated as a
 * workload. BURST_JOBS processes (forked) on one shared sim device of 4 GiB
 * run a seeded random schedule of bursts: 1-8 blocks of 8-512 MiB (whole
 * 2 MiB units), allocated, held 5-40 ms, freed. An admission board in
 * shared memory keeps the true total of the bursts' live memory at or
 * below the device at every instant (a burst waits there, bounded, until
 * it fits), so every out-of-memory error is avoidable. Reported per
 * setting: bursts done and failed, out-of-memory errors and how many
 * gcalloc counted avoidable, requests to the peers and their round trips
 * (the allocations that asked: p50, p99), every allocation's latency (p99,
 * failed ones included) and the wall time against the same schedule on a
 * device with room for all of them. Variants: one peer SIGKILLed half-way
 * (its admitted memory handed back to the board, as its death gives it
 * back to the device), and one SIGSTOPped for 5 s half-way (its memory
 * stays admitted: its cache is out of reach while stopped). Each
 * out-of-memory error is also judged as the promise states it: one the
 * live peers' cache could have prevented is any while no peer is stopped
 * (admission keeps the live memory within the device), and while one is,
 * one where the others' admitted memory plus everything the stopped one
 * reserved (its live memory and its cache, out of reach; as it published
 * it, exact for reserved bytes) fit the device.
 */
#include <errno.h>
#include <stddef.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/sharing_bursts.h"
#include "gcalloc.h"
#include "tools/tool.h"

#define MIB ((int64_t)1 << 20)
#define BURST_JOBS 4
#define BURST_CAPACITY (4096 * MIB)
#define SAMPLES 65536 /* allocation latencies kept per job */
#define ADMIT_WAIT_S BURST_ADMIT_WAIT_S

typedef struct {
  int64_t bursts, failed, ooms, avoidable, requests, rounds, allocations, admit_timeouts, errors, live_preventable;
  char first_error[256];
  int kept, asked;
  float alloc_ms[SAMPLES];
  float asked_ms[SAMPLES / 4];
} burst_job_t;

/* (No condition variable: glibc's process-shared one is not robust to a
 * waiter that dies, and a later broadcast can block for good. A burst that
 * does not fit looks again every 200 us.) */
typedef struct {
  pthread_mutex_t lock; /* process-shared, robust: a job killed inside it */
  int64_t capacity;
  int64_t admitted[BURST_JOBS]; /* each job's admitted bytes: their sum is the live total (one store a change) */
  _Atomic int done[BURST_JOBS];
  _Atomic int stopped;          /* the job stopped now (its index + 1; 0: none), set once it is stopped */
  _Atomic int32_t stopped_pid;
  burst_job_t job[BURST_JOBS];
} burst_board_t;

static burst_board_t *bb;

static void sleep_ms(double ms) {
  struct timespec t = {(time_t)(ms / 1000), (long)((ms - (double)(long)(ms / 1000) * 1000) * 1e6)};
  nanosleep(&t, NULL);
}

/* (A job killed while it held the lock leaves it to the next taker, who
 * makes it consistent: the board is the sum of single stores.) */
static void board_lock(void) {
  if (pthread_mutex_lock(&bb->lock) == EOWNERDEAD) pthread_mutex_consistent(&bb->lock);
}

static int64_t board_live(void) {
  int64_t live = 0;
  for (int i = 0; i < BURST_JOBS; i++) live += bb->admitted[i];
  return live;
}

/* Wait until `bytes` more fit the board (bounded); whether they were admitted. */
static bool admit(int me, int64_t bytes) {
  double until = tool_seconds() + ADMIT_WAIT_S;
  for (;;) {
    board_lock();
    bool ok = board_live() + bytes <= bb->capacity;
    if (ok) bb->admitted[me] += bytes;
    pthread_mutex_unlock(&bb->lock);
    if (ok || tool_seconds() > until) return ok;
    sleep_ms(0.2);
  }
}

static void give_back(int me, int64_t bytes) {
  board_lock();
  bb->admitted[me] -= bytes;
  pthread_mutex_unlock(&bb->lock);
}

/* Whether an out-of-memory error just met could have been prevented by the
 * live peers' cache (see the top of this file). */
static bool live_could_prevent(gca_allocator_t *a) {
  int stopped = atomic_load(&bb->stopped);
  if (!stopped) return true;
  gca_ipc_peer_t peers[64];
  int n = gca_ipc_peers(a, 0, peers, 64);
  int32_t pid = atomic_load(&bb->stopped_pid);
  uint64_t held = 0;
  for (int i = 0; i < n && i < 64; i++)
    if (peers[i].pid == pid) held = peers[i].reserved_bytes;
  board_lock();
  int64_t others = 0;
  for (int i = 0; i < BURST_JOBS; i++)
    if (i != stopped - 1) others += bb->admitted[i];
  pthread_mutex_unlock(&bb->lock);
  return others + (int64_t)held <= bb->capacity || atomic_load(&bb->stopped) != stopped;
}

static void burst_job(const char *spec, const char *conf, int me, int bursts, unsigned seed) {
  gca_allocator_t *a = NULL;
  if (gca_open(spec, conf, &a) != GCA_OK) {
    fprintf(stderr, "gcalloc bench-sharing: burst job %d cannot open the device: %s\n", me, gca_last_error());
    _exit(2);
  }
  burst_job_t *j = &bb->job[me];
  unsigned s = seed * 2654435761u + (unsigned)me * 40503u + 1;
#define NEXT() ((s = s * 1103515245u + 12345u) >> 8)
  for (int b = 0; b < bursts; b++) {
    int k = 1 + (int)(NEXT() % 8);
    int64_t size[8], total = 0;
    for (int i = 0; i < k; i++) total += size[i] = (4 + (int64_t)(NEXT() % 253)) * 2 * MIB; /* 8-512 MiB */
    double hold = 5 + (double)(NEXT() % 36);
    if (!admit(me, total)) {
      j->failed++;
      j->admit_timeouts++;
      continue;
    }
    void *held[8];
    bool failed = false;
    for (int i = 0; i < k; i++) {
      gca_stats_t before, after;
      gca_get_stats(a, 0, &before);
      double t0 = tool_seconds();
      held[i] = gca_malloc(a, (size_t)size[i], 0, 0);
      double ms = (tool_seconds() - t0) * 1e3;
      gca_get_stats(a, 0, &after);
      j->allocations++;
      if (j->kept < SAMPLES) j->alloc_ms[j->kept++] = (float)ms;
      if (after.num_ipc_requests != before.num_ipc_requests && j->asked < SAMPLES / 4) j->asked_ms[j->asked++] = (float)ms;
      if (!held[i]) failed = true;
      if (!held[i] && gca_last_status() == GCA_ERR_OOM && conf && live_could_prevent(a)) j->live_preventable++;
      if (!held[i] && gca_last_status() != GCA_ERR_OOM && !j->errors++)
        snprintf(j->first_error, sizeof j->first_error, "%s", gca_last_error());
    }
    sleep_ms(hold);
    for (int i = 0; i < k; i++)
      if (held[i]) gca_free(a, held[i]);
    give_back(me, total);
    j->bursts++;
    j->failed += failed;
  }
#undef NEXT
  gca_stats_t st;
  gca_get_stats(a, 0, &st);
  j->ooms = st.num_ooms;
  j->avoidable = st.num_avoidable_ooms;
  j->requests = st.num_ipc_requests;
  j->rounds = st.num_ipc_rounds;
  atomic_store(&bb->done[me], 1);
  gca_close(a);
  _exit(0);
}

static int cmp_float(const void *x, const void *y) {
  float a = *(const float *)x, b = *(const float *)y;
  return (a > b) - (a < b);
}

static double percentile(float *v, int n, int pct) {
  if (n == 0) return 0;
  qsort(v, (size_t)n, sizeof *v, cmp_float);
  int at = (n * pct) / 100;
  return v[at < n ? at : n - 1];
}

/* One setting: the jobs, and with `victim` a signal at half-way. */
static int run_setting(burst_setting_t *set, int bursts, int stop_ms) {
  memset(bb, 0, sizeof *bb);
  pthread_mutexattr_t ma;
  pthread_mutexattr_init(&ma);
  pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(&bb->lock, &ma);
  bb->capacity = BURST_CAPACITY;
  char spec[128];
  /* (The device with room is 64 times as large: four times the board's
   * capacity was not room enough, as each process's cache of segments cut
   * to its own bursts' sizes could fill a quarter of it and still miss.) */
  snprintf(spec, sizeof spec, "sim:shared=bursts-%d-%d,capacity=%" PRId64 "MiB", (int)getpid(), set->index,
           set->room ? BURST_CAPACITY / MIB * 64 : BURST_CAPACITY / MIB);
  double t0 = tool_seconds();
  pid_t pids[BURST_JOBS];
  for (int i = 0; i < BURST_JOBS; i++) {
    pids[i] = fork();
    if (pids[i] == 0) burst_job(spec, set->conf, i, bursts, 7);
  }
  if (set->signal) { /* half-way through job 0's bursts, the last job is killed or stopped */
    while (bb->job[0].bursts < bursts / 2 && !atomic_load(&bb->done[0])) sleep_ms(1);
    int victim = BURST_JOBS - 1;
    if (set->signal == SIGKILL) {
      kill(pids[victim], SIGKILL);
      waitpid(pids[victim], NULL, 0);
      board_lock(); /* (its memory went back to the device with it) */
      bb->admitted[victim] = 0;
      pthread_mutex_unlock(&bb->lock);
    } else {
      kill(pids[victim], SIGSTOP);
      int ws = 0;
      bool stopped = waitpid(pids[victim], &ws, WUNTRACED) == pids[victim] && WIFSTOPPED(ws);
      if (stopped) {
        atomic_store(&bb->stopped_pid, (int32_t)pids[victim]);
        atomic_store(&bb->stopped, victim + 1);
      }
      sleep_ms(stop_ms);
      atomic_store(&bb->stopped, 0);
      kill(pids[victim], SIGCONT);
    }
  }
  int rc = 0;
  for (int i = 0; i < BURST_JOBS; i++) {
    int ws = 0;
    if (waitpid(pids[i], &ws, 0) < 0) continue; /* (the killed one: reaped above) */
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) rc = -1;
  }
  double wall = tool_seconds() - t0;
  static float all[BURST_JOBS * SAMPLES], asked[BURST_JOBS * SAMPLES / 4];
  int n = 0, m = 0;
  memset(&set->bursts, 0, sizeof *set - offsetof(burst_setting_t, bursts));
  for (int i = 0; i < BURST_JOBS; i++) {
    burst_job_t *j = &bb->job[i];
    set->bursts += j->bursts;
    set->failed += j->failed;
    set->ooms += j->ooms;
    set->avoidable += j->avoidable;
    set->requests += j->requests;
    set->rounds += j->rounds;
    set->allocations += j->allocations;
    set->admit_timeouts += j->admit_timeouts;
    set->live_preventable += j->live_preventable;
    if (j->errors && !set->errors) snprintf(set->first_error, sizeof set->first_error, "%s", j->first_error);
    set->errors += j->errors;
    memcpy(all + n, j->alloc_ms, (size_t)j->kept * sizeof *all);
    n += j->kept;
    memcpy(asked + m, j->asked_ms, (size_t)j->asked * sizeof *asked);
    m += j->asked;
  }
  set->wall_s = wall;
  set->malloc_p99_ms = percentile(all, n, 99);
  set->trip_p50_ms = percentile(asked, m, 50);
  set->trip_p99_ms = percentile(asked, m, 99);
  pthread_mutex_destroy(&bb->lock);
  return rc;
}

int bench_sharing_bursts(burst_setting_t *sets, int count, int bursts, int stop_ms) {
  bb = mmap(NULL, sizeof *bb, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (bb == MAP_FAILED) return -1;
  int rc = 0;
  for (int i = 0; i < count; i++) {
    sets[i].index = i;
    if (run_setting(&sets[i], bursts, stop_ms)) rc = -1;
  }
  munmap(bb, sizeof *bb);
  return rc;
}
