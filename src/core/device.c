/* One device's caching allocator: the malloc and free paths and the cache
 * release, under the device's single lock.
 *
 * malloc, as PyTorch does it: complete the deferred frees whose events have
 * completed, round the size, pick the pool, take the best fit. On a miss:
 * with cross_stream_reuse, move the smallest fitting whole segment cached
 * for another stream to this one (preferring streams whose work is all
 * done), ordered after that stream's work; else ask the device for a
 * segment; if the device is full, free cached oversize blocks that could
 * cover the request and ask again; then wait for every pending free, free every whole cached segment, look in the
 * cache once more and ask the device once more (num_alloc_retries); then
 * fail with an out-of-memory message in PyTorch's form (num_ooms). The
 * cached path makes no system call and allocates nothing (descriptors come
 * from a recycled list); its cost is a tree lookup and a hash insert.
 *
 * free: the allocated counters drop at once; a block used on other streams
 * waits for their events (events.c), any other returns to its pool at once.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/coop.h"
#include "core/core.h"
#include "core/events.h"
#include "core/expandable.h"
#include "core/history.h"
#include "core/mempool.h"
#include "core/oom.h"

static void warn_no_virtual_memory(device_t *d);

/* ipc_cooperation:True: join the device's rendezvous. A backend without an
 * identity, or a region that cannot be had or is not one, leaves
 * cooperation off with a warning: the allocator works alone. A backend
 * without virtual memory is said at once: the promise covers less there. */
static void join_peers(device_t *d) {
  char identity[96];
  const backend_ops_t *ops = d->backend->ops;
  int rc = ops->device_identity ? ops->device_identity(d->backend->state, d->index, identity, sizeof identity)
                                : gca__set_error(GCA_ERR_BACKEND, "the %s backend names no device across processes",
                                                 ops->name);
  if (rc == GCA_OK) rc = gca__coop_join(d, identity, &d->coop);
  if (rc != GCA_OK)
    gca__log_message(GCA_LOG_WARNING, "ipc_cooperation:True: device %d works alone: %s", d->index, gca_last_error());
  gca__clear_error();
  if (d->coop && d->config.expandable_segments && !gca__expandable_available(d)) {
    d->vm.unwarned = false;
    warn_no_virtual_memory(d);
  }
}

int gca__device_init(device_t *d, gca_allocator_t *owner, int index, const config_t *cfg) {
  memset(d, 0, sizeof *d);
  pthread_condattr_t attr;
  bool cond_ok = pthread_condattr_init(&attr) == 0;
  cond_ok = cond_ok && pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 &&
            pthread_cond_init(&d->wait.cond, &attr) == 0;
  pthread_condattr_destroy(&attr);
  if (!cond_ok) return gca__set_error(GCA_ERR_NOMEM, "cannot create the condition variable of device %d", index);
  if (lock_init(&d->lock, RANK_DEVICE) != 0 || pthread_mutex_init(&d->wait.lock, NULL) != 0) {
    pthread_cond_destroy(&d->wait.cond);
    return gca__set_error(GCA_ERR_NOMEM, "cannot create the locks of device %d", index);
  }
  d->owner = owner;
  d->index = index;
  d->backend = &owner->backend;
  d->config = *cfg;
  gca__device_resolve_pad(d);
  d->launch_blocking = owner->launch_blocking;
  gca__pool_init(&d->small_pool, GCA_POOL_SMALL);
  gca__pool_init(&d->large_pool, GCA_POOL_LARGE);
  if (gca__block_map_init(&d->allocated) != GCA_OK) {
    lock_destroy(&d->lock);
    pthread_mutex_destroy(&d->wait.lock);
    pthread_cond_destroy(&d->wait.cond);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory creating device %d", index);
  }
  atomic_init(&d->allocated_now, 0);
  atomic_init(&d->reserved_now, 0);
  atomic_init(&d->paused_now, 0);
  atomic_init(&d->span_lo, UINTPTR_MAX);
  atomic_init(&d->span_hi, 0);
  atomic_init(&d->waiters, 0);
  d->no_caching = owner->no_caching;
  /* Nothing here asks the device anything: a backend may have to make the
   * device current to answer, and a framework's rank on one device must not
   * find contexts made on all of them (docs/acl.md). The fraction's bytes
   * and virtual memory are asked at the device's first use of them. */
  if (cfg->memory_fraction_set) {
    d->limit.set = d->limit.pending = true;
    d->limit.fraction = cfg->memory_fraction;
    d->limit.allowed = SIZE_MAX;
  }
  if (cfg->ipc_cooperation) join_peers(d);
  return GCA_OK;
}

void gca__device_resolve_pad(device_t *d) {
  size_t pad = 0;
  if (d->config.pad_32_mode == PAD_ON) pad = 32;
  else if (d->config.pad_32_mode == PAD_AUTO && d->backend->ops->size_pad &&
           d->backend->ops->size_pad(d->backend->state, d->index, &pad) != GCA_OK)
    pad = 0;
  d->config.size_pad = pad;
  int kb = d->config.base_addr_aligned_kb;
  d->config.base_align = kb >= 0 ? (size_t)kb * 1024 : d->backend->ops->base_align;
}

