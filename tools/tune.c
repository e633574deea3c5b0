/* `gcalloc tune TRACE [--capacity SIZE] [--device N] [--json]`: which
 * settings make a recorded job reserve the least? Replays the trace on the
 * simulated device under every combination of
 *
 *   max_split_size_mb          unset, 32, 64, 128, 256, 512, 1024
 *   roundup_power2_divisions   unset, 1, 2, 4, 8, 16
 *   garbage_collection_threshold  unset, 0.5, 0.7, 0.9   (only with --capacity:
 *                              it acts only under a memory limit, which here is
 *                              per_process_memory_fraction:1.0 of the capacity)
 *   cross_stream_reuse         False, True   (only when the trace has several streams)
 *   expandable_segments        False, True, True with stitching
 *
 * and ranks them by peak reserved bytes (summed over the trace's devices),
 * then by device allocations (each a cudaMalloc), then by the shortest
 * configuration string. With --capacity, a configuration under which the job
 * does not fit ranks below every one under which it does, and among those
 * that do not, the one that got furthest (operations replayed before the
 * out-of-memory) ranks first: the peak of a replay that stopped says
 * nothing of what the job needs. The answers (one for gcalloc, one of
 * PyTorch's keys alone) are never worse than the defaults, and take the
 * setting with the fewest keys among those within 0.5% of the best. The
 * trace is planned once (replay_plan), and the settings are replayed on
 * every processor at once (evaluate_all).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backends/sim_driver.h"
#include "base/base.h"
#include "backends/sim_driver.h"
#include "replay/replay.h"
#include "tool.h"

typedef struct candidate {
  char conf[256];
  uint64_t peak_reserved;  /* summed over devices */
  uint64_t peak_requested;
  uint64_t device_allocs;
  uint64_t replayed;       /* operations replayed, over devices: up to the out-of-memory where one stopped */
  uint64_t largest_peak, largest_bound; /* the largest device's peak reserved and lower bound */
  bool fits;
} candidate_t;

/* Within this fraction of the best peak, fewer keys win (a shorter
 * configuration is easier to keep, and a gain this small is noise between
 * jobs). */
#define FEWER_KEYS_WITHIN 0.005

static int rank(const void *x, const void *y) {
  const candidate_t *a = x, *b = y;
  if (a->fits != b->fits) return a->fits ? -1 : 1;
  if (!a->fits && a->replayed != b->replayed) return a->replayed > b->replayed ? -1 : 1;
  if (a->peak_reserved != b->peak_reserved) return a->peak_reserved < b->peak_reserved ? -1 : 1;
  if (a->device_allocs != b->device_allocs) return a->device_allocs < b->device_allocs ? -1 : 1;
  size_t la = strlen(a->conf), lb = strlen(b->conf);
  return la != lb ? (la < lb ? -1 : 1) : strcmp(a->conf, b->conf);
}


static int evaluate(const trace_t *t, const replay_options_t *base, candidate_t *c) {
  replay_options_t o = *base;
  o.conf = c->conf;
  replay_result_t r;
  int rc = replay_trace(t, &o, &r);
  if (rc) return rc;
  c->fits = true;
  for (int i = 0; i < r.device_count; i++) {
    c->peak_reserved += r.devices[i].peak_reserved;
    c->peak_requested += r.devices[i].peak_requested;
    c->device_allocs += r.devices[i].device_allocs;
    c->replayed += r.devices[i].events;
    c->fits &= !r.devices[i].oom;
    if (r.devices[i].peak_reserved > c->largest_peak) c->largest_peak = r.devices[i].peak_reserved;
    if (r.devices[i].bound_reserved > c->largest_bound) c->largest_bound = r.devices[i].bound_reserved;
  }
  replay_result_free(&r);
  return GCA_OK;
}

/* The candidates are replayed on every processor at once, each replay on
 * one thread (its devices one after another): a replay shares nothing but
 * the trace, which it only reads, and its result does not depend on the
 * order, so the ranking is the same with one worker or sixteen. At most
 * TUNE_WORKERS, each holding one replay's memory at a time. */
#define TUNE_WORKERS 16

typedef struct tune_jobs {
  const trace_t *t;
  const replay_options_t *base;
  candidate_t *c;
  size_t count;
  atomic_size_t next, done;
  atomic_bool failed;
  pthread_mutex_t lock; /* the first failure's message */
  size_t failed_at;     /* the failing candidate first in order */
  int status;
  char message[1024];
} tune_jobs_t;

/* Candidates until none is left, or one failed; the calling thread shows
 * the progress on its way (`progress` NULL on the others). */
