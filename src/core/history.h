/* The allocation history (history.c), with the lock held: a ring of
 * entries with their call stacks, for snapshots and memory_viz.
 */
#ifndef GCALLOC_CORE_HISTORY_H
#define GCALLOC_CORE_HISTORY_H

#include "core/core.h"

/* An entry: 56 bytes, the call stack apart (history_t.frames). A cached
 * alloc+free pair writes two, under the device lock: their stores must
 * land in the processor's caches and the lock's release waits for them, so
 * the ring is kept dense, and a free that completes at once takes one slot
 * for its two entries (completed_too). */
typedef struct history_entry {
  uint8_t action; /* gca_trace_action */
  uint8_t depth;  /* frames kept for it in history_t.frames (0 when there are none) */
  uint8_t completed_too; /* in the ring: a free_requested slot that is also its free_completed
                          * entry, at the same time and with the same stack (0 in a copy) */
  union {
    int32_t ipc_asked;     /* ipc_request: peers asked */
    int32_t ipc_requester; /* ipc_release: the pid asking */
  };
  gca_stream_t stream;
  uint64_t addr, size;
  union {
    uint64_t ticks;  /* in the ring: gca__ticks when it was recorded */
    int64_t time_us; /* in a copy (gca__history_copy): the wall clock's microseconds */
  } when;
  union {
    uint64_t device_free; /* oom */
    struct {
      uint64_t received;  /* ipc_request */
      int32_t silent;
    } ipc;
  };
} history_entry_t;
_Static_assert(sizeof(history_entry_t) == 56, "a history entry is 56 bytes");

typedef struct history {
  history_entry_t *ring;
  uintptr_t (*frames)[MAX_FRAMES]; /* entry i's stack at frames[i]; NULL when entries get none (context < ALLOC) */
  size_t cap;                /* the entries kept: the newest `cap` (PyTorch's max_entries) */
  size_t count, next;        /* slots in use (at most cap), and where the next goes; a slot
                              * holds one entry or two (completed_too) */
  int context;               /* gca_context */
  int stacks;                /* gca_stacks */
  ticks_pair_t start;        /* the counter and the wall clock when recording started */
} history_t;

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
/* A free that completes at once (no other stream used the block): its
 * free_requested and free_completed entries, one slot, one clock reading
 * and one stack for both. Recording on. */
void gca__history_freed_at_once(device_t *d, const block_t *b);
int gca__history_start(device_t *d, int context, int stacks, size_t max_entries);
/* Without any lock (the GIL is taken first: pyframes.c): gather the
 * calling thread's Python frames for the entries (and block stacks) the
 * call about to be made records on `d`, if its history wants them for an
 * allocation or, `freeing`, a free; _done forgets them after the call. */
void gca__history_python_gather(device_t *d, bool freeing);
void gca__history_python_done(void);
void gca__history_stop(device_t *d);
void gca__history_destroy(device_t *d);
/* The entries the history holds now (at most its cap). */
size_t gca__history_entries(const device_t *d);
/* Copy the entries, oldest first, into out (room for gca__history_entries),
 * each entry's time on the wall clock, and their stacks into frames (as
 * many rows) when the history keeps any (d->obs.history->frames); returns
 * how many. */
size_t gca__history_copy(const device_t *d, history_entry_t *out, uintptr_t (*frames)[MAX_FRAMES]);

#endif /* GCALLOC_CORE_HISTORY_H */