int gca__device_set_fraction_locked(device_t *d, double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    return gca__set_error(GCA_ERR_INVALID, "invalid memory fraction %g for device %d: it must be within [0, 1]", fraction,
                          d->index);
  size_t free_bytes = 0, total = 0;
  int rc = d->backend->ops->mem_get_info(d->backend->state, d->index, &free_bytes, &total);
  if (rc) return rc;
  d->limit.set = true;
  d->limit.pending = false;
  d->limit.fraction = fraction;
  d->limit.allowed = (size_t)(fraction * (double)total);
  return GCA_OK;
}

void gca__device_limit_resolve(device_t *d) {
  size_t free_bytes = 0, total = 0;
  /* A device that cannot say: no limit this time, asked again next time. */
  if (d->backend->ops->mem_get_info(d->backend->state, d->index, &free_bytes, &total) != GCA_OK) {
    gca__clear_error();
    return;
  }
  d->limit.pending = false;
  d->limit.allowed = (size_t)(d->limit.fraction * (double)total);
}

void gca__device_peers_answered(device_t *d, size_t need, gca_stream_t stream, const coop_outcome_t *got,
                                coop_tally_t *tally) {
  d->stats.num_ipc_rounds += got->asked > 0;
  d->stats.num_ipc_peers_asked += got->asked;
  d->stats.ipc_bytes_received += (int64_t)got->received;
  d->stats.num_ipc_timeouts += got->timeouts;
  gca__coop_count(d->coop, got, false);
  if (d->obs.recording) gca__history_ipc_request(d, need, stream, got->asked, got->timeouts, got->received);
  if (tally) {
    gca__coop_tally_add(tally, got, d->config.ipc_release_timeout_ms);
  } else {
    coop_tally_t one = {0};
    gca__coop_tally_add(&one, got, d->config.ipc_release_timeout_ms);
    gca__device_peers_done(d, &one);
  }
}

void gca__device_peers_done(device_t *d, const coop_tally_t *tally) {
  d->stats.num_ipc_requests += tally->rounds > 0;
  gca__coop_tally_keep(d->coop, tally);
}

bool gca__device_limit_refuses(device_t *d, size_t bytes) {
  if (!limit_on(d) || (size_t)family_current(&d->stats, FAM_RESERVED_BYTES) + bytes <= d->limit.allowed) return false;
  if (d->config.throw_on_malloc_oom) {
    d->stats.num_oom_rejections++;
    d->rejected = true;
  }
  gca__set_error(GCA_ERR_OOM, "device %d: %zu more bytes would pass the %zu the process may reserve "
                 "(per_process_memory_fraction %g)", d->index, bytes, d->limit.allowed, d->limit.fraction);
  return true;
}

_Thread_local callback_frame_t *gca__callback_frame;

int gca__callback_refuses(const char *what) {
  const callback_frame_t *f = gca__callback_frame;
  return gca__set_error(GCA_ERR_INVALID, "%s: not allowed from inside %s, which runs with device %d's lock held: %s",
                        what, f->name, f->device->index,
                        f->reads ? "only calls that read the allocator are (include/gcalloc.h)"
                                 : "a segment is changing, and no call of the allocator is");
}

int gca__forked_refuses(const gca_allocator_t *a, const char *what) {
  return gca__set_error(GCA_ERR_INVALID, "%s: the allocator was opened by process %d, and this process is a child of "
                        "its fork: only gca_close is allowed on it (it frees this process's books, nothing of the "
                        "parent's); open an allocator of its own", what, a->pid);
}

GCA_COLD void gca__segment_observer_call(device_t *d, bool alloc, size_t size) {
  callback_frame_t frame = {.name = "the segment observer", .device = d, .reads = false};
  callback_enter(&frame);
  d->obs.segment_fn(d->obs.segment_ctx, alloc, size);
  callback_leave(&frame);
}

/* Take the lock again after running without it (callbacks, handlers), and
 * collect the frees that completed meanwhile. */
static void relock(device_t *d) {
  lock_acquire(&d->lock);
  if (d->ev.pending_events | (uintptr_t)d->ev.releasing) gca__events_process(d);
}

/* Whether a drain is due: a release skipped for one, or a segment freed
 * into since the last. */
static bool drain_due(device_t *d) {
  if (d->drain.wanted) return true;
  for (const segment_t *seg = d->segments; seg; seg = seg->next)
    if (seg->freed_turn >= d->drain.finished) return true;
  return false;
}

/* A drain calling gcalloc may come back here (a free, then a miss that
 * wants a release): one drain in another is allowed, none deeper, so that
 * such a drain cannot recurse without end. The depth is this thread's; a
 * drain left by an exception or longjmp never counts itself out, so a
 * depth recorded below the current frame (the stack grows down: the drain
 * that counted it is no longer on the stack) is stale and starts again. */
#define DRAIN_NESTING 2
static _Thread_local int drain_depth;
static _Thread_local uintptr_t drain_frame; /* the outermost drain's frame */

