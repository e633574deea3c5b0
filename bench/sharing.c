/* `gcalloc bench-sharing`: processes on one device, with and without
 * cooperation (ipc_cooperation:True, docs/sharing.md), in one run.
 *
 *   jobs       N = 2, 4, 8 processes (forked) on one shared sim device of
 *              1 GiB. In turn, each takes 60% of it (12 blocks of 51 MiB)
 *              for a moment and frees it (it stays cached), BIG_PHASES
 *              times; meanwhile the others toggle one block of their own.
 *              The live memory of all of them always fits (8 x 51 + 11 x
 *              51 MiB < 1 GiB), so every out-of-memory is avoidable; a job
 *              stops at its first one, as a real job would. Reported: turns
 *              done, out-of-memory errors (and how many gcalloc itself
 *              counted avoidable, num_avoidable_ooms), and the wait of
 *              every allocation that asked the peers or failed (p50, p99,
 *              max, the failed ones included). Then with one peer stopped
 *              (SIGSTOP) just after its turn, caching 561 MiB: for 300 ms,
 *              and for 1.5 s with and without oom_retry_timeout_ms:3000.
 *   round trip a peer caches 512 MiB when told; the other process asks for 768 MiB,
 *              which fits only once the peer released: the time of that
 *              gca_malloc (the request, the peer's release, the retry),
 *              median and p99 of ROUND_TRIPS, in microseconds.
 *   hot path   a 4 KiB malloc+free loop with cooperation on and off and no
 *              pressure, rounds interleaved: ns per pair and the ratio.
 *   bursts     4 processes under a seeded random schedule of bursts whose
 *              live memory always fits a 4 GiB device (sharing_bursts.c):
 *              bursts failed, out-of-memory errors, round trips, malloc
 *              p99, wall time against a device with room; a peer killed
 *              and one stopped half-way.
 * The device is the sim's (there is no GPU here); the round trip includes
 * the peer emptying its cache on the sim, which costs what its bookkeeping
 * costs, not what a driver's free does (docs/sharing.md has a GPU's).
 */
#include <inttypes.h>
#include <signal.h>
#include <stdatomic.h>
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

#define MIB ((size_t)1 << 20)
#define BLOCK (51 * MIB)
#define BIG_BLOCKS 11 /* beside the job's own block: 12 x 51 MiB, 60% of 1 GiB */
#define BIG_PHASES 10
#define MAX_JOBS 8
#define MAX_WAITS 512
#define JOB_SECONDS 60
#define ROUND_TRIPS 200

/* --quick (the CTest smoke check): a third of the turns, a quarter of the
 * round trips, a tenth of the hot loop. */
static int big_phases = BIG_PHASES, round_trip_count = ROUND_TRIPS, hot_pairs = 1000000;

static char device_spec[128];

static void sleep_us(long us) {
  struct timespec t = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&t, NULL);
}

/* What the jobs share (an anonymous shared mapping made before the fork). */
typedef struct {
  _Atomic int turn;              /* the job taking 60% now */
  _Atomic int state[MAX_JOBS];   /* 0 running, 1 done, 2 stopped by an out-of-memory, 3 failed */
  int phases[MAX_JOBS];
  int64_t avoidable[MAX_JOBS];   /* num_avoidable_ooms */
  int waits[MAX_JOBS];
  double wait_ms[MAX_JOBS][MAX_WAITS];
  _Atomic int oom_said;
  char first_oom[1024]; /* the first job's out-of-memory message */
} board_t;

static board_t *board;

/* The turn goes to the next job still running. */
static void pass_turn(int me, int n) {
  for (int k = 1; k <= n; k++) {
    int j = (me + k) % n;
    if (atomic_load(&board->state[j]) == 0) {
      atomic_store(&board->turn, j);
      return;
    }
  }
}

/* One allocation of the job, timed: kept when it asked the peers or failed. */
static void *job_malloc(gca_allocator_t *a, int me) {
  gca_stats_t before, after;
  gca_get_stats(a, 0, &before);
  double t0 = tool_seconds();
  void *p = gca_malloc(a, BLOCK, 0, 0);
  double ms = (tool_seconds() - t0) * 1e3;
  gca_get_stats(a, 0, &after);
  if ((!p || after.num_ipc_requests != before.num_ipc_requests) && board->waits[me] < MAX_WAITS)
    board->wait_ms[me][board->waits[me]++] = ms;
  return p;
}

