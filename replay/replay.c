/* Replaying a trace on the simulated device (docs/replay.md).
 *
 * Per device of the trace, in three steps:
 *  1. The start state. Recording rarely starts with an empty device: the
 *     allocations live at its start are those a walk back from the
 *     snapshot's final blocks finds (an alloc in the trace was not live
 *     before it; a free in the trace was; plan_device tells it per address
 *     going forward), and are allocated first, in address order
 *     ("seeded"). PyTorch's reserved memory at the start is found the
 *     same way from the final segments and the segment events, and, where
 *     the record tells them, the segments themselves: the seeds are then
 *     made in those, at their recorded offsets, with the memory PyTorch
 *     had cached between them ("the start as PyTorch had it" below), and
 *     every segment is placed where the record had it.
 *  2. The operations: each alloc a new slot, each free_completed (the
 *     release) frees its slot, and a run of recorded segment frees that the
 *     replay did not cause stands for an empty_cache() call of the job.
 *  3. One run on a fresh simulated device: the peaks, the device calls, the
 *     first OOM with a capacity, and gcalloc's segment events after the
 *     seeding (seen through the device's segment observer), matched in order
 *     against the recorded ones (longest common subsequence of (action,
 *     size)): how many of PyTorch's own decisions gcalloc reproduced. With a
 *     timeline, the memory after every operation is kept, and a second run
 *     stops at the peak to take the segment map.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <unistd.h>

#include "backends/sim_driver.h"
#include "base/base.h"
#include "core/inspect.h"
#include "replay.h"
#include "util.h"

typedef enum { OP_ALLOC, OP_FREE, OP_EMPTY_CACHE } op_kind;

typedef struct op {
  uint8_t kind;
  uint32_t slot;
  uint64_t size;
  gca_stream_t stream;
  int64_t recorded_reserved; /* PyTorch's reserved bytes at this point of the record */
} op_t;

typedef struct seed {
  uint64_t addr, size;
  gca_stream_t stream;
  uint32_t state; /* its addr_state_t */
  uint64_t block; /* its block's size when the record tells it (live to the end: a final block), else 0 */
} seed_t;

/* A segment PyTorch had when recording began, and the seeds inside it:
 * seeds[first .. first + count), in address order. */
typedef struct start_segment {
  uint64_t addr, size;
  gca_stream_t stream;
  size_t first, count;
} start_segment_t;

typedef struct device_plan {
  op_t *ops;
  size_t count, cap;
  size_t seeded, allocs;
  seed_t *seeds;            /* the seeds in address order (seed i's slot is i); the first `seeded` ops make them */
  start_segment_t *starts;  /* PyTorch's segments at the start, in address order (none: unknown) */
  size_t start_count;
  /* Where the simulator is to put segments (sim_set_placement): the start
   * segments first (place_starts of them), then each recorded
   * segment_alloc, at their recorded addresses. */
  sim_place_t *places;
  size_t place_count, place_starts;
  uint64_t place_origin; /* the lowest of those addresses */
  seg_event_t *recorded;
  size_t recorded_count;
  int64_t recorded_peak;
  uint32_t *slot_stacks; /* slot -> its alloc's stack (trace_t.event_stacks; 0 for seeds); NULL: the trace has none */
} device_plan_t;

static bool is_release(trace_action a) { return a == TA_FREE_COMPLETED || a == TA_FREE_REQUESTED; }
static bool is_segment_up(trace_action a) { return a == TA_SEGMENT_ALLOC || a == TA_SEGMENT_MAP; }
static bool is_segment_down(trace_action a) { return a == TA_SEGMENT_FREE || a == TA_SEGMENT_UNMAP; }

/* What the plan knows of one address of the device. */
typedef struct addr_state {
  uint64_t addr;
  int64_t final_block;   /* index in final_blocks of an active block there (the last), or -1 */
  int64_t early_release; /* the last release (free_requested or _completed) before its first alloc, or -1 */
  bool allocated;        /* an alloc seen (pass 1) */
  uint32_t live_slot;    /* pass 2: slot + 1 of the allocation live there, or 0 */
} addr_state_t;

/* The plan's address index: address -> state, open addressing with linear
 * probing, never deleting, so that one probe finds an address or says where
 * to put it (the general addr_map takes a get and then a put for a new one).
 * A slot holds the address with its state, so a probe touches one line. */
typedef struct state_slot {
  uint64_t addr;
  uint32_t state_plus1; /* 0: empty (any address, UINT64_MAX too, can be a key) */
} state_slot_t;

typedef struct addr_states {
  state_slot_t *slots;
  size_t slot_mask; /* slots - 1, a power of two less one */
  addr_state_t *states;
  size_t count, cap;
} addr_states_t;

static size_t state_home(const addr_states_t *as, uint64_t addr) {
  return (size_t)((addr * 0x9E3779B97F4A7C15ull) >> 32) & as->slot_mask;
}

/* Doubles the index (at half full), or makes it with `first` slots (a
 * power of two); false when the host is out of memory. */
static bool states_rehash(addr_states_t *as, size_t first) {
  size_t n = as->slots ? 2 * (as->slot_mask + 1) : first;
  state_slot_t *slots = calloc(n, sizeof *slots);
  if (!slots) return false;
  addr_states_t bigger = {slots, n - 1, NULL, 0, 0};
  for (size_t i = 0; as->slots && i <= as->slot_mask; i++) {
    if (!as->slots[i].state_plus1) continue;
    size_t j = state_home(&bigger, as->slots[i].addr);
    while (slots[j].state_plus1) j = (j + 1) & bigger.slot_mask;
    slots[j] = as->slots[i];
  }
  free(as->slots);
  as->slots = slots;
  as->slot_mask = n - 1;
  return true;
}

/* The state of addr, made if new; UINT32_MAX when the host is out of memory. */
static inline uint32_t state_of(addr_states_t *as, uint64_t addr) {
  size_t i = state_home(as, addr);
  for (; as->slots[i].state_plus1; i = (i + 1) & as->slot_mask)
    if (as->slots[i].addr == addr) return as->slots[i].state_plus1 - 1;
  if (as->count == as->cap) {
    addr_state_t *grown = gca__grow_array(as->states, &as->cap, sizeof *grown, 1024);
    if (!grown) return UINT32_MAX;
    as->states = grown;
  }
  if (as->count >= UINT32_MAX - 1) return UINT32_MAX;
  if (2 * (as->count + 1) > as->slot_mask + 1) {
    if (!states_rehash(as, 0)) return UINT32_MAX;
    for (i = state_home(as, addr); as->slots[i].state_plus1; i = (i + 1) & as->slot_mask) {}
  }
  as->slots[i] = (state_slot_t){addr, (uint32_t)as->count + 1};
  as->states[as->count] = (addr_state_t){addr, -1, -1, false, 0};
  return (uint32_t)as->count++;
}

/* Sorts the seeds by address: least significant byte first, skipping the
 * bytes all addresses share (device addresses differ in a few), a pass of
 * counting each. qsort's calls through a pointer took 20-30 us for the 622
 * seeds of a real trace, a sixth of the plan. tmp holds n seeds. */