void gca__device_drain_unlocked(device_t *d, bool always) {
  if (!d->drain.fn || (!always && !drain_due(d))) return;
  uintptr_t frame = (uintptr_t)__builtin_frame_address(0);
  if (drain_depth && frame > drain_frame) drain_depth = 0; /* (stale: see above) */
  if (drain_depth >= DRAIN_NESTING) return;
  if (drain_depth++ == 0) drain_frame = frame;
  uint64_t turn = ++d->drain.started;
  d->drain.wanted = false;
  gca_queue_drain_fn fn = d->drain.fn;
  void *user = d->drain.user;
  lock_release(&d->lock);
  int depth = recorder_suspend();
  /* (A drain that throws or jumps out leaves turn unfinished: the next
   * release drains again. Nothing is held here.) */
  GCA_ASSERT(LOCKS_HELD() == 0); /* (the framework's call: no lock of gcalloc's across it) */
  fn(d->index, user);
  drain_depth--;
  recorder_resume(depth);
  relock(d);
  if (turn > d->drain.finished) d->drain.finished = turn;
  /* The queue is empty: now every piece of work is on a stream, and once
   * the device is synchronized none of it still uses what goes back. */
  const backend_ops_t *ops = d->backend->ops;
  if (ops->device_synchronize && ops->device_synchronize(d->backend->state, d->index) != GCA_OK)
    gca__note_absorbed(d);
}

void gca__drain_devices(gca_allocator_t *a, bool always) {
  if (in_locked_callback()) return; /* (a device's lock is held: its caller is refused, or drains later) */
  for (int i = 0; a && i < a->device_count; i++) {
    device_t *d = &a->devices[i];
    if (!d->drain.fn) continue; /* (read without the lock: set before the framework allocates) */
    lock_acquire(&d->lock);
    if (d->segments) gca__device_drain_unlocked(d, always); /* (none: nothing would go back) */
    lock_release(&d->lock);
  }
}

void gca__device_destroy(device_t *d, bool forked) {
  /* Give every segment back, live blocks included: the allocator is going
   * away and nothing may leak on the device. First wait for the work that
   * may still use the memory. A backend whose destroy() releases all of it
   * (the sim) is not asked piece by piece: a replay of an expandable trace
   * spent a third of its time unmapping thousands of pages at the end.
   * A child of fork's copy (`forked`) frees its books only: the memory,
   * events, streams and the rendezvous's slot are the parent's. */
  if (forked) gca__coop_forget(d->coop);
  else gca__coop_leave(d->coop); /* (its thread may empty the cache: first) */
  d->coop = NULL;
  gca__events_shutdown(d, forked);
  bool give_back = !forked && !d->backend->ops->destroy_releases_memory;
  size_t left = 0; /* bytes the device would not take back, after CLOSE_TRIES each */
  segment_t *seg = d->segments;
  while (seg) {
    segment_t *next = seg->next;
    for (block_t *b = seg->head; b; b = b->next)
      if (block_in_use(b)) gca__history_drop_stack(b);
    if (seg->expandable) {
      left += gca__expandable_segment_destroy(d, seg, give_back);
    } else if (give_back) {
      bool went = false;
      for (int i = 0; i < CLOSE_TRIES && !went; i++)
        went = gca__given_back(d->backend->ops->free(d->backend->state, d->index, seg->addr, seg->size));
      if (!went) left += seg->size;
    }
    free(seg);
    seg = next;
  }
  d->segments = NULL;
  left += gca__expandable_kept_destroy(d, give_back);
  if (left) {
    char text[32];
    gca__format_bytes(left, text, sizeof text);
    gca__log_message(GCA_LOG_ERROR, "device %d: the device refused to take back %s at close, %d times each; they are "
                     "left to it (last refusal: %s)", d->index, text, CLOSE_TRIES, gca_last_error());
  }
  gca__mempools_destroy(d);
  gca__pool_destroy(&d->small_pool);
  gca__pool_destroy(&d->large_pool);
  gca__block_chunks_free(d);
  gca__history_destroy(d);
  gca__block_map_destroy(&d->allocated);
  lock_destroy(&d->lock);
  pthread_mutex_destroy(&d->wait.lock);
  pthread_cond_destroy(&d->wait.cond);
}

/* PyTorch's release_cached_blocks: wait for every pending free, then give
 * every whole cached segment back (with `need`, the largest first until
 * that much went back), and wait until the device has them. */
static void release_cached(device_t *d, size_t need) {
  d->stats.num_sync_all_streams++;
  gca__events_synchronize(d);
  if (need) gca__segment_release_cached_upto(d, need);
  else gca__segment_release_all_cached(d);
  gca__events_finish_releases(d, true);
}

static void release_cached_blocks(device_t *d) { release_cached(d, 0); }

void gca__device_release_cache_locked(device_t *d) { release_cached_blocks(d); }

