/* The caching core and its policies: types and functions shared by
 * src/core, and seen by the layers above it (host, observe, api) and by the
 * replay toolkit.
 *
 * The picture: an allocator owns a backend (a table of device primitives) and
 * one `device` per device the backend exposes. A device owns its segments
 * (memory obtained from the backend), each tiled exactly by blocks linked in
 * address order. A free block sits in the free index of its pool (small or
 * large), ordered by (stream, size, address); an allocated block sits in the
 * device's allocation map, keyed by address. A block is in at most one of
 * the two, so both share one intrusive link; a block in neither is waiting:
 * freed by the caller but still used by queued stream work (see events.c), or
 * the whole of a segment on its way back to the device. Everything a device owns is guarded
 * by its one mutex; nothing here is touched without it, except the two
 * atomic mirrors of allocated and reserved bytes that lock-free readers use.
 */
#ifndef GCALLOC_CORE_H
#define GCALLOC_CORE_H

#include "base/base.h"
#include "base/tree.h"
#include "backends/backend.h"

/* PyTorch's constants (CUDACachingAllocator.cpp). */
#define KIB ((size_t)1024)
#define MIB ((size_t)1024 * 1024)
#define MIN_BLOCK_SIZE ((size_t)512)     /* kMinBlockSize: every size is a multiple */
#define SMALL_SIZE MIB                   /* kSmallSize: largest small-pool request */
#define SMALL_BUFFER (2 * MIB)           /* kSmallBuffer: small-pool segment */
#define MIN_LARGE_ALLOC (10 * MIB)       /* kMinLargeAlloc: below it, a LARGE_BUFFER segment */
#define LARGE_BUFFER (20 * MIB)          /* kLargeBuffer: segment for mid-size requests */
#define ROUND_LARGE (2 * MIB)            /* kRoundLarge: big segments round up to this */
#define ROUNDUP_INTERVALS 16             /* roundup_power2_divisions intervals, 1 MiB .. 64 GiB */

/* ------------------------------------------------------------------------ */
/* Configuration (config.c)                                                  */
/* ------------------------------------------------------------------------ */

typedef struct config {
  size_t max_split_size;          /* SIZE_MAX: unlimited (no oversize rules) */
  size_t max_non_split_rounding;  /* bytes an oversize block may exceed the request by */
  size_t roundup_divisions[ROUNDUP_INTERVALS];
  double gc_threshold;            /* 0: off */
  double memory_fraction;         /* of each device's total the process may reserve */
  bool memory_fraction_set;       /* the key was given (enforced, and GC may run) */
  uint64_t oom_retry_timeout_ms;  /* 0: an allocation that cannot be served fails at once */
  uint32_t oom_handler_retries;   /* rounds of OOM handlers asking for another try */
  size_t pinned_num_register_threads;
  bool expandable_segments;
  /* gcalloc's own, with expandable segments: before mapping new memory,
   * move whole free pages of the same pool and stream into place. */
  bool stitching;
  bool release_lock_on_malloc;
  bool pinned_use_host_register;
  bool pinned_use_background_threads;
  size_t pinned_reserve_segment_mb; /* 0: none; the pinned allocator pins it at the first miss that finds it set */
  bool backend_async;             /* backend:cudaMallocAsync */
  /* A miss may take a whole segment cached for another stream, up to this
   * many times the size of the segment the device would be asked for:
   * 0 off, HUGE_VAL any size. */
  double cross_stream_reuse;
  bool any_divisions;             /* some roundup_divisions[i] > 1: rounding takes the slow path */
  /* pad_32_bytes (gcalloc's own, for torch_npu's sizing): PAD_AUTO asks
   * the backend (backend_ops_t.size_pad), PAD_ON and PAD_OFF decide. */
  int pad_32_mode;
  size_t size_pad;                /* bytes added before rounding, resolved per device */
  /* gcalloc's own: cooperation between processes on a device (coop.c). */
  bool ipc_cooperation;
  bool ipc_group_access;
  uint64_t ipc_release_timeout_ms;
} config_t;

enum { PAD_AUTO = 0, PAD_ON = 1, PAD_OFF = 2 };

void gca__config_defaults(config_t *cfg);

/* Apply `text` on top of *cfg. `origin` names where the text came from (an
 * environment variable, or NULL for code) and is quoted in messages. On error
 * *cfg is untouched, the error is set and GCA_ERR_CONFIG returned. Warnings
 * (unknown keys, features not built) go to the log. */
int gca__config_apply(config_t *cfg, const char *text, const char *origin);

/* Render *cfg as a configuration string; returns the full length. */
size_t gca__config_format(const config_t *cfg, char *buf, size_t cap);

/* ------------------------------------------------------------------------ */
/* Sizing rules (size.c)                                                     */
/* ------------------------------------------------------------------------ */

/* PyTorch's round_size (torch_npu's, with cfg->size_pad added first); 0
 * when `size` is too large to round. */
size_t gca__round_size(const config_t *cfg, size_t size);
/* Round up to the next of `divisions` equal steps between the surrounding
 * powers of two (PyTorch's roundup_power2_next_division); 0 on overflow. */
size_t gca__round_to_division(size_t size, size_t divisions);
/* The roundup_power2_divisions interval of `size`: floor(log2 size) - 20, clamped to 0..15. */
int gca__roundup_interval(size_t size);
/* PyTorch's get_allocation_size; 0 when it would overflow. */
size_t gca__segment_size_for(size_t rounded);

/* ------------------------------------------------------------------------ */
/* Blocks, segments, pools                                                   */
/* ------------------------------------------------------------------------ */

