/* The CUDA backend ("cuda", "cuda:driver=PATH"): the backend interface over
 * the CUDA driver API, loaded at run time.
 *
 * The library never links the driver: libcuda.so.1 (or the file named by
 * the driver= option or GCALLOC_CUDA_DRIVER, e.g. the test double the tests
 * build) is opened with dlopen when a cuda allocator is opened, and every
 * entry point is looked up by its versioned name (cuMemAlloc_v2, as cuda.h
 * maps them). Where there is no driver, gca_open("cuda") fails with
 * GCA_ERR_BACKEND naming what could not be loaded, and nothing else changes.
 * The driver's types are declared here with their ABI layout (checked
 * against cuda.h 13.0), so no CUDA header is needed to build.
 *
 * Each device works in its primary context (the one the CUDA runtime, and so
 * PyTorch, uses); a call makes it current on the calling thread first when
 * it is not. Events are created without timing and kept in a per-device
 * free list, since cuEventCreate costs more than a record. Every driver
 * failure becomes a gcalloc status whose message names the entry point, its
 * arguments and the driver's error name (cuGetErrorName):
 * CUDA_ERROR_OUT_OF_MEMORY is GCA_ERR_OOM (the core may release its cache
 * and retry), CUDA_ERROR_INVALID_VALUE is GCA_ERR_INVALID (GCA_ERR_BAD_POINTER
 * for a host free), anything else GCA_ERR_BACKEND. A refused free of device
 * memory is GCA_ERR_BACKEND whatever the code, so the core keeps the memory
 * and offers it again; an event cuEventDestroy refuses is kept and offered
 * again at the next destroy and at close.
 *
 * Virtual memory (expandable segments) uses cuMemAddressReserve, cuMemCreate
 * (pinned device memory), cuMemMap and cuMemSetAccess (read-write for the
 * owning device), cuMemUnmap, cuMemRelease, cuMemAddressFree, at the
 * minimum granularity; it is offered only when the device reports
 * CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED and the driver has
 * every entry point.
 */
#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "backends/backend.h"

/* ---- the driver's ABI (cuda.h) ------------------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_READY = 600,
  CU_EVENT_DISABLE_TIMING = 0x2,
  CU_MEMHOSTALLOC_PORTABLE = 0x1,
  CU_MEMHOSTREGISTER_PORTABLE = 0x1,
  CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_MEMORYTYPE_HOST = 1,
  CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_ACCESS_FLAGS_PROT_NONE = 0,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
};

typedef struct CUmemLocation {
  int type;
  int id;
} CUmemLocation;

typedef struct CUmemAllocationProp {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;
} CUmemAccessDesc;

/* Every entry point used: X(name, symbol, required, return type args). */
#define CUDA_ENTRIES(X)                                                                                     \
  X(cuInit, "cuInit", 1, (unsigned flags))                                                                  \
  X(cuGetErrorName, "cuGetErrorName", 1, (CUresult error, const char **name))                              \
  X(cuDeviceGetCount, "cuDeviceGetCount", 1, (int *count))                                                  \
  X(cuDeviceGet, "cuDeviceGet", 1, (CUdevice * device, int ordinal))                                        \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1, (CUcontext * ctx, CUdevice dev))              \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", 1, (CUdevice dev))                          \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", 1, (CUcontext * ctx))                                               \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", 1, (CUcontext ctx))                                                 \
  X(cuMemAlloc, "cuMemAlloc_v2", 1, (CUdeviceptr * ptr, size_t size))                                      \
  X(cuMemFree, "cuMemFree_v2", 1, (CUdeviceptr ptr))                                                        \
  X(cuMemGetInfo, "cuMemGetInfo_v2", 1, (size_t * free_bytes, size_t * total))                              \
  X(cuEventCreate, "cuEventCreate", 1, (CUevent * event, unsigned flags))                                   \
  X(cuEventRecord, "cuEventRecord", 1, (CUevent event, CUstream stream))                                    \
  X(cuEventQuery, "cuEventQuery", 1, (CUevent event))                                                       \
  X(cuEventSynchronize, "cuEventSynchronize", 1, (CUevent event))                                           \
  X(cuEventDestroy, "cuEventDestroy_v2", 1, (CUevent event))                                                \
  X(cuStreamWaitEvent, "cuStreamWaitEvent", 1, (CUstream stream, CUevent event, unsigned flags))            \
  X(cuStreamSynchronize, "cuStreamSynchronize", 1, (CUstream stream))                                       \
  X(cuCtxSynchronize, "cuCtxSynchronize", 1, (void))                                                         \
  X(cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", 0, (int *mode))                 \
  X(cuStreamGetCaptureInfo, "cuStreamGetCaptureInfo", 0, (CUstream stream, int *status, uint64_t *id))      \
  X(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", 0, (void *dst, CUdeviceptr src, size_t bytes, CUstream stream)) \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", 0, (CUdeviceptr dst, const void *src, size_t bytes, CUstream stream)) \
  X(cuDeviceGetName, "cuDeviceGetName", 1, (char *name, int len, CUdevice dev))                             \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute", 1, (int *value, int attribute, CUdevice dev))             \
  X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", 1, (size_t * bytes, CUdevice dev))                              \
  X(cuDeviceGetUuid, "cuDeviceGetUuid_v2", 0, (unsigned char *uuid, CUdevice dev))                           \
  X(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", 0, (int *can, CUdevice dev, CUdevice peer))             \
  X(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", 0, (CUcontext peer, unsigned flags))                    \
  X(cuCtxDisablePeerAccess, "cuCtxDisablePeerAccess", 0, (CUcontext peer))                                  \
  X(cuCtxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange", 0, (int *least, int *greatest))             \
  X(cuMemHostAlloc, "cuMemHostAlloc", 0, (void **ptr, size_t size, unsigned flags))                         \
  X(cuMemFreeHost, "cuMemFreeHost", 0, (void *ptr))                                                         \
  X(cuMemHostRegister, "cuMemHostRegister_v2", 0, (void *ptr, size_t size, unsigned flags))                 \
  X(cuMemHostUnregister, "cuMemHostUnregister", 0, (void *ptr))                                             \
  X(cuPointerGetAttribute, "cuPointerGetAttribute", 0, (void *data, int attribute, CUdeviceptr ptr))        \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", 0,                                      \
    (size_t * granularity, const CUmemAllocationProp *prop, int option))                                    \
  X(cuMemAddressReserve, "cuMemAddressReserve", 0,                                                          \
    (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags))         \
  X(cuMemAddressFree, "cuMemAddressFree", 0, (CUdeviceptr ptr, size_t size))                                \
  X(cuMemCreate, "cuMemCreate", 0,                                                                          \
    (CUmemGenericAllocationHandle * handle, size_t size, const CUmemAllocationProp *prop,                   \
     unsigned long long flags))                                                                             \
  X(cuMemRelease, "cuMemRelease", 0, (CUmemGenericAllocationHandle handle))                                 \
  X(cuMemMap, "cuMemMap", 0,                                                                                \
    (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,                      \
     unsigned long long flags))                                                                             \
  X(cuMemUnmap, "cuMemUnmap", 0, (CUdeviceptr ptr, size_t size))                                            \
  X(cuMemSetAccess, "cuMemSetAccess", 0, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count))

