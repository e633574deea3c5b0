/* Replaying a recorded trace on the simulated device, and comparing with
 * what PyTorch's allocator did on the same sequence (docs/replay.md). */
#ifndef GCALLOC_REPLAY_H
#define GCALLOC_REPLAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gcalloc.h"
#include "core/inspect.h"
#include "trace.h"

/* Called every few thousand operations of a long replay. */
typedef void (*replay_progress_fn)(void *ctx, int device, size_t done, size_t total);

/* Every device's plan of a trace (replay_plan): what replay_trace makes of
 * the trace before it replays it, whatever the settings. */
typedef struct replay_plans replay_plans_t;

typedef struct replay_options {
  const char *conf;        /* configuration; NULL: the trace's recorded settings, else defaults */
  uint64_t capacity;       /* bytes of the simulated device; 0: unlimited (8 TiB) */
  int device;              /* -1: every device of the trace */
  bool infer_empty_cache;  /* a run of recorded segment frees gcalloc did not cause is an empty_cache() */
  bool match_segments;     /* compare gcalloc's segment events with the recorded ones */
  bool timeline;           /* keep the memory after every operation, and the segments at the peak */
  bool series_only;        /* with timeline: the memory only, not the segments at the peak (no second run) */
  bool page_census;        /* with expandable segments: count their pages at the peak (maps: with timeline) */
  int threads;              /* devices replayed at once; 0: one per processor usable (results do not depend on it) */
  bool start_snapshot;      /* tests: each device's state after the seeding, in start_snapshot */
  replay_progress_fn progress; /* called from the replaying threads, one call at a time */
  void *progress_ctx;
  /* The plans replay_plan made of this trace with the same device and
   * infer_empty_cache, used instead of planning again (a trace replayed
   * under many settings: gcalloc tune); NULL: planned here. Only read, so
   * threads may share them. */
  const replay_plans_t *plans;
} replay_options_t;

/* A block live at gcalloc's peak that the report says more of: where its
 * allocation was made (an index into trace_t.stacks), or that it was live
 * when recording began (REPLAY_BEFORE_RECORDING). */
typedef struct replay_origin {
  uint64_t addr;
  uint32_t stack;
} replay_origin_t;
#define REPLAY_BEFORE_RECORDING UINT32_MAX

typedef struct replay_device {
  int device;
  /* A gcalloc trace whose allocators shared a device number (trace_t.origins):
   * the allocator id and its device number this device replays; else -1 and
   * `device`. */
  int allocator, recorded_device;
  size_t events;                  /* alloc and free operations replayed (before the out-of-memory, with oom) */
  size_t seeded;                  /* allocations live when recording began, made first */
  size_t start_segments;          /* of PyTorch's segments at that time, those made as recorded (0: none) */
  uint64_t peak_requested, peak_allocated, peak_reserved;
  /* The least any allocator could reserve at its peak for this sequence, in
   * 2 MiB pages with PyTorch's two pools kept apart (the whole sequence,
   * whether or not the replay fitted): how far peak_reserved is from the
   * best possible. */
  uint64_t bound_reserved;
  int64_t recorded_peak_reserved; /* PyTorch's, from the trace's segment events; -1 unknown */
  uint64_t device_allocs, device_frees;
  size_t segment_events_recorded; /* in the trace, after the start */
  size_t segment_events_matched;  /* of those, reproduced by gcalloc in order (same action and size) */
  size_t segment_events_replayed; /* gcalloc's own, after the start */
  size_t empty_cache_calls;       /* inferred from the recorded segment frees */
  bool oom;                       /* the replay stopped at an allocation that failed */
  size_t oom_event;               /* its index among the device's operations */
  uint64_t oom_size;
  char oom_message[2048];
  double seconds;                 /* the replay loop, without loading */
  /* Expandable segments (all zero when none was made): pages mapped and
   * unmapped over the replay (moves included), moved by stitching, and with
   * options.page_census or timeline the census at gcalloc's peak reserved
   * (with timeline, with each range's map). */
  bool expandable;
  uint64_t pages_mapped, pages_unmapped, pages_moved;
  uint64_t stitch_waits; /* stitching's waits for the stream before moving pages */
  page_census_t peak_pages;
  /* With options.timeline: the bytes after each operation (seeds included),
   * PyTorch's reserved where the trace records it (else NULL), and the
   * segments when gcalloc's reserved first reached its peak. */
  size_t timeline_count;
  uint64_t *requested_at, *allocated_at, *reserved_at;
  int64_t *recorded_reserved_at;
  size_t peak_op;
  gca_snapshot_t *peak_snapshot;
  /* With options.timeline, the blocks of peak_snapshot with an origin, by
   * address (replay_origin_at). */
  replay_origin_t *peak_origins;
  size_t peak_origin_count;
  gca_snapshot_t *start_snapshot; /* with options.start_snapshot */
} replay_device_t;

typedef struct replay_result {
  replay_device_t *devices;
  int device_count;
  char conf[1024];                /* the configuration replayed with */
} replay_result_t;

int replay_trace(const trace_t *t, const replay_options_t *o, replay_result_t *out);
/* The plans of t's devices under o (its device and infer_empty_cache), for
 * replay_trace's options.plans: GCA_OK, or an error set (the host out of
 * memory, a device the trace does not have). Freed by replay_plans_free
 * after the last replay that uses them. */
int replay_plan(const trace_t *t, const replay_options_t *o, replay_plans_t **out);
void replay_plans_free(replay_plans_t *plans);

/* A segment event, PyTorch's or the replay's: what the matching compares. */
typedef struct seg_event {
  bool alloc; /* segment_alloc/map; else free/unmap */
  uint64_t size;
} seg_event_t;
/* How many of x's events y reproduces in order: the longest common
 * subsequence by (action, size). In the header for the tests. */
size_t replay_segment_lcs(const seg_event_t *x, size_t n, const seg_event_t *y, size_t m);
void replay_result_free(replay_result_t *r);
/* The origin of the block at addr in d's peak_snapshot, or NULL: none known. */
const replay_origin_t *replay_origin_at(const replay_device_t *d, uint64_t addr);

#endif
