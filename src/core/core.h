/* The caching core's central types and the functions every part of it
 * shares: blocks, segments, pools, the device and the allocator. Each
 * concern of the core has a header of its own beside this one (config.h,
 * stats.h, mempool.h, coop.h, expandable.h, events.h, history.h, oom.h),
 * included by the files that need it; the layers above the core (host,
 * observe, api) see these, the replay toolkit only inspect.h.
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
#include "core/config.h"
#include "core/inspect.h"
#include "core/stats.h"

/* ------------------------------------------------------------------------ */
/* Blocks, segments, pools                                                   */
/* ------------------------------------------------------------------------ */

typedef struct block block_t;
typedef struct segment segment_t;

/* A captured call stack: raw return addresses, innermost first. */
#define PY_FRAMES 16       /* Python frames first (history.c), */
#define NATIVE_FRAMES 16   /* then native return addresses */
#define MAX_FRAMES (PY_FRAMES + NATIVE_FRAMES)
enum { PY_AT_ALLOC = 1, PY_AT_FREE = 2 }; /* device.obs.python: where Python frames are wanted */
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
  /* What a search down the free index reads comes first: the tree links,
   * then the key (size, address; the stream is the segment's). A block is
   * either in an index (free, unmapped) or in use (allocated, pending,
   * quarantined), never both, so the two share their first 32 bytes, and
   * the free block's age shares the in-use block's event count and flags. */
  union {
    RB_ENTRY(block) link;    /* free or unmapped index node (free and unmapped blocks) */
    struct {                 /* in use (block_in_use) */
      block_t *hash_next;    /* allocation map chain (allocated); the capture's held list (pending) */
      size_t requested;      /* what the caller asked for */
      stream_uses_t *uses;   /* other streams that used it; NULL: none */
      call_stack_t *stack;   /* where it was allocated (history context STATE and up); else NULL.
                              * Beside `uses`: a free tests both, and recording, in one branch. */
    };
  };
  size_t size;               /* rounded size this block covers */
  uintptr_t addr;
  block_t *prev, *next;      /* address neighbours inside the segment */
  segment_t *segment;        /* (its pool and stream are the segment's: block_pool, block_stream) */
  /* Free blocks: the pool's lookup count when the block became free, 48
   * bits in two fields (block_gc_base, block_set_gc_base); in use: the
   * fields named. */
  union {
    uint32_t event_count;    /* pending blocks: events not yet completed */
    uint32_t gc_base_lo;
  };
  union {
    struct {
      bool oversize;         /* counted in oversize_allocations */
      bool traced_pending;   /* its free went into the trace file as pending: its completion goes too */
    };
    uint16_t gc_base_hi;
  };
  uint8_t state;             /* enum block_state */
  bool expandable;           /* lies in an expandable segment (segment->expandable, kept here, hot) */
};

#if UINTPTR_MAX == UINT64_MAX
_Static_assert(sizeof(block_t) == 80, "a block descriptor is 80 bytes");
#endif

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
  /* drain.started when one of its blocks was last freed: it may go back
   * once a drain begun after that returned (gca__segment_drained). */
  uint64_t freed_turn;
  /* Expandable segments (expandable.c): addr and size are the reserved
   * address range, tiled by blocks of which the UNMAPPED ones have no
   * memory; pages[i] is the physical memory mapped at page i (0: none). */
  bool expandable;
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

/* Size classes of the free index (pool.c): one per 512-byte size below
 * 512 KiB, then 16 per power of two. */
#define POOL_CLASSES 1744
#define POOL_CLASS_WORDS ((POOL_CLASSES + 63) / 64)
typedef struct stream_bins stream_bins_t;

