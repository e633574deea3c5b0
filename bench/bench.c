/* `gcalloc bench`: gcalloc against the host allocators, measured in one run.
 *
 * Workloads:
 *   alloc_free_4KiB   malloc + free of 4 KiB in a loop (ns per pair);
 *   small_mix_64B_64KiB
 *                     256 blocks held, then pairs that free a random one
 *                     and allocate its replacement of a random size from
 *                     64 B to 64 KiB (ns per pair);
 *   live_blocks_N     N blocks of 4 KiB held (10^3 to 10^6), then pairs
 *                     that free one of them and allocate its replacement
 *                     (ns per pair), and the host memory each held block
 *                     costs gcalloc;
 *   threads_T_*       T threads (1 to 8) let go together, each looping
 *                     4 KiB pairs on device 0, on a device each, or through
 *                     the pinned host allocator: the wall time over all
 *                     their pairs;
 *   pinned 4 KiB      the 4 KiB loop through the pinned host allocator
 *                     (gca_host_malloc + gca_host_free, cached), against
 *                     the same host allocators: no target, the cost shown;
 *   history           the 4 KiB loop with the history off, on, and on with
 *                     stacks;
 *   instructions      those of a cached 4 KiB pair, counted by callgrind
 *                     where valgrind is installed (no target);
 *   trace:<name>      the alloc/free sequence of each trace in the traces
 *                     folder (the sample snapshots by default; sizes and
 *                     order as recorded, memory never touched), ns per
 *                     operation, replayed warm several times: a device
 *                     cache against host allocators that give memory back
 *                     to the kernel, so no target.
 * Peers: glibc malloc (the process's own), mimalloc (mi_malloc) and jemalloc,
 * both loaded with dlopen so that neither replaces malloc for the process.
 * gcalloc runs on the sim backend with no added latency. Each figure is the
 * median of several timed repetitions after one warm-up, the allocators
 * interleaved within each repetition; gcalloc's spread beside it (slowest
 * repetition less the fastest, over the median).
 *
 * Each workload runs in a child process of its own (fork), so no allocator
 * carries state from one workload into the next: glibc, for one, raises its
 * mmap threshold after freeing large chunks, and a trace measured after
 * another then looks several times faster for glibc than measured alone.
 *
 * Targets (TARGET_*): the 4 KiB loop and the small mix at most mimalloc's time; the most
 * blocks held at most 3x the time at the fewest; at most 96 bytes of host
 * memory per held block; 2-8 threads on one device (or the pinned
 * allocator) at least one thread's pairs a second, on a device each 0.8 x
 * min(T, processors) times them; the history on (no stacks) at most 1.5x
 * off. A missed target is printed; with --check it makes the exit status 1.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/base.h"
#include "gcalloc.h"
#include "replay/trace.h"
#include "tools/tool.h"

typedef struct host_alloc {
  const char *name;
  void *(*alloc)(size_t);
  void (*release)(void *);
} host_alloc_t;

enum { HOST_GLIBC, HOST_MIMALLOC, HOST_JEMALLOC, HOSTS };

typedef enum workload_kind { KIND_LOOP, KIND_TRACE, KIND_SWEEP, KIND_THREADS } workload_kind;

/* The thread workloads' families: every thread on one device, a device
 * each, the pinned host allocator. */
enum { ON_ONE_DEVICE, ON_OWN_DEVICE, ON_PINNED, FAMILIES };
static const char *const family_names[FAMILIES] = {"one_device", "own_device", "pinned"};

typedef struct result {
  char name[96];
  size_t ops;
  double gcalloc_ns;
  double gcalloc_spread;   /* gcalloc's repetitions: (slowest - fastest) / median */
  double host_ns[HOSTS];
  size_t gcalloc_failures;
  int kind;                /* workload_kind */
  size_t live;             /* KIND_SWEEP: the blocks held */
  int threads, family;     /* KIND_THREADS: how many, and ON_* */
  double bytes_per_block;  /* KIND_SWEEP: gcalloc's host memory (resident) per block held */
} result_t;

/* One measured workload, run in a child of its own (isolated): `run` with
 * the fields it reads. */
typedef struct job {
  int (*run)(const struct job *j, result_t *r);
  const host_alloc_t *hosts;
  int reps;
  long n;
  bool pinned;              /* the loop: through the pinned host allocator */
  size_t live;              /* blocks held */
  int threads, family;      /* threads: how many, and ON_* */
  const char *path, *label; /* a trace */
} job_t;

static double now_ns(void) { return tool_seconds() * 1e9; }

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, compare_doubles);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* gcalloc's figure of r: the median of its repetitions, and their spread. */
static void gcalloc_figure(result_t *r, double *v, int n) {
  r->gcalloc_ns = median(v, n);
  r->gcalloc_spread = r->gcalloc_ns > 0 ? (v[n - 1] - v[0]) / r->gcalloc_ns : 0;
}

static bool load_host(host_alloc_t *h, const char *lib, const char *alloc_sym, const char *free_sym) {
  void *handle = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    fprintf(stderr, "gcalloc bench: cannot load %s (%s); install it (see scripts/install-deps.sh)\n", lib,
            dlerror());
    return false;
  }
  *(void **)&h->alloc = dlsym(handle, alloc_sym);
  *(void **)&h->release = dlsym(handle, free_sym);
  if (!h->alloc || !h->release) {
    fprintf(stderr, "gcalloc bench: %s lacks %s/%s\n", lib, alloc_sym, free_sym);
    return false;
  }
  return true;
}

/* ---- the 4 KiB loop ----------------------------------------------------- */

static volatile uintptr_t sink;

/* A sim allocator with no configuration, or NULL (the error printed). */
static gca_allocator_t *bench_open(const char *spec) {
  gca_allocator_t *a = NULL;
  if (gca_open(spec, NULL, &a) == GCA_OK) return a;
  fprintf(stderr, "gcalloc bench: %s\n", gca_last_error());
  return NULL;
}

