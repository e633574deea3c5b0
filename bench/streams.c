/* `gcalloc bench-streams`: what cross-stream reuse saves on a multi-stream
 * workload, against PyTorch's per-stream caching measured in the same run:
 * cross_stream_reuse:True (move any whole cached segment of another stream)
 * and cross_stream_reuse:1 (only segments no larger than the device would
 * be asked for, so moving one never splits more than a fresh one would).
 *
 * The workload is the one PyTorch issue #109863 describes: an inference
 * server that runs each request on a stream of its own (4 streams), with
 * fewer requests in flight than streams. A request is a transformer forward
 * pass of random batch and sequence length: per layer an activation and an
 * MLP intermediate four times larger, a few small buffers, the previous
 * activation freed once the next exists. The host interleaves the requests
 * in flight op by op; every allocation is used by simulated work on its
 * stream (duration proportional to its size), and the host spends 5 us per
 * op launching. Memory a stream cached is idle while the other streams run
 * requests, so per-stream caching reserves it again for each stream.
 *
 * Each policy runs the same seeded sequence on the sim, whose race detector
 * fails the run if any block is handed out, or freed on the device, while
 * unordered work still uses it. Reported per policy: peak allocated and
 * reserved with no capacity limit; device allocations; cross-stream reuses
 * and the stream waits they added; simulated makespan (how much the added
 * waits serialize the streams); and the smallest device (in 256 MiB steps)
 * on which the workload runs without running out of memory, with the
 * allocation retries (synchronize + free cache + allocate again, each costly
 * on a real GPU) it needs there.
 *
 * Two device models bracket a real GPU: one engine (work of different
 * streams runs one piece at a time, as large kernels that fill the GPU do)
 * and unlimited engines (streams never slow each other down, so a wait that
 * serializes two streams costs its full length). The makespan cost of the
 * waits lies between the two.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/sim_driver.h"
#include "core/inspect.h"
#include "tools/tool.h"

#define STREAMS 4
#define LAYERS 24
#define HIDDEN 4096
#define HOST_NS_PER_OP 5000
#define BYTES_PER_NS 2000 /* 2 TB/s of device bandwidth */
#define MAX_LIVE 64

typedef struct scenario {
  const char *name;
  int in_flight;
  int requests;
  uint64_t seed;
} scenario_t;

typedef struct run_result {
  bool ok;            /* finished without OOM or error */
  int64_t peak_allocated, peak_reserved;
  int64_t device_allocs, cross_reuses, retries, ooms;
  uint64_t stream_waits, hazards, makespan_ns;
  size_t ops;
  char error[256];
} run_result_t;

/* One request in flight: its stream, its shape, where it is. */
typedef struct request {
  gca_stream_t stream;
  size_t act_bytes, mlp_bytes;
  int layer, step;
  void *act, *next_act, *mlp;
  void *smalls[4];
  bool active;
} request_t;

static uint64_t next_random(uint64_t *s) { /* xorshift64* */
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}

static void start_request(request_t *r, int index, uint64_t *rng) {
  memset(r, 0, sizeof *r);
  r->stream = (gca_stream_t)(0x100 * (1 + index % STREAMS));
  size_t batch = 1 + next_random(rng) % 8, seq = 128 * (1 + next_random(rng) % 16);
  r->act_bytes = batch * seq * HIDDEN * 2; /* fp16 */
  r->mlp_bytes = 4 * r->act_bytes;
  r->active = true;
}

typedef struct runner {
  gca_allocator_t *a;
  run_result_t *res;
} runner_t;

/* Allocate and use on the request's stream; false (error kept) on failure. */
static bool alloc_use(runner_t *rn, request_t *r, size_t size, void **out) {
  void *p = gca_malloc(rn->a, size, 0, r->stream);
  rn->res->ops++;
  if (!p) {
    snprintf(rn->res->error, sizeof rn->res->error, "%s", gca_last_error());
    return false;
  }
  if (gca__sim_launch(gca__inspect_backend(rn->a), 0, r->stream, size / BYTES_PER_NS + 1, (uintptr_t)p, size) != GCA_OK) {
    snprintf(rn->res->error, sizeof rn->res->error, "%s", gca_last_error());
    return false;
  }
  *out = p;
  return true;
}

static bool release(runner_t *rn, void **p) {
  rn->res->ops++;
  int rc = gca_free(rn->a, *p);
  *p = NULL;
  if (rc != GCA_OK) snprintf(rn->res->error, sizeof rn->res->error, "%s", gca_last_error());
  return rc == GCA_OK;
}

/* One host step of a request: the next op of its current layer. Steps per
 * layer: next activation, MLP intermediate, small buffers, free MLP, free
 * small buffers, retire the previous activation. */