/* The smallest whole cached segment of another stream that fits `rounded`
 * under the oversize rules and the configured size ratio, preferring
 * streams whose work is all done (no waiting); NULL if none. Only whole
 * segments move between streams: taking pieces of another stream's split
 * segments was measured to fragment both streams' segments and to trade
 * blocks back and forth, each time with a wait (docs/streams.md). The ratio
 * bounds how much larger than a fresh segment a moved one may be: a larger
 * one is split, and a split segment cannot be given back under pressure.
 * Whether a stream is idle is asked only of a stream whose candidate could
 * win. */
static block_t *whole_segment_elsewhere(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded,
                                        bool *idle) {
  block_t *best = NULL;
  *idle = false;
  for (block_t *first = gca__pool_first(pool); first; first = gca__pool_first_after_stream(pool, block_stream(first))) {
    if (block_stream(first) == stream) continue;
    gca_stream_t other = block_stream(first);
    block_t *b = gca__pool_lower_bound(pool, other, rounded);
    while (b && block_stream(b) == other && (b->prev || b->next || b->expandable)) b = gca__pool_next(pool, b);
    if (!b || block_stream(b) != other || !gca__pool_fits(&d->config, rounded, b)) continue;
    if ((double)b->size > d->config.cross_stream_reuse * (double)gca__segment_size_for(rounded)) continue;
    if (best && *idle && b->size >= best->size) continue;
    bool is_idle = gca__events_stream_is_idle(d, other);
    if (best && !(is_idle && !*idle) && !(is_idle == *idle && b->size < best->size)) continue;
    best = b;
    *idle = is_idle;
  }
  return best;
}

/* Cross-stream reuse, if configured: move a whole cached segment of another
 * stream to `stream`, once `stream` is ordered after that stream's work
 * (nothing to order if it is idle), and hand out the request from it. */
static block_t *take_from_other_stream(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded,
                                       size_t requested) {
  if (d->config.cross_stream_reuse <= 0 || d->capture.count) return NULL; /* (it queries and records events) */
  bool idle;
  block_t *b = whole_segment_elsewhere(d, pool, stream, rounded, &idle);
  if (!b || (!idle && !gca__events_order_reuse(d, block_stream(b), stream))) return NULL;
  if (!gca__segment_reserve(d, pool, stream)) return NULL; /* (no host memory: a new segment is tried) */
  d->stats.num_cross_stream_reuses++;
  gca__pool_remove(pool, b);
  gca__segment_unreserve(d, pool, block_stream(b));
  b->segment->stream = stream;
  return gca__block_take(d, b, false, rounded, requested);
}

/* A fit in the cache: on the stream's own blocks, then (if configured) on
 * another stream's. */
static block_t *take_cached(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested) {
  pool->lookups++;
  block_t *b = gca__pool_best_fit(pool, &d->config, stream, rounded);
  return b ? gca__block_take(d, b, true, rounded, requested)
           : take_from_other_stream(d, pool, stream, rounded, requested);
}

static block_t *take_new_segment(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded,
                                 size_t requested, int *rc) {
  if ((d->config.expandable_segments || pool->pausable) && gca__expandable_available(d))
    return gca__expandable_take(d, pool, stream, rounded, requested, rc);
  block_t *b = gca__segment_alloc(d, pool, stream, rounded, rc);
  return b ? gca__block_take(d, b, false, rounded, requested) : NULL;
}

/* From the device: a new segment, freeing cache when the device is full
 * (PyTorch's alloc_block, release_available_cached_blocks,
 * release_cached_blocks). NULL with *rc set if nothing worked. */
static block_t *take_from_device(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested,
                                 int *rc) {
  if (!d->capture.count) gca__gc_collect(d);
  block_t *b = take_new_segment(d, pool, stream, rounded, requested, rc);
  if (b || *rc != GCA_ERR_OOM) return b;
  /* During a graph capture nothing goes back to the device: a new segment
   * or nothing. Rejected by the fraction (throw_on_*malloc_oom): nothing.
   * Held back for the framework's queue (drain.wanted): the caller drains
   * it and climbs again, so that nothing goes back before it must. */
  if (d->capture.count || d->rejected || d->drain.wanted) return NULL;

  if (gca__segment_release_available(d, pool, stream, rounded)) {
    gca__events_finish_releases(d, true);
    b = take_new_segment(d, pool, stream, rounded, requested, rc);
    if (b || *rc != GCA_ERR_OOM) return b;
  }

  release_cached_blocks(d);
  /* Unlike PyTorch, look in the cache again: frees that were waiting for
   * events have just completed, and one of them may fit. */
  b = take_cached(d, pool, stream, rounded, requested);
  if (b) return b;
  d->stats.num_alloc_retries++;
  return take_new_segment(d, pool, stream, rounded, requested, rc);
}

/* One pass of the ladder after a miss on the stream's own cache. */
static block_t *attempt(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested, int *rc) {
  block_t *b = take_from_other_stream(d, pool, stream, rounded, requested);
  return b ? b : take_from_device(d, pool, stream, rounded, requested, rc);
}

/* The ladder, drained and tried again (at most DRAIN_RETRIES times) where
 * it skipped a release because the framework's queue was owed a drain. */