static double loop_host(const host_alloc_t *h, long n) {
  double t0 = now_ns();
  for (long i = 0; i < n; i++) {
    void *p = h->alloc(4096);
    sink += (uintptr_t)p;
    h->release(p);
  }
  return (now_ns() - t0) / (double)n;
}

static double loop_gcalloc(gca_allocator_t *a, long n, bool pinned) {
  double t0 = now_ns();
  if (pinned) {
    for (long i = 0; i < n; i++) {
      void *p = gca_host_malloc(a, 4096);
      sink += (uintptr_t)p;
      gca_host_free(a, p);
    }
  } else {
    for (long i = 0; i < n; i++) {
      void *p = gca_malloc(a, 4096, 0, 0);
      sink += (uintptr_t)p;
      gca_free(a, p);
    }
  }
  return (now_ns() - t0) / (double)n;
}

static int run_loop(const job_t *j, result_t *r) {
  const host_alloc_t *hosts = j->hosts;
  int reps = j->reps;
  long n = j->n;
  bool pinned = j->pinned;
  gca_allocator_t *a = bench_open("sim");
  if (!a) return 1;
  snprintf(r->name, sizeof r->name, pinned ? "pinned_alloc_free_4KiB" : "alloc_free_4KiB");
  r->ops = (size_t)n;
  double samples[HOSTS + 1][32];
  loop_gcalloc(a, n / 10, pinned);
  for (int h = 0; h < HOSTS; h++) loop_host(&hosts[h], n / 10);
  /* Interleave allocators within each repetition so drift hits all alike. */
  for (int rep = 0; rep < reps; rep++) {
    samples[HOSTS][rep] = loop_gcalloc(a, n, pinned);
    for (int h = 0; h < HOSTS; h++) samples[h][rep] = loop_host(&hosts[h], n);
  }
  gcalloc_figure(r, samples[HOSTS], reps);
  for (int h = 0; h < HOSTS; h++) r->host_ns[h] = median(samples[h], reps);
  gca_close(a);
  return 0;
}

/* ---- the small-size mix ------------------------------------------------- */

/* MIX_HELD blocks held, then pairs that free one of them, picked at random,
 * and allocate its replacement of a random size from 64 B to 64 KiB (each
 * power of two as likely, then uniform within it): the same seeded sequence
 * for every allocator. ns per free+malloc pair. */
enum { MIX_HELD = 256, MIX_STEPS = 1 << 16 };

typedef struct mix_step {
  uint32_t slot, size;
} mix_step_t;

static void mix_plan(mix_step_t *steps) {
  uint64_t x = 0x9e3779b97f4a7c15u;
  for (int i = 0; i < MIX_STEPS; i++) {
    x = x * 6364136223846793005u + 1442695040888963407u;
    uint32_t base = 1u << (6 + (x >> 60) % 10); /* 64 B .. 32 KiB */
    steps[i].size = base + (uint32_t)(x >> 20) % base;
    steps[i].slot = (uint32_t)(x >> 40) % MIX_HELD;
  }
}

static double mix_host(const host_alloc_t *h, void **slots, const mix_step_t *steps, long n) {
  double t0 = now_ns();
  for (long i = 0; i < n; i++) {
    const mix_step_t *st = &steps[i & (MIX_STEPS - 1)];
    h->release(slots[st->slot]);
    slots[st->slot] = h->alloc(st->size);
  }
  return (now_ns() - t0) / (double)n;
}

static double mix_gcalloc(gca_allocator_t *a, void **slots, const mix_step_t *steps, long n, size_t *failures) {
  double t0 = now_ns();
  for (long i = 0; i < n; i++) {
    const mix_step_t *st = &steps[i & (MIX_STEPS - 1)];
    if (slots[st->slot]) gca_free(a, slots[st->slot]);
    if (!(slots[st->slot] = gca_malloc(a, st->size, 0, 0))) ++*failures;
  }
  return (now_ns() - t0) / (double)n;
}

static int run_small_mix(const job_t *j, result_t *r) {
  const host_alloc_t *hosts = j->hosts;
  int reps = j->reps;
  long n = j->n;
  static mix_step_t steps[MIX_STEPS];
  static void *slots[HOSTS + 1][MIX_HELD];
  mix_plan(steps);
  gca_allocator_t *a = bench_open("sim");
  if (!a) return 1;
  snprintf(r->name, sizeof r->name, "small_mix_64B_64KiB");
  r->ops = (size_t)n;
  for (int k = 0; k < MIX_HELD; k++) {
    if (!(slots[HOSTS][k] = gca_malloc(a, steps[k].size, 0, 0))) r->gcalloc_failures++;
    for (int h = 0; h < HOSTS; h++) slots[h][k] = hosts[h].alloc(steps[k].size);
  }
  double samples[HOSTS + 1][32];
  mix_gcalloc(a, slots[HOSTS], steps, n / 10, &r->gcalloc_failures);
  for (int h = 0; h < HOSTS; h++) mix_host(&hosts[h], slots[h], steps, n / 10);
  for (int rep = 0; rep < reps; rep++) {
    samples[HOSTS][rep] = mix_gcalloc(a, slots[HOSTS], steps, n, &r->gcalloc_failures);
    for (int h = 0; h < HOSTS; h++) samples[h][rep] = mix_host(&hosts[h], slots[h], steps, n);
  }
  gcalloc_figure(r, samples[HOSTS], reps);
  for (int h = 0; h < HOSTS; h++) r->host_ns[h] = median(samples[h], reps);
  for (int k = 0; k < MIX_HELD; k++) {
    if (slots[HOSTS][k]) gca_free(a, slots[HOSTS][k]);
    for (int h = 0; h < HOSTS; h++) hosts[h].release(slots[h][k]);
  }
  gca_close(a);
  return 0;
}

/* ---- many live blocks ---------------------------------------------------- */

/* `live` 4 KiB blocks held, then pairs that free one of them, picked in a
 * fixed scattered order, and allocate its replacement: where the block map,
 * the free index and the descriptors no longer fit in the processor's
 * caches, and how a hash that gathers keys shows. ns per free+malloc pair. */