static bool step(runner_t *rn, request_t *r, uint64_t *rng) {
  switch (r->step++) {
    case 0: return alloc_use(rn, r, r->act_bytes, &r->next_act);
    case 1: return alloc_use(rn, r, r->mlp_bytes, &r->mlp);
    case 2:
      for (int i = 0; i < 4; i++)
        if (!alloc_use(rn, r, 1 + next_random(rng) % (64 * KIB), &r->smalls[i])) return false;
      return true;
    case 3: return release(rn, &r->mlp);
    case 4:
      for (int i = 0; i < 4; i++)
        if (!release(rn, &r->smalls[i])) return false;
      return true;
    default:
      if (r->act && !release(rn, &r->act)) return false;
      r->act = r->next_act;
      r->next_act = NULL;
      r->step = 0;
      if (++r->layer == LAYERS) {
        if (!release(rn, &r->act)) return false;
        r->active = false;
      }
      return true;
  }
}

static void run_scenario(const scenario_t *sc, int engines, const char *conf, size_t capacity, run_result_t *res) {
  memset(res, 0, sizeof *res);
  char spec[96];
  snprintf(spec, sizeof spec, "sim:capacity=%zu,engines=%d", capacity, engines);
  gca_allocator_t *a;
  if (gca_open(spec, conf, &a) != GCA_OK) {
    snprintf(res->error, sizeof res->error, "%s", gca_last_error());
    return;
  }
  runner_t rn = {a, res};
  const backend_t *sim = gca__inspect_backend(a);
  uint64_t rng = sc->seed;
  request_t reqs[8];
  int started = 0, finished = 0;
  for (int i = 0; i < sc->in_flight; i++) start_request(&reqs[i], started++, &rng);
  bool ok = true;
  while (ok && finished < sc->requests) {
    for (int i = 0; ok && i < sc->in_flight; i++) {
      request_t *r = &reqs[i];
      if (!r->active) continue;
      ok = step(&rn, r, &rng);
      gca__sim_advance(sim, HOST_NS_PER_OP);
      if (ok && !r->active) {
        finished++;
        if (started < sc->requests) start_request(r, started++, &rng);
      }
    }
  }
  /* The makespan: when the last stream's work completes. */
  uint64_t end = gca__sim_now(sim);
  for (int s = 0; s < STREAMS; s++) {
    uint64_t t = gca__sim_stream_ready_at(sim, 0, (gca_stream_t)(0x100 * (1 + s)));
    if (t > end) end = t;
  }
  gca_stats_t st;
  gca_get_stats(a, 0, &st);
  sim_counters_t c;
  gca__sim_get_counters(sim, 0, &c);
  res->ok = ok;
  res->peak_allocated = st.allocated_bytes[GCA_POOL_ALL].peak;
  res->peak_reserved = st.reserved_bytes[GCA_POOL_ALL].peak;
  res->device_allocs = st.num_device_alloc;
  res->cross_reuses = st.num_cross_stream_reuses;
  res->retries = st.num_alloc_retries;
  res->ooms = st.num_ooms;
  res->stream_waits = c.stream_waits;
  res->hazards = c.hazards;
  res->makespan_ns = end;
  if (ok && gca_check(a, 0) != GCA_OK) {
    res->ok = false;
    snprintf(res->error, sizeof res->error, "%s", gca_last_error());
  }
  gca_close(a);
}

/* The smallest capacity, in 256 MiB steps, on which the run succeeds. */
static size_t min_capacity(const scenario_t *sc, int engines, const char *conf, size_t lo, size_t hi,
                           run_result_t *at) {
  const size_t step = 256 * MIB;
  lo = lo / step * step;
  hi = (hi + step - 1) / step * step;
  run_result_t r;
  run_scenario(sc, engines, conf, hi, &r);
  if (!r.ok) return 0;
  *at = r;
  while (hi - lo > step) { /* invariant: hi fits; lo does not (or is the floor) */
    size_t mid = (lo + hi) / 2 / step * step;
    run_scenario(sc, engines, conf, mid, &r);
    if (r.ok) {
      hi = mid;
      *at = r;
    } else {
      lo = mid;
    }
  }
  return hi;
}


const tool_command_t bench_streams_command = {
    "bench-streams", NULL, "[--json] [--quick]",
    "memory saved by cross-stream reuse on a multi-stream serving workload",
    "\n"
    "Peak reserved memory of a multi-stream inference server's workload with PyTorch's per-stream\n"
    "caching and with gcalloc's cross-stream reuse, measured in the same run (docs/streams.md).\n"
    "\n"
    "  --json      the figures as JSON\n"
    "  --quick     fewer requests (a smoke test, not figures to quote)\n"
    "  -h, --help  this help\n",
    bench_streams_main};