static void sort_seeds(seed_t *seeds, seed_t *tmp, size_t n) {
  uint64_t all_or = 0, all_and = UINT64_MAX;
  for (size_t i = 0; i < n; i++) {
    all_or |= seeds[i].addr;
    all_and &= seeds[i].addr;
  }
  for (int shift = 0; shift < 64; shift += 8) {
    if ((((all_or ^ all_and) >> shift) & 0xff) == 0) continue; /* the same byte in every address */
    size_t start[257] = {0};
    for (size_t i = 0; i < n; i++) start[((seeds[i].addr >> shift) & 0xff) + 1]++;
    for (int b = 0; b < 256; b++) start[b + 1] += start[b];
    for (size_t i = 0; i < n; i++) tmp[start[(seeds[i].addr >> shift) & 0xff]++] = seeds[i];
    memcpy(seeds, tmp, n * sizeof *seeds);
  }
}

/* Where a device's events lie in the trace: from its first to past its
 * last (lo == hi: none). A trace's readers group events by device, so a
 * device's plan looks at its own events only, not at every event of the
 * trace three times (a tenth of the replay of a four-device snapshot). */
typedef struct event_span {
  size_t lo, hi;
} event_span_t;

/* A segment event of the device, for plan_start_segments: where it was in
 * the trace orders an address's events. */
typedef struct segment_seen {
  uint64_t addr, size, stream;
  size_t at;
  bool up;
} segment_seen_t;

static int by_addr_then_order(const void *x, const void *y) {
  const segment_seen_t *a = x, *b = y;
  if (a->addr != b->addr) return a->addr < b->addr ? -1 : 1;
  return a->at < b->at ? -1 : a->at > b->at;
}

static int by_start_addr(const void *x, const void *y) {
  const start_segment_t *a = x, *b = y;
  return a->addr < b->addr ? -1 : a->addr > b->addr;
}

/* The segments PyTorch had when recording began: the final segments less
 * those the trace allocated, with those it freed (an address's first
 * segment event says which: a free, it was there with that size; an
 * alloc, it was not), each with the seeds inside it. Only for plain
 * segments (a segment_map means expandable ones, whose start is not a
 * list of segments), and only when they add up to the reserved bytes the
 * plan found at the start and do not overlap; else none, and the seeds are
 * made as the allocator places them. False only when the host is out of
 * memory. */
static bool plan_start_segments(const trace_t *t, int d, event_span_t span, int64_t reserved, device_plan_t *p) {
  if (!t->has_segment_state || reserved <= 0) return true;
  size_t n = 0;
  for (size_t k = span.lo; k < span.hi; k++) {
    const trace_event_t *e = &t->events[k];
    if (e->device != d) continue;
    if (e->action == TA_SEGMENT_MAP || e->action == TA_SEGMENT_UNMAP) return true;
    n += (e->action == TA_SEGMENT_ALLOC || e->action == TA_SEGMENT_FREE) && e->size;
  }
  segment_seen_t *seen = malloc((n + 1) * sizeof *seen);
  start_segment_t *starts = malloc((n + t->final_segment_count + 1) * sizeof *starts);
  if (!seen || !starts) {
    free(seen);
    free(starts);
    return false;
  }
  n = 0;
  for (size_t k = span.lo; k < span.hi; k++) {
    const trace_event_t *e = &t->events[k];
    if (e->device == d && (e->action == TA_SEGMENT_ALLOC || e->action == TA_SEGMENT_FREE) && e->size)
      seen[n++] = (segment_seen_t){e->addr, e->size, e->stream, k, e->action == TA_SEGMENT_ALLOC};
  }
  qsort(seen, n, sizeof *seen, by_addr_then_order);
  size_t count = 0;
  for (size_t i = 0; i < n; i++)
    if ((i == 0 || seen[i].addr != seen[i - 1].addr) && !seen[i].up)
      starts[count++] = (start_segment_t){seen[i].addr, seen[i].size, (gca_stream_t)seen[i].stream, 0, 0};
  for (size_t i = 0; i < t->final_segment_count; i++) {
    const trace_segment_t *f = &t->final_segments[i];
    if (f->device != d) continue;
    /* Untouched by the trace: there from the start. */
    size_t lo = 0, hi = n;
    while (lo < hi) {
      size_t mid = lo + (hi - lo) / 2;
      if (seen[mid].addr < f->addr) lo = mid + 1;
      else hi = mid;
    }
    if (lo == n || seen[lo].addr != f->addr)
      starts[count++] = (start_segment_t){f->addr, f->size, (gca_stream_t)f->stream, 0, 0};
  }
  free(seen);
  qsort(starts, count, sizeof *starts, by_start_addr);
  int64_t total = 0;
  bool whole = true;
  for (size_t i = 0; i < count && whole; i++) {
    total += (int64_t)starts[i].size;
    whole = !i || starts[i - 1].addr + starts[i - 1].size <= starts[i].addr;
  }
  if (!whole || total != reserved) {
    free(starts);
    return true;
  }
  /* The seeds inside each (both in address order). */
  size_t next = 0;
  for (size_t i = 0; i < count; i++) {
    start_segment_t *st = &starts[i];
    while (next < p->seeded && p->seeds[next].addr < st->addr) next++;
    st->first = next;
    while (next < p->seeded && p->seeds[next].addr - st->addr < st->size) next++;
    st->count = next - st->first;
  }
  p->starts = starts;
  p->start_count = count;
  return true;
}

/* A seed in a large start segment, freed during the record, with more than
 * 1 MiB free after its rounded size: its block may have kept up to 1 MiB
 * of that unsplit (PyTorch splits a large block only above it), and the
 * record gives a freed block's requested size only. While it is live, no
 * request lands in its tail, and the first one served from the free block
 * after it lands at that block's start, the tail's end: so the record's
 * first allocation in [rounded end, rounded end + 1 MiB] before the seed
 * is freed tells its block's size. (Where there is none, the tail stays
 * unknown and is taken as none.) */
typedef struct tail_window {
  uint64_t lo, hi; /* the addresses its tail's end may be at */
  size_t seed;     /* its index */
  size_t freed_at; /* the trace index of its release */
  bool told;
} tail_window_t;