static void evaluate_some(tune_jobs_t *j, tool_progress_t *progress) {
  for (;;) {
    size_t i = atomic_fetch_add(&j->next, 1);
    if (i >= j->count || atomic_load(&j->failed)) return;
    int rc = evaluate(j->t, j->base, &j->c[i]);
    if (rc != GCA_OK) {
      pthread_mutex_lock(&j->lock);
      if (!atomic_load(&j->failed) || i < j->failed_at) {
        j->failed_at = i;
        j->status = rc;
        snprintf(j->message, sizeof j->message, "%s", gca_last_error());
      }
      atomic_store(&j->failed, true);
      pthread_mutex_unlock(&j->lock);
      return;
    }
    size_t done = atomic_fetch_add(&j->done, 1) + 1;
    if (progress) tool_progress_show(progress, "tuning (%zu of %zu settings replayed", done, j->count);
  }
}

static void *tune_worker(void *arg) {
  evaluate_some(arg, NULL);
  return NULL;
}

/* Every candidate's figures; GCA_OK, or the error of the first candidate
 * (in their order) that failed, set on this thread. */
static int evaluate_all(const trace_t *t, const replay_options_t *base, candidate_t *c, size_t count,
                        tool_progress_t *progress) {
  replay_options_t one_thread = *base;
  one_thread.threads = 1;
  tune_jobs_t j = {.t = t, .base = &one_thread, .c = c, .count = count, .status = GCA_OK};
  atomic_init(&j.next, 0);
  atomic_init(&j.done, 0);
  atomic_init(&j.failed, false);
  pthread_mutex_init(&j.lock, NULL);
  long online = gca__processors_usable();
  size_t workers = online < 1 ? 1 : online > TUNE_WORKERS ? TUNE_WORKERS : (size_t)online;
  if (workers > count) workers = count ? count : 1;
  pthread_t threads[TUNE_WORKERS];
  size_t started = 0;
  /* (A thread that cannot start leaves its share to the others.) */
  while (started + 1 < workers && pthread_create(&threads[started], NULL, tune_worker, &j) == 0) started++;
  evaluate_some(&j, progress);
  for (size_t i = 0; i < started; i++) pthread_join(threads[i], NULL);
  pthread_mutex_destroy(&j.lock);
  if (atomic_load(&j.failed)) return gca__set_error(j.status, "%s", j.message);
  return GCA_OK;
}

static bool several_streams(const trace_t *t) {
  for (size_t i = 1; i < t->count; i++)
    if (t->events[i].stream != t->events[0].stream) return true; /* (numbers: one each) */
  return false;
}

static void put(char *buf, size_t cap, const char *item) {
  size_t n = strlen(buf);
  snprintf(buf + n, cap - n, "%s%s", n ? "," : "", item);
}

/* Keys only gcalloc reads: PyTorch's parser refuses a configuration that
 * names one, and the rest of such a configuration may do worse alone. */
static bool pytorch_keys_only(const char *conf) {
  return !strstr(conf, "stitching") && !strstr(conf, "cross_stream_reuse") &&
         !strstr(conf, "per_process_memory_fraction");
}

/* Better than the defaults: fits where they do not, or fits as they do
 * and reserves less. A setting under which the job does not fit beats
 * nothing, whatever it reserved before it stopped. */
static bool beats(const candidate_t *c, const candidate_t *defaults) {
  if (!c->fits) return false;
  return !defaults->fits || c->peak_reserved < defaults->peak_reserved;
}

static int keys_of(const char *conf) {
  int n = *conf != 0;
  for (const char *p = conf; *p; p++) n += *p == ',';
  return n;
}

/* The answer among the ranked candidates `c` (those of PyTorch's keys
 * alone, with `torch_only`): the best one that fits, or with the fewest keys
 * among those within FEWER_KEYS_WITHIN of its peak; NULL when none fits or
 * it does not beat the defaults. */
static const candidate_t *answer(const candidate_t *c, size_t n, bool torch_only, const candidate_t *defaults) {
  const candidate_t *best = NULL;
  for (size_t i = 0; i < n && !best; i++)
    if (c[i].fits && (!torch_only || pytorch_keys_only(c[i].conf))) best = &c[i];
  if (!best) return NULL;
  const candidate_t *pick = best;
  double within = (double)best->peak_reserved * (1.0 + FEWER_KEYS_WITHIN);
  for (size_t i = 0; i < n && (double)c[i].peak_reserved <= within; i++)
    if (c[i].fits && (!torch_only || pytorch_keys_only(c[i].conf)) && keys_of(c[i].conf) < keys_of(pick->conf))
      pick = &c[i];
  return beats(pick, defaults) ? pick : NULL;
}

