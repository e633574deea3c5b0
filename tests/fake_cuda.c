/* A test double of the CUDA driver: the entry points gcalloc's cuda backend
 * loads (src/backends/cuda.c), implemented on host memory, so CI exercises
 * the whole backend without a GPU. Loaded through GCALLOC_CUDA_DRIVER or
 * "cuda:driver=PATH"; a test that dlopens the same file gets the same copy
 * and drives it with the fakecuda_* functions below.
 *
 * What it models:
 *  - devices (FAKECUDA_DEVICES, default 2) with a capacity each
 *    (fakecuda_set_capacity, default 1 GiB) that device allocations and
 *    physical memory count against: CUDA_ERROR_OUT_OF_MEMORY beyond it;
 *  - primary contexts and a current context per thread; calls that need one
 *    fail with CUDA_ERROR_INVALID_CONTEXT without it;
 *  - device memory as real host memory (512-byte aligned), so tests can
 *    write what they allocate; frees of unknown pointers are refused;
 *  - events: complete when recorded, unless fakecuda_hold_events(1) keeps
 *    them pending until fakecuda_complete_events(), a synchronization on
 *    them, or on their stream;
 *  - virtual memory with real mappings: reserved ranges are PROT_NONE
 *    address space, physical memory is a memfd, cuMemMap maps it there and
 *    cuMemSetAccess makes it read-write and records which devices may
 *    access it (fakecuda_access); unmapping puts PROT_NONE back;
 *  - stream-ordered allocation (cuMemAllocAsync/cuMemFreeAsync), at once;
 *  - device properties, peer access, stream priorities, pinned host memory
 *    (allocated, or the caller's registered) and cuPointerGetAttribute;
 *  - failure injection: fakecuda_fail(entry, skip, times, code) makes the
 *    named entry point fail with `code` after `skip` more calls, `times`
 *    times; fakecuda_calls(entry) counts the calls.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create */
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fake_plumbing.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8
#define MAX_ITEMS 65536
#define GRANULARITY ((size_t)2 << 20)

enum {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  NO_DEVICE = 100,
  INVALID_DEVICE = 101,
  INVALID_CONTEXT = 201,
  NOT_READY = 600,
  PEER_ALREADY_ENABLED = 704,
  PEER_NOT_ENABLED = 705,
  HOST_MEMORY_ALREADY_REGISTERED = 712,
  HOST_MEMORY_NOT_REGISTERED = 713,
  NOT_SUPPORTED = 801,
  STREAM_CAPTURE_UNSUPPORTED = 900,
  UNKNOWN = 999
};

typedef struct fake_ctx {
  int device;
  int retained;
  int peers[MAX_DEVICES];
} fake_ctx_t;

typedef struct fake_event {
  uintptr_t stream;
  int pending;
  int recorded;
} fake_event_t;

/* One table for everything that has an address: device allocations, host
 * allocations, reservations, mappings, physical handles. */
enum { ITEM_FREE, ITEM_DEVICE, ITEM_HOST, ITEM_RESERVED, ITEM_MAPPED, ITEM_PHYSICAL, ITEM_REGISTERED };
typedef struct item {
  int kind;
  int device;
  uintptr_t addr;
  size_t size;
  int fd;          /* physical memory */
  uint64_t handle; /* mapped: the physical handle */
  unsigned access; /* mapped: the devices that may read and write it, a bit each */
} item_t;

static int initialized, device_count = -1, hold_events, no_vmm;
static size_t capacity = (size_t)1 << 30, used[MAX_DEVICES];
static fake_ctx_t contexts[MAX_DEVICES];
static __thread fake_ctx_t *current;
static item_t items[MAX_ITEMS];
static fake_event_t *events[MAX_ITEMS];
static size_t live_events;

/* ---- control ------------------------------------------------------------ */

static int capture_global; /* (fakecuda_capture and the captures, below) */
#define MAX_CAPTURES 8
static struct {
  uintptr_t stream;
  uint64_t id;
  int mode;
} captures[MAX_CAPTURES];
static uint64_t next_capture_id = 100;


EXPORT void fakecuda_reset(void) {
  pthread_mutex_lock(&lock);
  plumbing_reset();
  capture_global = 0;
  memset(captures, 0, sizeof captures);
  hold_events = 0;
  no_vmm = 0;
  device_count = -1;
  pthread_mutex_unlock(&lock);
}

