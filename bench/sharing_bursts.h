/* `gcalloc bench-sharing`'s bursts (sharing_bursts.c): processes on one
 * shared device under a random schedule whose live memory always fits. */
#ifndef GCALLOC_BENCH_SHARING_BURSTS_H
#define GCALLOC_BENCH_SHARING_BURSTS_H

#include <stdint.h>

/* How long a burst waits for room on the admission board before it counts as failed. */
#define BURST_ADMIT_WAIT_S 60

/* One setting: what it runs (conf, label, room, signal), then what it
 * measured (from `bursts` on: zeroed before each run). */
typedef struct burst_setting {
  const char *conf;  /* the jobs' configuration (NULL: the defaults, no cooperation) */
  const char *label;
  int room;          /* 1: a device with room for every job's cache at once (the wall time's reference) */
  int signal;        /* 0, SIGKILL or SIGSTOP: sent to one job half-way */
  int index;
  int64_t bursts, failed, ooms, avoidable, requests, rounds, allocations;
  int64_t admit_timeouts, errors; /* bursts failed by a wait for admission that ran out; allocations refused
                                     with an error other than out of memory */
  int64_t live_preventable; /* out-of-memory errors the live peers' cache could have prevented: all of them,
                               but while a peer is stopped, those where the others' live memory and
                               everything the stopped one reserved fit the device */
  double malloc_p99_ms, trip_p50_ms, trip_p99_ms, wall_s;
  char first_error[256];          /* the first of those errors */
} burst_setting_t;

/* Run `count` settings of `bursts` bursts per job (a SIGSTOP lasts
 * `stop_ms`); 0, or -1 when a job failed. */
int bench_sharing_bursts(burst_setting_t *sets, int count, int bursts, int stop_ms);

#endif
