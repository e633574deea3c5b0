/* `gcalloc bench-replay [--traces DIR] [--runs N] [--json] [--speed-only]`:
 * the replay's two targets on the real traces of ../shared/traces.
 *
 * Speed, end to end: reading the file, planning, replaying every device
 * with the segment matching on (what `gcalloc replay` does), best and
 * median of N runs in this process, in trace events per second; and the
 * best of N runs of `gcalloc replay --json` each in a new process, as a
 * user meets it (the tool's own clock: from opening the file to the last
 * device replayed, so not the process's start), which pays what runs in
 * one process do not: faulting in fresh memory, creating threads. The peer,
 * measured in the same run: Python's own unpickler loading the same file
 * (the first step of PyTorch's tooling, torch.cuda._memory_viz), best of N,
 * with the ratio gcalloc's whole replay / Python's load alone.
 *
 * Memory: gcalloc's peak reserved with default settings against PyTorch's
 * recorded peak reserved, per device.
 *
 * --speed-only leaves out the new processes and Python (their columns
 * print "-", JSON -1): scripts/compare-replay.sh runs it many times over,
 * alternating two builds.
 */
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/internal.h"
#include "../src/export/replay.h"
#include "../tools/tool.h"


/* Best seconds of Python's pickle.load over `runs`, or -1 without python3. */
static double python_load_seconds(const char *path, int runs) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "python3 -c \"import pickle,sys,time\n"
           "class R(pickle.Unpickler):\n"
           "    def find_class(self, m, n): raise pickle.UnpicklingError('global')\n"
           "best = 1e9\n"
           "for _ in range(%d):\n"
           "    t = time.perf_counter()\n"
           "    with open(sys.argv[1], 'rb') as f: R(f).load()\n"
           "    best = min(best, time.perf_counter() - t)\n"
           "print(best)\" '%s' 2>/dev/null",
           runs, path);
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  double s = -1;
  if (fscanf(p, "%lf", &s) != 1) s = -1;
  pclose(p);
  return s;
}

typedef struct row {
  char name[256];
  size_t events;
  double best, median, python;
  double fresh; /* best events/s of `gcalloc replay` in new processes; -1 when not measured */
  replay_result_t result;
} row_t;

/* Best end-to-end events/s that `gcalloc replay --json PATH` reports over
 * `runs` new processes, or -1 (no /proc/self/exe, or a run failed). */
static double fresh_process_rate(const char *path, int runs) {
  char self[1024];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return -1;
  self[n] = '\0';
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "'%s' replay --json '%s' 2>/dev/null", self, path);
  double best = -1;
  for (int i = 0; i < runs; i++) {
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    char buf[4096];
    size_t got = fread(buf, 1, sizeof buf - 1, p);
    buf[got] = '\0';
    if (pclose(p) != 0) return -1;
    const char *key = strstr(buf, "\"end_to_end_events_per_second\": ");
    if (!key) return -1;
    double rate = strtod(key + strlen("\"end_to_end_events_per_second\": "), NULL);
    if (rate > best) best = rate;
  }
  return best;
}

static bool is_trace(const char *name) {
  return strstr(name, ".pickle") || strstr(name, ".log") || strstr(name, ".csv") || strstr(name, ".trace");
}

static int bench_one(const char *path, const char *name, int runs, bool peers, row_t *row) {
  double *times = calloc((size_t)runs, sizeof *times);
  if (!times) return GCA_ERR_NOMEM;
  snprintf(row->name, sizeof row->name, "%s", name);
  int rc = GCA_OK;
  for (int i = 0; i < runs && rc == GCA_OK; i++) {
    double t0 = tool_seconds();
    trace_t t;
    rc = trace_load(path, &t);
    if (rc) break;
    replay_options_t o = {.device = -1, .infer_empty_cache = true, .match_segments = true};
    replay_result_t r;
    rc = replay_trace(&t, &o, &r);
    times[i] = tool_seconds() - t0;
    row->events = t.count;
    trace_free(&t);
    if (rc) break;
    if (i == 0) row->result = r;
    else replay_result_free(&r);
  }
  if (rc == GCA_OK) {
    qsort(times, (size_t)runs, sizeof *times, compare_doubles);
    row->best = times[0];
    row->median = times[runs / 2];
    row->python = peers && strstr(path, ".pickle") ? python_load_seconds(path, runs) : -1;
    row->fresh = peers ? fresh_process_rate(path, runs) : -1;
  }
  free(times);
  return rc;
}

