/* The backend interface: the device primitives the caching core needs.
 *
 * Like mimalloc's prim layer, this is the only way the core reaches a device.
 * A backend is a table of functions plus an opaque state; it is opened from a
 * spec "NAME:key=value,...". Calls may come from several threads at once (one
 * per device lock), so a backend guards its own state. Every call returns
 * GCA_OK or a negative gca_status and sets the error message on failure;
 * GCA_ERR_OOM means "no memory now" (the core may free cache and retry), any
 * other failure is final.
 *
 * Streams and events order memory reuse: the core records an event on a
 * stream (it completes when the work queued on the stream before it has),
 * asks whether it has completed, waits for it, or makes another stream wait
 * for it. A stream is the caller's handle (gca_stream_t, a cudaStream_t on
 * CUDA); an event is the backend's handle. The stream and event entries may
 * be NULL: the core then treats the device as synchronous (every event has
 * completed when recorded).
 *
 * Virtual memory (expandable segments) separates address space from
 * physical memory, as CUDA's cuMemAddressReserve / cuMemCreate / cuMemMap
 * do: reserve a range of addresses (no memory behind it), create physical
 * memory (counted against the device's capacity; GCA_ERR_OOM when there is
 * none), map it at an address of a reserved range (readable and writable by
 * the device once mapped), unmap it, destroy it, give the range back. All
 * addresses and sizes are multiples of vm_granularity. A backend without
 * virtual memory leaves all seven entries NULL; the core then serves
 * expandable_segments:True with ordinary segments and says so once.
 */
#ifndef GCALLOC_BACKEND_H
#define GCALLOC_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gcalloc.h"

/* event_query's answer when the event has not completed yet (not an error). */
#define BACKEND_NOT_READY 1

typedef struct backend_ops {
  const char *name;
  int (*device_count)(void *state);
  /* Allocate `size` bytes on `device`; the address is 512-byte aligned. */
  int (*malloc)(void *state, int device, size_t size, uintptr_t *addr);
  /* Free what malloc returned; `size` is the size it was asked for.
   * GCA_ERR_BAD_POINTER: the device holds no such allocation (a bookkeeping
   * error of the caller; nothing was freed); GCA_ERR_CORRUPT: freed, but
   * work still used it (the sim's race detector); any other failure: the
   * device refused and the memory is still allocated. */
  int (*free)(void *state, int device, uintptr_t addr, size_t size);
  int (*mem_get_info)(void *state, int device, size_t *free_bytes, size_t *total_bytes);
  /* Create an event and record it on `stream`: it completes when every piece
   * of work queued on the stream so far has. */
  int (*event_record)(void *state, int device, gca_stream_t stream, uintptr_t *event);
  /* GCA_OK when the event has completed, BACKEND_NOT_READY when not yet. */
  int (*event_query)(void *state, int device, uintptr_t event);
  /* Block the host until the event has completed. */
  int (*event_synchronize)(void *state, int device, uintptr_t event);
  /* Release an event (recorded, completed or not). */
  void (*event_destroy)(void *state, int device, uintptr_t event);
  /* Work queued on `stream` from now on starts only after `event` completes. */
  int (*stream_wait_event)(void *state, int device, gca_stream_t stream, uintptr_t event);
  /* Block the host until all work queued on `stream` has completed. */
  int (*stream_synchronize)(void *state, int device, gca_stream_t stream);
  /* Block the host until all work queued on the device, on any stream, has
   * completed (may be NULL: the core then relies on its events alone). */
  int (*device_synchronize)(void *state, int device);
  /* Copies between device memory and (pinned) host memory, queued on
   * `stream` after its earlier work; they are done when the stream is
   * (stream_synchronize). NULL: not offered (pausing a pool with a host
   * copy is then refused). */
  int (*copy_to_host)(void *state, int device, gca_stream_t stream, void *dst, uintptr_t src, size_t size);
  int (*copy_to_device)(void *state, int device, gca_stream_t stream, uintptr_t dst, const void *src, size_t size);
  /* Virtual memory (may all be NULL). The page size mappings are made of. */
  int (*vm_granularity)(void *state, int device, size_t *granularity);
  /* Reserve `size` bytes of addresses, aligned to the granularity. */
  int (*vm_reserve)(void *state, int device, size_t size, uintptr_t *addr);
  /* Give back a reserved range (addr and size as reserved); nothing may be mapped in it. */
  int (*vm_unreserve)(void *state, int device, uintptr_t addr, size_t size);
  /* Create `size` bytes of physical memory; its handle in *handle. */
  int (*vm_create)(void *state, int device, size_t size, uintptr_t *handle);
  /* Destroy physical memory; it must not be mapped. */
  int (*vm_destroy)(void *state, int device, uintptr_t handle);
  /* Map the whole of `handle` (size bytes) at addr, inside a reserved range. */
  int (*vm_map)(void *state, int device, uintptr_t addr, size_t size, uintptr_t handle);
  /* Unmap what is mapped at [addr, addr + size) (whole mappings). The
   * caller must have waited for work that uses it: like a free,
   * GCA_ERR_CORRUPT reports that it did not (the sim's race detector). */
  int (*vm_unmap)(void *state, int device, uintptr_t addr, size_t size);
  /* Optional (NULL: the core calls the ones above once per page). A
   * backend whose calls cost more than their work (the sim: a lock and a
   * look-up each) serves a run of pages in one. vm_create_many: what n
   * vm_create calls of `size` bytes would do, stopping at the first that
   * fails (its status returned), with *made created in handles[].
   * vm_destroy_many: n vm_destroy calls, each destroyed if it can be; the
   * last refusal's status, in *refused how many were, and the refused
   * handles moved to the front of handles[] in their order (the memory is
   * still the caller's, to give back later). vm_map_many:
   * handles[i] (each `size` bytes) mapped at addr + i * size, all or none. */
  int (*vm_create_many)(void *state, int device, size_t size, size_t n, uintptr_t *handles, size_t *made);
  int (*vm_destroy_many)(void *state, int device, uintptr_t *handles, size_t n, size_t *refused);
  int (*vm_map_many)(void *state, int device, uintptr_t addr, size_t size, size_t n, const uintptr_t *handles);
  /* Device facts and peers (may be NULL: the public calls then say the
   * backend has none). */
  int (*device_properties)(void *state, int device, gca_device_properties_t *out);
  int (*can_access_peer)(void *state, int device, int peer, int *can);
  int (*enable_peer_access)(void *state, int device, int peer);
  int (*disable_peer_access)(void *state, int device, int peer);
  int (*stream_priority_range)(void *state, int device, int *least, int *greatest);
  /* The driver's id of the graph capture `stream` is in, 0 when it is in
   * none (may be NULL: no stream is ever in one). The PyTorch drop-in's
   * graph pools bind a capture to a pool by it. */
  int (*stream_capture)(void *state, int device, gca_stream_t stream, uint64_t *capture_id);
  /* Page-locked host memory for the pinned host allocator (may be NULL). */
  int (*host_alloc)(void *state, size_t size, void **ptr);
  int (*host_free)(void *state, void *ptr);
  /* Page-lock `size` bytes of the caller's memory at ptr (cudaHostRegister),
   * and undo it (may be NULL: pinned_use_cuda_host_register then falls back
   * to host_alloc). */
  int (*host_register)(void *state, void *ptr, size_t size);
  int (*host_unregister)(void *state, void *ptr);
  /* Whether the backend knows `ptr` as page-locked host memory. */
  int (*host_is_pinned)(void *state, const void *ptr, int *pinned);
  /* Bytes added to every request before it is rounded (may be NULL: none).
   * torch_npu pads by 32 on SoCs before Ascend950; the configuration key
   * pad_32_bytes overrides what the backend says. */
  int (*size_pad)(void *state, int device, size_t *pad);
  /* What names the device across processes, whatever the visible-devices
   * variables (may be NULL: no cooperation between processes). */
  int (*device_identity)(void *state, int device, char *out, size_t cap);
  void (*destroy)(void *state);
  /* Free this process's state of the backend and nothing more: no driver
   * call, no change to memory other processes share (a child of fork
   * closing the allocator it inherited: the device's memory, contexts and
   * shared regions are its parent's). The driver's library stays loaded. */
  void (*forget)(void *state);
  /* In a child of fork, at once (may be NULL): let go of what would keep
   * the parent looking alive to other processes (the shared sim's region
   * file, whose lock byte marks the parent's slot). */
  void (*after_fork_child)(void *state);
  /* destroy() gives back all the device's memory at once (the sim, whose
   * device memory is its own bookkeeping): closing an allocator then need
   * not give it back a segment and a page at a time. A real device's
   * memory outlives the backend's state, so the CUDA backend says no. */
  bool destroy_releases_memory;
  /* Where blocks of 2 MiB and more start in expandable segments unless
   * base_addr_aligned_kb says otherwise: torch_npu aligns them to 16 KiB;
   * 0 (PyTorch) leaves them where the best fit puts them. */
  size_t base_align;
} backend_ops_t;