typedef struct driver {
  void *handle;
#define DECLARE_ENTRY(field, symbol, required, args) CUresult (*field) args;
  CUDA_ENTRIES(DECLARE_ENTRY)
#undef DECLARE_ENTRY
} driver_t;

#define EVENT_CACHE 256 /* events kept for reuse per device */
#define MAX_PEERS 64    /* devices that can be given access to mappings */

typedef struct vm_mapping {
  uintptr_t addr;
  size_t size;
} vm_mapping_t;

typedef struct cuda_device {
  CUdevice dev;
  /* The primary context, retained at the device's first use (retaining it
   * makes it, with its memory on the device: a device nobody uses is left
   * alone), under ctx_lock. */
  CUcontext _Atomic ctx;
  pthread_mutex_t ctx_lock;
  bool retained;
  bool vm;                   /* virtual memory offered */
  size_t granularity;
  pthread_mutex_t event_lock;
  CUevent events[EVENT_CACHE];
  size_t event_count;
  kept_handles_t refused_events; /* events cuEventDestroy refused: offered again */
  /* Virtual memory mapped on this device, and the other devices given
   * access to it (a bit each, devices 0..63): cuCtxEnablePeerAccess does not
   * reach cuMemMap'd memory, whose access is set per mapping, so a peer
   * enabled later is given access to what is mapped already, and every new
   * mapping is opened to the enabled peers (as PyTorch's expandable
   * segments do). Guarded by vm_lock: peers change outside the core's
   * device lock. */
  pthread_mutex_t vm_lock;
  uint64_t accessors;
  vm_mapping_t *mappings;
  size_t mapping_count, mapping_cap;
} cuda_device_t;

typedef struct cuda {
  driver_t drv;
  char path[512];
  int device_count;
  cuda_device_t devices[];
} cuda_t;

/* ---- errors ------------------------------------------------------------- */

