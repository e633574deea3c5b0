/* The Ascend backend ("acl", "acl:library=PATH"): the backend interface over
 * AscendCL's runtime, loaded at run time.
 *
 * The library never links CANN: libascendcl.so (or the file named by the
 * library= option or GCALLOC_ACL_LIBRARY, e.g. the stand-in the tests
 * build) is opened with dlopen when an acl allocator is opened. The calls
 * every AscendCL has are required; those torch_npu treats as optional
 * (aclrtMallocAlign32, aclrtQueryEventStatus, aclrtCreateEventWithFlag,
 * aclrtGetSocName, peer access, host memory, virtual memory) are looked up
 * with dlsym and their absence handled. The types are declared here with
 * their ABI layout (acl_rt.h), so no CANN header is needed to build.
 *
 * aclInit is called once; ACL_ERROR_REPEAT_INITIALIZE means a framework
 * initialized first, which is fine. The current device is per thread in
 * AscendCL, and a framework keeps its own idea of it (torch_npu caches the
 * thread's device and skips aclrtSetDevice when it thinks it is there):
 * every call that works on a device makes it current on the calling thread
 * (aclrtGetDevice, then aclrtSetDevice when it differs or none is set) and
 * puts the thread's previous device back before returning, as torch_npu's
 * device guard does (a thread that had none is left on the call's device:
 * AscendCL cannot unset one). Opening touches no device: aclrtSetDevice
 * makes a context on the device it names, so virtual memory is probed on a
 * device when the core first asks for it there. Device memory comes from
 * aclrtMallocAlign32 (else aclrtMalloc, which pads by 32 bytes) with the
 * HUGE_FIRST policy. Events are created with
 * ACL_EVENT_CAPTURE_STREAM_PROGRESS where the runtime has
 * aclrtCreateEventWithFlag, and kept in a per-device free list; they are
 * queried with aclrtQueryEventStatus (COMPLETE = 1) or, on an older
 * runtime, aclrtQueryEvent (COMPLETE = 0): the two enums have opposite
 * values. Every AscendCL error becomes a gcalloc status whose message names
 * the call, its arguments and the code (and its name where known): 207001
 * and 207018 are GCA_ERR_OOM (the core releases its cache and retries),
 * invalid parameters GCA_ERR_INVALID (GCA_ERR_BAD_POINTER for a host free),
 * anything else GCA_ERR_BACKEND. A refused free of device memory is
 * GCA_ERR_BACKEND whatever the code, so the core keeps the memory and offers
 * it again; an event aclrtDestroyEvent refuses is kept and offered again at
 * the next destroy and at close.
 *
 * Virtual memory (expandable segments) uses aclrtReserveMemAddress (with
 * the huge-page flag, as torch_npu), aclrtMallocPhysical (HBM, huge pages),
 * aclrtMapMem, aclrtUnmapMem (one mapping each), aclrtFreePhysical,
 * aclrtReleaseMemAddress, at aclrtMemGetAllocationGranularity's minimum. It
 * is probed as torch_npu does, by reserving 512 bytes, on a device's first
 * use of expandable segments; without the entry points or when the probe
 * fails, expandable_segments:True is served with ordinary segments, with a
 * warning.
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

/* ---- AscendCL's ABI (acl_base.h, acl_rt.h) ------------------------------ */

typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef void *aclrtDrvMemHandle;

enum {
  ACL_SUCCESS = 0,
  ACL_ERROR_INVALID_PARAM = 100000,
  ACL_ERROR_UNINITIALIZE = 100001,
  ACL_ERROR_REPEAT_INITIALIZE = 100002,
  ACL_ERROR_RT_PARAM_INVALID = 107000,
  ACL_ERROR_RT_MEMORY_ALLOCATION = 207001,
  ACL_ERROR_RT_DEVICE_OOM = 207018,
  ACL_HBM_MEM = 1,
  ACL_HBM_MEM_HUGE = 4,
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
  ACL_EVENT_SYNC = 0x1,
  ACL_EVENT_CAPTURE_STREAM_PROGRESS = 0x2,
  ACL_EVENT_RECORDED_STATUS_COMPLETE = 1, /* aclrtEventRecordedStatus (aclrtQueryEventStatus) */
  ACL_EVENT_STATUS_COMPLETE = 0,          /* aclrtEventStatus (aclrtQueryEvent) */
  ACL_MEM_LOCATION_TYPE_DEVICE = 1,
  ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
  ACL_RESERVE_HUGE_PAGE = 1 /* torch_npu's flags for aclrtReserveMemAddress */
};

/* aclsysGetCANNVersion's answer (acl.h). */
enum { ACL_PKG_NAME_CANN = 0, ACL_PKG_VERSION_MAX_SIZE = 128, ACL_PKG_VERSION_PARTS_MAX_SIZE = 64 };
typedef struct aclCANNPackageVersion {
  char version[ACL_PKG_VERSION_MAX_SIZE];
  char majorVersion[ACL_PKG_VERSION_PARTS_MAX_SIZE];
  char minorVersion[ACL_PKG_VERSION_PARTS_MAX_SIZE];
  char releaseVersion[ACL_PKG_VERSION_PARTS_MAX_SIZE];
  char patchVersion[ACL_PKG_VERSION_PARTS_MAX_SIZE];
  char reserved[ACL_PKG_VERSION_MAX_SIZE];
} aclCANNPackageVersion;

typedef struct aclrtPhysicalMemProp {
  int handleType;
  int allocationType;
  int memAttr;
  struct {
    uint32_t id;
    int type;
  } location;
  uint64_t reserve;
} aclrtPhysicalMemProp;