int bench_replay_main(int argc, char **argv) {
  const char *dir = "../shared/traces";
  int runs = 10;
  bool json = false, peers = true;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--traces") && i + 1 < argc) dir = argv[++i];
    else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--json")) json = true;
    else if (!strcmp(argv[i], "--speed-only")) peers = false;
    else {
      fprintf(stderr, "usage: gcalloc bench-replay [--traces DIR] [--runs N] [--json] [--speed-only]\n");
      return 2;
    }
  }
  if (runs < 1) runs = 1;
  /* Each subdirectory of DIR holds one trace file (SOURCES.txt's layout). */
  DIR *d = opendir(dir);
  if (!d) {
    fprintf(stderr, "gcalloc bench-replay: cannot open %s\n", dir);
    return 1;
  }
  row_t rows[32];
  int n = 0, rc = 0;
  struct dirent *e;
  char names[32][256];
  int count = 0;
  while ((e = readdir(d)) && count < 32)
    if (e->d_name[0] != '.') snprintf(names[count++], sizeof names[0], "%s", e->d_name);
  closedir(d);
  qsort(names, (size_t)count, sizeof names[0], (int (*)(const void *, const void *))strcmp);
  for (int k = 0; k < count && rc == 0; k++) {
    char sub[1024];
    snprintf(sub, sizeof sub, "%s/%s", dir, names[k]);
    DIR *s = opendir(sub);
    if (!s) continue;
    while ((e = readdir(s)) && n < 32) {
      if (!is_trace(e->d_name)) continue;
      char path[2048];
      snprintf(path, sizeof path, "%s/%s", sub, e->d_name);
      memset(&rows[n], 0, sizeof rows[n]);
      if (bench_one(path, names[k], runs, peers, &rows[n]) != GCA_OK) {
        fprintf(stderr, "gcalloc bench-replay: %s: %s\n", path, gca_last_error());
        rc = 1;
        break;
      }
      n++;
    }
    closedir(s);
  }
  if (json) printf("{\"runs\": %d, \"traces\": [", runs);
  else {
    printf("replay end to end (load, plan, replay every device with segment matching), best/median of %d runs\n", runs);
    printf("%-32s %8s %9s %9s %12s %9s  %18s  %s\n", "trace", "events", "best ms", "median", "M events/s", "new proc",
           "Python load ms (x)", "peak reserved gcalloc / PyTorch, per device");
  }
  for (int i = 0; i < n; i++) {
    row_t *r = &rows[i];
    double rate = r->best > 0 ? (double)r->events / r->best : 0;
    if (json) {
      printf("%s\n {\"trace\": ", i ? "," : "");
      json_put_string(stdout, r->name);
      printf(", \"events\": %zu, \"best_seconds\": %.6f, \"median_seconds\": %.6f, \"events_per_second\": %.0f"
             ", \"new_process_events_per_second\": %.0f, \"python_load_seconds\": %.6f, \"devices\": [",
             r->events, r->best, r->median, rate, r->fresh, r->python);
      for (int k = 0; k < r->result.device_count; k++) {
        const replay_device_t *dv = &r->result.devices[k];
        printf("%s{\"device\": %d, \"peak_reserved_bytes\": %" PRIu64 ", \"recorded_peak_reserved_bytes\": %" PRId64
               ", \"seeded\": %zu}",
               k ? ", " : "", dv->device, dv->peak_reserved, dv->recorded_peak_reserved, dv->seeded);
      }
      printf("]}");
    } else {
      char python[64] = "-";
      if (r->python > 0) snprintf(python, sizeof python, "%.1f (%.2fx)", r->python * 1e3, r->best / r->python);
      char fresh[32] = "-";
      if (r->fresh > 0) snprintf(fresh, sizeof fresh, "%.2f", r->fresh / 1e6);
      printf("%-32.32s %8zu %9.2f %9.2f %12.2f %9s  %18s  ", r->name, r->events, r->best * 1e3, r->median * 1e3,
             rate / 1e6, fresh, python);
      for (int k = 0; k < r->result.device_count; k++) {
        const replay_device_t *dv = &r->result.devices[k];
        if (!dv->events) continue;
        if (dv->recorded_peak_reserved > 0)
          printf("%sdev%d %.3f", k ? ", " : "", dv->device, (double)dv->peak_reserved / (double)dv->recorded_peak_reserved);
        else
          printf("%sdev%d %.3f GiB (not recorded)", k ? ", " : "", dv->device, gib((double)dv->peak_reserved));
      }
      printf("\n");
    }
    replay_result_free(&r->result);
  }
  if (json) printf("\n]}\n");
  else if (peers)
    printf("new proc = M events/s, best of %d runs of `gcalloc replay` each in a new process (its own clock)\n"
           "(x) = gcalloc's whole replay / Python's pickle load of the same file alone, both best of %d\n",
           runs, runs);
  return rc;
}
