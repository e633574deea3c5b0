/* Allocation traces recorded by PyTorch users, read into one event list, and
 * turned into a replayable sequence of operations.
 *
 * Formats, told apart by their first byte: a PyTorch memory snapshot pickle
 * (its device_traces: alloc, free_requested, free_completed, segment_*, oom,
 * snapshot entries); gcalloc's own trace ("# gcalloc trace"); RMM's
 * logging_resource_adaptor CSV ("Thread,Time,Action,Pointer,Size,Stream");
 * the allocatorSim text log, one allocation a line, "<alloc_op> <free_op>
 * <size>".
 */
#ifndef GCALLOC_TRACE_H
#define GCALLOC_TRACE_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#include "gcalloc.h"

typedef enum trace_action {
  TA_ALLOC,
  TA_FREE_REQUESTED,
  TA_FREE_COMPLETED,
  TA_SEGMENT_ALLOC,
  TA_SEGMENT_FREE,
  TA_SEGMENT_MAP,
  TA_SEGMENT_UNMAP,
  TA_SNAPSHOT,
  TA_OOM,
  TA_OTHER
} trace_action;

/* 32 bytes: a long trace's events are most of what reading it writes, and
 * in a new process each fresh 4 KiB of them a page fault (23,000 events
 * are 180 pages, not 225 at 40 bytes). Devices are numbered 0 to 255 in
 * every format, and a stream is its number in trace_t.streams. */
typedef struct trace_event {
  uint64_t addr;   /* device_free for oom entries */
  uint64_t size;
  int64_t time_us; /* -1 when the trace has none */
  uint32_t stream; /* the stream's number (trace_event_stream); 0: the default stream, 0 */
  uint8_t device;
  uint8_t action;  /* trace_action */
} trace_event_t;
_Static_assert(sizeof(trace_event_t) == 32, "an event is 32 bytes");

/* The streams a trace's events name, numbered in the order first met:
 * number 0 is stream 0 (the default stream) and needs no table. */
typedef struct trace_streams {
  uint64_t *values;  /* number -> stream; NULL while only stream 0 was met */
  uint32_t count, cap;
  uint32_t *index;   /* open addressing by the stream's hash: number + 1, 0 empty */
  uint32_t index_cap; /* a power of two, at least twice count */
  /* The stream last looked up and its number (a trace's streams come in
   * runs): 0 and 0 at first. */
  uint64_t last_value;
  uint32_t last;
} trace_streams_t;

/* trace_stream_number past its first look. */
int trace_stream_lookup(trace_streams_t *s, uint64_t value, uint32_t *number);

/* The number of stream `value` in s, added if new: GCA_OK, or an error set
 * (the host out of memory, 2^32 - 2 streams). One compare when it is the
 * stream looked up last, as it is for most events of a trace. */
static inline int trace_stream_number(trace_streams_t *s, uint64_t value, uint32_t *number) {
  if (value == s->last_value) {
    *number = s->last;
    return GCA_OK;
  }
  return trace_stream_lookup(s, value, number);
}
void trace_streams_free(trace_streams_t *s);

/* A block of the snapshot's final state (segments at the end of recording). */
typedef struct trace_block {
  int device;
  uint64_t addr;
  uint64_t size;       /* rounded */
  uint64_t requested;
  uint64_t stream;
  bool active;         /* active_allocated or active_pending_free */
} trace_block_t;

typedef struct trace_segment {
  int device;
  uint64_t addr;
  uint64_t size;
  uint64_t stream; /* 0 when the snapshot does not say */
} trace_segment_t;

/* Where a replayed device came from, for a gcalloc trace whose allocators
 * shared a device number (trace_t.origins). */
typedef struct trace_origin {
  int allocator; /* the trace's allocator id */
  int device;    /* its device number */
} trace_origin_t;