#define DRAIN_RETRIES 3
static block_t *attempt_drained(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested,
                                int *rc) {
  for (int tries = 0;; tries++) {
    d->drain.wanted = false;
    block_t *b = attempt(d, pool, stream, rounded, requested, rc);
    if (b || *rc != GCA_ERR_OOM || !d->drain.wanted || tries == DRAIN_RETRIES) return b;
    gca__device_drain_unlocked(d, false);
    if ((b = take_cached(d, pool, stream, rounded, requested))) return b;
  }
}

/* Memory may have come back: the cache, then the ladder. */
static block_t *take_again(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested,
                           int *rc) {
  block_t *b = take_cached(d, pool, stream, rounded, requested);
  return b ? b : attempt_drained(d, pool, stream, rounded, requested, rc);
}

/* What a request lacks on the device: the device memory its new segment
 * (or, expandable, its pages) takes beyond what the device has free now;
 * 0 when it fits. What the peers are asked for: more would have them give
 * back cache for nothing, and wait for one that cannot answer when the
 * others already made room. */
static size_t shortfall(device_t *d, pool_t *pool, size_t rounded) {
  size_t want = gca__segment_size_for(rounded);
  if ((d->config.expandable_segments || pool->pausable) && gca__expandable_available(d)) {
    size_t page = gca__expandable_page_size(d, pool);
    want = (rounded + page - 1) / page * page;
  }
  size_t free_bytes = 0, total = 0;
  if (d->backend->ops->mem_get_info(d->backend->state, d->index, &free_bytes, &total) != GCA_OK) {
    gca__clear_error();
    return want;
  }
  return want > free_bytes ? want - free_bytes : 0;
}

/* The other processes on the device release their cache, and the request
 * is tried again (with the lock held; released while they are asked). They
 * are asked for the shortfall (shortfall()). What they released goes back
 * to the device, where any process may take it first (a peer's next
 * allocation, a third process's): while peers still release something, or
 * leave (a closing process leaves the rendezvous before its memory is
 * back), they are asked again, within ipc_release_timeout_ms of the first
 * request. Each round is added to `tally`. */
static block_t *ask_peers(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested, int *rc,
                          coop_tally_t *tally) {
  uint64_t deadline = gca__now_ns() + d->config.ipc_release_timeout_ms * 1000000u;
  bool left = false;
  for (;;) {
    size_t need = shortfall(d, pool, rounded);
    if (need == 0) { /* room came back since the ladder looked */
      block_t *b = take_again(d, pool, stream, rounded, requested, rc);
      if (b || *rc != GCA_ERR_OOM) return b;
      need = gca__segment_size_for(rounded); /* (the room was taken meanwhile, or is not in one piece) */
    }
    atomic_store(&d->coop_waiting, (int64_t)need);
    uint64_t timeout_ms = d->config.ipc_release_timeout_ms; /* (read under the lock: gca_set_config writes it) */
    lock_release(&d->lock);
    coop_outcome_t got;
    gca__coop_ask(d->coop, need, deadline, timeout_ms, &got);
    if (left || (got.gone && !got.received)) { /* give a leaving peer's memory a moment to come back */
      left = true;
      nanosleep(&(struct timespec){0, 2000000}, NULL);
    }
    relock(d);
    atomic_store(&d->coop_waiting, 0);
    gca__device_peers_answered(d, need, stream, &got, tally);
    block_t *b = got.asked || left ? take_again(d, pool, stream, rounded, requested, rc) : NULL;
    if (b || *rc != GCA_ERR_OOM || !(got.received || got.gone) || gca__now_ns() >= deadline) return b;
  }
}

#define ASK_PEERS_EVERY_NS 100000000u /* while an allocation waits (oom_retry_timeout_ms) */

/* After the ladder failed for want of memory: ask the other processes
 * (ipc_cooperation:True), wait for memory to come back
 * (oom_retry_timeout_ms; the processes asked again every 100 ms of it),
 * then let the OOM handlers free some (bounded by oom_handler_retries),
 * trying again after each. The lock is held on entry and on return,
 * released while asking, waiting and while handlers run. */
