/* `gcalloc bench-replay [--traces DIR] [--runs N] [--json] [--speed-only]`:
 * the replay's two targets on a folder of traces (the sample snapshots of
 * data/snapshots by default; real PyTorch jobs' snapshots with --traces).
 *
 * Speed, end to end: reading the file, planning, replaying every device
 * with the segment matching and the page census at the peak on (what
 * `gcalloc replay` does without --report), best and
 * median of N runs in this process, in trace events per second; and the
 * best of N runs of `gcalloc replay --json` each in a new process, as a
 * user meets it (the tool's own clock: from opening the file to the last
 * device replayed, so not the process's start), which pays what runs in
 * one process do not: faulting in fresh memory, creating threads; with the
 * fewest page faults one took, and what a page fault costs on the machine
 * (measured here), to tell the kernel's share. The peer,
 * measured in the same run: Python's own unpickler loading the same file
 * (the first step of PyTorch's tooling, torch.cuda._memory_viz), best of N,
 * with the ratio gcalloc's whole replay / Python's load alone. And the
 * floor of a new process: what one pays at the least before any work,
 * mapping the file and reading each of its pages, and writing the events'
 * array in fresh memory; the target's budget less that floor is the time
 * left for the work itself, to set beside the best run in one process.
 *
 * Memory: gcalloc's peak reserved with default settings against PyTorch's
 * recorded peak reserved, per device.
 *
 * --speed-only leaves out the new processes and Python (their columns
 * print "-", JSON -1): scripts/compare-replay.sh runs it many times over,
 * alternating two builds.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "base/base.h"
#include "backends/sim_driver.h"
#include "replay/replay.h"
#include "tools/tool.h"


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

#define TARGET_EVENTS_PER_SECOND 5e6 /* the reference rate that sets each trace's budget */

typedef struct row {
  char name[256];
  size_t events;
  double best, median, python;
  double fresh; /* best events/s of `gcalloc replay` in new processes; -1 when not measured */
  double idle;  /* median events/s of those run after idle (--idle); -1 when not measured */
  long fresh_faults; /* the fewest page faults one of them took; -1 when not measured */
  double floor;      /* best seconds of the new-process floor (new_process_floor); -1 when not measured */
  replay_result_t result;
} row_t;

/* One `gcalloc replay --json PATH` in a new process (`self`): the
 * end-to-end events/s it reports and the page faults it took (its own,
 * from wait4: the kernel mapping a page of memory or of the file for it
 * the first time it was touched). False when it cannot be measured (a
 * run that failed). */
static bool spawn_replay(const char *self, const char *path, double *rate, long *faults) {
  char *args[] = {(char *)self, "replay", "--json", (char *)path, NULL};
  int out[2];
  if (pipe(out) != 0) return false;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid;
  int spawned = posix_spawn(&pid, self, &actions, NULL, args, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(out[1]);
  char buf[16384]; /* (the JSON of a few devices: a new process that wrote more would fail on the closed pipe) */
  size_t got = 0;
  for (ssize_t r; spawned == 0 && got < sizeof buf - 1 && (r = read(out[0], buf + got, sizeof buf - 1 - got)) != 0;)
    if (r > 0) got += (size_t)r;
    else if (errno != EINTR) break;
  buf[got] = '\0';
  close(out[0]);
  if (spawned != 0) return false;
  int status;
  struct rusage usage;
  while (wait4(pid, &status, 0, &usage) < 0)
    if (errno != EINTR) return false;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return false;
  const char *key = strstr(buf, "\"end_to_end_events_per_second\": ");
  if (!key) return false;
  *rate = strtod(key + strlen("\"end_to_end_events_per_second\": "), NULL);
  *faults = usage.ru_minflt;
  return true;
}

/* `runs` new processes back to back: the best events/s and the fewest
 * page faults one took; then, with idle_s > 0, IDLE_RUNS more, each after
 * idle_s seconds of sleep (a process run once, whose fresh memory a
 * virtual machine's host may have taken back meanwhile): their median
 * events/s. -1 each
 * where it cannot be measured (no /proc/self/exe, a run that failed). */
#define IDLE_RUNS 3
static void fresh_processes(const char *path, int runs, double idle_s, double *best_rate, long *fewest_faults,
                            double *idle_rate) {
  *best_rate = *idle_rate = -1;
  *fewest_faults = -1;
  char self[1024];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  double best = -1, rate;
  long fewest = -1, faults;
  for (int i = 0; i < runs; i++) {
    if (!spawn_replay(self, path, &rate, &faults)) return;
    if (rate > best) best = rate;
    if (fewest < 0 || faults < fewest) fewest = faults;
  }
  *best_rate = best;
  *fewest_faults = fewest;
  if (idle_s <= 0) return;
  double rates[IDLE_RUNS];
  for (int i = 0; i < IDLE_RUNS; i++) {
    struct timespec pause = {(time_t)idle_s, (long)((idle_s - (double)(time_t)idle_s) * 1e9)};
    while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
    }
    if (!spawn_replay(self, path, &rates[i], &faults)) return;
  }
  qsort(rates, IDLE_RUNS, sizeof *rates, compare_doubles);
  *idle_rate = rates[IDLE_RUNS / 2];
}

