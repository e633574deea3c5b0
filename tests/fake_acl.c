/* A stand-in for AscendCL's runtime (libascendcl.so): the entry points
 * gcalloc's acl backend loads (src/backends/acl.c), on host memory, so CI
 * exercises the whole backend without an NPU. Loaded through
 * GCALLOC_ACL_LIBRARY or "acl:library=PATH"; a test that dlopens the same
 * file gets the same copy and drives it with the fakeacl_* functions.
 * Built twice: whole, and with FAKEACL_MINIMAL, without the entry points
 * that torch_npu treats as optional (aclrtMallocAlign32,
 * aclrtQueryEventStatus, aclrtCreateEventWithFlag, aclrtGetSocName, peer
 * access, host memory, virtual memory), as an older CANN has them.
 *
 * Each semantic names where it comes from: [rt] CANN's acl_rt.h and
 * acl_base.h (calls, types, enumerations, error codes), [npu] torch_npu's
 * NPUCachingAllocator.cpp and AclInterface.cpp (how a framework uses them).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create */
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fake_plumbing.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8
#define MAX_ITEMS 65536
#define GRANULARITY ((size_t)2 << 20) /* [rt] aclrtMemGetAllocationGranularity: 2 MiB */

/* [rt] acl_base.h and rt_error_codes.h. */
enum {
  ACL_SUCCESS = 0,
  ACL_ERROR_INVALID_PARAM = 100000,
  ACL_ERROR_UNINITIALIZE = 100001,
  ACL_ERROR_REPEAT_INITIALIZE = 100002,
  ACL_ERROR_INVALID_FILE = 100003,
  ACL_ERROR_RT_PARAM_INVALID = 107000,
  ACL_ERROR_RT_INVALID_DEVICEID = 107001,
  ACL_ERROR_RT_CONTEXT_NULL = 107002,
  ACL_ERROR_RT_MEMORY_ALLOCATION = 207001,
  ACL_ERROR_RT_NO_DEVICE = 207004,
};

/* [rt] aclrtMemAttr, aclrtEventRecordedStatus and aclrtEventStatus (the
 * two status enums have opposite values), aclrtMemMallocPolicy, event flags. */
enum { ACL_DDR_MEM = 0, ACL_HBM_MEM = 1, ACL_HBM_MEM_HUGE = 4 };
enum { ACL_EVENT_RECORDED_STATUS_NOT_READY = 0, ACL_EVENT_RECORDED_STATUS_COMPLETE = 1 };
enum { ACL_EVENT_STATUS_COMPLETE = 0, ACL_EVENT_STATUS_NOT_READY = 1 };
enum { ACL_MEM_MALLOC_HUGE1G_ONLY_P2P = 7, ACL_EVENT_FLAGS_KNOWN = 0x1 | 0x2 | 0x4 | 0x8 };
enum { ACL_EVENT_SYNC = 0x1, ACL_EVENT_CAPTURE_STREAM_PROGRESS = 0x2, ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000 };

typedef struct aclrtPhysicalMemProp {
  int handleType;     /* ACL_MEM_HANDLE_TYPE_NONE = 0 */
  int allocationType; /* ACL_MEM_ALLOCATION_TYPE_PINNED = 0 */
  int memAttr;        /* aclrtMemAttr */
  struct {
    uint32_t id;
    int type; /* ACL_MEM_LOCATION_TYPE_DEVICE = 1 */
  } location;
  uint64_t reserve;
} aclrtPhysicalMemProp;

enum { ITEM_FREE, ITEM_DEVICE, ITEM_HOST, ITEM_RESERVED, ITEM_MAPPED, ITEM_PHYSICAL };
typedef struct item {
  int kind;
  int device;
  uintptr_t addr; /* a physical handle's address is its handle */
  size_t size;    /* what counts against the device's capacity */
  int fd;         /* physical memory */
  uintptr_t handle; /* mapped: the physical handle */
  uint64_t serial;  /* which item this is, an address reused or not */
} item_t;

typedef struct fake_event {
  uintptr_t stream;
  int device;
  int pending;
  uint32_t flags;
  int waited; /* a stream waits on it: until it completes, no destroy and no record */
} fake_event_t;