static double below(const candidate_t *c, const candidate_t *defaults) {
  return defaults->peak_reserved ? 100.0 * (1.0 - (double)c->peak_reserved / (double)defaults->peak_reserved) : 0;
}

/* What to paste, never worse than the defaults: the best for gcalloc
 * (GCALLOC_ALLOC_CONF when it has gcalloc's own keys), and the best of
 * PyTorch's keys alone for PyTorch's own allocator, replayed as it is. */
static void advise(const candidate_t *best, const candidate_t *torch_best, const candidate_t *defaults,
                   uint64_t capacity) {
  if (!best) {
    printf("\nbest: the defaults; no setting searched reserves less by more than %.1f%% with fewer keys, so there "
           "is nothing to set\n", 100 * FEWER_KEYS_WITHIN);
    return;
  }
  /* (where the defaults do not fit, their peak is that of a replay that
   * stopped: nothing to compare with) */
  char b1[64], b2[64];
  if (defaults->fits) {
    snprintf(b1, sizeof b1, ", %.1f%% below the defaults", below(best, defaults));
    snprintf(b2, sizeof b2, ", %.1f%% below the defaults", torch_best ? below(torch_best, defaults) : 0.0);
  } else {
    snprintf(b1, sizeof b1, " (the defaults do not fit)");
    snprintf(b2, sizeof b2, " (the defaults do not fit)");
  }
  if (pytorch_keys_only(best->conf)) {
    printf("\nbest: %.3f GiB reserved%s, with keys PyTorch's allocator reads too; paste:\nPYTORCH_CUDA_ALLOC_CONF=%s\n",
           gib(best->peak_reserved), b1, best->conf);
    return;
  }
  printf("\nbest with gcalloc: %.3f GiB reserved%s; paste:\nGCALLOC_ALLOC_CONF=%s\n", gib(best->peak_reserved), b1,
         best->conf);
  if (torch_best)
    printf("\nbest with PyTorch's own allocator (its keys only, replayed alone): %.3f GiB reserved%s; paste:\n"
           "PYTORCH_CUDA_ALLOC_CONF=%s\n", gib(torch_best->peak_reserved), b2, torch_best->conf);
  else if (defaults->fits)
    printf("\nwith PyTorch's own allocator: no setting of its keys searched beats the defaults; keep them\n");
  else
    printf("\nwith PyTorch's own allocator: neither the defaults nor any setting of its keys searched fits in %.3f "
           "GiB; the job needs gcalloc with the setting above, or a larger device (--min-capacity gives the "
           "smallest for each)\n", gib(capacity));
}

/* Nothing searched fits: how far the furthest got, and what it needs
 * without a limit (`unlimited`, replayed so; 0: unknown). */
static void say_nothing_fits(const candidate_t *furthest, const candidate_t *defaults, const candidate_t *unlimited,
                             uint64_t capacity) {
  printf("\nnothing searched fits in %.3f GiB: the furthest, %s, stops after %" PRIu64 " operations", gib(capacity),
         furthest->conf[0] ? furthest->conf : "the defaults", furthest->replayed);
  if (unlimited) printf(" of %" PRIu64, unlimited->replayed);
  printf(" (the defaults after %" PRIu64 ")\n", defaults->replayed);
  if (unlimited && unlimited->peak_reserved > capacity)
    printf("without a limit it reserves %.3f GiB at its peak: the capacity is %.3f GiB short of that (it may fit in "
           "somewhat less, where the allocator gives its cache back and tries again)\n",
           gib(unlimited->peak_reserved), gib(unlimited->peak_reserved - capacity));
}

/* ---- the smallest device (--min-capacity) ------------------------------ */

#define CAPACITY_STEP ((uint64_t)2 << 20) /* the device's granularity */
#define MONOTONE_CHECKS 8

typedef struct smallest {
  const char *what;
  char conf[256];
  uint64_t capacity;      /* the least on which it fits (0: it fits on none searched) */
  uint64_t unlimited;     /* its peak reserved without a limit */
  bool monotone;          /* fits on every capacity checked above it */
  uint64_t broken_at;     /* else where it did not */
} smallest_t;

static bool fits_on(const trace_t *t, const replay_options_t *base, const char *conf, uint64_t capacity) {
  replay_options_t o = *base;
  o.capacity = capacity;
  candidate_t c = {0};
  snprintf(c.conf, sizeof c.conf, "%s", conf);
  return evaluate(t, &o, &c) == GCA_OK && c.fits;
}

