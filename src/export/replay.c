/* Replaying a trace on the simulated device (docs/replay.md).
 *
 * Per device of the trace, in three steps:
 *  1. The start state. Recording rarely starts with an empty device: the
 *     allocations live at its start are found by walking back from the
 *     snapshot's final blocks (an alloc in the trace was not live before
 *     it; a free in the trace was), and are allocated first, in address
 *     order ("seeded"). PyTorch's reserved memory at the start is found the
 *     same way from the final segments and the segment events.
 *  2. The operations: each alloc a new slot, each free_completed (the
 *     release) frees its slot, and a run of recorded segment frees that the
 *     replay did not cause stands for an empty_cache() call of the job.
 *  3. Two runs on a fresh simulated device: one timed (peaks, device calls,
 *     the first OOM with --capacity), one with history on after the seeding,
 *     whose segment events are matched in order against the recorded ones
 *     (longest common subsequence of (action, size)): how many of PyTorch's
 *     own decisions gcalloc reproduced.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../internal.h"
#include "replay.h"

typedef enum { OP_ALLOC, OP_FREE, OP_EMPTY_CACHE } op_kind;

typedef struct op {
  uint8_t kind;
  uint32_t slot;
  uint64_t size;
  gca_stream_t stream;
} op_t;

typedef struct seg_event {
  bool alloc; /* segment_alloc/map; else free/unmap */
  uint64_t size;
} seg_event_t;

/* Address -> value, open addressing, for the walks over one device. */
typedef struct addr_map {
  uint64_t *keys; /* addr + 1; 0 empty; UINT64_MAX deleted */
  uint64_t *vals;
  size_t cap, used;
} addr_map_t;

static size_t map_find(const addr_map_t *m, uint64_t addr, bool for_insert) {
  uint64_t key = addr + 1;
  size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & (m->cap - 1), tomb = SIZE_MAX;
  while (m->keys[i]) {
    if (m->keys[i] == key) return i;
    if (m->keys[i] == UINT64_MAX && tomb == SIZE_MAX) tomb = i;
    i = (i + 1) & (m->cap - 1);
  }
  return for_insert && tomb != SIZE_MAX ? tomb : i;
}

static bool map_init(addr_map_t *m, size_t expected) {
  m->cap = 1024;
  while (m->cap < expected * 2 + 16) m->cap *= 2;
  m->keys = calloc(m->cap, sizeof *m->keys);
  m->vals = calloc(m->cap, sizeof *m->vals);
  m->used = 0;
  return m->keys && m->vals;
}

static void map_free(addr_map_t *m) {
  free(m->keys);
  free(m->vals);
}

/* Returns a pointer to the value of addr, or NULL. */
static uint64_t *map_get(addr_map_t *m, uint64_t addr) {
  size_t i = map_find(m, addr, false);
  return m->keys[i] == addr + 1 ? &m->vals[i] : NULL;
}

static void map_put(addr_map_t *m, uint64_t addr, uint64_t val) {
  size_t i = map_find(m, addr, true);
  if (m->keys[i] != addr + 1) m->used++;
  m->keys[i] = addr + 1;
  m->vals[i] = val;
}

static void map_del(addr_map_t *m, uint64_t addr) {
  size_t i = map_find(m, addr, false);
  if (m->keys[i] == addr + 1) m->keys[i] = UINT64_MAX;
}

typedef struct device_plan {
  op_t *ops;
  size_t count, cap;
  size_t seeded, allocs;
  seg_event_t *recorded;
  size_t recorded_count;
  int64_t recorded_peak;
} device_plan_t;

static bool plan_push(device_plan_t *p, op_t op) {
  if (p->count == p->cap) {
    op_t *grown = grow_array(p->ops, &p->cap, sizeof *grown, 4096);
    if (!grown) return false;
    p->ops = grown;
  }
  p->ops[p->count++] = op;
  return true;
}

typedef struct seed {
  uint64_t addr, size;
  gca_stream_t stream;
} seed_t;

static int compare_seeds(const void *x, const void *y) {
  const seed_t *a = x, *b = y;
  return a->addr < b->addr ? -1 : a->addr > b->addr;
}