static bool plan_tails(const trace_t *t, int d, event_span_t span, const addr_states_t *as, device_plan_t *p) {
  size_t n = 0;
  for (size_t i = 0; i < p->start_count; i++) n += p->starts[i].size == SMALL_BUFFER ? 0 : p->starts[i].count;
  if (!n) return true;
  tail_window_t *w = malloc(n * sizeof *w);
  if (!w) return false;
  n = 0;
  for (size_t i = 0; i < p->start_count; i++) {
    const start_segment_t *st = &p->starts[i];
    if (st->size == SMALL_BUFFER) continue;
    for (size_t k = st->first; k < st->first + st->count; k++) {
      const seed_t *sd = &p->seeds[k];
      const addr_state_t *state = &as->states[sd->state];
      uint64_t end = sd->addr + (sd->size + MIN_BLOCK_SIZE - 1) / MIN_BLOCK_SIZE * MIN_BLOCK_SIZE;
      uint64_t next = k + 1 < st->first + st->count ? p->seeds[k + 1].addr : st->addr + st->size;
      if (sd->block || state->early_release < 0 || end >= next || next - end <= SMALL_SIZE) continue;
      w[n++] = (tail_window_t){end, end + SMALL_SIZE, k, (size_t)state->early_release, false};
    }
  }
  /* The windows lie in different gaps, in address order. */
  for (size_t k = span.lo; n && k < span.hi; k++) {
    const trace_event_t *e = &t->events[k];
    if (e->device != d || e->action != TA_ALLOC) continue;
    size_t lo = 0, hi = n;
    while (lo < hi) {
      size_t mid = lo + (hi - lo) / 2;
      if (w[mid].hi < e->addr) lo = mid + 1;
      else hi = mid;
    }
    if (lo < n && !w[lo].told && w[lo].lo <= e->addr && k < w[lo].freed_at) {
      w[lo].told = true;
      p->seeds[w[lo].seed].block = e->addr - p->seeds[w[lo].seed].addr;
    }
  }
  free(w);
  return true;
}

/* Where PyTorch's segments lay: the start's, then each segment_alloc of the
 * record (added in pass 2), in order, at its address. gcalloc's best fit,
 * as PyTorch's, breaks ties between free blocks of one size by address, so
 * the simulator is asked to put each segment where the record had it
 * (relative to the lowest), not in its own order; a segment the replay
 * asks for that the record does not have goes where the simulator finds
 * room. Room for the start's and `segment_events` more; false only when
 * the host is out of memory. */
static bool plan_places(device_plan_t *p, size_t segment_events) {
  if (!(p->places = malloc((p->start_count + segment_events + 1) * sizeof *p->places))) return false;
  p->place_origin = UINT64_MAX;
  for (size_t i = 0; i < p->start_count; i++) {
    p->places[p->place_count++] = (sim_place_t){p->starts[i].size, p->starts[i].addr};
    p->place_origin = p->starts[i].addr < p->place_origin ? p->starts[i].addr : p->place_origin;
  }
  p->place_starts = p->place_count;
  return true;
}

static void plan_free(device_plan_t *p) {
  gca__big_free(p->ops, p->cap * sizeof *p->ops);
  free(p->recorded);
  free(p->seeds);
  free(p->starts);
  free(p->places);
  free(p->slot_stacks);
  memset(p, 0, sizeof *p);
}

/* Steps 1 and 2 for device d, in two passes over its events with one
 * address lookup per alloc or release (three or four were a third of the time of
 * replaying a trace).
 *
 * Step 1 is the walk back from the final blocks (going back, an alloc takes
 * its address out of the live set and a release puts it in if absent), told
 * per address from the forward order: the address is live at the start if
 * its first alloc or release is a release, or if it has neither and holds
 * an active final block. What was live there is the last release before the
 * first alloc (the one the walk back puts in last), or the final block when
 * the address is never allocated. */
static int plan_device(const trace_t *t, int d, event_span_t span, const replay_options_t *o, device_plan_t *p) {
  memset(p, 0, sizeof *p);
  size_t n = 0;
  for (size_t i = span.lo; i < span.hi; i++) n += t->events[i].device == d;
  addr_states_t as = {0};
  uint32_t *state_at = malloc((n + 1) * sizeof *state_at); /* per event of the device, for pass 2 */
  seed_t *seeds = NULL;
  /* The index sized for the addresses expected: the real traces reuse
   * 3-13% of their events' addresses (a small log, half), and a table of
   * 4,096 slots, 64 KiB, cost a small log's new process 15 page faults
   * (36 us) for nothing; from 64 to 4,096 slots, it grows when half full. */
  size_t expected = n / 8;
  for (size_t i = 0; i < t->final_block_count; i++) expected += t->final_blocks[i].device == d;
  size_t first_slots = 64;
  while (first_slots < 4096 && first_slots < 2 * expected) first_slots *= 2;
  bool ok = states_rehash(&as, first_slots) && state_at;
  for (size_t i = 0; ok && i < t->final_block_count; i++) {
    const trace_block_t *b = &t->final_blocks[i];
    if (b->device != d || !b->active) continue;
    uint32_t s = state_of(&as, b->addr);
    if (!(ok = s != UINT32_MAX)) break;
    as.states[s].final_block = (int64_t)i;
  }
  /* Pass 1: first allocs and early releases; PyTorch's reserved bytes at
   * the start (the final segments less what the segment events added). */
  int64_t reserved = 0;
  for (size_t i = 0; i < t->final_segment_count; i++)
    if (t->final_segments[i].device == d) reserved += (int64_t)t->final_segments[i].size;
  size_t segment_events = 0, j = 0;
  for (size_t k = span.lo; ok && k < span.hi; k++) {
    const trace_event_t *e = &t->events[k];
    if (e->device != d) continue;
    state_at[j] = UINT32_MAX;
    if (e->action == TA_ALLOC || is_release(e->action)) {
      uint32_t s = state_of(&as, e->addr);
      if (!(ok = s != UINT32_MAX)) break;
      state_at[j] = s;
      /* Without branches: whether an event is an alloc or a release
       * follows no pattern a predictor learns. */
      addr_state_t *st = &as.states[s];
      bool alloc = e->action == TA_ALLOC;
      st->early_release = !alloc && !st->allocated ? (int64_t)k : st->early_release;
      st->allocated |= alloc;
    } else if (is_segment_up(e->action) || is_segment_down(e->action)) {
      reserved += is_segment_up(e->action) ? -(int64_t)e->size : (int64_t)e->size;
      segment_events++;
    }
    j++;
  }
  /* The seeds, in address order. */
  size_t ns = 0;
  if (ok) {
    seeds = malloc(2 * (as.count + 1) * sizeof *seeds); /* (and the sort's room) */
    p->recorded = malloc((segment_events + 1) * sizeof *p->recorded);
    ok = seeds && p->recorded;
  }
  for (size_t i = 0; ok && i < as.count; i++) {
    const addr_state_t *st = &as.states[i];
    if (st->early_release >= 0 && (st->allocated || st->final_block < 0)) {
      const trace_event_t *e = &t->events[st->early_release];
      seeds[ns++] = (seed_t){st->addr, e->size, (gca_stream_t)trace_event_stream(t, e), (uint32_t)i, 0};
    } else if (!st->allocated && st->final_block >= 0) {
      const trace_block_t *b = &t->final_blocks[st->final_block];
      seeds[ns++] = (seed_t){st->addr, b->requested, (gca_stream_t)b->stream, (uint32_t)i, b->size};
    }
  }
  if (ok) sort_seeds(seeds, seeds + as.count + 1, ns);
  if (ok) {
    p->seeds = seeds;
    p->seeded = ns;
    ok = plan_start_segments(t, d, span, reserved, p) && plan_places(p, segment_events) &&
         plan_tails(t, d, span, &as, p);
  }

  /* Pass 2: slots for the seeds, then the events; at most one operation
   * each. */
  if (ok) {
    p->cap = n + ns + 1;
    /* A big array (util.c): in a new process it takes the mapping the
     * reader's memo left, already faulted in, instead of dozens of pages
     * of its own (a tenth of a new process's replay). */
    ok = (p->ops = gca__big_alloc(p->cap * sizeof *p->ops)) != NULL;
    if (ok && t->event_stacks) ok = (p->slot_stacks = calloc(p->cap, sizeof *p->slot_stacks)) != NULL;
  }
  uint32_t slots = 0;
  for (size_t i = 0; ok && i < ns; i++) {
    as.states[seeds[i].state].live_slot = ++slots;
    p->ops[p->count++] = (op_t){OP_ALLOC, slots - 1, seeds[i].size, seeds[i].stream, reserved};
  }
  int64_t peak = reserved;
  bool in_free_run = false;
  j = 0;
  for (size_t k = span.lo; k < span.hi && ok; k++) {
    const trace_event_t *e = &t->events[k];
    if (e->device != d) continue;
    uint32_t s = state_at[j++];
    if (is_segment_down(e->action) && e->size == 0) {
      /* gcalloc's own traces mark an empty_cache() call so. */
      if (!in_free_run && o->infer_empty_cache) p->ops[p->count++] = (op_t){OP_EMPTY_CACHE, 0, 0, 0, reserved};
      in_free_run = true;
      continue;
    }
    if (is_segment_up(e->action) || is_segment_down(e->action)) {
      bool up = is_segment_up(e->action);
      reserved += up ? (int64_t)e->size : -(int64_t)e->size;
      if (reserved > peak) peak = reserved;
      p->recorded[p->recorded_count++] = (seg_event_t){up, e->size};
      if (e->action == TA_SEGMENT_ALLOC && e->size) {
        p->places[p->place_count++] = (sim_place_t){e->size, e->addr};
        p->place_origin = e->addr < p->place_origin ? e->addr : p->place_origin;
      }
      if (!up && !in_free_run && o->infer_empty_cache)
        p->ops[p->count++] = (op_t){OP_EMPTY_CACHE, 0, 0, 0, reserved};
      in_free_run = !up;
      continue;
    }
    if (e->action == TA_ALLOC) {
      in_free_run = false;
      as.states[s].live_slot = ++slots;
      if (p->slot_stacks) p->slot_stacks[slots - 1] = t->event_stacks[k];
      p->allocs++;
      p->ops[p->count++] = (op_t){OP_ALLOC, slots - 1, e->size, (gca_stream_t)trace_event_stream(t, e), reserved};
    } else if (e->action == TA_FREE_COMPLETED) {
      in_free_run = false;
      uint32_t *live = &as.states[s].live_slot;
      if (!*live) continue; /* freed twice in the record, or never allocated: nothing to replay */
      p->ops[p->count++] = (op_t){OP_FREE, *live - 1, 0, 0, reserved};
      *live = 0;
    }
  }
  p->recorded_peak = t->has_segment_state ? peak : -1;
  if (!p->seeds) free(seeds);
  free(state_at);
  free(as.states);
  free(as.slots);
  if (!ok) {
    plan_free(p);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory planning a replay");
  }
  return GCA_OK;
}

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct seg_log {
  seg_event_t *events;
  size_t count, cap;
  bool failed;
} seg_log_t;