struct pool {
  size_t free_count;         /* blocks in the free index */
  uint64_t lookups;          /* best-fit searches so far: the clock of block ages (gc.c) */
  stream_bins_t *hot;        /* the stream's bins last used */
  stream_bins_t **streams;   /* each stream's free blocks by class, sorted by stream (pool.c) */
  size_t stream_count, stream_cap;
  size_t cap_size;           /* sizes from here up share the top class, class_cap */
  unsigned class_cap;
  int kind;                  /* GCA_POOL_SMALL or GCA_POOL_LARGE */
  bool pausable;             /* its segments are expandable whatever the configuration (mempool.c) */
  bool fine_pages;           /* GCA_POOL_FINE_PAGES: its expandable segments map 2 MiB pages */
  size_t expandable_segments; /* of this pool: while 0, best fit pays one branch for them */
  struct mempool *owner;     /* the private pool it belongs to; NULL: the device's default pools */
  struct unmapped_index unmapped; /* unmapped blocks by (stream, address) */
  size_t unmapped_count;
};

void gca__pool_init(pool_t *pool, int kind);
/* Free the streams' bins (the pool's blocks are the device's). */
void gca__pool_destroy(pool_t *pool);
/* A segment of `stream` joins the pool (reserve; false: no host memory) or
 * leaves it (unreserve): while it has one, a stream's blocks always have
 * their place in the index. */
bool gca__pool_reserve(pool_t *pool, gca_stream_t stream);
void gca__pool_unreserve(pool_t *pool, gca_stream_t stream);
/* For the checker: the i-th stream with a place in the index and its
 * reservations (false past the last), and whether `stream` has one. */
bool gca__pool_stream_at(const pool_t *pool, size_t i, gca_stream_t *stream, size_t *held);
bool gca__pool_stream_held(pool_t *pool, gca_stream_t stream);
void gca__pool_insert(pool_t *pool, block_t *b);
void gca__pool_remove(pool_t *pool, block_t *b);
/* The size of `b`, in the index, just changed from old_size (a split or a
 * merge; its address may have moved with it): restore the order, which in
 * the common case means checking its neighbours and nothing more. */