static bool is_release(trace_action a) { return a == TA_FREE_COMPLETED || a == TA_FREE_REQUESTED; }
static bool is_segment_up(trace_action a) { return a == TA_SEGMENT_ALLOC || a == TA_SEGMENT_MAP; }
static bool is_segment_down(trace_action a) { return a == TA_SEGMENT_FREE || a == TA_SEGMENT_UNMAP; }

/* Steps 1 and 2 for device d. */
static int plan_device(const trace_t *t, int d, const replay_options_t *o, device_plan_t *p) {
  memset(p, 0, sizeof *p);
  size_t n = 0;
  for (size_t i = 0; i < t->count; i++) n += t->events[i].device == d;
  addr_map_t live; /* addr -> requested size + 1 (streams kept apart below) */
  addr_map_t streams;
  if (!map_init(&live, n + t->final_block_count) || !map_init(&streams, n + t->final_block_count)) {
    map_free(&live);
    map_free(&streams);
    return set_error(GCA_ERR_NOMEM, "out of host memory planning a replay");
  }
  for (size_t i = 0; i < t->final_block_count; i++) {
    const trace_block_t *b = &t->final_blocks[i];
    if (b->device != d || !b->active) continue;
    map_put(&live, b->addr, b->requested + 1);
    map_put(&streams, b->addr, b->stream);
  }
  /* Walk back: what was live before the first event. */
  int64_t reserved = 0;
  for (size_t i = 0; i < t->final_segment_count; i++)
    if (t->final_segments[i].device == d) reserved += (int64_t)t->final_segments[i].size;
  size_t segment_events = 0;
  for (size_t k = t->count; k-- > 0;) {
    const trace_event_t *e = &t->events[k];
    if (e->device != d) continue;
    if (e->action == TA_ALLOC) map_del(&live, e->addr);
    else if (is_release(e->action) && !map_get(&live, e->addr)) {
      map_put(&live, e->addr, e->size + 1);
      map_put(&streams, e->addr, e->stream);
    } else if (is_segment_up(e->action)) {
      reserved -= (int64_t)e->size;
      segment_events++;
    } else if (is_segment_down(e->action)) {
      reserved += (int64_t)e->size;
      segment_events++;
    }
  }
  /* The seeds, in address order. */
  seed_t *seeds = malloc((live.used + 1) * sizeof *seeds);
  p->recorded = malloc((segment_events + 1) * sizeof *p->recorded);
  if (!seeds || !p->recorded) {
    free(seeds);
    map_free(&live);
    map_free(&streams);
    return set_error(GCA_ERR_NOMEM, "out of host memory planning a replay");
  }
  size_t ns = 0;
  for (size_t i = 0; i < live.cap; i++) {
    if (!live.keys[i] || live.keys[i] == UINT64_MAX) continue;
    uint64_t addr = live.keys[i] - 1;
    uint64_t *stream = map_get(&streams, addr);
    seeds[ns++] = (seed_t){addr, live.vals[i] - 1, stream ? (gca_stream_t)*stream : 0};
  }
  qsort(seeds, ns, sizeof *seeds, compare_seeds);

  /* Forward: slots for the seeds, then the events. `live` now maps an
   * address to its slot + 1. */
  map_free(&live);
  map_free(&streams);
  if (!map_init(&live, n + ns)) {
    free(seeds);
    return set_error(GCA_ERR_NOMEM, "out of host memory planning a replay");
  }
  uint32_t slots = 0;
  bool ok = true;
  for (size_t i = 0; i < ns && ok; i++) {
    map_put(&live, seeds[i].addr, ++slots);
    ok = plan_push(p, (op_t){OP_ALLOC, slots - 1, seeds[i].size, seeds[i].stream});
  }
  p->seeded = ns;
  int64_t peak = reserved;
  bool in_free_run = false;
  for (size_t k = 0; k < t->count && ok; k++) {
    const trace_event_t *e = &t->events[k];
    if (e->device != d) continue;
    if (is_segment_down(e->action) && e->size == 0) {
      /* gcalloc's own traces mark an empty_cache() call so. */
      if (!in_free_run && o->infer_empty_cache) ok = plan_push(p, (op_t){OP_EMPTY_CACHE, 0, 0, 0});
      in_free_run = true;
      continue;
    }
    if (is_segment_up(e->action) || is_segment_down(e->action)) {
      bool up = is_segment_up(e->action);
      reserved += up ? (int64_t)e->size : -(int64_t)e->size;
      if (reserved > peak) peak = reserved;
      p->recorded[p->recorded_count++] = (seg_event_t){up, e->size};
      if (!up && !in_free_run && o->infer_empty_cache) ok = plan_push(p, (op_t){OP_EMPTY_CACHE, 0, 0, 0});
      in_free_run = !up;
      continue;
    }
    if (e->action == TA_ALLOC) {
      in_free_run = false;
      map_put(&live, e->addr, ++slots);
      p->allocs++;
      ok = plan_push(p, (op_t){OP_ALLOC, slots - 1, e->size, (gca_stream_t)e->stream});
    } else if (e->action == TA_FREE_COMPLETED) {
      in_free_run = false;
      uint64_t *slot = map_get(&live, e->addr);
      if (!slot) continue; /* freed twice in the record, or never allocated: nothing to replay */
      ok = plan_push(p, (op_t){OP_FREE, (uint32_t)(*slot - 1), 0, 0});
      map_del(&live, e->addr);
    }
  }
  p->recorded_peak = t->has_segment_state ? peak : -1;
  free(seeds);
  map_free(&live);
  if (!ok) return set_error(GCA_ERR_NOMEM, "out of host memory planning a replay");
  return GCA_OK;
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Run the plan on a fresh device. With `history`, recording starts after the
 * seeds and *out_alloc receives the allocator still open (the caller takes
 * its snapshot); else it is closed. */
static int run_plan(const device_plan_t *p, const char *spec, const char *conf, bool history, replay_device_t *r,
                    gca_allocator_t **out_alloc) {
  gca_allocator_t *a;
  int rc = gca_open(spec, conf, &a);
  if (rc) return rc;
  void **ptrs = calloc(p->count + 1, sizeof *ptrs);
  if (!ptrs) {
    gca_close(a);
    return set_error(GCA_ERR_NOMEM, "out of host memory replaying");
  }
  double start = now_seconds();
  for (size_t i = 0; i < p->count; i++) {
    if (history && i == p->seeded) {
      size_t entries = 4 * (p->count - p->seeded) + 64;
      rc = gca_record_history(a, 1, GCA_CONTEXT_NONE, entries < ((size_t)1 << 26) ? entries : (size_t)1 << 26);
      if (rc) break;
    }
    const op_t *op = &p->ops[i];
    if (op->kind == OP_ALLOC) {
      ptrs[op->slot] = gca_malloc(a, op->size, 0, op->stream);
      if (!ptrs[op->slot] && op->size) {
        if (gca_last_status() != GCA_ERR_OOM) {
          rc = gca_last_status();
          break;
        }
        r->oom = true;
        r->oom_event = i;
        r->oom_size = op->size;
        snprintf(r->oom_message, sizeof r->oom_message, "%s", gca_last_error());
        break;
      }
    } else if (op->kind == OP_FREE) {
      if (ptrs[op->slot] && (rc = gca_free(a, ptrs[op->slot])) != GCA_OK) break;
      ptrs[op->slot] = NULL;
    } else {
      r->empty_cache_calls++;
      gca_empty_cache(a, 0);
    }
  }
  r->seconds = now_seconds() - start;
  gca_stats_t s;
  gca_get_stats(a, 0, &s);
  r->peak_requested = (uint64_t)s.requested_bytes[GCA_POOL_ALL].peak;
  r->peak_allocated = (uint64_t)s.allocated_bytes[GCA_POOL_ALL].peak;
  r->peak_reserved = (uint64_t)s.reserved_bytes[GCA_POOL_ALL].peak;
  r->device_allocs = (uint64_t)s.num_device_alloc;
  r->device_frees = (uint64_t)s.num_device_free;
  free(ptrs);
  if (history && rc == GCA_OK) *out_alloc = a;
  else gca_close(a);
  return rc;
}

/* Longest common subsequence of (action, size); two rows of the table. */
static size_t lcs(const seg_event_t *x, size_t n, const seg_event_t *y, size_t m) {
  size_t *prev = calloc(m + 1, sizeof *prev), *cur = calloc(m + 1, sizeof *cur);
  if (!prev || !cur) {
    free(prev);
    free(cur);
    return 0;
  }
  for (size_t i = 1; i <= n; i++) {
    for (size_t j = 1; j <= m; j++) {
      bool same = x[i - 1].alloc == y[j - 1].alloc && x[i - 1].size == y[j - 1].size;
      cur[j] = same ? prev[j - 1] + 1 : (prev[j] > cur[j - 1] ? prev[j] : cur[j - 1]);
    }
    size_t *tmp = prev;
    prev = cur;
    cur = tmp;
  }
  size_t result = prev[m];
  free(prev);
  free(cur);
  return result;
}

/* gcalloc's segment events of the history run. */
static size_t replayed_segment_events(gca_allocator_t *a, seg_event_t **out) {
  gca_snapshot_t *s;
  *out = NULL;
  if (gca_snapshot_take(a, &s) != GCA_OK) return 0;
  size_t n = 0;
  seg_event_t *ev = malloc((s->trace_counts[0] + 1) * sizeof *ev);
  for (size_t i = 0; ev && i < s->trace_counts[0]; i++) {
    const gca_trace_entry_t *e = &s->device_traces[0][i];
    if (e->action == GCA_TRACE_SEGMENT_ALLOC || e->action == GCA_TRACE_SEGMENT_MAP)
      ev[n++] = (seg_event_t){true, e->size};
    else if (e->action == GCA_TRACE_SEGMENT_FREE || e->action == GCA_TRACE_SEGMENT_UNMAP)
      ev[n++] = (seg_event_t){false, e->size};
  }
  gca_snapshot_free(s);
  *out = ev;
  return n;
}

int replay_trace(const trace_t *t, const replay_options_t *o, replay_result_t *out) {
  memset(out, 0, sizeof *out);
  const char *conf = o->conf ? o->conf : (t->settings ? t->settings : "");
  snprintf(out->conf, sizeof out->conf, "%s", conf);
  char spec[96];
  /* Unlimited: the sim's largest device, so no trace meets its end. */
  snprintf(spec, sizeof spec, "sim:capacity=%llu",
           (unsigned long long)(o->capacity ? o->capacity : (uint64_t)8 << 40));
  int first = o->device >= 0 ? o->device : 0;
  int last = o->device >= 0 ? o->device : t->device_count - 1;
  if (o->device >= t->device_count)
    return set_error(GCA_ERR_INVALID, "the trace has no device %d (it has %d)", o->device, t->device_count);
  out->devices = calloc((size_t)(last - first + 1) + 1, sizeof *out->devices);
  if (!out->devices) return set_error(GCA_ERR_NOMEM, "out of host memory replaying");
  int rc = GCA_OK;
  for (int d = first; d <= last && rc == GCA_OK; d++) {
    device_plan_t p;
    rc = plan_device(t, d, o, &p);
    replay_device_t *r = &out->devices[out->device_count++];
    r->device = d;
    if (rc == GCA_OK) {
      r->seeded = p.seeded;
      r->events = p.count - p.seeded;
      r->recorded_peak_reserved = p.recorded_peak;
      r->segment_events_recorded = p.recorded_count;
      rc = run_plan(&p, spec, conf, false, r, NULL);
    }
    if (rc == GCA_OK) {
      /* The fidelity run: the same plan, history on after the seeds. */
      replay_device_t again;
      memset(&again, 0, sizeof again);
      gca_allocator_t *a = NULL;
      rc = run_plan(&p, spec, conf, true, &again, &a);
      if (rc == GCA_OK) {
        seg_event_t *mine;
        size_t n = replayed_segment_events(a, &mine);
        r->segment_events_matched = lcs(p.recorded, p.recorded_count, mine, n);
        free(mine);
        gca_close(a);
      }
    }
    free(p.ops);
    free(p.recorded);
  }
  if (rc) replay_result_free(out);
  return rc;
}

void replay_result_free(replay_result_t *r) {
  free(r->devices);
  memset(r, 0, sizeof *r);
}