/* The least capacity, a multiple of CAPACITY_STEP, on which the job fits
 * under candidate c (replayed without a limit; a capacity is every
 * device's, so its largest device counts): bisection between the lower
 * bound (nothing fits below it) and c's largest peak (where it fits: a
 * replay that never reaches the capacity does what it does without one).
 * The bisection relies on "fits on capacity" growing with the capacity;
 * that is checked on the step below the answer (by the bisection) and on
 * MONOTONE_CHECKS capacities spread between the answer and the unlimited
 * peak. (It can fail: a smaller device makes the allocator give its cache
 * back sooner, which can leave it less fragmented later.) */
static int find_smallest(const trace_t *t, const replay_options_t *base, const candidate_t *c, uint64_t bound,
                         smallest_t *s) {
  snprintf(s->conf, sizeof s->conf, "%s", c->conf);
  s->unlimited = c->largest_peak;
  uint64_t hi = (s->unlimited + CAPACITY_STEP - 1) / CAPACITY_STEP * CAPACITY_STEP;
  uint64_t lo = bound / CAPACITY_STEP * CAPACITY_STEP; /* (below the bound nothing fits) */
  if (lo) lo -= CAPACITY_STEP;
  if (!fits_on(t, base, s->conf, hi)) return gca__set_error(GCA_ERR_INVALID, "%s does not fit on its own peak, %" PRIu64
                                                           " bytes", s->conf[0] ? s->conf : "the defaults", hi);
  while (hi - lo > CAPACITY_STEP) {
    uint64_t mid = lo + (hi - lo) / 2 / CAPACITY_STEP * CAPACITY_STEP;
    if (fits_on(t, base, s->conf, mid)) hi = mid;
    else lo = mid;
  }
  s->capacity = hi;
  s->monotone = true;
  for (int k = 1; k <= MONOTONE_CHECKS && s->monotone; k++) {
    uint64_t at = hi + (s->unlimited > hi ? (s->unlimited - hi) * (uint64_t)k / MONOTONE_CHECKS : 0);
    at = (at + CAPACITY_STEP - 1) / CAPACITY_STEP * CAPACITY_STEP;
    if (!fits_on(t, base, s->conf, at)) s->monotone = false, s->broken_at = at;
  }
  return GCA_OK;
}

/* The least capacity on which any of the n candidates fits, and which:
 * from the least of `known` (already bisected), each other candidate is
 * tried one step below the least found so far, and bisected down from
 * there where it fits (a candidate that does not costs one replay). The
 * answers above are bisected for their own settings: one that reserves
 * least without a limit need not be the one that fits the smallest device. */
static void find_least_any(const trace_t *t, const replay_options_t *base, const candidate_t *c, size_t n,
                           uint64_t bound, const smallest_t *known, int known_n, smallest_t *out) {
  *out = known[0];
  for (int i = 1; i < known_n; i++)
    if (known[i].capacity < out->capacity) *out = known[i];
  out->what = "any setting";
  uint64_t bottom = bound / CAPACITY_STEP * CAPACITY_STEP;
  for (size_t i = 0; i < n && out->capacity >= bound + CAPACITY_STEP; i++) {
    bool seen = false;
    for (int k = 0; k < known_n && !seen; k++) seen = strcmp(c[i].conf, known[k].conf) == 0;
    uint64_t hi = out->capacity - CAPACITY_STEP;
    if (seen || !fits_on(t, base, c[i].conf, hi)) continue;
    uint64_t lo = bottom ? bottom - CAPACITY_STEP : 0; /* (below the bound nothing fits) */
    while (hi - lo > CAPACITY_STEP) {
      uint64_t mid = lo + (hi - lo) / 2 / CAPACITY_STEP * CAPACITY_STEP;
      if (fits_on(t, base, c[i].conf, mid)) hi = mid;
      else lo = mid;
    }
    snprintf(out->conf, sizeof out->conf, "%s", c[i].conf);
    out->capacity = hi;
    out->unlimited = c[i].largest_peak;
    out->monotone = true;
  }
}

/* The smallest device for the defaults, the two answers, and any setting
 * searched (the n candidates). */