EXPORT void fakecuda_fail(const char *entry, unsigned skip, unsigned times, int code) {
  plumbing_fail(entry, skip, times, code);
}

EXPORT unsigned long fakecuda_calls(const char *entry) { return plumbing_calls(entry); }

/* A graph capture in global mode under way (fakecuda_capture): calls that
 * take memory are refused unless the calling thread is in relaxed mode
 * (cuThreadExchangeStreamCaptureMode), as the driver does. */
static _Thread_local int capture_mode; /* 0 global, 1 thread-local, 2 relaxed */
EXPORT void fakecuda_capture(int on) { capture_global = on; }
#define REFUSED_IN_CAPTURE() (capture_global && capture_mode != 2)

EXPORT int cuThreadExchangeStreamCaptureMode(int *mode) {
  ENTER("cuThreadExchangeStreamCaptureMode");
  if (!mode || *mode < 0 || *mode > 2) LEAVE(INVALID_VALUE);
  int old = capture_mode;
  capture_mode = *mode;
  *mode = old;
  LEAVE(OK);
}

EXPORT void fakecuda_set_capacity(size_t bytes) { capacity = bytes; }
EXPORT void fakecuda_set_devices(int n) { device_count = n; }
EXPORT void fakecuda_set_no_vmm(int on) { no_vmm = on; }
EXPORT void fakecuda_hold_events(int on) { hold_events = on; }

EXPORT void fakecuda_complete_events(void) {
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i]) events[i]->pending = 0;
  pthread_mutex_unlock(&lock);
}

/* Bytes of device memory in use on `device` (allocations and physical memory). */
EXPORT size_t fakecuda_used(int device) { return used[device]; }

/* How many items of a kind are alive: 1 device, 2 host, 3 reserved, 4 mapped, 5 physical, 6 registered. */
EXPORT size_t fakecuda_live(int kind) {
  size_t n = 0;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < MAX_ITEMS; i++) n += items[i].kind == kind;
  pthread_mutex_unlock(&lock);
  return n;
}

EXPORT size_t fakecuda_live_events(void) { return live_events; }
EXPORT int fakecuda_retained(int device) { return contexts[device].retained; }

/* ---- plumbing ----------------------------------------------------------- */


static int devices(void) {
  if (device_count >= 0) return device_count;
  const char *env = getenv("FAKECUDA_DEVICES");
  int n = env ? atoi(env) : 2;
  return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : n;
}

static item_t *new_item(int kind, int device, uintptr_t addr, size_t size) {
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (items[i].kind == ITEM_FREE) {
      items[i] = (item_t){kind, device, addr, size, -1, 0, 0};
      return &items[i];
    }
  return NULL;
}

static item_t *find(int kind, uintptr_t addr) {
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (items[i].kind == kind && items[i].addr == addr) return &items[i];
  return NULL;
}

static item_t *containing(int kind, uintptr_t addr) {
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (items[i].kind == kind && addr >= items[i].addr && addr < items[i].addr + items[i].size) return &items[i];
  return NULL;
}

/* ---- the driver API ------------------------------------------------------ */

EXPORT int cuInit(unsigned flags) {
  ENTER("cuInit");
  if (flags) LEAVE(INVALID_VALUE);
  initialized = 1;
  LEAVE(OK);
}