/* Every entry point used: X(name, required, args). */
#define ACL_ENTRIES(X)                                                                                         \
  X(aclInit, 1, (const char *config))                                                                          \
  X(aclrtGetDeviceCount, 1, (uint32_t * count))                                                                \
  X(aclrtSetDevice, 1, (int32_t id))                                                                           \
  X(aclrtGetDevice, 1, (int32_t * id))                                                                         \
  X(aclrtMalloc, 1, (void **p, size_t size, int policy))                                                       \
  X(aclrtMallocAlign32, 0, (void **p, size_t size, int policy))                                                \
  X(aclrtFree, 1, (void *p))                                                                                   \
  X(aclrtGetMemInfo, 1, (int attr, size_t *free_bytes, size_t *total))                                         \
  X(aclrtCreateEvent, 1, (aclrtEvent * e))                                                                     \
  X(aclrtCreateEventWithFlag, 0, (aclrtEvent * e, uint32_t flag))                                              \
  X(aclrtRecordEvent, 1, (aclrtEvent e, aclrtStream s))                                                        \
  X(aclrtQueryEventStatus, 0, (aclrtEvent e, int *status))                                                     \
  X(aclrtQueryEvent, 0, (aclrtEvent e, int *status))                                                           \
  X(aclrtSynchronizeEvent, 1, (aclrtEvent e))                                                                  \
  X(aclrtDestroyEvent, 1, (aclrtEvent e))                                                                      \
  X(aclrtStreamWaitEvent, 1, (aclrtStream s, aclrtEvent e))                                                    \
  X(aclrtSynchronizeStream, 1, (aclrtStream s))                                                                \
  X(aclrtSynchronizeDevice, 1, (void))                                                                         \
  X(aclrtDeviceCanAccessPeer, 0, (int32_t * can, int32_t device, int32_t peer))                                \
  X(aclrtDeviceEnablePeerAccess, 0, (int32_t peer, uint32_t flags))                                            \
  X(aclrtDeviceDisablePeerAccess, 0, (int32_t peer))                                                           \
  X(aclrtMallocHost, 0, (void **p, size_t size))                                                               \
  X(aclrtFreeHost, 0, (void *p))                                                                               \
  X(aclrtMemGetAllocationGranularity, 0, (aclrtPhysicalMemProp * prop, int option, size_t *granularity))       \
  X(aclrtReserveMemAddress, 0, (void **va, size_t size, size_t alignment, void *expect, uint64_t flags))       \
  X(aclrtReleaseMemAddress, 0, (void *va))                                                                     \
  X(aclrtMallocPhysical, 0, (aclrtDrvMemHandle * h, size_t size, const aclrtPhysicalMemProp *prop, uint64_t f)) \
  X(aclrtFreePhysical, 0, (aclrtDrvMemHandle h))                                                               \
  X(aclrtMapMem, 0, (void *va, size_t size, size_t offset, aclrtDrvMemHandle h, uint64_t flags))               \
  X(aclrtUnmapMem, 0, (void *va))                                                                              \
  X(aclsysGetCANNVersion, 0, (int name, aclCANNPackageVersion *version))

typedef struct runtime {
  void *handle;
#define DECLARE_ENTRY(name, required, args) aclError(*name) args;
  ACL_ENTRIES(DECLARE_ENTRY)
#undef DECLARE_ENTRY
  const char *(*aclrtGetSocName)(void);
} runtime_t;

#define EVENT_CACHE 256 /* events kept for reuse per device */

typedef struct acl_mapping {
  uintptr_t addr;
  size_t size;
  aclrtDrvMemHandle handle; /* what is mapped there */
} acl_mapping_t;

typedef struct acl_device {
  bool probed;               /* virtual memory probed (at the core's first ask, under vm_lock) */
  bool vm;
  size_t granularity;
  pthread_mutex_t event_lock;
  aclrtEvent events[EVENT_CACHE];
  size_t event_count;
  kept_handles_t refused_events; /* events aclrtDestroyEvent refused: offered again */
  kept_handles_t refused_probes; /* the probe's reservation aclrtReleaseMemAddress refused: offered again */
  /* Events a stream was made to wait on. The runtime forbids destroying or
   * recording again an event while a wait on it is pending (until it
   * completes), so one the core lets go before then (`released`) is reused
   * only once a query finds it complete. */
  struct waited_event {
    aclrtEvent event;
    bool released;
  } *waited;
  size_t waited_count, waited_cap;
  /* The mappings made (aclrtUnmapMem takes one at a time, by its start). */
  pthread_mutex_t vm_lock;
  acl_mapping_t *mappings;
  size_t mapping_count, mapping_cap;
} acl_device_t;

typedef struct acl {
  runtime_t rt;
  char path[512];
  char soc[64];
  char cann[ACL_PKG_VERSION_MAX_SIZE]; /* the CANN package's version, "" where the runtime cannot say */
  int device_count;
  acl_device_t devices[];
} acl_t;

/* ---- errors ------------------------------------------------------------- */

static const struct {
  int code;
  const char *name;
} acl_error_names[] = {
    {100000, "ACL_ERROR_INVALID_PARAM"},        {100001, "ACL_ERROR_UNINITIALIZE"},
    {100002, "ACL_ERROR_REPEAT_INITIALIZE"},    {200000, "ACL_ERROR_BAD_ALLOC"},
    {200001, "ACL_ERROR_API_NOT_SUPPORT"},      {200002, "ACL_ERROR_INVALID_DEVICE"},
    {200006, "ACL_ERROR_FEATURE_UNSUPPORTED"},  {107000, "ACL_ERROR_RT_PARAM_INVALID"},
    {107001, "ACL_ERROR_RT_INVALID_DEVICEID"},  {107002, "ACL_ERROR_RT_CONTEXT_NULL"},
    {207000, "ACL_ERROR_RT_FEATURE_NOT_SUPPORT"}, {207001, "ACL_ERROR_RT_MEMORY_ALLOCATION"},
    {207002, "ACL_ERROR_RT_MEMORY_FREE"},       {207004, "ACL_ERROR_RT_NO_DEVICE"},
    {207018, "ACL_ERROR_RT_DEVICE_OOM"},        {507000, "ACL_ERROR_RT_INTERNAL_ERROR"},
    {507006, "ACL_ERROR_RT_EVENT_NOT_COMPLETE"}, {507053, "ACL_ERROR_RT_DEVICE_MEM_ERROR"},
};

static const char *acl_error_name(aclError r) {
  for (size_t i = 0; i < sizeof acl_error_names / sizeof acl_error_names[0]; i++)
    if (acl_error_names[i].code == r) return acl_error_names[i].name;
  return "an AscendCL error";
}

/* The status for a failed call, with its message. */
GCA_PRINTF(3, 4) static int acl_error(aclError r, int invalid_status, const char *fmt, ...) {
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  int status = r == ACL_ERROR_RT_MEMORY_ALLOCATION || r == ACL_ERROR_RT_DEVICE_OOM ? GCA_ERR_OOM
               : r == ACL_ERROR_INVALID_PARAM || r == ACL_ERROR_RT_PARAM_INVALID  ? invalid_status
                                                                                  : GCA_ERR_BACKEND;
  return gca__set_error(status, "acl backend: %s failed: %s (%d)", what, acl_error_name(r), r);
}