#define SWEEP_STEP 2654435761u

static size_t sweep_pick(long i, size_t live) { return (size_t)((uint64_t)i * SWEEP_STEP % live); }

static double sweep_host(const host_alloc_t *h, void **slots, size_t live, long n) {
  double t0 = now_ns();
  for (long i = 0; i < n; i++) {
    size_t k = sweep_pick(i, live);
    h->release(slots[k]);
    slots[k] = h->alloc(4096);
  }
  return (now_ns() - t0) / (double)n;
}

static double sweep_gcalloc(gca_allocator_t *a, void **slots, size_t live, long n, size_t *failures) {
  double t0 = now_ns();
  for (long i = 0; i < n; i++) {
    size_t k = sweep_pick(i, live);
    if (slots[k]) gca_free(a, slots[k]);
    if (!(slots[k] = gca_malloc(a, 4096, 0, 0))) ++*failures;
  }
  return (now_ns() - t0) / (double)n;
}

/* Resident bytes of this process (0 when /proc cannot say). */
static size_t resident_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long long pages = 0, resident = 0;
  if (!f) return 0;
  int got = fscanf(f, "%llu %llu", &pages, &resident);
  fclose(f);
  return got == 2 ? (size_t)resident * (size_t)sysconf(_SC_PAGESIZE) : 0;
}

static int run_sweep(const job_t *j, result_t *r) {
  const host_alloc_t *hosts = j->hosts;
  size_t live = j->live;
  gca_allocator_t *a = bench_open("sim");
  if (!a) return 1;
  snprintf(r->name, sizeof r->name, "live_blocks_%zu", live);
  r->kind = KIND_SWEEP;
  r->live = live;
  r->ops = (size_t)j->n;
  void **slots[HOSTS + 1];
  for (int h = 0; h <= HOSTS; h++)
    if (!(slots[h] = calloc(live, sizeof **slots))) {
      fprintf(stderr, "gcalloc bench: out of host memory for %zu blocks\n", live);
      return 1;
    }
  /* gcalloc's blocks first, the host memory they cost measured alone (its
   * block descriptors, map and free index: the device memory is not the
   * host's). The bench's own array of their addresses is made resident
   * first (calloc's pages are mapped only when written; volatile, so the
   * compiler cannot drop zeros stored on calloc's memory): it is the
   * caller's memory, not gcalloc's. */
  for (size_t i = 0; i < live; i += 512) ((void *volatile *)slots[HOSTS])[i] = NULL;
  size_t before = resident_bytes();
  for (size_t i = 0; i < live; i++)
    if (!(slots[HOSTS][i] = gca_malloc(a, 4096, 0, 0))) r->gcalloc_failures++;
  size_t after = resident_bytes();
  r->bytes_per_block = after > before ? (double)(after - before) / (double)live : 0;
  for (int h = 0; h < HOSTS; h++)
    for (size_t i = 0; i < live; i++) slots[h][i] = hosts[h].alloc(4096);
  sweep_gcalloc(a, slots[HOSTS], live, j->n / 10, &r->gcalloc_failures);
  for (int h = 0; h < HOSTS; h++) sweep_host(&hosts[h], slots[h], live, j->n / 10);
  double samples[HOSTS + 1][32];
  for (int rep = 0; rep < j->reps; rep++) {
    samples[HOSTS][rep] = sweep_gcalloc(a, slots[HOSTS], live, j->n, &r->gcalloc_failures);
    for (int h = 0; h < HOSTS; h++) samples[h][rep] = sweep_host(&hosts[h], slots[h], live, j->n);
  }
  gcalloc_figure(r, samples[HOSTS], j->reps);
  for (int h = 0; h < HOSTS; h++) r->host_ns[h] = median(samples[h], j->reps);
  for (int h = 0; h < HOSTS; h++) {
    for (size_t i = 0; i < live; i++) hosts[h].release(slots[h][i]);
    free(slots[h]);
  }
  free(slots[HOSTS]); /* (gca_close frees the blocks) */
  gca_close(a);
  return 0;
}

/* ---- threads ------------------------------------------------------------ */

/* T threads, each looping n 4 KiB pairs from one start (a barrier): the
 * time of the whole over the pairs of all, so that a figure below the one
 * thread's means more pairs a second in total. */
typedef struct threads_run {
  const host_alloc_t *host; /* NULL: gcalloc */
  gca_allocator_t *a;
  int family;
  long n;
  pthread_barrier_t start;
  _Atomic size_t failures;
} threads_run_t;

typedef struct thread_arg {
  threads_run_t *run;
  int index;
} thread_arg_t;

static void *thread_loop(void *p) {
  thread_arg_t *t = p;
  threads_run_t *r = t->run;
  int device = r->family == ON_OWN_DEVICE ? t->index : 0;
  size_t failures = 0;
  uintptr_t seen = 0; /* (the shared sink written once: per pair, its line would bounce between threads) */
  pthread_barrier_wait(&r->start);
  for (long i = 0; i < r->n; i++) {
    void *q = r->host                       ? r->host->alloc(4096)
              : r->family == ON_PINNED ? gca_host_malloc(r->a, 4096)
                                       : gca_malloc(r->a, 4096, device, 0);
    seen += (uintptr_t)q;
    failures += !q;
    if (!q) continue;
    if (r->host) r->host->release(q);
    else if (r->family == ON_PINNED) gca_host_free(r->a, q);
    else gca_free(r->a, q);
  }
  atomic_fetch_add(&r->failures, failures);
  sink += seen;
  return NULL;
}

/* ns per pair of the whole, or a negative number when a thread could not
 * be started. */
