/* `gcalloc bench-sharing`: processes on one device, with and without
 * cooperation (ipc_cooperation:True, docs/sharing.md), in one run.
 *
 *   phases     N = 2, 4, 8 processes (forked) on one shared sim device of
 *              1 GiB, each doing STEPS steps: take 60% of the device in
 *              chunks, hold it a moment, free it (it stays cached), idle a
 *              moment. Without cooperation a process's cache starves the
 *              others; with it they ask each other. Reported: steps
 *              completed and steps that ran out of memory, over all.
 *   round trip a peer caches 512 MiB when told; the other process asks for 768 MiB,
 *              which fits only once the peer released: the time of that
 *              gca_malloc (the request, the peer's release, the retry),
 *              median and p99 of ROUND_TRIPS, in microseconds.
 *   hot path   a 4 KiB malloc+free loop with cooperation on and off and no
 *              pressure, rounds interleaved: ns per pair and the ratio.
 * The device is the sim's (there is no GPU here); the round trip includes
 * the peer emptying its cache on the sim, which costs what its bookkeeping
 * costs, not what a driver's free does.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gcalloc.h"
#include "tools/tool.h"

#define MIB ((size_t)1 << 20)
#define STEPS 40
#define ROUND_TRIPS 200

/* --quick (the CTest smoke check): a quarter of the steps and round trips,
 * a tenth of the hot loop. */
static int steps = STEPS, round_trip_count = ROUND_TRIPS, hot_pairs = 1000000;

static char device_spec[128];

static void sleep_us(long us) {
  struct timespec t = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&t, NULL);
}

/* One process of the phases workload: writes "completed oom" to fd. */
static void phases_child(const char *conf, int seed, int fd) {
  gca_allocator_t *a = NULL;
  if (gca_open(device_spec, conf, &a) != GCA_OK) {
    fprintf(stderr, "gcalloc bench-sharing: process %d cannot open the device: %s\n", seed, gca_last_error());
    _exit(2);
  }
  unsigned s = (unsigned)seed * 2654435761u + 1;
  int completed = 0, ooms = 0;
  void *chunks[12];
  for (int step = 0; step < steps; step++) {
    int got = 0;
    bool ok = true;
    for (int i = 0; i < 12 && ok; i++) { /* 12 x 51 MiB: 60% of 1 GiB */
      chunks[got] = gca_malloc(a, 51 * MIB, 0, 0);
      ok = chunks[got] != NULL;
      got += ok;
    }
    if (ok) completed++;
    else ooms++;
    sleep_us(1000); /* the phase that needs the memory */
    for (int i = 0; i < got; i++) gca_free(a, chunks[i]);
    sleep_us(2000 + (long)((s = s * 1103515245u + 12345u) >> 16) % (2000 * 4)); /* the others' turn */
  }
  char line[64];
  int n = snprintf(line, sizeof line, "%d %d\n", completed, ooms);
  if (write(fd, line, (size_t)n) != n) _exit(3);
  gca_close(a);
  _exit(0);
}