#define ACL_CHECK(call, invalid, ...)                              \
  do {                                                         \
    aclError r_ = (call);                                      \
    if (r_ != ACL_SUCCESS) return acl_error(r_, invalid, __VA_ARGS__); \
  } while (0)

/* The thread's device before a call (-1: none), and whether the call
 * switched it. */
typedef struct acl_guard {
  int32_t saved;
  bool switched;
} acl_guard_t;

/* Make `device` current on this thread (AscendCL's current device is per
 * thread, and a thread that never set one has none), remembering the
 * thread's own for acl_leave. ANY_DEVICE: the thread's, else device 0 (for
 * calls that need some context, as host memory does). */
#define ANY_DEVICE (-1)
static int acl_enter(acl_t *a, int device, acl_guard_t *g) {
  int32_t cur = -1;
  g->saved = -1;
  g->switched = false;
  if (a->rt.aclrtGetDevice(&cur) == ACL_SUCCESS) {
    g->saved = cur;
    if (cur == device || device == ANY_DEVICE) return GCA_OK;
  }
  if (device == ANY_DEVICE) device = 0;
  ACL_CHECK(a->rt.aclrtSetDevice(device), GCA_ERR_BACKEND, "aclrtSetDevice (device %d)", device);
  g->switched = true;
  return GCA_OK;
}

/* Put the thread's device back (the gcalloc error of the call is kept). */
static void acl_leave(acl_t *a, const acl_guard_t *g) {
  if (g->switched && g->saved >= 0) (void)a->rt.aclrtSetDevice(g->saved);
}

/* Run `call` (a gcalloc status) with `device` current, and return its status. */
#define ON_DEVICE(a, device, call)              \
  do {                                          \
    acl_guard_t guard_;                         \
    int rc_ = acl_enter((a), (device), &guard_); \
    if (rc_ == GCA_OK) {                        \
      rc_ = (call);                             \
      acl_leave((a), &guard_);                  \
    }                                           \
    return rc_;                                 \
  } while (0)

static int acl_missing(const char *entry) {
  return gca__set_error(GCA_ERR_BACKEND, "acl backend: the AscendCL runtime has no %s", entry);
}

/* ---- the backend operations -------------------------------------------- */

static int acl_device_count(void *state) { return ((acl_t *)state)->device_count; }

static int acl_malloc_here(acl_t *a, int device, size_t size, uintptr_t *addr) {
  void *p = NULL;
  if (a->rt.aclrtMallocAlign32)
    ACL_CHECK(a->rt.aclrtMallocAlign32(&p, size, ACL_MEM_MALLOC_HUGE_FIRST), GCA_ERR_INVALID,
          "aclrtMallocAlign32 (%zu bytes, device %d)", size, device);
  else
    ACL_CHECK(a->rt.aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST), GCA_ERR_INVALID, "aclrtMalloc (%zu bytes, device %d)",
          size, device);
  *addr = (uintptr_t)p;
  return GCA_OK;
}

static int acl_malloc(void *state, int device, size_t size, uintptr_t *addr) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_malloc_here(a, device, size, addr));
}

static int acl_free_here(acl_t *a, int device, uintptr_t addr, size_t size) {
  /* Any refusal, invalid parameters too, leaves the memory the runtime's
   * as far as anyone can tell: the core keeps the segment, to offer again. */
  ACL_CHECK(a->rt.aclrtFree((void *)addr), GCA_ERR_BACKEND, "aclrtFree (0x%" PRIxPTR ", %zu bytes, device %d)", addr,
        size, device);
  return GCA_OK;
}

static int acl_free(void *state, int device, uintptr_t addr, size_t size) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_free_here(a, device, addr, size));
}

static int acl_mem_get_info_here(acl_t *a, int device, size_t *free_bytes, size_t *total_bytes) {
  ACL_CHECK(a->rt.aclrtGetMemInfo(ACL_HBM_MEM, free_bytes, total_bytes), GCA_ERR_BACKEND,
        "aclrtGetMemInfo (ACL_HBM_MEM, device %d)", device);
  return GCA_OK;
}

static int acl_mem_get_info(void *state, int device, size_t *free_bytes, size_t *total_bytes) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_mem_get_info_here(a, device, free_bytes, total_bytes));
}

/* An event the core may query and may make another stream wait on: the
 * runtime refuses aclrtStreamWaitEvent on an event without ACL_EVENT_SYNC
 * (207000), and queries need ACL_EVENT_CAPTURE_STREAM_PROGRESS, the flag
 * torch_npu's allocator gives its events. (aclrtCreateEvent's events have
 * both.) */
#define EVENT_FLAGS (ACL_EVENT_SYNC | ACL_EVENT_CAPTURE_STREAM_PROGRESS)
static int acl_create_event(acl_t *a, int device, aclrtEvent *e) {
  if (a->rt.aclrtCreateEventWithFlag)
    ACL_CHECK(a->rt.aclrtCreateEventWithFlag(e, EVENT_FLAGS), GCA_ERR_BACKEND,
          "aclrtCreateEventWithFlag (ACL_EVENT_SYNC | ACL_EVENT_CAPTURE_STREAM_PROGRESS, device %d)", device);
  else
    ACL_CHECK(a->rt.aclrtCreateEvent(e), GCA_ERR_BACKEND, "aclrtCreateEvent (device %d)", device);
  return GCA_OK;
}

#define ACL_EVENTS "acl backend: events"

static int acl_destroy_one_event(void *ctx, uintptr_t e) { return ((acl_t *)ctx)->rt.aclrtDestroyEvent((aclrtEvent)e); }

/* Destroy e (the device current), and offer again the ones refused before;
 * one refused now is kept for the next time. */
static void acl_event_drop(acl_t *a, int device, aclrtEvent e) {
  acl_device_t *d = &a->devices[device];
  mutex_lock(&d->event_lock, RANK_BACKEND_EVENTS);
  gca__kept_handles_destroy(&d->refused_events, acl_destroy_one_event, a, (uintptr_t)e, ACL_EVENTS);
  mutex_unlock(&d->event_lock);
}

static bool acl_event_complete(acl_t *a, aclrtEvent e);

