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
#include <time.h>

#include "core/core.h"
#include "core/history.h"

int64_t gca__history_now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

/* The caller's stack, without this function's own frame. */
static uint8_t capture(uintptr_t *ips) {
  void *buf[MAX_FRAMES + 1];
  int n = unw_backtrace(buf, MAX_FRAMES + 1);
  if (n <= 1) return 0;
  for (int i = 1; i < n; i++) ips[i - 1] = (uintptr_t)buf[i];
  return (uint8_t)(n - 1);
}

/* The next slot of the ring, overwriting the oldest once it is full. */
static history_entry_t *next_slot(history_t *h) {
  history_entry_t *e = &h->ring[h->next];
  h->next = h->next + 1 == h->cap ? 0 : h->next + 1;
  if (h->count < h->cap) h->count++;
  return e;
}

static history_entry_t *record(device_t *d, int action, uintptr_t addr, size_t size, gca_stream_t stream) {
  history_t *h = d->obs.history;
  history_entry_t *e = next_slot(h);
  e->action = (uint8_t)action;
  e->depth = 0;
  e->addr = addr;
  e->size = size;
  e->stream = stream;
  e->device_free = 0;
  e->ipc_received = 0;
  e->ipc_asked = e->ipc_silent = e->ipc_requester = 0;
  e->time_us = gca__history_now_us();
  return e;
}

/* Stacks on entries: allocation-like actions from ALLOC, frees from ALL. */
static bool wants_stack(const history_t *h, int action) {
  bool freeing = action == GCA_TRACE_FREE_REQUESTED || action == GCA_TRACE_FREE_COMPLETED ||
                 action == GCA_TRACE_SEGMENT_FREE || action == GCA_TRACE_SEGMENT_UNMAP;
  return h->context >= (freeing ? GCA_CONTEXT_ALL : GCA_CONTEXT_ALLOC);
}

void gca__history_event(device_t *d, int action, uintptr_t addr, size_t size, gca_stream_t stream) {
  history_entry_t *e = record(d, action, addr, size, stream);
  if (wants_stack(d->obs.history, action)) e->depth = capture(e->ips);
}

void gca__history_oom(device_t *d, size_t size, gca_stream_t stream, size_t device_free) {
  history_entry_t *e = record(d, GCA_TRACE_OOM, 0, size, stream);
  e->device_free = device_free;
  if (wants_stack(d->obs.history, GCA_TRACE_OOM)) e->depth = capture(e->ips);
}

void gca__history_ipc_request(device_t *d, size_t need, gca_stream_t stream, int asked, int silent,
                              size_t received) {
  history_entry_t *e = record(d, GCA_TRACE_IPC_REQUEST, 0, need, stream);
  e->ipc_received = received;
  e->ipc_asked = asked;
  e->ipc_silent = silent;
  if (wants_stack(d->obs.history, GCA_TRACE_IPC_REQUEST)) e->depth = capture(e->ips);
}

void gca__history_ipc_release(device_t *d, size_t released, int32_t requester) {
  record(d, GCA_TRACE_IPC_RELEASE, 0, released, 0)->ipc_requester = requester;
}

void gca__history_alloc(device_t *d, block_t *b, size_t requested) {
  history_t *h = d->obs.history;
  history_entry_t *e = record(d, GCA_TRACE_ALLOC, b->addr, requested, b->stream);
  if (h->context < GCA_CONTEXT_STATE) return;
  call_stack_t *stack = malloc(sizeof *stack);
  uintptr_t ips[MAX_FRAMES];
  uint8_t depth = capture(ips);
  if (stack) {
    stack->depth = depth;
    memcpy(stack->ips, ips, depth * sizeof ips[0]);
    free(b->stack);
    b->stack = stack;
  }
  if (wants_stack(h, GCA_TRACE_ALLOC)) {
    e->depth = depth;
    memcpy(e->ips, ips, depth * sizeof ips[0]);
  }
}

void gca__history_drop_stack(block_t *b) {
  free(b->stack);
  b->stack = NULL;
}

int gca__history_start(device_t *d, int context, size_t max_entries) {
  history_entry_t *ring = calloc(max_entries, sizeof *ring);
  history_t *h = d->obs.history ? d->obs.history : calloc(1, sizeof *h);
  if (!ring || !h) {
    free(ring);
    if (!d->obs.history) free(h);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory for a history of %zu entries", max_entries);
  }
  free(h->ring);
  h->ring = ring;
  h->cap = max_entries;
  h->count = h->next = 0;
  h->context = context;
  d->obs.history = h;
  d->obs.recording = true;
  return GCA_OK;
}

void gca__history_stop(device_t *d) { d->obs.recording = false; }

void gca__history_destroy(device_t *d) {
  if (d->obs.history) free(d->obs.history->ring);
  free(d->obs.history);
  d->obs.history = NULL;
  d->obs.recording = false;
}

size_t gca__history_copy(const device_t *d, history_entry_t *out) {
  const history_t *h = d->obs.history;
  if (!h) return 0;
  size_t first = h->count < h->cap ? 0 : h->next; /* the oldest */
  for (size_t i = 0; i < h->count; i++) out[i] = h->ring[(first + i) % h->cap];
  return h->count;
}