static block_t *recover(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded, size_t requested, int *rc,
                        coop_tally_t *tally) {
  block_t *b = d->coop ? ask_peers(d, pool, stream, rounded, requested, rc, tally) : NULL;
  uint64_t timeout_ns = d->config.oom_retry_timeout_ms * 1000000u;
  if (!b && timeout_ns && gca__oom_worth_waiting(d, rounded)) {
    d->stats.num_alloc_waits++;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    uint64_t backoff = 1000000, waited = 0, asked_at = 0; /* 1 ms, doubling to 128 ms */
    while (!b && *rc == GCA_ERR_OOM && waited < timeout_ns) {
      /* (Counted a waiter only while it waits: the ladder below may run
       * the framework's drain, which may throw past this frame.) */
      atomic_fetch_add(&d->waiters, 1);
      uint64_t generation = gca__oom_generation(d);
      uint64_t step = backoff < timeout_ns - waited ? backoff : timeout_ns - waited;
      gca__oom_wait(d, generation, step);
      atomic_fetch_sub(&d->waiters, 1);
      if (d->ev.pending_events | (uintptr_t)d->ev.releasing) gca__events_process(d);
      b = take_again(d, pool, stream, rounded, requested, rc);
      /* The peers' live memory may have come back to their caches meanwhile: asked again. */
      if (!b && *rc == GCA_ERR_OOM && d->coop && waited >= asked_at + ASK_PEERS_EVERY_NS) {
        asked_at = waited;
        b = ask_peers(d, pool, stream, rounded, requested, rc, tally);
      }
      clock_gettime(CLOCK_MONOTONIC, &now);
      waited = (uint64_t)(now.tv_sec - start.tv_sec) * 1000000000u + (uint64_t)now.tv_nsec - (uint64_t)start.tv_nsec;
      if (backoff < 128000000) backoff *= 2;
    }
  }
  for (uint32_t round = 0; !b && *rc == GCA_ERR_OOM && round < d->config.oom_handler_retries; round++) {
    if (!atomic_load_explicit(&d->owner->callbacks[CB_OOM_HANDLER].count, memory_order_relaxed)) break;
    lock_release(&d->lock);
    bool again = gca__oom_run_callbacks(d, CB_OOM_HANDLER, gca__segment_size_for(rounded));
    relock(d);
    if (!again) break;
    d->stats.num_oom_handler_retries++;
    b = take_again(d, pool, stream, rounded, requested, rc);
  }
  return b;
}

/* Device failures gcalloc handled since the last report: with the lock
 * held, how many; logged (without the lock) by report_absorbed. */
void gca__note_absorbed(device_t *d) {
  snprintf(d->ev.absorbed_message, sizeof d->ev.absorbed_message, "%s", gca_last_error());
}

void gca__note_refused_free(device_t *d) {
  d->stats.num_device_free_failures++;
  gca__note_absorbed(d);
}

static absorbed_t take_absorbed(device_t *d) {
  absorbed_t a;
  size_t now = d->ev.errors + (size_t)d->stats.num_device_free_failures;
  a.fresh = now - d->ev.reported_errors;
  d->ev.reported_errors = now;
  if (a.fresh) memcpy(a.last, d->ev.absorbed_message, sizeof a.last);
  return a;
}

GCA_COLD static void report_absorbed(device_t *d, const absorbed_t *a) {
  if (a->fresh)
    gca__log_message(GCA_LOG_ERROR, "device %d: %zu device failures handled (events waited out, frees refused and kept; "
                     "see num_device_free_failures); the last: %s", d->index, a->fresh, a->last);
}

/* expandable_segments:True where the device turned out to have no virtual
 * memory (found at its first segment): said once per device. */
GCA_COLD static void warn_no_virtual_memory(device_t *d) {
  if (!d->config.expandable_segments_set) /* (implied by ipc_cooperation:True) */
    gca__log_message(GCA_LOG_WARNING, "ipc_cooperation:True: device %d of backend %s has no virtual memory, so its "
                     "segments cannot give back the free memory inside them: a peer asked for memory gets only whole "
                     "free segments, and the promise of no avoidable out-of-memory covers only those (docs/sharing.md)",
                     d->index, d->backend->ops->name);
  else
    gca__log_message(GCA_LOG_WARNING, "expandable_segments:True: device %d of backend %s has no virtual memory; "
                     "ordinary segments are used instead", d->index, d->backend->ops->name);
}

/* An out-of-memory error with cooperation on: avoidable when the live
 * bytes of every cooperating process (the peers' as published) and the
 * request fit what of the device is not held outside them, and this
 * process's live bytes and the request fit its fraction. What was outside
 * is kept (ipc_outside_bytes). */
GCA_COLD static void count_if_avoidable(device_t *d, size_t rounded, const oom_report_t *report) {
  int64_t own = family_current(&d->stats, FAM_ALLOCATED_BYTES) - atomic_load(&d->paused_now);
  size_t mine = (size_t)(own > 0 ? own : 0) + rounded;
  d->stats.ipc_outside_bytes = (int64_t)report->outside;
  size_t room = report->total > report->outside ? report->total - report->outside : 0;
  if (mine + gca__coop_peers_live(d->coop) <= room && (!limit_on(d) || mine <= d->limit.allowed)) {
    d->stats.num_avoidable_ooms++;
    gca__coop_count(d->coop, NULL, true);
  }
}

/* The miss path, with the lock held; returns the address (0 on failure,
 * with the error set) with the lock released. */
