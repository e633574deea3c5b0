/* The drop-in for PyTorch: C functions with the signatures
 * torch.cuda.memory.CUDAPluggableAllocator loads from a shared library
 * (alloc and free), and a few more that the Python package (python/gcalloc)
 * calls, all on one process-wide allocator.
 *
 * PyTorch calls alloc and free from any thread, with the device index and
 * the cudaStream_t of the current stream; a cudaStream_t is the driver's
 * CUstream, which is what the cuda backend takes. The allocator is opened by
 * gca_torch_init (the Python package does, before handing the functions to
 * PyTorch), or on the first allocation from GCALLOC_TORCH_BACKEND (default
 * "cuda") and the environment's configuration. torch_npu's
 * NPUPluggableAllocator loads gca_npu_malloc and gca_npu_free, the same
 * with a size_t size and an aclrtStream, whose first allocation opens the
 * allocator on "acl" by default.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/mempool.h"
#include "host/host.h"
#include "observe/observe.h"

static pthread_mutex_t torch_lock = PTHREAD_MUTEX_INITIALIZER;
static gca_allocator_t *_Atomic torch_allocator;
/* Settings kept for the first allocation's open (gca_torch_defer), under
 * torch_lock. */
static struct {
  bool set;
  char backend[512];
  char config[4096];
} deferred;
/* torch_npu's drain of its task queue, c10_npu::npuSynchronizeDevice(bool),
 * connected at open (gca_npu_set_queue_drain), under torch_lock. */
typedef bool (*npu_synchronize_fn)(bool check_error);
static npu_synchronize_fn npu_drain;
/* The last failed allocation's message, for whichever thread asks: PyTorch
 * allocates on autograd's threads too, where gca_last_error() stays. */
static pthread_mutex_t failure_lock = PTHREAD_MUTEX_INITIALIZER;
static char last_failure[4096];
/* c10::detail::torchCheckFail(const char *func, const char *file, uint32_t
 * line, const char *msg) of the framework's libc10 (gca_torch_set_raise):
 * it throws c10::Error and never returns. Neither pluggable allocator checks
 * for NULL: a NULL becomes the tensor's data, and the first kernel that
 * writes it is an illegal memory access that ends the process's CUDA
 * context. Throwing is the one way to refuse; this file is compiled with
 * unwind tables so that the exception unwinds through its frames, which
 * hold no lock when it is thrown. */
typedef void (*c10_check_fail_fn)(const char *func, const char *file, uint32_t line, const char *msg);
static c10_check_fail_fn _Atomic c10_raise;
/* The same for out of memory (gca_torch_set_raise_oom): a function of that
 * signature that throws c10::OutOfMemoryError, which Python sees as
 * torch.OutOfMemoryError. The class is thrown only by code compiled against
 * the framework's headers: libc10 exports nothing that throws it. */
static c10_check_fail_fn _Atomic c10_raise_oom;
/* aclrtStream c10_npu::NPUStream::stream(bool need_empty) const of the
 * running torch_npu (gca_npu_set_stream_accessor): a member function, so
 * the object's address comes first; with need_empty false it reads the
 * stream without emptying the task queue. */
typedef void *(*npu_stream_accessor_fn)(const void *npu_stream, bool need_empty);
static npu_stream_accessor_fn _Atomic npu_stream_of;
/* Stream uses of memory the allocator did not make (framework_stream_use). */
static atomic_size_t foreign_stream_uses;
/* torch_npu's operator workspace cache (c10_npu::NPUWorkspaceAllocator):
 * a block per stream from aclrtMallocAlign32, beside gcalloc, kept until
 * its emptyCache. Connected with gca_npu_set_workspace_release: the
 * function and how many arguments its release takes (3: int device, bool
 * need_empty_queue, bool check_error; 2: int device, bool check_error; 1:
 * bool check_error), under torch_lock. */
static void *workspace_release;
static int workspace_arity;

static void keep_failure(const char *message) {
  mutex_lock(&failure_lock, RANK_TORCH_FAILURE);
  snprintf(last_failure, sizeof last_failure, "%s", message);
  mutex_unlock(&failure_lock);
}

size_t gca_torch_last_failure(char *buf, size_t cap) {
  mutex_lock(&failure_lock, RANK_TORCH_FAILURE);
  size_t len = strlen(last_failure);
  if (buf && cap) snprintf(buf, cap, "%s", last_failure);
  mutex_unlock(&failure_lock);
  return len;
}