static double threads_once(threads_run_t *r, int threads) {
  pthread_t ids[8];
  thread_arg_t args[8];
  if (pthread_barrier_init(&r->start, NULL, (unsigned)threads + 1) != 0) return -1;
  int started = 0;
  for (; started < threads; started++) {
    args[started] = (thread_arg_t){r, started};
    if (pthread_create(&ids[started], NULL, thread_loop, &args[started]) != 0) break;
  }
  if (started < threads) { /* (the started ones wait at the barrier for ever: give up the process) */
    fprintf(stderr, "gcalloc bench: cannot start %d threads\n", threads);
    _exit(1);
  }
  /* (the clock read before the barrier lets them go: read after, it could
   * miss the threads' work while this one waits for a processor) */
  double t0 = now_ns();
  pthread_barrier_wait(&r->start);
  for (int i = 0; i < threads; i++) pthread_join(ids[i], NULL);
  double ns = (now_ns() - t0) / ((double)r->n * threads);
  pthread_barrier_destroy(&r->start);
  return ns;
}

static int run_threads(const job_t *j, result_t *r) {
  const host_alloc_t *hosts = j->hosts;
  int reps = j->reps, threads = j->threads, family = j->family;
  long n = j->n;
  char spec[32];
  snprintf(spec, sizeof spec, "sim:devices=%d", threads);
  gca_allocator_t *a = bench_open(spec);
  if (!a) return 1;
  snprintf(r->name, sizeof r->name, "threads_%d_%s", threads, family_names[family]);
  r->kind = KIND_THREADS;
  r->threads = threads;
  r->family = family;
  r->ops = (size_t)n * (size_t)threads;
  threads_run_t runs[HOSTS + 1];
  for (int h = 0; h <= HOSTS; h++) {
    memset(&runs[h], 0, sizeof runs[h]);
    runs[h].host = h < HOSTS ? &hosts[h] : NULL;
    runs[h].a = a;
    runs[h].family = family;
    runs[h].n = n / 10;
  }
  for (int h = 0; h <= HOSTS; h++) threads_once(&runs[h], threads); /* (warm-up) */
  double samples[HOSTS + 1][32];
  for (int rep = 0; rep < reps; rep++)
    for (int h = 0; h <= HOSTS; h++) {
      runs[h].n = n;
      if ((samples[h][rep] = threads_once(&runs[h], threads)) < 0) return 1;
    }
  gcalloc_figure(r, samples[HOSTS], reps);
  for (int h = 0; h < HOSTS; h++) r->host_ns[h] = median(samples[h], reps);
  r->gcalloc_failures = atomic_load(&runs[HOSTS].failures);
  gca_close(a);
  return 0;
}

/* ---- the cost of history ------------------------------------------------ */

/* The 4 KiB loop with history off, on without stacks, and on with stacks
 * (context ALL), measured interleaved in one process: what recording costs
 * on the cached path. */
static int run_history_cost(const job_t *j, result_t *r) {
  int reps = j->reps;
  long n = j->n;
  gca_allocator_t *a[3];
  const gca_context contexts[3] = {GCA_CONTEXT_NONE, GCA_CONTEXT_NONE, GCA_CONTEXT_ALL};
  for (int i = 0; i < 3; i++) {
    if (gca_open("sim", NULL, &a[i]) != GCA_OK ||
        (i > 0 && gca_record_history(a[i], 1, contexts[i], 100000) != GCA_OK)) {
      fprintf(stderr, "gcalloc bench: %s\n", gca_last_error());
      return 1;
    }
    loop_gcalloc(a[i], n / 10, false);
  }
  double samples[3][32];
  for (int rep = 0; rep < reps; rep++)
    for (int i = 0; i < 3; i++) samples[i][rep] = loop_gcalloc(a[i], i == 2 ? n / 10 : n, false);
  /* (the figures travel back in a result_t: gcalloc_ns = off, the first
   * two host slots = on, with stacks) */
  snprintf(r->name, sizeof r->name, "history");
  gcalloc_figure(r, samples[0], reps);
  r->host_ns[0] = median(samples[1], reps);
  r->host_ns[1] = median(samples[2], reps);
  for (int i = 0; i < 3; i++) gca_close(a[i]);
  return 0;
}

/* ---- trace replay ------------------------------------------------------- */

static double replay_host(const host_alloc_t *h, const trace_ops_t *o, void **slots) {
  double t0 = now_ns();
  for (size_t i = 0; i < o->count; i++) {
    const trace_op_t *op = &o->ops[i];
    if (op->is_free) {
      h->release(slots[op->slot]);
      slots[op->slot] = NULL;
    } else {
      slots[op->slot] = h->alloc(op->size);
    }
  }
  for (size_t s = 0; s < o->slot_count; s++) {
    if (slots[s]) h->release(slots[s]);
    slots[s] = NULL;
  }
  return now_ns() - t0;
}

static double replay_gcalloc(gca_allocator_t *a, const trace_ops_t *o, void **slots, size_t *failures) {
  double t0 = now_ns();
  for (size_t i = 0; i < o->count; i++) {
    const trace_op_t *op = &o->ops[i];
    if (op->is_free) {
      gca_free(a, slots[op->slot]);
      slots[op->slot] = NULL;
    } else {
      slots[op->slot] = gca_malloc(a, op->size, op->device, op->stream);
      if (!slots[op->slot] && op->size) (*failures)++;
    }
  }
  for (size_t s = 0; s < o->slot_count; s++) {
    if (slots[s]) gca_free(a, slots[s]);
    slots[s] = NULL;
  }
  return now_ns() - t0;
}

static size_t live_at_end(const trace_ops_t *o) {
  size_t live = 0;
  for (size_t i = 0; i < o->count; i++) live += o->ops[i].is_free ? (size_t)-1 : 1;
  return live;
}

