/* The allocation history (history.c), with the lock held: a ring of
 * entries with their call stacks, for snapshots and memory_viz.
 */
#ifndef GCALLOC_CORE_HISTORY_H
#define GCALLOC_CORE_HISTORY_H

#include "core/core.h"

typedef struct history_entry {
  uint8_t action;            /* gca_trace_action */
  uint8_t depth;             /* frames in ips */
  gca_stream_t stream;
  uint64_t addr, size, device_free;
  int64_t time_us;
  uint64_t ipc_received;               /* ipc_request */
  int32_t ipc_asked, ipc_silent;       /* ipc_request */
  int32_t ipc_requester;               /* ipc_release */
  uintptr_t ips[MAX_FRAMES];
} history_entry_t;

typedef struct history {
  history_entry_t *ring;
  size_t cap, count, next;   /* next: where the next entry goes */
  int context;               /* gca_context */
  int stacks;                /* gca_stacks */
} history_t;

int64_t gca__history_now_us(void);
/* Entries; called only while d->obs.recording. */
void gca__history_event(device_t *d, int action, uintptr_t addr, size_t size, gca_stream_t stream);
void gca__history_alloc(device_t *d, block_t *b, size_t requested);
void gca__history_oom(device_t *d, size_t size, gca_stream_t stream, size_t device_free);
/* Cooperation between processes: a request to the peers and what came of
 * it; a release made for a peer (no stack: the answering thread's). */
void gca__history_ipc_request(device_t *d, size_t need, gca_stream_t stream, int asked, int silent,
                              size_t received);
void gca__history_ipc_release(device_t *d, size_t released, int32_t requester);
/* A block's free completed: drop its stack. */
void gca__history_drop_stack(block_t *b);
/* segment.c: a free completes: record it (if on) and drop the block's stack. */
void gca__history_free_completed(device_t *d, block_t *b);
int gca__history_start(device_t *d, int context, int stacks, size_t max_entries);
/* Without any lock (the GIL is taken first: pyframes.c): gather the
 * calling thread's Python frames for the entries (and block stacks) the
 * call about to be made records on `d`, if its history wants them for an
 * allocation or, `freeing`, a free; _done forgets them after the call. */
void gca__history_python_gather(device_t *d, bool freeing);
void gca__history_python_done(void);
void gca__history_stop(device_t *d);
void gca__history_destroy(device_t *d);
/* Copy the ring, oldest first, into out (room for d->obs.history->cap); returns how many. */
size_t gca__history_copy(const device_t *d, history_entry_t *out);

#endif /* GCALLOC_CORE_HISTORY_H */