GCA_COLD static uintptr_t malloc_on_miss(device_t *d, pool_t *pool, gca_stream_t stream, size_t rounded,
                                         size_t requested) {
  block_t *b = NULL;
  int rc = GCA_ERR_OOM;
  d->rejected = false;
  /* PyTorch's free-memory callbacks, then the cache again. */
  if (atomic_load_explicit(&d->owner->callbacks[CB_FREE_MEMORY].count, memory_order_relaxed)) {
    lock_release(&d->lock);
    bool freed = gca__oom_run_callbacks(d, CB_FREE_MEMORY, rounded);
    relock(d);
    if (freed) b = take_cached(d, pool, stream, rounded, requested);
  }
  if (!b) b = attempt_drained(d, pool, stream, rounded, requested, &rc);
  if (!b && rc == GCA_ERR_OOM && !d->rejected) {
    coop_tally_t tally = {0}; /* (every round of this one request to the peers) */
    b = recover(d, pool, stream, rounded, requested, &rc, &tally);
    if (d->coop) gca__device_peers_done(d, &tally);
  }
  absorbed_t absorbed = take_absorbed(d);
  bool no_vm = d->vm.unwarned;
  d->vm.unwarned = false;
  if (b || rc != GCA_ERR_OOM) {
    uintptr_t addr = b ? b->addr : 0;
    lock_release(&d->lock);
    report_absorbed(d, &absorbed);
    if (unlikely(no_vm)) warn_no_virtual_memory(d);
    return addr;
  }
  d->stats.num_ooms++;
  oom_report_t report;
  gca__oom_explain(d, stream, rounded, &report);
  if (d->coop) count_if_avoidable(d, rounded, &report);
  if (d->obs.recording) gca__history_oom(d, report.size, stream, report.free_bytes);
  lock_release(&d->lock);
  report_absorbed(d, &absorbed);
  if (unlikely(no_vm)) warn_no_virtual_memory(d);
  gca__oom_notify(d, &report);
  return 0;
}

void *gca__device_malloc(device_t *d, size_t size, gca_stream_t stream) {
  lock_acquire(&d->lock);
  if (unlikely(d->ev.pending_events | (uintptr_t)d->ev.releasing)) gca__events_process(d);
  size_t rounded = gca__round_size(&d->config, size);
  if (unlikely(rounded == 0)) {
    lock_release(&d->lock);
    gca__set_error(GCA_ERR_INVALID, "cannot allocate %zu bytes: the size overflows when rounded", size);
    return NULL;
  }
  pool_t *pool = rounded <= SMALL_SIZE ? &d->small_pool : &d->large_pool;
  if (unlikely(d->priv.routes) && !(pool = gca__mempool_route(d, stream, rounded, pool))) {
    lock_release(&d->lock); /* (a paused pool: the error is set) */
    return NULL;
  }
  pool->lookups++;
  block_t *b = gca__pool_best_fit(pool, &d->config, stream, rounded);
  if (unlikely(b == NULL)) return (void *)malloc_on_miss(d, pool, stream, rounded, size);
  uintptr_t addr = gca__block_take(d, b, true, rounded, size)->addr;
  lock_release(&d->lock);
  return (void *)addr;
}

GCA_COLD static void free_slow(device_t *d, block_t *b) {
  /* Freed while its pool is paused: its host copy is not restored. */
  mempool_t *owner = block_pool(b)->owner;
  if (d->priv.paused && owner && owner->paused) {
    gca__mempool_drop_backup_of(d, owner, b->addr);
    atomic_fetch_sub(&d->paused_now, (int64_t)b->size);
  }
  if (b->uses) {
    if (d->obs.recording) gca__history_event(d, GCA_TRACE_FREE_REQUESTED, b->addr, b->requested, block_stream(b));
    gca__events_defer_free(d, b);
    return;
  }
  if (d->obs.recording) gca__history_freed_at_once(d, b);
  gca__history_drop_stack(b);
  gca__block_give_back(d, b);
}

/* gca_no_caching, with the framework's queue not yet drained for this
 * free: drained, and the cache released again. */
GCA_COLD static void drain_and_release(device_t *d) {
  gca__device_drain_unlocked(d, false);
  release_cached_blocks(d);
}

int gca__device_free_locked(device_t *d, uintptr_t addr) {
  block_t *b = gca__block_map_take(&d->allocated, addr);
  if (unlikely(b == NULL)) return GCA_ERR_BAD_POINTER;
  int kind = pool_kind_of(b);
  family_decrease(&d->stats, FAM_ALLOCATION, kind, 1);
  family_decrease(&d->stats, FAM_ALLOCATED_BYTES, kind, (int64_t)b->size);
  if (unlikely(b->oversize)) {
    stat_decrease(&d->stats.oversize_allocations, 1);
    b->oversize = false;
  }
  atomic_store_explicit(&d->allocated_now, family_current(&d->stats, FAM_ALLOCATED_BYTES), memory_order_relaxed);
  /* One branch for the rare cases: stream uses, a stack, a paused pool;
   * history on without stacks keeps the give-back below. */
  b->segment->freed_turn = d->drain.started; /* (work queued on it may wait in the framework's host queue) */
  if (unlikely(((uintptr_t)b->uses | (uintptr_t)b->stack | d->priv.paused) != 0)) {
    free_slow(d, b);
  } else {
    if (unlikely(d->obs.recording)) gca__history_freed_at_once(d, b);
    gca__block_give_back(d, b);
  }
  if (unlikely(d->no_caching) && !d->capture.count) {
    d->drain.wanted = false;
    release_cached_blocks(d);
    if (d->drain.wanted) drain_and_release(d);
  }
  return GCA_OK;
}