void gca__pool_resized(pool_t *pool, block_t *b, size_t old_size);
/* Best fit for `size` on `stream` under the oversize rules; NULL on a miss. */
block_t *gca__pool_best_fit(pool_t *pool, const config_t *cfg, gca_stream_t stream, size_t size);
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
  /* Lowest and highest address of any segment ever held: lets gca_free find
   * the owning device of a pointer without taking every device's lock. In
   * a cache line of their own, written only when a segment widens them: a
   * free on another device reads them, and must not share a line this
   * device's allocations write (its lock, its mirrors). Devices are 64-byte
   * aligned for the same reason (gca_open allocates them so). */
  _Alignas(64) _Atomic uintptr_t span_lo;
  _Atomic uintptr_t span_hi;
  _Alignas(64) lock_t lock;
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
  struct {
    struct mempool *list;
    size_t routes;
    struct stream_route *stream_routes;
    size_t stream_route_count, stream_route_cap;
    size_t paused;           /* frees look for a host copy to drop while nonzero */
  } priv;
  /* Graph captures running on the device (gca_capture_begin): while any
   * does, nothing is freed to the device, unmapped, synchronized, or has an
   * event recorded or queried. Frees that would record events wait in
   * `held` (linked by hash_next: they are out of the allocation map). */
  struct {
    size_t count;
    block_t *held;
  } capture;
  block_map_t allocated;
  segment_t *segments;
  size_t segment_count;
  /* Device memory the backend has handed this device and not taken back,
   * by its own answers: gca_check holds the books to it. */
  size_t device_bytes;
  /* What the device refused to take back (it keeps it, so the cache does):
   * segment frees refused, and physical pages unmapped whose destroy was
   * refused, still held, off the reserved bytes (nothing maps them),
   * offered back at every release (expandable.c). */
  struct {
    size_t free_errors;
    struct kept_page *pages;
    size_t page_count, page_cap, page_bytes;
  } kept;
  kept_stats_t stats;
  block_t *spare_blocks;     /* recycled descriptors: no malloc on the hot path */
  block_chunk_t *chunks;     /* where the descriptors live, freed at close */
  /* Stream-ordered frees (events.c). */
  struct {
    event_queue_t *queues;   /* one per stream with pending frees */
    size_t queue_count, queue_cap;
    size_t pending_events;   /* entries in the queues */
    size_t pending_blocks;   /* blocks PENDING or QUARANTINED */
    size_t quarantined_blocks;
    segment_t *releasing;    /* segments whose device free waits for their stream */
    size_t releasing_count;
    size_t errors;           /* backend event failures (each handled by waiting instead) */
    size_t reported_errors;  /* errors + refused frees already logged */
    char absorbed_message[256]; /* the backend's message for the last of them (note_absorbed) */
  } ev;
  bool launch_blocking;      /* every free completes before gca_free returns */
  bool no_caching;           /* every free releases the cache (gca_no_caching) */
  bool rejected;             /* this miss was rejected by the fraction (throw_on_*malloc_oom): no ladder */
  /* The framework's host queue (gca_set_queue_drain): work queued there
   * may use a block after its free. A segment goes back only once a drain
   * begun after its last free returned (segment.freed_turn); the drain is
   * called with no lock held (gca__device_drain_unlocked), never inside a
   * release: a release that finds its segment undrained is skipped
   * (`wanted` set), and the caller drains and tries again. */
  struct {
    gca_queue_drain_fn fn;
    void *user;
    bool wanted;       /* a release was skipped for want of a drain */
    uint64_t started;  /* drains begun (turns count from 1) */
    uint64_t finished; /* the latest turn of those that returned (one that threw or jumped never does) */
  } drain;
  /* Observers: the history (history.c), and the replay's segment observer,
   * told of every segment the device gives (alloc true) or takes back
   * (inspect.h). NULL otherwise: the device-call paths pay one branch. */
  struct {
    bool recording;          /* the history records */
    /* Python frames wanted (history.c): PY_AT_ALLOC, PY_AT_FREE. Read
     * without the lock, before it is taken, to gather them. */
    _Atomic uint8_t python;
    struct history *history; /* NULL until recording is first started */
    gca__segment_observer_fn segment_fn;
    void *segment_ctx;
    /* What the core calls while segment_fn is set: gca__segment_observer_call
     * (through this pointer, see segment_observed). */
    void (*segment_call)(device_t *d, bool alloc, size_t size);
  } obs;
  /* Virtual memory of the backend (expandable.c): asked once. */
  struct {
    int state;               /* 0 not asked, 1 available, -1 not (expandable segments fall back) */
    bool unwarned;           /* found unavailable with expandable segments asked for: not said yet */
    size_t granularity;
    uint64_t pages_mapped;   /* expandable pages mapped so far (moves included) */
    uint64_t pages_unmapped; /* ... and unmapped */
  } vm;
  /* The per-process memory fraction: reserved bytes may not pass `allowed`. */
  struct {
    bool set;
    bool pending;            /* set at open: `allowed` asked of the device at its first use */
    double fraction;
    size_t allowed;
  } limit;
  /* Waiting allocations sleep here; a free wakes them only if `waiters`. */
  struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint64_t generation;     /* bumped by each wake, under the lock */
  } wait;
  /* Lock-free mirrors of the allocated and reserved bytes of both pools. */
  _Atomic int64_t allocated_now;
  _Atomic int64_t reserved_now;
  /* Allocated bytes in paused pools: live, with no device memory under them. */
  _Atomic int64_t paused_now;
  /* Cooperation between processes (coop.c): NULL when off. */
  struct coop *coop;
  _Atomic int64_t coop_waiting; /* bytes an allocation waits for, published to the peers */
};

int gca__device_init(device_t *d, gca_allocator_t *owner, int index, const config_t *cfg);
/* d->config.size_pad from its pad_32_bytes mode and the backend (at init,
 * and after every configuration change). */