/* Empty torch_npu's task queue and wait for the thread's device, with
 * check_error false (most errors are warned, not thrown). Called with no
 * lock held: it gives up the GIL and takes it back, and may still throw
 * c10::Error, which unwinds through gcalloc's frames to torch_npu. The
 * device is synchronized by gcalloc next. */
static void drain_npu_queue(int device, void *user) {
  (void)device, (void)user;
  (void)npu_drain(false);
}

/* An OOM handler of the process-wide allocator: torch_npu's workspace
 * cache emptied (its queue emptied first, its errors warned), with no lock
 * held, as torch_npu's own allocator does when it runs out. Another try
 * where the device has more free memory after it. */
static int release_npu_workspaces(int device, size_t size, void *user) {
  (void)size, (void)user;
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  mutex_lock(&torch_lock, RANK_TORCH);
  void *fn = workspace_release;
  int arity = workspace_arity;
  mutex_unlock(&torch_lock);
  size_t before = 0, after = 0, total = 0;
  if (!a || !fn || gca_mem_get_info(a, device, &before, &total) != GCA_OK) return 0;
  if (arity == 3) ((void (*)(int, bool, bool))fn)(device, true, false);
  else if (arity == 2) ((void (*)(int, bool))fn)(device, false);
  else ((void (*)(bool))fn)(false);
  return gca_mem_get_info(a, device, &after, &total) == GCA_OK && after > before;
}

/* Open (or configure) the process-wide allocator; `fallback` is the
 * backend when neither `backend` nor GCALLOC_TORCH_BACKEND names one. */
static int torch_init(const char *backend, const char *config, const char *fallback) {
  if (in_locked_callback()) return gca__callback_refuses("gca_torch_init"); /* (its lock comes before devices) */
  gca__log_hold(); /* opening logs; a handler may allocate through these exports */
  mutex_lock(&torch_lock, RANK_TORCH);
  int rc = GCA_OK;
  gca_allocator_t *a = atomic_load(&torch_allocator);
  if (a) {
    /* Already open (PyTorch may have allocated): only the settings change. */
    if (backend && *backend && strncmp(backend, gca_backend_name(a), strlen(gca_backend_name(a))) != 0)
      rc = gca__set_error(GCA_ERR_INVALID, "gca_torch_init: the allocator is already open on the %s backend, not %s",
                          gca_backend_name(a), backend);
    else if (config && *config)
      rc = gca_set_config(a, config);
  } else {
    if (!backend && !config && deferred.set) {
      backend = deferred.backend;
      config = deferred.config;
    }
    const char *env = getenv("GCALLOC_TORCH_BACKEND");
    const char *spec = backend && *backend ? backend : env && *env ? env : fallback;
    rc = gca_open(spec, config, &a);
    if (rc == GCA_OK) {
      keep_failure("");
      if (npu_drain) (void)gca_set_queue_drain(a, drain_npu_queue, NULL);
      if (workspace_release) (void)gca_add_oom_handler(a, release_npu_workspaces, NULL);
      atomic_store(&torch_allocator, a);
    }
  }
  mutex_unlock(&torch_lock);
  gca__log_release();
  return rc;
}

int gca_torch_init(const char *backend, const char *config) { return torch_init(backend, config, "cuda"); }

int gca_torch_defer(const char *backend, const char *config) {
  if (in_locked_callback()) return gca__callback_refuses("gca_torch_defer");
  if ((backend && strlen(backend) >= sizeof deferred.backend) || (config && strlen(config) >= sizeof deferred.config))
    return gca__set_error(GCA_ERR_INVALID, "gca_torch_defer: the backend or configuration is too long");
  config_t check;
  gca__config_defaults(&check);
  int rc = gca__config_apply(&check, config, NULL); /* (refused now, not at the first allocation) */
  if (rc) return rc;
  mutex_lock(&torch_lock, RANK_TORCH);
  if (atomic_load(&torch_allocator)) {
    mutex_unlock(&torch_lock);
    return torch_init(backend, config, "acl"); /* (open already: as gca_torch_init) */
  }
  deferred.set = true;
  snprintf(deferred.backend, sizeof deferred.backend, "%s", backend ? backend : "");
  snprintf(deferred.config, sizeof deferred.config, "%s", config ? config : "");
  mutex_unlock(&torch_lock);
  return GCA_OK;
}