typedef struct block block_t;
typedef struct segment segment_t;

/* A captured call stack: raw return addresses, innermost first. */
#define MAX_FRAMES 16
typedef struct call_stack {
  uint8_t depth;
  uintptr_t ips[MAX_FRAMES];
} call_stack_t;
typedef struct pool pool_t;
typedef struct device device_t;

/* Where a block is in its life. */
enum block_state {
  BLOCK_FREE,        /* in its pool's free index */
  BLOCK_ALLOCATED,   /* in the allocation map */
  BLOCK_PENDING,     /* freed; waits for events on the streams that used it */
  BLOCK_QUARANTINED, /* freed, but the backend could not order its reuse: never reused */
  BLOCK_RELEASING,   /* a whole segment whose device free waits for its stream */
  BLOCK_UNMAPPED     /* expandable segments: addresses with no memory mapped, in the pool's unmapped index */
};

/* Streams other than its own a block was used on (record_stream). Usually
 * none, so a block holds only a pointer. */
typedef struct stream_uses {
  uint32_t count, cap;
  gca_stream_t streams[];
} stream_uses_t;

struct block {
  /* What a search down the free index reads comes first, in one cache line:
   * the tree links, then the key (stream, size, address). */
  RB_ENTRY(block) link;      /* free index node (free blocks only) */
  gca_stream_t stream;       /* the stream the block's segment belongs to */
  size_t size;               /* rounded size this block covers */
  uintptr_t addr;
  block_t *prev, *next;      /* address neighbours inside the segment */
  block_t *hash_next;        /* chain of the allocation map */
  segment_t *segment;
  pool_t *pool;
  size_t requested;          /* what the caller asked for (allocated and pending blocks) */
  stream_uses_t *uses;       /* allocated blocks: other streams that used it; NULL: none */
  call_stack_t *stack;       /* where it was allocated (history context STATE and up); else NULL.
                              * Beside `uses`: a free tests both, and recording, in one branch. */
  uint32_t event_count;      /* pending blocks: events not yet completed */
  uint8_t state;             /* enum block_state */
  bool oversize;             /* counted in oversize_allocations */
  bool expandable;           /* lies in an expandable segment (segment->expandable, kept here, hot) */
  bool traced_pending;       /* its free went into the trace file as pending: its completion goes too */
  uint64_t gc_base;          /* free blocks: the pool's lookup count when it became free (age = now - base) */
};

struct segment {
  uintptr_t addr;
  size_t size;
  gca_stream_t stream;
  pool_t *pool;
  block_t *head;             /* the block at addr */
  segment_t *prev, *next;    /* the device's segment list */
  segment_t *release_next;   /* the device's list of segments being released */
  uintptr_t release_event;   /* releasing: completes when its stream's work is done */
  bool oversize;             /* counted in oversize_segments */
  /* Expandable segments (expandable.c): addr and size are the reserved
   * address range, tiled by blocks of which the UNMAPPED ones have no
   * memory; pages[i] is the physical memory mapped at page i (0: none). */
  bool expandable;
  bool range_kept;           /* empty, and the device would not release its range: offered again at releases */
  size_t page_size;
  uintptr_t *pages;          /* page_cap entries; pages past it are unmapped */
  size_t page_cap;
  size_t mapped_bytes;
  size_t mapped_top;         /* one past the highest page mapped (0: none), for the census */
  /* Its pool is paused: 1 for each page that was mapped and is mapped
   * again at resume (page_cap entries); NULL otherwise. */
  uint8_t *paused_pages;
};

RB_HEAD(free_index, block);
RB_HEAD(unmapped_index, block);

struct pool {
  struct free_index index;   /* free blocks by (stream, size, address) */
  size_t free_count;         /* nodes in the index */
  size_t expandable_segments; /* of this pool: while 0, best fit pays one branch for them */
  struct unmapped_index unmapped; /* unmapped blocks by (stream, address) */
  size_t unmapped_count;
  uint64_t lookups;          /* best-fit searches so far: the clock of block ages (gc.c) */
  int kind;                  /* GCA_POOL_SMALL or GCA_POOL_LARGE */
  struct mempool *owner;     /* the private pool it belongs to; NULL: the device's default pools */
  bool pausable;             /* its segments are expandable whatever the configuration (mempool.c) */
};

void gca__pool_init(pool_t *pool, int kind);
void gca__pool_insert(pool_t *pool, block_t *b);
void gca__pool_remove(pool_t *pool, block_t *b);
/* The key of `b`, in the index, just became smaller (or larger): restore the
 * order, which in the common case means checking one neighbour and nothing
 * more. Keys may only move in the direction named. `before` is b's
 * predecessor in the index (pool_best_fit reports it). */
void gca__pool_key_decreased(pool_t *pool, block_t *b, block_t *before);
void gca__pool_key_increased(pool_t *pool, block_t *b);
/* Best fit for `size` on `stream` under the oversize rules; NULL on a miss.
 * *pred receives the found block's predecessor in the index. */