typedef struct backend {
  const backend_ops_t *ops;
  void *state;
} backend_t;

/* Open a backend from a spec ("sim", "sim:capacity=24GiB"). */
int gca__backend_open(const char *spec, backend_t *out);
/* The options of a backend that loads a library and takes no other option
 * ("KEY=PATH"): the path given, else $ENV when set and not empty, else
 * `fallback`; an unknown option names `backend` and is an error. */
int gca__backend_library_path(const char *backend, const char *options, const char *key, const char *env,
                              const char *fallback, char *path, size_t cap);
void gca__backend_close(backend_t *b);
/* The same, or for a child of fork's copy (`forked`) its `forget`. */
void gca__backend_close_as(backend_t *b, bool forked);

/* Handles a driver would not destroy (events, for the CUDA and Ascend
 * backends): still the driver's and ours, so kept and offered again, at the
 * next destroy and at close, rather than dropped. */
typedef struct gca__kept_handles {
  uintptr_t *items;
  size_t count, cap;
} kept_handles_t;
/* Keep h; false when out of host memory (then it is lost, and said).
 * `what` names them in messages, plural: "acl backend: events". */
bool gca__kept_handles_add(kept_handles_t *k, uintptr_t h, const char *what);
/* Destroy h with destroy(ctx, h) (0: destroyed), after offering the kept
 * ones again; h is kept when refused. */
void gca__kept_handles_destroy(kept_handles_t *k, int (*destroy)(void *ctx, uintptr_t h), void *ctx, uintptr_t h,
                               const char *what);
/* Offer each kept handle to destroy(ctx, h) (0: destroyed); those refused
 * stay. With `last`, the array goes too, and those refused are logged as
 * left to the driver. */
void gca__kept_handles_retry(kept_handles_t *k, int (*destroy)(void *ctx, uintptr_t h), void *ctx, bool last,
                             const char *what);

/* The sim backend (backend/sim.c). */
int gca__sim_backend_create(const char *options, backend_t *out);
/* The CUDA backend (backends/cuda.c): the driver API through dlopen. */
int gca__cuda_backend_create(const char *options, backend_t *out);
/* The Ascend backend (backends/acl.c): AscendCL's runtime through dlopen. */
int gca__acl_backend_create(const char *options, backend_t *out);

#endif /* GCALLOC_BACKEND_H */
