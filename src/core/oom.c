/* Out of memory, handled gracefully: the user's callbacks, waiting for memory
 * that other threads are about to give back, and an error message that says
 * what PyTorch's says and what it lacks.
 *
 * Callbacks (free-memory callbacks, OOM observers, OOM handlers) are kept per
 * allocator in small fixed lists under one mutex, and always called with no
 * lock of the library held (the trace file's included), so they may call
 * back into gcalloc.
 * A call takes a copy of the list first: a callback may add or remove
 * callbacks while it runs.
 *
 * Waiting: a thread whose allocation cannot be served waits on the device's
 * condition variable, woken by frees (a free looks at the waiter count, one
 * relaxed load, and signals only if someone waits) and by exponential
 * backoff timeouts (memory can also come back without a free through this
 * allocator: events completing, other processes), until its deadline.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/coop.h"
#include "core/core.h"
#include "core/mempool.h"
#include "core/oom.h"

/* ---- callbacks ---------------------------------------------------------- */

int gca__callbacks_add(gca_allocator_t *a, int kind, void (*fn)(void), void *user, const char *what) {
  if (!a || !fn) return gca__set_error(GCA_ERR_INVALID, "%s: %s is NULL", what, a ? "function" : "allocator");
  callback_list_t *list = &a->callbacks[kind];
  mutex_lock(&a->callbacks_lock, RANK_CALLBACKS);
  int n = atomic_load(&list->count), rc = GCA_OK;
  if (n == MAX_CALLBACKS)
    rc = gca__set_error(GCA_ERR_INVALID, "%s: %d callbacks of this kind are registered already (the most kept)", what,
                        MAX_CALLBACKS);
  else {
    list->items[n] = (callback_t){fn, user};
    atomic_store(&list->count, n + 1);
  }
  mutex_unlock(&a->callbacks_lock);
  return rc;
}

int gca__callbacks_remove(gca_allocator_t *a, int kind, void (*fn)(void), void *user, const char *what) {
  if (!a || !fn) return gca__set_error(GCA_ERR_INVALID, "%s: %s is NULL", what, a ? "function" : "allocator");
  callback_list_t *list = &a->callbacks[kind];
  mutex_lock(&a->callbacks_lock, RANK_CALLBACKS);
  int n = atomic_load(&list->count), rc = gca__set_error(GCA_ERR_INVALID, "%s: no such callback is registered", what);
  for (int i = 0; i < n; i++) {
    if (list->items[i].fn != fn || list->items[i].user != user) continue;
    memmove(&list->items[i], &list->items[i + 1], (size_t)(n - i - 1) * sizeof list->items[0]);
    atomic_store(&list->count, n - 1);
    rc = GCA_OK;
    break;
  }
  mutex_unlock(&a->callbacks_lock);
  if (rc == GCA_OK) gca__clear_error();
  return rc;
}

/* A copy of one list; returns how many. */
static int snapshot(gca_allocator_t *a, int kind, callback_t *out) {
  if (atomic_load_explicit(&a->callbacks[kind].count, memory_order_relaxed) == 0) return 0;
  mutex_lock(&a->callbacks_lock, RANK_CALLBACKS);
  int n = atomic_load(&a->callbacks[kind].count);
  memcpy(out, a->callbacks[kind].items, (size_t)n * sizeof *out);
  mutex_unlock(&a->callbacks_lock);
  return n;
}

/* Free-memory callbacks and OOM handlers share a signature: call every one
 * of `kind` (all of them, even after one said yes); true if any said yes. */
bool gca__oom_run_callbacks(device_t *d, int kind, size_t size) {
  callback_t cbs[MAX_CALLBACKS];
  int n = snapshot(d->owner, kind, cbs);
  if (n == 0) return false;
  int traced = recorder_suspend();
  GCA_ASSERT(LOCKS_HELD() == 0);
  bool any = false;
  for (int i = 0; i < n; i++) any |= ((gca_oom_handler_fn)cbs[i].fn)(d->index, size, cbs[i].user) != 0;
  recorder_resume(traced);
  return any;
}

