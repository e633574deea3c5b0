/* The history: a ring of trace entries per device (PyTorch's alloc_trace),
 * and the call stacks of live blocks.
 *
 * Recording is switched per allocator at run time (gca_record_history). The
 * core calls the history_* hooks below only when d->obs.recording is set (one
 * predictable branch when it is not). Stacks are captured with libunwind's
 * unw_backtrace as raw instruction pointers, which is fast (tens of ns a
 * frame) and safe under the device lock; turning them into names happens
 * when a snapshot is taken (snapshot.c), outside every lock. A live block
 * keeps its stack behind block->stack (context STATE and up) until its free
 * completes.
 *
 * All functions run with the device lock held.
 */
#define UNW_LOCAL_ONLY
#include <libunwind.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/history.h"

/* The calling thread's Python frames, gathered before the lock for the
 * call in progress (gca__history_python_gather). */
static _Thread_local struct {
  uint8_t depth;
  uintptr_t frames[PY_FRAMES];
} python_pending;

void gca__history_python_gather(device_t *d, bool freeing) {
  uint8_t want = atomic_load_explicit(&d->obs.python, memory_order_relaxed);
  python_pending.depth =
      want & (freeing ? PY_AT_FREE : PY_AT_ALLOC) ? (uint8_t)gca__py_gather(python_pending.frames, PY_FRAMES) : 0;
}

void gca__history_python_done(void) { python_pending.depth = 0; }

/* The caller's stack, without this function's own frame: the Python frames
 * gathered for this call first (innermost first, what the user's code
 * did), then the native return addresses; with GCA_STACKS_PYTHON only the
 * Python ones where there are any. */
static uint8_t capture(const history_t *h, uintptr_t *ips) {
  uint8_t n = 0;
  if (h->stacks != GCA_STACKS_NATIVE && python_pending.depth) {
    n = python_pending.depth;
    memcpy(ips, python_pending.frames, n * sizeof ips[0]);
    if (h->stacks == GCA_STACKS_PYTHON) return n;
  }
  void *buf[NATIVE_FRAMES + 1];
  int got = unw_backtrace(buf, NATIVE_FRAMES + 1);
  for (int i = 1; i < got; i++) ips[n++] = (uintptr_t)buf[i];
  return n;
}

/* The next slot of the ring, overwriting the oldest once it is full. */
static history_entry_t *next_slot(history_t *h) {
  history_entry_t *e = &h->ring[h->next];
  h->next = h->next + 1 == h->cap ? 0 : h->next + 1;
  if (h->count < h->cap) h->count++;
  return e;
}

/* Stacks on entries: allocation-like actions from ALLOC, frees from ALL. */
static bool wants_stack(const history_t *h, int action) {
  bool freeing = action == GCA_TRACE_FREE_REQUESTED || action == GCA_TRACE_FREE_COMPLETED ||
                 action == GCA_TRACE_SEGMENT_FREE || action == GCA_TRACE_SEGMENT_UNMAP;
  return h->context >= (freeing ? GCA_CONTEXT_ALL : GCA_CONTEXT_ALLOC);
}

static history_entry_t *record(device_t *d, int action, uintptr_t addr, size_t size, gca_stream_t stream) {
  history_t *h = d->obs.history;
  history_entry_t *e = next_slot(h);
  e->action = (uint8_t)action;
  e->depth = 0;
  e->completed_too = 0;
  e->addr = addr;
  e->size = size;
  e->stream = stream;
  e->when.ticks = gca__ticks();
  /* (the unions are written by the actions they belong to, and read only for them) */
  return e;
}

/* The stack row of entry e (the history keeps them: context ALLOC and up). */
static uintptr_t *frames_of(history_t *h, const history_entry_t *e) { return h->frames[e - h->ring]; }

/* Entry e's stack, when the settings want one for its action. */
static void maybe_capture(history_t *h, history_entry_t *e) {
  if (wants_stack(h, e->action)) e->depth = capture(h, frames_of(h, e));
}

void gca__history_event(device_t *d, int action, uintptr_t addr, size_t size, gca_stream_t stream) {
  maybe_capture(d->obs.history, record(d, action, addr, size, stream));
}

/* (Cold: inlined into the free, it cost the free without history 23
 * instructions of spills.) */
GCA_COLD void gca__history_freed_at_once(device_t *d, const block_t *b) {
  history_t *h = d->obs.history;
  history_entry_t *e = record(d, GCA_TRACE_FREE_REQUESTED, b->addr, b->requested, block_stream(b));
  e->completed_too = 1;
  /* (both are frees: one stack serves the two) */
  if (unlikely(wants_stack(h, GCA_TRACE_FREE_REQUESTED))) e->depth = capture(h, frames_of(h, e));
}

void gca__history_oom(device_t *d, size_t size, gca_stream_t stream, size_t device_free) {
  history_entry_t *e = record(d, GCA_TRACE_OOM, 0, size, stream);
  e->device_free = device_free;
  maybe_capture(d->obs.history, e);
}

void gca__history_ipc_request(device_t *d, size_t need, gca_stream_t stream, int asked, int silent,
                              size_t received) {
  history_entry_t *e = record(d, GCA_TRACE_IPC_REQUEST, 0, need, stream);
  e->ipc.received = received;
  e->ipc_asked = asked;
  e->ipc.silent = silent;
  maybe_capture(d->obs.history, e);
}

void gca__history_ipc_release(device_t *d, size_t released, int32_t requester) {
  record(d, GCA_TRACE_IPC_RELEASE, 0, released, 0)->ipc_requester = requester;
}