int gca_npu_set_queue_drain(void *npu_synchronize_device) {
  if (in_locked_callback()) return gca__callback_refuses("gca_npu_set_queue_drain");
  mutex_lock(&torch_lock, RANK_TORCH);
  *(void **)&npu_drain = npu_synchronize_device;
  gca_allocator_t *a = atomic_load(&torch_allocator);
  int rc = a ? gca_set_queue_drain(a, npu_drain ? drain_npu_queue : NULL, NULL) : GCA_OK;
  mutex_unlock(&torch_lock);
  return rc;
}

int gca_npu_set_workspace_release(void *release, int arity) {
  if (in_locked_callback()) return gca__callback_refuses("gca_npu_set_workspace_release");
  if (release && (arity < 1 || arity > 3))
    return gca__set_error(GCA_ERR_INVALID, "gca_npu_set_workspace_release: %d arguments: torch_npu's "
                          "NPUWorkspaceAllocator::emptyCache takes 1, 2 or 3", arity);
  mutex_lock(&torch_lock, RANK_TORCH);
  bool was = workspace_release != NULL;
  workspace_release = release;
  workspace_arity = release ? arity : 0;
  gca_allocator_t *a = atomic_load(&torch_allocator);
  int rc = GCA_OK;
  if (a && release && !was) rc = gca_add_oom_handler(a, release_npu_workspaces, NULL);
  else if (a && !release && was) rc = gca_remove_oom_handler(a, release_npu_workspaces, NULL);
  mutex_unlock(&torch_lock);
  return rc;
}

static gca_allocator_t *process_allocator(const char *fallback) {
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  if (a || torch_init(NULL, NULL, fallback) != GCA_OK) return a;
  return atomic_load(&torch_allocator);
}

gca_allocator_t *gca_torch_allocator(void) { return process_allocator("cuda"); }

int gca_torch_is_open(void) { return atomic_load_explicit(&torch_allocator, memory_order_acquire) != NULL; }

int gca_torch_set_raise(void *torch_check_fail) {
  atomic_store(&c10_raise, (c10_check_fail_fn)torch_check_fail);
  return GCA_OK;
}

int gca_torch_set_raise_oom(void *throw_out_of_memory) {
  atomic_store(&c10_raise_oom, (c10_check_fail_fn)throw_out_of_memory);
  return GCA_OK;
}

/* A refused allocation: thrown into the framework (c10::OutOfMemoryError for
 * out of memory where that raiser is connected, else c10::Error) where a
 * raiser is connected (the message says "CUDA out of memory." or "NPU out
 * of memory." as the frameworks' own do, for code that looks for it), else
 * logged where the user will see it, PyTorch getting NULL. The message is
 * kept for gca_torch_last_failure either way. */
static void raise_failure(int device) {
  const char *why = gca_last_error();
  bool oom = gca_last_status() == GCA_ERR_OOM;
  c10_check_fail_fn raise = oom ? atomic_load(&c10_raise_oom) : NULL;
  if (!raise) raise = atomic_load(&c10_raise);
  if (!raise) {
    gca__log_message(GCA_LOG_ERROR, "PyTorch allocation on device %d failed: %s", device, why);
    return;
  }
  gca_allocator_t *a = atomic_load(&torch_allocator);
  const char *kind = a && !strcmp(gca_backend_name(a), "acl") ? "NPU" : "CUDA";
  char message[4200];
  if (oom)
    snprintf(message, sizeof message, "gcalloc: %s %s", kind, why);
  else
    snprintf(message, sizeof message, "gcalloc: %s allocation on device %d failed: %s", kind, device, why);
  GCA_ASSERT(LOCKS_HELD() == 0); /* (it throws into the framework) */
  raise(__func__, __FILE__, __LINE__, message); /* does not return */
  abort();
}

/* ---- CUDA graph pools (the pluggable allocator's graph hooks) ----------
 * PyTorch's CUDAGraph::capture_begin calls beginAllocateToPool(device,
 * mempool_id, filter) and then begins the driver's capture; the filter says
 * which streams' allocations go to the pool (those in this graph's
 * capture). gcalloc does not call the filter (a C++ std::function): it asks
 * the driver which capture a stream is in (backend stream_capture), and the
 * first capture seen on the device after a begin is bound to its pool.
 * Each mempool id is a private pool of gcalloc's, made at the first begin,
 * with PyTorch's use count (a begin counts one, releasePool drops one); at
 * zero it ends once its blocks are freed (until then, at each free).
 * Under torch_lock. */