/* The floor's steps: open the file, map it and read one byte of each of
 * its first `file_bytes` (all of it when larger), and write `array_bytes`
 * of fresh anonymous memory page by page. Nothing is unmapped: the child
 * that calls it exits. */
static bool floor_steps(const char *path, size_t file_bytes, size_t array_bytes) {
  int fd = open(path, O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || st.st_size <= 0) return false;
  if (file_bytes > (size_t)st.st_size) file_bytes = (size_t)st.st_size;
  const volatile unsigned char *file = mmap(NULL, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  volatile unsigned char *array =
      array_bytes ? mmap(NULL, array_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) : NULL;
  if (file == MAP_FAILED || array == MAP_FAILED) return false;
  unsigned char sum = 0;
  for (size_t at = 0; at < file_bytes; at += 4096) sum = (unsigned char)(sum + file[at]);
  for (size_t at = 0; at < array_bytes; at += 4096) array[at] = sum;
  return true;
}

/* The least a replay in a new process pays before any work, in a child
 * forked for it (its own fresh pages): from opening the file, mapping it
 * and reading one byte of each of its pages (the kernel mapping the page
 * cache's pages for it), and writing an events' array of `events` in
 * fresh anonymous memory, as `gcalloc replay` must at the least (its
 * events are 32 bytes, trace.h; the arena, the memo, the simulator's
 * state and the code's own pages come on top). Seconds, or -1 where it
 * cannot be measured. The child calls only what is safe after a fork
 * from a process with threads. */
static double floor_once(const char *path, size_t events) {
  int out[2];
  if (pipe(out) != 0) return -1;
  pid_t pid = fork();
  if (pid < 0) {
    close(out[0]), close(out[1]);
    return -1;
  }
  if (pid == 0) {
    /* The same steps once on a page each, untimed: a forked child faults
     * in the code it runs and the stack it writes (copied on write), which
     * a new process's replay does before it opens the file; with them
     * left, this is a floor that a replay could never go under. */
    double seconds = -1;
    struct timespec t0, t1;
    if (floor_steps(path, 4096, 4096)) {
      clock_gettime(CLOCK_MONOTONIC, &t0);
      if (floor_steps(path, SIZE_MAX, events * sizeof(trace_event_t))) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
      }
    }
    ssize_t wrote = write(out[1], &seconds, sizeof seconds);
    _exit(wrote == (ssize_t)sizeof seconds ? 0 : 1);
  }
  close(out[1]);
  double seconds = -1;
  ssize_t got;
  while ((got = read(out[0], &seconds, sizeof seconds)) < 0 && errno == EINTR) {
  }
  if (got != (ssize_t)sizeof seconds) seconds = -1;
  close(out[0]);
  int status;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? seconds : -1;
}

static double new_process_floor(const char *path, size_t events, int runs) {
  double best = -1;
  for (int i = 0; i < runs; i++) {
    double s = floor_once(path, events);
    if (s < 0) return -1;
    if (best < 0 || s < best) best = s;
  }
  return best;
}

/* What fresh memory costs on this host, which a new process pays and
 * runs in one process mostly do not: microseconds to fault in a 4 KiB
 * page (touching 8 MiB page by page, huge pages refused) and a 2 MiB huge
 * page (the same where the kernel gives huge pages), best of 5; -1 where
 * it cannot be measured. */