block_t *gca__pool_best_fit(pool_t *pool, const config_t *cfg, gca_stream_t stream, size_t size, block_t **pred);
/* Whether free block `b` (size >= `size`) may serve `size` under the oversize rules. */
bool gca__pool_fits(const config_t *cfg, size_t size, const block_t *b);
/* The smallest free block on `stream` whose size is >= size, ignoring the oversize rules. */
block_t *gca__pool_lower_bound(pool_t *pool, gca_stream_t stream, size_t size);
/* The largest free block on `stream`, or NULL. */
block_t *gca__pool_last_on_stream(pool_t *pool, gca_stream_t stream);
block_t *gca__pool_first(pool_t *pool);
/* The first block of the first stream after `stream`, or NULL. */
block_t *gca__pool_first_after_stream(pool_t *pool, gca_stream_t stream);
block_t *gca__pool_next(pool_t *pool, block_t *b);
block_t *gca__pool_prev(pool_t *pool, block_t *b);
bool gca__pool_contains(pool_t *pool, block_t *b);
/* The unmapped index (expandable segments). */
void gca__pool_unmapped_insert(pool_t *pool, block_t *b);
void gca__pool_unmapped_remove(pool_t *pool, block_t *b);
/* The unmapped block of `stream` at the lowest address, or NULL. */
block_t *gca__pool_unmapped_first(pool_t *pool, gca_stream_t stream);
block_t *gca__pool_unmapped_next(pool_t *pool, block_t *b);
bool gca__pool_unmapped_contains(pool_t *pool, block_t *b);

/* ------------------------------------------------------------------------ */
/* Allocation map (blockmap.c): allocated blocks by address, open hashing     */
/* ------------------------------------------------------------------------ */

typedef struct block_map {
  block_t **buckets;
  size_t bucket_count;       /* a power of two */
  size_t count;
} block_map_t;

int gca__block_map_init(block_map_t *m);
void gca__block_map_destroy(block_map_t *m);
/* Insert; may grow the table. Never fails: if growing fails the chains just
 * get longer. */
void gca__block_map_insert(block_map_t *m, block_t *b);
block_t *gca__block_map_find(const block_map_t *m, uintptr_t addr);
/* Remove and return the block at addr, or NULL. */
block_t *gca__block_map_take(block_map_t *m, uintptr_t addr);

/* ------------------------------------------------------------------------ */
/* Statistics (stats.c)                                                      */
/* ------------------------------------------------------------------------ */

static inline void stat_increase(gca_stat_t *s, int64_t n) {
  s->current += n;
  if (s->current > s->peak) s->peak = s->current;
  s->allocated += n;
}

static inline void stat_decrease(gca_stat_t *s, int64_t n) {
  s->current -= n;
  s->freed += n;
}

/* How a device keeps its statistics. Families are kept per pool (small,
 * large); the "all" entry is derived when read, since its current, allocated
 * and freed are sums of the two pools. Only its peak must be tracked as
 * things happen (the peak of a sum is not the sum of the peaks). A family's
 * two pool entries share one cache line, so an update finds the sibling's
 * current, needed for that peak, in the line it already holds; an
 * allocation touches a few lines of statistics plus the line of "all" peaks.
 *
 * "active" is not kept either, to spare the hot path two more families. By
 * PyTorch's definition it is what is allocated plus what was freed but whose
 * free has not completed (pending), so it is derived from the allocation
 * families and the pending ones (kept, moved only when a free is deferred):
 *   active.current   = allocation.current + pending.current
 *   active.allocated = allocation.allocated (both rise together, at malloc)
 *   active.freed     = allocation.freed - pending's rises + pending's falls
 *   active.peak      = max(allocation.peak, active_peak)
 * The sum can only rise at a malloc, and while nothing is pending it equals
 * allocation, whose peak covers it; so active_peak is raised at a malloc only
 * while some free is pending (one branch on the hot path). */
enum stat_family {
  FAM_ALLOCATION,
  FAM_ALLOCATED_BYTES,
  FAM_REQUESTED_BYTES,
  FAM_INACTIVE_SPLIT,
  FAM_INACTIVE_SPLIT_BYTES,
  FAM_SEGMENT,
  FAM_RESERVED_BYTES,
  FAM_PENDING,       /* blocks freed whose free has not completed */
  FAM_PENDING_BYTES,
  FAM_COUNT
};

/* A kept statistic. "allocated" (the total of increases) is not counted on
 * the hot path: since the last reset it equals current - base + freed. */
typedef struct kept_stat {
  int64_t current;
  int64_t peak;
  int64_t freed;
  int64_t base; /* current at the last reset of accumulated counts */
} kept_stat_t;

typedef struct family_stats {
  _Alignas(64) kept_stat_t pool[2]; /* [kind - 1]: small, large */
} family_stats_t;

/* The scalar counters, named as in gca_stats_t: one list, so that keeping,
 * publishing and resetting a counter cannot drift apart. */
#define KEPT_COUNTERS(X)                                                                                     \
  X(num_alloc_retries) X(num_ooms) X(num_sync_all_streams) X(num_device_alloc) X(num_device_free)              \
  X(num_cross_stream_reuses) X(num_device_free_failures) X(num_gc_releases) X(num_alloc_waits)                 \
  X(num_oom_handler_retries) X(num_pages_moved) X(num_ipc_requests) X(ipc_bytes_received) X(num_ipc_timeouts)

typedef struct kept_stats {
  family_stats_t family[FAM_COUNT];
  int64_t all_peak[FAM_COUNT];
  /* Peak of allocation + pending reached while frees were pending:
   * [0] blocks, [1] bytes; by pool index (GCA_POOL_ALL, SMALL, LARGE). */
  int64_t active_peak[2][GCA_POOL_KINDS];
  gca_stat_t oversize_allocations;
  gca_stat_t oversize_segments;
#define DECLARE_COUNTER(name) int64_t name;
  KEPT_COUNTERS(DECLARE_COUNTER)
#undef DECLARE_COUNTER
} kept_stats_t;

static inline int64_t family_current(const kept_stats_t *k, int fam) {
  return k->family[fam].pool[0].current + k->family[fam].pool[1].current;
}