/* An allocation's stack (context STATE and up), kept on the block and, when
 * the settings want it, on its entry e. Out of line: the entry alone then
 * takes no stack frame for the stack's buffer. */
GCA_NOINLINE static void alloc_stack(history_t *h, history_entry_t *e, block_t *b) {
  call_stack_t *stack = malloc(sizeof *stack);
  uintptr_t ips[MAX_FRAMES];
  uint8_t depth = capture(h, ips);
  if (stack) {
    stack->depth = depth;
    memcpy(stack->ips, ips, depth * sizeof ips[0]);
    free(b->stack);
    b->stack = stack;
  }
  if (wants_stack(h, GCA_TRACE_ALLOC)) {
    e->depth = depth;
    memcpy(frames_of(h, e), ips, depth * sizeof ips[0]);
  }
}

void gca__history_alloc(device_t *d, block_t *b, size_t requested) {
  history_t *h = d->obs.history;
  history_entry_t *e = record(d, GCA_TRACE_ALLOC, b->addr, requested, block_stream(b));
  if (h->context >= GCA_CONTEXT_STATE) alloc_stack(h, e, b);
}

void gca__history_drop_stack(block_t *b) {
  free(b->stack);
  b->stack = NULL;
}

/* What Python frames the settings want: at allocations (their entries and
 * the block's stack), at frees; none where no Python runs. */
static uint8_t python_wanted(int context, int stacks) {
  /* (A process without Python pays nothing for them: calls keep the plain entry.) */
  if (stacks == GCA_STACKS_NATIVE || !gca__py_present()) return 0;
  return (uint8_t)((context >= GCA_CONTEXT_STATE ? PY_AT_ALLOC : 0) | (context >= GCA_CONTEXT_ALL ? PY_AT_FREE : 0));
}

static void set_python(device_t *d, uint8_t want) {
  uint8_t was = atomic_exchange_explicit(&d->obs.python, want, memory_order_relaxed);
  if (!was != !want) gca__log_python_frames(want ? 1 : -1);
}

int gca__history_start(device_t *d, int context, int stacks, size_t max_entries) {
  history_entry_t *ring = calloc(max_entries, sizeof *ring);
  /* (entries get stacks from context ALLOC on: wants_stack) */
  uintptr_t(*frames)[MAX_FRAMES] = context >= GCA_CONTEXT_ALLOC ? calloc(max_entries, sizeof *frames) : NULL;
  history_t *h = d->obs.history ? d->obs.history : calloc(1, sizeof *h);
  if (!ring || !h || (context >= GCA_CONTEXT_ALLOC && !frames)) {
    free(ring);
    free(frames);
    if (!d->obs.history) free(h);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory for a history of %zu entries", max_entries);
  }
  free(h->ring);
  free(h->frames);
  h->ring = ring;
  h->frames = frames;
  h->cap = max_entries;
  h->count = h->next = 0;
  h->context = context;
  h->stacks = stacks;
  gca__ticks_init();
  h->start = gca__ticks_pair();
  d->obs.history = h;
  d->obs.recording = true;
  set_python(d, python_wanted(context, stacks));
  return GCA_OK;
}

void gca__history_stop(device_t *d) {
  d->obs.recording = false;
  set_python(d, 0);
}

void gca__history_destroy(device_t *d) {
  if (d->obs.history) {
    free(d->obs.history->ring);
    free(d->obs.history->frames);
  }
  free(d->obs.history);
  d->obs.history = NULL;
  d->obs.recording = false;
  set_python(d, 0);
}

/* The entries a slot holds. */
static size_t slot_entries(const history_entry_t *e) { return 1 + (size_t)e->completed_too; }

/* The oldest slot in use, and the entries the slots in use hold (a full
 * ring may hold more than cap: the oldest are then dropped from copies). */
static size_t first_slot(const history_t *h) { return h->count < h->cap ? 0 : h->next; }

static size_t held_entries(const history_t *h) {
  size_t held = 0, first = first_slot(h);
  for (size_t i = 0; i < h->count; i++) held += slot_entries(&h->ring[(first + i) % h->cap]);
  return held;
}

size_t gca__history_entries(const device_t *d) {
  const history_t *h = d->obs.history;
  if (!h) return 0;
  size_t held = held_entries(h);
  return held < h->cap ? held : h->cap;
}

size_t gca__history_copy(const device_t *d, history_entry_t *out, uintptr_t (*frames)[MAX_FRAMES]) {
  const history_t *h = d->obs.history;
  if (!h) return 0;
  size_t held = held_entries(h);
  size_t skip = held > h->cap ? held - h->cap : 0; /* the oldest entries beyond cap */
  size_t first = first_slot(h), n = 0;
  ticks_pair_t now = gca__ticks_pair();
  for (size_t i = 0; i < h->count; i++) {
    size_t at = (first + i) % h->cap;
    const history_entry_t *e = &h->ring[at];
    for (size_t k = 0; k < slot_entries(e); k++) {
      if (skip) {
        skip--;
        continue;
      }
      out[n] = *e;
      out[n].completed_too = 0;
      if (k == 1) out[n].action = GCA_TRACE_FREE_COMPLETED;
      out[n].when.time_us = gca__ticks_to_us(e->when.ticks, h->start, now);
      if (h->frames && frames) memcpy(frames[n], h->frames[at], e->depth * sizeof frames[n][0]);
      n++;
    }
  }
  return n;
}