void gca__device_resolve_pad(device_t *d);
/* `forked`: a child of fork's copy; its books only (gca__device_destroy). */
void gca__device_destroy(device_t *d, bool forked);
void *gca__device_malloc(device_t *d, size_t size, gca_stream_t stream);
/* With the lock held: free the allocation at addr, or GCA_ERR_BAD_POINTER. */
int gca__device_free_locked(device_t *d, uintptr_t addr);
/* With the lock held: if addr lies in one of the device's segments, set an
 * error "cannot ACTION ADDR: why it is not a live allocation" and return true. */
bool gca__device_explain_bad_pointer(device_t *d, uintptr_t addr, const char *action);
void gca__device_empty_cache(device_t *d);
/* A peer asked (`requester`, for the history): release cached segments as
 * gca_empty_cache does, the largest first until `need` bytes went back
 * (0: all of them) (coop.c's thread); the bytes released. */
size_t gca__device_release_for_peer(device_t *d, int32_t requester, size_t need);

/* With the lock held: record a use of the allocation at addr by `stream`
 * (`erase`: forget it). */
int gca__device_record_stream_locked(device_t *d, uintptr_t addr, gca_stream_t stream, bool erase);
void gca__device_synchronize(device_t *d);
void gca__device_process_events(device_t *d);
/* With the lock held: limit what the device may reserve to fraction x its
 * total memory (PyTorch's set_per_process_memory_fraction). */
int gca__device_set_fraction_locked(device_t *d, double fraction);
/* Whether a fraction limits the device, its `allowed` asked of the device
 * first if it was set at open (a device nobody uses is never asked). */
void gca__device_limit_resolve(device_t *d);
/* With the lock held: whether `bytes` more reserved would pass the
 * fraction's limit; if so the error is set (GCA_ERR_OOM) and, under
 * throw_on_cudamalloc_oom / throw_on_npumalloc_oom, the request is rejected
 * outright: no cache released, no retry (num_oom_rejections). */
bool gca__device_limit_refuses(device_t *d, size_t bytes);
static inline bool limit_on(device_t *d) {
  if (!d->limit.set) return false;
  if (unlikely(d->limit.pending)) gca__device_limit_resolve(d);
  return true;
}
/* With the lock held: empty the framework's queue before device memory goes
 * back (`always`: even if nothing was freed since, for a pause, whose live
 * blocks may have queued work). */
/* Whether seg's free memory may go back to the device now (with the lock
 * held): no framework queue, or a drain begun after its last free
 * returned. false sets drain.wanted: the caller skips the release, and its
 * caller drains (below) and tries again. */
static inline bool gca__segment_drained(device_t *d, const segment_t *seg) {
  if (!d->drain.fn || seg->freed_turn < d->drain.finished) return true;
  d->drain.wanted = true;
  return false;
}
/* Drain the framework's queue if wanted (a release was skipped) or a
 * segment is undrained (or `always`), with d's lock held on
 * entry and on return and released around the call (and the trace file's,
 * as around any callback): the drain may take the framework's locks (the
 * GIL), call gcalloc, throw or longjmp. The caller's state must be whole. */
void gca__device_drain_unlocked(device_t *d, bool always);
/* The same from a caller that holds no lock: every device of `a` with a
 * framework queue and memory that could go back. */
void gca__drain_devices(gca_allocator_t *a, bool always);
/* gca_pool_release without its drain, for a caller that holds a lock of
 * its own (no framework call may run under it) and drained before taking
 * it: a segment freed into since then stays cached until the next drain. */
int gca__pool_release_drained(gca_allocator_t *a, gca_pool_t pool);
/* With the lock held: PyTorch's release_cached_blocks (every pending free
 * waited for, every whole cached segment given back), as the ladder's last
 * step and gca_empty_cache do. */