static int print_smallest(const trace_t *t, const replay_options_t *base, const char *path,
                          const candidate_t *defaults, const candidate_t *best, const candidate_t *torch_best,
                          const candidate_t *c, size_t n, bool json) {
  smallest_t s[4] = {{.what = "defaults"}, {.what = "PyTorch's best"}, {.what = "gcalloc's best"}};
  if (!torch_best) torch_best = defaults;
  const candidate_t *which[3] = {defaults, torch_best, best ? best : torch_best};
  uint64_t bound = defaults->largest_bound; /* (the same for every setting) */
  for (int i = 0; i < 3; i++) {
    /* (an answer that is the defaults, or the other answer, has its bisection already) */
    int same = -1;
    for (int j = 0; j < i && same < 0; j++)
      if (which[j] == which[i]) same = j;
    if (same >= 0) {
      const char *what = s[i].what;
      s[i] = s[same];
      s[i].what = what;
      continue;
    }
    int rc = find_smallest(t, base, which[i], bound, &s[i]);
    if (rc != GCA_OK) {
      fprintf(stderr, "gcalloc tune: %s: %s\n", path, gca_last_error());
      return 1;
    }
  }
  find_least_any(t, base, c, n, bound, s, 3, &s[3]);
  if (json) { /* (inside tune's JSON object) */
    printf(", \"min_capacity\": {\"bound_reserved_bytes\": %" PRIu64 ", \"step_bytes\": %" PRIu64 ", \"smallest\": [",
           bound, CAPACITY_STEP);
    for (int i = 0; i < 4; i++) {
      printf("%s\n  {\"what\": \"%s\", \"conf\": ", i ? "," : "", s[i].what);
      gca__json_string(stdout, s[i].conf);
      printf(", \"capacity_bytes\": %" PRIu64 ", \"unlimited_peak_reserved_bytes\": %" PRIu64 ", \"monotone\": %s",
             s[i].capacity, s[i].unlimited, s[i].monotone ? "true" : "false");
      if (!s[i].monotone) printf(", \"does_not_fit_at_bytes\": %" PRIu64, s[i].broken_at);
      printf("}");
    }
    printf("\n]}");
  } else {
    printf("the smallest device %s fits on (to %" PRIu64 " MiB; bisection between the lower bound and each "
           "setting's peak without a limit%s):\n", path, CAPACITY_STEP >> 20,
           t->device_count > 1 ? "; each device of the trace gets that much" : "");
    for (int i = 0; i < 4; i++) {
      printf("  %-15s %10.3f GiB  (%.3f GiB without a limit)  %s\n", s[i].what, gib(s[i].capacity),
             gib(s[i].unlimited), s[i].conf[0] ? s[i].conf : "(defaults)");
      if (!s[i].monotone)
        printf("    but it does not fit on %.3f GiB, above that: fitting does not grow with the capacity here, so "
               "read this as one capacity it fits on, not the least\n", gib(s[i].broken_at));
    }
    printf("  %-15s %10.3f GiB  (no allocator in 2 MiB pages with PyTorch's two pools reserves less%s)\n",
           "lower bound", gib(bound), t->device_count > 1 ? " on the largest device" : "");
  }
  return 0;
}

/* ---- the report (--report) ---------------------------------------------- */

/* The run as recorded (the trace's settings, else the defaults), with the
 * defaults and the answers drawn beside it; each answer is replayed again
 * for its memory over time (the series only), one at a time, and kept only
 * as the report embeds it. Where the trace records no settings, the run
 * shown is the defaults' and serves as theirs. */
static int write_report(const trace_t *t, const replay_options_t *base, const char *path, const char *out,
                        const candidate_t *best, const candidate_t *torch_best, const candidate_t *furthest) {
  typedef struct {
    const char *label, *conf, *env;
  } shown_run_t;
  shown_run_t runs[4];
  size_t n = 0;
  runs[n++] = (shown_run_t){"defaults", "", NULL};
  if (furthest) {
    runs[n++] = (shown_run_t){"furthest (nothing searched fits)", furthest->conf, NULL};
  } else {
    if (torch_best)
      runs[n++] = (shown_run_t){"best with PyTorch's own allocator", torch_best->conf, "PYTORCH_CUDA_ALLOC_CONF"};
    if (best && (!torch_best || strcmp(best->conf, torch_best->conf)))
      runs[n++] = (shown_run_t){"best with gcalloc", best->conf,
                                pytorch_keys_only(best->conf) ? "PYTORCH_CUDA_ALLOC_CONF" : NULL};
  }
  replay_options_t o = *base;
  o.timeline = true;
  o.page_census = true;
  o.conf = NULL; /* (the trace's settings, else the defaults: what `gcalloc replay` replays) */
  o.match_segments = true; /* (the page says how many of PyTorch's segment events it reproduced) */
  replay_result_t shown;
  int rc = replay_trace(t, &o, &shown);
  if (rc != GCA_OK) {
    fprintf(stderr, "gcalloc tune: %s: %s\n", path, gca_last_error());
    return 1;
  }
  char *json[4] = {0};
  o.series_only = true;
  o.match_segments = base->match_segments;
  for (size_t i = 0; i < n && rc == GCA_OK; i++) {
    replay_result_t r;
    const replay_result_t *of = &shown;
    if (strcmp(runs[i].conf, shown.conf)) {
      o.conf = runs[i].conf;
      if ((rc = replay_trace(t, &o, &r)) != GCA_OK) break;
      of = &r;
    }
    report_run_t run = {runs[i].label, of, runs[i].env};
    if (!(json[i] = report_answer_json(&run))) rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory");
    if (of == &r) replay_result_free(&r);
  }
  int status = 1;
  if (rc == GCA_OK) {
    const char *note = !best && !furthest ? "No setting searched beats the defaults by more than 0.5% with fewer keys: "
                                            "nothing to set." : NULL;
    report_input_t in = {.command = "tune", .trace_path = path, .r = &shown, .capacity = base->capacity,
                         .answers = json, .answer_count = n, .answers_note = note, .trace = t};
    status = report_write(out, &in);
  } else {
    fprintf(stderr, "gcalloc tune: %s: %s\n", path, gca_last_error());
  }
  replay_result_free(&shown);
  for (size_t i = 0; i < n; i++) free(json[i]);
  return status;
}

