/* Stream-ordered frees: record_stream, frees deferred until the work queued
 * on the streams that used a block has completed, device frees deferred
 * until a segment's stream is done with it, and the ordering that lets a
 * block cached for one stream be reused on another.
 *
 * PyTorch's rules. A block is cached for the stream it was allocated on;
 * reusing it on that stream needs no waiting, because a stream runs its work
 * in order. A block also used on other streams (record_stream) must not be
 * reused before their work queued up to the free has completed: at the free
 * an event is recorded on each of those streams, and the block stays out of
 * its pool (PENDING: the allocated counters have dropped, the active ones
 * not) until the last of its events completes. Completed events are
 * collected at every malloc and on demand, one queue per stream, oldest
 * first, stopping at the first that has not completed: a stream's events
 * complete in order, and one slow stream does not hold up the others.
 *
 * Backend failures never make memory reusable early. If an event cannot be
 * recorded or asked about, the core waits for the stream on the host instead
 * (slower, still safe); if even that fails the block is QUARANTINED: counted
 * as active, never reused, given back only when the allocator closes.
 *
 * Everything here runs with the device lock held.
 */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/events.h"
#include "core/history.h"

/* ---- the backend's stream primitives; a backend without them is a
 *      synchronous device, whose events have completed when recorded ---- */

/* Trace recording's hooks (core.h); NULL while nothing is recorded. */
const call_recorder_t *_Atomic gca__call_recorder;

static int record_event(device_t *d, gca_stream_t stream, uintptr_t *event) {
  *event = 0;
  const backend_ops_t *ops = d->backend->ops;
  return ops->event_record ? ops->event_record(d->backend->state, d->index, stream, event) : GCA_OK;
}

static int query_event(device_t *d, uintptr_t event) {
  return event ? d->backend->ops->event_query(d->backend->state, d->index, event) : GCA_OK;
}

static int wait_event(device_t *d, uintptr_t event) {
  return event ? d->backend->ops->event_synchronize(d->backend->state, d->index, event) : GCA_OK;
}

static void destroy_event(device_t *d, uintptr_t event) {
  if (event) d->backend->ops->event_destroy(d->backend->state, d->index, event);
}

static int wait_stream(device_t *d, gca_stream_t stream) {
  const backend_ops_t *ops = d->backend->ops;
  return ops->stream_synchronize ? ops->stream_synchronize(d->backend->state, d->index, stream) : GCA_OK;
}

/* The fallback when an event failed: wait for the whole stream. */
static int wait_stream_instead(device_t *d, gca_stream_t stream) {
  d->ev.errors++;
  gca__note_absorbed(d);
  return wait_stream(d, stream);
}

/* ---- stream uses -------------------------------------------------------- */

int gca__stream_uses_add(block_t *b, gca_stream_t stream) {
  /* Uses on the block's own stream need no event: reuse happens on that
   * stream, after its work, by stream order. */
  if (stream == block_stream(b)) return GCA_OK;
  stream_uses_t *uses = b->uses;
  if (uses) {
    for (uint32_t i = 0; i < uses->count; i++)
      if (uses->streams[i] == stream) return GCA_OK;
  }
  if (!uses || uses->count == uses->cap) {
    uint32_t cap = uses ? 2 * uses->cap : 2;
    stream_uses_t *grown = realloc(uses, sizeof *grown + cap * sizeof grown->streams[0]);
    if (!grown) return gca__set_error(GCA_ERR_NOMEM, "out of host memory recording a stream use");
    if (!uses) grown->count = 0;
    grown->cap = cap;
    b->uses = uses = grown;
  }
  uses->streams[uses->count++] = stream;
  return GCA_OK;
}

void gca__stream_uses_remove(block_t *b, gca_stream_t stream) {
  stream_uses_t *uses = b->uses;
  for (uint32_t i = 0; uses && i < uses->count; i++)
    if (uses->streams[i] == stream) {
      uses->streams[i] = uses->streams[--uses->count];
      break;
    }
  if (uses && !uses->count) { /* (no uses: the free takes the fast path again) */
    free(uses);
    b->uses = NULL;
  }
}

/* ---- pending frees ------------------------------------------------------ */

/* The last event of a pending block completed: its free completes. */
static void complete_free(device_t *d, block_t *b) {
  int kind = pool_kind_of(b);
  family_decrease(&d->stats, FAM_PENDING, kind, 1);
  family_decrease(&d->stats, FAM_PENDING_BYTES, kind, (int64_t)b->size);
  d->ev.pending_blocks--;
  gca__history_free_completed(d, b);
  if (unlikely(b->traced_pending)) {
    b->traced_pending = false;
    const call_recorder_t *r = recorder();
    if (r) r->free_completed(d->owner->id, b->addr);
  }
  gca__block_give_back(d, b);
}