typedef struct graph_pool {
  int device;
  uint64_t id[2];           /* c10::cuda::MempoolId_t */
  gca_pool_t pool;
  int uses;                 /* begins not yet released */
  int open;                 /* begins not yet ended */
  uint64_t capture;         /* the driver's capture bound to it (0: none yet) */
  gca_stream_t streams[8];  /* streams routed to it while they capture */
  int stream_count;
  bool ending;              /* released by PyTorch: it ends with its last block (graphs_ending counts it) */
  bool by_stream;           /* begun naming its stream (PyTorch 2.1-2.2): no other capture binds to it unbound */
  struct graph_pool *next;
} graph_pool_t;
static graph_pool_t *graph_pools;
static atomic_int graphs_open;    /* begins not yet ended, every device: the allocation's one check */
static atomic_int graphs_ending;  /* pools released with blocks still live */

static graph_pool_t *graph_pool_find(int device, uint64_t first, uint64_t second) {
  for (graph_pool_t *g = graph_pools; g; g = g->next)
    if (g->device == device && g->id[0] == first && g->id[1] == second) return g;
  return NULL;
}

/* End the pools released whose blocks are all freed now. Under torch_lock,
 * so without the framework's drain (the caller drained before taking it:
 * no framework call runs under gcalloc's locks). */
static void graph_pools_end(gca_allocator_t *a) {
  for (graph_pool_t **at = &graph_pools; *at;) {
    graph_pool_t *g = *at;
    if (!g->ending || g->open > 0 || gca__pool_release_drained(a, g->pool) != GCA_OK) {
      at = &g->next;
      continue;
    }
    *at = g->next;
    free(g);
    atomic_fetch_sub(&graphs_ending, 1);
  }
  gca__clear_error(); /* (a pool with live blocks stays: refused, not an error) */
}

void gca_torch_begin_allocate_to_pool(int device, uint64_t id_first, uint64_t id_second, const void *filter) {
  (void)filter; /* (the driver says which streams capture) */
  gca_allocator_t *a = gca_torch_allocator();
  if (!a) return;
  mutex_lock(&torch_lock, RANK_TORCH);
  graph_pool_t *g = graph_pool_find(device, id_first, id_second);
  if (!g && (g = calloc(1, sizeof *g))) {
    g->device = device;
    g->id[0] = id_first;
    g->id[1] = id_second;
    if (gca_pool_create(a, device, &g->pool) != GCA_OK) {
      free(g);
      g = NULL;
    } else {
      g->next = graph_pools;
      graph_pools = g;
    }
  }
  if (g) {
    if (g->ending) atomic_fetch_sub(&graphs_ending, 1);
    g->ending = false;
    g->uses++;
    g->open++;
    g->capture = 0;
    g->by_stream = false;
    (void)gca__capture_hold(a, g->pool, true);
    atomic_fetch_add(&graphs_open, 1);
  }
  mutex_unlock(&torch_lock);
  if (!g)
    gca__log_message(GCA_LOG_ERROR, "CUDA graph pool (%llu, %llu) on device %d: %s: the capture's allocations go to "
                     "the general cache", (unsigned long long)id_first, (unsigned long long)id_second, device,
                     gca_last_error());
}

/* A begin ended: its streams no longer go to the pool. Under torch_lock. */
static void graph_pool_close(gca_allocator_t *a, graph_pool_t *g) {
  for (int i = 0; i < g->stream_count; i++) (void)gca_pool_unroute_stream(a, g->pool, g->streams[i]);
  g->stream_count = 0;
  g->capture = 0;
  g->open--;
  (void)gca__capture_hold(a, g->pool, false);
  atomic_fetch_sub(&graphs_open, 1);
}

void gca_torch_end_allocate_to_pool(int device, uint64_t id_first, uint64_t id_second) {
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  if (!a) return;
  mutex_lock(&torch_lock, RANK_TORCH);
  graph_pool_t *g = graph_pool_find(device, id_first, id_second);
  if (g && g->open > 0) graph_pool_close(a, g);
  mutex_unlock(&torch_lock);
}