static int run_trace(const job_t *j, result_t *r) {
  const host_alloc_t *hosts = j->hosts;
  const char *path = j->path, *label = j->label;
  int reps = j->reps;
  trace_t t;
  trace_ops_t o;
  if (trace_load(path, &t) != GCA_OK || trace_to_ops(&t, &o) != GCA_OK) {
    fprintf(stderr, "gcalloc bench: %s\n", gca_last_error());
    return 1;
  }
  char spec[96];
  snprintf(spec, sizeof spec, "sim:devices=%d,capacity=1TiB", t.device_count > 0 ? t.device_count : 1);
  trace_free(&t);
  gca_allocator_t *a;
  void **slots = calloc(o.slot_count ? o.slot_count : 1, sizeof *slots);
  if (!slots || gca_open(spec, NULL, &a) != GCA_OK) {
    fprintf(stderr, "gcalloc bench: %s\n", slots ? gca_last_error() : "out of memory");
    free(slots);
    trace_ops_free(&o);
    return 1;
  }
  snprintf(r->name, sizeof r->name, "trace:%s", label);
  r->kind = KIND_TRACE;
  r->ops = o.count + live_at_end(&o);
  double samples[HOSTS + 1][32];
  size_t failures = 0;
  replay_gcalloc(a, &o, slots, &failures);
  for (int h = 0; h < HOSTS; h++) replay_host(&hosts[h], &o, slots);
  failures = 0;
  for (int rep = 0; rep < reps; rep++) {
    samples[HOSTS][rep] = replay_gcalloc(a, &o, slots, &failures) / (double)r->ops;
    for (int h = 0; h < HOSTS; h++) samples[h][rep] = replay_host(&hosts[h], &o, slots) / (double)r->ops;
  }
  r->gcalloc_failures = failures;
  gcalloc_figure(r, samples[HOSTS], reps);
  for (int h = 0; h < HOSTS; h++) r->host_ns[h] = median(samples[h], reps);
  gca_close(a);
  free(slots);
  trace_ops_free(&o);
  return 0;
}

/* Each subfolder of the traces folder holds one trace file. */
static int for_each_trace(const char *dir, int (*fn)(const char *path, const char *label, void *ctx), void *ctx) {
  struct dirent **subdirs;
  int n = scandir(dir, &subdirs, NULL, alphasort);
  if (n < 0) {
    fprintf(stderr, "gcalloc bench: cannot read the traces folder %s (use --traces DIR)\n", dir);
    return -1;
  }
  int found = 0, rc = 0;
  for (int i = 0; i < n; i++) {
    const char *name = subdirs[i]->d_name;
    if (name[0] == '.' || rc) continue;
    char sub[4096];
    snprintf(sub, sizeof sub, "%s/%s", dir, name);
    struct dirent **files;
    int m = scandir(sub, &files, NULL, alphasort);
    for (int j = 0; j < m; j++) {
      const char *f = files[j]->d_name;
      size_t len = strlen(f);
      bool is_trace = (len > 7 && strcmp(f + len - 7, ".pickle") == 0) || (len > 4 && strcmp(f + len - 4, ".log") == 0);
      if (is_trace && !rc) {
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", sub, f);
        rc = fn(path, name, ctx);
        found++;
      }
      free(files[j]);
    }
    if (m >= 0) free(files);
  }
  for (int i = 0; i < n; i++) free(subdirs[i]);
  free(subdirs);
  if (!rc && found == 0) {
    fprintf(stderr, "gcalloc bench: no traces (*.pickle, *.log) under %s\n", dir);
    return -1;
  }
  return rc ? -1 : found;
}

/* Run fn(arg, r) in a child process and bring *r back through a pipe. A
 * workload that cannot be isolated is not measured at all: in-process
 * figures would depend on the workloads before it. */
static int isolated(int (*fn)(void *arg, result_t *r), void *arg, result_t *r) {
  int fds[2];
  if (pipe(fds) != 0) {
    perror("gcalloc bench: pipe");
    return 1;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    perror("gcalloc bench: fork");
    close(fds[0]);
    close(fds[1]);
    return 1;
  }
  if (pid == 0) {
    close(fds[0]);
    int rc = fn(arg, r);
    ssize_t n = rc == 0 ? write(fds[1], r, sizeof *r) : 0;
    _exit(rc == 0 && n == (ssize_t)sizeof *r ? 0 : 1);
  }
  close(fds[1]);
  ssize_t got = 0, n;
  while (got < (ssize_t)sizeof *r && (n = read(fds[0], (char *)r + got, sizeof *r - (size_t)got)) > 0) got += n;
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return (got == (ssize_t)sizeof *r && WIFEXITED(status) && WEXITSTATUS(status) == 0) ? 0 : 1;
}

/* ---- instructions a pair (callgrind) ----------------------------------- */

/* The instructions one cached 4 KiB pair executes, counted by valgrind's
 * callgrind where valgrind is installed: this program run under it twice
 * (GCALLOC_BENCH_PAIRS pairs, then twice as many), the difference over the
 * pairs added, so start-up and the loop's set-up cancel out. Deterministic,
 * unlike the times. 0: valgrind is not installed or failed. */
enum { COUNTED_PAIRS = 100000 };

/* The last two lines valgrind wrote (its reason, when it gives up), without
 * its "==pid==" prefixes, into why. */
static void valgrind_last_words(const char *out, char *why, size_t cap) {
  const char *lines[2] = {NULL, NULL};
  size_t lens[2] = {0, 0};
  for (const char *p = out; *p;) {
    const char *end = strchr(p, '\n');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    const char *text = p;
    if (text[0] == '=' && text[1] == '=') { /* "==123== " */
      const char *close = strstr(text + 2, "== ");
      if (close && close < p + len) text = close + 3;
    }
    size_t n = len - (size_t)(text - p);
    if (n > 0) {
      lines[0] = lines[1], lens[0] = lens[1];
      lines[1] = text, lens[1] = n;
    }
    p = end ? end + 1 : p + len;
  }
  snprintf(why, cap, "%.*s%s%.*s", (int)lens[0], lines[0] ? lines[0] : "", lines[0] ? " " : "", (int)lens[1],
           lines[1] ? lines[1] : "");
}

/* The total callgrind reports for `pairs` pairs, or 0 with the reason in
 * why. */