static void quarantine(device_t *d, block_t *b) {
  if (b->state == BLOCK_PENDING) {
    b->state = BLOCK_QUARANTINED;
    d->ev.quarantined_blocks++;
  }
}

/* One of b's events completed (ok) or could not be waited for (!ok). */
static void event_done(device_t *d, block_t *b, bool ok) {
  if (!ok) quarantine(d, b);
  if (--b->event_count == 0 && b->state == BLOCK_PENDING) complete_free(d, b);
}

static event_queue_t *queue_of(device_t *d, gca_stream_t stream) {
  for (size_t i = 0; i < d->ev.queue_count; i++)
    if (d->ev.queues[i].stream == stream) return &d->ev.queues[i];
  if (d->ev.queue_count == d->ev.queue_cap) {
    event_queue_t *grown = gca__grow_array(d->ev.queues, &d->ev.queue_cap, sizeof *grown, 4);
    if (!grown) return NULL;
    d->ev.queues = grown;
  }
  event_queue_t *q = &d->ev.queues[d->ev.queue_count++];
  memset(q, 0, sizeof *q);
  q->stream = stream;
  return q;
}

/* Append (event, b) to the stream's queue; false on host OOM. */
static bool queue_push(device_t *d, gca_stream_t stream, uintptr_t event, block_t *b) {
  event_queue_t *q = queue_of(d, stream);
  if (!q) return false;
  if (q->count == q->cap) {
    size_t cap = q->cap ? 2 * q->cap : 8;
    pending_free_t *items = malloc(cap * sizeof *items);
    if (!items) return false;
    for (size_t i = 0; i < q->count; i++) items[i] = q->items[(q->head + i) % q->cap];
    free(q->items);
    q->items = items;
    q->head = 0;
    q->cap = cap;
  }
  q->items[(q->head + q->count) % q->cap] = (pending_free_t){event, b};
  q->count++;
  d->ev.pending_events++;
  return true;
}

static pending_free_t queue_pop(device_t *d, event_queue_t *q) {
  pending_free_t pf = q->items[q->head];
  q->head = (q->head + 1) % q->cap;
  q->count--;
  d->ev.pending_events--;
  return pf;
}

/* Queues left empty keep their ring for the next free on that stream;
 * drop them once there are many, so short-lived streams do not pile up. */
static void drop_empty_queues(device_t *d) {
  if (d->ev.queue_count <= 16) return;
  for (size_t i = 0; i < d->ev.queue_count;) {
    if (d->ev.queues[i].count == 0) {
      free(d->ev.queues[i].items);
      d->ev.queues[i] = d->ev.queues[--d->ev.queue_count];
    } else {
      i++;
    }
  }
}

/* Record the events of pending block b's stream uses. */
static void record_uses(device_t *d, block_t *b) {
  stream_uses_t *uses = b->uses;
  b->uses = NULL;
  /* One count is held while the events are recorded and dropped at the end,
   * which completes the free then if no event had to be queued. */
  b->event_count = 1;
  for (uint32_t i = 0; i < uses->count; i++) {
    gca_stream_t stream = uses->streams[i];
    uintptr_t event;
    int rc = record_event(d, stream, &event);
    if (rc == GCA_OK && event && !d->launch_blocking && queue_push(d, stream, event, b)) {
      b->event_count++;
      continue;
    }
    /* Not queued (launch-blocking mode, a synchronous backend, no host
     * memory for the queue, or a failed record): wait for it here. */
    if (rc == GCA_OK) {
      rc = wait_event(d, event);
      destroy_event(d, event);
    }
    if (rc != GCA_OK && wait_stream_instead(d, stream) != GCA_OK) quarantine(d, b);
  }
  free(uses);
  /* Events still queued: the block stays pending past this free. The trace
   * file says so, and says when it completes. */
  const call_recorder_t *r;
  if (b->event_count > 1 && unlikely((r = recorder()) != NULL)) {
    b->traced_pending = true;
    r->free_pending();
  }
  event_done(d, b, true);
}

void gca__events_defer_free(device_t *d, block_t *b) {
  int kind = pool_kind_of(b);
  b->state = BLOCK_PENDING;
  family_increase(&d->stats, FAM_PENDING, kind, 1);
  family_increase(&d->stats, FAM_PENDING_BYTES, kind, (int64_t)b->size);
  d->ev.pending_blocks++;
  if (unlikely(d->capture.count)) { /* no event may be recorded now: held until the capture ends */
    b->event_count = 0;
    b->hash_next = d->capture.held;
    d->capture.held = b;
    return;
  }
  record_uses(d, b);
}

void gca__events_after_capture(device_t *d) {
  block_t *b = d->capture.held;
  d->capture.held = NULL;
  while (b) {
    block_t *next = b->hash_next;
    b->hash_next = NULL;
    record_uses(d, b);
    b = next;
  }
}