static inline void family_increase(kept_stats_t *k, int fam, int kind, int64_t n) {
  kept_stat_t *st = &k->family[fam].pool[kind - 1];
  st->current += n;
  if (st->current > st->peak) st->peak = st->current;
  int64_t all = family_current(k, fam);
  if (all > k->all_peak[fam]) k->all_peak[fam] = all;
}

static inline void family_decrease(kept_stats_t *k, int fam, int kind, int64_t n) {
  kept_stat_t *st = &k->family[fam].pool[kind - 1];
  st->current -= n;
  st->freed += n;
}

/* After a malloc while frees are pending: raise the active peaks. */
void gca__stats_note_active_peak(kept_stats_t *k);

/* The public view of kept statistics, "all" entries filled in. */
void gca__stats_materialize(const kept_stats_t *kept, gca_stats_t *out);
/* The device's statistics in PyTorch's shape (gca_get_stats), under its lock. */
void gca__device_stats(device_t *d, gca_stats_t *out);
void gca__stats_reset_peak(kept_stats_t *k);
void gca__stats_reset_accumulated(kept_stats_t *k);

/* ------------------------------------------------------------------------ */
/* Devices (device.c, segment.c)                                             */
/* ------------------------------------------------------------------------ */

typedef struct block_chunk block_chunk_t;

/* A free waiting for an event: the block returns to its pool when the last
 * of its events completes. */
typedef struct pending_free {
  uintptr_t event;
  block_t *block;
} pending_free_t;

/* The pending frees of one stream, oldest first (a ring). Events of one
 * stream complete in order, so only the oldest needs asking. */
typedef struct event_queue {
  gca_stream_t stream;
  pending_free_t *items;
  size_t head, count, cap;
} event_queue_t;

struct device {
  lock_t lock;
  /* Allocations waiting for memory to come back (oom.c), beside the lock so
   * that a free's look at it (after unlocking) touches no other line. */
  _Atomic int waiters;
  int index;
  gca_allocator_t *owner;
  backend_t *backend;
  config_t config;           /* a copy of the allocator's, refreshed under the lock */
  pool_t small_pool;
  pool_t large_pool;
  /* Private pools (mempool.c), and how many routes lead to them: while 0,
   * an allocation pays one branch for them. */
  struct mempool *mempools;
  size_t routes;
  struct stream_route *stream_routes;
  size_t stream_route_count, stream_route_cap;
  /* Graph captures running on the device (gca_capture_begin): while any
   * does, nothing is freed to the device, unmapped, synchronized, or has an
   * event recorded or queried. Frees that would record events wait in
   * `held` (linked by hash_next: they are out of the allocation map). */
  size_t captures;
  block_t *held;
  size_t paused_pools;       /* frees look for a host copy to drop while nonzero */
  block_map_t allocated;
  segment_t *segments;
  size_t segment_count;
  size_t backend_free_errors; /* segment frees the backend refused */
  /* Device memory the backend has handed this device and not taken back,
   * by its own answers: gca_check holds the books to it. */
  size_t device_bytes;
  /* Physical pages unmapped whose destroy the device refused: still held,
   * off the reserved bytes (nothing maps them), offered back at every
   * release (expandable.c). */
  struct kept_page *kept_pages;
  size_t kept_page_count, kept_page_cap, kept_page_bytes;
  kept_stats_t stats;
  block_t *spare_blocks;     /* recycled descriptors: no malloc on the hot path */
  block_chunk_t *chunks;     /* where the descriptors live, freed at close */
  /* Stream-ordered frees (events.c). */
  event_queue_t *queues;     /* one per stream with pending frees */
  size_t queue_count, queue_cap;
  size_t pending_events;     /* entries in the queues */
  size_t pending_blocks;     /* blocks PENDING or QUARANTINED */
  size_t quarantined_blocks;
  segment_t *releasing;      /* segments whose device free waits for their stream */
  size_t releasing_count;
  size_t event_errors;       /* backend event failures (each handled by waiting instead) */
  size_t reported_errors;    /* event_errors + refused frees already logged */
  char absorbed_message[256]; /* the backend's message for the last of them (note_absorbed) */
  bool launch_blocking;      /* every free completes before gca_free returns */
  bool recording;            /* the history records (history.c) */
  struct history *history;   /* NULL until recording is first started */
  /* Told of every segment the device gives (alloc true) or takes back, for
   * the replay (export/replay.c). NULL otherwise: the device-call paths pay
   * one branch. */
  void (*segment_observer)(void *ctx, bool alloc, size_t size);
  void *segment_observer_ctx;
  /* Virtual memory of the backend (expandable.c): asked once. */
  int vm_state;              /* 0 not asked, 1 available, -1 not (expandable segments fall back) */
  size_t vm_granularity;
  uint64_t pages_mapped;     /* expandable pages mapped so far (moves included) */
  uint64_t pages_unmapped;   /* ... and unmapped */
  /* The per-process memory fraction: reserved bytes may not pass `allowed`. */
  bool fraction_set;
  double fraction;
  size_t allowed;
  /* Waiting allocations sleep here; a free wakes them only if `waiters`. */
  pthread_mutex_t wait_lock;
  pthread_cond_t wait_cond;
  uint64_t free_generation;  /* bumped by each wake, under wait_lock */
  /* Lock-free mirrors of the allocated and reserved bytes of both pools. */
  _Atomic int64_t allocated_now;
  _Atomic int64_t reserved_now;
  /* Cooperation between processes (coop.c): NULL when off. */
  struct coop *coop;
  _Atomic int64_t coop_waiting; /* bytes an allocation waits for, published to the peers */
  /* Lowest and highest address of any segment ever held: lets gca_free find
   * the owning device of a pointer without taking every device's lock. */
  _Atomic uintptr_t span_lo;
  _Atomic uintptr_t span_hi;
};