/* Put an event the core let go into the free list (or destroy it when the
 * list is full). With event_lock held and the device current. */
static void acl_event_recycle(acl_t *a, acl_device_t *d, aclrtEvent e) {
  if (d->event_count < EVENT_CACHE) d->events[d->event_count++] = e;
  else gca__kept_handles_destroy(&d->refused_events, acl_destroy_one_event, a, (uintptr_t)e, ACL_EVENTS);
}

/* Recycle the waited events let go whose waits are over. With event_lock
 * held and the device current. */
static void acl_events_sweep(acl_t *a, acl_device_t *d) {
  size_t kept = 0;
  for (size_t i = 0; i < d->waited_count; i++) {
    struct waited_event w = d->waited[i];
    if (w.released && acl_event_complete(a, w.event)) acl_event_recycle(a, d, w.event);
    else d->waited[kept++] = w;
  }
  d->waited_count = kept;
}

static int acl_event_record_here(acl_t *a, int device, gca_stream_t stream, uintptr_t *event) {
  acl_device_t *d = &a->devices[device];
  aclrtEvent e = NULL;
  mutex_lock(&d->event_lock, RANK_BACKEND_EVENTS);
  if (d->waited_count) acl_events_sweep(a, d);
  if (d->event_count) e = d->events[--d->event_count];
  mutex_unlock(&d->event_lock);
  int rc;
  if (!e && (rc = acl_create_event(a, device, &e)) != GCA_OK) return rc;
  aclError r = a->rt.aclrtRecordEvent(e, (aclrtStream)stream);
  if (r != ACL_SUCCESS) {
    acl_event_drop(a, device, e);
    return acl_error(r, GCA_ERR_INVALID, "aclrtRecordEvent (stream 0x%" PRIxPTR ", device %d)", stream, device);
  }
  *event = (uintptr_t)e;
  return GCA_OK;
}

static int acl_event_record(void *state, int device, gca_stream_t stream, uintptr_t *event) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_event_record_here(a, device, stream, event));
}

/* The two query forms answer in enums with opposite values. */
static int acl_event_query_here(acl_t *a, int device, uintptr_t event) {
  int status = -1;
  if (a->rt.aclrtQueryEventStatus) {
    ACL_CHECK(a->rt.aclrtQueryEventStatus((aclrtEvent)event, &status), GCA_ERR_INVALID,
          "aclrtQueryEventStatus (device %d)", device);
    return status == ACL_EVENT_RECORDED_STATUS_COMPLETE ? GCA_OK : BACKEND_NOT_READY;
  }
  ACL_CHECK(a->rt.aclrtQueryEvent((aclrtEvent)event, &status), GCA_ERR_INVALID, "aclrtQueryEvent (device %d)", device);
  return status == ACL_EVENT_STATUS_COMPLETE ? GCA_OK : BACKEND_NOT_READY;
}

static bool acl_event_complete(acl_t *a, aclrtEvent e) {
  int rc = acl_event_query_here(a, -1, (uintptr_t)e);
  if (rc < 0) gca__clear_error();
  return rc == GCA_OK;
}

static int acl_event_query(void *state, int device, uintptr_t event) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_event_query_here(a, device, event));
}

static int acl_event_synchronize_here(acl_t *a, int device, uintptr_t event) {
  ACL_CHECK(a->rt.aclrtSynchronizeEvent((aclrtEvent)event), GCA_ERR_INVALID, "aclrtSynchronizeEvent (device %d)", device);
  return GCA_OK;
}

static int acl_event_synchronize(void *state, int device, uintptr_t event) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_event_synchronize_here(a, device, event));
}

/* The waited entry of e, or NULL. With event_lock held. */
static struct waited_event *acl_waited(acl_device_t *d, aclrtEvent e) {
  for (size_t i = 0; i < d->waited_count; i++)
    if (d->waited[i].event == e) return &d->waited[i];
  return NULL;
}

static void acl_event_destroy(void *state, int device, uintptr_t event) {
  acl_t *a = state;
  acl_device_t *d = &a->devices[device];
  aclrtEvent e = (aclrtEvent)event;
  mutex_lock(&d->event_lock, RANK_BACKEND_EVENTS);
  bool easy = !(d->waited_count && acl_waited(d, e)) && d->event_count < EVENT_CACHE;
  if (easy) d->events[d->event_count++] = e;
  mutex_unlock(&d->event_lock);
  acl_guard_t g;
  if (easy || acl_enter(a, device, &g) != GCA_OK) return;
  mutex_lock(&d->event_lock, RANK_BACKEND_EVENTS);
  /* (looked up again: the list may have moved while the lock was not held) */
  struct waited_event *w = d->waited_count ? acl_waited(d, e) : NULL;
  if (w) {
    w->released = true; /* (recycled by the sweep once its waits are over) */
    acl_events_sweep(a, d);
  } else {
    acl_event_recycle(a, d, e);
  }
  mutex_unlock(&d->event_lock);
  acl_leave(a, &g);
}

static int acl_stream_wait_event_here(acl_t *a, int device, gca_stream_t stream, uintptr_t event) {
  acl_device_t *d = &a->devices[device];
  mutex_lock(&d->event_lock, RANK_BACKEND_EVENTS);
  bool known = acl_waited(d, (aclrtEvent)event) != NULL;
  if (!known && d->waited_count == d->waited_cap) {
    struct waited_event *grown = gca__grow_array(d->waited, &d->waited_cap, sizeof *grown, 16);
    if (!grown) {
      mutex_unlock(&d->event_lock);
      return gca__set_error(GCA_ERR_NOMEM, "acl backend: out of host memory recording a stream wait");
    }
    d->waited = grown;
  }
  aclError r = a->rt.aclrtStreamWaitEvent((aclrtStream)stream, (aclrtEvent)event);
  if (r == ACL_SUCCESS && !known) d->waited[d->waited_count++] = (struct waited_event){(aclrtEvent)event, false};
  mutex_unlock(&d->event_lock);
  if (r != ACL_SUCCESS)
    return acl_error(r, GCA_ERR_INVALID, "aclrtStreamWaitEvent (stream 0x%" PRIxPTR ", device %d)", stream, device);
  return GCA_OK;
}