int bench_streams_main(int argc, char **argv) {
  bool json = false, quick = false;
  const tool_option_t options[] = {
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {"--quick", OPTION_FLAG, &quick, 0, 0, NULL},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&bench_streams_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  int requests = quick ? 40 : 200;
  const scenario_t scenarios[] = {
      {"serving: 4 streams, 1 request in flight", 1, requests, 1},
      {"serving: 4 streams, 2 requests in flight", 2, requests, 2},
      {"serving: 4 streams, 3 requests in flight", 3, requests, 3},
  };
  const struct {
    const char *label, *conf;
  } policies[] = {{"per-stream cache (PyTorch)", "cross_stream_reuse:False"},
                  {"cross_stream_reuse:True", "cross_stream_reuse:True"},
                  {"cross_stream_reuse:1", "cross_stream_reuse:1"}};
  enum { POLICIES = sizeof policies / sizeof policies[0] };
  const struct {
    int engines;
    const char *label;
  } models[] = {{1, "one engine (streams share the device)"}, {0, "unlimited engines (streams fully parallel)"}};
  const size_t unlimited = (size_t)4 << 40;
  const size_t n_scenarios = sizeof scenarios / sizeof scenarios[0];
  int failures = 0;
  if (json) printf("{\n  \"runs\": [\n");
  for (size_t m = 0; m < 2; m++)
    for (size_t s = 0; s < n_scenarios; s++) {
      const scenario_t *sc = &scenarios[s];
      int engines = models[m].engines;
      run_result_t res[POLICIES], at_min[POLICIES];
      size_t cap[POLICIES];
      for (int p = 0; p < POLICIES; p++) {
        run_scenario(sc, engines, policies[p].conf, unlimited, &res[p]);
        if (!res[p].ok || res[p].hazards) {
          fprintf(stderr, "gcalloc bench-streams: %s, %s: %s\n", sc->name, policies[p].label,
                  res[p].hazards ? "hazard seen by the sim" : res[p].error);
          return 1;
        }
        memset(&at_min[p], 0, sizeof at_min[p]);
        cap[p] = min_capacity(sc, engines, policies[p].conf, (size_t)res[p].peak_allocated,
                              (size_t)res[p].peak_reserved, &at_min[p]);
        if (!cap[p]) failures++;
      }
      bool last = m == 1 && s + 1 == n_scenarios;
      if (json) {
        printf("    {\"scenario\": \"%s\", \"device\": \"%s\", \"requests\": %d, \"policies\": [\n", sc->name,
               models[m].label, sc->requests);
        for (int p = 0; p < POLICIES; p++)
          printf("      {\"policy\": \"%s\", \"ops\": %zu, \"peak_allocated_bytes\": %" PRId64
                 ", \"peak_reserved_bytes\": %" PRId64 ", \"device_allocs\": %" PRId64
                 ", \"cross_stream_reuses\": %" PRId64 ", \"stream_waits\": %" PRIu64 ", \"makespan_ns\": %" PRIu64
                 ", \"min_capacity_bytes\": %zu, \"retries_at_min_capacity\": %" PRId64
                 ", \"peak_reserved_saved\": %.4f, \"makespan_ratio\": %.4f}%s\n",
                 policies[p].label, res[p].ops, res[p].peak_allocated, res[p].peak_reserved, res[p].device_allocs,
                 res[p].cross_reuses, res[p].stream_waits, res[p].makespan_ns, cap[p], at_min[p].retries,
                 1.0 - (double)res[p].peak_reserved / (double)res[0].peak_reserved,
                 (double)res[p].makespan_ns / (double)res[0].makespan_ns, p + 1 < POLICIES ? "," : "");
        printf("    ]}%s\n", last ? "" : ",");
      } else {
        printf("%s, %d requests (%zu ops); %s\n", sc->name, sc->requests, res[0].ops, models[m].label);
        printf("  %-27s %8s %8s %7s %6s %6s %6s %8s %8s %8s %7s %7s\n", "policy", "peak GiB", "reserved",
               "res/alc", "saved", "dev.al", "reuses", "waits", "makespan", "/PyTorch", "min GiB", "retries");
        for (int p = 0; p < POLICIES; p++)
          printf("  %-27s %8.2f %8.2f %7.3f %5.1f%% %6" PRId64 " %6" PRId64 " %8" PRIu64
                 " %6.1fms %8.3f %7.2f %7" PRId64 "\n",
                 policies[p].label, gib(res[p].peak_allocated), gib(res[p].peak_reserved),
                 (double)res[p].peak_reserved / (double)res[p].peak_allocated,
                 100.0 * (1.0 - (double)res[p].peak_reserved / (double)res[0].peak_reserved), res[p].device_allocs,
                 res[p].cross_reuses, res[p].stream_waits, (double)res[p].makespan_ns / 1e6,
                 (double)res[p].makespan_ns / (double)res[0].makespan_ns, gib((int64_t)cap[p]), at_min[p].retries);
        printf("\n");
      }
    }
  if (json) printf("  ]\n}\n");
  return failures ? 1 : 0;
}