static const char *error_name(const cuda_t *c, CUresult r) {
  const char *name = NULL;
  if (c->drv.cuGetErrorName && c->drv.cuGetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
  return "an unknown CUDA error";
}

/* The status for a failed driver call, with its message. */
GCA_PRINTF(4, 5) static int driver_error(const cuda_t *c, CUresult r, int invalid_status, const char *fmt, ...) {
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  int status = r == CUDA_ERROR_OUT_OF_MEMORY ? GCA_ERR_OOM : r == CUDA_ERROR_INVALID_VALUE ? invalid_status : GCA_ERR_BACKEND;
  return gca__set_error(status, "cuda backend: %s failed: %s (%d)", what, error_name(c, r), r);
}

#define CHECK(c, call, invalid, ...)                                    \
  do {                                                                  \
    CUresult r_ = (call);                                               \
    if (r_ != CUDA_SUCCESS) return driver_error(c, r_, invalid, __VA_ARGS__); \
  } while (0)

/* The device's primary context, retained at its first use. */
static int primary_context(cuda_t *c, int device, CUcontext *out) {
  cuda_device_t *d = &c->devices[device];
  CUcontext ctx = atomic_load_explicit(&d->ctx, memory_order_acquire);
  if (!ctx) {
    mutex_lock(&d->ctx_lock, RANK_BACKEND_CONTEXT);
    ctx = atomic_load_explicit(&d->ctx, memory_order_relaxed);
    CUresult r = CUDA_SUCCESS;
    if (!ctx && (r = c->drv.cuDevicePrimaryCtxRetain(&ctx, d->dev)) == CUDA_SUCCESS) {
      d->retained = true;
      atomic_store_explicit(&d->ctx, ctx, memory_order_release);
    }
    mutex_unlock(&d->ctx_lock);
    if (r != CUDA_SUCCESS) return driver_error(c, r, GCA_ERR_BACKEND, "cuDevicePrimaryCtxRetain (device %d)", device);
  }
  *out = ctx;
  return GCA_OK;
}

/* The calling thread's context before a call, given back after it, as
 * PyTorch's device guard does: a framework keeps its own idea of the
 * thread's device, and the thread's context is its to choose. */
typedef struct guard {
  cuda_t *c;
  CUcontext saved;
  bool switched;
} guard_t;

/* ANY_CONTEXT: the thread's context, whichever device it is on (portable
 * host memory needs one), else device 0's primary context. */
#define ANY_CONTEXT (-1)
static int enter(guard_t *g, int device) {
  cuda_t *c = g->c;
  CUcontext cur = NULL, ctx = NULL;
  if (c->drv.cuCtxGetCurrent(&cur) != CUDA_SUCCESS) cur = NULL;
  g->saved = cur;
  if (device == ANY_CONTEXT) {
    if (cur) return GCA_OK;
    device = 0;
  }
  int rc = primary_context(c, device, &ctx);
  if (rc || cur == ctx) return rc;
  CHECK(c, c->drv.cuCtxSetCurrent(ctx), GCA_ERR_BACKEND, "cuCtxSetCurrent (device %d)", device);
  g->switched = true;
  return GCA_OK;
}

static void leave(guard_t *g) {
  if (g->switched) (void)g->c->drv.cuCtxSetCurrent(g->saved);
  g->switched = false;
}

/* Make `device`'s primary context current for the rest of the calling
 * function, and put the thread's own back however the function returns
 * (the cleanup attribute, gcc and clang); return the failure if it cannot. */
#define IN_CONTEXT(c, device)                                            \
  guard_t guard_ __attribute__((cleanup(leave))) = {(c), NULL, false}; \
  do {                                                                  \
    int rc_ = enter(&guard_, (device));                                 \
    if (rc_) return rc_;                                                \
  } while (0)

/* ---- the backend operations -------------------------------------------- */

static int cuda_device_count(void *state) { return ((cuda_t *)state)->device_count; }

/* Calls that take device memory run in relaxed capture mode on the calling
 * thread, as PyTorch runs cudaMalloc: during a graph capture in global
 * mode (gca_capture_begin) the driver would refuse them otherwise. They
 * are not stream work, so relaxed mode is safe for them. -1: no change. */
#define CAPTURE_MODE_RELAXED 2
static int relax(cuda_t *c) {
  int mode = CAPTURE_MODE_RELAXED;
  if (!c->drv.cuThreadExchangeStreamCaptureMode || c->drv.cuThreadExchangeStreamCaptureMode(&mode) != CUDA_SUCCESS)
    return -1;
  return mode;
}

static void unrelax(cuda_t *c, int mode) {
  if (mode >= 0) (void)c->drv.cuThreadExchangeStreamCaptureMode(&mode);
}

static int cuda_malloc(void *state, int device, size_t size, uintptr_t *addr) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CUdeviceptr p = 0;
  int mode = relax(c);
  CUresult r = c->drv.cuMemAlloc(&p, size);
  unrelax(c, mode);
  CHECK(c, r, GCA_ERR_INVALID, "cuMemAlloc_v2 (%zu bytes, device %d)", size, device);
  *addr = (uintptr_t)p;
  return GCA_OK;
}

static int cuda_free(void *state, int device, uintptr_t addr, size_t size) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  /* Any refusal, an invalid value too, leaves the memory the driver's as far
   * as anyone can tell: the core keeps the segment, to offer again. */
  CHECK(c, c->drv.cuMemFree((CUdeviceptr)addr), GCA_ERR_BACKEND, "cuMemFree_v2 (0x%" PRIxPTR ", %zu bytes, device %d)",
        addr, size, device);
  return GCA_OK;
}

static int cuda_mem_get_info(void *state, int device, size_t *free_bytes, size_t *total_bytes) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuMemGetInfo(free_bytes, total_bytes), GCA_ERR_BACKEND, "cuMemGetInfo_v2 (device %d)", device);
  return GCA_OK;
}

#define CUDA_EVENTS "cuda backend: events"

static int destroy_one_event(void *ctx, uintptr_t e) { return ((cuda_t *)ctx)->drv.cuEventDestroy((CUevent)e); }

/* Destroy e (the device's context current), and offer again the ones
 * refused before; one refused now is kept for the next time. */
static void event_drop(cuda_t *c, int device, CUevent e) {
  cuda_device_t *d = &c->devices[device];
  mutex_lock(&d->event_lock, RANK_BACKEND_EVENTS);
  gca__kept_handles_destroy(&d->refused_events, destroy_one_event, c, (uintptr_t)e, CUDA_EVENTS);
  mutex_unlock(&d->event_lock);
}

static int cuda_event_record(void *state, int device, gca_stream_t stream, uintptr_t *event) {
  cuda_t *c = state;
  cuda_device_t *d = &c->devices[device];
  IN_CONTEXT(c, device);
  CUevent e = NULL;
  mutex_lock(&d->event_lock, RANK_BACKEND_EVENTS);
  if (d->event_count) e = d->events[--d->event_count];
  mutex_unlock(&d->event_lock);
  if (!e) CHECK(c, c->drv.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), GCA_ERR_BACKEND, "cuEventCreate (device %d)", device);
  CUresult r = c->drv.cuEventRecord(e, (CUstream)stream);
  if (r != CUDA_SUCCESS) {
    event_drop(c, device, e);
    return driver_error(c, r, GCA_ERR_INVALID, "cuEventRecord (stream 0x%" PRIxPTR ", device %d)", stream, device);
  }
  *event = (uintptr_t)e;
  return GCA_OK;
}