static void observe_segment(void *ctx, bool alloc, size_t size) {
  seg_log_t *log = ctx;
  if (log->count == log->cap) {
    seg_event_t *grown = gca__grow_array(log->events, &log->cap, sizeof *grown, 256);
    if (!grown) {
      log->failed = true;
      return;
    }
    log->events = grown;
  }
  log->events[log->count++] = (seg_event_t){alloc, size};
}

/* ---- the start as PyTorch had it ----------------------------------------
 * Seeded one by one, the allocations live at the start are packed into as
 * few segments as gcalloc would make for them; PyTorch, whose history is
 * not in the record, had them spread over the segments it had made, with
 * memory cached free between them (on real snapshots, a quarter more
 * reserved than live), and served the first requests of the record from that
 * cache. When the plan knows those segments (plan_start_segments), the
 * replay makes them, each at its recorded size, with the seeds at their
 * recorded offsets and the gaps free, through the allocator's own calls:
 * the segment is made whole (one request of its size; a small one, two
 * of 1 MiB) and freed, then carved in address order, each seed and each
 * gap's placeholder taking the low end of the segment's free rest, the
 * only free block of its pool while the segments carved before stay
 * covered; last the gaps' placeholders are freed and merge. A seed's
 * block is its rounded size, or, for a seed still live when recording
 * ended, the size the final state gives (PyTorch leaves a large block's
 * last megabyte or less unsplit); a gap a large segment cannot have held
 * free (1 MiB or less: PyTorch splits a large block only above that)
 * belongs to the seed before it. Such a block is carved as a placeholder,
 * freed before the gaps, and the seed then allocated into it (the only
 * free block again), unsplit. What no record tells is how much of a
 * larger gap after a seed freed during the record was its unsplit tail:
 * the replay takes none. A segment whose layout the settings could not
 * have made (sizes they round otherwise, a seed of the other pool, a seed
 * over its neighbour, a segment max_split_size makes oversize) keeps its
 * seeds to be made one by one after, as before. */

/* A piece of a start segment: a seed's block (seed >= 0) or a gap. */
typedef struct piece {
  uint64_t size;
  int64_t seed;
  bool tail;  /* a seed's block holding a gap after its rounded size (made by placeholder) */
  void *ptr;
} piece_t;

static bool add_gap(gca_allocator_t *a, bool small, uint64_t gap, piece_t *out, size_t *n, bool known) {
  if (gap % MIN_BLOCK_SIZE) return false;
  if (!small && gap && gap <= SMALL_SIZE) {
    /* (PyTorch leaves no such free block: it is the seed's before, unless
     * the record gave that one's size.) */
    if (!*n || out[*n - 1].seed < 0 || known) return false;
    out[*n - 1].size += gap;
    out[*n - 1].tail = true;
    return gca_round_size(a, out[*n - 1].size) == out[*n - 1].size;
  }
  while (gap) {
    uint64_t part = small && gap > SMALL_SIZE ? SMALL_SIZE : gap;
    if (gca_round_size(a, part) != part) return false;
    out[(*n)++] = (piece_t){part, -1, false, NULL};
    gap -= part;
  }
  return true;
}

/* The pieces of a start segment in address order, into out (room for
 * 3 * count + 4); 0 when the settings cannot make its layout. */