void gca__device_release_cache_locked(device_t *d);
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
/* Whole cached segments of the default pools, largest first, until `need`
 * bytes went back (then the expandable segments' cache too, when short);
 * the bytes of the ordinary segments released. */
size_t gca__segment_release_cached_upto(device_t *d, size_t need);
/* Release every unsplit free block of one pool. */
void gca__segment_release_pool(device_t *d, pool_t *pool);
/* Hand out free block `b` (in its pool's index if in_index, else a fresh
 * segment's block) for a request: split if the rules say so, update the
 * statistics, enter the handed-out block in the allocation map and return it. */
block_t *gca__block_take(device_t *d, block_t *b, bool in_index, size_t rounded, size_t requested);
/* Return a freed block (out of the map, its free complete) to its pool,
 * merging with free neighbours; `b` may be recycled. */
void gca__block_give_back(device_t *d, block_t *b);
/* A new segment's descriptor and its first block's, and its place in the
 * free index of (pool, stream); false with *status set (host OOM). _drop
 * gives them back when the device refused. */
bool gca__segment_descriptors_new(device_t *d, pool_t *pool, gca_stream_t stream, segment_t **seg, block_t **b,
                                  int *status);
void gca__segment_descriptors_drop(device_t *d, pool_t *pool, gca_stream_t stream, segment_t *seg, block_t *b);
/* A segment of `stream` joins `pool` (false: no host memory) or leaves it:
 * its place in the pool's free index (gca__pool_reserve), and for a private
 * pool's segment in the device's pool that takes it in if the private pool
 * ends before the device takes it back. */
bool gca__segment_reserve(device_t *d, pool_t *pool, gca_stream_t stream);
void gca__segment_unreserve(device_t *d, pool_t *pool, gca_stream_t stream);
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

/* At close, a call that gives memory back is tried this many times; it
 * went when it worked or the device says the handle is not its own. */
#define CLOSE_TRIES 3
static inline bool gca__given_back(int rc) { return rc == GCA_OK || rc == GCA_ERR_BAD_POINTER; }
/* The pool a block belongs to: its segment's (a segment moves between
 * pools whole, mempool.c's rehome). */
static inline pool_t *block_pool(const block_t *b) { return b->segment->pool; }
/* The device's pool of `pool`'s kind: a private pool's segments go there if
 * it ends while the device still holds them (mempool.c, rehome). */
static inline pool_t *home_pool(device_t *d, const pool_t *pool) {
  return pool->kind == GCA_POOL_SMALL ? &d->small_pool : &d->large_pool;
}
static inline gca_stream_t block_stream(const block_t *b) { return b->segment->stream; }
/* A free block's age is counted modulo 2^48 best-fit searches of its pool:
 * exact for any age a process can reach (2^48 searches take days even at
 * a billion a second). */
#define GC_AGE_MASK ((UINT64_C(1) << 48) - 1)
static inline void block_set_gc_base(block_t *b, uint64_t lookups) {
  b->gc_base_lo = (uint32_t)lookups;
  b->gc_base_hi = (uint16_t)(lookups >> 32);
}
static inline uint64_t block_gc_base(const block_t *b) { return (uint64_t)b->gc_base_hi << 32 | b->gc_base_lo; }
static inline uint64_t block_gc_age(const pool_t *pool, const block_t *b) {
  return (pool->lookups - block_gc_base(b)) & GC_AGE_MASK;
}
static inline int pool_kind_of(const block_t *b) { return block_pool(b)->kind; }
/* Whether the block's in-use fields (hash_next, requested, uses, stack)
 * hold values: allocated, pending or quarantined. Otherwise they are the
 * index links (or nothing). */
static inline bool block_in_use(const block_t *b) {
  return b->state == BLOCK_ALLOCATED || b->state == BLOCK_PENDING || b->state == BLOCK_QUARANTINED;
}
/* Its other streams' uses, NULL when it is not in use. */
static inline stream_uses_t *block_uses(const block_t *b) { return block_in_use(b) ? b->uses : NULL; }