typedef struct trace {
  trace_event_t *events; /* device 0's events, then device 1's ... in recorded order */
  trace_streams_t streams; /* what the events' stream numbers stand for */
  size_t events_big;     /* bytes when events is a big array (util.c), else 0 (malloc'd) */
  size_t count;
  int device_count;
  /* Snapshots only (else empty): the state when recording ended, and the
   * PYTORCH_CUDA_ALLOC_CONF the job ran with (NULL if not recorded). */
  trace_block_t *final_blocks;
  size_t final_block_count;
  trace_segment_t *final_segments;
  size_t final_segment_count;
  char *settings;
  bool has_segment_state; /* the snapshot had a segments list */
  /* gcalloc traces only: NULL while each device number was one allocator's
   * (the devices are the trace's own numbers); else device i is the pair
   * origins[i], the pairs numbered in the order they first allocated. */
  trace_origin_t *origins;
  /* Snapshots read with trace_load_options.stacks that carry frames (else
   * NULL and 0): each alloc event's call stack as stacks[event_stacks[i]]
   * (0: none; stacks[0] is NULL), stacks shared by every allocation made
   * from the same place. A stack is its frames a line each, innermost
   * first, as "file:line:function" with the file's last path component
   * (PyTorch's memory viewer's form), the allocator's own frames and the
   * interpreter's left out, at most TRACE_STACK_FRAMES of them. */
  uint32_t *event_stacks;
  char **stacks;
  size_t stack_count; /* stacks[] entries, stacks[0] included */
  uint64_t stacks_left_out; /* stacks asked for, not read: the snapshot's bytes, over the limit; else 0 */
} trace_t;

#define TRACE_STACK_FRAMES 32

/* The stream an event of t names. */
static inline uint64_t trace_event_stream(const trace_t *t, const trace_event_t *e) {
  return e->stream ? t->streams.values[e->stream] : 0;
}

/* Load either format (told apart by the pickle's first byte). Returns
 * GCA_OK, or GCA_ERR_IO / GCA_ERR_INVALID with a message naming the file and
 * the problem. */
int trace_load(const char *path, trace_t *out);
/* A long read's progress, called from the reading thread: `done` of
 * `total` bytes of `stage`: "decompressing" (a compressed trace's bytes
 * read, after every 8 MiB it gave at most), then "reading" (the trace's
 * own bytes); total 0 when unknown. A caller that shows it should
 * throttle it: it may come every megabyte. */
typedef void (*trace_progress_fn)(void *ctx, const char *stage, uint64_t done, uint64_t total);
/* trace_load, telling `progress` (when not NULL) how far it is. */
int trace_load_progress(const char *path, trace_t *out, trace_progress_fn progress, void *ctx);
typedef struct trace_load_options {
  trace_progress_fn progress; /* as trace_load_progress's; NULL: none */
  void *ctx;
  /* Keep the allocations' call stacks (trace_t.stacks) where a snapshot
   * has frames: they are most of a snapshot, so reading keeps them only
   * when asked, and reads them by the general machine, a dict an entry
   * (about 3x the time and 4 bytes of memory more per byte of snapshot). */
  bool stacks;
  /* With stacks: only from a snapshot of at most this many bytes (as read,
   * decompressed); a larger one is read without them, and
   * trace_t.stacks_left_out says so. 0: any size. */
  uint64_t stacks_limit;
} trace_load_options_t;
int trace_load_with(const char *path, const trace_load_options_t *options, trace_t *out);
void trace_free(trace_t *t);
/* A PyTorch snapshot already in memory (`name` is for the messages). */
int trace_parse_snapshot(const char *name, const void *data, size_t len, trace_t *out);
/* Tests: the same through the pickle reader's general machine alone (no
 * flat-dict loop, no entries taken as they are read), which must give the
 * same trace or the same error. */
int trace_parse_snapshot_slowly(const char *name, const void *data, size_t len, trace_t *out);
/* Tests: the same with the pickle reader's second reader started at
 * offset `split` of the data (pickle_options.split), wherever that is. */
int trace_parse_snapshot_split(const char *name, const void *data, size_t len, size_t split, trace_t *out);
/* Tests: the same with its call stacks (trace_load_options.stacks). */
int trace_parse_snapshot_stacks(const char *name, const void *data, size_t len, trace_t *out);
/* The same events, final state and settings (tests, the fuzzer). */
bool trace_equal(const trace_t *a, const trace_t *b);

/* A replayable operation: allocate `size` into slot, or free the slot. */
typedef struct trace_op {
  uint32_t slot;
  uint8_t is_free;
  uint8_t device;
  uint64_t size;
  uint64_t stream;
} trace_op_t;

typedef struct trace_ops {
  trace_op_t *ops;
  size_t count;
  size_t slot_count;     /* slots used: allocations in the trace */
  size_t skipped_frees;  /* frees of blocks that were live before the trace began */
  size_t allocs;
} trace_ops_t;

/* Allocations become slots; a block's free is its free_requested entry (the
 * program's free call) or, without one, its free_completed. Frees of blocks
 * allocated before recording began are skipped and counted. */
int trace_to_ops(const trace_t *t, trace_ops_t *out);
void trace_ops_free(trace_ops_t *o);

#endif /* GCALLOC_TRACE_H */