static size_t start_pieces(gca_allocator_t *a, const gca__settings_t *cfg, const start_segment_t *st, const seed_t *seeds, piece_t *out) {
  bool small = st->size == SMALL_BUFFER;
  if (small ? gca_round_size(a, SMALL_SIZE) != SMALL_SIZE
            : st->size < MIN_LARGE_ALLOC && st->size != LARGE_BUFFER) return 0;
  if (!small && (gca_round_size(a, st->size) != st->size || gca_segment_size(st->size) != st->size)) return 0;
  /* With a max_split_size, a segment at or above it is oversize: nothing
   * smaller is carved from it. */
  if (st->size >= cfg->max_split_size) return 0;
  size_t n = 0;
  uint64_t at = 0;
  bool known = false; /* the size of the last seed's block */
  for (size_t k = st->first; k < st->first + st->count; k++) {
    uint64_t off = seeds[k].addr - st->addr, rounded = gca_round_size(a, seeds[k].size);
    uint64_t block = seeds[k].block ? seeds[k].block : rounded;
    if (!rounded || block < rounded || small != (rounded <= SMALL_SIZE) || off < at || st->size - off < block)
      return 0;
    if (!add_gap(a, small, off - at, out, &n, known)) return 0;
    out[n++] = (piece_t){block, (int64_t)k, block > rounded, NULL};
    if (block > rounded && gca_round_size(a, block) != block) return 0;
    at = off + block;
    known = seeds[k].block != 0;
  }
  return add_gap(a, small, st->size - at, out, &n, known) ? n : 0;
}

/* A request of the seeding refused: out of memory is the replay's answer
 * (the first operation does not fit), anything else an error. */
static int seeding_refused(replay_device_t *r, uint64_t size) {
  if (gca_last_status() != GCA_ERR_OOM) return gca_last_status();
  r->oom = true;
  r->oom_event = 0;
  r->oom_size = size;
  snprintf(r->oom_message, sizeof r->oom_message, "%s", gca_last_error());
  return GCA_OK;
}

/* Whether the settings leave PyTorch's start to be made as it was: not
 * with expandable segments, which make no such segments. */
static bool start_as_recorded(gca_allocator_t *a) {
  gca__settings_t s;
  return gca__inspect_settings(a, &s) == GCA_OK && !s.expandable_segments;
}

/* The seeds, made in PyTorch's start segments where their layout allows
 * and one by one after for the rest: ptrs[i] is seed i. GCA_OK with
 * r->oom set when the device is too small for them. */
static int seed_as_recorded(gca_allocator_t *a, const device_plan_t *p, void **ptrs, replay_device_t *r) {
  gca__settings_t cfg;
  gca__inspect_settings(a, &cfg);
  size_t room = 3 * p->seeded + 4 * p->start_count + 4;
  piece_t *pieces = malloc(room * sizeof *pieces);
  bool *placed = calloc(p->seeded + 1, sizeof *placed);
  int rc = GCA_OK;
  if (!pieces || !placed) rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory replaying");
  size_t used = 0;
  for (size_t i = 0; rc == GCA_OK && !r->oom && i < p->start_count; i++) {
    const start_segment_t *st = &p->starts[i];
    size_t n = start_pieces(a, &cfg, st, p->seeds, pieces + used);
    if (!n) continue;
    r->start_segments++;
    /* The segment is made whole first, unless its first piece's request
     * makes one of its size anyway (a 2 MiB segment's, a 20 MiB one's
     * under 10 MiB: most of them), the pool having no free block then. */
    bool small = st->size == SMALL_BUFFER;
    const piece_t *lead = &pieces[used];
    uint64_t lead_request = lead->seed >= 0 && !lead->tail ? p->seeds[lead->seed].size : lead->size;
    if (gca_segment_size(gca_round_size(a, lead_request)) != st->size) {
      uint64_t whole = small ? SMALL_SIZE : st->size;
      void *first = gca_malloc(a, whole, 0, st->stream), *second = NULL;
      if (first && small) second = gca_malloc(a, whole, 0, st->stream);
      if (!first || (small && !second)) {
        if (first) gca_free(a, first);
        rc = seeding_refused(r, whole);
        break;
      }
      gca_free(a, first);
      if (second) gca_free(a, second);
    }
    for (size_t j = used; j < used + n; j++) {
      /* A seed whose block is its rounded size is made at once: its
       * request takes the same low end (a third of the calls). */
      piece_t *pc = &pieces[j];
      bool direct = pc->seed >= 0 && !pc->tail;
      const seed_t *seed = direct ? &p->seeds[pc->seed] : NULL;
      void *got = direct ? gca_malloc(a, seed->size, 0, seed->stream) : gca_malloc(a, pc->size, 0, st->stream);
      if (!got && (!direct || seed->size)) {
        rc = seeding_refused(r, direct ? seed->size : pc->size);
        break;
      }
      if (direct) ptrs[pc->seed] = got;
      else pc->ptr = got;
      if (pc->seed >= 0) placed[pc->seed] = true;
    }
    used += n;
  }
  /* Each seed with a tail into its block, then the gaps freed. */
  for (size_t j = 0; j < used; j++) {
    if (pieces[j].seed < 0 || !pieces[j].ptr) continue;
    const seed_t *seed = &p->seeds[pieces[j].seed];
    gca_free(a, pieces[j].ptr);
    pieces[j].ptr = NULL;
    if (rc == GCA_OK && !r->oom && !(ptrs[pieces[j].seed] = gca_malloc(a, seed->size, 0, seed->stream)) && seed->size)
      rc = seeding_refused(r, seed->size);
  }
  for (size_t j = 0; j < used; j++)
    if (pieces[j].ptr) gca_free(a, pieces[j].ptr);
  for (size_t k = 0; rc == GCA_OK && !r->oom && k < p->seeded; k++) {
    if (placed[k]) continue;
    const seed_t *seed = &p->seeds[k];
    if (!(ptrs[k] = gca_malloc(a, seed->size, 0, seed->stream)) && seed->size) rc = seeding_refused(r, seed->size);
  }
  free(pieces);
  free(placed);
  return rc;
}

/* Keep an out-of-memory message, naming the trace's device: each device is
 * replayed as device 0 of an allocator of its own, and gcalloc's message
 * says "Device 0 has a total capacity". */
static void name_device(replay_device_t *r, const char *message) {
  const char *own = "Device 0 has a total capacity", *at = strstr(message, own);
  if (!at || r->device == 0) {
    snprintf(r->oom_message, sizeof r->oom_message, "%s", message);
    return;
  }
  snprintf(r->oom_message, sizeof r->oom_message, "%.*sDevice %d has a total capacity%s", (int)(at - message), message,
           r->device, at + strlen(own));
}

static int origin_order(const void *x, const void *y) {
  const replay_origin_t *a = x, *b = y;
  return (a->addr > b->addr) - (a->addr < b->addr);
}

/* The blocks live at the peak (ptrs, by slot) that the report says more
 * of: those live since before recording, and those whose allocation's
 * stack the trace has; into r->peak_origins, by address. */
static int peak_origins(const device_plan_t *p, void *const *ptrs, replay_device_t *r) {
  size_t slots = p->seeded + p->allocs, n = 0;
  for (size_t k = 0; k < slots; k++) n += ptrs[k] && (k < p->seeded || (p->slot_stacks && p->slot_stacks[k]));
  if (!n) return GCA_OK;
  if (!(r->peak_origins = malloc(n * sizeof *r->peak_origins)))
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory replaying");
  for (size_t k = 0; k < slots; k++) {
    uint32_t stack = k < p->seeded ? REPLAY_BEFORE_RECORDING : p->slot_stacks ? p->slot_stacks[k] : 0;
    if (ptrs[k] && stack) r->peak_origins[r->peak_origin_count++] = (replay_origin_t){(uintptr_t)ptrs[k], stack};
  }
  qsort(r->peak_origins, n, sizeof *r->peak_origins, origin_order);
  return GCA_OK;
}

