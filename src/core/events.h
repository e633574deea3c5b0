/* Stream-ordered frees (events.c), with the lock held: events recorded
 * for a freed block's streams, and the device frees that wait for theirs.
 */
#ifndef GCALLOC_CORE_EVENTS_H
#define GCALLOC_CORE_EVENTS_H

#include "core/core.h"

/* events.c: with the lock held. */
/* A freed block with stream uses: record an event on each of those streams;
 * the free completes when they all have. During a graph capture the block
 * is held pending, its events recorded when the last capture ends. */
void gca__events_defer_free(device_t *d, block_t *b);
/* The last capture on the device ended: record the held blocks' events. */
void gca__events_after_capture(device_t *d);
/* Complete the deferred frees whose events have completed, per stream in
 * order, and the device frees whose streams are done (PyTorch's
 * process_events). Nothing during a capture. */
void gca__events_process(device_t *d);
/* Wait for every pending event and complete every deferred free. */
void gca__events_synchronize(device_t *d);
/* Finish the device frees of releasing segments; wait for their streams if
 * `wait`, else only those already done. */
void gca__events_finish_releases(device_t *d, bool wait);
/* Make work queued on `to` from now on start after the work queued so far
 * on `from` (cross-stream reuse of a block cached for `from`); false if the
 * backend could do it neither with an event nor by waiting. */
bool gca__events_order_reuse(device_t *d, gca_stream_t from, gca_stream_t to);
/* Block the host until the work queued on `stream` has completed. */
int gca__events_wait_stream(device_t *d, gca_stream_t stream);
/* Whether every piece of work queued on `stream` has completed (false if
 * the backend cannot tell). */
bool gca__events_stream_is_idle(device_t *d, gca_stream_t stream);
/* Record an event on `stream` for a segment's device free: true if the
 * stream is already idle (free now); else the event is in *event. On a
 * backend failure waits for the stream instead, and returns true; false
 * with *event 0 if even that failed. */
bool gca__events_ready_to_free(device_t *d, gca_stream_t stream, uintptr_t *event);
/* Add `stream` to a block's stream uses; GCA_ERR_NOMEM if the set cannot grow. */
int gca__stream_uses_add(block_t *b, gca_stream_t stream);
/* Forget a use recorded by gca__stream_uses_add (none: nothing changes). */
void gca__stream_uses_remove(block_t *b, gca_stream_t stream);
/* At device destruction: wait for every stream the device's memory may be
 * used on, and forget the pending frees. */
void gca__events_shutdown(device_t *d, bool forked);

#endif /* GCALLOC_CORE_EVENTS_H */