void gca__oom_notify(device_t *d, const oom_report_t *r) {
  callback_t cbs[MAX_CALLBACKS];
  int n = snapshot(d->owner, CB_OOM_OBSERVER, cbs);
  if (n == 0) return;
  /* Observers may call gcalloc and overwrite this thread's error. */
  char message[2048];
  int status = gca_last_status();
  snprintf(message, sizeof message, "%s", gca_last_error());
  int traced = recorder_suspend();
  GCA_ASSERT(LOCKS_HELD() == 0);
  for (int i = 0; i < n; i++)
    ((gca_oom_observer_fn)cbs[i].fn)(d->index, r->size, r->limit, r->free_bytes, cbs[i].user);
  recorder_resume(traced);
  gca__set_error(status, "%s", message);
}

/* ---- waiting ------------------------------------------------------------ */

static size_t device_total(device_t *d, size_t *free_bytes) {
  size_t f = 0, t = 0;
  d->backend->ops->mem_get_info(d->backend->state, d->index, &f, &t);
  if (free_bytes) *free_bytes = f;
  return t;
}

bool gca__oom_worth_waiting(device_t *d, size_t rounded) {
  size_t need = gca__segment_size_for(rounded);
  size_t limit = limit_on(d) ? d->limit.allowed : device_total(d, NULL);
  if (need > limit) return false; /* can never fit: fail now */
  /* (With cooperation, the peers' live memory may come back to their caches.) */
  return family_current(&d->stats, FAM_ALLOCATED_BYTES) > 0 || d->ev.pending_blocks > 0 || d->ev.releasing || d->coop;
}

uint64_t gca__oom_generation(device_t *d) {
  mutex_lock(&d->wait.lock, RANK_DEVICE_WAIT);
  uint64_t g = d->wait.generation;
  mutex_unlock(&d->wait.lock);
  return g;
}

void gca__oom_wait(device_t *d, uint64_t generation, uint64_t ns) {
  lock_release(&d->lock);
  /* The memory waited for comes from other threads' frees, traced ones too. */
  int traced = recorder_suspend();
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  uint64_t nsec = (uint64_t)until.tv_nsec + ns;
  until.tv_sec += (time_t)(nsec / 1000000000u);
  until.tv_nsec = (long)(nsec % 1000000000u);
  mutex_lock(&d->wait.lock, RANK_DEVICE_WAIT);
  while (d->wait.generation == generation) {
    if (pthread_cond_timedwait(&d->wait.cond, &d->wait.lock, &until) != 0) break;
  }
  mutex_unlock(&d->wait.lock);
  recorder_resume(traced);
  lock_acquire(&d->lock);
}

void gca__oom_wake(device_t *d) {
  mutex_lock(&d->wait.lock, RANK_DEVICE_WAIT);
  d->wait.generation++;
  pthread_cond_broadcast(&d->wait.cond);
  mutex_unlock(&d->wait.lock);
}

/* ---- the message -------------------------------------------------------- */

static const char *bytes(uint64_t n, char *buf) {
  gca__format_bytes(n, buf, 32);
  return buf;
}

#define MAX_STREAMS_SHOWN 4

/* What the cache holds, for the message. */
typedef struct cache_view {
  uint64_t free_bytes[3];      /* by pool index */
  uint64_t free_blocks[3];
  uint64_t largest;
  uint64_t other_streams;      /* free bytes cached for other streams */
  struct { gca_stream_t stream; uint64_t bytes; } by_stream[MAX_STREAMS_SHOWN];
  int streams, more_streams;
} cache_view_t;

static void add_stream_bytes(cache_view_t *v, gca_stream_t s, uint64_t n) {
  for (int i = 0; i < v->streams; i++)
    if (v->by_stream[i].stream == s) {
      v->by_stream[i].bytes += n;
      return;
    }
  if (v->streams < MAX_STREAMS_SHOWN) {
    v->by_stream[v->streams].stream = s;
    v->by_stream[v->streams++].bytes = n;
  } else {
    v->more_streams++;
  }
}

static void view_cache(device_t *d, gca_stream_t stream, cache_view_t *v) {
  memset(v, 0, sizeof *v);
  for (pool_t *pool = gca__device_pool_next(d, NULL); pool; pool = gca__device_pool_next(d, pool))
    for (block_t *b = gca__pool_first(pool); b; b = gca__pool_next(pool, b)) {
      v->free_bytes[pool->kind] += b->size;
      v->free_blocks[pool->kind]++;
      if (b->size > v->largest) v->largest = b->size;
      add_stream_bytes(v, block_stream(b), b->size);
      if (block_stream(b) != stream) v->other_streams += b->size;
    }
}