const replay_origin_t *replay_origin_at(const replay_device_t *d, uint64_t addr) {
  replay_origin_t key = {.addr = addr};
  return d->peak_origin_count
             ? bsearch(&key, d->peak_origins, d->peak_origin_count, sizeof key, origin_order)
             : NULL;
}

/* Run the plan on a fresh device, up to operation `stop_at` (SIZE_MAX: all
 * of it). With `log`, gcalloc's segment events after the seeds go there;
 * with `peak`, the state after operation stop_at: a snapshot (with
 * options.timeline) and the page census into peak->peak_pages; without it,
 * with options.page_census and no timeline, the census's counts at the
 * peak into r->peak_pages. */
static int run_plan(const device_plan_t *p, const char *spec, const char *conf, const replay_options_t *o,
                    size_t stop_at, seg_log_t *log, replay_device_t *r, replay_device_t *peak) {
  gca_allocator_t *a;
  int rc = gca_open(spec, conf, &a);
  if (rc) return rc;
  bool as_recorded = p->start_count && start_as_recorded(a);
  if (p->place_count) {
    size_t skip = as_recorded ? 0 : p->place_starts; /* (segments seeded one by one go anywhere) */
    rc = gca__sim_set_placement(gca__inspect_backend(a), 0, p->places + skip, p->place_count - skip, p->place_origin);
    if (rc == GCA_ERR_INVALID) rc = GCA_OK; /* (not the simulator: nothing to place) */
    if (rc) {
      gca_close(a);
      return rc;
    }
  }
  void **ptrs = calloc(p->count + 1, sizeof *ptrs);
  bool timeline = o->timeline && !peak;
  if (timeline) {
    r->requested_at = malloc((p->count + 1) * sizeof *r->requested_at);
    r->allocated_at = malloc((p->count + 1) * sizeof *r->allocated_at);
    r->reserved_at = malloc((p->count + 1) * sizeof *r->reserved_at);
    if (p->recorded_peak >= 0) r->recorded_reserved_at = malloc((p->count + 1) * sizeof *r->recorded_reserved_at);
  }
  if (!ptrs || (timeline && (!r->requested_at || !r->allocated_at || !r->reserved_at ||
                             (p->recorded_peak >= 0 && !r->recorded_reserved_at)))) {
    free(ptrs);
    gca_close(a);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory replaying");
  }
  uint64_t peak_reserved = 0;
  /* The page census at the peak, without maps: counted at each new peak
   * as it comes (a few ranges and the free blocks), not by a second run up
   * to the last one (which the maps and the snapshot of --report still
   * take): a second run would replay an expandable device twice, a
   * sixth of the whole replay of such a snapshot. */
  bool census_here = o->page_census && !o->timeline && !peak;
  double start = now_seconds();
  size_t i = 0;
  if (as_recorded) {
    /* The seeding operations at once: every point of them is the state
     * after them (their placeholders are not the job's), and the peaks
     * start there. */
    rc = seed_as_recorded(a, p, ptrs, r);
    /* (Its placeholders go through the allocator's every path of split
     * and merge: the books are checked once after them.) */
    if (rc == GCA_OK && !r->oom) rc = gca_check(a, 0);
    if (rc == GCA_OK && !r->oom) {
      gca_reset_peak_stats(a, 0);
      i = p->seeded;
      gca__books_t books;
      gca__inspect_books(a, 0, &books);
      peak_reserved = (uint64_t)books.reserved;
      r->peak_op = i ? i - 1 : 0;
      if (census_here) gca__inspect_census_counts(a, 0, &r->peak_pages);
      for (size_t k = 0; timeline && k < i; k++) {
        r->requested_at[k] = (uint64_t)books.requested;
        r->allocated_at[k] = (uint64_t)books.allocated;
        r->reserved_at[k] = peak_reserved;
        if (r->recorded_reserved_at) r->recorded_reserved_at[k] = p->ops[k].recorded_reserved;
      }
    }
  }
  if (log && i == p->seeded) gca__inspect_observe_segments(a, 0, observe_segment, log);
  bool start_snapshot = o->start_snapshot && !peak;
  if (start_snapshot && rc == GCA_OK && !r->oom && i == p->seeded) rc = gca_snapshot_take(a, &r->start_snapshot);
  size_t last = rc == GCA_OK && !r->oom ? p->count : i; /* (nothing more after a failed seeding) */
  for (; i < last && i <= stop_at; i++) {
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
        name_device(r, gca_last_error());
        break;
      }
    } else if (op->kind == OP_FREE) {
      if (ptrs[op->slot] && (rc = gca_free(a, ptrs[op->slot])) != GCA_OK) break;
      ptrs[op->slot] = NULL;
    } else {
      r->empty_cache_calls++;
      gca_empty_cache(a, 0);
    }
    /* The replay is single-threaded: the device's books can be read as they are. */
    uint64_t reserved = (uint64_t)gca_reserved_bytes(a, 0);
    if (reserved > peak_reserved) {
      peak_reserved = reserved;
      r->peak_op = i;
      if (census_here) gca__inspect_census_counts(a, 0, &r->peak_pages);
    }
    if (timeline) {
      gca__books_t books;
      gca__inspect_books(a, 0, &books);
      r->requested_at[i] = (uint64_t)books.requested;
      r->allocated_at[i] = (uint64_t)books.allocated;
      r->reserved_at[i] = reserved;
      if (r->recorded_reserved_at) r->recorded_reserved_at[i] = op->recorded_reserved;
    }
    if (unlikely(i + 1 == p->seeded)) { /* (seeded one by one) */
      if (log) gca__inspect_observe_segments(a, 0, observe_segment, log);
      if (start_snapshot && (rc = gca_snapshot_take(a, &r->start_snapshot)) != GCA_OK) break;
    }
    if (o->progress && (i & 65535) == 65535) o->progress(o->progress_ctx, r->device, i + 1, p->count);
  }
  r->seconds = now_seconds() - start;
  if (timeline) r->timeline_count = i;
  gca__inspect_observe_segments(a, 0, NULL, NULL);
  gca_stats_t s;
  gca_get_stats(a, 0, &s);
  if (!peak) {
    r->peak_requested = (uint64_t)s.requested_bytes[GCA_POOL_ALL].peak;
    r->peak_allocated = (uint64_t)s.allocated_bytes[GCA_POOL_ALL].peak;
    r->peak_reserved = (uint64_t)s.reserved_bytes[GCA_POOL_ALL].peak;
    r->device_allocs = (uint64_t)s.num_device_alloc;
    r->device_frees = (uint64_t)s.num_device_free;
    gca__books_t books;
    gca__inspect_books(a, 0, &books);
    r->pages_mapped = books.pages_mapped;
    r->pages_unmapped = books.pages_unmapped;
    r->pages_moved = (uint64_t)s.num_pages_moved;
    r->stitch_waits = (uint64_t)s.num_stitch_waits;
    r->expandable = books.pages_mapped > 0;
    if (!r->expandable) gca__page_census_free(&r->peak_pages); /* (a range reserved, never mapped: none, as documented) */
  }
  if (peak && rc == GCA_OK && o->timeline) rc = gca_snapshot_take(a, &peak->peak_snapshot);
  if (peak && rc == GCA_OK && o->timeline) rc = peak_origins(p, ptrs, peak);
  if (peak && rc == GCA_OK) rc = gca__inspect_census(a, 0, o->timeline, &peak->peak_pages);
  free(ptrs);
  gca_close(a);
  return rc;
}