static const struct {
  int code;
  const char *name;
} names[] = {{OK, "CUDA_SUCCESS"},
             {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
             {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
             {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
             {NO_DEVICE, "CUDA_ERROR_NO_DEVICE"},
             {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
             {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
             {NOT_READY, "CUDA_ERROR_NOT_READY"},
             {PEER_ALREADY_ENABLED, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"},
             {PEER_NOT_ENABLED, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED"},
             {HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
             {HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
             {NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
             {UNKNOWN, "CUDA_ERROR_UNKNOWN"}};

EXPORT int cuGetErrorName(int error, const char **name) {
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (names[i].code == error) {
      *name = names[i].name;
      return OK;
    }
  *name = NULL;
  return INVALID_VALUE;
}

EXPORT int cuDeviceGetCount(int *count) {
  ENTER("cuDeviceGetCount");
  if (!initialized) LEAVE(NOT_INITIALIZED);
  *count = devices();
  LEAVE(OK);
}

/* A UUID per device, the same in every process that loads the double. */
EXPORT int cuDeviceGetUuid_v2(unsigned char *uuid, int device) {
  ENTER("cuDeviceGetUuid_v2");
  if (device < 0 || device >= devices()) LEAVE(INVALID_DEVICE);
  for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xa0 + i + 16 * device);
  LEAVE(OK);
}

EXPORT int cuDeviceGet(int *device, int ordinal) {
  ENTER("cuDeviceGet");
  if (!initialized) LEAVE(NOT_INITIALIZED);
  if (ordinal < 0 || ordinal >= devices()) LEAVE(INVALID_DEVICE);
  *device = ordinal;
  LEAVE(OK);
}

EXPORT int cuDevicePrimaryCtxRetain(void **ctx, int device) {
  ENTER("cuDevicePrimaryCtxRetain");
  if (device < 0 || device >= devices()) LEAVE(INVALID_DEVICE);
  contexts[device].device = device;
  contexts[device].retained++;
  *ctx = &contexts[device];
  LEAVE(OK);
}

EXPORT int cuDevicePrimaryCtxRelease_v2(int device) {
  ENTER("cuDevicePrimaryCtxRelease_v2");
  if (device < 0 || device >= devices() || !contexts[device].retained) LEAVE(INVALID_DEVICE);
  contexts[device].retained--;
  LEAVE(OK);
}

EXPORT int cuCtxGetCurrent(void **ctx) {
  ENTER("cuCtxGetCurrent");
  *ctx = current;
  LEAVE(OK);
}

EXPORT int cuCtxSetCurrent(void *ctx) {
  ENTER("cuCtxSetCurrent");
  current = ctx;
  LEAVE(OK);
}

/* The current context's device, or -1. */
static int current_device(void) { return current && current->retained ? current->device : -1; }

EXPORT int cuMemAlloc_v2(uint64_t *ptr, size_t size) {
  ENTER("cuMemAlloc_v2");
  if (REFUSED_IN_CAPTURE()) LEAVE(STREAM_CAPTURE_UNSUPPORTED);
  int d = current_device();
  if (d < 0) LEAVE(INVALID_CONTEXT);
  if (!size) LEAVE(INVALID_VALUE);
  if (used[d] + size > capacity) LEAVE(OUT_OF_MEMORY);
  void *p = NULL;
  if (posix_memalign(&p, 512, size)) LEAVE(OUT_OF_MEMORY);
  if (!new_item(ITEM_DEVICE, d, (uintptr_t)p, size)) {
    free(p);
    LEAVE(OUT_OF_MEMORY);
  }
  used[d] += size;
  *ptr = (uintptr_t)p;
  LEAVE(OK);
}

EXPORT int cuMemFree_v2(uint64_t ptr) {
  ENTER("cuMemFree_v2");
  item_t *it = find(ITEM_DEVICE, (uintptr_t)ptr);
  if (!it) LEAVE(INVALID_VALUE);
  used[it->device] -= it->size;
  free((void *)it->addr);
  it->kind = ITEM_FREE;
  LEAVE(OK);
}

/* Stream-ordered allocation (bench-cuda's peer): the double's streams run
 * their work at once, so the memory is allocated and freed at once. */
EXPORT int cuMemAllocAsync(uint64_t *ptr, size_t size, uintptr_t stream) {
  (void)stream;
  return cuMemAlloc_v2(ptr, size);
}

EXPORT int cuMemFreeAsync(uint64_t ptr, uintptr_t stream) {
  (void)stream;
  return cuMemFree_v2(ptr);
}

EXPORT int cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
  ENTER("cuMemGetInfo_v2");
  int d = current_device();
  if (d < 0) LEAVE(INVALID_CONTEXT);
  *free_bytes = capacity - used[d];
  *total = capacity;
  LEAVE(OK);
}

EXPORT int cuEventCreate(fake_event_t **event, unsigned flags) {
  ENTER("cuEventCreate");
  (void)flags;
  if (current_device() < 0) LEAVE(INVALID_CONTEXT);
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (!events[i]) {
      events[i] = calloc(1, sizeof *events[i]);
      if (!events[i]) LEAVE(OUT_OF_MEMORY);
      live_events++;
      *event = events[i];
      LEAVE(OK);
    }
  LEAVE(OUT_OF_MEMORY);
}

static size_t event_slot(const fake_event_t *e) {
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i] == e && e) return i;
  return MAX_ITEMS;
}

EXPORT int cuEventRecord(fake_event_t *e, uintptr_t stream) {
  ENTER("cuEventRecord");
  if (event_slot(e) == MAX_ITEMS) LEAVE(INVALID_VALUE);
  e->stream = stream;
  e->recorded = 1;
  e->pending = hold_events;
  LEAVE(OK);
}

EXPORT int cuEventQuery(fake_event_t *e) {
  ENTER("cuEventQuery");
  if (event_slot(e) == MAX_ITEMS) LEAVE(INVALID_VALUE);
  LEAVE(e->pending ? NOT_READY : OK);
}

EXPORT int cuEventSynchronize(fake_event_t *e) {
  ENTER("cuEventSynchronize");
  if (event_slot(e) == MAX_ITEMS) LEAVE(INVALID_VALUE);
  e->pending = 0;
  LEAVE(OK);
}

EXPORT int cuEventDestroy_v2(fake_event_t *e) {
  ENTER("cuEventDestroy_v2");
  size_t i = event_slot(e);
  if (i == MAX_ITEMS) LEAVE(INVALID_VALUE);
  free(events[i]);
  events[i] = NULL;
  live_events--;
  LEAVE(OK);
}

EXPORT int cuStreamWaitEvent(uintptr_t stream, fake_event_t *e, unsigned flags) {
  ENTER("cuStreamWaitEvent");
  (void)stream;
  if (flags || event_slot(e) == MAX_ITEMS) LEAVE(INVALID_VALUE);
  LEAVE(OK);
}

EXPORT int cuStreamSynchronize(uintptr_t stream) {
  ENTER("cuStreamSynchronize");
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (events[i] && events[i]->stream == stream) events[i]->pending = 0;
  LEAVE(OK);
}

/* Streams and copies, for tests that drive the device themselves
 * (test_cuda_driver): work runs at once, so a stream is never busy. */
EXPORT int cuStreamCreate(uintptr_t *stream, unsigned flags) {
  ENTER("cuStreamCreate");
  if (!current || flags > 1) LEAVE(current ? INVALID_VALUE : INVALID_CONTEXT);
  static uintptr_t next_stream = 0x5000;
  *stream = next_stream += 16;
  LEAVE(OK);
}

EXPORT int cuStreamDestroy_v2(uintptr_t stream) {
  ENTER("cuStreamDestroy_v2");
  LEAVE(stream ? OK : INVALID_VALUE);
}

/* [drv] stream capture: a stream is in at most one capture, with an id
 * unique in the process; a capture in global mode (CU_STREAM_CAPTURE_MODE_
 * GLOBAL, 0) makes calls that take memory refused on threads not in
 * relaxed mode (REFUSED_IN_CAPTURE) until it ends. The legacy stream (0)
 * cannot be captured. */

EXPORT int cuStreamBeginCapture_v2(uintptr_t stream, int mode) {
  ENTER("cuStreamBeginCapture_v2");
  if (!current) LEAVE(INVALID_CONTEXT);
  if (!stream || mode < 0 || mode > 2) LEAVE(INVALID_VALUE);
  int slot = -1;
  for (int i = 0; i < MAX_CAPTURES; i++) {
    if (captures[i].stream == stream) LEAVE(INVALID_VALUE); /* (already capturing: CUDA_ERROR_ILLEGAL_STATE) */
    if (!captures[i].stream && slot < 0) slot = i;
  }
  if (slot < 0) LEAVE(OUT_OF_MEMORY);
  captures[slot].stream = stream;
  captures[slot].id = next_capture_id++;
  captures[slot].mode = mode;
  if (mode == 0) capture_global++;
  LEAVE(OK);
}

EXPORT int cuStreamEndCapture(uintptr_t stream, void **graph) {
  ENTER("cuStreamEndCapture");
  for (int i = 0; i < MAX_CAPTURES; i++)
    if (captures[i].stream == stream) {
      if (captures[i].mode == 0) capture_global--;
      captures[i].stream = 0;
      if (graph) *graph = (void *)(uintptr_t)captures[i].id;
      LEAVE(OK);
    }
  LEAVE(INVALID_VALUE);
}

/* The legacy form (status, id): NONE 0, ACTIVE 1. */
EXPORT int cuStreamGetCaptureInfo(uintptr_t stream, int *status, uint64_t *id) {
  ENTER("cuStreamGetCaptureInfo");
  if (!status) LEAVE(INVALID_VALUE);
  *status = 0;
  for (int i = 0; i < MAX_CAPTURES; i++)
    if (stream && captures[i].stream == stream) {
      *status = 1;
      if (id) *id = captures[i].id;
    }
  LEAVE(OK);
}

EXPORT int cuStreamQuery(uintptr_t stream) {
  ENTER("cuStreamQuery");
  (void)stream;
  LEAVE(OK);
}

EXPORT int cuCtxSynchronize(void) {
  ENTER("cuCtxSynchronize");
  LEAVE(current ? OK : INVALID_CONTEXT);
}

/* Device memory is host memory here: the bytes must lie in one allocation,
 * or in mapped ranges that follow each other (an expandable segment's
 * pages). */
static int device_range(uint64_t addr, size_t bytes) {
  item_t *it = containing(ITEM_DEVICE, (uintptr_t)addr);
  if (it) return addr + bytes <= it->addr + it->size;
  uint64_t end = addr + bytes;
  while (addr < end) {
    it = containing(ITEM_MAPPED, (uintptr_t)addr);
    if (!it) return 0;
    addr = it->addr + it->size;
  }
  return 1;
}

EXPORT int cuMemsetD32Async(uint64_t addr, unsigned value, size_t count, uintptr_t stream) {
  ENTER("cuMemsetD32Async");
  (void)stream;
  if (addr % 4 || !device_range(addr, count * 4)) LEAVE(INVALID_VALUE);
  unsigned *p = (unsigned *)(uintptr_t)addr;
  for (size_t i = 0; i < count; i++) p[i] = value;
  LEAVE(OK);
}

EXPORT int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t bytes) {
  ENTER("cuMemcpyDtoH_v2");
  if (!device_range(src, bytes)) LEAVE(INVALID_VALUE);
  memcpy(dst, (void *)(uintptr_t)src, bytes);
  LEAVE(OK);
}

EXPORT int cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t bytes) {
  ENTER("cuMemcpyHtoD_v2");
  if (!device_range(dst, bytes)) LEAVE(INVALID_VALUE);
  memcpy((void *)(uintptr_t)dst, src, bytes);
  LEAVE(OK);
}

/* The double's streams run their work at once. */
EXPORT int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t bytes, uintptr_t stream) {
  ENTER("cuMemcpyDtoHAsync_v2");
  (void)stream;
  if (!device_range(src, bytes)) LEAVE(INVALID_VALUE);
  memcpy(dst, (void *)(uintptr_t)src, bytes);
  LEAVE(OK);
}

EXPORT int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t bytes, uintptr_t stream) {
  ENTER("cuMemcpyHtoDAsync_v2");
  (void)stream;
  if (!device_range(dst, bytes)) LEAVE(INVALID_VALUE);
  memcpy((void *)(uintptr_t)dst, src, bytes);
  LEAVE(OK);
}

EXPORT int cuDeviceGetName(char *name, int len, int device) {
  ENTER("cuDeviceGetName");
  if (device < 0 || device >= devices()) LEAVE(INVALID_DEVICE);
  const char *text = "gcalloc fake CUDA device";
  if (len <= 0) LEAVE(INVALID_VALUE);
  strncpy(name, text, (size_t)len - 1);
  name[len - 1] = 0;
  LEAVE(OK);
}

EXPORT int cuDeviceGetAttribute(int *value, int attribute, int device) {
  ENTER("cuDeviceGetAttribute");
  if (device < 0 || device >= devices()) LEAVE(INVALID_DEVICE);
  switch (attribute) {
    case 16: *value = 132; break;                /* multiprocessors */
    case 75: *value = 9; break;                  /* compute capability */
    case 76: *value = 0; break;
    case 102: *value = !no_vmm; break;           /* virtual memory management */
    default: LEAVE(INVALID_VALUE);
  }
  LEAVE(OK);
}

EXPORT int cuDeviceTotalMem_v2(size_t *bytes, int device) {
  ENTER("cuDeviceTotalMem_v2");
  if (device < 0 || device >= devices()) LEAVE(INVALID_DEVICE);
  *bytes = capacity;
  LEAVE(OK);
}

EXPORT int cuDeviceCanAccessPeer(int *can, int device, int peer) {
  ENTER("cuDeviceCanAccessPeer");
  if (device < 0 || device >= devices() || peer < 0 || peer >= devices()) LEAVE(INVALID_DEVICE);
  *can = device != peer;
  LEAVE(OK);
}

EXPORT int cuCtxEnablePeerAccess(fake_ctx_t *peer, unsigned flags) {
  ENTER("cuCtxEnablePeerAccess");
  if (!current || !peer || flags) LEAVE(INVALID_VALUE);
  if (peer == current) LEAVE(INVALID_DEVICE);
  if (current->peers[peer->device]) LEAVE(PEER_ALREADY_ENABLED);
  current->peers[peer->device] = 1;
  LEAVE(OK);
}

EXPORT int cuCtxDisablePeerAccess(fake_ctx_t *peer) {
  ENTER("cuCtxDisablePeerAccess");
  if (!current || !peer) LEAVE(INVALID_VALUE);
  if (!current->peers[peer->device]) LEAVE(PEER_NOT_ENABLED);
  current->peers[peer->device] = 0;
  LEAVE(OK);
}

EXPORT int cuCtxGetStreamPriorityRange(int *least, int *greatest) {
  ENTER("cuCtxGetStreamPriorityRange");
  if (!current) LEAVE(INVALID_CONTEXT);
  *least = 0;
  *greatest = -5;
  LEAVE(OK);
}

EXPORT int cuMemHostAlloc(void **ptr, size_t size, unsigned flags) {
  ENTER("cuMemHostAlloc");
  (void)flags;
  if (!current) LEAVE(INVALID_CONTEXT);
  if (!size) LEAVE(INVALID_VALUE);
  void *p = NULL;
  if (posix_memalign(&p, 4096, size)) LEAVE(OUT_OF_MEMORY);
  if (!new_item(ITEM_HOST, -1, (uintptr_t)p, size)) {
    free(p);
    LEAVE(OUT_OF_MEMORY);
  }
  *ptr = p;
  LEAVE(OK);
}

EXPORT int cuMemFreeHost(void *ptr) {
  ENTER("cuMemFreeHost");
  item_t *it = find(ITEM_HOST, (uintptr_t)ptr);
  if (!it) LEAVE(INVALID_VALUE);
  free(ptr);
  it->kind = ITEM_FREE;
  LEAVE(OK);
}

EXPORT int cuMemHostRegister_v2(void *ptr, size_t size, unsigned flags) {
  ENTER("cuMemHostRegister_v2");
  if (!current) LEAVE(INVALID_CONTEXT);
  if (!ptr || !size || flags > 0xf) LEAVE(INVALID_VALUE);
  uintptr_t p = (uintptr_t)ptr;
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if ((items[i].kind == ITEM_HOST || items[i].kind == ITEM_REGISTERED) && p < items[i].addr + items[i].size &&
        items[i].addr < p + size)
      LEAVE(HOST_MEMORY_ALREADY_REGISTERED);
  if (!new_item(ITEM_REGISTERED, -1, p, size)) LEAVE(OUT_OF_MEMORY);
  LEAVE(OK);
}

EXPORT int cuMemHostUnregister(void *ptr) {
  ENTER("cuMemHostUnregister");
  item_t *it = find(ITEM_REGISTERED, (uintptr_t)ptr);
  if (!it) LEAVE(HOST_MEMORY_NOT_REGISTERED);
  it->kind = ITEM_FREE;
  LEAVE(OK);
}

EXPORT int cuPointerGetAttribute(void *data, int attribute, uint64_t ptr) {
  ENTER("cuPointerGetAttribute");
  if (attribute != 2) LEAVE(INVALID_VALUE);
  if (containing(ITEM_HOST, (uintptr_t)ptr) || containing(ITEM_REGISTERED, (uintptr_t)ptr)) *(unsigned *)data = 1;
  else if (containing(ITEM_DEVICE, (uintptr_t)ptr) || containing(ITEM_MAPPED, (uintptr_t)ptr)) *(unsigned *)data = 2;
  else LEAVE(INVALID_VALUE);
  LEAVE(OK);
}

/* ---- virtual memory ----------------------------------------------------- */

typedef struct prop {
  int type, handle_types, location_type, location_id;
} prop_t; /* the leading fields of CUmemAllocationProp */

EXPORT int cuMemGetAllocationGranularity(size_t *granularity, const prop_t *prop, int option) {
  ENTER("cuMemGetAllocationGranularity");
  if (!prop || prop->type != 1 || prop->location_type != 1 || option < 0 || option > 1) LEAVE(INVALID_VALUE);
  *granularity = GRANULARITY;
  LEAVE(OK);
}

EXPORT int cuMemAddressReserve(uint64_t *ptr, size_t size, size_t alignment, uint64_t addr, unsigned long long flags) {
  ENTER("cuMemAddressReserve");
  if (REFUSED_IN_CAPTURE()) LEAVE(STREAM_CAPTURE_UNSUPPORTED);
  if (!size || size % GRANULARITY || addr || flags || (alignment && alignment != GRANULARITY)) LEAVE(INVALID_VALUE);
  char *base = mmap(NULL, size + GRANULARITY, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) LEAVE(OUT_OF_MEMORY);
  uintptr_t at = ((uintptr_t)base + GRANULARITY - 1) & ~(GRANULARITY - 1);
  if (at > (uintptr_t)base) munmap(base, at - (uintptr_t)base);
  munmap((void *)(at + size), (uintptr_t)base + size + GRANULARITY - (at + size));
  if (!new_item(ITEM_RESERVED, current_device(), at, size)) {
    munmap((void *)at, size);
    LEAVE(OUT_OF_MEMORY);
  }
  *ptr = at;
  LEAVE(OK);
}

EXPORT int cuMemAddressFree(uint64_t ptr, size_t size) {
  ENTER("cuMemAddressFree");
  item_t *r = find(ITEM_RESERVED, (uintptr_t)ptr);
  if (!r || r->size != size) LEAVE(INVALID_VALUE);
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (items[i].kind == ITEM_MAPPED && items[i].addr >= ptr && items[i].addr < ptr + size) LEAVE(INVALID_VALUE);
  munmap((void *)r->addr, size);
  r->kind = ITEM_FREE;
  LEAVE(OK);
}

EXPORT int cuMemCreate(uint64_t *handle, size_t size, const prop_t *prop, unsigned long long flags) {
  ENTER("cuMemCreate");
  if (REFUSED_IN_CAPTURE()) LEAVE(STREAM_CAPTURE_UNSUPPORTED);
  if (!prop || prop->type != 1 || prop->location_type != 1 || flags || !size || size % GRANULARITY)
    LEAVE(INVALID_VALUE);
  int d = prop->location_id;
  if (d < 0 || d >= devices()) LEAVE(INVALID_DEVICE);
  if (used[d] + size > capacity) LEAVE(OUT_OF_MEMORY);
  int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    LEAVE(OUT_OF_MEMORY);
  }
  item_t *it = new_item(ITEM_PHYSICAL, d, 0, size);
  if (!it) {
    close(fd);
    LEAVE(OUT_OF_MEMORY);
  }
  it->fd = fd;
  it->handle = (uint64_t)(it - items) + 1;
  used[d] += size;
  *handle = it->handle;
  LEAVE(OK);
}

static item_t *physical(uint64_t handle) {
  if (!handle || handle > MAX_ITEMS || items[handle - 1].kind != ITEM_PHYSICAL) return NULL;
  return &items[handle - 1];
}

static int mapped_count(uint64_t handle) {
  int n = 0;
  for (size_t i = 0; i < MAX_ITEMS; i++) n += items[i].kind == ITEM_MAPPED && items[i].handle == handle;
  return n;
}

static void release_physical(item_t *p) {
  used[p->device] -= p->size;
  close(p->fd);
  p->kind = ITEM_FREE;
}

EXPORT int cuMemRelease(uint64_t handle) {
  ENTER("cuMemRelease");
  item_t *p = physical(handle);
  if (!p) LEAVE(INVALID_VALUE);
  /* The driver keeps mapped memory until it is unmapped; gcalloc never
   * releases mapped memory, so the double refuses it to catch a slip. */
  if (mapped_count(handle)) LEAVE(INVALID_VALUE);
  release_physical(p);
  LEAVE(OK);
}

EXPORT int cuMemMap(uint64_t ptr, size_t size, size_t offset, uint64_t handle, unsigned long long flags) {
  ENTER("cuMemMap");
  if (REFUSED_IN_CAPTURE()) LEAVE(STREAM_CAPTURE_UNSUPPORTED);
  item_t *p = physical(handle);
  item_t *r = containing(ITEM_RESERVED, (uintptr_t)ptr);
  if (!p || !r || offset || flags || size != p->size || ptr % GRANULARITY || ptr + size > r->addr + r->size)
    LEAVE(INVALID_VALUE);
  for (size_t i = 0; i < MAX_ITEMS; i++)
    if (items[i].kind == ITEM_MAPPED && items[i].addr < ptr + size && ptr < items[i].addr + items[i].size)
      LEAVE(INVALID_VALUE);
  if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd, 0) == MAP_FAILED)
    LEAVE(OUT_OF_MEMORY);
  item_t *m = new_item(ITEM_MAPPED, p->device, (uintptr_t)ptr, size);
  if (!m) LEAVE(OUT_OF_MEMORY);
  m->handle = handle;
  LEAVE(OK);
}