static unsigned long long callgrind_total(const char *exe, long pairs, char *why, size_t cap) {
  int fds[2];
  if (pipe(fds) != 0) return 0;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return 0;
  }
  if (pid == 0) {
    char count[32];
    snprintf(count, sizeof count, "%ld", pairs);
    setenv("GCALLOC_BENCH_PAIRS", count, 1);
    dup2(fds[1], STDERR_FILENO);
    int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execlp("valgrind", "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", exe, "bench",
           (char *)NULL);
    fprintf(stderr, "valgrind is not installed (%s)\n", strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  char out[8192];
  size_t got = 0;
  ssize_t n;
  while (got + 1 < sizeof out && (n = read(fds[0], out + got, sizeof out - 1 - got)) > 0) got += (size_t)n;
  out[got] = 0;
  while (read(fds[0], &(char){0}, 1) > 0) {
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const char *at = strstr(out, "Collected : ");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !at) {
    valgrind_last_words(out, why, cap);
    return 0;
  }
  return strtoull(at + strlen("Collected : "), NULL, 10);
}

/* 0 with the reason in why when not counted. */
static double instructions_per_pair(char *why, size_t cap) {
  char exe[4096];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) {
    snprintf(why, cap, "cannot find this program: %s", strerror(errno));
    return 0;
  }
  exe[len] = 0;
  unsigned long long once = callgrind_total(exe, COUNTED_PAIRS, why, cap);
  unsigned long long twice = once ? callgrind_total(exe, 2 * COUNTED_PAIRS, why, cap) : 0;
  if (once && twice <= once) snprintf(why, cap, "callgrind counted %llu, then %llu", once, twice);
  return once && twice > once ? (double)(twice - once) / COUNTED_PAIRS : 0;
}

/* Under callgrind: the pairs alone. */
static int counted_pairs(long pairs) {
  gca_allocator_t *a = bench_open("sim");
  if (!a) return 1;
  loop_gcalloc(a, pairs, false);
  gca_close(a);
  return 0;
}

static int job_main(void *p, result_t *r) {
  const job_t *j = p;
  return j->run(j, r);
}

typedef struct trace_ctx {
  const host_alloc_t *hosts;
  int reps;
  result_t *results;
  int count;
} trace_ctx_t;

static int trace_visit(const char *path, const char *label, void *p) {
  trace_ctx_t *c = p;
  if (c->count >= 30) return 0;
  job_t job = {.run = run_trace, .hosts = c->hosts, .reps = c->reps, .path = path, .label = label};
  return isolated(job_main, &job, &c->results[c->count++]);
}

/* ---- output ------------------------------------------------------------- */

static double best_host(const result_t *r) {
  double b = r->host_ns[0];
  for (int h = 1; h < HOSTS; h++)
    if (r->host_ns[h] < b) b = r->host_ns[h];
  return b;
}

/* The targets (docs/benchmarks.md). A failed step misses every target. */
#define TARGET_LOOP_VS_MIMALLOC 1.0
#define TARGET_SWEEP_GROWTH 3.0
#define TARGET_BYTES_PER_BLOCK 96.0
#define TARGET_HISTORY_ON 1.5
#define TARGET_OWN_DEVICE_SCALING 0.8

/* The sweep's rows: its largest against its smallest (gcalloc's figures). */
typedef struct sweep_span {
  const result_t *least, *most;
} sweep_span_t;

static sweep_span_t sweep_span(const result_t *results, int count) {
  sweep_span_t s = {NULL, NULL};
  for (int i = 0; i < count; i++) {
    if (results[i].kind != KIND_SWEEP) continue;
    if (!s.least || results[i].live < s.least->live) s.least = &results[i];
    if (!s.most || results[i].live > s.most->live) s.most = &results[i];
  }
  return s;
}

/* The one-thread row the thread workload r is judged against: its family's
 * (one device's for a device each), or NULL. */
static const result_t *one_thread(const result_t *results, int count, const result_t *r) {
  int family = r->family == ON_OWN_DEVICE ? ON_ONE_DEVICE : r->family;
  for (int i = 0; i < count; i++)
    if (results[i].kind == KIND_THREADS && results[i].threads == 1 && results[i].family == family) return &results[i];
  return NULL;
}

/* Whether r has a target, and then whether it is met, its text in *target. */
static bool target_of(const result_t *r, const result_t *results, int count, sweep_span_t span, char *target,
                      size_t cap, bool *met) {
  *met = r->gcalloc_failures == 0;
  const result_t *one = r->kind == KIND_THREADS && r->threads > 1 ? one_thread(results, count, r) : NULL;
  switch (r->kind) {
  case KIND_THREADS: {
    if (!one) break;
    /* The total with T threads, against one thread's: at least as much on
     * one device; with a device each, growing with the processors (80% of
     * min(T, processors) times). */
    int cores = gca__processors_usable();
    double want = r->family == ON_OWN_DEVICE ? TARGET_OWN_DEVICE_SCALING * (r->threads < cores ? r->threads : cores) : 1.0;
    snprintf(target, cap, ">= %.1fx 1 thread's pairs/s", want);
    *met = *met && one->gcalloc_failures == 0 && r->gcalloc_ns * want <= one->gcalloc_ns;
    return true;
  }
  case KIND_LOOP:
    snprintf(target, cap, "<= %.1fx mimalloc", TARGET_LOOP_VS_MIMALLOC);
    *met = *met && r->gcalloc_ns <= TARGET_LOOP_VS_MIMALLOC * r->host_ns[HOST_MIMALLOC];
    return true;
  case KIND_SWEEP:
    if (r != span.most || span.least == span.most) break;
    snprintf(target, cap, "<= %.0fx at %zu held", TARGET_SWEEP_GROWTH, span.least->live);
    *met = *met && span.least->gcalloc_failures == 0 && r->gcalloc_ns <= TARGET_SWEEP_GROWTH * span.least->gcalloc_ns;
    return true;
  default:
    break;
  }
  snprintf(target, cap, "%s", r->kind == KIND_TRACE ? "none (device cache vs host)" : "none");
  return false;
}

/* jemalloc uses initial-exec TLS, and a library loaded with dlopen gets
 * only glibc's small static TLS surplus. Raise the surplus for this process
 * by re-running it once with the glibc tunable set. */