/* [npu] torch_npu's task queue (TASK_QUEUE_ENABLE, on by default): an
 * operator is queued on the host and launched later by another thread, so
 * its memory may be freed to the allocator, and by the allocator to the
 * runtime, before the operator ever runs. A test queues work on device
 * memory (fakeacl_queue_work) and runs the queue (fakeacl_run_queue): work
 * whose memory the runtime no longer has is counted (fakeacl_stale_work),
 * not done. */
typedef struct queued_work {
  uintptr_t addr;
  size_t size;
  uint64_t serial; /* the device memory or mapping it works on */
} queued_work_t;
#define MAX_QUEUED 256
static queued_work_t queued[MAX_QUEUED];
static size_t queued_count, stale_work, queue_runs;
static char init_config[256];

static int initialized, device_count = -1, hold_events, peers_enabled[MAX_DEVICES][MAX_DEVICES];
static size_t capacity = (size_t)1 << 30, used[MAX_DEVICES];
static char soc_name[64] = "Ascend910B3";
static char cann_version[128] = "8.3.RC1";
/* [rt] the current device is per thread: aclrtSetDevice on each thread
 * before memory, stream or event calls; none until then. */
static __thread int current = -1;
static unsigned long set_device_calls;
/* [rt] the first aclrtSetDevice on a device makes its context (and default
 * stream) in the process: counted, so that tests see which devices a
 * library touched. */
static int touched[MAX_DEVICES];
static item_t items[MAX_ITEMS];
static fake_event_t *events[MAX_ITEMS];
static size_t live_events;
/* [rt] a stream is NULL (the device's default stream) or one aclrtCreateStream
 * made; anything else handed to an event or stream call is refused
 * (107000). The unit tests name streams by bare handles, so the rule holds
 * once fakeacl_strict_streams(1) (the framework stand-ins turn it on);
 * refusals are counted either way for a handle never created. */
#define MAX_STREAMS 64
static void *streams[MAX_STREAMS];
static int strict_streams;
static unsigned long bad_streams;

/* ---- control ------------------------------------------------------------ */

EXPORT void fakeacl_reset(void) {
  pthread_mutex_lock(&lock);
  plumbing_reset();
  memset(peers_enabled, 0, sizeof peers_enabled);
  memset(touched, 0, sizeof touched);
  hold_events = 0;
  strict_streams = 0;
  bad_streams = 0;
  queued_count = stale_work = queue_runs = 0;
  device_count = -1;
  capacity = (size_t)1 << 30;
  snprintf(soc_name, sizeof soc_name, "%s", "Ascend910B3");
  snprintf(cann_version, sizeof cann_version, "%s", "8.3.RC1");
  pthread_mutex_unlock(&lock);
}

/* The named entry point fails with `code` after `skip` more calls, `times` times. */
EXPORT void fakeacl_fail(const char *entry, unsigned skip, unsigned times, int code) {
  plumbing_fail(entry, skip, times, code);
}

EXPORT unsigned long fakeacl_calls(const char *entry) { return plumbing_calls(entry); }

EXPORT void fakeacl_set_capacity(size_t bytes) { capacity = bytes; }
EXPORT void fakeacl_set_devices(int n) { device_count = n; }
EXPORT void fakeacl_set_soc(const char *name) { snprintf(soc_name, sizeof soc_name, "%s", name); }
/* What aclsysGetCANNVersion answers for the CANN package ("": it fails). */
EXPORT void fakeacl_set_cann_version(const char *v) { snprintf(cann_version, sizeof cann_version, "%s", v); }
EXPORT void fakeacl_hold_events(int on) { hold_events = on; }
EXPORT void fakeacl_strict_streams(int on) { strict_streams = on; }
EXPORT unsigned long fakeacl_bad_streams(void) { return bad_streams; }
/* This thread's current device (-1: none set), as the runtime keeps it. */
EXPORT int fakeacl_current_device(void) { return current; }

EXPORT void fakeacl_complete_events(void) {
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i]) events[i]->pending = 0;
  pthread_mutex_unlock(&lock);
}

/* The work of one stream completes: the events recorded on it. */
EXPORT void fakeacl_complete_stream(void *stream) {
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i] && events[i]->stream == (uintptr_t)stream) events[i]->pending = 0;
  pthread_mutex_unlock(&lock);
}