/* A block's state as snapshots name it (gca_block_state). */
static inline int block_state_of(const block_t *b) {
  switch (b->state) {
    case BLOCK_ALLOCATED: return GCA_BLOCK_ACTIVE_ALLOCATED;
    case BLOCK_PENDING:
    case BLOCK_QUARANTINED: return GCA_BLOCK_ACTIVE_PENDING_FREE;
    default: return GCA_BLOCK_INACTIVE;
  }
}


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

/* ------------------------------------------------------------------------ */
/* The allocator (allocator.c)                                               */
/* ------------------------------------------------------------------------ */

typedef struct host_cache host_cache_t;

struct gca_allocator {
  backend_t backend;
  int device_count;
  /* Inherited across fork (set in the child by the fork handler): every
   * call is refused but gca_close, which frees this process's books only.
   * Beside device_count: gca_malloc reads both. */
  bool forked;
  int pid;                     /* the process that opened it */
  device_t *devices;
  pthread_mutex_t config_lock; /* serializes gca_set_config (RANK_CONFIG: before the devices) */
  /* The master copy; devices hold copies. Written by gca_set_config alone,
   * under both locks; read under settings_lock (RANK_SETTINGS: a leaf, so
   * the host cache may read it under a device's lock and its own). */
  pthread_mutex_t settings_lock;
  config_t config;
  bool launch_blocking;        /* GCALLOC_/CUDA_/ASCEND_LAUNCH_BLOCKING at open */
  bool no_caching;             /* PYTORCH_NO_CUDA/NPU_MEMORY_CACHING at open */
  int id;                      /* the allocator's number in the trace file */
  pthread_mutex_t callbacks_lock;
  callback_list_t callbacks[CB_KINDS];
  host_cache_t *host;          /* the pinned host allocator (host.c) */
  _Atomic uint64_t last_pool_id; /* private pools' ids: the next is one more */
  uint64_t serial;               /* unique among the allocators of the process's life (mempool.c) */
};

/* ------------------------------------------------------------------------ */
/* Callbacks that run under a device's lock                                  */
/* ------------------------------------------------------------------------ */

/* The framework's queue drain and the segment observer are called with
 * their device's lock held: a release is under way, and its steps must
 * not interleave with another thread's. While one runs, this thread's
 * frame names it and its device. A public call made from inside it that
 * only reads reads that device as its caller holds it (the books are whole
 * at every point a callback is called); any other call that would take a
 * lock (the device's own, another device's, or one ranked before the
 * devices') fails at once with GCA_ERR_INVALID naming the callback: it
 * would wait for itself, or close a cycle with another thread. Callbacks
 * called with no lock held (free-memory callbacks, OOM observers and
 * handlers, log handlers) push no frame: any call works there.
 * A frame raises a guard (gca__calls_guard) while it is pushed: gca_malloc
 * and gca_free read that word anyway (one relaxed load), and only while a
 * guard is up look at the thread-local frame, which in a library loaded
 * with dlopen is a call into the dynamic linker (an initial-exec variable
 * would be one load, but takes static TLS, which dlopen may not have:
 * Python's ctypes could then not load the library). A thread sees its own
 * guard in program order; another thread's only sends it to the check. */
typedef struct callback_frame {
  const char *name;                /* "the queue drain (gca_set_queue_drain)" */
  const device_t *device;          /* whose lock the caller holds */
  bool reads;                      /* the books are whole: reading calls work (else none does) */
  struct callback_frame *outer;
} callback_frame_t;
extern _Thread_local callback_frame_t *gca__callback_frame;

/* GCA_ERR_INVALID for public call `what` made from inside the callback this
 * thread runs. */
int gca__callback_refuses(const char *what);
/* GCA_ERR_INVALID for public call `what` on `a`, inherited across fork. */
int gca__forked_refuses(const gca_allocator_t *a, const char *what);
/* Whether `a` (not NULL) may serve call `what`: false, the error set, for
 * an allocator inherited across fork. */