/* Take the oldest entry of q, now complete (or failed: `rc`), and finish it. */
static void finish_head(device_t *d, event_queue_t *q, int rc) {
  if (rc != GCA_OK) rc = wait_stream_instead(d, q->stream);
  pending_free_t pf = queue_pop(d, q);
  destroy_event(d, pf.event);
  event_done(d, pf.block, rc == GCA_OK);
}

void gca__events_process(device_t *d) {
  if (unlikely(d->capture.count)) return; /* (no event may be queried) */
  for (size_t i = 0; i < d->ev.queue_count; i++) {
    event_queue_t *q = &d->ev.queues[i];
    while (q->count) {
      int rc = query_event(d, q->items[q->head].event);
      if (rc == BACKEND_NOT_READY) break;
      finish_head(d, q, rc);
    }
  }
  drop_empty_queues(d);
  if (d->ev.releasing) gca__events_finish_releases(d, false);
}

void gca__events_synchronize(device_t *d) {
  for (size_t i = 0; i < d->ev.queue_count; i++) {
    event_queue_t *q = &d->ev.queues[i];
    while (q->count) finish_head(d, q, wait_event(d, q->items[q->head].event));
  }
  drop_empty_queues(d);
  gca__events_finish_releases(d, true);
}

/* ---- deferred device frees --------------------------------------------- */

bool gca__events_ready_to_free(device_t *d, gca_stream_t stream, uintptr_t *event) {
  *event = 0;
  uintptr_t e;
  int rc = record_event(d, stream, &e);
  if (rc == GCA_OK) {
    rc = query_event(d, e);
    if (rc == BACKEND_NOT_READY && !d->launch_blocking) {
      *event = e;
      return false;
    }
    if (rc == BACKEND_NOT_READY) rc = wait_event(d, e);
    destroy_event(d, e);
    if (rc == GCA_OK) return true;
  }
  return wait_stream_instead(d, stream) == GCA_OK;
}

void gca__events_finish_releases(device_t *d, bool wait) {
  segment_t **link = &d->ev.releasing;
  while (*link) {
    segment_t *seg = *link;
    int rc = wait ? wait_event(d, seg->release_event) : query_event(d, seg->release_event);
    if (rc == BACKEND_NOT_READY) {
      link = &seg->release_next;
      continue;
    }
    if (rc != GCA_OK) rc = wait_stream_instead(d, seg->stream);
    destroy_event(d, seg->release_event);
    seg->release_event = 0;
    *link = seg->release_next;
    seg->release_next = NULL;
    d->ev.releasing_count--;
    if (rc == GCA_OK) {
      gca__segment_free_now(d, seg);
    } else {
      /* The stream's work cannot be waited for: freeing would risk a
       * use-after-free on the device, so the segment stays cached. */
      seg->head->state = BLOCK_FREE;
      gca__pool_insert(seg->pool, seg->head);
    }
  }
}

/* ---- cross-stream reuse ------------------------------------------------- */

int gca__events_wait_stream(device_t *d, gca_stream_t stream) { return wait_stream(d, stream); }

bool gca__events_stream_is_idle(device_t *d, gca_stream_t stream) {
  uintptr_t e;
  if (record_event(d, stream, &e) != GCA_OK) return false;
  int rc = query_event(d, e);
  destroy_event(d, e);
  return rc == GCA_OK;
}

bool gca__events_order_reuse(device_t *d, gca_stream_t from, gca_stream_t to) {
  uintptr_t e;
  int rc = record_event(d, from, &e);
  if (rc == GCA_OK) {
    rc = query_event(d, e);
    if (rc == BACKEND_NOT_READY) {
      const backend_ops_t *ops = d->backend->ops;
      rc = ops->stream_wait_event ? ops->stream_wait_event(d->backend->state, d->index, to, e) : wait_event(d, e);
    }
    destroy_event(d, e);
    if (rc == GCA_OK) return true;
  }
  /* Waiting on the host orders the reuse too. */
  return wait_stream_instead(d, from) == GCA_OK;
}

/* ---- shutdown ----------------------------------------------------------- */

void gca__events_shutdown(device_t *d, bool forked) {
  if (!forked) gca__events_synchronize(d);
  /* Memory given back at close may still be used by queued work: wait for
   * every stream it was used on, so the device frees that follow are safe
   * (a child of fork's copy waits for nothing: no memory goes back). */
  for (segment_t *seg = d->segments; seg; seg = seg->next) {
    if (!forked) (void)wait_stream(d, seg->stream);
    for (block_t *b = seg->head; b; b = b->next) {
      if (!block_uses(b)) continue;
      for (uint32_t i = 0; !forked && i < b->uses->count; i++) (void)wait_stream(d, b->uses->streams[i]);
      free(b->uses);
      b->uses = NULL;
    }
  }
  for (size_t i = 0; i < d->ev.queue_count; i++) free(d->ev.queues[i].items);
  free(d->ev.queues);
  d->ev.queues = NULL;
  d->ev.queue_count = d->ev.queue_cap = 0;
}