/* ---- private pools (mempool.c), with the device lock held ---- */
/* A live block's copy in pinned host memory, taken at a pause. */
typedef struct pool_backup {
  uintptr_t addr;
  size_t size;
  gca_stream_t stream;
  void *host;
} pool_backup_t;

typedef struct mempool {
  pool_t small, large;
  uint64_t id;
  device_t *device;
  int64_t references;        /* gca_pool_retain / gca_pool_release */
  size_t thread_routes;      /* threads' pushes naming it, not yet popped */
  size_t stream_routes;      /* streams routed to it */
  bool pausable, paused;
  pool_backup_t *backups;    /* host copies (a pause's, or kept at resume) */
  size_t backup_count, backup_cap, backup_bytes;
  /* Gives a host copy back (the front end's: the host allocator is above
   * the core). Set with the first copy. */
  void (*drop_backup)(gca_allocator_t *a, void *host);
  struct mempool *next;      /* the device's list */
} mempool_t;

typedef struct stream_route {
  gca_stream_t stream;
  mempool_t *pool;
  bool capture;              /* made by gca_capture_begin */
} stream_route_t;

/* The pool an allocation of `rounded` bytes on `stream` goes to, when some
 * route exists (d->routes): the calling thread's innermost push for this
 * device, else the stream's route, else `fallback`; NULL, with the error
 * set, when that pool is paused. */
pool_t *gca__mempool_route(device_t *d, gca_stream_t stream, size_t rounded, pool_t *fallback);
mempool_t *gca__mempool_find(device_t *d, uint64_t id);
/* The pool `id` with its device locked; NULL (nothing locked) with the
 * error set. */
mempool_t *gca__mempool_lock(gca_allocator_t *a, uint64_t id, const char *what);
/* Wait for the pool's own streams (its segments', its live blocks' other
 * uses, its pending frees') and complete the frees they held back. */
int gca__mempool_quiesce(device_t *d, mempool_t *mp);
/* Unmap and give back every page of a pool's segments, remembering them;
 * and map new memory at the remembered pages. */
int gca__mempool_unmap(device_t *d, mempool_t *mp, size_t *released);
int gca__mempool_remap(device_t *d, mempool_t *mp);
/* The pool's free cache given back (whole free pages unmapped, empty
 * ranges released) before a pause, so a resume maps back only pages that
 * hold live blocks. Returns the bytes unmapped. */
size_t gca__mempool_trim(device_t *d, mempool_t *mp);
/* The bytes a resume of the paused pool maps back. */
size_t gca__mempool_paused_bytes(const device_t *d, const mempool_t *mp);
/* Drop the pool's host copies (all, or the one of the block at addr). */
void gca__mempool_drop_backups(device_t *d, mempool_t *mp);
void gca__mempool_drop_backup_of(device_t *d, mempool_t *mp, uintptr_t addr);
/* GCA_OK, or GCA_ERR_INVALID naming `what` while a capture runs on the
 * device (calls that would synchronize or free are refused then). */
int gca__device_capturing(device_t *d, const char *what);
/* Give every segment of the device's private pools back (at destroy). */
void gca__mempools_destroy(device_t *d);
/* An allocator opens (takes its serial) and closes, for the threads' pool
 * pushes: a push to a closed allocator goes stale, one open when its
 * thread exits is undone. */
int gca__allocator_register(gca_allocator_t *a);
void gca__allocator_unregister(gca_allocator_t *a);
/* Every free index of the device, one after another: the default pools,
 * then each private pool's small and large. The first for NULL; NULL
 * after the last. */
pool_t *gca__device_pool_next(device_t *d, pool_t *pool);

int gca__device_init(device_t *d, gca_allocator_t *owner, int index, const config_t *cfg);
/* d->config.size_pad from its pad_32_bytes mode and the backend (at init,
 * and after every configuration change). */
void gca__device_resolve_pad(device_t *d);
void gca__device_destroy(device_t *d);
void *gca__device_malloc(device_t *d, size_t size, gca_stream_t stream);
/* With the lock held: free the allocation at addr, or GCA_ERR_BAD_POINTER. */
int gca__device_free_locked(device_t *d, uintptr_t addr);
/* With the lock held: if addr lies in one of the device's segments, set an
 * error "cannot ACTION ADDR: why it is not a live allocation" and return true. */
bool gca__device_explain_bad_pointer(device_t *d, uintptr_t addr, const char *action);
void gca__device_empty_cache(device_t *d);
/* A peer asked (`requester`, for the history): release the cache as
 * gca_empty_cache does (coop.c's thread); the bytes released. */
size_t gca__device_release_for_peer(device_t *d, int32_t requester);

/* ---- cooperation between processes (coop.c) ---- */
typedef struct coop coop_t;
typedef struct coop_outcome {
  int asked, timeouts;
  size_t received;
} coop_outcome_t;
/* Join the device's rendezvous (its identity names it); a thread answers
 * peers' requests until gca__coop_leave. */
int gca__coop_join(device_t *d, const char *identity, coop_t **out);
void gca__coop_leave(coop_t *c);
/* Ask the peers that cache most to release, for `need` bytes, and wait up
 * to ipc_release_timeout_ms; returns the bytes released. Without the
 * device lock. */