static int cuda_event_query(void *state, int device, uintptr_t event) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CUresult r = c->drv.cuEventQuery((CUevent)event);
  if (r == CUDA_ERROR_NOT_READY) return BACKEND_NOT_READY;
  if (r != CUDA_SUCCESS) return driver_error(c, r, GCA_ERR_INVALID, "cuEventQuery (device %d)", device);
  return GCA_OK;
}

static int cuda_event_synchronize(void *state, int device, uintptr_t event) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuEventSynchronize((CUevent)event), GCA_ERR_INVALID, "cuEventSynchronize (device %d)", device);
  return GCA_OK;
}

static void cuda_event_destroy(void *state, int device, uintptr_t event) {
  cuda_t *c = state;
  cuda_device_t *d = &c->devices[device];
  mutex_lock(&d->event_lock, RANK_BACKEND_EVENTS);
  bool kept = d->event_count < EVENT_CACHE;
  if (kept) d->events[d->event_count++] = (CUevent)event;
  mutex_unlock(&d->event_lock);
  /* A recorded event may be destroyed before it completes: the driver frees it then. */
  if (kept) return;
  guard_t g = {c, NULL, false};
  if (enter(&g, device) == GCA_OK) event_drop(c, device, (CUevent)event);
  leave(&g);
}

static int cuda_stream_wait_event(void *state, int device, gca_stream_t stream, uintptr_t event) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuStreamWaitEvent((CUstream)stream, (CUevent)event, 0), GCA_ERR_INVALID,
        "cuStreamWaitEvent (stream 0x%" PRIxPTR ", device %d)", stream, device);
  return GCA_OK;
}

static int cuda_stream_synchronize(void *state, int device, gca_stream_t stream) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuStreamSynchronize((CUstream)stream), GCA_ERR_INVALID,
        "cuStreamSynchronize (stream 0x%" PRIxPTR ", device %d)", stream, device);
  return GCA_OK;
}

static int cuda_device_synchronize(void *state, int device) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuCtxSynchronize(), GCA_ERR_BACKEND, "cuCtxSynchronize (device %d)", device);
  return GCA_OK;
}

static int cuda_copy_to_host(void *state, int device, gca_stream_t stream, void *dst, uintptr_t src, size_t size) {
  cuda_t *c = state;
  if (!c->drv.cuMemcpyDtoHAsync) return gca__set_error(GCA_ERR_BACKEND, "cuda backend: the driver has no cuMemcpyDtoHAsync_v2");
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuMemcpyDtoHAsync(dst, (CUdeviceptr)src, size, (CUstream)stream), GCA_ERR_BACKEND,
        "cuMemcpyDtoHAsync (%zu bytes from 0x%" PRIxPTR ", device %d)", size, src, device);
  return GCA_OK;
}

static int cuda_copy_to_device(void *state, int device, gca_stream_t stream, uintptr_t dst, const void *src,
                               size_t size) {
  cuda_t *c = state;
  if (!c->drv.cuMemcpyHtoDAsync) return gca__set_error(GCA_ERR_BACKEND, "cuda backend: the driver has no cuMemcpyHtoDAsync_v2");
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuMemcpyHtoDAsync((CUdeviceptr)dst, src, size, (CUstream)stream), GCA_ERR_BACKEND,
        "cuMemcpyHtoDAsync (%zu bytes to 0x%" PRIxPTR ", device %d)", size, dst, device);
  return GCA_OK;
}

/* ---- virtual memory ----------------------------------------------------- */

static CUmemAllocationProp device_memory(int device) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

static int no_virtual_memory(int device) {
  return gca__set_error(GCA_ERR_BACKEND, "cuda backend: device %d has no virtual memory management", device);
}

static int cuda_vm_granularity(void *state, int device, size_t *granularity) {
  cuda_t *c = state;
  if (!c->devices[device].vm) return no_virtual_memory(device);
  *granularity = c->devices[device].granularity;
  return GCA_OK;
}

static int cuda_vm_reserve(void *state, int device, size_t size, uintptr_t *addr) {
  cuda_t *c = state;
  if (!c->devices[device].vm) return no_virtual_memory(device);
  IN_CONTEXT(c, device);
  CUdeviceptr p = 0;
  int mode = relax(c);
  CUresult r = c->drv.cuMemAddressReserve(&p, size, 0, 0, 0);
  unrelax(c, mode);
  CHECK(c, r, GCA_ERR_INVALID, "cuMemAddressReserve (%zu bytes, device %d)", size, device);
  *addr = (uintptr_t)p;
  return GCA_OK;
}

static int cuda_vm_unreserve(void *state, int device, uintptr_t addr, size_t size) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuMemAddressFree((CUdeviceptr)addr, size), GCA_ERR_INVALID,
        "cuMemAddressFree (0x%" PRIxPTR ", %zu bytes, device %d)", addr, size, device);
  return GCA_OK;
}