static void reexec_with_tls_surplus(int argc, char **argv) {
  if (getenv("GCALLOC_BENCH_TLS")) return;
  setenv("GCALLOC_BENCH_TLS", "1", 1);
  const char *old = getenv("GLIBC_TUNABLES");
  char tunables[2048];
  snprintf(tunables, sizeof tunables, "%s%sglibc.rtld.optional_static_tls=65536", old ? old : "", old ? ":" : "");
  setenv("GLIBC_TUNABLES", tunables, 1);
  char **args = calloc((size_t)argc + 2, sizeof *args);
  if (!args) return;
  args[0] = "gcalloc";
  for (int i = 0; i < argc; i++) args[i + 1] = argv[i];
  execv("/proc/self/exe", args);
  free(args); /* exec failed: go on, and the dlopen below reports why */
}

const tool_command_t bench_command = {
    "bench", NULL, "[--json] [--traces DIR] [--quick] [--check]",
    "compare gcalloc with glibc, mimalloc and jemalloc (loops, blocks held, threads, traces)",
    "\n"
    "Times gcalloc (on the simulated device) against glibc malloc, mimalloc and jemalloc in the same run:\n"
    "a 4 KiB malloc+free loop, a mix of sizes from 64 B to 64 KiB, 4 KiB blocks replaced among 10^3 to\n"
    "10^6 held (and the host memory each held block costs gcalloc), 1 to 8 threads on one device, on a\n"
    "device each and on the pinned host allocator, the history's cost, the pinned host allocator's loop,\n"
    "and the alloc/free sequence of every trace in the traces folder; prints ns per operation (the median\n"
    "of the repetitions, and gcalloc's spread), the ratios and the targets (docs/benchmarks.md); with\n"
    "valgrind installed, the instructions of a cached 4 KiB pair.\n"
    "\n"
    "  --json        the figures as JSON\n"
    "  --traces DIR  the folder of traces, one folder each (default: the sample snapshots, data/snapshots;\n"
    "                without them, the loops alone)\n"
    "  --quick       fewer repetitions, and at most 10^5 blocks held (a smoke test, not figures to quote)\n"
    "  --check       exit with status 1 when a target is missed (without it, the run says so and exits 0)\n"
    "  -h, --help    this help\n",
    bench_main};