static int acl_device_synchronize_here(acl_t *a, int device) {
  ACL_CHECK(a->rt.aclrtSynchronizeDevice(), GCA_ERR_BACKEND, "aclrtSynchronizeDevice (device %d)", device);
  return GCA_OK;
}

static int acl_device_synchronize(void *state, int device) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_device_synchronize_here(a, device));
}

static int acl_stream_wait_event(void *state, int device, gca_stream_t stream, uintptr_t event) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_stream_wait_event_here(a, device, stream, event));
}

static int acl_stream_synchronize_here(acl_t *a, int device, gca_stream_t stream) {
  ACL_CHECK(a->rt.aclrtSynchronizeStream((aclrtStream)stream), GCA_ERR_INVALID,
        "aclrtSynchronizeStream (stream 0x%" PRIxPTR ", device %d)", stream, device);
  return GCA_OK;
}

static int acl_stream_synchronize(void *state, int device, gca_stream_t stream) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_stream_synchronize_here(a, device, stream));
}

/* ---- virtual memory ----------------------------------------------------- */

static aclrtPhysicalMemProp acl_device_memory(int device) {
  aclrtPhysicalMemProp prop;
  memset(&prop, 0, sizeof prop);
  prop.memAttr = ACL_HBM_MEM_HUGE;
  prop.location.id = (uint32_t)device;
  prop.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
  return prop;
}

static int acl_no_vm(int device) {
  return gca__set_error(GCA_ERR_BACKEND, "acl backend: device %d has no virtual memory", device);
}

#define ACL_PROBES "acl backend: the virtual-memory probe's reservations"

static int acl_release_one_probe(void *ctx, uintptr_t va) {
  return ((acl_t *)ctx)->rt.aclrtReleaseMemAddress((void *)va);
}

/* Virtual memory as torch_npu probes it: every entry point, a granularity,
 * and a 512-byte reservation that succeeds (and is given back); with the
 * device current, restored after. A release refused is kept and offered
 * again at every release of a reservation and at close, where one still
 * refused is logged, as refused event destroys are (the probe's answer
 * stands: the reservation succeeded). */
static void acl_probe_vm(acl_t *a, int device) {
  acl_device_t *d = &a->devices[device];
  const runtime_t *rt = &a->rt;
  if (!rt->aclrtMemGetAllocationGranularity || !rt->aclrtReserveMemAddress || !rt->aclrtReleaseMemAddress ||
      !rt->aclrtMallocPhysical || !rt->aclrtFreePhysical || !rt->aclrtMapMem || !rt->aclrtUnmapMem)
    return;
  aclrtPhysicalMemProp prop = acl_device_memory(device);
  size_t g = 0;
  void *probe = NULL;
  acl_guard_t guard;
  if (acl_enter(a, device, &guard) != GCA_OK) {
    gca__clear_error();
    return;
  }
  if (rt->aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &g) == ACL_SUCCESS && g &&
      rt->aclrtReserveMemAddress(&probe, 512, 0, NULL, ACL_RESERVE_HUGE_PAGE) == ACL_SUCCESS) {
    if (rt->aclrtReleaseMemAddress(probe) != ACL_SUCCESS)
      (void)gca__kept_handles_add(&d->refused_probes, (uintptr_t)probe, ACL_PROBES);
    d->granularity = g;
    d->vm = true;
  }
  acl_leave(a, &guard);
}

/* The core asks this first, once per device, before any other virtual
 * memory call there: the probe runs then, not at open. */
static int acl_vm_granularity(void *state, int device, size_t *granularity) {
  acl_t *a = state;
  acl_device_t *d = &a->devices[device];
  mutex_lock(&d->vm_lock, RANK_BACKEND);
  if (!d->probed) {
    acl_probe_vm(a, device);
    d->probed = true;
  }
  mutex_unlock(&d->vm_lock);
  if (!d->vm) return acl_no_vm(device);
  *granularity = d->granularity;
  return GCA_OK;
}

static int acl_vm_reserve_here(acl_t *a, int device, size_t size, uintptr_t *addr) {
  void *va = NULL;
  ACL_CHECK(a->rt.aclrtReserveMemAddress(&va, size, 0, NULL, ACL_RESERVE_HUGE_PAGE), GCA_ERR_INVALID,
        "aclrtReserveMemAddress (%zu bytes, device %d)", size, device);
  *addr = (uintptr_t)va;
  return GCA_OK;
}

static int acl_vm_reserve(void *state, int device, size_t size, uintptr_t *addr) {
  acl_t *a = state;
  if (!a->devices[device].vm) return acl_no_vm(device);
  ON_DEVICE(a, device, acl_vm_reserve_here(a, device, size, addr));
}

static int acl_vm_unreserve_here(acl_t *a, int device, uintptr_t addr, size_t size) {
  acl_device_t *d = &a->devices[device];
  mutex_lock(&d->vm_lock, RANK_BACKEND);
  gca__kept_handles_retry(&d->refused_probes, acl_release_one_probe, a, false, ACL_PROBES);
  mutex_unlock(&d->vm_lock);
  ACL_CHECK(a->rt.aclrtReleaseMemAddress((void *)addr), GCA_ERR_INVALID,
        "aclrtReleaseMemAddress (0x%" PRIxPTR ", %zu bytes, device %d)", addr, size, device);
  return GCA_OK;
}

static int acl_vm_unreserve(void *state, int device, uintptr_t addr, size_t size) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_vm_unreserve_here(a, device, addr, size));
}

static int acl_vm_create_here(acl_t *a, int device, size_t size, uintptr_t *handle) {
  aclrtPhysicalMemProp prop = acl_device_memory(device);
  aclrtDrvMemHandle h = NULL;
  ACL_CHECK(a->rt.aclrtMallocPhysical(&h, size, &prop, 0), GCA_ERR_INVALID, "aclrtMallocPhysical (%zu bytes, device %d)",
        size, device);
  *handle = (uintptr_t)h;
  return GCA_OK;
}

static int acl_vm_create(void *state, int device, size_t size, uintptr_t *handle) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_vm_create_here(a, device, size, handle));
}

static int acl_vm_destroy_here(acl_t *a, int device, uintptr_t handle) {
  ACL_CHECK(a->rt.aclrtFreePhysical((aclrtDrvMemHandle)handle), GCA_ERR_INVALID, "aclrtFreePhysical (device %d)", device);
  return GCA_OK;
}

static int acl_vm_destroy(void *state, int device, uintptr_t handle) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_vm_destroy_here(a, device, handle));
}