size_t gca__coop_ask(coop_t *c, size_t need, coop_outcome_t *out);
/* What the last request got, by peer, for the out-of-memory message. */
const char *gca__coop_last(const coop_t *c);
int gca__coop_peers(coop_t *c, gca_ipc_peer_t *out, size_t cap);
/* With the lock held: record a use of the allocation at addr by `stream`. */
int gca__device_record_stream_locked(device_t *d, uintptr_t addr, gca_stream_t stream);
void gca__device_synchronize(device_t *d);
void gca__device_process_events(device_t *d);
/* With the lock held: limit what the device may reserve to fraction x its
 * total memory (PyTorch's set_per_process_memory_fraction). */
int gca__device_set_fraction_locked(device_t *d, double fraction);
int gca__device_check_locked(device_t *d);

/* segment.c: with the lock held. */
block_t *gca__block_new(device_t *d);
void gca__block_recycle(device_t *d, block_t *b);

/* Surgery on a segment's address list, shared by every merge and split.
 * b takes in its neighbour after (before) it, which leaves the list; the
 * caller takes it out of any index first and recycles it. */
static inline void block_absorb_next(block_t *b) {
  block_t *next = b->next;
  b->size += next->size;
  b->next = next->next;
  if (next->next) next->next->prev = b;
}
static inline void block_absorb_prev(block_t *b) {
  block_t *prev = b->prev;
  b->addr = prev->addr;
  b->size += prev->size;
  b->prev = prev->prev;
  if (prev->prev) prev->prev->next = b;
  else b->segment->head = b;
}
/* The last `size` bytes of b become `tail` (a spare descriptor, given b's
 * other fields), linked after it. */
static inline void block_split_tail(block_t *b, block_t *tail, size_t size) {
  *tail = *b;
  tail->addr = b->addr + b->size - size;
  tail->size = size;
  tail->prev = b;
  if (tail->next) tail->next->prev = tail;
  b->next = tail;
  b->size -= size;
}
/* Free every descriptor chunk (at device destruction). */
void gca__block_chunks_free(device_t *d);
/* Obtain a segment for a request of `rounded` bytes; NULL with error set. */
block_t *gca__segment_alloc(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, int *status);
/* Give an unsplit free block's segment back to the backend: at once if its
 * stream has no queued work, else once that work completes (events.c
 * finishes it). The segment counts as reserved until the backend has it.
 * False if it stays cached (the device refused, or the stream's work cannot
 * be waited for). */
bool gca__segment_release(device_t *d, block_t *b);
/* Free the segment (its whole free block, out of the index) on the device
 * now: its stream's work has completed. If the device refuses, the segment
 * stays cached (back in the index) and false is returned. */
bool gca__segment_free_now(device_t *d, segment_t *seg);
/* Free the smallest cached oversize block that satisfies `rounded` (or
 * several, from the largest down); PyTorch's release_available_cached_blocks. */
bool gca__segment_release_available(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded);
/* Release every unsplit free block of both default pools (private pools
 * keep theirs: it is their graphs' memory). */
void gca__segment_release_all_cached(device_t *d);
/* Release every unsplit free block of one pool. */
void gca__segment_release_pool(device_t *d, pool_t *pool);
/* Hand out free block `b` (in its pool's index if in_index, else a fresh
 * segment's block; then `pred` is its predecessor in the index) for a
 * request: split if the rules say so, update the
 * statistics, enter the handed-out block in the allocation map and return it. */
block_t *gca__block_take(device_t *d, block_t *b, block_t *pred, bool in_index, size_t rounded, size_t requested);
/* Return a freed block (out of the map, its free complete) to its pool,
 * merging with free neighbours; `b` may be recycled. */
void gca__block_give_back(device_t *d, block_t *b);
/* A new segment's descriptor and its first block's; false with *status
 * set (host OOM). _drop gives both back when the device refused. */
bool gca__segment_descriptors_new(device_t *d, segment_t **seg, block_t **b, int *status);
void gca__segment_descriptors_drop(device_t *d, segment_t *seg, block_t *b);
/* Describe a segment of [addr, addr + size) on `stream` in `pool`, tiled by
 * the one block b, and put it on the device's list. */
void gca__segment_start(device_t *d, segment_t *seg, block_t *b, pool_t *pool, gca_stream_t stream, uintptr_t addr,
                        size_t size);
/* Keep the backend's message (gca_last_error) for a failure the device
 * handled itself (an event waited out, a free refused), for the report. */
void gca__note_absorbed(device_t *d);
/* The device refused to take memory back (it keeps it, so the cache does):
 * count it in num_device_free_failures and keep its message. */
void gca__note_refused_free(device_t *d);
/* Failures absorbed since the last report, and the last one's message:
 * taken under a lock, logged after it is dropped (a log handler may call
 * back into the library). The device cache and the pinned host cache use it. */
typedef struct absorbed {
  size_t fresh;
  char last[256];
} absorbed_t;

/* Add a segment to the device's list, or take it off. */
void gca__segment_link(device_t *d, segment_t *seg);
void gca__segment_unlink(device_t *d, segment_t *seg);
/* Keep the lock-free mirror of reserved bytes and the device's address span current. */
void gca__mirror_reserved(device_t *d);
void gca__widen_span(device_t *d, uintptr_t lo, uintptr_t hi);

/* expandable.c, with the lock held: PyTorch's expandable segments. */
/* Whether the backend has virtual memory (asked once; logs once if not). */
bool gca__expandable_available(device_t *d);
/* A block for `rounded` bytes from an expandable segment of (pool, stream),
 * mapping memory as needed (PyTorch's try_allocate_expandable_block), handed
 * out with block_take; NULL with *rc set. */