const tool_command_t tune_command = {
    "tune", "TRACE",
    "TRACE [--capacity SIZE | --min-capacity] [--device N] [--json] [--report FILE.html [--stacks]]",
    "search the settings under which the trace reserves the least",
    "\n"
    "Replays TRACE (any trace `gcalloc replay` reads; - for standard input) under every combination of\n"
    "max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold (with --capacity),\n"
    "cross_stream_reuse (when the trace has several streams) and expandable segments with and without\n"
    "stitching, ranks them by peak reserved memory, and prints what to paste, never worse than the\n"
    "defaults: the best for gcalloc (as GCALLOC_ALLOC_CONF when it uses gcalloc's own keys) and, beside it,\n"
    "the best made only of keys PyTorch's own allocator reads (as PYTORCH_CUDA_ALLOC_CONF), or none when no\n"
    "such setting beats the defaults. The settings are replayed on every processor at once (16 at most);\n"
    "progress is shown on stderr when it is a terminal.\n"
    "\n"
    "  --capacity SIZE  the device's memory, like 80GiB: settings under which the job does not fit rank\n"
    "                   below every one under which it does\n"
    "  --min-capacity   also find the smallest device the job fits on with the defaults and with each\n"
    "                   answer (bisection to 2 MiB)\n"
    "  --device N       tune for device N of the trace only\n"
    "  --json           the ranking as JSON\n"
    "  --report FILE.html  also write `gcalloc replay --report`'s page of the run as recorded, with the\n"
    "                   answers beside it: a table, and each one's reserved memory over the same timeline\n"
    "  --stacks         with --report, read the call stacks from a snapshot of any size (as replay's)\n"
    "  -h, --help       this help\n"
    "\n"
    "Exit status: 0 done; 1 the trace could not be read or replayed, or the report written; 2 bad\n"
    "arguments; 3 nothing fits --capacity.\n",
    tune_main};