EXPORT size_t fakeacl_used(int device) { return used[device]; }

/* Items alive of a kind: 1 device, 2 host, 3 reserved, 4 mapped, 5 physical. */
EXPORT size_t fakeacl_live(int kind) {
  size_t n = 0;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < MAX_ITEMS; i++) n += items[i].kind == kind;
  pthread_mutex_unlock(&lock);
  return n;
}

EXPORT size_t fakeacl_live_events(void) { return live_events; }
EXPORT unsigned long fakeacl_set_device_calls(void) { return set_device_calls; }
EXPORT int aclrtSetDevice(int32_t id);
/* Whether a context was made on the device (an aclrtSetDevice named it). */
EXPORT int fakeacl_touched(int device) { return device >= 0 && device < MAX_DEVICES && touched[device]; }
/* Make `device` this thread's current one, as a framework would (the runtime's own aclrtSetDevice). */
EXPORT int fakeacl_set_current(int device) { return aclrtSetDevice(device); }

static item_t *containing(int kind, uintptr_t addr, size_t size);

/* The device memory or mapping holding [addr, addr + size), or NULL. */
static item_t *memory_at(uintptr_t addr, size_t size) {
  item_t *it = containing(ITEM_DEVICE, addr, size);
  return it ? it : containing(ITEM_MAPPED, addr, size);
}

/* Work on [addr, addr + size): one mapping or one allocation of device memory. */
EXPORT int fakeacl_queue_work(uintptr_t addr, size_t size) {
  pthread_mutex_lock(&lock);
  item_t *it = memory_at(addr, size);
  int ok = it && queued_count < MAX_QUEUED;
  if (ok) queued[queued_count++] = (queued_work_t){addr, size, it->serial};
  pthread_mutex_unlock(&lock);
  return ok ? 0 : -1;
}

/* Launch and finish what is queued: it writes its memory, if the runtime
 * still has the same memory there (not memory freed, nor memory allocated
 * again at the same address). */
EXPORT void fakeacl_run_queue(void) {
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < queued_count; i++) {
    queued_work_t w = queued[i];
    item_t *it = memory_at(w.addr, w.size);
    if (it && it->serial == w.serial)
      memset((void *)w.addr, 0x5a, w.size);
    else
      stale_work++;
  }
  queued_count = 0;
  queue_runs++;
  pthread_mutex_unlock(&lock);
}

EXPORT size_t fakeacl_stale_work(void) { return stale_work; }
EXPORT size_t fakeacl_queue_runs(void) { return queue_runs; }
/* The configuration file of the aclInit that initialized the runtime ("" for none). */
EXPORT const char *fakeacl_init_config(void) { return init_config; }

/* ---- plumbing ----------------------------------------------------------- */

/* [rt] runtime calls before aclInit fail; [rt] a thread with no current
 * device has no context. */
#define NEED_DEVICE()                               \
  do {                                              \
    if (!initialized) LEAVE(ACL_ERROR_UNINITIALIZE); \
    if (current < 0) LEAVE(ACL_ERROR_RT_CONTEXT_NULL); \
  } while (0)