static int run_phases(int procs, const char *conf, int *completed, int *ooms) {
  int fds[2];
  if (pipe(fds)) return -1;
  pid_t pids[8];
  for (int i = 0; i < procs; i++) {
    pids[i] = fork();
    if (pids[i] == 0) {
      close(fds[0]);
      phases_child(conf, i + 1, fds[1]);
    }
  }
  close(fds[1]);
  *completed = *ooms = 0;
  FILE *f = fdopen(fds[0], "r");
  int c, o, rc = 0;
  for (int i = 0; i < procs; i++) {
    if (!f || fscanf(f, "%d %d", &c, &o) != 2) rc = -1;
    else *completed += c, *ooms += o;
  }
  if (f) fclose(f);
  for (int i = 0; i < procs; i++) {
    int ws = 0;
    waitpid(pids[i], &ws, 0);
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
      fprintf(stderr, "gcalloc bench-sharing: process %d of %d ended with status %#x\n", i + 1, procs, ws);
      rc = -1;
    }
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

const tool_command_t bench_sharing_command = {
    "bench-sharing", NULL, "[--json] [--quick]",
    "processes on one device with and without cooperation: steps, OOMs, round trip, hot path",
    "\n"
    "2, 4 and 8 processes on one shared simulated device, alternating phases that each need 60% of it,\n"
    "with and without ipc_cooperation:True: steps completed and out of memory; the round trip of a release\n"
    "request (median and p99, microseconds); the hot path's cost with cooperation on and no pressure, as\n"
    "a ratio to off (docs/sharing.md).\n"
    "\n"
    "  --json      the figures as JSON\n"
    "  --quick     10 steps a process, 50 round trips, a shorter loop (a smoke test, not figures to quote)\n"
    "  -h, --help  this help\n",
    bench_sharing_main};

int bench_sharing_main(int argc, char **argv) {
  bool json = false, quick = false;
  const tool_option_t options[] = {
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {"--quick", OPTION_FLAG, &quick, 0, 0, NULL},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&bench_sharing_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  if (quick) {
    steps = STEPS / 4;
    round_trip_count = ROUND_TRIPS / 4;
    hot_pairs = 100000;
  }
  snprintf(device_spec, sizeof device_spec, "sim:shared=bench-%d,capacity=1GiB", (int)getpid());
  int counts[3][2][2]; /* [procs][coop][completed, ooms] */
  static const int procs[3] = {2, 4, 8};
  int rc = 0;
  for (int i = 0; i < 3; i++)
    for (int coop = 0; coop < 2; coop++)
      if (run_phases(procs[i], coop ? "ipc_cooperation:True" : NULL, &counts[i][coop][0], &counts[i][coop][1]))
        rc = 1;
  double median = 0, p99 = 0;
  int refused = 0;
  if (round_trips(&median, &p99, &refused) || refused > round_trip_count / 2) {
    fprintf(stderr, "gcalloc bench-sharing: the round trip failed: %s\n", gca_last_error());
    rc = 1;
  }
  gca_allocator_t *on = NULL, *off = NULL;
  double best_on = 1e30, best_off = 1e30;
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
  if (json) {
    printf("{\"phases\": [");
    for (int i = 0; i < 3; i++)
      printf("%s{\"processes\": %d, \"steps\": %d, \"without\": {\"completed\": %d, \"ooms\": %d}, "
             "\"with\": {\"completed\": %d, \"ooms\": %d}}",
             i ? ", " : "", procs[i], procs[i] * steps, counts[i][0][0], counts[i][0][1], counts[i][1][0],
             counts[i][1][1]);
    printf("], \"round_trip_us\": {\"median\": %.1f, \"p99\": %.1f}, \"hot_path_ns\": {\"off\": %.1f, \"on\": %.1f, "
           "\"ratio\": %.3f}, \"round_trips_refused\": %d}\n", median, p99, best_off, best_on, best_on / best_off, refused);
  } else {
    printf("processes on one 1 GiB sim device, %d steps each needing 60%% of it\n", steps);
    printf("processes   without cooperation: done / OOM     with: done / OOM\n");
    for (int i = 0; i < 3; i++)
      printf("%9d   %20d / %-6d    %8d / %-6d\n", procs[i], counts[i][0][0], counts[i][0][1], counts[i][1][0],
             counts[i][1][1]);
    printf("\nrelease request round trip (ask, peer releases 512 MiB, retry), %d times: median %.0f us, p99 %.0f us"
           " (%d not answered in time)\n", round_trip_count, median, p99, refused);
    printf("hot path, 4 KiB malloc+free, no pressure: off %.1f ns, on %.1f ns (%.3fx)\n", best_off, best_on,
           best_on / best_off);
  }
  if (rc) fprintf(stderr, "gcalloc bench-sharing: a measurement failed\n");
  return rc;
}