static void job(const char *conf, int me, int n) {
  gca_allocator_t *a = NULL;
  if (gca_open(device_spec, conf, &a) != GCA_OK) {
    fprintf(stderr, "gcalloc bench-sharing: job %d cannot open the device: %s\n", me, gca_last_error());
    atomic_store(&board->state[me], 3);
    pass_turn(me, n);
    _exit(2);
  }
  unsigned s = (unsigned)(me + 1) * 2654435761u + 1;
  void *mine = NULL, *big[BIG_BLOCKS];
  bool oom = false;
  double until = tool_seconds() + JOB_SECONDS;
  while (board->phases[me] < big_phases && !oom && tool_seconds() < until) {
    if (atomic_load(&board->turn) == me) {
      int got = 0;
      while (got < BIG_BLOCKS && (big[got] = job_malloc(a, me)) != NULL) got++;
      oom = got < BIG_BLOCKS;
      sleep_us(1000); /* the phase that needs the memory */
      for (int i = 0; i < got; i++) gca_free(a, big[i]);
      board->phases[me] += !oom;
      if (!oom) pass_turn(me, n);
    } else if (mine) {
      gca_free(a, mine);
      mine = NULL;
    } else {
      oom = (mine = job_malloc(a, me)) == NULL;
    }
    sleep_us(200 + (long)((s = s * 1103515245u + 12345u) >> 16) % 800);
  }
  if (oom && !atomic_exchange(&board->oom_said, 1)) snprintf(board->first_oom, sizeof board->first_oom, "%s", gca_last_error());
  if (mine) gca_free(a, mine);
  gca_stats_t st;
  gca_get_stats(a, 0, &st);
  board->avoidable[me] = st.num_avoidable_ooms;
  atomic_store(&board->state[me], oom ? 2 : board->phases[me] < big_phases ? 3 : 1);
  if (atomic_load(&board->turn) == me) pass_turn(me, n);
  gca_close(a);
  _exit(0);
}

typedef struct {
  int procs, stop_ms;
  const char *conf, *label;
  int phases, ooms, failed;
  int64_t avoidable;
  double p50, p99, max;
  int waits;
  char first_oom[1024];
} scenario_t;

static int cmp_double(const void *x, const void *y);

/* The jobs of one scenario; with stop_ms, the job whose turn just ended is
 * stopped that long, at the first two turns. */