int bench_main(int argc, char **argv) {
  bool json = false, quick = false, check = false;
  const char *traces = NULL;
  const tool_option_t options[] = {
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {"--quick", OPTION_FLAG, &quick, 0, 0, NULL},
      {"--check", OPTION_FLAG, &check, 0, 0, NULL},
      {"--traces", OPTION_TEXT, &traces, 0, 0, "DIR"},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&bench_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  const char *pairs = getenv("GCALLOC_BENCH_PAIRS"); /* (run under callgrind by instructions_per_pair) */
  if (pairs) return counted_pairs(atol(pairs));
  if (!traces && !(traces = tool_samples_dir()))
    fprintf(stderr, "gcalloc bench: no sample snapshots here (data/snapshots): the loops alone; --traces DIR adds "
                    "the traces of a folder\n");
  /* A folder given is checked before a second of work is spent on the loop. */
  struct stat st;
  bool found = !traces || stat(traces, &st) == 0;
  if (!found || (traces && !S_ISDIR(st.st_mode))) {
    fprintf(stderr, "gcalloc bench: the traces folder %s: %s (use --traces DIR)\n", traces,
            !found ? strerror(errno) : "not a folder");
    return 2;
  }
  reexec_with_tls_surplus(argc, argv); /* (what it runs parses the same arguments again) */
  host_alloc_t hosts[HOSTS] = {{"glibc", malloc, free}, {"mimalloc", NULL, NULL}, {"jemalloc", NULL, NULL}};
  /* jemalloc first: it needs static TLS, of which a dlopen'ed library can
   * only get what is left over. */
  if (!load_host(&hosts[HOST_JEMALLOC], "libjemalloc.so.2", "malloc", "free") ||
      !load_host(&hosts[HOST_MIMALLOC], "libmimalloc.so.2", "mi_malloc", "mi_free"))
    return 1;

  int reps = quick ? 3 : 9;
  result_t results[64];
  memset(results, 0, sizeof results);
  int count = 0;
  job_t loop = {.run = run_loop, .hosts = hosts, .reps = reps, .n = quick ? 200000 : 3000000};
  if (isolated(job_main, &loop, &results[count++])) return 1;
  job_t mix = {.run = run_small_mix, .hosts = hosts, .reps = reps, .n = quick ? 200000 : 2000000};
  if (isolated(job_main, &mix, &results[count++])) return 1;
  /* (10^6 blocks of 4 KiB are 4 GiB of host memory for each host allocator
   * that touches them: not in a smoke test) */
  for (size_t live = 1000; live <= (quick ? 100000u : 1000000u); live *= 10) {
    job_t sweep = {.run = run_sweep, .hosts = hosts, .reps = quick ? 3 : 5, .n = quick ? 100000 : 1000000, .live = live};
    if (isolated(job_main, &sweep, &results[count++])) return 1;
  }
  for (int family = 0; family < FAMILIES; family++)
    for (int threads = family == ON_OWN_DEVICE ? 2 : 1; threads <= 8; threads *= 2) {
      job_t job = {.run = run_threads, .hosts = hosts, .reps = quick ? 3 : 5, .n = quick ? 20000 : 500000,
                   .threads = threads, .family = family};
      if (isolated(job_main, &job, &results[count++])) return 1;
    }
  trace_ctx_t ctx = {hosts, reps, results + count, 0};
  if (traces && for_each_trace(traces, trace_visit, &ctx) < 0) return 1;
  count += ctx.count;
  result_t hist;
  memset(&hist, 0, sizeof hist);
  job_t history = {.run = run_history_cost, .reps = reps, .n = quick ? 200000 : 3000000};
  if (isolated(job_main, &history, &hist)) return 1;
  result_t pinned;
  memset(&pinned, 0, sizeof pinned);
  loop.pinned = true;
  if (isolated(job_main, &loop, &pinned)) return 1;

  char not_counted[512] = "";
  double instructions = instructions_per_pair(not_counted, sizeof not_counted);

  sweep_span_t span = sweep_span(results, count);
  const result_t *most = span.most;
  bool bytes_met = most && most->bytes_per_block <= TARGET_BYTES_PER_BLOCK;
  double history_ratio = hist.host_ns[0] / hist.gcalloc_ns;
  bool history_met = history_ratio <= TARGET_HISTORY_ON;
  bool all_met = bytes_met && history_met;
  if (json) {
    printf("{\n  \"unit\": \"ns per operation (loops and live blocks: per alloc+free pair)\",\n  \"workloads\": [\n");
  } else {
    printf("%-34s %10s %10s %7s %10s %10s %10s %8s %8s  %s\n", "workload", "ops", "gcalloc", "spread", "glibc",
           "mimalloc", "jemalloc", "/mimal.", "/best", "target");
  }
  for (int i = 0; i < count; i++) {
    const result_t *r = &results[i];
    char target[96];
    bool met;
    bool has = target_of(r, results, count, span, target, sizeof target, &met);
    if (has) all_met &= met;
    double vs_mi = r->gcalloc_ns / r->host_ns[HOST_MIMALLOC];
    double vs_best = r->gcalloc_ns / best_host(r);
    if (json) {
      printf("    {\"name\": \"%s\", \"kind\": \"%s\", \"ops\": %zu, \"gcalloc_ns\": %.2f, \"gcalloc_spread\": %.3f, "
             "\"glibc_ns\": %.2f, "
             "\"mimalloc_ns\": %.2f, \"jemalloc_ns\": %.2f, \"ratio_vs_mimalloc\": %.3f, \"ratio_vs_best_host\": %.3f, "
             "\"gcalloc_failures\": %zu, ",
             r->name, (const char *[]){"loop", "trace", "live_blocks", "threads"}[r->kind], r->ops,
             r->gcalloc_ns, r->gcalloc_spread, r->host_ns[0], r->host_ns[1], r->host_ns[2], vs_mi, vs_best, r->gcalloc_failures);
      if (r->kind == KIND_SWEEP)
        printf("\"live_blocks\": %zu, \"bytes_per_live_block\": %.1f, ", r->live, r->bytes_per_block);
      if (r->kind == KIND_THREADS)
        printf("\"threads\": %d, \"on\": \"%s\", ", r->threads, family_names[r->family]);
      printf("\"target\": \"%s\", \"target_met\": %s}%s\n", target, has ? (met ? "true" : "false") : "null",
             i + 1 < count ? "," : "");
    } else {
      printf("%-34s %10zu %10.1f %6.1f%% %10.1f %10.1f %10.1f %8.3f %8.3f  %s%s%s\n", r->name, r->ops,
             r->gcalloc_ns, 100 * r->gcalloc_spread, r->host_ns[0], r->host_ns[1], r->host_ns[2], vs_mi, vs_best,
             target, has ? ": " : "", has ? (met ? "met" : "MISSED") : "");
    }
  }
  if (json) {
    printf("  ],\n");
    if (most)
      printf("  \"bytes_per_live_block\": {\"live_blocks\": %zu, \"bytes\": %.1f, \"target\": \"<= %.0f\", "
             "\"target_met\": %s},\n",
             most->live, most->bytes_per_block, TARGET_BYTES_PER_BLOCK, bytes_met ? "true" : "false");
    printf("  \"history_4KiB_ns\": {\"off\": %.2f, \"on\": %.2f, \"on_with_stacks\": %.2f, \"target\": "
           "\"on <= %.1fx off\", \"target_met\": %s},\n",
           hist.gcalloc_ns, hist.host_ns[0], hist.host_ns[1], TARGET_HISTORY_ON, history_met ? "true" : "false");
    printf("  \"pinned_4KiB_ns\": {\"gcalloc\": %.2f, \"glibc\": %.2f, \"mimalloc\": %.2f, \"jemalloc\": %.2f, "
           "\"ratio_vs_mimalloc\": %.3f},\n",
           pinned.gcalloc_ns, pinned.host_ns[0], pinned.host_ns[1], pinned.host_ns[2],
           pinned.gcalloc_ns / pinned.host_ns[HOST_MIMALLOC]);
    if (instructions > 0) printf("  \"instructions_per_4KiB_pair\": %.1f,\n", instructions);
    else printf("  \"instructions_per_4KiB_pair\": null,\n");
    printf("  \"all_targets_met\": %s\n}\n", all_met ? "true" : "false");
  } else {
    if (most)
      printf("host memory per live block (gcalloc, %zu blocks held): %.1f bytes (target <= %.0f: %s)\n", most->live,
             most->bytes_per_block, TARGET_BYTES_PER_BLOCK, bytes_met ? "met" : "MISSED");
    printf("history, 4 KiB loop: off %.1f ns, on %.1f ns (%.2fx; target <= %.1fx: %s), on with stacks %.1f ns "
           "(%.2fx)\n",
           hist.gcalloc_ns, hist.host_ns[0], history_ratio, TARGET_HISTORY_ON, history_met ? "met" : "MISSED",
           hist.host_ns[1], hist.host_ns[1] / hist.gcalloc_ns);
    printf("pinned host, 4 KiB loop (no target): gcalloc %.1f ns, glibc %.1f, mimalloc %.1f, jemalloc %.1f "
           "(%.2fx mimalloc)\n",
           pinned.gcalloc_ns, pinned.host_ns[0], pinned.host_ns[1], pinned.host_ns[2],
           pinned.gcalloc_ns / pinned.host_ns[HOST_MIMALLOC]);
    if (instructions > 0)
      printf("instructions per cached 4 KiB pair (callgrind, no target): %.1f\n", instructions);
    else
      printf("instructions per cached 4 KiB pair: not counted (%s)\n", not_counted);
    printf("all targets %s\n", all_met ? "met" : "NOT met");
  }
  return check && !all_met ? 1 : 0;
}
