/* The simulated device's driver API: what tests, benchmarks and the replay
 * toolkit ask of the sim backend beyond the backend interface (its counts
 * of what it was asked, its graph-capture model, work queued on its streams,
 * its placement of segments, its clock). Nothing of the allocator uses it:
 * the allocator sees the sim through backend.h alone. */
#ifndef GCALLOC_SIM_DRIVER_H
#define GCALLOC_SIM_DRIVER_H

#include "backends/backend.h"

/* The most memory a sim device may have (each device's addresses are a
 * range of twice that). */
#define SIM_MAX_CAPACITY ((size_t)1 << 43) /* 8 TiB */

/* Ground truth kept by the sim device, for tests that check the allocator's
 * own counting against the device's. */
typedef struct sim_counters {
  uint64_t malloc_calls;     /* every request, failed ones included */
  uint64_t mallocs;          /* successful allocations */
  uint64_t frees;
  uint64_t live;             /* allocations not yet freed */
  size_t used;               /* bytes in live allocations */
  size_t capacity;
  uint64_t launches;         /* work queued with sim_launch */
  uint64_t events_recorded;  /* event_record calls, failed ones included */
  uint64_t events_live;      /* recorded and not yet destroyed */
  uint64_t stream_waits;     /* stream_wait_event calls */
  uint64_t host_waits;       /* event or stream synchronizations */
  uint64_t hazards;          /* unordered uses of memory, device frees of memory in use */
  uint64_t free_calls;       /* every free, failed ones included */
  /* Virtual memory. Physical memory counts in `used` and, as an
   * allocation, in malloc_calls (so fault injection reaches it). */
  uint64_t vm_reserved;      /* bytes of address space reserved now */
  uint64_t vm_handles;       /* physical allocations alive */
  uint64_t vm_mapped;        /* bytes mapped now */
  uint64_t vm_maps, vm_unmaps;
  /* Pinned host memory (one host for all devices: the same in each). */
  uint64_t host_calls;       /* host_alloc and host_register calls, failed ones included */
  uint64_t host_live;        /* ranges allocated or registered now */
  size_t host_used;          /* bytes in them */
  uint64_t host_unbacked_pages; /* pages not yet backed when registered (mincore), all registrations */
  uint64_t capture_violations; /* calls refused while a stream was captured (gca__sim_set_capture) */
  uint64_t copied_to_host, copied_to_device; /* bytes copied (copy_to_host / copy_to_device) */
} sim_counters_t;

/* Fills *out for a sim backend; GCA_ERR_INVALID for any other backend. */
int gca__sim_get_counters(const backend_t *b, int device, sim_counters_t *out);
/* Model graph capture on the device (as the application's
 * cudaStreamBeginCapture and EndCapture would): while on, device frees,
 * unmaps, physical memory destroys, address range releases, event records,
 * queries and synchronizations, stream waits and synchronizations fail and
 * count in capture_violations. */
int gca__sim_set_capture(const backend_t *b, int device, bool on);

/* Driving the sim's device model (tests, benchmarks, replay). Time is
 * simulated: it moves only when sim_advance is called or when the host waits
 * (an event or stream synchronization moves it to the moment the awaited
 * work completes). Streams are independent of each other (as CUDA streams
 * created non-blocking): only events order them.
 *
 * Queue `duration_ns` of work on `stream` that uses [addr, addr + size) (size
 * 0: no memory). It starts when the stream's earlier work and every event
 * the stream was made to wait for have completed. If that memory is in use by
 * work of another stream that is not ordered before it, or later freed while
 * the work is pending, the sim counts a hazard and the call (or the free)
 * fails naming both; the work is queued either way. */
int gca__sim_launch(const backend_t *b, int device, gca_stream_t stream, uint64_t duration_ns, uintptr_t addr,
                    size_t size);
/* Where device allocations go (the replay's: docs/replay.md, "the start as
 * PyTorch had it"): a list of (size, address) in the order they are
 * expected, addresses as another device gave them; `origin` of those is
 * put at the device's first address, the others at the same distance from
 * it. An allocation of the next entry's size takes its address when that
 * range is free, and the entry is used up either way; any other
 * allocation goes first fit, as without a list. Ties between free blocks of
 * one size are broken by address, so where segments lie decides which a
 * request takes. Replaces any list given before (n 0: none).
 * GCA_ERR_INVALID for another backend, GCA_ERR_NOMEM. */
typedef struct sim_place {
  uint64_t size, addr;
} sim_place_t;
int gca__sim_set_placement(const backend_t *b, int device, const sim_place_t *places, size_t n, uint64_t origin);

/* Move simulated time forward; work and events due by then complete. */
void gca__sim_advance(const backend_t *b, uint64_t ns);
/* The simulated time in ns since the backend was opened. */
uint64_t gca__sim_now(const backend_t *b);
/* When the work queued so far on `stream` completes (<= now: idle). */
uint64_t gca__sim_stream_ready_at(const backend_t *b, int device, gca_stream_t stream);

#endif /* GCALLOC_SIM_DRIVER_H */