static int acl_vm_map_here(acl_t *a, int device, uintptr_t addr, size_t size, uintptr_t handle) {
  acl_device_t *d = &a->devices[device];
  mutex_lock(&d->vm_lock, RANK_BACKEND);
  if (d->mapping_count == d->mapping_cap) {
    acl_mapping_t *grown = gca__grow_array(d->mappings, &d->mapping_cap, sizeof *grown, 64);
    if (!grown) {
      mutex_unlock(&d->vm_lock);
      return gca__set_error(GCA_ERR_NOMEM, "acl backend: out of host memory recording a mapping");
    }
    d->mappings = grown;
  }
  aclError r = a->rt.aclrtMapMem((void *)addr, size, 0, (aclrtDrvMemHandle)handle, 0);
  if (r == ACL_SUCCESS) d->mappings[d->mapping_count++] = (acl_mapping_t){addr, size, (aclrtDrvMemHandle)handle};
  mutex_unlock(&d->vm_lock);
  if (r != ACL_SUCCESS)
    return acl_error(r, GCA_ERR_INVALID, "aclrtMapMem (0x%" PRIxPTR ", %zu bytes, device %d)", addr, size, device);
  return GCA_OK;
}

static int acl_vm_map(void *state, int device, uintptr_t addr, size_t size, uintptr_t handle) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_vm_map_here(a, device, addr, size, handle));
}

/* [addr, addr + size) is whole mappings, maybe several: aclrtUnmapMem
 * takes one at a time, by its start. All or none: on a refusal the ones
 * unmapped by this call are mapped again, so the caller's pages are as
 * they were. */
static int acl_vm_unmap_here(acl_t *a, int device, uintptr_t addr, size_t size) {
  acl_device_t *d = &a->devices[device];
  mutex_lock(&d->vm_lock, RANK_BACKEND);
  acl_mapping_t *undone = malloc((d->mapping_count + 1) * sizeof *undone);
  if (!undone) {
    mutex_unlock(&d->vm_lock);
    return gca__set_error(GCA_ERR_NOMEM, "acl backend: out of host memory unmapping");
  }
  size_t kept = 0, done = 0, found = 0;
  aclError r = ACL_SUCCESS;
  uintptr_t failed_at = 0;
  for (size_t i = 0; i < d->mapping_count; i++) {
    acl_mapping_t m = d->mappings[i];
    if (r == ACL_SUCCESS && m.addr >= addr && m.addr < addr + size) {
      found += m.size;
      r = a->rt.aclrtUnmapMem((void *)m.addr);
      if (r == ACL_SUCCESS) {
        undone[done++] = m;
        continue;
      }
      failed_at = m.addr;
    }
    d->mappings[kept++] = m;
  }
  for (size_t k = 0; r != ACL_SUCCESS && k < done; k++) /* put back what this call unmapped */
    if (a->rt.aclrtMapMem((void *)undone[k].addr, undone[k].size, 0, undone[k].handle, 0) == ACL_SUCCESS)
      d->mappings[kept++] = undone[k];
  free(undone);
  d->mapping_count = kept;
  mutex_unlock(&d->vm_lock);
  if (r != ACL_SUCCESS)
    return acl_error(r, GCA_ERR_INVALID, "aclrtUnmapMem (0x%" PRIxPTR ", one of the mappings in %zu bytes at 0x%" PRIxPTR
                     ", device %d)", failed_at, size, addr, device);
  if (found != size)
    return gca__set_error(GCA_ERR_INVALID, "acl backend: unmap of %zu bytes at 0x%" PRIxPTR " on device %d: %zu of them "
                          "were mapped", size, addr, device, found);
  return GCA_OK;
}

static int acl_vm_unmap(void *state, int device, uintptr_t addr, size_t size) {
  acl_t *a = state;
  ON_DEVICE(a, device, acl_vm_unmap_here(a, device, addr, size));
}

/* ---- device facts, peers, host memory, sizing -------------------------- */

static int acl_device_properties(void *state, int device, gca_device_properties_t *out) {
  acl_t *a = state;
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "%s", a->soc[0] ? a->soc : "Ascend NPU");
  size_t free_bytes = 0, total = 0;
  int rc = acl_mem_get_info(state, device, &free_bytes, &total);
  if (rc) return rc;
  out->total_memory = total;
  return GCA_OK;
}

static int acl_can_access_peer(void *state, int device, int peer, int *can) {
  acl_t *a = state;
  if (!a->rt.aclrtDeviceCanAccessPeer) return acl_missing("aclrtDeviceCanAccessPeer");
  int32_t c = 0;
  ACL_CHECK(a->rt.aclrtDeviceCanAccessPeer(&c, device, peer), GCA_ERR_INVALID,
        "aclrtDeviceCanAccessPeer (device %d, peer %d)", device, peer);
  *can = c != 0;
  return GCA_OK;
}

/* AscendCL enables access from the current device: made current first. */
static int acl_enable_peer_access_here(acl_t *a, int device, int peer) {
  ACL_CHECK(a->rt.aclrtDeviceEnablePeerAccess(peer, 0), GCA_ERR_INVALID, "aclrtDeviceEnablePeerAccess (device %d, peer %d)",
        device, peer);
  return GCA_OK;
}

static int acl_enable_peer_access(void *state, int device, int peer) {
  acl_t *a = state;
  if (!a->rt.aclrtDeviceEnablePeerAccess) return acl_missing("aclrtDeviceEnablePeerAccess");
  ON_DEVICE(a, device, acl_enable_peer_access_here(a, device, peer));
}

static int acl_disable_peer_access_here(acl_t *a, int device, int peer) {
  ACL_CHECK(a->rt.aclrtDeviceDisablePeerAccess(peer), GCA_ERR_INVALID, "aclrtDeviceDisablePeerAccess (device %d, peer %d)",
        device, peer);
  return GCA_OK;
}

static int acl_disable_peer_access(void *state, int device, int peer) {
  acl_t *a = state;
  if (!a->rt.aclrtDeviceDisablePeerAccess) return acl_missing("aclrtDeviceDisablePeerAccess");
  ON_DEVICE(a, device, acl_disable_peer_access_here(a, device, peer));
}

/* Pinned host memory needs a current context (CANN's aclrtMallocHost and
 * aclrtFreeHost fail with ACL_ERROR_RT_CONTEXT_NULL without one): the
 * thread's device where it has one, else device 0 for the call. */