block_t *gca__expandable_take(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested, int *rc);
/* Best fit among expandable blocks: from the lower bound `b`, PyTorch's walk
 * to the block whose size plus the unmapped space after it is smallest (or,
 * with expandable segments off, past expandable blocks). */
block_t *gca__expandable_refit(pool_t *pool, const config_t *cfg, gca_stream_t stream, block_t *b);
/* Unmap every whole free page of every expandable segment, after waiting
 * for the segment's stream, and give back the address range of segments
 * left with nothing mapped (PyTorch's release_blocks for them). */
void gca__expandable_release_all(device_t *d);
/* The same for one pool's free expandable blocks. */
void gca__expandable_release_pool(device_t *d, pool_t *pool);
/* Pause: unmap and destroy every mapped page of seg, marked in
 * seg->paused_pages; the bytes given back are added to *released. Pages
 * the device will not unmap stay mapped (the first error is returned). */
int gca__expandable_pause(device_t *d, segment_t *seg, size_t *released);
/* Resume: new memory at every marked page not mapped yet; on failure the
 * pages mapped so far stay, the rest stay marked. */
int gca__expandable_resume(device_t *d, segment_t *seg);
/* A paused segment of an ending pool, nothing mapped in it: give its
 * addresses back. */
void gca__expandable_release_paused(device_t *d, segment_t *seg);
/* At device destruction: unmap and destroy everything and give the range
 * back (when give_back: see device_destroy), and free the page table.
 * Returns the bytes the device would not take back. */
size_t gca__expandable_segment_destroy(device_t *d, segment_t *seg, bool give_back);
/* At close: the kept pages given back (with give_back) and forgotten;
 * returns the bytes the device would not take back. */
size_t gca__expandable_kept_destroy(device_t *d, bool give_back);
/* At close, a call that gives memory back is tried this many times; it
 * went when it worked or the device says the handle is not its own. */
#define CLOSE_TRIES 3
static inline bool gca__given_back(int rc) { return rc == GCA_OK || rc == GCA_ERR_BAD_POINTER; }
/* How many snapshot segments the device's segments make (one per mapped run of an expandable one). */
size_t gca__expandable_snapshot_count(const device_t *d);

/* The pages of a device's expandable segments at one moment: what is
 * mapped, and what is not below each range's highest mapped page (the
 * holes; the reservation above it is address space only). */
enum { PAGE_RUN_UNMAPPED = 3 }; /* a page_run_t state beside GCA_BLOCK_* */
typedef struct page_run {
  uint64_t size;
  uint8_t state;             /* GCA_BLOCK_* of a mapped block, or PAGE_RUN_UNMAPPED */
} page_run_t;
typedef struct page_range {
  uintptr_t addr;
  uint64_t reserved;         /* the address range */
  uint64_t extent;           /* up to the end of its highest mapped page */
  uint64_t page_size;
  int pool;                  /* GCA_POOL_SMALL or GCA_POOL_LARGE */
  gca_stream_t stream;
  uint64_t mapped_pages, free_pages, unmapped_pages;
  page_run_t *runs;          /* the blocks of [addr, addr + extent) in address order */
  size_t run_count;
} page_range_t;
typedef struct page_census {
  size_t ranges;
  uint64_t reserved_bytes;   /* address space of the ranges */
  uint64_t mapped_pages, mapped_bytes;
  uint64_t free_pages, free_bytes;         /* mapped pages inside free blocks: what empty_cache unmaps */
  uint64_t unmapped_pages, unmapped_bytes; /* holes below each range's highest mapped page */
  page_range_t *maps;        /* with expandable_census(..., true): `ranges` of them */
} page_census_t;
/* Count (and with `maps`, draw) the pages; GCA_ERR_NOMEM if the maps cannot be had. */
int gca__expandable_census(const device_t *d, bool maps, page_census_t *out);
/* The same counts without maps, from what the device keeps up to date
 * (each range's mapped bytes and top, the free indexes): cheap enough to
 * take at every new peak of a replay. Nothing to free. */
void gca__expandable_census_counts(device_t *d, page_census_t *out);
static inline bool device_has_expandable(const device_t *d) {
  return d->small_pool.expandable_segments || d->large_pool.expandable_segments;
}
void gca__page_census_free(page_census_t *c);

static inline int pool_kind_of(const block_t *b) { return b->pool->kind; }

/* A block's state as snapshots name it (gca_block_state). */
static inline int block_state_of(const block_t *b) {
  switch (b->state) {
    case BLOCK_ALLOCATED: return GCA_BLOCK_ACTIVE_ALLOCATED;
    case BLOCK_PENDING:
    case BLOCK_QUARANTINED: return GCA_BLOCK_ACTIVE_PENDING_FREE;
    default: return GCA_BLOCK_INACTIVE;
  }
}

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
/* At device destruction: wait for every stream the device's memory may be
 * used on, and forget the pending frees. */
void gca__events_shutdown(device_t *d);

/* ------------------------------------------------------------------------ */
/* History (history.c), with the lock held                                   */
/* ------------------------------------------------------------------------ */

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
} history_t;

int64_t gca__history_now_us(void);
/* Entries; called only while d->recording. */
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
int gca__history_start(device_t *d, int context, size_t max_entries);
void gca__history_stop(device_t *d);
void gca__history_destroy(device_t *d);
/* Copy the ring, oldest first, into out (room for d->history->cap); returns how many. */
size_t gca__history_copy(const device_t *d, history_entry_t *out);