static int cuda_vm_create(void *state, int device, size_t size, uintptr_t *handle) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CUmemAllocationProp prop = device_memory(device);
  CUmemGenericAllocationHandle h = 0;
  int mode = relax(c);
  CUresult r = c->drv.cuMemCreate(&h, size, &prop, 0);
  unrelax(c, mode);
  CHECK(c, r, GCA_ERR_INVALID, "cuMemCreate (%zu bytes, device %d)", size, device);
  *handle = (uintptr_t)h;
  return GCA_OK;
}

static int cuda_vm_destroy(void *state, int device, uintptr_t handle) {
  cuda_t *c = state;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuMemRelease((CUmemGenericAllocationHandle)handle), GCA_ERR_INVALID, "cuMemRelease (device %d)",
        device);
  return GCA_OK;
}

/* Access descriptors for a mapping of `device`: itself and its enabled
 * peers. With d->vm_lock held. */
static size_t access_list(const cuda_t *c, int device, CUmemAccessDesc *out) {
  size_t n = 0;
  out[n++] = (CUmemAccessDesc){{CU_MEM_LOCATION_TYPE_DEVICE, device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  uint64_t peers = c->devices[device].accessors;
  for (int p = 0; p < c->device_count && p < MAX_PEERS; p++)
    if (peers >> p & 1) out[n++] = (CUmemAccessDesc){{CU_MEM_LOCATION_TYPE_DEVICE, p}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  return n;
}

static int cuda_vm_map(void *state, int device, uintptr_t addr, size_t size, uintptr_t handle) {
  cuda_t *c = state;
  cuda_device_t *d = &c->devices[device];
  IN_CONTEXT(c, device);
  mutex_lock(&d->vm_lock, RANK_BACKEND);
  if (d->mapping_count == d->mapping_cap) {
    vm_mapping_t *grown = gca__grow_array(d->mappings, &d->mapping_cap, sizeof *grown, 64);
    if (!grown) {
      mutex_unlock(&d->vm_lock);
      return gca__set_error(GCA_ERR_NOMEM, "cuda backend: out of host memory recording a mapping");
    }
    d->mappings = grown;
  }
  int mode = relax(c);
  CUresult r = c->drv.cuMemMap((CUdeviceptr)addr, size, 0, (CUmemGenericAllocationHandle)handle, 0);
  if (r != CUDA_SUCCESS) {
    unrelax(c, mode);
    mutex_unlock(&d->vm_lock);
    return driver_error(c, r, GCA_ERR_INVALID, "cuMemMap (0x%" PRIxPTR ", %zu bytes, device %d)", addr, size, device);
  }
  CUmemAccessDesc access[MAX_PEERS + 1];
  size_t n = access_list(c, device, access);
  r = c->drv.cuMemSetAccess((CUdeviceptr)addr, size, access, n);
  unrelax(c, mode);
  if (r != CUDA_SUCCESS) {
    mutex_unlock(&d->vm_lock);
    c->drv.cuMemUnmap((CUdeviceptr)addr, size); /* mapped but unusable: undo */
    return driver_error(c, r, GCA_ERR_INVALID, "cuMemSetAccess (0x%" PRIxPTR ", %zu bytes, device %d, %zu device%s)",
                        addr, size, device, n, n == 1 ? "" : "s");
  }
  d->mappings[d->mapping_count++] = (vm_mapping_t){addr, size};
  mutex_unlock(&d->vm_lock);
  return GCA_OK;
}

static int cuda_vm_unmap(void *state, int device, uintptr_t addr, size_t size) {
  cuda_t *c = state;
  cuda_device_t *d = &c->devices[device];
  IN_CONTEXT(c, device);
  mutex_lock(&d->vm_lock, RANK_BACKEND);
  CUresult r = c->drv.cuMemUnmap((CUdeviceptr)addr, size);
  if (r == CUDA_SUCCESS) {
    /* Forget the mappings in the range (whole mappings, maybe several). */
    size_t kept = 0;
    for (size_t i = 0; i < d->mapping_count; i++)
      if (d->mappings[i].addr < addr || d->mappings[i].addr >= addr + size) d->mappings[kept++] = d->mappings[i];
    d->mapping_count = kept;
  }
  mutex_unlock(&d->vm_lock);
  if (r != CUDA_SUCCESS)
    return driver_error(c, r, GCA_ERR_INVALID, "cuMemUnmap (0x%" PRIxPTR ", %zu bytes, device %d)", addr, size,
                        device);
  return GCA_OK;
}

/* Give `accessor` access `flags` to every mapping of `owner`. With the
 * owner's vm_lock held. */
static int set_mappings_access(cuda_t *c, int owner, int accessor, unsigned flags) {
  cuda_device_t *d = &c->devices[owner];
  CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, accessor}, flags};
  for (size_t i = 0; i < d->mapping_count; i++) {
    CUresult r = c->drv.cuMemSetAccess((CUdeviceptr)d->mappings[i].addr, d->mappings[i].size, &access, 1);
    if (r != CUDA_SUCCESS)
      return driver_error(c, r, GCA_ERR_INVALID,
                          "cuMemSetAccess (0x%" PRIxPTR ", %zu bytes of device %d, %s for device %d)",
                          d->mappings[i].addr, d->mappings[i].size, owner, flags ? "read-write" : "none", accessor);
  }
  return GCA_OK;
}

/* ---- device facts, peers, host memory ---------------------------------- */

static int cuda_device_properties(void *state, int device, gca_device_properties_t *out) {
  cuda_t *c = state;
  CUdevice dev = c->devices[device].dev;
  memset(out, 0, sizeof *out);
  CHECK(c, c->drv.cuDeviceGetName(out->name, (int)sizeof out->name, dev), GCA_ERR_BACKEND,
        "cuDeviceGetName (device %d)", device);
  out->name[sizeof out->name - 1] = 0;
  CHECK(c, c->drv.cuDeviceGetAttribute(&out->major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), GCA_ERR_BACKEND,
        "cuDeviceGetAttribute (compute capability major, device %d)", device);
  CHECK(c, c->drv.cuDeviceGetAttribute(&out->minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), GCA_ERR_BACKEND,
        "cuDeviceGetAttribute (compute capability minor, device %d)", device);
  CHECK(c, c->drv.cuDeviceGetAttribute(&out->multiprocessor_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
        GCA_ERR_BACKEND, "cuDeviceGetAttribute (multiprocessor count, device %d)", device);
  size_t total = 0;
  CHECK(c, c->drv.cuDeviceTotalMem(&total, dev), GCA_ERR_BACKEND, "cuDeviceTotalMem_v2 (device %d)", device);
  out->total_memory = total;
  return GCA_OK;
}

static int missing(const char *entry) {
  return gca__set_error(GCA_ERR_BACKEND, "cuda backend: the driver has no %s", entry);
}

/* The device's UUID (what CUDA_VISIBLE_DEVICES does not change). */
static int cuda_device_identity(void *state, int device, char *out, size_t cap) {
  cuda_t *c = state;
  if (!c->drv.cuDeviceGetUuid) return missing("cuDeviceGetUuid_v2");
  unsigned char uuid[16];
  CHECK(c, c->drv.cuDeviceGetUuid(uuid, c->devices[device].dev), GCA_ERR_BACKEND, "cuDeviceGetUuid_v2 (device %d)",
        device);
  char hex[33];
  for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", uuid[i]);
  snprintf(out, cap, "cuda:GPU-%s", hex);
  return GCA_OK;
}

static int cuda_can_access_peer(void *state, int device, int peer, int *can) {
  cuda_t *c = state;
  if (!c->drv.cuDeviceCanAccessPeer) return missing("cuDeviceCanAccessPeer");
  CHECK(c, c->drv.cuDeviceCanAccessPeer(can, c->devices[device].dev, c->devices[peer].dev), GCA_ERR_INVALID,
        "cuDeviceCanAccessPeer (device %d, peer %d)", device, peer);
  return GCA_OK;
}

/* `device` may read and write `peer`'s memory from now on: its ordinary
 * allocations through the context (cuCtxEnablePeerAccess), its mapped
 * virtual memory (expandable segments) through each mapping's access. */
static int cuda_enable_peer_access(void *state, int device, int peer) {
  cuda_t *c = state;
  if (!c->drv.cuCtxEnablePeerAccess) return missing("cuCtxEnablePeerAccess");
  if (device >= MAX_PEERS)
    return gca__set_error(GCA_ERR_INVALID, "cuda backend: peer access for device %d: at most %d devices", device, MAX_PEERS);
  CUcontext peer_ctx = NULL;
  int rc = primary_context(c, peer, &peer_ctx);
  if (rc) return rc;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuCtxEnablePeerAccess(peer_ctx, 0), GCA_ERR_INVALID,
        "cuCtxEnablePeerAccess (device %d, peer %d)", device, peer);
  cuda_device_t *p = &c->devices[peer];
  char why[512];
  mutex_lock(&p->vm_lock, RANK_BACKEND);
  rc = set_mappings_access(c, peer, device, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  if (rc == GCA_OK) {
    p->accessors |= (uint64_t)1 << device;
  } else {
    /* All or nothing: take back what was given. */
    snprintf(why, sizeof why, "%s", gca_last_error());
    (void)set_mappings_access(c, peer, device, CU_MEM_ACCESS_FLAGS_PROT_NONE);
  }
  mutex_unlock(&p->vm_lock);
  if (rc == GCA_OK) return GCA_OK;
  c->drv.cuCtxDisablePeerAccess(peer_ctx); /* (the device's context is still current) */
  return gca__set_error(rc, "%s; peer access not enabled", why);
}

static int cuda_disable_peer_access(void *state, int device, int peer) {
  cuda_t *c = state;
  if (!c->drv.cuCtxDisablePeerAccess) return missing("cuCtxDisablePeerAccess");
  CUcontext peer_ctx = NULL;
  int rc = primary_context(c, peer, &peer_ctx);
  if (rc) return rc;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuCtxDisablePeerAccess(peer_ctx), GCA_ERR_INVALID,
        "cuCtxDisablePeerAccess (device %d, peer %d)", device, peer);
  cuda_device_t *p = &c->devices[peer];
  mutex_lock(&p->vm_lock, RANK_BACKEND);
  if (device < MAX_PEERS) p->accessors &= ~((uint64_t)1 << device);
  rc = set_mappings_access(c, peer, device, CU_MEM_ACCESS_FLAGS_PROT_NONE);
  mutex_unlock(&p->vm_lock);
  return rc;
}

static int cuda_stream_priority_range(void *state, int device, int *least, int *greatest) {
  cuda_t *c = state;
  if (!c->drv.cuCtxGetStreamPriorityRange) return missing("cuCtxGetStreamPriorityRange");
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuCtxGetStreamPriorityRange(least, greatest), GCA_ERR_BACKEND,
        "cuCtxGetStreamPriorityRange (device %d)", device);
  return GCA_OK;
}