static int acl_host_alloc_here(acl_t *a, size_t size, void **ptr) {
  ACL_CHECK(a->rt.aclrtMallocHost(ptr, size), GCA_ERR_INVALID, "aclrtMallocHost (%zu bytes)", size);
  return GCA_OK;
}

static int acl_host_alloc(void *state, size_t size, void **ptr) {
  acl_t *a = state;
  if (!a->rt.aclrtMallocHost) return acl_missing("aclrtMallocHost");
  ON_DEVICE(a, ANY_DEVICE, acl_host_alloc_here(a, size, ptr));
}

static int acl_host_free_here(acl_t *a, void *ptr) {
  ACL_CHECK(a->rt.aclrtFreeHost(ptr), GCA_ERR_BAD_POINTER, "aclrtFreeHost (%p)", ptr);
  return GCA_OK;
}

static int acl_host_free(void *state, void *ptr) {
  acl_t *a = state;
  if (!a->rt.aclrtFreeHost) return acl_missing("aclrtFreeHost");
  ON_DEVICE(a, ANY_DEVICE, acl_host_free_here(a, ptr));
}

/* Whether a CANN version reads as 9.1.0 or later, as torch_npu compares
 * versions of 9 and up (GetCANNInfo.cpp: MAJOR.MINOR.PATCH, then an
 * optional alpha, beta or rc, numbered or not, which comes before the
 * release). A version torch_npu cannot read, or one before 9, is not. */
static bool cann_at_least_9_1(const char *version) {
  char copy[ACL_PKG_VERSION_MAX_SIZE];
  snprintf(copy, sizeof copy, "%s", version);
  char *tok[6], *save = NULL;
  int n = 0;
  for (char *t = strtok_r(copy, ".-", &save); t && n < 6; t = strtok_r(NULL, ".-", &save)) tok[n++] = t;
  if (n < 3 || n > 5) return false;
  long part[3];
  for (int i = 0; i < 3; i++) {
    char *end = NULL;
    part[i] = strtol(tok[i], &end, 10);
    if (end == tok[i] || *end || part[i] < 0) return false;
  }
  if (part[0] < 9) return false;
  long weight = 0, pre = 0;
  if (n >= 4) {
    static const struct { const char *name; long weight; } kinds[] = {{"alpha", 300}, {"beta", 200}, {"rc", 100}};
    size_t k = 0, len = 0;
    for (; k < 3; k++)
      if (strncmp(tok[3], kinds[k].name, len = strlen(kinds[k].name)) == 0) break;
    if (k == 3) return false;
    weight = kinds[k].weight;
    const char *num = n == 5 ? tok[4] : tok[3] + len;
    if (n == 5 && tok[3][len]) return false;
    if (*num) {
      char *end = NULL;
      pre = strtol(num, &end, 10);
      if (*end || pre < 0) return false;
    }
  }
  long long v = part[0] * 10000000LL + part[1] * 100000LL + part[2] * 1000LL - weight + pre;
  return v >= 9 * 10000000LL + 1 * 100000LL;
}

/* torch_npu pads every request by 32 bytes before rounding, but on
 * Ascend950 and later SoCs with CANN 9.1.0 or later (AddPadSize in
 * NPUCachingAllocator.cpp): decided here from the SoC name (a name without
 * a number, or no name at all, is taken as an earlier SoC) and the CANN
 * package's version (aclsysGetCANNVersion; none: an earlier CANN). */
static int acl_size_pad(void *state, int device, size_t *pad) {
  (void)device;
  acl_t *a = state;
  *pad = 32;
  if (strncmp(a->soc, "Ascend", 6) == 0) {
    char *end = NULL;
    long model = strtol(a->soc + 6, &end, 10);
    if (end != a->soc + 6 && model >= 950 && cann_at_least_9_1(a->cann)) *pad = 0;
  }
  return GCA_OK;
}

/* AscendCL offers no device UUID among the calls used here: the SoC name and
 * the device's index, which ASCEND_RT_VISIBLE_DEVICES changes (processes
 * that cooperate must see the NPUs alike; docs/acl.md). */
static int acl_device_identity(void *state, int device, char *out, size_t cap) {
  acl_t *a = state;
  snprintf(out, cap, "acl:%s:%d", a->soc[0] ? a->soc : "npu", device);
  return GCA_OK;
}

/* ---- opening and closing ------------------------------------------------ */

/* This process's state alone, with no runtime call: a child of fork's
 * (backend.h), and the end of acl_destroy. */
static void acl_forget(void *state) {
  acl_t *a = state;
  if (!a) return;
  for (int i = 0; i < a->device_count; i++) {
    acl_device_t *d = &a->devices[i];
    free(d->refused_events.items);
    free(d->refused_probes.items);
    pthread_mutex_destroy(&d->event_lock);
    pthread_mutex_destroy(&d->vm_lock);
    free(d->mappings);
    free(d->waited);
  }
  free(a);
}

static void acl_destroy(void *state) {
  acl_t *a = state;
  if (!a) return;
  for (int i = 0; i < a->device_count; i++) {
    acl_device_t *d = &a->devices[i];
    acl_guard_t g;
    if ((d->event_count || d->refused_events.count || d->waited_count) && acl_enter(a, i, &g) == GCA_OK) {
      for (size_t k = 0; k < d->waited_count; k++) /* (a wait still pending ends first) */
        if (d->waited[k].released) {
          (void)a->rt.aclrtSynchronizeEvent(d->waited[k].event);
          gca__kept_handles_destroy(&d->refused_events, acl_destroy_one_event, a, (uintptr_t)d->waited[k].event,
                                    ACL_EVENTS);
        }
      for (size_t k = 0; k < d->event_count; k++)
        gca__kept_handles_destroy(&d->refused_events, acl_destroy_one_event, a, (uintptr_t)d->events[k], ACL_EVENTS);
      gca__kept_handles_retry(&d->refused_events, acl_destroy_one_event, a, false, ACL_EVENTS);
      acl_leave(a, &g);
    }
    gca__kept_handles_retry(&d->refused_events, acl_destroy_one_event, a, true, ACL_EVENTS);
    gca__kept_handles_retry(&d->refused_probes, acl_release_one_probe, a, true, ACL_PROBES);
  }
  /* Neither aclFinalize nor aclrtResetDevice: the framework beside us may
   * still use the runtime. */
  if (a->rt.handle) dlclose(a->rt.handle);
  acl_forget(a);
}