/* A block freed at addr whose free waits for events, or NULL. */
GCA_COLD static block_t *pending_block_at(device_t *d, uintptr_t addr) {
  for (segment_t *seg = d->segments; seg; seg = seg->next) {
    if (addr < seg->addr || addr - seg->addr >= seg->size) continue;
    for (block_t *b = seg->head; b; b = b->next)
      if (b->addr == addr) return b->state == BLOCK_PENDING ? b : NULL;
  }
  return NULL;
}

int gca__device_record_stream_locked(device_t *d, uintptr_t addr, gca_stream_t stream, bool erase) {
  block_t *b = gca__block_map_find(&d->allocated, addr);
  /* Erasing from a block freed already (torch_npu's process groups erase
   * after the free): its free completes when its events do, as recorded. */
  if (!b && erase && pending_block_at(d, addr)) return GCA_OK;
  if (!b) return GCA_ERR_BAD_POINTER;
  if (!erase) return gca__stream_uses_add(b, stream);
  gca__stream_uses_remove(b, stream);
  return GCA_OK;
}

void gca__device_process_events(device_t *d) {
  lock_acquire(&d->lock);
  gca__events_process(d);
  lock_release(&d->lock);
  device_wake_waiters(d);
}

void gca__device_synchronize(device_t *d) {
  lock_acquire(&d->lock);
  if (d->capture.count) {
    lock_release(&d->lock);
    return;
  }
  d->stats.num_sync_all_streams++;
  gca__events_synchronize(d);
  absorbed_t absorbed = take_absorbed(d);
  lock_release(&d->lock);
  report_absorbed(d, &absorbed);
  device_wake_waiters(d);
}

GCA_COLD bool gca__device_explain_bad_pointer(device_t *d, uintptr_t addr, const char *action) {
  for (segment_t *seg = d->segments; seg; seg = seg->next) {
    if (addr < seg->addr || addr - seg->addr >= seg->size) continue;
    for (block_t *b = seg->head; b; b = b->next) {
      if (addr < b->addr || addr - b->addr >= b->size) continue;
      if (b->state == BLOCK_ALLOCATED) {
        gca__set_error(GCA_ERR_BAD_POINTER,
                       "cannot %s %p: it points %zu bytes inside the allocation at %p (%zu bytes) on device %d; "
                       "pass the pointer gca_malloc returned",
                       action, (void *)addr, (size_t)(addr - b->addr), (void *)b->addr, b->size, d->index);
      } else if (b->state == BLOCK_PENDING || b->state == BLOCK_QUARANTINED) {
        gca__set_error(GCA_ERR_BAD_POINTER,
                       "cannot %s %p: it was freed already on device %d (its free waits for work queued on the "
                       "streams that used it)",
                       action, (void *)addr, d->index);
      } else if (b->state == BLOCK_UNMAPPED) {
        gca__set_error(GCA_ERR_BAD_POINTER,
                       "cannot %s %p: it is not allocated (it lies in unmapped address space of an expandable "
                       "segment of device %d)",
                       action, (void *)addr, d->index);
      } else {
        gca__set_error(GCA_ERR_BAD_POINTER,
                       "cannot %s %p: it is not allocated (it lies in free cached memory of device %d; "
                       "was it freed twice?)",
                       action, (void *)addr, d->index);
      }
      return true;
    }
  }
  return false;
}

/* Release the cache (for a peer when `requester` is not 0: its largest
 * whole segments first, until `need` bytes went back; 0: all of it); the
 * bytes released. */
static size_t empty_cache(device_t *d, int32_t requester, size_t need) {
  lock_acquire(&d->lock);
  if (d->capture.count) { /* (a peer's request during a graph capture: nothing may go back now) */
    lock_release(&d->lock);
    return 0;
  }
  int64_t before = atomic_load(&d->reserved_now);
  /* Drained only where a release was skipped for it (and again where a
   * free came between the drain and the release). */
  for (int tries = 0;; tries++) {
    d->drain.wanted = false;
    release_cached(d, need);
    if (!d->drain.wanted || tries == DRAIN_RETRIES ||
        (need && (size_t)(before - atomic_load(&d->reserved_now)) >= need))
      break;
    gca__device_drain_unlocked(d, false);
  }
  int64_t after = atomic_load(&d->reserved_now);
  size_t released = before > after ? (size_t)(before - after) : 0;
  if (requester && d->obs.recording) gca__history_ipc_release(d, released, requester);
  absorbed_t absorbed = take_absorbed(d);
  lock_release(&d->lock);
  report_absorbed(d, &absorbed);
  device_wake_waiters(d);
  return released;
}

size_t gca__device_release_for_peer(device_t *d, int32_t requester, size_t need) {
  return empty_cache(d, requester, need);
}

void gca__device_empty_cache(device_t *d) { (void)empty_cache(d, 0, 0); }