static int run_jobs(scenario_t *sc) {
  memset(board, 0, sizeof *board);
  pid_t pids[MAX_JOBS];
  for (int i = 0; i < sc->procs; i++) {
    pids[i] = fork();
    if (pids[i] == 0) job(sc->conf, i, sc->procs);
  }
  int stops = 0, last_turn = 0;
  double until = tool_seconds() + JOB_SECONDS + 10;
  while (sc->stop_ms && stops < 2 && tool_seconds() < until) {
    int t = atomic_load(&board->turn);
    bool running = false;
    for (int i = 0; i < sc->procs; i++) running |= atomic_load(&board->state[i]) == 0;
    if (!running) break;
    if (t != last_turn) { /* the job that just freed its 60% caches it */
      kill(pids[last_turn], SIGSTOP);
      sleep_us((long)sc->stop_ms * 1000);
      kill(pids[last_turn], SIGCONT);
      stops++;
      last_turn = atomic_load(&board->turn);
      continue;
    }
    sleep_us(100);
  }
  int rc = 0;
  for (int i = 0; i < sc->procs; i++) {
    int ws = 0;
    waitpid(pids[i], &ws, 0);
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0 || atomic_load(&board->state[i]) == 3) {
      fprintf(stderr, "gcalloc bench-sharing: job %d of %d ended with status %#x, state %d\n", i + 1, sc->procs, ws,
              atomic_load(&board->state[i]));
      sc->failed++;
      rc = -1;
    }
  }
  static double all[MAX_JOBS * MAX_WAITS];
  int n = 0;
  sc->phases = sc->ooms = 0;
  sc->avoidable = 0;
  for (int i = 0; i < sc->procs; i++) {
    sc->phases += board->phases[i];
    sc->ooms += atomic_load(&board->state[i]) == 2;
    sc->avoidable += board->avoidable[i];
    for (int k = 0; k < board->waits[i]; k++) all[n++] = board->wait_ms[i][k];
  }
  sc->waits = n;
  snprintf(sc->first_oom, sizeof sc->first_oom, "%s", board->first_oom);
  sc->p50 = sc->p99 = sc->max = 0;
  if (n) {
    qsort(all, (size_t)n, sizeof all[0], cmp_double);
    sc->p50 = all[n / 2];
    sc->p99 = all[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
    sc->max = all[n - 1];
  }
  return rc;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

/* The peer of the round trip: on each byte from `commands` caches 512 MiB
 * (unless it still does) and answers on `answers`; it ends at end of
 * file. Told when to cache, it never takes the memory back between a
 * release and the requester's retry, which would make the round trip
 * measure a race instead. */
static void round_trip_peer(int commands, int answers) {
  gca_allocator_t *a = NULL;
  if (gca_open(device_spec, "ipc_cooperation:True", &a) != GCA_OK) {
    fprintf(stderr, "gcalloc bench-sharing: the round trip's peer cannot open the device: %s\n", gca_last_error());
    _exit(2);
  }
  char c;
  while (read(commands, &c, 1) == 1) {
    bool cached = gca_reserved_bytes(a, 0) > 0;
    if (!cached) {
      void *p = gca_malloc(a, 512 * MIB, 0, 0);
      if (p) gca_free(a, p);
      cached = p != NULL;
    }
    if (write(answers, cached ? "r" : "x", 1) != 1) break;
  }
  gca_close(a);
  _exit(0);
}

static int round_trips(double *median, double *p99, int *refused) {
  int to_peer[2], from_peer[2];
  if (pipe(to_peer)) return -1;
  if (pipe(from_peer)) {
    close(to_peer[0]);
    close(to_peer[1]);
    return -1;
  }
  pid_t peer = fork();
  if (peer == 0) {
    close(to_peer[1]);
    close(from_peer[0]);
    round_trip_peer(to_peer[0], from_peer[1]);
  }
  close(to_peer[0]);
  close(from_peer[1]);
  char c = 0;
  int rc = write(to_peer[1], "c", 1) == 1 && read(from_peer[0], &c, 1) == 1 && c == 'r' ? 0 : -1;
  sleep_us(200000); /* the peer has published */
  gca_allocator_t *a = NULL;
  if (rc == 0 && gca_open(device_spec, "ipc_cooperation:True", &a) != GCA_OK) rc = -1;
  static double us[ROUND_TRIPS];
  int n = 0;
  for (int i = 0; i < round_trip_count && rc == 0; i++) {
    /* The peer caches its 512 MiB again, then the request. */
    if (write(to_peer[1], "c", 1) != 1 || read(from_peer[0], &c, 1) != 1 || c != 'r') {
      rc = -1;
      break;
    }
    double t0 = tool_seconds();
    void *p = gca_malloc(a, 768 * MIB, 0, 0);
    double t = (tool_seconds() - t0) * 1e6;
    if (!p) { /* the peer did not answer within ipc_release_timeout_ms: not a round trip */
      (*refused)++;
      continue;
    }
    us[n++] = t;
    gca_free(a, p);
    gca_empty_cache(a, 0);
  }
  close(to_peer[1]); /* (the peer ends) */
  close(from_peer[0]);
  waitpid(peer, NULL, 0);
  gca_close(a);
  if (rc == 0 && n == 0) rc = -1;
  if (rc) return rc;
  qsort(us, (size_t)n, sizeof us[0], cmp_double);
  *median = us[n / 2];
  *p99 = us[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
  return 0;
}

static double hot_loop(gca_allocator_t *a) {
  double t0 = tool_seconds();
  for (int i = 0; i < hot_pairs; i++) gca_free(a, gca_malloc(a, 4096, 0, 0));
  return (tool_seconds() - t0) * 1e9 / hot_pairs;
}

/* The jobs, the round trip and the hot path, as text. */
static void print_jobs(const scenario_t *sc, int scenarios, double median, double p99, int refused, double best_off,
                       double best_on) {
  printf("jobs on one 1 GiB sim device taking turns at 60%% of it, %d turns each; their live memory always fits,\n"
         "so every out-of-memory is avoidable; a job stops at its first\n", big_phases);
  printf("processes  cooperation  %-48s  turns done  OOMs  counted avoidable  wait p50 / p99 / max ms (n)\n",
         "setting");
  for (int i = 0; i < scenarios; i++)
    printf("%9d  %-11s  %-48s  %4d / %-4d  %4d  %17" PRId64 "  %.2f / %.2f / %.2f (%d)\n", sc[i].procs,
           sc[i].conf ? "on" : "off", sc[i].label, sc[i].phases, sc[i].procs * big_phases, sc[i].ooms,
           sc[i].avoidable, sc[i].p50, sc[i].p99, sc[i].max, sc[i].waits);
  printf("\nthe first out-of-memory message of each setting with cooperation on that had one:\n");
  for (int i = 0; i < scenarios; i++)
    if (sc[i].conf && sc[i].ooms)
      printf("  %d processes%s%s: %s\n", sc[i].procs, *sc[i].label ? ", " : "", sc[i].label, sc[i].first_oom);
  printf("\nrelease request round trip (ask, peer releases 512 MiB, retry), %d times: median %.0f us, p99 %.0f us"
         " (%d not answered in time)\n", round_trip_count, median, p99, refused);
  printf("hot path, 4 KiB malloc+free, no pressure: off %.1f ns, on %.1f ns (%.3fx)\n", best_off, best_on,
         best_on / best_off);
}

const tool_command_t bench_sharing_command = {
    "bench-sharing", NULL, "[--json] [--quick] [--bursts N] [--bursts-only]",
    "processes on one device with and without cooperation: turns, OOMs, waits, round trip, hot path",
    "\n"
    "2, 4 and 8 processes on one shared simulated device taking turns at a phase that needs 60% of it while\n"
    "the others hold a block each (their live memory always fits), with and without ipc_cooperation:True,\n"
    "then with one peer stopped: turns done, out-of-memory errors (a job stops at its first), the wait of\n"
    "every allocation that asked the peers or failed (p50/p99/max); the round trip of a release request\n"
    "(median and p99, microseconds); the hot path's cost with cooperation on and no pressure, as a ratio\n"
    "to off; then 4 processes under a seeded random schedule of bursts (1-8 blocks of 8-512 MiB held 5-40\n"
    "ms) whose live memory always fits a 4 GiB device: bursts failed, out-of-memory errors, requests and\n"
    "their round trips, malloc p99 and wall time against a device with room, with a peer killed and one\n"
    "stopped for 5 s half-way (docs/sharing.md).\n"
    "\n"
    "  --json      the figures as JSON\n"
    "  --quick        3 turns a job, 50 round trips, a shorter loop, 40 bursts a job, a 1 s stop (a smoke\n"
    "                 test, not figures to quote)\n"
    "  --bursts N     bursts a job (default 5000; 40 with --quick)\n"
    "  --bursts-only  the bursts alone\n"
    "  -h, --help     this help\n",
    bench_sharing_main};

int bench_sharing_main(int argc, char **argv) {
  bool json = false, quick = false, bursts_only = false;
  long burst_count = 0;
  const tool_option_t options[] = {
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {"--quick", OPTION_FLAG, &quick, 0, 0, NULL},
      {"--bursts", OPTION_NUMBER, &burst_count, 1, 1000000, "N"},
      {"--bursts-only", OPTION_FLAG, &bursts_only, 0, 0, NULL},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&bench_sharing_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  if (quick) {
    big_phases = 3;
    round_trip_count = ROUND_TRIPS / 4;
    hot_pairs = 100000;
  }
  snprintf(device_spec, sizeof device_spec, "sim:shared=bench-%d,capacity=1GiB", (int)getpid());
  board = mmap(NULL, sizeof *board, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (board == MAP_FAILED) {
    perror("gcalloc bench-sharing: mmap");
    return 1;
  }
  const char *on_conf = "ipc_cooperation:True";
  scenario_t sc[] = {
      {2, 0, NULL, "", 0, 0, 0, 0, 0, 0, 0, 0, ""},
      {2, 0, on_conf, "", 0, 0, 0, 0, 0, 0, 0, 0, ""},
      {4, 0, NULL, "", 0, 0, 0, 0, 0, 0, 0, 0, ""},
      {4, 0, on_conf, "", 0, 0, 0, 0, 0, 0, 0, 0, ""},
      {8, 0, NULL, "", 0, 0, 0, 0, 0, 0, 0, 0, ""},
      {8, 0, on_conf, "", 0, 0, 0, 0, 0, 0, 0, 0, ""},
      {4, 300, on_conf, "a peer stopped 300 ms", 0, 0, 0, 0, 0, 0, 0, 0, ""},
      {4, 1500, on_conf, "a peer stopped 1.5 s", 0, 0, 0, 0, 0, 0, 0, 0, ""},
      {4, 1500, "ipc_cooperation:True,oom_retry_timeout_ms:3000", "a peer stopped 1.5 s, oom_retry_timeout_ms:3000",
       0, 0, 0, 0, 0, 0, 0, 0, ""},
  };
  const int scenarios = (int)(sizeof sc / sizeof sc[0]);
  int rc = 0;
  double median = 0, p99 = 0, best_on = 1e30, best_off = 1e30;
  int refused = 0;
  if (!bursts_only) {
    for (int i = 0; i < scenarios; i++)
      if (run_jobs(&sc[i])) rc = 1;
    if (round_trips(&median, &p99, &refused) || refused > round_trip_count / 2) {
      fprintf(stderr, "gcalloc bench-sharing: the round trip failed: %s\n", gca_last_error());
      rc = 1;
    }
    gca_allocator_t *on = NULL, *off = NULL;
    if (gca_open(device_spec, "ipc_cooperation:True", &on) == GCA_OK && gca_open(device_spec, NULL, &off) == GCA_OK) {
      for (int r = 0; r < 7; r++) {
        double t_off = hot_loop(off), t_on = hot_loop(on);
        if (r > 0 && t_off < best_off) best_off = t_off;
        if (r > 0 && t_on < best_on) best_on = t_on;
      }
    } else {
      rc = 1;
    }
    gca_close(on);
    gca_close(off);
  }
  /* The bursts: the schedule on a device with room (the wall time's
   * reference), without and with cooperation, then a peer killed and one
   * stopped half-way. */
  if (!burst_count) burst_count = quick ? 40 : 5000;
  int stop_ms = quick ? 1000 : 5000;
  burst_setting_t bursts[] = {
      {.conf = NULL, .label = "a device with room for all", .room = 1},
      {.conf = NULL, .label = "cooperation off"},
      {.conf = "ipc_cooperation:True", .label = "cooperation on"},
      {.conf = "ipc_cooperation:True", .label = "on, a peer killed half-way", .signal = SIGKILL},
      {.conf = "ipc_cooperation:True", .label = "on, a peer stopped half-way", .signal = SIGSTOP},
  };
  const int burst_settings = (int)(sizeof bursts / sizeof bursts[0]);
  if (bench_sharing_bursts(bursts, burst_settings, (int)burst_count, stop_ms)) {
    fprintf(stderr, "gcalloc bench-sharing: a burst job failed\n");
    rc = 1;
  }
  double room_s = bursts[0].wall_s > 0 ? bursts[0].wall_s : 1;
  if (json) {
    printf("{\"jobs\": [");
    for (int i = 0; i < (bursts_only ? 0 : scenarios); i++)
      printf("%s{\"processes\": %d, \"cooperation\": %s, \"config\": \"%s\", \"stopped_ms\": %d, \"turns\": %d, "
             "\"turns_done\": %d, \"ooms\": %d, \"ooms_avoidable\": %d, \"counted_avoidable\": %" PRId64 ", "
             "\"waits\": %d, \"wait_ms\": {\"p50\": %.3f, \"p99\": %.3f, \"max\": %.3f}, \"failed\": %d}",
             i ? ", " : "", sc[i].procs, sc[i].conf ? "true" : "false", sc[i].conf ? sc[i].conf : "", sc[i].stop_ms,
             sc[i].procs * big_phases, sc[i].phases, sc[i].ooms, sc[i].ooms, sc[i].avoidable, sc[i].waits, sc[i].p50,
             sc[i].p99, sc[i].max, sc[i].failed);
    printf("], \"bursts\": [");
    for (int i = 0; i < burst_settings; i++) {
      const burst_setting_t *b = &bursts[i];
      printf("%s{\"setting\": \"%s\", \"jobs\": 4, \"bursts\": %" PRId64 ", \"failed\": %" PRId64 ", \"ooms\": %" PRId64
             ", \"counted_avoidable\": %" PRId64 ", \"requests\": %" PRId64 ", \"rounds\": %" PRId64
             ", \"allocations\": %" PRId64 ", \"malloc_p99_ms\": %.3f, \"round_trip_ms\": {\"p50\": %.3f, \"p99\": %.3f}"
             ", \"wall_s\": %.3f, \"wall_vs_room\": %.3f, \"admit_timeouts\": %" PRId64 ", \"errors\": %" PRId64
             ", \"ooms_live_preventable\": %" PRId64 "}",
             i ? ", " : "", b->label, b->bursts, b->failed, b->ooms, b->avoidable, b->requests, b->rounds,
             b->allocations, b->malloc_p99_ms, b->trip_p50_ms, b->trip_p99_ms, b->wall_s, b->wall_s / room_s,
             b->admit_timeouts, b->errors, b->live_preventable);
    }
    if (bursts_only)
      printf("], \"round_trip_us\": null, \"hot_path_ns\": null, \"round_trips_refused\": 0}\n");
    else
      printf("], \"round_trip_us\": {\"median\": %.1f, \"p99\": %.1f}, \"hot_path_ns\": {\"off\": %.1f, \"on\": %.1f, "
             "\"ratio\": %.3f}, \"round_trips_refused\": %d}\n", median, p99, best_off, best_on, best_on / best_off,
             refused);
  } else {
    if (!bursts_only) print_jobs(sc, scenarios, median, p99, refused, best_off, best_on);
    printf("%sbursts: 4 processes on one 4 GiB sim device, %ld bursts each of 1-8 blocks of 8-512 MiB held 5-40 ms,\n"
           "admitted so that their live memory always fits (every out-of-memory is avoidable); a stop lasts %d ms\n",
           bursts_only ? "" : "\n", burst_count, stop_ms);
    printf("%-30s  %7s  %6s  %5s  %9s  %8s  %6s  %13s  %19s  %8s  %7s\n", "setting", "bursts", "failed", "OOMs",
           "avoidable", "requests", "rounds", "malloc p99 ms", "round trip p50/p99", "wall s", "vs room");
    for (int i = 0; i < burst_settings; i++) {
      const burst_setting_t *b = &bursts[i];
      printf("%-30s  %7" PRId64 "  %6" PRId64 "  %5" PRId64 "  %9" PRId64 "  %8" PRId64 "  %6" PRId64 "  %13.2f  %8.2f / %8.2f  %8.2f  %6.3fx\n",
             b->label, b->bursts, b->failed, b->ooms, b->avoidable, b->requests, b->rounds, b->malloc_p99_ms,
             b->trip_p50_ms, b->trip_p99_ms, b->wall_s, b->wall_s / room_s);
    }
    for (int i = 0; i < burst_settings; i++) {
      const burst_setting_t *b = &bursts[i];
      if (b->admit_timeouts)
        printf("  %s: %" PRId64 " bursts failed waiting %d s for admission\n", b->label, b->admit_timeouts,
               BURST_ADMIT_WAIT_S);
      if (b->errors)
        printf("  %s: %" PRId64 " allocations refused with an error other than out of memory, the first: %s\n",
               b->label, b->errors, b->first_error);
      if (b->conf && b->ooms)
        printf("  %s: %" PRId64 " out-of-memory errors, %" PRId64 " of them preventable by the live peers' cache%s\n",
               b->label, b->ooms, b->live_preventable,
               b->signal == SIGSTOP ? " (the others came while the stopped peer's live memory and cache left too "
                                      "little room)" : "");
    }
  }
  munmap(board, sizeof *board);
  if (rc) fprintf(stderr, "gcalloc bench-sharing: a measurement failed\n");
  return rc;
}