/* PyTorch 2.1 and 2.2's form: the capturing stream named, no filter. The
 * stream goes to the pool at once (the driver need not say it captures);
 * other streams joining its capture follow it there as in the form above. */
void gca_torch_begin_allocate_stream_to_pool(int device, void *stream, uint64_t id_first, uint64_t id_second) {
  gca_torch_begin_allocate_to_pool(device, id_first, id_second, NULL);
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  if (!a) return;
  mutex_lock(&torch_lock, RANK_TORCH);
  graph_pool_t *g = graph_pool_find(device, id_first, id_second);
  if (g && g->open > 0 && g->stream_count < (int)(sizeof g->streams / sizeof g->streams[0]) &&
      gca_pool_route_stream(a, g->pool, (gca_stream_t)stream) == GCA_OK) {
    g->streams[g->stream_count++] = (gca_stream_t)stream;
    g->by_stream = true;
  }
  mutex_unlock(&torch_lock);
}

void gca_torch_end_allocate_stream_to_pool(int device, void *stream) {
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  if (!a) return;
  mutex_lock(&torch_lock, RANK_TORCH);
  for (graph_pool_t *g = graph_pools; g; g = g->next) {
    bool routed = false;
    for (int i = 0; i < g->stream_count; i++) routed |= g->streams[i] == (gca_stream_t)stream;
    if (g->device == device && g->open > 0 && routed) {
      graph_pool_close(a, g);
      break;
    }
  }
  mutex_unlock(&torch_lock);
}

void gca_torch_release_pool(int device, uint64_t id_first, uint64_t id_second) {
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  if (!a) return;
  gca__drain_devices(a, false); /* (graph_pools_end may not) */
  mutex_lock(&torch_lock, RANK_TORCH);
  graph_pool_t *g = graph_pool_find(device, id_first, id_second);
  if (g && g->uses > 0 && --g->uses == 0) {
    g->ending = true;
    atomic_fetch_add(&graphs_ending, 1);
    graph_pools_end(a);
  }
  mutex_unlock(&torch_lock);
}

/* An allocation on `stream` while a graph pool is open on some device: a
 * stream in a capture goes to the pool its capture is bound to (the first
 * capture seen after a begin binds to the pool begun last). */
GCA_COLD static void route_capturing_stream(gca_allocator_t *a, int device, gca_stream_t stream) {
  if (device < 0 || device >= a->device_count || !a->backend.ops->stream_capture) return;
  uint64_t capture = 0;
  if (a->backend.ops->stream_capture(a->backend.state, device, stream, &capture) != GCA_OK || !capture) {
    gca__clear_error();
    return;
  }
  mutex_lock(&torch_lock, RANK_TORCH);
  /* Its capture's pool; else the pool begun naming this stream; else the
   * newest pool no capture is bound to (the list is newest first). */
  graph_pool_t *bound = NULL, *named = NULL, *unbound = NULL;
  for (graph_pool_t *g = graph_pools; g && !bound; g = g->next) {
    if (g->device != device || g->open <= 0) continue;
    if (g->capture == capture) bound = g;
    else if (!g->capture) {
      for (int i = 0; i < g->stream_count && !named; i++)
        if (g->streams[i] == stream) named = g;
      if (!g->by_stream && !unbound) unbound = g;
    }
  }
  graph_pool_t *g = bound ? bound : named ? named : unbound;
  bool routed = false;
  for (int i = 0; g && i < g->stream_count; i++) routed |= g->streams[i] == stream;
  if (g && routed) g->capture = capture;
  else if (g && g->stream_count < (int)(sizeof g->streams / sizeof g->streams[0]) &&
           gca_pool_route_stream(a, g->pool, stream) == GCA_OK) {
    g->capture = capture;
    g->streams[g->stream_count++] = stream;
  }
  mutex_unlock(&torch_lock);
}

/* An allocation for PyTorch (CUDA or NPU) on the process-wide allocator. */
static void *framework_malloc(gca_allocator_t *a, size_t size, int device, void *stream) {
  if (!a) {
    keep_failure(gca_last_error());
    raise_failure(device);
    return NULL;
  }
  if (unlikely(atomic_load_explicit(&graphs_open, memory_order_relaxed))) route_capturing_stream(a, device, (gca_stream_t)stream);
  void *p = gca_malloc(a, size, device, (gca_stream_t)stream);
  if (!p && size) {
    keep_failure(gca_last_error());
    raise_failure(device);
  }
  return p;
}