static const backend_ops_t acl_ops = {
    .name = "acl",
    .device_count = acl_device_count,
    .malloc = acl_malloc,
    .free = acl_free,
    .mem_get_info = acl_mem_get_info,
    .event_record = acl_event_record,
    .event_query = acl_event_query,
    .event_synchronize = acl_event_synchronize,
    .event_destroy = acl_event_destroy,
    .stream_wait_event = acl_stream_wait_event,
    .stream_synchronize = acl_stream_synchronize,
    .device_synchronize = acl_device_synchronize,
    .vm_granularity = acl_vm_granularity,
    .vm_reserve = acl_vm_reserve,
    .vm_unreserve = acl_vm_unreserve,
    .vm_create = acl_vm_create,
    .vm_destroy = acl_vm_destroy,
    .vm_map = acl_vm_map,
    .vm_unmap = acl_vm_unmap,
    .device_properties = acl_device_properties,
    .can_access_peer = acl_can_access_peer,
    .enable_peer_access = acl_enable_peer_access,
    .disable_peer_access = acl_disable_peer_access,
    .host_alloc = acl_host_alloc,
    .host_free = acl_host_free,
    .size_pad = acl_size_pad,
    .device_identity = acl_device_identity,
    .destroy = acl_destroy,
    .forget = acl_forget,
    .base_align = 16384, /* torch_npu's kAlignRoundLarge */
};

static int acl_load_runtime(const char *path, runtime_t *rt) {
  dlerror();
  rt->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!rt->handle) {
    const char *why = dlerror();
    return gca__set_error(GCA_ERR_BACKEND, "acl backend: no AscendCL runtime: cannot load %s (%s)", path,
                          why ? why : "unknown reason");
  }
#define LOOK_UP(name, required, args)                                                                            \
  *(void **)&rt->name = dlsym(rt->handle, #name);                                                                \
  if (required && !rt->name)                                                                                     \
    return gca__set_error(GCA_ERR_BACKEND, "acl backend: %s has no %s (too old, or not AscendCL's runtime)", path, \
                          #name);
  ACL_ENTRIES(LOOK_UP)
#undef LOOK_UP
  *(void **)&rt->aclrtGetSocName = dlsym(rt->handle, "aclrtGetSocName");
  if (!rt->aclrtQueryEventStatus && !rt->aclrtQueryEvent)
    return gca__set_error(GCA_ERR_BACKEND, "acl backend: %s has neither aclrtQueryEventStatus nor aclrtQueryEvent", path);
  return GCA_OK;
}


/* aclInit once per process: a framework that initializes after us gets
 * ACL_ERROR_REPEAT_INITIALIZE and its configuration file is not read, so
 * the drop-in opens gcalloc at the first allocation, after torch_npu's own
 * aclInit (docs/acl.md). REPEAT_INITIALIZE here means a framework was first. */
static pthread_mutex_t acl_init_lock = PTHREAD_MUTEX_INITIALIZER;
static void *acl_initialized; /* the runtime's handle once initialized */

static aclError acl_init_once(const runtime_t *rt) {
  mutex_lock(&acl_init_lock, RANK_BACKEND_CONTEXT);
  aclError r = ACL_SUCCESS;
  if (acl_initialized != rt->handle) {
    r = rt->aclInit(NULL);
    if (r == ACL_ERROR_REPEAT_INITIALIZE) r = ACL_SUCCESS;
    if (r == ACL_SUCCESS) acl_initialized = rt->handle;
  }
  mutex_unlock(&acl_init_lock);
  return r;
}

int gca__acl_backend_create(const char *options, backend_t *out) {
  char path[512];
  int rc = gca__backend_library_path("acl", options, "library", "GCALLOC_ACL_LIBRARY", "libascendcl.so", path,
                                     sizeof path);
  if (rc) return rc;

  runtime_t rt;
  memset(&rt, 0, sizeof rt);
  rc = acl_load_runtime(path, &rt);
  if (rc) {
    if (rt.handle) dlclose(rt.handle);
    return rc;
  }
  aclError r = acl_init_once(&rt);
  uint32_t count = 0;
  if (r == ACL_SUCCESS && (r = rt.aclrtGetDeviceCount(&count)) == ACL_ERROR_UNINITIALIZE) {
    /* (the runtime was unloaded and loaded again since it was initialized) */
    if ((r = rt.aclInit(NULL)) == ACL_SUCCESS) r = rt.aclrtGetDeviceCount(&count);
  }
  if (r != ACL_SUCCESS)
    rc = acl_error(r, GCA_ERR_BACKEND, "aclInit/aclrtGetDeviceCount (runtime %s)", path);
  else if (count == 0 || count > 1024)
    rc = gca__set_error(GCA_ERR_BACKEND, "acl backend: the runtime %s sees %s", path,
                        count ? "more than 1024 devices" : "no NPU");
  if (rc) {
    dlclose(rt.handle);
    return rc;
  }
  acl_t *a = calloc(1, sizeof *a + (size_t)count * sizeof a->devices[0]);
  if (!a) {
    dlclose(rt.handle);
    return gca__set_error(GCA_ERR_NOMEM, "acl backend: out of host memory");
  }
  a->rt = rt;
  snprintf(a->path, sizeof a->path, "%s", path);
  const char *soc = rt.aclrtGetSocName ? rt.aclrtGetSocName() : NULL;
  snprintf(a->soc, sizeof a->soc, "%s", soc ? soc : "");
  aclCANNPackageVersion cann;
  memset(&cann, 0, sizeof cann);
  if (rt.aclsysGetCANNVersion && rt.aclsysGetCANNVersion(ACL_PKG_NAME_CANN, &cann) == ACL_SUCCESS)
    snprintf(a->cann, sizeof a->cann, "%.*s", (int)sizeof cann.version, cann.version);
  for (uint32_t i = 0; i < count; i++) {
    acl_device_t *d = &a->devices[i];
    pthread_mutex_init(&d->event_lock, NULL);
    pthread_mutex_init(&d->vm_lock, NULL);
    a->device_count = (int)i + 1;
  }
  out->ops = &acl_ops;
  out->state = a;
  return GCA_OK;
}