/* Page-locked host memory, portable across contexts (as PyTorch's
 * cudaHostAlloc(cudaHostAllocDefault) in the primary context of device 0). */
static int cuda_host_alloc(void *state, size_t size, void **ptr) {
  cuda_t *c = state;
  if (!c->drv.cuMemHostAlloc) return missing("cuMemHostAlloc");
  IN_CONTEXT(c, ANY_CONTEXT);
  CHECK(c, c->drv.cuMemHostAlloc(ptr, size, CU_MEMHOSTALLOC_PORTABLE), GCA_ERR_INVALID, "cuMemHostAlloc (%zu bytes)",
        size);
  return GCA_OK;
}

static int cuda_host_free(void *state, void *ptr) {
  cuda_t *c = state;
  if (!c->drv.cuMemFreeHost) return missing("cuMemFreeHost");
  IN_CONTEXT(c, ANY_CONTEXT);
  CHECK(c, c->drv.cuMemFreeHost(ptr), GCA_ERR_BAD_POINTER, "cuMemFreeHost (%p)", ptr);
  return GCA_OK;
}

/* Page-lock the caller's memory, portable across contexts (PyTorch's
 * pinned_use_cuda_host_register path). */
static int cuda_host_register(void *state, void *ptr, size_t size) {
  cuda_t *c = state;
  if (!c->drv.cuMemHostRegister) return missing("cuMemHostRegister_v2");
  IN_CONTEXT(c, ANY_CONTEXT);
  CHECK(c, c->drv.cuMemHostRegister(ptr, size, CU_MEMHOSTREGISTER_PORTABLE), GCA_ERR_INVALID,
        "cuMemHostRegister (%p, %zu bytes)", ptr, size);
  return GCA_OK;
}