/* PyTorch's size_t of 2^63 bytes or more, through the pluggable
 * allocator's ssize_t: refused, the error set. */
static bool size_refused(ptrdiff_t size) {
  if (size >= 0) return false;
  gca__set_error(GCA_ERR_INVALID, "cannot allocate %zu bytes: more than any device holds", (size_t)size);
  return true;
}

void *gca_torch_malloc(ptrdiff_t size, int device, void *stream) {
  if (size_refused(size)) {
    keep_failure(gca_last_error());
    raise_failure(device);
    return NULL;
  }
  return framework_malloc(gca_torch_allocator(), (size_t)size, device, stream);
}

void *gca_npu_malloc(size_t size, int device, void *stream) {
  return framework_malloc(process_allocator("acl"), size, device, stream);
}

static void framework_free(void *ptr, int device) {
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  if (!ptr) return;
  if (!a || gca_free(a, ptr) != GCA_OK)
    gca__log_message(GCA_LOG_ERROR, "PyTorch free of %p on device %d failed: %s", ptr, device,
                     a ? gca_last_error() : "no allocator is open");
  else if (unlikely(atomic_load_explicit(&graphs_ending, memory_order_relaxed))) {
    gca__drain_devices(a, false);
    mutex_lock(&torch_lock, RANK_TORCH); /* (a released graph's pool ends with its last block) */
    graph_pools_end(a);
    mutex_unlock(&torch_lock);
  }
}

void gca_torch_free(void *ptr, ptrdiff_t size, int device, void *stream) {
  (void)size, (void)stream;
  framework_free(ptr, device);
}

void gca_npu_free(void *ptr, size_t size, int device, void *stream) {
  (void)size, (void)stream;
  framework_free(ptr, device);
}

/* The MemPool route (gcalloc.torch.region): PyTorch's own caching
 * allocator asks for each segment of a MemPool whose allocator is
 * CUDAPluggableAllocator(libgcalloc, "gca_torch_region_malloc",
 * "gca_torch_region_free"), on the thread that allocates, inside the
 * region that pushed the tag's pool. Outside one the request is refused:
 * the segment would land in the default pool, where no pause reaches it.
 * A refusal returns NULL, which PyTorch turns into its own
 * torch.OutOfMemoryError, holding its allocator's lock: nothing is thrown
 * through it, and the message is kept for gca_torch_last_failure. */
void *gca_torch_region_malloc(ptrdiff_t size, int device, void *stream) {
  gca_allocator_t *a = gca_torch_allocator();
  bool ok = a && !size_refused(size) && gca__device_lookup(a, device, "gca_torch_region_malloc");
  if (ok && !gca__mempool_thread_pushed(a, device)) {
    gca__set_error(GCA_ERR_INVALID,
                   "PyTorch asked for a %zu-byte segment of a gcalloc MemPool outside gcalloc.torch.region() on "
                   "this thread (device %d): refused, since no pause would reach it",
                   (size_t)size, device);
    ok = false;
  }
  void *p = ok ? gca_malloc(a, (size_t)size, device, (gca_stream_t)stream) : NULL;
  if (!p && (size || !a)) keep_failure(gca_last_error());
  return p;
}

void gca_torch_region_free(void *ptr, ptrdiff_t size, int device, void *stream) {
  (void)size, (void)stream;
  framework_free(ptr, device);
}

/* A stream use from the framework (record or erase). As PyTorch's and
 * torch_npu's own allocators, quiet for what the allocator did not make:
 * the NULL of an empty tensor, and memory of another (from_blob, DLPack,
 * IPC), which gca_torch_foreign_stream_uses counts. */
static void framework_stream_use(void *ptr, void *stream, bool erase) {
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  if (!a) return;
  if (!ptr) {
    atomic_fetch_add_explicit(&foreign_stream_uses, 1, memory_order_relaxed);
    return;
  }
  int rc = erase ? gca_erase_stream(a, ptr, (gca_stream_t)stream) : gca_record_stream(a, ptr, (gca_stream_t)stream);
  if (rc == GCA_ERR_BAD_POINTER) atomic_fetch_add_explicit(&foreign_stream_uses, 1, memory_order_relaxed);
  else if (rc != GCA_OK)
    gca__log_message(GCA_LOG_ERROR, "%s of %p failed: %s", erase ? "erase_stream" : "record_stream", ptr,
                     gca_last_error());
}