static void fresh_memory_cost(double *page_us, double *huge_us) {
  *page_us = *huge_us = -1;
#if defined(__linux__) && defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
  const size_t bytes = (size_t)8 << 20, huge = (size_t)2 << 20, page = 4096;
  for (int round = 0; round < 5; round++) {
    for (int kind = 0; kind < 2; kind++) {
      char *raw = mmap(NULL, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED) return;
      char *p = (char *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
      if (madvise(p, bytes, kind ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) == 0) {
        double t0 = tool_seconds();
        for (size_t at = 0; at < bytes; at += page) ((volatile char *)p)[at] = 1;
        double us = (tool_seconds() - t0) * 1e6 / (double)(bytes / (kind ? huge : page));
        double *best = kind ? huge_us : page_us;
        if (*best < 0 || us < *best) *best = us;
      }
      munmap(raw, bytes + huge);
    }
  }
#endif
}

static bool is_trace(const char *name) {
  return strstr(name, ".pickle") || strstr(name, ".log") || strstr(name, ".csv") || strstr(name, ".trace");
}

static int bench_one(const char *path, const char *name, int runs, bool peers, double idle_s, row_t *row) {
  double *times = calloc((size_t)runs, sizeof *times);
  if (!times) return GCA_ERR_NOMEM;
  snprintf(row->name, sizeof row->name, "%.*s", (int)sizeof row->name - 1, name);
  int rc = GCA_OK;
  for (int i = 0; i < runs && rc == GCA_OK; i++) {
    double t0 = tool_seconds();
    trace_t t;
    rc = trace_load(path, &t);
    if (rc) break;
    /* The options `gcalloc replay` runs with (tools/replay.c), the page
     * census at the peak included. */
    replay_options_t o = {.device = -1, .infer_empty_cache = true, .match_segments = true, .page_census = true};
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
    row->fresh = row->idle = row->fresh_faults = row->floor = -1;
    if (peers) {
      fresh_processes(path, runs, idle_s, &row->fresh, &row->fresh_faults, &row->idle);
      row->floor = new_process_floor(path, row->events, runs);
    }
  }
  free(times);
  return rc;
}

const tool_command_t bench_replay_command = {
    "bench-replay", NULL, "[--traces DIR] [--runs N] [--json] [--speed-only] [--idle SECONDS]",
    "replay speed end to end and peak reserved against PyTorch on a folder of traces",
    "\n"
    "The replay's targets on every real trace: its speed end to end (load, plan, replay of every device),\n"
    "best and median of N runs in this process and the best of N new processes of `gcalloc replay`,\n"
    "with the least a new process pays before any work and the room the 5 M events/s budget leaves past it,\n"
    "against Python's unpickler loading the same file; and gcalloc's peak reserved against PyTorch's\n"
    "recorded one, per device (docs/replay.md, \"Speed\").\n"
    "\n"
    "  --traces DIR     the folder of traces, one folder each (default: the sample snapshots,\n"
    "                   data/snapshots)\n"
    "  --runs N         runs of each kind per trace, 1 to 1000000 (default 10)\n"
    "  --json           the figures as JSON\n"
    "  --speed-only     leave out the new processes and Python (scripts/compare-replay.sh's mode)\n"
    "  --idle SECONDS   also time a few new processes each run after that long idle, 0 to 3600\n"
    "                   (default 0: none)\n"
    "  -h, --help       this help\n",
    bench_replay_main};

int bench_replay_main(int argc, char **argv) {
  const char *dir = NULL;
  long runs_given = 10;
  bool json = false, speed_only = false;
  double idle_s = 0;
  const tool_option_t options[] = {
      {"--traces", OPTION_TEXT, &dir, 0, 0, "DIR"},
      {"--runs", OPTION_NUMBER, &runs_given, 1, 1000000, "N"},
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {"--speed-only", OPTION_FLAG, &speed_only, 0, 0, NULL},
      {"--idle", OPTION_SECONDS, &idle_s, 0, 3600, "SECONDS"},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&bench_replay_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  if (!dir && !(dir = tool_samples_dir())) {
    fprintf(stderr, "gcalloc bench-replay: no sample snapshots here (data/snapshots): name a folder of traces "
                    "with --traces DIR\n");
    return 2;
  }
  int runs = (int)runs_given;
  bool peers = !speed_only;
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
    if ((size_t)snprintf(sub, sizeof sub, "%s/%s", dir, names[k]) >= sizeof sub) {
      fprintf(stderr, "gcalloc bench-replay: the path %s/%s is too long\n", dir, names[k]);
      rc = 1;
      break;
    }
    DIR *s = opendir(sub);
    if (!s) continue;
    while ((e = readdir(s)) && n < 32) {
      if (!is_trace(e->d_name)) continue;
      char path[2048];
      if ((size_t)snprintf(path, sizeof path, "%s/%s", sub, e->d_name) >= sizeof path) {
        fprintf(stderr, "gcalloc bench-replay: the path %s/%s is too long\n", sub, e->d_name);
        rc = 1;
        break;
      }
      memset(&rows[n], 0, sizeof rows[n]);
      if (bench_one(path, names[k], runs, peers, idle_s, &rows[n]) != GCA_OK) {
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
    printf("%-32s %8s %9s %9s %12s %16s%s %14s  %18s  %s\n", "trace", "events", "best ms", "median", "M events/s",
           "new proc (faults)", idle_s > 0 && peers ? "  after idle" : "", "floor/room ms", "Python load ms (x)",
           "peak reserved gcalloc / PyTorch, per device");
  }
  for (int i = 0; i < n; i++) {
    row_t *r = &rows[i];
    double rate = r->best > 0 ? (double)r->events / r->best : 0;
    if (json) {
      printf("%s\n {\"trace\": ", i ? "," : "");
      gca__json_string(stdout, r->name);
      printf(", \"events\": %zu, \"best_seconds\": %.6f, \"median_seconds\": %.6f, \"events_per_second\": %.0f"
             ", \"new_process_events_per_second\": %.0f, \"new_process_page_faults\": %ld"
             ", \"after_idle_events_per_second\": %.0f, \"new_process_floor_seconds\": %.6f"
             ", \"target_seconds\": %.6f, \"python_load_seconds\": %.6f, \"devices\": [",
             r->events, r->best, r->median, rate, r->fresh, r->fresh_faults, r->idle, r->floor,
             (double)r->events / TARGET_EVENTS_PER_SECOND, r->python);
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
      if (r->fresh > 0) snprintf(fresh, sizeof fresh, "%.2f (%ld)", r->fresh / 1e6, r->fresh_faults);
      char idle[32] = "";
      if (idle_s > 0 && peers) snprintf(idle, sizeof idle, "  %10s", "-");
      if (r->idle > 0) snprintf(idle, sizeof idle, "  %10.2f", r->idle / 1e6);
      char floor[32] = "-";
      if (r->floor > 0)
        snprintf(floor, sizeof floor, "%.2f/%.2f", r->floor * 1e3,
                 ((double)r->events / TARGET_EVENTS_PER_SECOND - r->floor) * 1e3);
      printf("%-32.32s %8zu %9.2f %9.2f %12.2f %16s%s %14s  %18s  ", r->name, r->events, r->best * 1e3,
             r->median * 1e3, rate / 1e6, fresh, idle, floor, python);
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
  double page_us = -1, huge_us = -1;
  if (peers) fresh_memory_cost(&page_us, &huge_us);
  if (json) printf("\n], \"fresh_page_fault_us\": %.3f, \"fresh_huge_page_fault_us\": %.1f}\n", page_us, huge_us);
  else if (peers) {
    printf("new proc = M events/s, best of %d runs of `gcalloc replay` each in a new process (its own clock),\n"
           "  back to back (a process run once after idle: --idle SECONDS, or IDLE=4 NEW_PROCESS=1 scripts/compare-replay.sh);\n"
           "  faults = the fewest page faults one of them took: memory and file pages, a huge page counting one,\n"
           "  those a helper took ahead of the replaying thread (tools/replay.c, heap_warm) included\n"
           "floor = ms a new process pays at the least before any work, best of %d: mapping the file and reading\n"
           "  each of its pages, writing the events' array in fresh memory; room = the target's budget (events at\n"
           "  5 M/s) less the floor: what is left for the work, to set beside the best ms in one process\n"
           "(x) = gcalloc's whole replay / Python's pickle load of the same file alone, both best of %d\n",
           runs, runs, runs);
    if (idle_s > 0)
      printf("after idle = M events/s, median of %d runs of `gcalloc replay` each in a new process after %g s idle\n",
             IDLE_RUNS, idle_s);
    if (page_us >= 0 && huge_us >= 0)
      printf("fresh memory on this host, best of 5: %.2f us to fault in a 4 KiB page, %.0f us a 2 MiB huge page\n",
             page_us, huge_us);
  }
  return rc;
}