static bool same_seg_event(const seg_event_t *a, const seg_event_t *b) {
  return a->alloc == b->alloc && a->size == b->size;
}

/* Longest common subsequence of (action, size). A common prefix and suffix
 * belong to one, so they are matched first and the table (two rows) only
 * covers the rest: a replay that makes PyTorch's decisions, the usual case,
 * costs a pass, not the product of the two lengths (100 million cells for
 * two logs of 10,000 events). */
size_t replay_segment_lcs(const seg_event_t *x, size_t n, const seg_event_t *y, size_t m) {
  size_t same = 0;
  while (n && m && same_seg_event(x, y)) {
    x++, y++, n--, m--;
    same++;
  }
  while (n && m && same_seg_event(&x[n - 1], &y[m - 1])) {
    n--, m--;
    same++;
  }
  if (!n || !m) return same;
  size_t *prev = calloc(m + 1, sizeof *prev), *cur = calloc(m + 1, sizeof *cur);
  if (!prev || !cur) {
    free(prev);
    free(cur);
    return same;
  }
  for (size_t i = 1; i <= n; i++) {
    for (size_t j = 1; j <= m; j++)
      cur[j] = same_seg_event(&x[i - 1], &y[j - 1]) ? prev[j - 1] + 1 : (prev[j] > cur[j - 1] ? prev[j] : cur[j - 1]);
    size_t *tmp = prev;
    prev = cur;
    cur = tmp;
  }
  size_t result = same + prev[m];
  free(prev);
  free(cur);
  return result;
}

/* Every device's plan, made once (replay_plan) and only read after. */
struct replay_plans {
  const trace_t *t;       /* what they were made of, */
  int device;             /* and with which options */
  bool infer_empty_cache;
  int first, count;
  device_plan_t *plans;   /* device first + k's is plans[k] */
};

/* The least any allocator could reserve for the plan's sequence on a
 * device that maps memory in pages of SMALL_BUFFER (2 MiB, CUDA's and
 * AscendCL's granularity) and keeps PyTorch's two pools apart (requests of
 * at most 1 MiB in one, larger ones in the other: no page serves both): at
 * every point each pool holds at least its live bytes rounded up to whole
 * pages, so no allocator reserves less than the largest such sum. An
 * allocator may pack blocks within pages any way it likes and move them
 * between pages for free: the bound asks nothing else of it. 0 without
 * host memory for the slots. */
static uint64_t lower_bound(const device_plan_t *p) {
  uint64_t *sizes = calloc(p->count + 1, sizeof *sizes);
  if (!sizes) return 0;
  uint64_t live[2] = {0, 0}, best = 0;
  for (size_t i = 0; i < p->count; i++) {
    const op_t *op = &p->ops[i];
    if (op->kind == OP_ALLOC) {
      sizes[op->slot] = op->size;
      live[op->size > SMALL_SIZE] += op->size;
    } else if (op->kind == OP_FREE) {
      live[sizes[op->slot] > SMALL_SIZE] -= sizes[op->slot];
      sizes[op->slot] = 0;
    }
    uint64_t pages = (live[0] + SMALL_BUFFER - 1) / SMALL_BUFFER + (live[1] + SMALL_BUFFER - 1) / SMALL_BUFFER;
    if (pages * SMALL_BUFFER > best) best = pages * SMALL_BUFFER;
  }
  free(sizes);
  return best;
}

/* Steps 1 to 3 for device d, into r: step 1 planned here, or taken from
 * o->plans. */
static int replay_device(const trace_t *t, int d, event_span_t span, const replay_options_t *o, const char *spec,
                         const char *conf, replay_device_t *r) {
  device_plan_t own = {0};
  const device_plan_t *p = o->plans ? &o->plans->plans[d - o->plans->first] : &own;
  int rc = o->plans ? GCA_OK : plan_device(t, d, span, o, &own);
  r->device = d;
  if (rc == GCA_OK) {
    r->seeded = p->seeded;
    r->events = p->count - p->seeded;
    r->bound_reserved = lower_bound(p);
    r->recorded_peak_reserved = p->recorded_peak;
    r->segment_events_recorded = p->recorded_count;
    seg_log_t log = {0};
    rc = run_plan(p, spec, conf, o, SIZE_MAX, o->match_segments ? &log : NULL, r, NULL);
    /* Stopped by an out-of-memory: only what ran before it was replayed. */
    if (rc == GCA_OK && r->oom) r->events = r->oom_event > p->seeded ? r->oom_event - p->seeded : 0;
    if (rc == GCA_OK && log.failed) rc = gca__set_error(GCA_ERR_NOMEM, "out of host memory replaying");
    if (rc == GCA_OK && o->match_segments) {
      r->segment_events_replayed = log.count;
      r->segment_events_matched = replay_segment_lcs(p->recorded, p->recorded_count, log.events, log.count);
    }
    free(log.events);
    /* The segment map at the peak: the same replay again, stopped there
     * (the page census alone was counted on the way: run_plan). */
    if (rc == GCA_OK && o->timeline && !o->series_only && r->peak_reserved) {
      replay_device_t again = {.device = d};
      rc = run_plan(p, spec, conf, o, r->peak_op, NULL, &again, r);
    }
  }
  plan_free(&own);
  return rc;
}

/* Devices replay in parallel: each has its own allocator on its own
 * simulated device, so they share nothing but the trace (read only), and the
 * results are the same in any order. A worker takes the next device until
 * none is left, and keeps a failure's status and message (errors are per
 * thread) for the caller's thread. */
typedef struct device_jobs {
  const trace_t *t;
  const replay_options_t *o; /* progress calls go through progress_serialized */
  const char *spec, *conf;
  int first, count;
  const event_span_t *spans; /* per device */
  replay_device_t *results;
  int *status;
  char (*messages)[1024];
  pthread_mutex_t lock; /* next, and the caller's progress callback */
  int next;
  replay_progress_fn progress;
  void *progress_ctx;
} device_jobs_t;

static void progress_serialized(void *ctx, int device, size_t done, size_t total) {
  device_jobs_t *jobs = ctx;
  pthread_mutex_lock(&jobs->lock);
  jobs->progress(jobs->progress_ctx, device, done, total);
  pthread_mutex_unlock(&jobs->lock);
}