void gca_torch_record_stream(void *ptr, void *stream) { framework_stream_use(ptr, stream, false); }

size_t gca_torch_foreign_stream_uses(void) {
  return atomic_load_explicit(&foreign_stream_uses, memory_order_relaxed);
}

int gca_npu_set_stream_accessor(void *npu_stream_stream) {
  *(void **)&npu_stream_of = npu_stream_stream;
  return GCA_OK;
}

/* A stream use whose stream is torch_npu's NPUStream object (passed by
 * address: it has a user-provided destructor), its aclrtStream asked of
 * torch_npu. The accessor is called holding no lock: it may throw. */
static void npu_object_stream_use(void *ptr, const void *npu_stream, bool erase) {
  npu_stream_accessor_fn stream_of = npu_stream_of;
  if (!stream_of) {
    gca__log_message(GCA_LOG_ERROR, "%s of %p: torch_npu passed its NPUStream object, and no way to read its "
                     "aclrtStream is connected (gca_npu_set_stream_accessor): the use is not recorded",
                     erase ? "erase_stream" : "record_stream", ptr);
    return;
  }
  if (!ptr || !atomic_load_explicit(&torch_allocator, memory_order_acquire)) {
    framework_stream_use(ptr, NULL, erase);
    return;
  }
  framework_stream_use(ptr, npu_stream ? stream_of(npu_stream, false) : NULL, erase);
}

void gca_npu_record_stream_object(void *ptr, const void *npu_stream) { npu_object_stream_use(ptr, npu_stream, false); }

void gca_npu_erase_stream_object(void *ptr, const void *npu_stream) { npu_object_stream_use(ptr, npu_stream, true); }

void gca_torch_empty_cache(void) {
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  if (a) (void)gca_empty_cache(a, -1);
}

void gca_npu_empty_cache(bool check_error) {
  (void)check_error; /* (gcalloc's cache release reports through the log, never throws) */
  gca_torch_empty_cache();
}

void gca_npu_erase_stream(void *ptr, void *stream) { framework_stream_use(ptr, stream, true); }

void gca_npu_init(int device_count) {
  gca_allocator_t *a = process_allocator("acl");
  if (a && device_count > gca_device_count(a))
    gca__log_message(GCA_LOG_WARNING, "torch_npu sees %d devices, gcalloc's %s backend %d: allocations on the others fail",
                     device_count, gca_backend_name(a), gca_device_count(a));
}

void gca_torch_set_memory_fraction(double fraction, int device) {
  gca_allocator_t *a = gca_torch_allocator();
  if (a && gca_set_memory_fraction(a, fraction, device) != GCA_OK)
    gca__log_message(GCA_LOG_ERROR, "set_per_process_memory_fraction(%g, %d) failed: %s", fraction, device,
                     gca_last_error());
}

void gca_torch_init_devices(int device_count) {
  gca_allocator_t *a = gca_torch_allocator();
  if (a && device_count > gca_device_count(a))
    gca__log_message(GCA_LOG_WARNING, "PyTorch sees %d devices, gcalloc's %s backend %d: allocations on the others fail",
                     device_count, gca_backend_name(a), gca_device_count(a));
}

void *gca_torch_base_alloc(void *ptr, size_t *size) {
  gca_allocator_t *a = atomic_load_explicit(&torch_allocator, memory_order_acquire);
  void *base = NULL;
  if (a && gca_base_allocation(a, ptr, &base, size) == GCA_OK) return base;
  /* (PyTorch's own allocator refuses an unknown pointer; a pluggable hook
   * has no way to, so the pointer stands for itself, as without the hook.) */
  gca__log_message(GCA_LOG_ERROR, "base allocation of %p: %s", ptr, a ? gca_last_error() : "no allocator is open");
  if (size) *size = 0;
  return ptr;
}

void gca_torch_shutdown(void) {
  if (in_locked_callback()) {
    gca__callback_refuses("gca_torch_shutdown");
    return;
  }
  mutex_lock(&torch_lock, RANK_TORCH);
  gca_allocator_t *a = atomic_exchange(&torch_allocator, NULL);
  mutex_unlock(&torch_lock);
  gca_close(a);
}