static int devices(void) {
  if (device_count >= 0) return device_count;
  const char *env = getenv("FAKEACL_DEVICES");
  int n = env ? atoi(env) : 2;
  return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

static item_t *new_item(int kind, int device, uintptr_t addr, size_t size) {
  static uint64_t serials;
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (items[i].kind == ITEM_FREE) {
      items[i] = (item_t){kind, device, addr, size, -1, 0, ++serials};
      return &items[i];
    }
  return NULL;
}

static item_t *find(int kind, uintptr_t addr) {
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (items[i].kind == kind && items[i].addr == addr) return &items[i];
  return NULL;
}

static item_t *containing(int kind, uintptr_t addr, size_t size) {
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (items[i].kind == kind && addr >= items[i].addr && addr + size <= items[i].addr + items[i].size) return &items[i];
  return NULL;
}

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* ---- initialization and devices ----------------------------------------- */

/* [rt] aclInit once per process; again: ACL_ERROR_REPEAT_INITIALIZE. */
EXPORT int aclInit(const char *configPath) {
  ENTER("aclInit");
  if (initialized) LEAVE(ACL_ERROR_REPEAT_INITIALIZE);
  initialized = 1;
  snprintf(init_config, sizeof init_config, "%s", configPath ? configPath : "");
  LEAVE(ACL_SUCCESS);
}

/* [rt] after aclFinalize the runtime may be initialized again. */
EXPORT int aclFinalize(void) {
  ENTER("aclFinalize");
  if (!initialized) LEAVE(ACL_ERROR_UNINITIALIZE);
  initialized = 0;
  init_config[0] = 0;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtGetDeviceCount(uint32_t *count) {
  ENTER("aclrtGetDeviceCount");
  if (!initialized) LEAVE(ACL_ERROR_UNINITIALIZE);
  if (!count) LEAVE(ACL_ERROR_INVALID_PARAM);
  if (devices() == 0) LEAVE(ACL_ERROR_RT_NO_DEVICE);
  *count = (uint32_t)devices();
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtSetDevice(int32_t id) {
  ENTER("aclrtSetDevice");
  if (!initialized) LEAVE(ACL_ERROR_UNINITIALIZE);
  if (id < 0 || id >= devices()) LEAVE(ACL_ERROR_RT_INVALID_DEVICEID);
  current = id;
  set_device_calls++;
  touched[id] = 1;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtGetDevice(int32_t *id) {
  ENTER("aclrtGetDevice");
  NEED_DEVICE();
  *id = current;
  LEAVE(ACL_SUCCESS);
}

#ifndef FAKEACL_MINIMAL
EXPORT const char *aclrtGetSocName(void) { return soc_name; }

/* [rt] acl.h's aclCANNPackageVersion: version[128], then four parts of 64, reserved[128]. */
typedef struct cann_package_version {
  char version[128], major[64], minor[64], release[64], patch[64], reserved[128];
} cann_package_version_t;

EXPORT int aclsysGetCANNVersion(int name, cann_package_version_t *v) {
  ENTER("aclsysGetCANNVersion");
  if (!v || name < 0 || name > 7) LEAVE(ACL_ERROR_INVALID_PARAM);
  if (!cann_version[0]) LEAVE(ACL_ERROR_INVALID_FILE);
  memset(v, 0, sizeof *v);
  snprintf(v->version, sizeof v->version, "%s", cann_version);
  LEAVE(ACL_SUCCESS);
}
#endif

/* ---- device memory ------------------------------------------------------ */

/* [rt] aclrtMalloc pads by 32 bytes (what it takes of the device is the
 * size aligned to 32, plus 32); aclrtMallocAlign32 only aligns. Both give
 * 32-byte-aligned memory (here 512-aligned host memory). */
static int device_malloc(void **p, size_t size, int policy, size_t pad) {
  NEED_DEVICE();
  if (!p || !size || policy < 0 || policy > ACL_MEM_MALLOC_HUGE1G_ONLY_P2P) LEAVE(ACL_ERROR_INVALID_PARAM);
  size_t take = align_up(size, 32) + pad;
  if (used[current] + take > capacity) LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  void *mem = NULL;
  if (posix_memalign(&mem, 512, take)) LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  if (!new_item(ITEM_DEVICE, current, (uintptr_t)mem, take)) {
    free(mem);
    LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  }
  used[current] += take;
  *p = mem;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtMalloc(void **p, size_t size, int policy) {
  ENTER("aclrtMalloc");
  return device_malloc(p, size, policy, 32);
}

#ifndef FAKEACL_MINIMAL
EXPORT int aclrtMallocAlign32(void **p, size_t size, int policy) {
  ENTER("aclrtMallocAlign32");
  return device_malloc(p, size, policy, 0);
}
#endif

EXPORT int aclrtFree(void *p) {
  ENTER("aclrtFree");
  NEED_DEVICE();
  item_t *it = find(ITEM_DEVICE, (uintptr_t)p);
  if (!it) LEAVE(ACL_ERROR_INVALID_PARAM);
  used[it->device] -= it->size;
  free(p);
  it->kind = ITEM_FREE;
  LEAVE(ACL_SUCCESS);
}

/* [rt] synchronous fills and copies (aclrtMemset, aclrtMemcpy): device
 * memory must be the runtime's (allocated, or mapped) and whole. */
enum { ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE };

static int device_range(const void *p, size_t n) {
  uintptr_t at = (uintptr_t)p, end = at + n;
  if (containing(ITEM_DEVICE, at, n)) return 1;
  while (at < end) { /* (mappings side by side in a reservation are one range to the device) */
    item_t *m = containing(ITEM_MAPPED, at, 1);
    if (!m) return 0;
    at = m->addr + m->size;
  }
  return 1;
}

EXPORT int aclrtMemset(void *dev, size_t max, int32_t value, size_t count) {
  ENTER("aclrtMemset");
  NEED_DEVICE();
  if (!dev || count > max || !device_range(dev, count)) LEAVE(ACL_ERROR_INVALID_PARAM);
  memset(dev, value, count);
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtMemcpy(void *dst, size_t max, const void *src, size_t count, int kind) {
  ENTER("aclrtMemcpy");
  NEED_DEVICE();
  int dst_dev = kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
  int src_dev = kind == ACL_MEMCPY_DEVICE_TO_HOST || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
  if (!dst || !src || count > max || kind < 0 || kind > ACL_MEMCPY_DEVICE_TO_DEVICE ||
      (dst_dev && !device_range(dst, count)) || (src_dev && !device_range(src, count)))
    LEAVE(ACL_ERROR_INVALID_PARAM);
  memmove(dst, src, count);
  LEAVE(ACL_SUCCESS);
}

/* [rt] device memory is ACL_HBM_MEM on an NPU with HBM. */
EXPORT int aclrtGetMemInfo(int attr, size_t *free_bytes, size_t *total) {
  ENTER("aclrtGetMemInfo");
  NEED_DEVICE();
  if (!free_bytes || !total || (attr != ACL_HBM_MEM && attr != ACL_DDR_MEM)) LEAVE(ACL_ERROR_INVALID_PARAM);
  size_t cap = attr == ACL_HBM_MEM ? capacity : 0;
  *total = cap;
  *free_bytes = attr == ACL_HBM_MEM ? cap - used[current] : 0;
  LEAVE(ACL_SUCCESS);
}

/* ---- events and streams --------------------------------------------------
 * [rt] an event completes once the work queued on its stream before the
 * record has; here work completes at once, unless fakeacl_hold_events(1)
 * keeps events pending until fakeacl_complete_events() or a
 * synchronization of the event, its stream or the device. */

static int create_event(void **e, uint32_t flags) {
  NEED_DEVICE();
  if (!e || (flags & ~(uint32_t)ACL_EVENT_FLAGS_KNOWN)) LEAVE(ACL_ERROR_INVALID_PARAM);
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (!events[i]) {
      fake_event_t *ev = calloc(1, sizeof *ev);
      if (!ev) LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
      ev->device = current;
      ev->flags = flags;
      events[i] = ev;
      live_events++;
      *e = ev;
      LEAVE(ACL_SUCCESS);
    }
  LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
}

/* [rt] a default event may be waited on and queried. */
EXPORT int aclrtCreateEvent(void **e) {
  ENTER("aclrtCreateEvent");
  return create_event(e, ACL_EVENT_SYNC | ACL_EVENT_CAPTURE_STREAM_PROGRESS);
}

#ifndef FAKEACL_MINIMAL
/* [npu] torch_npu creates its allocator's events with ACL_EVENT_CAPTURE_STREAM_PROGRESS. */
EXPORT int aclrtCreateEventWithFlag(void **e, uint32_t flag) {
  ENTER("aclrtCreateEventWithFlag");
  return create_event(e, flag);
}
#endif

static fake_event_t *event_of(void *e) {
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i] && events[i] == e) return events[i];
  return NULL;
}

/* A wait on the event is still pending: it has not completed. */
static int waited_on(fake_event_t *ev) {
  if (!ev->pending) ev->waited = 0;
  return ev->waited;
}

/* Whether `stream` is NULL or was created (and not destroyed); a strict
 * refusal is counted (the lock held). */
static int stream_known(void *stream) {
  if (!stream) return 1;
  for (size_t i = 0; i < MAX_STREAMS; i++)
    if (streams[i] == stream) return 1;
  bad_streams++;
  return !strict_streams;
}

EXPORT int aclrtCreateStream(void **stream) {
  ENTER("aclrtCreateStream");
  NEED_DEVICE();
  if (!stream) LEAVE(ACL_ERROR_INVALID_PARAM);
  for (size_t i = 0; i < MAX_STREAMS; i++)
    if (!streams[i]) {
      if (!(streams[i] = malloc(16))) LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
      *stream = streams[i];
      LEAVE(ACL_SUCCESS);
    }
  LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
}

EXPORT int aclrtDestroyStream(void *stream) {
  ENTER("aclrtDestroyStream");
  for (size_t i = 0; stream && i < MAX_STREAMS; i++)
    if (streams[i] == stream) {
      free(streams[i]);
      streams[i] = NULL;
      LEAVE(ACL_SUCCESS);
    }
  LEAVE(ACL_ERROR_RT_PARAM_INVALID);
}

/* [rt] recording again an event a stream still waits on is refused. */
EXPORT int aclrtRecordEvent(void *e, void *stream) {
  ENTER("aclrtRecordEvent");
  NEED_DEVICE();
  fake_event_t *ev = event_of(e);
  if (!ev || waited_on(ev)) LEAVE(ACL_ERROR_INVALID_PARAM);
  if (!stream_known(stream)) LEAVE(ACL_ERROR_RT_PARAM_INVALID);
  ev->stream = (uintptr_t)stream;
  ev->pending = hold_events;
  LEAVE(ACL_SUCCESS);
}

#ifndef FAKEACL_MINIMAL
/* [rt] the newer form: aclrtEventRecordedStatus, NOT_READY 0, COMPLETE 1. */
EXPORT int aclrtQueryEventStatus(void *e, int *status) {
  ENTER("aclrtQueryEventStatus");
  NEED_DEVICE();
  fake_event_t *ev = event_of(e);
  if (!ev || !status) LEAVE(ACL_ERROR_INVALID_PARAM);
  *status = ev->pending ? ACL_EVENT_RECORDED_STATUS_NOT_READY : ACL_EVENT_RECORDED_STATUS_COMPLETE;
  LEAVE(ACL_SUCCESS);
}
#endif

/* [rt] the older form: aclrtEventStatus, COMPLETE 0, NOT_READY 1. */
EXPORT int aclrtQueryEvent(void *e, int *status) {
  ENTER("aclrtQueryEvent");
  NEED_DEVICE();
  fake_event_t *ev = event_of(e);
  if (!ev || !status) LEAVE(ACL_ERROR_INVALID_PARAM);
  *status = ev->pending ? ACL_EVENT_STATUS_NOT_READY : ACL_EVENT_STATUS_COMPLETE;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtSynchronizeEvent(void *e) {
  ENTER("aclrtSynchronizeEvent");
  NEED_DEVICE();
  fake_event_t *ev = event_of(e);
  if (!ev) LEAVE(ACL_ERROR_INVALID_PARAM);
  ev->pending = 0;
  LEAVE(ACL_SUCCESS);
}

/* [rt] destroying an event a stream still waits on is refused. */
EXPORT int aclrtDestroyEvent(void *e) {
  ENTER("aclrtDestroyEvent");
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i] && events[i] == e) {
      if (waited_on(events[i])) LEAVE(ACL_ERROR_RT_PARAM_INVALID);
      free(events[i]);
      events[i] = NULL;
      live_events--;
      LEAVE(ACL_SUCCESS);
    }
  LEAVE(ACL_ERROR_INVALID_PARAM);
}

/* [rt] only an event created with ACL_EVENT_SYNC may be waited on
 * (207000 otherwise); the wait stays pending until the event completes. */
EXPORT int aclrtStreamWaitEvent(void *stream, void *e) {
  ENTER("aclrtStreamWaitEvent");
  NEED_DEVICE();
  fake_event_t *ev = event_of(e);
  if (!ev) LEAVE(ACL_ERROR_INVALID_PARAM);
  if (!stream_known(stream)) LEAVE(ACL_ERROR_RT_PARAM_INVALID);
  if (!(ev->flags & ACL_EVENT_SYNC)) LEAVE(ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
  if (ev->pending) ev->waited = 1;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtSynchronizeStream(void *stream) {
  ENTER("aclrtSynchronizeStream");
  NEED_DEVICE();
  if (!stream_known(stream)) LEAVE(ACL_ERROR_RT_PARAM_INVALID);
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i] && events[i]->stream == (uintptr_t)stream) events[i]->pending = 0;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtSynchronizeDevice(void) {
  ENTER("aclrtSynchronizeDevice");
  NEED_DEVICE();
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i] && events[i]->device == current) events[i]->pending = 0;
  LEAVE(ACL_SUCCESS);
}

#ifndef FAKEACL_MINIMAL
/* ---- peers and host memory ---------------------------------------------- */

EXPORT int aclrtDeviceCanAccessPeer(int32_t *can, int32_t device, int32_t peer) {
  ENTER("aclrtDeviceCanAccessPeer");
  if (!initialized) LEAVE(ACL_ERROR_UNINITIALIZE);
  if (!can || device < 0 || peer < 0 || device >= devices() || peer >= devices()) LEAVE(ACL_ERROR_INVALID_PARAM);
  *can = device != peer;
  LEAVE(ACL_SUCCESS);
}

/* [rt] from the current device to `peer`; flags must be 0. */
EXPORT int aclrtDeviceEnablePeerAccess(int32_t peer, uint32_t flags) {
  ENTER("aclrtDeviceEnablePeerAccess");
  NEED_DEVICE();
  if (flags || peer < 0 || peer >= devices() || peer == current) LEAVE(ACL_ERROR_INVALID_PARAM);
  peers_enabled[current][peer] = 1;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtDeviceDisablePeerAccess(int32_t peer) {
  ENTER("aclrtDeviceDisablePeerAccess");
  NEED_DEVICE();
  if (peer < 0 || peer >= devices() || !peers_enabled[current][peer]) LEAVE(ACL_ERROR_INVALID_PARAM);
  peers_enabled[current][peer] = 0;
  LEAVE(ACL_SUCCESS);
}

EXPORT int fakeacl_peer_enabled(int device, int peer) { return peers_enabled[device][peer]; }

/* [rt] host memory needs a current context, as device memory does
 * (ACL_ERROR_RT_CONTEXT_NULL on a thread that set no device). */
EXPORT int aclrtMallocHost(void **p, size_t size) {
  ENTER("aclrtMallocHost");
  NEED_DEVICE();
  if (!p || !size) LEAVE(ACL_ERROR_INVALID_PARAM);
  void *mem = NULL;
  if (posix_memalign(&mem, 4096, size)) LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  if (!new_item(ITEM_HOST, -1, (uintptr_t)mem, size)) {
    free(mem);
    LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  }
  *p = mem;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtFreeHost(void *p) {
  ENTER("aclrtFreeHost");
  NEED_DEVICE();
  item_t *it = find(ITEM_HOST, (uintptr_t)p);
  if (!it) LEAVE(ACL_ERROR_INVALID_PARAM);
  free(p);
  it->kind = ITEM_FREE;
  LEAVE(ACL_SUCCESS);
}

/* ---- virtual memory ------------------------------------------------------
 * [rt] aclrtReserveMemAddress / aclrtMallocPhysical / aclrtMapMem, the
 * counterparts of cuMemAddressReserve / cuMemCreate / cuMemMap, with real
 * mappings: a reservation is PROT_NONE address space (its size rounded up
 * to the granularity: [npu] torch_npu probes with 512 bytes), physical
 * memory a memfd that counts against the capacity, a mapping maps it
 * read-write, and aclrtUnmapMem takes the one mapping that starts at va. */

EXPORT int aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, int option, size_t *granularity) {
  ENTER("aclrtMemGetAllocationGranularity");
  if (!prop || !granularity || option < 0 || option > 1) LEAVE(ACL_ERROR_INVALID_PARAM);
  *granularity = GRANULARITY;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtReserveMemAddress(void **va, size_t size, size_t alignment, void *expect, uint64_t flags) {
  ENTER("aclrtReserveMemAddress");
  NEED_DEVICE();
  if (!va || !size || expect || flags > 1 || (alignment & (alignment - 1))) LEAVE(ACL_ERROR_INVALID_PARAM);
  size = align_up(size, GRANULARITY);
  char *base = mmap(NULL, size + GRANULARITY, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  uintptr_t start = align_up((uintptr_t)base, GRANULARITY);
  if (start > (uintptr_t)base) munmap(base, start - (uintptr_t)base);
  munmap((char *)start + size, (uintptr_t)base + GRANULARITY - start);
  if (!new_item(ITEM_RESERVED, current, start, size)) {
    munmap((void *)start, size);
    LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  }
  *va = (void *)start;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtReleaseMemAddress(void *va) {
  ENTER("aclrtReleaseMemAddress");
  item_t *r = find(ITEM_RESERVED, (uintptr_t)va);
  if (!r) LEAVE(ACL_ERROR_INVALID_PARAM);
  for (size_t i = 0; i < MAX_ITEMS; i++) /* nothing may be mapped in it */
    if (items[i].kind == ITEM_MAPPED && items[i].addr >= r->addr && items[i].addr < r->addr + r->size)
      LEAVE(ACL_ERROR_RT_PARAM_INVALID);
  munmap(va, r->size);
  r->kind = ITEM_FREE;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtMallocPhysical(void **handle, size_t size, const aclrtPhysicalMemProp *prop, uint64_t flags) {
  ENTER("aclrtMallocPhysical");
  NEED_DEVICE();
  if (!handle || !prop || flags || !size || size % GRANULARITY || prop->location.type != 1 ||
      prop->location.id >= (uint32_t)devices())
    LEAVE(ACL_ERROR_INVALID_PARAM);
  int device = (int)prop->location.id;
  if (used[device] + size > capacity) LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  int fd = memfd_create("fakeacl", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  }
  static uintptr_t next_handle = 0x1000;
  item_t *it = new_item(ITEM_PHYSICAL, device, next_handle, size);
  if (!it) {
    close(fd);
    LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  }
  next_handle += 0x1000;
  it->fd = fd;
  used[device] += size;
  *handle = (void *)it->addr;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtFreePhysical(void *handle) {
  ENTER("aclrtFreePhysical");
  item_t *p = find(ITEM_PHYSICAL, (uintptr_t)handle);
  if (!p) LEAVE(ACL_ERROR_INVALID_PARAM);
  for (size_t i = 0; i < MAX_ITEMS; i++) /* it must not be mapped */
    if (items[i].kind == ITEM_MAPPED && items[i].handle == p->addr) LEAVE(ACL_ERROR_RT_PARAM_INVALID);
  close(p->fd);
  used[p->device] -= p->size;
  p->kind = ITEM_FREE;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtMapMem(void *va, size_t size, size_t offset, void *handle, uint64_t flags) {
  ENTER("aclrtMapMem");
  NEED_DEVICE();
  item_t *p = find(ITEM_PHYSICAL, (uintptr_t)handle);
  if (!p || flags || offset || size != p->size || !containing(ITEM_RESERVED, (uintptr_t)va, size))
    LEAVE(ACL_ERROR_INVALID_PARAM);
  for (size_t i = 0; i < MAX_ITEMS; i++) /* no overlap with a mapping, nor a handle mapped twice */
    if (items[i].kind == ITEM_MAPPED &&
        (items[i].handle == p->addr ||
         ((uintptr_t)va < items[i].addr + items[i].size && items[i].addr < (uintptr_t)va + size)))
      LEAVE(ACL_ERROR_RT_PARAM_INVALID);
  if (mmap(va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, p->fd, 0) == MAP_FAILED)
    LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  item_t *m = new_item(ITEM_MAPPED, p->device, (uintptr_t)va, size);
  if (!m) LEAVE(ACL_ERROR_RT_MEMORY_ALLOCATION);
  m->handle = p->addr;
  LEAVE(ACL_SUCCESS);
}

EXPORT int aclrtUnmapMem(void *va) {
  ENTER("aclrtUnmapMem");
  NEED_DEVICE();
  item_t *m = find(ITEM_MAPPED, (uintptr_t)va);
  if (!m) LEAVE(ACL_ERROR_INVALID_PARAM);
  mmap(va, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  m->kind = ITEM_FREE;
  LEAVE(ACL_SUCCESS);
}
#endif /* FAKEACL_MINIMAL */