static void device_worker(void *arg) {
  device_jobs_t *jobs = arg;
  for (;;) {
    pthread_mutex_lock(&jobs->lock);
    int k = jobs->next < jobs->count ? jobs->next++ : -1;
    pthread_mutex_unlock(&jobs->lock);
    if (k < 0) return;
    jobs->status[k] =
        replay_device(jobs->t, jobs->first + k, jobs->spans[k], jobs->o, jobs->spec, jobs->conf, &jobs->results[k]);
    if (jobs->status[k]) snprintf(jobs->messages[k], sizeof jobs->messages[k], "%s", gca_last_error());
  }
}

/* How many threads replay: o->threads, or one per processor usable; never
 * more than the devices that have events. */
static int replay_threads(const replay_options_t *o, const event_span_t *spans, int count) {
  int busy = 0;
  for (int k = 0; k < count; k++) busy += spans[k].hi > spans[k].lo;
  if (busy <= 1) return 1;
  long online = o->threads > 0 ? o->threads : gca__processors_usable();
  int threads = online < 1 ? 1 : online > 64 ? 64 : (int)online;
  return threads < busy ? threads : busy > 0 ? busy : 1;
}

/* The devices o replays of t: first, and how many; an error set when the
 * trace has not o's device. */
static int devices_replayed(const trace_t *t, const replay_options_t *o, int *first, int *count) {
  if (o->device >= t->device_count)
    return gca__set_error(GCA_ERR_INVALID, "the trace has no device %d (it has %d)", o->device, t->device_count);
  *first = o->device >= 0 ? o->device : 0;
  int last = o->device >= 0 ? o->device : t->device_count - 1;
  *count = last - *first + 1 > 0 ? last - *first + 1 : 0;
  return GCA_OK;
}

/* Where each of those devices' events lie (spans zeroed, count of them). */
static void device_spans(const trace_t *t, int first, int count, event_span_t *spans) {
  for (size_t i = 0; i < t->count; i++) {
    int k = t->events[i].device - first;
    if (k < 0 || k >= count) continue;
    if (spans[k].hi == 0) spans[k].lo = i;
    spans[k].hi = i + 1;
  }
}

int replay_plan(const trace_t *t, const replay_options_t *o, replay_plans_t **out) {
  *out = NULL;
  int first = 0, count = 0;
  int rc = devices_replayed(t, o, &first, &count);
  if (rc) return rc;
  replay_plans_t *plans = malloc(sizeof *plans);
  device_plan_t *each = calloc((size_t)count + 1, sizeof *each);
  event_span_t *spans = calloc((size_t)count + 1, sizeof *spans);
  if (!plans || !each || !spans) {
    free(plans);
    free(each);
    free(spans);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory planning a replay");
  }
  *plans = (replay_plans_t){t, o->device, o->infer_empty_cache, first, count, each};
  device_spans(t, first, count, spans);
  for (int k = 0; k < count && rc == GCA_OK; k++) rc = plan_device(t, first + k, spans[k], o, &plans->plans[k]);
  free(spans);
  if (rc) {
    replay_plans_free(plans);
    return rc;
  }
  *out = plans;
  return GCA_OK;
}

void replay_plans_free(replay_plans_t *plans) {
  if (!plans) return;
  for (int k = 0; k < plans->count; k++) plan_free(&plans->plans[k]);
  free(plans->plans);
  free(plans);
}

int replay_trace(const trace_t *t, const replay_options_t *o, replay_result_t *out) {
  memset(out, 0, sizeof *out);
  const char *conf = o->conf ? o->conf : (t->settings ? t->settings : "");
  snprintf(out->conf, sizeof out->conf, "%s", conf);
  char spec[96];
  /* Unlimited: the sim's largest device, so no trace meets its end. */
  snprintf(spec, sizeof spec, "sim:capacity=%llu",
           (unsigned long long)(o->capacity ? o->capacity : (uint64_t)8 << 40));
  int first = 0, count = 0;
  int rc = devices_replayed(t, o, &first, &count);
  if (rc) return rc;
  if (o->plans && (o->plans->t != t || o->plans->device != o->device ||
                   o->plans->infer_empty_cache != o->infer_empty_cache))
    return gca__set_error(GCA_ERR_INVALID, "replay: the plans given were made of another trace or with another device "
                          "or infer_empty_cache");
  out->devices = calloc((size_t)count + 1, sizeof *out->devices);
  int *status = calloc((size_t)count + 1, sizeof *status);
  char(*messages)[1024] = calloc((size_t)count + 1, sizeof *messages);
  event_span_t *spans = calloc((size_t)count + 1, sizeof *spans);
  if (!out->devices || !status || !messages || !spans) {
    free(out->devices);
    free(status);
    free(messages);
    free(spans);
    out->devices = NULL;
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory replaying");
  }
  out->device_count = count;
  for (int k = 0; k < count; k++) {
    out->devices[k].allocator = t->origins ? t->origins[first + k].allocator : -1;
    out->devices[k].recorded_device = t->origins ? t->origins[first + k].device : first + k;
  }
  device_spans(t, first, count, spans);
  device_jobs_t jobs = {.t = t, .spec = spec, .conf = conf, .first = first, .count = count, .spans = spans,
                        .results = out->devices, .status = status, .messages = messages};
  replay_options_t worker_options = *o;
  if (o->progress) {
    jobs.progress = o->progress;
    jobs.progress_ctx = o->progress_ctx;
    worker_options.progress = progress_serialized;
    worker_options.progress_ctx = &jobs;
  }
  jobs.o = &worker_options;
  pthread_mutex_init(&jobs.lock, NULL);
  int threads = replay_threads(o, spans, count);
  helper_job_t helpers[64];
  int started = 0;
  /* The caller's thread is one of the workers, on kept threads (helpers.c);
   * a helper that cannot be had only makes the replay slower, and one that
   * has not started when the caller is done is taken back. */
  while (started < threads - 1) {
    helpers[started] = (helper_job_t){.run = device_worker, .arg = &jobs};
    if (!gca__helper_submit(&helpers[started])) break;
    started++;
  }
  device_worker(&jobs);
  for (int i = 0; i < started; i++) gca__helper_wait(&helpers[i]);
  pthread_mutex_destroy(&jobs.lock);
  for (int k = 0; k < count && rc == GCA_OK; k++)
    if (status[k]) rc = gca__set_error(status[k], "%s", messages[k]);
  free(status);
  free(messages);
  free(spans);
  if (rc) replay_result_free(out);
  return rc;
}

void replay_result_free(replay_result_t *r) {
  for (int i = 0; i < r->device_count; i++) {
    replay_device_t *d = &r->devices[i];
    free(d->requested_at);
    free(d->allocated_at);
    free(d->reserved_at);
    free(d->recorded_reserved_at);
    gca_snapshot_free(d->peak_snapshot);
    free(d->peak_origins);
    gca_snapshot_free(d->start_snapshot);
    gca__page_census_free(&d->peak_pages);
  }
  free(r->devices);
  memset(r, 0, sizeof *r);
}