int tune_main(int argc, char **argv) {
  const char *path = NULL;
  replay_options_t base = {.device = -1, .infer_empty_cache = true};
  bool json = false, min_capacity = false, stacks = false;
  const char *report = NULL;
  long device = -1;
  const tool_option_t options[] = {
      {"--capacity", OPTION_SIZE, &base.capacity, 0, (long)SIM_MAX_CAPACITY, "SIZE"},
      {"--min-capacity", OPTION_FLAG, &min_capacity, 0, 0, NULL},
      {"--device", OPTION_NUMBER, &device, 0, 255, "N"},
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {"--stacks", OPTION_FLAG, &stacks, 0, 0, NULL},
      {"--report", OPTION_TEXT, &report, 0, 0, "FILE.html"},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&tune_command, options, argc, argv, &path);
  if (parsed) return parsed < 0 ? 0 : parsed;
  if (stacks && !report) {
    fprintf(stderr, "gcalloc tune: --stacks reads the call stacks for --report: give it with --report\n");
    return 2;
  }
  if (min_capacity && base.capacity) {
    fprintf(stderr, "gcalloc tune: --min-capacity finds the capacity: give it without --capacity\n");
    return 2;
  }
  base.device = (int)device;
  tool_progress_t progress;
  tool_progress_start(&progress);
  trace_t t;
  if (!tool_load_trace("tune", path, &t, &progress, report != NULL, stacks)) return 1;
  /* The trace is planned once (its seeds, operations, recorded segment
   * events): the plan does not depend on the settings, and was a third of
   * each replay. */
  replay_plans_t *plans;
  if (replay_plan(&t, &base, &plans) != GCA_OK) {
    tool_progress_done(&progress);
    fprintf(stderr, "gcalloc tune: %s: %s\n", path, gca_last_error());
    trace_free(&t);
    return 1;
  }
  base.plans = plans;
  static const char *const splits[] = {NULL, "32", "64", "128", "256", "512", "1024"};
  static const char *const divisions[] = {NULL, "1", "2", "4", "8", "16"};
  static const char *const gc_all[] = {NULL, "0.5", "0.7", "0.9"};
  static const char *const reuse_all[] = {NULL, "True"};
  static const char *const expandable_all[] = {NULL, "expandable_segments:True",
                                               "expandable_segments:True,stitching:True"};
  size_t n_gc = base.capacity ? 4 : 1, n_reuse = several_streams(&t) ? 2 : 1;
  size_t total = 7 * 6 * n_gc * n_reuse * 3;
  candidate_t *c = calloc(total + 1, sizeof *c);
  if (!c) {
    replay_plans_free(plans);
    trace_free(&t);
    fprintf(stderr, "gcalloc tune: out of host memory\n");
    return 1;
  }
  /* Candidate 0 is the defaults (the empty string), the baseline. */
  size_t n = 0;
  for (size_t s = 0; s < 7; s++)
    for (size_t d = 0; d < 6; d++)
      for (size_t g = 0; g < n_gc; g++)
        for (size_t x = 0; x < n_reuse; x++)
          for (size_t e = 0; e < 3; e++) {
            candidate_t *k = &c[n++];
            char item[128];
            if (splits[s]) {
              snprintf(item, sizeof item, "max_split_size_mb:%s", splits[s]);
              put(k->conf, sizeof k->conf, item);
            }
            if (divisions[d]) {
              snprintf(item, sizeof item, "roundup_power2_divisions:%s", divisions[d]);
              put(k->conf, sizeof k->conf, item);
            }
            if (gc_all[g]) {
              snprintf(item, sizeof item, "per_process_memory_fraction:1.0,garbage_collection_threshold:%s",
                       gc_all[g]);
              put(k->conf, sizeof k->conf, item);
            }
            if (reuse_all[x]) put(k->conf, sizeof k->conf, "cross_stream_reuse:True");
            if (expandable_all[e]) put(k->conf, sizeof k->conf, expandable_all[e]);
          }
  double t0 = tool_seconds();
  int rc = evaluate_all(&t, &base, c, n, &progress);
  double secs = tool_seconds() - t0;
  tool_progress_done(&progress);
  if (rc != GCA_OK) {
    fprintf(stderr, "gcalloc tune: %s: %s\n", path, gca_last_error());
    free(c);
    replay_plans_free(plans);
    trace_free(&t);
    return 1;
  }
  /* The recorded configuration (what the job ran with), for comparison. */
  candidate_t recorded = {0};
  bool have_recorded = t.settings && *t.settings;
  if (have_recorded) {
    snprintf(recorded.conf, sizeof recorded.conf, "%s", t.settings);
    if (evaluate(&t, &base, &recorded) != GCA_OK) have_recorded = false;
  }
  candidate_t defaults = c[0];
  qsort(c, n, sizeof *c, rank);
  bool nothing_fits = base.capacity && !c[0].fits;
  /* The answers: the best for gcalloc, and the best of PyTorch's keys
   * alone for PYTORCH_CUDA_ALLOC_CONF; NULL where none beats the defaults. */
  const candidate_t *best = answer(c, n, false, &defaults), *torch_best = answer(c, n, true, &defaults);
  /* Nothing fits: the furthest setting replayed without a limit says what
   * it would need. */
  candidate_t unlimited = {0};
  bool have_unlimited = false;
  int exit_code = nothing_fits ? 3 : 0;
  if (nothing_fits) {
    replay_options_t free_run = base;
    free_run.capacity = 0;
    snprintf(unlimited.conf, sizeof unlimited.conf, "%s", c[0].conf);
    have_unlimited = evaluate(&t, &free_run, &unlimited) == GCA_OK;
  }
  if (json) {
    printf("{\"trace\": ");
    gca__json_string(stdout, path);
    printf(", \"capacity_bytes\": %" PRIu64 ", \"configurations\": %zu, \"seconds\": %.3f, \"nothing_fits\": %s",
           base.capacity, n, secs, nothing_fits ? "true" : "false");
    const candidate_t *shown = best ? best : &defaults;
    printf(", \"best\": {\"conf\": ");
    gca__json_string(stdout, shown->conf);
    printf(", \"peak_reserved_bytes\": %" PRIu64 ", \"device_allocs\": %" PRIu64 ", \"fits\": %s"
           ", \"pytorch_keys_only\": %s, \"beats_defaults\": %s}, \"best_pytorch\": ",
           shown->peak_reserved, shown->device_allocs, shown->fits ? "true" : "false",
           pytorch_keys_only(shown->conf) ? "true" : "false", best ? "true" : "false");
    if (torch_best) {
      printf("{\"conf\": ");
      gca__json_string(stdout, torch_best->conf);
      printf(", \"peak_reserved_bytes\": %" PRIu64 ", \"device_allocs\": %" PRIu64 ", \"fits\": %s}",
             torch_best->peak_reserved, torch_best->device_allocs, torch_best->fits ? "true" : "false");
    } else {
      printf("null");
    }
    if (nothing_fits) {
      printf(", \"furthest\": {\"conf\": ");
      gca__json_string(stdout, c[0].conf);
      printf(", \"operations_replayed\": %" PRIu64, c[0].replayed);
      if (have_unlimited)
        printf(", \"operations\": %" PRIu64 ", \"unlimited_peak_reserved_bytes\": %" PRIu64
               ", \"shortfall_bytes\": %" PRIu64, unlimited.replayed, unlimited.peak_reserved,
               unlimited.peak_reserved > base.capacity ? unlimited.peak_reserved - base.capacity : 0);
      printf("}");
    }
    printf(", \"defaults\": {\"peak_reserved_bytes\": %" PRIu64 ", \"fits\": %s, \"operations_replayed\": %" PRIu64
           "}, \"ranked\": [", defaults.peak_reserved, defaults.fits ? "true" : "false", defaults.replayed);
    for (size_t i = 0; i < n; i++) {
      printf("%s\n  {\"conf\": ", i ? "," : "");
      gca__json_string(stdout, c[i].conf);
      printf(", \"peak_reserved_bytes\": %" PRIu64 ", \"device_allocs\": %" PRIu64 ", \"fits\": %s"
             ", \"operations_replayed\": %" PRIu64 "}", c[i].peak_reserved, c[i].device_allocs,
             c[i].fits ? "true" : "false", c[i].replayed);
    }
    printf("\n]");
    if (min_capacity && print_smallest(&t, &base, path, &defaults, best, torch_best, c, n, true)) exit_code = 1;
    printf("}\n");
  } else {
    printf("tuned %s: %zu configurations replayed in %.2f s%s\n", path, n, secs,
           base.capacity ? "" : " (garbage_collection_threshold needs --capacity; not searched)");
    if (!several_streams(&t)) printf("one stream in the trace: cross_stream_reuse not searched\n");
    printf("\n");
    printf("rank  peak reserved  x requested  device allocs  %sconfiguration\n", base.capacity ? "fits  " : "");
    for (size_t i = 0; i < n && i < 10; i++)
      printf("%4zu  %9.3f GiB  %11.3f  %13" PRIu64 "  %s%s\n", i + 1, gib(c[i].peak_reserved),
             c[i].peak_requested ? (double)c[i].peak_reserved / (double)c[i].peak_requested : 0, c[i].device_allocs,
             base.capacity ? (c[i].fits ? "yes   " : "no    ") : "", c[i].conf[0] ? c[i].conf : "(defaults)");
    printf("\ndefaults:          %9.3f GiB%s\n", gib(defaults.peak_reserved),
           base.capacity ? (defaults.fits ? ", fits" : ", does not fit") : "");
    if (have_recorded)
      printf("recorded settings: %9.3f GiB  (%s)%s\n", gib(recorded.peak_reserved), recorded.conf,
             base.capacity ? (recorded.fits ? ", fits" : ", does not fit") : "");
    if (nothing_fits) say_nothing_fits(&c[0], &defaults, have_unlimited ? &unlimited : NULL, base.capacity);
    else advise(best, torch_best, &defaults, base.capacity);
  }
  if (min_capacity && !json) {
    printf("\n");
    if (print_smallest(&t, &base, path, &defaults, best, torch_best, c, n, false)) exit_code = 1;
  }
  if (report) {
    if (write_report(&t, &base, path, report, best, torch_best, nothing_fits ? &c[0] : NULL)) exit_code = 1;
    else if (!json) printf("\nreport written to %s\n", report);
  }
  free(c);
  replay_plans_free(plans);
  trace_free(&t);
  return exit_code;
}