typedef struct access {
  int location_type, location_id, flags;
} access_t;

EXPORT int cuMemSetAccess(uint64_t ptr, size_t size, const access_t *desc, size_t count) {
  ENTER("cuMemSetAccess");
  if (!desc || count == 0 || count > MAX_DEVICES) LEAVE(INVALID_VALUE);
  /* Every byte must be mapped. */
  for (uint64_t at = ptr; at < ptr + size;) {
    item_t *m = containing(ITEM_MAPPED, (uintptr_t)at);
    if (!m) LEAVE(INVALID_VALUE);
    at = m->addr + m->size;
  }
  /* Each descriptor: a device, read-write (3) or none (0). Another device
   * than the memory's own must be able to reach it (every pair can here). */
  for (size_t k = 0; k < count; k++)
    if (desc[k].location_type != 1 || desc[k].location_id < 0 || desc[k].location_id >= devices() ||
        (desc[k].flags != 3 && desc[k].flags != 0))
      LEAVE(INVALID_VALUE);
  for (uint64_t at = ptr; at < ptr + size;) {
    item_t *m = containing(ITEM_MAPPED, (uintptr_t)at);
    for (size_t k = 0; k < count; k++) {
      if (desc[k].flags) m->access |= 1u << desc[k].location_id;
      else m->access &= ~(1u << desc[k].location_id);
    }
    at = m->addr + m->size;
  }
  if (mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) != 0) LEAVE(INVALID_VALUE);
  LEAVE(OK);
}

/* The devices that may access the mapping holding addr (a bit each); -1 if none holds it. */
EXPORT int fakecuda_access(uintptr_t addr) {
  pthread_mutex_lock(&lock);
  item_t *m = containing(ITEM_MAPPED, addr);
  int access = m ? (int)m->access : -1;
  pthread_mutex_unlock(&lock);
  return access;
}

EXPORT int cuMemUnmap(uint64_t ptr, size_t size) {
  ENTER("cuMemUnmap");
  /* Whole mappings only, covering the range without a gap. */
  for (uint64_t at = ptr; at < ptr + size;) {
    item_t *m = find(ITEM_MAPPED, (uintptr_t)at);
    if (!m || m->addr + m->size > ptr + size) LEAVE(INVALID_VALUE);
    at = m->addr + m->size;
  }
  for (uint64_t at = ptr; at < ptr + size;) {
    item_t *m = find(ITEM_MAPPED, (uintptr_t)at);
    at = m->addr + m->size;
    m->kind = ITEM_FREE;
  }
  mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  LEAVE(OK);
}