static int cuda_host_unregister(void *state, void *ptr) {
  cuda_t *c = state;
  if (!c->drv.cuMemHostUnregister) return missing("cuMemHostUnregister");
  IN_CONTEXT(c, ANY_CONTEXT);
  CHECK(c, c->drv.cuMemHostUnregister(ptr), GCA_ERR_BAD_POINTER, "cuMemHostUnregister (%p)", ptr);
  return GCA_OK;
}

/* Whether the driver knows `ptr` as page-locked host memory (any allocator's). */
static int cuda_host_is_pinned(void *state, const void *ptr, int *pinned) {
  cuda_t *c = state;
  *pinned = 0;
  if (!c->drv.cuPointerGetAttribute) return missing("cuPointerGetAttribute");
  IN_CONTEXT(c, ANY_CONTEXT);
  unsigned type = 0;
  CUresult r = c->drv.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)ptr);
  /* Memory the driver never saw is an invalid value to it: not pinned. */
  if (r == CUDA_ERROR_INVALID_VALUE) return GCA_OK;
  if (r != CUDA_SUCCESS) return driver_error(c, r, GCA_ERR_INVALID, "cuPointerGetAttribute (%p)", ptr);
  *pinned = type == CU_MEMORYTYPE_HOST;
  return GCA_OK;
}

/* ---- opening and closing ------------------------------------------------ */

/* This process's state alone, with no driver call: a child of fork's
 * (backend.h), and the end of cuda_destroy. */
static void cuda_forget(void *state) {
  cuda_t *c = state;
  if (!c) return;
  for (int i = 0; i < c->device_count; i++) {
    cuda_device_t *d = &c->devices[i];
    free(d->refused_events.items);
    pthread_mutex_destroy(&d->event_lock);
    pthread_mutex_destroy(&d->vm_lock);
    pthread_mutex_destroy(&d->ctx_lock);
    free(d->mappings);
  }
  free(c);
}

static void cuda_destroy(void *state) {
  cuda_t *c = state;
  if (!c) return;
  for (int i = 0; i < c->device_count; i++) {
    cuda_device_t *d = &c->devices[i];
    guard_t g = {c, NULL, false};
    if ((d->event_count || d->refused_events.count) && enter(&g, i) == GCA_OK) {
      for (size_t k = 0; k < d->event_count; k++)
        gca__kept_handles_destroy(&d->refused_events, destroy_one_event, c, (uintptr_t)d->events[k], CUDA_EVENTS);
      gca__kept_handles_retry(&d->refused_events, destroy_one_event, c, false, CUDA_EVENTS);
    }
    leave(&g);
    gca__kept_handles_retry(&d->refused_events, destroy_one_event, c, true, CUDA_EVENTS);
    if (d->retained) c->drv.cuDevicePrimaryCtxRelease(d->dev);
  }
  if (c->drv.handle) dlclose(c->drv.handle);
  cuda_forget(c);
}

/* CU_STREAM_CAPTURE_STATUS_ACTIVE; NONE is 0, INVALIDATED 2. */
#define CAPTURE_ACTIVE 1

static int cuda_stream_capture(void *state, int device, gca_stream_t stream, uint64_t *capture_id) {
  cuda_t *c = state;
  *capture_id = 0;
  if (!c->drv.cuStreamGetCaptureInfo) return GCA_OK; /* (a driver without graphs: nothing captures) */
  int status = 0;
  uint64_t id = 0;
  IN_CONTEXT(c, device);
  CHECK(c, c->drv.cuStreamGetCaptureInfo((CUstream)stream, &status, &id), GCA_ERR_BACKEND,
        "cuStreamGetCaptureInfo (stream %p, device %d)", (void *)stream, device);
  if (status == CAPTURE_ACTIVE) *capture_id = id ? id : 1;
  return GCA_OK;
}