void gca__oom_explain(device_t *d, gca_stream_t stream, size_t rounded, oom_report_t *report) {
  char b1[32], b2[32], b3[32], b4[32];
  size_t free_bytes = 0;
  size_t total = device_total(d, &free_bytes);
  size_t want = gca__segment_size_for(rounded);
  int64_t allocated = family_current(&d->stats, FAM_ALLOCATED_BYTES);
  int64_t reserved = family_current(&d->stats, FAM_RESERVED_BYTES);
  int64_t pending = family_current(&d->stats, FAM_PENDING_BYTES);
  report->size = want;
  report->limit = limit_on(d) ? d->limit.allowed : total;
  report->free_bytes = free_bytes;
  report->total = total;
  report->outside = d->coop ? gca__coop_outside(d->coop, total, free_bytes) : 0;

  char msg[2048];
  text_t o = {msg, sizeof msg, 0};
  /* PyTorch's message, word for word but for the names. */
  gca__text_put(&o, "out of memory. Tried to allocate %s. Device %d has a total capacity of %s of which %s is free. ",
                bytes(want, b1), d->index, bytes(total, b2), bytes(free_bytes, b3));
  if (limit_on(d)) gca__text_put(&o, "%s allowed; ", bytes(d->limit.allowed, b1));
  gca__text_put(&o, "Of the allocated memory %s is allocated by gcalloc, and %s is reserved by gcalloc but unallocated.",
                bytes((uint64_t)allocated, b1), bytes((uint64_t)(reserved - allocated), b2));

  /* What PyTorch's lacks. */
  cache_view_t v;
  view_cache(d, stream, &v);
  if (v.free_blocks[1] + v.free_blocks[2]) {
    gca__text_put(&o,
                  " Cached free: the largest block %s; small pool %s in %" PRIu64 " blocks, large pool %s in %" PRIu64
                  " blocks; by stream:",
                  bytes(v.largest, b1), bytes(v.free_bytes[1], b2), v.free_blocks[1], bytes(v.free_bytes[2], b3),
                  v.free_blocks[2]);
    for (int i = 0; i < v.streams; i++)
      gca__text_put(&o, "%s %#" PRIxPTR "%s %s", i ? "," : "", (uintptr_t)v.by_stream[i].stream,
                    v.by_stream[i].stream == stream ? " (this one)" : "", bytes(v.by_stream[i].bytes, b4));
    if (v.more_streams) gca__text_put(&o, " and more");
    gca__text_put(&o, ".");
    if (v.other_streams)
      gca__text_put(&o, " %s of it is cached for other streams, which this stream cannot use.", bytes(v.other_streams, b1));
  }
  if (pending > 0)
    gca__text_put(&o, " %s was freed but waits for work queued on other streams before it can be reused.",
                  bytes((uint64_t)pending, b1));
  if (d->coop) {
    gca__text_put(&o, " Processes sharing the device, asked to release their cache: %s.",
                  gca__coop_last(d->coop)[0] ? gca__coop_last(d->coop) : "none caches anything");
    if (report->outside >= MIN_BLOCK_SIZE)
      gca__text_put(&o, " %s of the device is held outside them (by processes without ipc_cooperation:True, or "
                    "the driver): no request can get it back.", bytes(report->outside, b1));
  }

  /* The setting that would help, the likeliest first. */
  if (d->rejected)
    gca__text_put(&o, " The request was rejected at once, the cache left alone, because it would pass "
                  "per_process_memory_fraction's limit (throw_on_cudamalloc_oom:True).");
  if (limit_on(d) && free_bytes >= want && (size_t)reserved + want > d->limit.allowed)
    gca__text_put(&o,
                  " To help: the process is limited to %s by per_process_memory_fraction:%g while the device has %s "
                  "free; raise the fraction.",
                  bytes(d->limit.allowed, b1), d->limit.fraction, bytes(free_bytes, b2));
  else if (d->config.oom_retry_timeout_ms == 0 && (pending > 0 || allocated > 0))
    gca__text_put(&o, " To help: if other threads are about to free memory, set oom_retry_timeout_ms to wait for it.");
  else if ((uint64_t)(reserved - allocated) >= want)
    gca__text_put(&o,
                  " To help: enough is reserved but unallocated, in pieces smaller than the request (fragmentation); "
                  "max_split_size_mb below this request's size keeps large cached blocks from being split.");
  gca__set_error(GCA_ERR_OOM, "%s", msg);
}
