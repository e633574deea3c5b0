/* The public entry points: opening an allocator on a backend, routing each
 * call to its device, configuration from the environment and from code.
 *
 * Configuration precedence: the first of GCALLOC_ALLOC_CONF,
 * PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF that is set (even to "") is
 * read at open (on the acl backend: GCALLOC_ALLOC_CONF,
 * MINDTORCH_NPU_ALLOC_CONF, PYTORCH_NPU_ALLOC_CONF, PYTORCH_ALLOC_CONF,
 * PYTORCH_CUDA_ALLOC_CONF); the string passed to gca_open is applied on
 * top of it. A
 * malformed environment string fails gca_open with a message naming the
 * variable, as PyTorch refuses to start on one.
 *
 * Launch-blocking mode, for debugging, is read at open from the first set
 * of GCALLOC_LAUNCH_BLOCKING, CUDA_LAUNCH_BLOCKING, ASCEND_LAUNCH_BLOCKING:
 * then every free completes before gca_free returns, waiting for the streams
 * that used the block, and so does every device free.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/coop.h"
#include "core/core.h"
#include "core/expandable.h"
#include "core/history.h"
#include "core/mempool.h"
#include "core/oom.h"
#include "host/host.h"
#include "observe/observe.h"

/* A call failed: the caller has the status and the message, so it is only
 * debug information for the log. */
GCA_COLD static void log_failure(const char *call) {
  if (log_on(GCA_LOG_DEBUG)) gca__log_message(GCA_LOG_DEBUG, "%s failed: %s", call, gca_last_error());
}

/* A spec or configuration as one word for the trace file (spaces mean
 * nothing in either). */
static void one_word(const char *text, char *out, size_t cap) {
  size_t n = 0;
  for (const char *p = text ? text : ""; *p && n + 1 < cap; p++)
    if (*p != ' ' && *p != '\t' && *p != '\n') out[n++] = *p;
  if (n == 0 && cap > 1) out[n++] = '-';
  out[n] = '\0';
}

/* The variables read, first set wins, by backend: on an NPU a framework's
 * own NPU variable beats PyTorch's CUDA one (docs/configuration.md). */