static inline bool allocator_usable(const gca_allocator_t *a, const char *what) {
  if (likely(!a->forked)) return true;
  gca__forked_refuses(a, what);
  return false;
}

static inline bool in_locked_callback(void) {
  return unlikely(atomic_load_explicit(&gca__calls_observed, memory_order_relaxed) >= GCA_OBSERVED_GUARD) &&
         gca__callback_frame != NULL;
}

/* Whether public call `what` on `a` (NULL: not looked at; the caller says
 * so) is refused, the error then set: made from inside a callback under a
 * device's lock, or on an allocator inherited across fork. */
static inline bool call_refused(const gca_allocator_t *a, const char *what) {
  if (in_locked_callback()) return gca__callback_refuses(what), true;
  return a && !allocator_usable(a, what);
}

/* How a reading call reaches device d: locked here (DEVICE_LOCKED), held
 * by the callback's caller on this thread (DEVICE_HELD: read, do not lock),
 * or refused (DEVICE_REFUSED, error set: another device's lock, taken
 * while one is held, would nest two locks of one rank). */
enum { DEVICE_REFUSED = -1, DEVICE_HELD = 0, DEVICE_LOCKED = 1 };
static inline int device_read_lock(device_t *d, const char *what) {
  if (!allocator_usable(d->owner, what)) return DEVICE_REFUSED;
  const callback_frame_t *f = in_locked_callback() ? gca__callback_frame : NULL;
  if (likely(f == NULL)) {
    lock_acquire(&d->lock);
    return DEVICE_LOCKED;
  }
  if (f->device == d && f->reads) return DEVICE_HELD;
  gca__callback_refuses(what);
  return DEVICE_REFUSED;
}

static inline void device_read_unlock(device_t *d, int how) {
  if (how == DEVICE_LOCKED) lock_release(&d->lock);
}

/* Run the callback of `frame` (its name and device set) with the frame
 * pushed: the caller calls between these two. */
static inline void callback_enter(callback_frame_t *frame) {
  frame->outer = gca__callback_frame;
  gca__callback_frame = frame;
  gca__calls_guard(1);
}
static inline void callback_leave(callback_frame_t *frame) {
  gca__calls_guard(-1);
  gca__callback_frame = frame->outer;
}

/* Tell the segment observer (inspect.h) of a segment given or taken back:
 * in the middle of the change, so no call of the allocator is allowed.
 * Through a pointer: a direct call to the function that pushes the frame,
 * even out of line, made the compiler keep the device in memory across
 * the whole free path (24 instructions a cached pair, callgrind). */
void gca__segment_observer_call(device_t *d, bool alloc, size_t size);
static inline void segment_observed(device_t *d, bool alloc, size_t size) {
  if (unlikely(d->obs.segment_call != NULL)) d->obs.segment_call(d, alloc, size);
}

/* Device `device` of `a`, or NULL with the error set, naming `what`:
 * the allocator and the index checked, nothing more (gca_malloc's plain
 * entry: the guards are checked on its observed one). */
static inline device_t *gca__device_lookup(const gca_allocator_t *a, int device, const char *what) {
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

/* Device `device` of `a` for a reading call, or NULL with the error set,
 * naming `what`. */
static inline device_t *gca__device_of_reading(const gca_allocator_t *a, int device, const char *what) {
  device_t *d = gca__device_lookup(a, device, what);
  return d && allocator_usable(a, what) ? d : NULL;
}

/* Device `device` of `a` for a call that changes it, or NULL with the
 * error set, naming `what`. Refused inside a callback that runs under a
 * device's lock, and on an allocator inherited across fork. */
static inline device_t *gca__device_of(const gca_allocator_t *a, int device, const char *what) {
  if (in_locked_callback()) {
    gca__callback_refuses(what);
    return NULL;
  }
  return gca__device_of_reading(a, device, what);
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