/* gc.c, with the lock held: PyTorch's garbage_collect_cached_blocks. When a
 * memory fraction is set and reserved memory is above garbage_collection_
 * threshold x allowed, give back whole cached large-pool segments, oldest
 * first (age: best-fit searches of the pool since the block became free),
 * until the excess is gone; without waiting for events or streams. */
void gca__gc_collect(device_t *d);

/* ------------------------------------------------------------------------ */
/* Out of memory (oom.c)                                                     */
/* ------------------------------------------------------------------------ */

/* The kinds of user callbacks the allocator keeps. */
enum callback_kind { CB_FREE_MEMORY, CB_OOM_OBSERVER, CB_OOM_HANDLER, CB_KINDS };
#define MAX_CALLBACKS 32

typedef struct callback {
  void (*fn)(void); /* the caller's function, cast back to its kind's type to call */
  void *user;
} callback_t;

typedef struct callback_list {
  callback_t items[MAX_CALLBACKS];
  _Atomic int count; /* read without the lock to skip an empty list */
} callback_list_t;

int gca__callbacks_add(gca_allocator_t *a, int kind, void (*fn)(void), void *user, const char *what);
int gca__callbacks_remove(gca_allocator_t *a, int kind, void (*fn)(void), void *user, const char *what);
/* Without any device lock: run the free-memory callbacks (true if one freed
 * memory) or the OOM handlers (true if one asked for another try). */
bool gca__oom_run_callbacks(device_t *d, int kind, size_t size);
/* With the lock held, on a request the device cannot serve: true if waiting
 * for memory to come back may help (something this allocator holds could be
 * freed, and the request fits in what the device or the fraction allows). */
bool gca__oom_worth_waiting(device_t *d, size_t rounded);
/* With the lock held: release it and wait until a free wakes this thread or
 * `ns` pass, then take it again. `generation` is the value read before the
 * last attempt (oom_generation). */
void gca__oom_wait(device_t *d, uint64_t generation, uint64_t ns);
uint64_t gca__oom_generation(device_t *d);
/* Wake allocations waiting on `d` (called after frees, without the lock). */
void gca__oom_wake(device_t *d);
static inline void device_wake_waiters(device_t *d) {
  if (unlikely(atomic_load_explicit(&d->waiters, memory_order_relaxed))) gca__oom_wake(d);
}
/* What the failed allocation tells observers. */
typedef struct oom_report {
  size_t size, limit, free_bytes;
} oom_report_t;
/* With the lock held: set the out-of-memory error (PyTorch's message plus
 * what it lacks) and fill *report for the observers. */
void gca__oom_explain(device_t *d, gca_stream_t stream, size_t rounded, oom_report_t *report);
/* Without any device lock: tell the observers. Keeps the error message. */
void gca__oom_notify(device_t *d, const oom_report_t *report);

/* ------------------------------------------------------------------------ */
/* The allocator (allocator.c)                                               */
/* ------------------------------------------------------------------------ */

typedef struct host_cache host_cache_t;

struct gca_allocator {
  backend_t backend;
  int device_count;
  device_t *devices;
  pthread_mutex_t config_lock; /* serializes gca_set_config */
  config_t config;             /* the master copy; devices hold copies */
  bool launch_blocking;        /* GCALLOC_/CUDA_/ACL_LAUNCH_BLOCKING at open */
  int id;                      /* the allocator's number in the trace file */
  pthread_mutex_t callbacks_lock;
  callback_list_t callbacks[CB_KINDS];
  host_cache_t *host;          /* the pinned host allocator (host.c) */
  _Atomic uint64_t last_pool_id; /* private pools' ids: the next is one more */
  uint64_t serial;               /* unique among the allocators of the process's life (mempool.c) */
};

/* Device `device` of `a`, or NULL with the error set, naming `what` (the
 * calls of the C API; inline: gca_malloc asks it every time). */
static inline device_t *gca__device_of(const gca_allocator_t *a, int device, const char *what) {
  if (unlikely(!a)) {
    gca__set_error(GCA_ERR_INVALID, "%s: allocator is NULL", what);
    return NULL;
  }
  if (unlikely(device < 0 || device >= a->device_count)) {
    gca__set_error(GCA_ERR_INVALID, "%s: device %d does not exist (the backend has %d device%s)", what, device,
                   a->device_count, a->device_count == 1 ? "" : "s");
    return NULL;
  }
  return &a->devices[device];
}

/* ------------------------------------------------------------------------ */
/* Trace recording, as the core sees it                                      */
/* ------------------------------------------------------------------------ */

/* While a trace file is written (GCALLOC_TRACE_FILE), src/observe/record.c
 * installs these hooks, and the core calls through them: it includes
 * nothing of the observability layer. NULL while nothing is recorded. */
typedef struct gca__call_recorder {
  /* The free being traced on this thread leaves its block pending. */
  void (*free_pending)(void);
  /* A pending free's block became reusable (under the device lock). */
  void (*free_completed)(int allocator, uintptr_t ptr);
  /* Give up the trace file's lock around callbacks and waits for memory
   * (how deep this thread held it), and take it back as deep. */
  int (*suspend)(void);
  void (*resume)(int depth);
} call_recorder_t;

extern const call_recorder_t *_Atomic gca__call_recorder;

static inline const call_recorder_t *recorder(void) {
  return atomic_load_explicit(&gca__call_recorder, memory_order_acquire);
}

static inline int recorder_suspend(void) {
  const call_recorder_t *r = recorder();
  return r ? r->suspend() : 0;
}

static inline void recorder_resume(int depth) {
  const call_recorder_t *r = recorder();
  if (r && depth) r->resume(depth);
}

#endif /* GCALLOC_CORE_H */