static const char *const config_variables[] = {"GCALLOC_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                               NULL};
static const char *const npu_config_variables[] = {"GCALLOC_ALLOC_CONF",      "MINDTORCH_NPU_ALLOC_CONF",
                                                   "PYTORCH_NPU_ALLOC_CONF",  "PYTORCH_ALLOC_CONF",
                                                   "PYTORCH_CUDA_ALLOC_CONF", NULL};

static bool backend_is(const char *spec, const char *name) {
  size_t n = strlen(name);
  return spec && strncmp(spec, name, n) == 0 && (spec[n] == '\0' || spec[n] == ':');
}

/* The first variable set wins, an empty one too (PyTorch asks whether a
 * variable is set, not whether it says anything); an empty one that hides
 * a later one that says something is warned about. */
static int apply_environment(config_t *cfg, const char *backend) {
  const char *const *names = backend_is(backend, "acl") ? npu_config_variables : config_variables;
  for (size_t i = 0; names[i]; i++) {
    const char *text = getenv(names[i]);
    if (!text) continue;
    for (size_t j = i + 1; !*text && names[j]; j++) {
      const char *hidden = getenv(names[j]);
      if (hidden && *hidden) {
        gca__log_message(GCA_LOG_WARNING, "%s is set but empty, so the defaults apply and %s=%s is not read (unset %s "
                         "to read it)", names[i], names[j], hidden, names[i]);
        break;
      }
    }
    return gca__config_apply(cfg, text, names[i]);
  }
  return GCA_OK;
}

static const char *const launch_blocking_variables[] = {"GCALLOC_LAUNCH_BLOCKING", "CUDA_LAUNCH_BLOCKING",
                                                        "ASCEND_LAUNCH_BLOCKING"};

static bool launch_blocking_from_environment(void) {
  for (size_t i = 0; i < sizeof launch_blocking_variables / sizeof launch_blocking_variables[0]; i++) {
    const char *v = getenv(launch_blocking_variables[i]);
    if (!v) continue;
    if (!strcmp(v, "1") || !strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcasecmp(v, "on")) return true;
    if (!strcmp(v, "0") || !*v || !strcasecmp(v, "false") || !strcasecmp(v, "no") || !strcasecmp(v, "off"))
      return false;
    gca__log_message(GCA_LOG_WARNING, "%s=%s is not 1 or 0; launch-blocking mode stays off", launch_blocking_variables[i],
                     v);
    return false;
  }
  return false;
}

/* PyTorch's and torch_npu's switch: set to anything but "0", nothing is cached. */
static bool no_caching_from_environment(const char *backend) {
  const char *v = getenv(backend_is(backend, "acl") ? "PYTORCH_NO_NPU_MEMORY_CACHING" : "PYTORCH_NO_CUDA_MEMORY_CACHING");
  return v && strcmp(v, "0") != 0;
}

static void close_unregistered(gca_allocator_t *a);

/* The allocator's own mutexes: all or none. */
static int allocator_mutexes_init(gca_allocator_t *a) {
  pthread_mutex_t *m[] = {&a->config_lock, &a->settings_lock, &a->callbacks_lock};
  for (size_t i = 0; i < sizeof m / sizeof m[0]; i++) {
    if (pthread_mutex_init(m[i], NULL) == 0) continue;
    while (i-- > 0) pthread_mutex_destroy(m[i]);
    return -1;
  }
  return 0;
}

static void allocator_mutexes_destroy(gca_allocator_t *a) {
  pthread_mutex_destroy(&a->config_lock);
  pthread_mutex_destroy(&a->settings_lock);
  pthread_mutex_destroy(&a->callbacks_lock);
}

/* ---- fork -------------------------------------------------------------------
 * A child of fork inherits every open allocator: copies of its books, and
 * handles to what its parent holds (device memory, a slot in a rendezvous,
 * a share of a shared simulated device, pinned memory, events, threads it
 * does not have). The child's copy is detached: every call on it is
 * refused but gca_close, which frees the child's books and touches nothing
 * of the parent's; the child opens its own. The books are whole when fork
 * copies them: the devices' locks, then the pinned caches', are taken
 * before it (in rank order) and let go after it in both processes. One
 * handler for both, so that the order holds whatever was opened first. */

static void before_fork(void) {
  gca__allocators_fork_prepare();
  gca__host_before_fork();
}

static void after_fork_parent(void) {
  gca__host_after_fork_parent();
  gca__allocators_fork_done(false);
}

static void after_fork_child(void) {
  gca__host_after_fork_child();
  gca__allocators_fork_done(true);
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static bool fork_handled;

static void handle_fork(void) { fork_handled = pthread_atfork(before_fork, after_fork_parent, after_fork_child) == 0; }

int gca_open(const char *backend, const char *config, gca_allocator_t **out) {
  gca__log_init();
  if (in_locked_callback()) return gca__callback_refuses("gca_open"); /* (the registry comes before devices) */
  if (!out) return gca__set_error(GCA_ERR_INVALID, "gca_open: out is NULL");
  pthread_once(&fork_once, handle_fork);
  if (!fork_handled) return gca__set_error(GCA_ERR_NOMEM, "gca_open: pthread_atfork failed: out of memory");
  *out = NULL;
  config_t cfg;
  gca__config_defaults(&cfg);
  int rc = apply_environment(&cfg, backend);
  if (rc) return rc;
  rc = gca__config_apply(&cfg, config, NULL);
  if (rc) return rc;

  gca_allocator_t *a = calloc(1, sizeof *a);
  if (!a) return gca__set_error(GCA_ERR_NOMEM, "out of host memory opening the allocator");
  rc = gca__backend_open(backend, &a->backend);
  if (rc) {
    free(a);
    return rc;
  }
  a->config = cfg;
  a->pid = (int)getpid();
  a->launch_blocking = launch_blocking_from_environment();
  a->no_caching = no_caching_from_environment(backend);
  a->device_count = a->backend.ops->device_count(a->backend.state);
  /* (64-byte aligned: no two devices share a cache line, core.h) */
  size_t devices_bytes = (size_t)(a->device_count > 0 ? a->device_count : 1) * sizeof *a->devices;
  a->devices = aligned_alloc(_Alignof(device_t), devices_bytes);
  if (a->devices) memset(a->devices, 0, devices_bytes);
  if (!a->devices || allocator_mutexes_init(a) != 0) {
    free(a->devices);
    gca__backend_close(&a->backend);
    free(a);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory opening the allocator");
  }
  for (int i = 0; i <= a->device_count; i++) {
    /* The devices, then the pinned host allocator. */
    rc = i < a->device_count ? gca__device_init(&a->devices[i], a, i, &cfg) : gca__host_cache_create(a);
    if (rc) {
      while (i-- > 0) gca__device_destroy(&a->devices[i], false);
      allocator_mutexes_destroy(a);
      free(a->devices);
      gca__backend_close(&a->backend);
      free(a);
      return rc;
    }
  }
  a->config.size_pad = a->device_count ? a->devices[0].config.size_pad : 0; /* (gca_round_size's) */
  if ((rc = gca__allocator_register(a)) != GCA_OK) {
    close_unregistered(a);
    return rc;
  }
  a->id = gca__record_init();
  if (gca__trace_file_active()) {
    char spec[256], conf[512];
    one_word(backend, spec, sizeof spec);
    one_word(config, conf, sizeof conf);
    gca__record_lock_calls();
    gca__record_line("open", "%d %s %s", a->id, spec, conf);
    gca__record_unlock_calls();
  }
  gca__log_message(GCA_LOG_INFO, "allocator %d opened on %s with %d device%s", a->id, a->backend.ops->name,
                   a->device_count, a->device_count == 1 ? "" : "s");
  *out = a;
  return GCA_OK;
}

/* Everything gca_open made, in reverse (the allocator's serial aside); a
 * child of fork's copy, its books only. */
static void close_unregistered(gca_allocator_t *a) {
  gca__host_cache_destroy(a, a->forked);
  for (int i = 0; i < a->device_count; i++) gca__device_destroy(&a->devices[i], a->forked);
  free(a->devices);
  allocator_mutexes_destroy(a);
  gca__backend_close_as(&a->backend, a->forked);
  free(a);
}

void gca_close(gca_allocator_t *a) {
  if (!a) return;
  if (in_locked_callback()) { /* (it would free the device the callback's caller holds, or wait for it) */
    gca__callback_refuses("gca_close");
    return;
  }
  /* Work on freed memory may wait in the framework's queue: drained before
   * the memory goes back (with no lock held). */
  if (!a->forked) gca__drain_devices(a, false);
  gca__allocator_unregister(a); /* (first: threads' pushes to it go stale) */
  if (!a->forked) { /* (the trace file is the parent's) */
    gca__record_lock_calls();
    gca__record_line("close", "%d", a->id);
    gca__record_unlock_calls();
  }
  gca__log_message(GCA_LOG_INFO, "allocator %d closed%s", a->id,
                   a->forked ? " (inherited across fork: this process's books only)" : "");
  bool forked = a->forked;
  close_unregistered(a);
  if (forked) gca__calls_guard(-1); /* (raised at fork) */
}

int gca_device_count(const gca_allocator_t *a) {
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_device_count: allocator is NULL");
  return a->device_count;
}

const char *gca_backend_name(const gca_allocator_t *a) { return a ? a->backend.ops->name : ""; }

/* ---- device facts and peers -------------------------------------------- */

static int not_offered(const gca_allocator_t *a, const char *what) {
  return gca__set_error(GCA_ERR_BACKEND, "%s: the %s backend does not offer it", what, a->backend.ops->name);
}

int gca_device_properties(gca_allocator_t *a, int device, gca_device_properties_t *out) {
  if (!gca__device_of_reading(a, device, "gca_device_properties")) return gca_last_status();
  if (!out) return gca__set_error(GCA_ERR_INVALID, "gca_device_properties: out is NULL");
  if (!a->backend.ops->device_properties) return not_offered(a, "gca_device_properties");
  return a->backend.ops->device_properties(a->backend.state, device, out);
}

/* Both devices exist and differ (`reads`: for a call that only reads). */
static int peer_pair(const gca_allocator_t *a, int device, int peer, const char *what, bool reads) {
  device_t *(*of)(const gca_allocator_t *, int, const char *) = reads ? gca__device_of_reading : gca__device_of;
  if (!of(a, device, what) || !of(a, peer, what)) return gca_last_status();
  if (device == peer) return gca__set_error(GCA_ERR_INVALID, "%s: device %d cannot be its own peer", what, device);
  return GCA_OK;
}

int gca_can_access_peer(gca_allocator_t *a, int device, int peer, int *can) {
  int rc = peer_pair(a, device, peer, "gca_can_access_peer", true);
  if (rc) return rc;
  if (!can) return gca__set_error(GCA_ERR_INVALID, "gca_can_access_peer: can is NULL");
  if (!a->backend.ops->can_access_peer) return not_offered(a, "gca_can_access_peer");
  return a->backend.ops->can_access_peer(a->backend.state, device, peer, can);
}

int gca_enable_peer_access(gca_allocator_t *a, int device, int peer) {
  int rc = peer_pair(a, device, peer, "gca_enable_peer_access", false);
  if (rc) return rc;
  if (!a->backend.ops->enable_peer_access) return not_offered(a, "gca_enable_peer_access");
  return a->backend.ops->enable_peer_access(a->backend.state, device, peer);
}

int gca_disable_peer_access(gca_allocator_t *a, int device, int peer) {
  int rc = peer_pair(a, device, peer, "gca_disable_peer_access", false);
  if (rc) return rc;
  if (!a->backend.ops->disable_peer_access) return not_offered(a, "gca_disable_peer_access");
  return a->backend.ops->disable_peer_access(a->backend.state, device, peer);
}

int gca_stream_priority_range(gca_allocator_t *a, int device, int *least, int *greatest) {
  if (!gca__device_of_reading(a, device, "gca_stream_priority_range")) return gca_last_status();
  if (!least || !greatest) return gca__set_error(GCA_ERR_INVALID, "gca_stream_priority_range: least or greatest is NULL");
  if (!a->backend.ops->stream_priority_range) return not_offered(a, "gca_stream_priority_range");
  return a->backend.ops->stream_priority_range(a->backend.state, device, least, greatest);
}

/* (The guards are the observed entry's: malloc_observed, free_observed.) */
static inline void *malloc_plain(gca_allocator_t *a, size_t size, int device, gca_stream_t stream) {
  device_t *d = gca__device_lookup(a, device, "gca_malloc");
  if (unlikely(!d)) return NULL;
  if (unlikely(size == 0)) {
    gca__clear_error();
    return NULL;
  }
  return gca__device_malloc(d, size, stream);
}

static bool in_span(const device_t *d, uintptr_t addr) {
  return addr >= atomic_load_explicit(&d->span_lo, memory_order_relaxed) &&
         addr < atomic_load_explicit(&d->span_hi, memory_order_relaxed);
}

static int free_on(device_t *d, uintptr_t addr) {
  lock_acquire(&d->lock);
  int rc = gca__device_free_locked(d, addr);
  lock_release(&d->lock);
  device_wake_waiters(d);
  return rc;
}

static inline int free_plain(gca_allocator_t *a, void *ptr) {
  if (!ptr) return GCA_OK;
  if (unlikely(!a)) return gca__set_error(GCA_ERR_INVALID, "gca_free: allocator is NULL");
  uintptr_t addr = (uintptr_t)ptr;
  /* One device: no need to look at address spans first. */
  if (likely(a->device_count == 1)) {
    if (likely(free_on(&a->devices[0], addr) == GCA_OK)) return GCA_OK;
  } else {
    for (int i = 0; i < a->device_count; i++)
      if (in_span(&a->devices[i], addr) && free_on(&a->devices[i], addr) == GCA_OK) return GCA_OK;
  }
  /* Not a live allocation: say what it is, from the device that holds it. */
  for (int i = 0; i < a->device_count; i++) {
    device_t *d = &a->devices[i];
    if (!in_span(d, addr)) continue;
    lock_acquire(&d->lock);
    bool explained = gca__device_explain_bad_pointer(d, addr, "free");
    lock_release(&d->lock);
    if (explained) return GCA_ERR_BAD_POINTER;
  }
  return gca__set_error(GCA_ERR_BAD_POINTER, "cannot free %p: it was not allocated by this allocator", ptr);
}

/* The live allocation starting at addr, read under its device's lock: its
 * block's address and size, and its segment's start and size. False when
 * addr starts no live allocation. */
typedef struct live_block {
  uintptr_t addr, segment;
  size_t size, segment_size;
  bool expandable;
} live_block_t;

/* 1: found; 0: addr starts no live allocation; -1: refused (error set). */
static int find_live_block(gca_allocator_t *a, uintptr_t addr, live_block_t *out, const char *what) {
  for (int i = 0; i < a->device_count; i++) {
    device_t *d = &a->devices[i];
    if (!in_span(d, addr)) continue;
    int how = device_read_lock(d, what);
    if (how == DEVICE_REFUSED) return -1;
    const block_t *b = gca__block_map_find(&d->allocated, addr);
    if (b)
      *out = (live_block_t){b->addr, b->segment->addr, b->size, b->segment->size, b->segment->expandable};
    device_read_unlock(d, how);
    if (b) return 1;
  }
  return 0;
}

size_t gca_usable_size(gca_allocator_t *a, void *ptr) {
  if (!a || !ptr) {
    gca__set_error(GCA_ERR_INVALID, "gca_usable_size: %s is NULL", a ? "pointer" : "allocator");
    return 0;
  }
  live_block_t b;
  int found = find_live_block(a, (uintptr_t)ptr, &b, "gca_usable_size");
  if (found > 0) return b.size;
  if (found < 0) return 0;
  gca__set_error(GCA_ERR_BAD_POINTER, "gca_usable_size: %p is not a live allocation", ptr);
  return 0;
}

int gca_base_allocation(gca_allocator_t *a, void *ptr, void **base, size_t *size) {
  if (!a || !ptr || !base)
    return gca__set_error(GCA_ERR_INVALID, "gca_base_allocation: %s is NULL", !a ? "allocator" : !ptr ? "pointer" : "base");
  live_block_t b;
  int found = find_live_block(a, (uintptr_t)ptr, &b, "gca_base_allocation");
  if (found < 0) return gca_last_status();
  if (found == 0)
    return gca__set_error(GCA_ERR_BAD_POINTER, "gca_base_allocation: %p is not the start of a live allocation", ptr);
  /* The whole segment, as PyTorch's getBaseAllocation; an expandable
   * segment is an address range reserved for the whole pool, so there the
   * allocation's own block. */
  *base = (void *)(b.expandable ? b.addr : b.segment);
  if (size) *size = b.expandable ? b.size : b.segment_size;
  return GCA_OK;
}

static int record_stream_plain(gca_allocator_t *a, void *ptr, gca_stream_t stream, bool erase) {
  const char *what = erase ? "erase a stream use of" : "record a stream use of";
  if (call_refused(a, erase ? "gca_erase_stream" : "gca_record_stream")) return gca_last_status();
  if (!a || !ptr)
    return gca__set_error(GCA_ERR_INVALID, "%s: %s is NULL", erase ? "gca_erase_stream" : "gca_record_stream",
                          a ? "pointer" : "allocator");
  uintptr_t addr = (uintptr_t)ptr;
  for (int i = 0; i < a->device_count; i++) {
    device_t *d = &a->devices[i];
    if (!in_span(d, addr)) continue;
    lock_acquire(&d->lock);
    int rc = gca__device_record_stream_locked(d, addr, stream, erase);
    bool explained = rc == GCA_ERR_BAD_POINTER && gca__device_explain_bad_pointer(d, addr, what);
    lock_release(&d->lock);
    if (rc != GCA_ERR_BAD_POINTER || explained) return rc;
  }
  return gca__set_error(GCA_ERR_BAD_POINTER, "cannot %s %p: it was not allocated by this allocator", what, ptr);
}

/* Run `fn` on one device, or on every device for -1. */
static int for_devices(gca_allocator_t *a, int device, const char *what, void (*fn)(device_t *)) {
  if (call_refused(a, what)) return gca_last_status();
  if (!a) return gca__set_error(GCA_ERR_INVALID, "%s: allocator is NULL", what);
  if (device == -1) {
    for (int i = 0; i < a->device_count; i++) fn(&a->devices[i]);
    return GCA_OK;
  }
  device_t *d = gca__device_of(a, device, what);
  if (!d) return gca_last_status();
  fn(d);
  return GCA_OK;
}

/* The same for a call that would synchronize or free: refused, doing
 * nothing, while a graph capture runs on a device it names. */
static int for_devices_not_capturing(gca_allocator_t *a, int device, const char *what, void (*fn)(device_t *)) {
  if (call_refused(a, what)) return gca_last_status();
  if (!a) return gca__set_error(GCA_ERR_INVALID, "%s: allocator is NULL", what);
  for (int i = 0; i < a->device_count; i++) {
    if (device != -1 && device != i) continue;
    int rc = gca__device_capturing(&a->devices[i], what);
    if (rc) return rc;
  }
  return for_devices(a, device, what, fn);
}

int gca_synchronize(gca_allocator_t *a, int device) {
  return for_devices_not_capturing(a, device, "gca_synchronize", gca__device_synchronize);
}

int gca_process_events(gca_allocator_t *a, int device) {
  return for_devices(a, device, "gca_process_events", gca__device_process_events);
}

int gca_set_memory_fraction(gca_allocator_t *a, double fraction, int device) {
  device_t *d = gca__device_of(a, device, "gca_set_memory_fraction");
  if (!d) return gca_last_status();
  lock_acquire(&d->lock);
  int rc = gca__device_set_fraction_locked(d, fraction);
  lock_release(&d->lock);
  if (rc) gca__prefix_error("gca_set_memory_fraction");
  else device_wake_waiters(d); /* a higher limit may let a waiting allocation through */
  return rc;
}

int gca_get_memory_fraction(gca_allocator_t *a, int device, double *fraction) {
  device_t *d = gca__device_of_reading(a, device, "gca_get_memory_fraction");
  if (!d) return gca_last_status();
  if (!fraction) return gca__set_error(GCA_ERR_INVALID, "gca_get_memory_fraction: fraction is NULL");
  int how = device_read_lock(d, "gca_get_memory_fraction");
  if (how == DEVICE_REFUSED) return gca_last_status();
  *fraction = d->limit.set ? d->limit.fraction : 1.0;
  device_read_unlock(d, how);
  return GCA_OK;
}

/* The callback registries (oom.c keeps them). */
#define CALLBACK_API(kind, type, add, remove)                                      \
  int add(gca_allocator_t *a, type fn, void *user) {                               \
    return gca__callbacks_add(a, kind, (void (*)(void))fn, user, #add);                 \
  }                                                                                \
  int remove(gca_allocator_t *a, type fn, void *user) {                            \
    return gca__callbacks_remove(a, kind, (void (*)(void))fn, user, #remove);           \
  }

CALLBACK_API(CB_FREE_MEMORY, gca_free_memory_fn, gca_add_free_memory_callback, gca_remove_free_memory_callback)
CALLBACK_API(CB_OOM_OBSERVER, gca_oom_observer_fn, gca_add_oom_observer, gca_remove_oom_observer)
CALLBACK_API(CB_OOM_HANDLER, gca_oom_handler_fn, gca_add_oom_handler, gca_remove_oom_handler)

int gca_record_history(gca_allocator_t *a, int enabled, gca_context context, size_t max_entries) {
  return gca_record_history_ex(a, enabled, context, GCA_STACKS_ALL, max_entries);
}

int gca_record_history_ex(gca_allocator_t *a, int enabled, gca_context context, gca_stacks stacks,
                          size_t max_entries) {
  if (call_refused(a, "gca_record_history")) return gca_last_status();
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_record_history: allocator is NULL");
  if (enabled && (stacks < GCA_STACKS_NATIVE || stacks > GCA_STACKS_ALL))
    return gca__set_error(GCA_ERR_INVALID, "gca_record_history: stacks %d is not NATIVE, PYTHON or ALL", (int)stacks);
  if (enabled && (context < GCA_CONTEXT_NONE || context > GCA_CONTEXT_ALL))
    return gca__set_error(GCA_ERR_INVALID, "gca_record_history: context %d is not NONE, STATE, ALLOC or ALL", (int)context);
  if (enabled && (max_entries == 0 || max_entries > ((size_t)1 << 26)))
    return gca__set_error(GCA_ERR_INVALID, "gca_record_history: max_entries %zu must be from 1 to %zu", max_entries,
                          (size_t)1 << 26);
  for (int i = 0; i < a->device_count; i++) {
    device_t *d = &a->devices[i];
    lock_acquire(&d->lock);
    int rc = GCA_OK;
    if (enabled) rc = gca__history_start(d, (int)context, (int)stacks, max_entries);
    else gca__history_stop(d);
    lock_release(&d->lock);
    if (rc) return rc;
  }
  return GCA_OK;
}

int gca_no_caching(const gca_allocator_t *a) {
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_no_caching: allocator is NULL");
  return a->no_caching ? 1 : 0;
}

int gca_set_queue_drain(gca_allocator_t *a, gca_queue_drain_fn fn, void *user) {
  if (call_refused(a, "gca_set_queue_drain")) return gca_last_status();
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_set_queue_drain: allocator is NULL");
  for (int i = 0; i < a->device_count; i++) {
    device_t *d = &a->devices[i];
    lock_acquire(&d->lock);
    d->drain.fn = fn;
    d->drain.user = user;
    /* (What was freed before is owed a drain too: its segments' turns are
     * not below a drain that returned after it.) */
    d->drain.finished = d->drain.started;
    lock_release(&d->lock);
  }
  return GCA_OK;
}

int gca_launch_blocking(const gca_allocator_t *a) {
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_launch_blocking: allocator is NULL");
  return a->launch_blocking ? 1 : 0;
}

static int empty_cache_plain(gca_allocator_t *a, int device) {
  return for_devices_not_capturing(a, device, "gca_empty_cache", gca__device_empty_cache);
}

/* ---- the observed entry points -------------------------------------------
 * Taken only while calls_observed is set (trace-level logging or a trace
 * file): each call is recorded in the trace file, under its lock, and
 * logged at trace level. Otherwise the public functions below pay one
 * relaxed load and a predictable branch. */

static int allocator_id(const gca_allocator_t *a) { return a ? a->id : -1; }

/* Python frames for the history, gathered before any lock is taken (the
 * GIL comes first): for an allocation on `device`, or (device -1) a free
 * on whichever device holds the pointer. */
static void python_gather(gca_allocator_t *a, int device) {
  if (!(atomic_load_explicit(&gca__calls_observed, memory_order_relaxed) & GCA_OBSERVED_PYTHON) || !a) return;
  if (device >= 0) {
    if (device < a->device_count) gca__history_python_gather(&a->devices[device], false);
    return;
  }
  for (int i = 0; i < a->device_count; i++)
    if (atomic_load_explicit(&a->devices[i].obs.python, memory_order_relaxed) & PY_AT_FREE) {
      gca__history_python_gather(&a->devices[i], true);
      return;
    }
}

/* The guards (gca__calls_guard) are checked first on both: before Python
 * frames (the GIL) or the trace file's lock are taken. */
GCA_COLD static void *malloc_observed(gca_allocator_t *a, size_t size, int device, gca_stream_t stream) {
  if (call_refused(a, "gca_malloc")) return NULL;
  python_gather(a, device);
  gca__record_lock_calls();
  void *p = malloc_plain(a, size, device, stream);
  gca__record_line("malloc", "%d %d %" PRIxPTR " %zu %" PRIxPTR, allocator_id(a), device, (uintptr_t)stream, size,
                   (uintptr_t)p);
  gca__record_unlock_calls();
  gca__log_message(GCA_LOG_TRACE, "malloc(%zu bytes, device %d, stream %#" PRIxPTR ") = %p", size, device,
                   (uintptr_t)stream, p);
  gca__history_python_done();
  return p;
}

GCA_COLD static int free_observed(gca_allocator_t *a, void *ptr) {
  if (ptr && call_refused(a, "gca_free")) return gca_last_status();
  if (ptr) python_gather(a, -1);
  gca__record_lock_calls();
  (void)gca__record_free_left_pending();
  int rc = free_plain(a, ptr);
  if (gca__record_free_left_pending())
    gca__record_line("free", "%d %" PRIxPTR " %d 1", allocator_id(a), (uintptr_t)ptr, rc);
  else
    gca__record_line("free", "%d %" PRIxPTR " %d", allocator_id(a), (uintptr_t)ptr, rc);
  gca__record_unlock_calls();
  gca__log_message(GCA_LOG_TRACE, "free(%p) = %s", ptr, gca_status_name(rc));
  gca__history_python_done();
  return rc;
}

GCA_FLATTEN void *gca_malloc(gca_allocator_t *a, size_t size, int device, gca_stream_t stream) {
  if (unlikely(atomic_load_explicit(&gca__calls_observed, memory_order_relaxed)))
    return malloc_observed(a, size, device, stream);
  void *p = malloc_plain(a, size, device, stream);
  if (unlikely(!p) && size) log_failure("gca_malloc");
  return p;
}

GCA_FLATTEN int gca_free(gca_allocator_t *a, void *ptr) {
  if (unlikely(atomic_load_explicit(&gca__calls_observed, memory_order_relaxed))) return free_observed(a, ptr);
  int rc = free_plain(a, ptr);
  if (unlikely(rc)) log_failure("gca_free");
  return rc;
}

int gca_record_stream(gca_allocator_t *a, void *ptr, gca_stream_t stream) {
  gca__record_lock_calls();
  int rc = record_stream_plain(a, ptr, stream, false);
  gca__record_line("record_stream", "%d %" PRIxPTR " %" PRIxPTR " %d", allocator_id(a), (uintptr_t)ptr,
                   (uintptr_t)stream, rc);
  gca__record_unlock_calls();
  gca__log_message(GCA_LOG_TRACE, "record_stream(%p, stream %#" PRIxPTR ") = %s", ptr, (uintptr_t)stream,
                   gca_status_name(rc));
  if (rc) log_failure("gca_record_stream");
  return rc;
}

int gca_erase_stream(gca_allocator_t *a, void *ptr, gca_stream_t stream) {
  int rc = record_stream_plain(a, ptr, stream, true);
  if (rc) log_failure("gca_erase_stream");
  return rc;
}

int gca_empty_cache(gca_allocator_t *a, int device) {
  gca__record_lock_calls();
  int rc = empty_cache_plain(a, device);
  gca__record_line("empty_cache", "%d %d %d", allocator_id(a), device, rc);
  gca__record_unlock_calls();
  gca__log_message(GCA_LOG_TRACE, "empty_cache(device %d) = %s", device, gca_status_name(rc));
  return rc;
}

int gca_mem_get_info(gca_allocator_t *a, int device, size_t *free_bytes, size_t *total_bytes) {
  device_t *d = gca__device_of_reading(a, device, "gca_mem_get_info");
  if (!d) return gca_last_status();
  size_t f = 0, t = 0;
  int rc = a->backend.ops->mem_get_info(a->backend.state, device, &f, &t);
  if (rc) return rc;
  if (free_bytes) *free_bytes = f;
  if (total_bytes) *total_bytes = t;
  return GCA_OK;
}

int gca_set_config(gca_allocator_t *a, const char *config) {
  if (call_refused(a, "gca_set_config")) return gca_last_status();
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_set_config: allocator is NULL");
  gca__log_hold(); /* the configuration's warnings are delivered after the lock */
  mutex_lock(&a->config_lock, RANK_CONFIG);
  config_t next = a->config; /* (read under config_lock: only this function writes it after open) */
  int rc = gca__config_apply(&next, config, NULL);
  /* Cooperation is set up at gca_open (the rendezvous joined, its thread
   * started): a change afterwards would be reported by gca_get_config and do
   * nothing, so it is refused. */
  if (rc == GCA_OK && (next.ipc_cooperation != a->config.ipc_cooperation ||
                       next.ipc_group_access != a->config.ipc_group_access))
    rc = gca__set_error(GCA_ERR_CONFIG, "gca_set_config: %s is read at gca_open only (the allocator is open %s it); "
                        "give it in gca_open's configuration or GCALLOC_ALLOC_CONF",
                        next.ipc_cooperation != a->config.ipc_cooperation ? "ipc_cooperation" : "ipc_group_access",
                        a->config.ipc_cooperation ? "with" : "without");
  if (rc == GCA_OK) {
    /* The fraction key, when it changes, sets every device's fraction;
     * gca_set_memory_fraction's per-device settings stay otherwise. */
    bool fraction_changed = next.memory_fraction_set &&
                            (!a->config.memory_fraction_set || next.memory_fraction != a->config.memory_fraction);
    for (int i = 0; i < a->device_count; i++) {
      device_t *d = &a->devices[i];
      lock_acquire(&d->lock);
      d->config = next;
      gca__device_resolve_pad(d);
      if (fraction_changed) (void)gca__device_set_fraction_locked(d, next.memory_fraction);
      lock_release(&d->lock);
    }
    next.size_pad = a->device_count ? a->devices[0].config.size_pad : 0;
    mutex_lock(&a->settings_lock, RANK_SETTINGS);
    a->config = next;
    mutex_unlock(&a->settings_lock);
  }
  mutex_unlock(&a->config_lock);
  gca__log_release();
  return rc;
}

int gca_get_config(gca_allocator_t *a, char *buf, size_t cap) {
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_get_config: allocator is NULL");
  mutex_lock(&a->settings_lock, RANK_SETTINGS);
  size_t n = gca__config_format(&a->config, buf, cap);
  mutex_unlock(&a->settings_lock);
  return (int)n;
}

size_t gca_round_size(gca_allocator_t *a, size_t size) {
  if (!a) {
    gca__set_error(GCA_ERR_INVALID, "gca_round_size: allocator is NULL");
    return 0;
  }
  mutex_lock(&a->settings_lock, RANK_SETTINGS);
  size_t r = gca__round_size(&a->config, size);
  mutex_unlock(&a->settings_lock);
  return r;
}

/* ---- statistics --------------------------------------------------------- */

int gca_get_stats(gca_allocator_t *a, int device, gca_stats_t *out) {
  device_t *d = gca__device_of_reading(a, device, "gca_get_stats");
  if (!d) return gca_last_status();
  if (!out) return gca__set_error(GCA_ERR_INVALID, "gca_get_stats: out is NULL");
  return gca__device_stats(d, out, "gca_get_stats");
}

static int reset_stats(gca_allocator_t *a, int device, const char *what, void (*reset)(kept_stats_t *)) {
  device_t *d = gca__device_of(a, device, what);
  if (!d) return gca_last_status();
  lock_acquire(&d->lock);
  reset(&d->stats);
  lock_release(&d->lock);
  return GCA_OK;
}

int gca_reset_peak_stats(gca_allocator_t *a, int device) {
  return reset_stats(a, device, "gca_reset_peak_stats", gca__stats_reset_peak);
}

int gca_reset_accumulated_stats(gca_allocator_t *a, int device) {
  return reset_stats(a, device, "gca_reset_accumulated_stats", gca__stats_reset_accumulated);
}

int64_t gca_allocated_bytes(const gca_allocator_t *a, int device) {
  if (!a || device < 0 || device >= a->device_count) return 0;
  return atomic_load_explicit(&a->devices[device].allocated_now, memory_order_relaxed);
}

int64_t gca_reserved_bytes(const gca_allocator_t *a, int device) {
  if (!a || device < 0 || device >= a->device_count) return 0;
  return atomic_load_explicit(&a->devices[device].reserved_now, memory_order_relaxed);
}

int gca_check(gca_allocator_t *a, int device) {
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca_check: allocator is NULL");
  int first = device == -1 ? 0 : device;
  int last = device == -1 ? a->device_count - 1 : device;
  if (device != -1 && !gca__device_of_reading(a, device, "gca_check")) return gca_last_status();
  for (int i = first; i <= last; i++) {
    device_t *d = &a->devices[i];
    int how = device_read_lock(d, "gca_check");
    if (how == DEVICE_REFUSED) return gca_last_status();
    int rc = gca__device_check_locked(d);
    device_read_unlock(d, how);
    if (rc) return rc;
  }
  return GCA_OK;
}

int gca_ipc_peers(gca_allocator_t *a, int device, gca_ipc_peer_t *out, size_t cap) {
  device_t *d = gca__device_of_reading(a, device, "gca_ipc_peers");
  if (!d) return gca_last_status();
  if (!out && cap) return gca__set_error(GCA_ERR_INVALID, "gca_ipc_peers: out is NULL");
  if (!d->coop)
    return gca__set_error(GCA_ERR_INVALID, "gca_ipc_peers: device %d does not cooperate (ipc_cooperation:True at "
                          "open turns it on)", device);
  return gca__coop_peers(d->coop, out, cap);
}