static const backend_ops_t cuda_ops = {
    .name = "cuda",
    .device_count = cuda_device_count,
    .malloc = cuda_malloc,
    .free = cuda_free,
    .mem_get_info = cuda_mem_get_info,
    .stream_capture = cuda_stream_capture,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
    .event_destroy = cuda_event_destroy,
    .stream_wait_event = cuda_stream_wait_event,
    .stream_synchronize = cuda_stream_synchronize,
    .device_synchronize = cuda_device_synchronize,
    .copy_to_host = cuda_copy_to_host,
    .copy_to_device = cuda_copy_to_device,
    .vm_granularity = cuda_vm_granularity,
    .vm_reserve = cuda_vm_reserve,
    .vm_unreserve = cuda_vm_unreserve,
    .vm_create = cuda_vm_create,
    .vm_destroy = cuda_vm_destroy,
    .vm_map = cuda_vm_map,
    .vm_unmap = cuda_vm_unmap,
    .device_properties = cuda_device_properties,
    .can_access_peer = cuda_can_access_peer,
    .enable_peer_access = cuda_enable_peer_access,
    .disable_peer_access = cuda_disable_peer_access,
    .stream_priority_range = cuda_stream_priority_range,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .host_is_pinned = cuda_host_is_pinned,
    .device_identity = cuda_device_identity,
    .destroy = cuda_destroy,
    .forget = cuda_forget,
};

/* Open the driver and look up its entry points. */
static int load_driver(const char *path, driver_t *drv) {
  dlerror();
  drv->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!drv->handle) {
    const char *why = dlerror();
    return gca__set_error(GCA_ERR_BACKEND, "cuda backend: no CUDA driver: cannot load %s (%s)", path,
                          why ? why : "unknown reason");
  }
#define LOOK_UP(field, symbol, required, args)                                                                      \
  *(void **)&drv->field = dlsym(drv->handle, symbol);                                                               \
  if (required && !drv->field)                                                                                      \
    return gca__set_error(GCA_ERR_BACKEND, "cuda backend: the CUDA driver %s has no %s (too old, or not a CUDA driver)", \
                          path, symbol);
  CUDA_ENTRIES(LOOK_UP)
#undef LOOK_UP
  return GCA_OK;
}

/* Whether the driver offers everything expandable segments need on `dev`. */
static void probe_virtual_memory(cuda_t *c, int device) {
  cuda_device_t *d = &c->devices[device];
  const driver_t *drv = &c->drv;
  int supported = 0;
  if (!drv->cuMemGetAllocationGranularity || !drv->cuMemAddressReserve || !drv->cuMemAddressFree || !drv->cuMemCreate ||
      !drv->cuMemRelease || !drv->cuMemMap || !drv->cuMemUnmap || !drv->cuMemSetAccess)
    return;
  if (drv->cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d->dev) !=
          CUDA_SUCCESS ||
      !supported)
    return;
  CUmemAllocationProp prop = device_memory(device);
  size_t g = 0;
  if (drv->cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !g) return;
  d->granularity = g;
  d->vm = true;
}

int gca__cuda_backend_create(const char *options, backend_t *out) {
  char path[512];
  int rc = gca__backend_library_path("cuda", options, "driver", "GCALLOC_CUDA_DRIVER", "libcuda.so.1", path,
                                     sizeof path);
  if (rc) return rc;

  driver_t drv;
  memset(&drv, 0, sizeof drv);
  rc = load_driver(path, &drv);
  if (rc) {
    if (drv.handle) dlclose(drv.handle);
    return rc;
  }
  cuda_t probe = {.drv = drv};
  CUresult r = drv.cuInit(0);
  int count = 0;
  if (r == CUDA_SUCCESS) r = drv.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS || count <= 0) {
    rc = r != CUDA_SUCCESS ? driver_error(&probe, r, GCA_ERR_BACKEND, "cuInit/cuDeviceGetCount (driver %s)", path)
                           : gca__set_error(GCA_ERR_BACKEND, "cuda backend: the driver %s sees no CUDA device", path);
    dlclose(drv.handle);
    return rc;
  }
  cuda_t *c = calloc(1, sizeof *c + (size_t)count * sizeof c->devices[0]);
  if (!c) {
    dlclose(drv.handle);
    return gca__set_error(GCA_ERR_NOMEM, "cuda backend: out of host memory");
  }
  c->drv = drv;
  snprintf(c->path, sizeof c->path, "%s", path);
  for (int i = 0; i < count; i++) {
    cuda_device_t *d = &c->devices[i];
    pthread_mutex_init(&d->event_lock, NULL);
    pthread_mutex_init(&d->vm_lock, NULL);
    pthread_mutex_init(&d->ctx_lock, NULL);
    atomic_init(&d->ctx, NULL);
    c->device_count = i + 1;
    if ((r = drv.cuDeviceGet(&d->dev, i)) != CUDA_SUCCESS) {
      rc = driver_error(c, r, GCA_ERR_BACKEND, "cuDeviceGet (device %d)", i);
      cuda_destroy(c);
      return rc;
    }
    probe_virtual_memory(c, i); /* (attributes: no context is made) */
  }
  out->ops = &cuda_ops;
  out->state = c;
  return GCA_OK;
}
