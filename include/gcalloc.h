/* gcalloc: a caching allocator for accelerator (GPU/NPU) memory.
 *
 * This is the whole public interface. An allocator (gca_allocator_t) is opened
 * on a backend (the simulated device "sim" by default) and manages every
 * device that backend exposes. Each device has its own caching core with
 * PyTorch's CUDACachingAllocator semantics: requests are rounded, served from
 * a small (<= 1 MiB) or a large pool by best fit over (stream, size, address),
 * blocks are split and merged inside segments obtained from the device, and
 * freed memory stays cached until gca_empty_cache() gives whole free segments
 * back. Blocks used on several streams are reused only once the work queued
 * on those streams has completed (gca_record_stream). Configuration uses
 * PyTorch's PYTORCH_CUDA_ALLOC_CONF syntax and the statistics carry
 * PyTorch's memory_stats() names and meanings.
 *
 * Errors: calls that return int return GCA_OK (0) or a negative gca_status;
 * calls that return a pointer return NULL on failure. Either way the reason is
 * kept in a thread-local message, read with gca_last_error(). The library
 * never prints unless the log handler does, and never exits the process.
 *
 * Threads: every call may be made from any thread at any time, except that
 * gca_close() must not race with other calls on the same allocator.
 */
#ifndef GCALLOC_H
#define GCALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* GCALLOC_VERSION_MAJOR, _MINOR, _PATCH and GCALLOC_VERSION_STRING ("0.4.0"),
 * written by the build from CMakeLists.txt's version. */
#include "gcalloc_version.h"

/* Visibility: the shared library exports only what is declared here. */
#if defined(__GNUC__) && !defined(GCA_STATIC_ONLY)
#define GCA_API __attribute__((visibility("default")))
#else
#define GCA_API
#endif

/* ------------------------------------------------------------------------ */
/* Status codes and errors                                                   */
/* ------------------------------------------------------------------------ */

typedef enum gca_status {
  GCA_OK = 0,
  GCA_ERR_INVALID = -1,      /* a bad argument: NULL handle, bad device, bad size */
  GCA_ERR_OOM = -2,          /* the device has no memory left for the request */
  GCA_ERR_CONFIG = -3,       /* a configuration string was malformed or out of range */
  GCA_ERR_BACKEND = -4,      /* unknown backend, bad backend options, or a driver failure */
  GCA_ERR_BAD_POINTER = -5,  /* free of a pointer this allocator did not hand out (or freed twice) */
  GCA_ERR_NOMEM = -6,        /* the host ran out of memory for bookkeeping */
  GCA_ERR_CORRUPT = -7,      /* gca_check() found a broken invariant */
  GCA_ERR_IO = -8            /* a file could not be read or written */
} gca_status;

/* The message explaining the last failure on the calling thread ("" if none).
 * The text stays valid until the next failing gcalloc call on this thread. */
GCA_API const char *gca_last_error(void);

/* The last failure's status on the calling thread (GCA_OK if none). */
GCA_API gca_status gca_last_status(void);

/* A short constant name for a status, e.g. "GCA_ERR_OOM". */
GCA_API const char *gca_status_name(int status);

/* Library version as "MAJOR.MINOR.PATCH". */
GCA_API const char *gca_version(void);

/* ------------------------------------------------------------------------ */
/* Logging                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum gca_log_level {
  GCA_LOG_OFF = 0,
  GCA_LOG_ERROR = 1,   /* a device failure gcalloc handled itself (a refused free, an event waited out) */
  GCA_LOG_WARNING = 2, /* something was ignored or is not built yet */
  GCA_LOG_INFO = 3,    /* allocators opened and closed */
  GCA_LOG_DEBUG = 4,   /* failed calls, with their message (the caller has the status too) */
  GCA_LOG_TRACE = 5    /* every call: malloc, free, record_stream, empty_cache */
} gca_log_level;

/* Messages up to this level are logged (GCA_LOG_OFF: none). Read at the
 * first gcalloc call from GCALLOC_LOG=off|error|warn|info|debug|trace
 * (default warn); GCALLOC_LOG_FILE=path sends the default handler's output
 * to that file instead of stderr. Checking the level costs a call one
 * predictable branch. Returns the previous level. */
GCA_API gca_log_level gca_set_log_level(gca_log_level level);
GCA_API gca_log_level gca_get_log_level(void);

/* Receives every message the library logs. `message` has no trailing newline
 * and is valid only during the call. Called without any lock of the library
 * held (a message logged inside a locked region is delivered when the
 * thread leaves it), so the handler may call back into gcalloc; the
 * caller's gca_last_error() is the same after it as before. */
typedef void (*gca_log_fn)(gca_log_level level, const char *message, void *user);

/* Install a process-wide log handler; NULL restores the default, which writes
 * "gcalloc: LEVEL: ..." to stderr (or GCALLOC_LOG_FILE); warnings only once
 * per distinct message. */
GCA_API void gca_set_log_handler(gca_log_fn fn, void *user);

/* A handler for the messages logged on the calling thread only, taking
 * precedence over the process-wide one (and the default) until it is
 * removed with NULL: a binding turns the warnings of one call into its
 * language's warnings this way (the Python package does, around the calls
 * that apply a configuration). Messages held while a lock is are delivered
 * on the same thread, so they reach it too. */
GCA_API void gca_set_thread_log_handler(gca_log_fn fn, void *user);

/* ------------------------------------------------------------------------ */
/* Opening an allocator                                                      */
/* ------------------------------------------------------------------------ */

typedef struct gca_allocator gca_allocator_t;

/* A stream is an opaque handle (a cudaStream_t on CUDA). 0 is the default
 * stream. Memory is cached per stream, as in PyTorch: a block freed by the
 * stream it was allocated on is reused at once by that stream (its work runs
 * in order), and by other streams only through gca_record_stream's events or
 * the cross_stream_reuse setting. */
typedef uintptr_t gca_stream_t;

/* Open an allocator on a backend.
 *
 * `backend` is "NAME" or "NAME:key=value,key=value". NULL or "" means "sim".
 * The sim backend is a model of a device whose addresses are never touched,
 * so an 80 GiB device needs no host memory. Its options:
 *   capacity=SIZE     bytes per device, with an optional unit B, KiB, MiB,
 *                     GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of
 *                     1000); default 80GiB
 *   devices=N         number of devices, 1..64; default 1
 *   fail_at=N         the Nth device allocation (counting from 1) fails
 *   fail_after=N      every device allocation after the first N fails
 *   fail_rate=P       each device allocation fails with probability P in [0,1]
 *   seed=S            seed of the fail_rate generator; default 1
 *   latency_ns=T      every device call (allocate, free) takes T ns longer
 *   event_fail_at=N   the Nth event record fails (a driver error)
 *   wait_fail_at=N    the Nth host wait for an event or stream fails
 *   backed=0|1        1: back allocations with host memory so they can be
 *                     written and read (tests); default 0
 *   engines=N         at most N pieces of queued work run at once (0: no limit)
 * Streams on the sim run work queued by its test and benchmark drivers in
 * simulated time (docs/sim-backend.md); with none queued, every event has
 * completed when recorded.
 *
 * `config` is a PyTorch-style allocator configuration (see gca_set_config);
 * it is applied on top of the environment's, which is read from the first set
 * of GCALLOC_ALLOC_CONF, PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF. NULL or
 * "" adds nothing.
 *
 * On success stores the allocator in *out and returns GCA_OK. */
GCA_API int gca_open(const char *backend, const char *config, gca_allocator_t **out);

/* Give every segment back to the device and free the allocator. Blocks still
 * allocated are released with it (their pointers become invalid). On the
 * simulated device, whose memory goes away with the allocator, segments are
 * not given back one by one first. NULL is a no-op.
 *
 * fork: a child inherits its parent's open allocators detached. Every call
 * on an inherited allocator fails with GCA_ERR_INVALID, naming the process
 * that opened it, but gca_close, which frees the child's copy of the books
 * and nothing of the parent's: no device memory, event or pinned block is
 * given back, the parent's slot in a rendezvous (ipc_cooperation) and its
 * share of a shared simulated device stay its own. The child opens its own
 * allocator. A fork waits for the calls in progress on other threads to
 * leave their devices (their locks are taken before it, let go after), so
 * the child's copy is whole. Closing from inside the queue drain or the
 * segment observer fails the same way, and leaves the allocator open. */
GCA_API void gca_close(gca_allocator_t *a);

/* Number of devices the allocator manages (>= 1), or a negative status. */
GCA_API int gca_device_count(const gca_allocator_t *a);

/* The backend's name, e.g. "sim". */
GCA_API const char *gca_backend_name(const gca_allocator_t *a);

/* The CUDA backend: "cuda" or "cuda:driver=PATH". The driver is loaded at
 * run time from PATH, else from $GCALLOC_CUDA_DRIVER, else libcuda.so.1; the
 * library never links it. Where none can be loaded gca_open fails with
 * GCA_ERR_BACKEND and a message that says "no CUDA driver" and why. Every
 * device the driver sees is managed, each in its primary context (the one
 * the CUDA runtime and PyTorch use). Streams are CUstream/cudaStream_t
 * handles; 0 is the legacy default stream. Driver failures come back as
 * gcalloc statuses whose message names the driver call and the driver's
 * error name (CUDA_ERROR_OUT_OF_MEMORY is GCA_ERR_OOM). See docs/cuda.md. */

/* ------------------------------------------------------------------------ */
/* Devices                                                                   */
/* ------------------------------------------------------------------------ */

/* (Its tag differs from the function's name so that C++ code including this
 * header does not see the function hide the struct: -Wshadow.) */
typedef struct gca_device_properties_s {
  char name[256];            /* e.g. "NVIDIA H100 80GB HBM3" */
  int major, minor;          /* compute capability */
  int multiprocessor_count;
  uint64_t total_memory;     /* bytes */
} gca_device_properties_t;

/* The device's name, compute capability, multiprocessor count and memory.
 * The sim reports "gcalloc sim device", capability 0.0, no multiprocessors
 * and its capacity. */
GCA_API int gca_device_properties(gca_allocator_t *a, int device, gca_device_properties_t *out);

/* The memory an allocation was carved from (PyTorch's getBaseAllocation,
 * which IPC and storage sharing use): for `ptr`, the start of a live
 * allocation, the start and size of its segment; for one in an expandable
 * segment (an address range reserved for a whole pool), the allocation's
 * own block. GCA_ERR_BAD_POINTER for any other pointer. `size` may be NULL. */
GCA_API int gca_base_allocation(gca_allocator_t *a, void *ptr, void **base, size_t *size);

/* Peer access between two devices of the allocator (cuDeviceCanAccessPeer,
 * cuCtxEnablePeerAccess, cuCtxDisablePeerAccess): *can is 1 if `device` can
 * read and write `peer`'s memory once enabled. Enabling twice, or disabling
 * what is not enabled, fails with the driver's error. GCA_ERR_BACKEND on a
 * backend without peers (the sim). */
GCA_API int gca_can_access_peer(gca_allocator_t *a, int device, int peer, int *can);
GCA_API int gca_enable_peer_access(gca_allocator_t *a, int device, int peer);
GCA_API int gca_disable_peer_access(gca_allocator_t *a, int device, int peer);

/* The range of stream priorities of the device (cuCtxGetStreamPriorityRange):
 * *least (usually 0) to *greatest (negative: more urgent). */
GCA_API int gca_stream_priority_range(gca_allocator_t *a, int device, int *least, int *greatest);

/* ------------------------------------------------------------------------ */
/* Allocation                                                                */
/* ------------------------------------------------------------------------ */

/* Allocate `size` bytes on `device` for use on `stream`.
 * Size 0 returns NULL with status GCA_OK (as PyTorch does: nothing to hold).
 * A request the cache cannot serve climbs PyTorch's ladder: free-memory
 * callbacks, garbage collection (with a memory fraction and
 * garbage_collection_threshold), a new segment from the device (refused
 * beyond the memory fraction), release of cached oversize blocks, release of
 * every cached segment after waiting for all events, one more try; then,
 * beyond PyTorch, waiting for memory other threads give back
 * (oom_retry_timeout_ms) and OOM handlers (gca_add_oom_handler).
 * On failure returns NULL: GCA_ERR_OOM when all of that failed (the message
 * is PyTorch's "out of memory" text plus the largest free block, free memory
 * by pool and stream, memory waiting for other streams, and the setting that
 * would help; OOM observers are told), GCA_ERR_INVALID for a bad device or a
 * size too large to round.
 * The returned pointer is a device address, aligned to 512 bytes. */
GCA_API void *gca_malloc(gca_allocator_t *a, size_t size, int device, gca_stream_t stream);

/* Free a pointer returned by gca_malloc. NULL is a no-op returning GCA_OK.
 * A pointer that is not the start of a live allocation (unknown, inside a
 * block, or already freed) returns GCA_ERR_BAD_POINTER and changes nothing.
 * The allocated statistics drop at once. If the block was used on other
 * streams (gca_record_stream), an event is recorded on each of them and the
 * block is reused only once they have all completed (the active statistics
 * drop then); otherwise it is free for its stream at once. */
GCA_API int gca_free(gca_allocator_t *a, void *ptr);

/* ------------------------------------------------------------------------ */
/* Streams                                                                   */
/* ------------------------------------------------------------------------ */

/* Declare that the allocation at `ptr` is used by work on `stream` (PyTorch's
 * Tensor.record_stream). When it is freed, its memory is not reused before
 * the work queued on `stream` up to the free has completed. A use on the
 * stream it was allocated for needs no declaring and is ignored. Returns
 * GCA_ERR_BAD_POINTER if `ptr` is not a live allocation, GCA_ERR_NOMEM if the
 * use cannot be recorded (then nothing changed). */
GCA_API int gca_record_stream(gca_allocator_t *a, void *ptr, gca_stream_t stream);

/* Forget a use gca_record_stream recorded: the allocation's free no longer
 * waits for `stream` (torch_npu's eraseStream, which its process groups call
 * once they have ordered the stream themselves). A stream never recorded,
 * or an allocation freed already whose free waits for its streams: nothing
 * changes (the free completes when the events recorded at it do).
 * GCA_ERR_BAD_POINTER for a pointer that is neither. A trace file (GCALLOC_TRACE_FILE) has no line for it: when
 * the free completes, which it changes, is written. */
GCA_API int gca_erase_stream(gca_allocator_t *a, void *ptr, gca_stream_t stream);

/* Complete the deferred frees whose events have completed, per stream in
 * order (every gca_malloc does this too). device = -1: every device. */
GCA_API int gca_process_events(gca_allocator_t *a, int device);

/* Wait for every outstanding event of `device` (-1: every device) and
 * complete every deferred free and deferred device free. Counted in
 * num_sync_all_streams. */
GCA_API int gca_synchronize(gca_allocator_t *a, int device);

/* 1 if the allocator runs in launch-blocking mode, 0 if not. The mode is read
 * at gca_open from the first set of GCALLOC_LAUNCH_BLOCKING,
 * CUDA_LAUNCH_BLOCKING, ASCEND_LAUNCH_BLOCKING ("1" on, "0" off): every free and
 * every device free then completes before the call returns, waiting for the
 * streams involved, so a misuse shows up where it happens. For debugging: it
 * is slow. */
GCA_API int gca_launch_blocking(const gca_allocator_t *a);

/* 1 if the allocator caches nothing, 0 if it caches. Read at gca_open from
 * PYTORCH_NO_CUDA_MEMORY_CACHING (PYTORCH_NO_NPU_MEMORY_CACHING on the acl
 * backend), as PyTorch and torch_npu read it: set to anything but "0", every
 * free gives the memory no allocation still uses back to the device at once
 * (as gca_empty_cache does), so that a memory checker sees each allocation.
 * For debugging: it is slow. Statistics are kept as usual. */
GCA_API int gca_no_caching(const gca_allocator_t *a);

/* A framework that queues device work on the host and launches it later from
 * another thread (torch_npu's task queue, TASK_QUEUE_ENABLE) must have that
 * queue emptied before the allocator gives memory back to the device: an
 * event the allocator records completes when the work already launched has,
 * not the work still in the host queue. `fn(device, user)` empties it: a
 * cached segment into which a block was freed goes back to the device (a
 * whole segment freed, expandable pages unmapped or moved) only once a call
 * begun after that free has returned; a pool is drained before it pauses,
 * whatever was freed. It is called from whichever thread releases
 * (gca_empty_cache, the out-of-memory ladder, garbage collection, a peer's
 * request, gca_pool_pause, gca_pool_release, gca_close) only when such a
 * release is due, with no lock of gcalloc's held: so the framework's own
 * locks (Python's GIL, which torch_npu's drain gives up and takes back) can
 * only be taken before gcalloc's, never after. Any call works from inside
 * it, on any thread; a drain whose calls make it due again is called inside
 * itself once, no deeper. It may throw a C++ exception or longjmp: gcalloc's
 * frames (compiled with unwind tables) hold nothing at that point, the
 * releases it was for are skipped, and the next release calls it again.
 * The device is then synchronized through the backend before anything goes
 * back. NULL: none (the default). The torch_npu drop-in connects torch_npu's
 * own drain, c10_npu::npuSynchronizeDevice (docs/acl.md). */
typedef void (*gca_queue_drain_fn)(int device, void *user);
GCA_API int gca_set_queue_drain(gca_allocator_t *a, gca_queue_drain_fn fn, void *user);

/* The size the allocation at `ptr` really occupies (its rounded block size),
 * or 0 with the error set if `ptr` is not a live allocation. */
GCA_API size_t gca_usable_size(gca_allocator_t *a, void *ptr);

/* Wait for every outstanding event (as gca_synchronize), then give every
 * fully free cached segment of `device` back to the backend (device = -1:
 * every device) and wait until the backend has them: a segment's device free
 * waits for the work queued on its stream. Counted in num_device_free. */
GCA_API int gca_empty_cache(gca_allocator_t *a, int device);

/* Free and total memory of the device as the backend reports it (the whole
 * device, other users included, like cudaMemGetInfo). */
GCA_API int gca_mem_get_info(gca_allocator_t *a, int device, size_t *free_bytes, size_t *total_bytes);

/* Limit what the allocator may reserve on `device` to fraction x the
 * device's total memory (torch.cuda.set_per_process_memory_fraction): a new
 * segment that would pass it is refused without asking the device, so the
 * cache is released and the request retried as when the device is full.
 * Setting a fraction (even 1) also enables garbage_collection_threshold.
 * GCA_ERR_INVALID unless 0 <= fraction <= 1; memory already reserved above a
 * lowered limit stays until it is freed. The configuration key
 * per_process_memory_fraction sets every device's. */
GCA_API int gca_set_memory_fraction(gca_allocator_t *a, double fraction, int device);

/* The fraction in force on `device` (1 when none was set). */
GCA_API int gca_get_memory_fraction(gca_allocator_t *a, int device, double *fraction);

/* ------------------------------------------------------------------------ */
/* When memory runs out                                                      */
/* ------------------------------------------------------------------------ */

/* Callbacks are kept per allocator (at most 32 of each kind), called in the
 * order they were added, on the allocating thread, with no lock of the
 * library held (trace recording's included): they may call any gcalloc
 * function but gca_close of this allocator, and must not wait for another
 * thread that is allocating on the same device. Adding the same
 * function twice calls it twice; removing takes out the first match of
 * (fn, user), or fails with GCA_ERR_INVALID. */

/* Free-memory callback (PyTorch's FreeMemoryCallback): run at every cache
 * miss, before the device is asked for memory. Return nonzero if it freed
 * memory into the cache, and the cache is searched again. `size` is the
 * rounded request. */
typedef int (*gca_free_memory_fn)(int device, size_t size, void *user);
GCA_API int gca_add_free_memory_callback(gca_allocator_t *a, gca_free_memory_fn fn, void *user);
GCA_API int gca_remove_free_memory_callback(gca_allocator_t *a, gca_free_memory_fn fn, void *user);

/* OOM observer (PyTorch's attachOutOfMemoryObserver): told of every
 * allocation that fails for want of memory, just before gca_malloc returns
 * NULL: the size asked of the device, the limit (allowed bytes if a memory
 * fraction is set, else the device's total) and the device's free bytes.
 * gca_last_error() still holds the OOM message after observers run. */
typedef void (*gca_oom_observer_fn)(int device, size_t size, size_t limit, size_t free_bytes, void *user);
GCA_API int gca_add_oom_observer(gca_allocator_t *a, gca_oom_observer_fn fn, void *user);
GCA_API int gca_remove_oom_observer(gca_allocator_t *a, gca_oom_observer_fn fn, void *user);

/* OOM handler (beyond PyTorch): called when the whole ladder, and any wait,
 * has failed. It may free memory (spill a cache, drop tensors) and return
 * nonzero to ask for another try; the allocation is tried again, at most
 * oom_handler_retries times (default 3), before it fails. */
typedef int (*gca_oom_handler_fn)(int device, size_t size, void *user); /* as gca_free_memory_fn */
GCA_API int gca_add_oom_handler(gca_allocator_t *a, gca_oom_handler_fn fn, void *user);
GCA_API int gca_remove_oom_handler(gca_allocator_t *a, gca_oom_handler_fn fn, void *user);

/* ------------------------------------------------------------------------ */
/* Configuration                                                             */
/* ------------------------------------------------------------------------ */

/* Apply a configuration string in PyTorch's syntax, "key:value,key:value",
 * with list values in brackets ("roundup_power2_divisions:[256:1,>:4]") and
 * booleans True/False. Keys (see docs/configuration.md):
 *   max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions,
 *   garbage_collection_threshold, expandable_segments,
 *   release_lock_on_cudamalloc, pinned_use_cuda_host_register,
 *   pinned_num_register_threads, pinned_use_background_threads,
 *   pinned_reserve_segment_size_mb,
 *   per_process_memory_fraction, backend, and gcalloc's own
 *   oom_retry_timeout_ms (default 0: an allocation the device cannot serve
 *   after the whole ladder waits up to this long for other threads to free
 *   memory, woken by each free, retrying with exponential backoff),
 *   oom_handler_retries (default 3: how many times OOM handlers may ask
 *   for another try), stitching (True/False, default False: with
 *   expandable_segments:True, before mapping new memory for a miss, move
 *   whole free pages of the same pool and stream into place; see
 *   docs/defrag.md), and
 *   cross_stream_reuse (True, False or a size ratio >= 1; default False: on
 *   a miss, before asking the device for memory, move a whole segment cached
 *   for another stream to the requesting stream, which is first made to wait
 *   for that stream's work; a ratio R moves only segments at most R times
 *   the size the device would be asked for; see docs/streams.md).
 * Unlike PyTorch, keys not named keep their current values. A key whose
 * feature is not built yet is accepted and logged as a warning; an unknown key
 * is logged and ignored. A malformed or out-of-range value fails with
 * GCA_ERR_CONFIG naming the key, the value and the rule, and then no key of
 * the string takes effect. Applies to every device of the allocator.
 * ipc_cooperation and ipc_group_access are read at gca_open only: a string
 * that changes either fails with GCA_ERR_CONFIG saying so (one that repeats
 * the value in force is fine). */
GCA_API int gca_set_config(gca_allocator_t *a, const char *config);

/* Write the settings in force as a configuration string that gca_set_config
 * accepts (always NUL-terminated, truncated to `cap`). Returns the length the
 * full string needs, excluding the NUL, or a negative status. */
GCA_API int gca_get_config(gca_allocator_t *a, char *buf, size_t cap);

/* ------------------------------------------------------------------------ */
/* Statistics                                                                */
/* ------------------------------------------------------------------------ */

/* One statistic, as PyTorch keeps it: increase(n) adds n to current and to
 * allocated and raises peak to current; decrease(n) subtracts n from current
 * and adds n to freed. */
typedef struct gca_stat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} gca_stat_t;

/* Index of the pool breakdown of a stat family. */
enum { GCA_POOL_ALL = 0, GCA_POOL_SMALL = 1, GCA_POOL_LARGE = 2, GCA_POOL_KINDS = 3 };

/* A device's statistics, with the meanings of torch.cuda.memory_stats():
 *   allocation / allocated_bytes: blocks handed out and not yet freed;
 *   segment / reserved_bytes: memory obtained from the device;
 *   active / active_bytes: allocated blocks plus freed ones whose free has
 *     not completed (deferred by stream events);
 *   inactive_split / inactive_split_bytes: free blocks inside split segments
 *     (memory that empty_cache cannot return);
 *   requested_bytes: the sizes callers asked for (before rounding);
 *   oversize_*: allocations and segments >= max_split_size. */
typedef struct gca_stats {
  gca_stat_t allocation[GCA_POOL_KINDS];
  gca_stat_t segment[GCA_POOL_KINDS];
  gca_stat_t active[GCA_POOL_KINDS];
  gca_stat_t inactive_split[GCA_POOL_KINDS];
  gca_stat_t allocated_bytes[GCA_POOL_KINDS];
  gca_stat_t reserved_bytes[GCA_POOL_KINDS];
  gca_stat_t active_bytes[GCA_POOL_KINDS];
  gca_stat_t inactive_split_bytes[GCA_POOL_KINDS];
  gca_stat_t requested_bytes[GCA_POOL_KINDS];
  gca_stat_t oversize_allocations;
  gca_stat_t oversize_segments;
  int64_t num_alloc_retries;    /* device allocations retried after emptying the cache */
  int64_t num_ooms;             /* out-of-memory failures returned to callers */
  int64_t num_sync_all_streams; /* times every stream was synchronized */
  int64_t num_device_alloc;     /* successful device (segment) allocations */
  int64_t num_device_free;      /* device (segment) frees */
  int64_t max_split_size;       /* bytes, -1 when unlimited */
  /* gcalloc's own (not in torch.cuda.memory_stats(), not flattened): */
  int64_t num_cross_stream_reuses;  /* segments moved from another stream's cache */
  int64_t num_device_free_failures; /* segment frees the device refused (kept cached) */
  int64_t num_gc_releases;          /* segments given back by garbage collection */
  int64_t num_alloc_waits;          /* allocations that waited for memory to come back */
  int64_t num_oom_handler_retries;  /* tries made again because an OOM handler asked */
  int64_t num_pages_moved;          /* stitching: free pages of expandable segments mapped elsewhere */
  /* Cooperation between processes (ipc_cooperation:True, docs/sharing.md): */
  int64_t num_ipc_requests;         /* requests made to the other processes (one per allocation that asked any) */
  int64_t ipc_bytes_received;       /* bytes they released in answer */
  int64_t num_ipc_timeouts;         /* asked processes that did not answer in time */
  /* Requests refused outright by per_process_memory_fraction under
   * throw_on_cudamalloc_oom / throw_on_npumalloc_oom (PyTorch's and
   * torch_npu's num_oom_rejections, flattened as theirs). */
  int64_t num_oom_rejections;
  int64_t num_ipc_peers_asked;      /* other processes asked, over all requests (ipc_cooperation:True) */
  /* Out-of-memory errors raised while the live (allocated) bytes of all the
   * cooperating processes, as they last published them (at most 100 ms
   * old), plus the request fit the device, and the request fit this
   * process's memory fraction: memory that was only cache, somewhere, was
   * not had in time (ipc_cooperation:True; docs/sharing.md). */
  int64_t num_avoidable_ooms;
  /* Stitching: waits for a stream's queued work before moving pages (one
   * per miss served with moved pages): each a stall of the host on a real
   * device. */
  int64_t num_stitch_waits;
  /* Rounds of requests to the other processes: an out-of-memory asks them
   * again while they still release something (num_ipc_requests counts it
   * once). */
  int64_t num_ipc_rounds;
  /* At the last out-of-memory with cooperation on: device memory in use by
   * no cooperating process (processes without ipc_cooperation:True, the
   * driver), which no request can get back; num_avoidable_ooms leaves it
   * out of what could have fit. */
  int64_t ipc_outside_bytes;
} gca_stats_t;

/* Copy a consistent view of `device`'s statistics. */
GCA_API int gca_get_stats(gca_allocator_t *a, int device, gca_stats_t *out);

/* Set every peak to its current value (torch.cuda.reset_peak_memory_stats). */
GCA_API int gca_reset_peak_stats(gca_allocator_t *a, int device);

/* Zero every allocated/freed total and the num_* counters
 * (torch.cuda.reset_accumulated_memory_stats). */
GCA_API int gca_reset_accumulated_stats(gca_allocator_t *a, int device);

/* Bytes currently allocated / reserved on `device` (0 for a bad device).
 * Lock-free: safe and cheap to call from any thread at any rate; the value
 * may lag a concurrent allocation by that one allocation. */
GCA_API int64_t gca_allocated_bytes(const gca_allocator_t *a, int device);
GCA_API int64_t gca_reserved_bytes(const gca_allocator_t *a, int device);

/* One entry of the flat form of the statistics. */
typedef struct gca_stat_item {
  const char *name; /* static string, e.g. "allocated_bytes.all.current" */
  int64_t value;
} gca_stat_item_t;

/* Number of entries gca_stats_flatten produces. */
#define GCA_STATS_FLAT_COUNT 123

/* Write the statistics as (name, value) pairs with exactly the keys of
 * torch.cuda.memory_stats(), in its (sorted) order, into items[0..cap).
 * Returns the number of entries available (GCA_STATS_FLAT_COUNT); writes at
 * most cap of them. */
GCA_API size_t gca_stats_flatten(const gca_stats_t *stats, gca_stat_item_t *items, size_t cap);

/* ------------------------------------------------------------------------ */
/* Pinned host memory (docs/pinned.md)                                       */
/* ------------------------------------------------------------------------ */

/* A caching allocator of page-locked host memory with the semantics of
 * PyTorch's CachingHostAllocator (torch's pin_memory): sizes round up to a
 * power of two and each power of two has its own free list (most recently
 * freed first); blocks are never split; a block used by work on streams
 * (gca_host_record_stream) goes back to its list only when the events
 * recorded on those streams at its free have completed. One per allocator,
 * shared by all its devices. On a cache miss the memory comes from the
 * backend (cuMemHostAlloc on CUDA), or, with
 * pinned_use_cuda_host_register:True, from malloc, pre-faulted by
 * pinned_num_register_threads threads, then registered (cuMemHostRegister). */

/* Allocate `size` bytes of pinned host memory (page-aligned; the block is
 * the next power of two). Size 0 returns NULL with status GCA_OK. Completed
 * events are collected first; on a miss, the blocks of the same size whose
 * events have completed are looked for before new memory is pinned. If
 * pinning fails for want of memory, the cached blocks are given back and it
 * is tried once more (PyTorch fails at once). On failure returns NULL:
 * GCA_ERR_OOM naming the size and what is cached, GCA_ERR_INVALID for a size
 * too large to round, GCA_ERR_BACKEND for a backend with no pinned memory. */
GCA_API void *gca_host_malloc(gca_allocator_t *a, size_t size);

/* Free a pointer returned by gca_host_malloc (NULL: a no-op). A pointer that
 * is not the start of a live block (unknown, inside one, freed already)
 * returns GCA_ERR_BAD_POINTER and changes nothing. The block is cached, not
 * unpinned; if it was used on streams, an event is recorded on each and it
 * is reused only once they have all completed. */
GCA_API int gca_host_free(gca_allocator_t *a, void *ptr);

/* Declare that the pinned block holding `ptr` (any address inside it, as a
 * view of a tensor would give) is used by work on `stream` of `device`
 * (PyTorch's CachingHostAllocator_recordEvent, called by copies from pinned
 * memory). GCA_ERR_BAD_POINTER if no live block holds `ptr` (PyTorch
 * returns false then), GCA_ERR_NOMEM if the use cannot be recorded. */
GCA_API int gca_host_record_stream(gca_allocator_t *a, void *ptr, int device, gca_stream_t stream);

/* Collect completed events, then unpin every cached block (blocks in use or
 * waiting for their events stay). If the backend refuses to free a block,
 * it stays cached and the backend's error is returned after the others are
 * freed. */
GCA_API int gca_host_empty_cache(gca_allocator_t *a);

/* *pinned = 1 if `ptr` points into page-locked host memory: a block of this
 * allocator, or, where the backend can tell, memory pinned by anyone
 * (cuPointerGetAttribute on CUDA, as torch's is_pinned). */
GCA_API int gca_host_is_pinned(gca_allocator_t *a, const void *ptr, int *pinned);

/* The size of the live pinned block starting at `ptr` (the power of two),
 * or 0 with the error set. */
GCA_API size_t gca_host_usable_size(gca_allocator_t *a, void *ptr);

/* Durations in microseconds (PyTorch's DurationStat). */
typedef struct gca_duration_stat {
  int64_t total, max, min, count;
} gca_duration_stat_t;

/* torch.cuda.host_memory_stats(), with the same meanings:
 *   allocation / allocated_bytes: blocks handed out and not yet back in a
 *     free list (a freed block waiting for its events still counts);
 *   segment / reserved_bytes: pinned memory obtained from the backend;
 *   host_alloc_time / host_free_time: time in the backend's pin and unpin
 *     calls; num_host_alloc / num_host_free: how many. */
typedef struct gca_host_stats_s { /* (the tag: as gca_device_properties_s) */
  gca_stat_t allocation;
  gca_stat_t segment;
  gca_stat_t allocated_bytes;
  gca_stat_t reserved_bytes;
  gca_duration_stat_t host_alloc_time;
  gca_duration_stat_t host_free_time;
  int64_t num_host_alloc;
  int64_t num_host_free;
  /* gcalloc's own: */
  int64_t pending_blocks;     /* freed blocks waiting for events */
  int64_t cached_bytes;       /* in the free lists, ready for reuse */
  int64_t num_alloc_retries;  /* pinning retried after giving the cache back */
  int64_t num_event_errors;   /* events that failed (a stream wait was made instead) */
  int64_t quarantined_blocks; /* never reused: even the stream wait failed */
} gca_host_stats_t;

GCA_API int gca_host_stats(gca_allocator_t *a, gca_host_stats_t *out);
/* Peaks to current values; totals (allocated, freed, durations, num_*) to zero. */
GCA_API int gca_host_reset_peak_stats(gca_allocator_t *a);
GCA_API int gca_host_reset_accumulated_stats(gca_allocator_t *a);

/* ------------------------------------------------------------------------ */
/* Observability: summary, history, snapshot (docs/observability.md)         */
/* ------------------------------------------------------------------------ */

/* Write torch.cuda.memory_summary()'s table for `device` into buf (always
 * NUL-terminated, truncated to cap): the same rows, columns, widths and unit
 * rules, under a title naming gcalloc, the device and its backend.
 * abbreviated != 0 leaves out the per-pool rows. Returns the length the
 * whole table needs (excluding the NUL), or a negative status. */
GCA_API int gca_memory_summary(gca_allocator_t *a, int device, int abbreviated, char *buf, size_t cap);

/* How much call-stack context the history keeps (PyTorch's `context`):
 * NONE no stacks; STATE stacks of live blocks (shown in snapshots); ALLOC
 * also on alloc entries of the history; ALL also on free entries. */
typedef enum gca_context {
  GCA_CONTEXT_NONE = 0,
  GCA_CONTEXT_STATE = 1,
  GCA_CONTEXT_ALLOC = 2,
  GCA_CONTEXT_ALL = 3
} gca_context;

/* Start (enabled != 0) or stop recording the history of every device: a ring
 * of the last `max_entries` trace entries (alloc, free_requested,
 * free_completed, segment_alloc, segment_free, snapshot, oom), each with its
 * time in microseconds and, as `context` asks, the call stack (captured
 * with libunwind: instruction pointers at the call, symbol names resolved
 * when a snapshot is taken). Starting drops what was recorded before;
 * stopping keeps it for later snapshots. With recording off the cached path
 * pays one predictable branch per entry point. */
GCA_API int gca_record_history(gca_allocator_t *a, int enabled, gca_context context, size_t max_entries);

/* Which frames a recorded stack holds (PyTorch's `stacks` argument). In a
 * process running Python, a call made from a thread with a Python thread
 * state also records that thread's Python frames (file, line, function;
 * found through CPython's own functions, with no link to libpython, taking
 * the GIL before any gcalloc lock, as PyTorch's allocator does): first,
 * innermost first, then the native ones. Threads without Python record
 * native frames only. */
typedef enum gca_stacks {
  GCA_STACKS_NATIVE = 0, /* native return addresses only */
  GCA_STACKS_PYTHON = 1, /* Python frames only, where the caller has them (else native) */
  GCA_STACKS_ALL = 2     /* Python frames, then native ones (gca_record_history's) */
} gca_stacks;

/* gca_record_history with the frames to keep. */
GCA_API int gca_record_history_ex(gca_allocator_t *a, int enabled, gca_context context, gca_stacks stacks,
                                  size_t max_entries);

/* One frame of a call stack. `filename` is the object file (binary or
 * shared library) the code lies in, `name` the function ("??" when the
 * symbol is not exported), `line` the offset of the return address in that
 * function (0 when unknown): C code has no line table without debug info. */
typedef struct gca_frame {
  const char *filename;
  const char *name;
  int line;
} gca_frame_t;

/* Block states, with the names PyTorch's snapshots use. */
typedef enum gca_block_state {
  GCA_BLOCK_ACTIVE_ALLOCATED = 0,    /* "active_allocated": in use */
  GCA_BLOCK_ACTIVE_PENDING_FREE = 1, /* "active_pending_free": freed, waiting for stream work */
  GCA_BLOCK_INACTIVE = 2             /* "inactive": free, cached */
} gca_block_state;

typedef struct gca_snapshot_block {
  uint64_t address;
  uint64_t size;            /* rounded */
  uint64_t requested_size;  /* what the caller asked for (0 for inactive blocks) */
  int state;                /* gca_block_state */
  const gca_frame_t *frames; /* where it was allocated (context STATE and up) */
  size_t frame_count;
} gca_snapshot_block_t;

typedef struct gca_snapshot_segment {
  int device;
  uint64_t address;
  uint64_t total_size;
  uint64_t allocated_size;  /* bytes of active_allocated blocks */
  uint64_t active_size;     /* ... and of active_pending_free blocks */
  uint64_t requested_size;  /* requested bytes of both */
  gca_stream_t stream;
  int pool;                 /* GCA_POOL_SMALL or GCA_POOL_LARGE */
  int is_expandable;
  const gca_snapshot_block_t *blocks; /* in address order, tiling the segment */
  size_t block_count;
  uint64_t pool_id;         /* the private pool it belongs to (gca_pool_create); 0: the default pool */
} gca_snapshot_segment_t;

/* The actions of history entries, with PyTorch's names. */
typedef enum gca_trace_action {
  GCA_TRACE_ALLOC = 0,          /* "alloc" */
  GCA_TRACE_FREE_REQUESTED = 1, /* "free_requested": gca_free was called */
  GCA_TRACE_FREE_COMPLETED = 2, /* "free_completed": the memory may be reused */
  GCA_TRACE_SEGMENT_ALLOC = 3,  /* "segment_alloc": memory obtained from the device */
  GCA_TRACE_SEGMENT_FREE = 4,   /* "segment_free": memory given back to it */
  GCA_TRACE_SEGMENT_MAP = 5,    /* "segment_map" (expandable segments) */
  GCA_TRACE_SEGMENT_UNMAP = 6,  /* "segment_unmap" (expandable segments) */
  GCA_TRACE_SNAPSHOT = 7,       /* "snapshot": a snapshot was taken here */
  GCA_TRACE_OOM = 8,            /* "oom": an allocation failed; size is what was asked of the device */
  /* gcalloc's own (ipc_cooperation:True; memory_viz and PyTorch's tools
   * list them and pass over them): */
  GCA_TRACE_IPC_REQUEST = 9,    /* "ipc_request": this process asked its peers to release cache;
                                   size is what it needed, ipc_* what they did */
  GCA_TRACE_IPC_RELEASE = 10    /* "ipc_release": this process released cache a peer asked for; size is
                                   what it released (its segment_free entries come just before) */
} gca_trace_action;

typedef struct gca_trace_entry {
  int action;               /* gca_trace_action */
  uint64_t addr;            /* 0 for oom and snapshot */
  uint64_t size;            /* requested size for alloc and frees; segment size for segments and oom */
  gca_stream_t stream;
  int64_t time_us;          /* microseconds since the Unix epoch */
  uint64_t device_free;     /* oom only: the device's free bytes */
  const gca_frame_t *frames;
  size_t frame_count;
  uint64_t ipc_bytes_received; /* ipc_request: what the peers released */
  int32_t ipc_peers_asked;     /* ipc_request: how many peers were asked */
  int32_t ipc_peers_silent;    /* ipc_request: how many did not answer in time */
  int32_t ipc_requester;       /* ipc_release: the pid that asked (the latest, when several did) */
} gca_trace_entry_t;

/* The state of every device, and the recorded history (empty unless
 * gca_record_history was on), at one moment. Owned by the caller: release
 * it with gca_snapshot_free. Everything it points to lives as long. */
typedef struct gca_snapshot {
  const gca_snapshot_segment_t *segments; /* every device's, device by device, in address order */
  size_t segment_count;
  int device_count;
  const gca_trace_entry_t *const *device_traces; /* [device]: oldest first */
  const size_t *trace_counts;                    /* [device] */
  const char *settings;                          /* the configuration in force (gca_get_config) */
  const char *backend;                           /* the backend's name */
} gca_snapshot_t;

/* Take a snapshot (records a "snapshot" entry in the history if on). */
GCA_API int gca_snapshot_take(gca_allocator_t *a, gca_snapshot_t **out);
GCA_API void gca_snapshot_free(gca_snapshot_t *s);

typedef enum gca_snapshot_format {
  GCA_SNAPSHOT_PICKLE = 0, /* torch.cuda.memory._dump_snapshot's layout: memory_viz opens it */
  GCA_SNAPSHOT_JSON = 1    /* the same layout as JSON (docs/observability.md) */
} gca_snapshot_format;

/* Write a snapshot to `path` (created or truncated). The pickle holds only
 * dicts, lists, strings, ints, floats, bools and None; it loads with an
 * unpickler that refuses every global. GCA_ERR_IO names the path and the
 * reason on failure. */
GCA_API int gca_snapshot_write(const gca_snapshot_t *s, const char *path, gca_snapshot_format format);

/* ------------------------------------------------------------------------ */
/* Checking                                                                  */
/* ------------------------------------------------------------------------ */

/* Walk every segment of `device` (-1: all devices) and verify the invariants:
 * blocks tile their segment exactly; no two free neighbours are left unmerged;
 * every free block is in exactly one free index and every allocated block in
 * the allocation map; the statistics equal a recount from the segments; and
 * the device memory the backend handed out and did not take back equals the
 * reserved bytes plus pages kept after a refused free (nothing dropped).
 * Returns GCA_OK or GCA_ERR_CORRUPT with the first broken invariant named in
 * gca_last_error(). Cost is proportional to the number of blocks. */
GCA_API int gca_check(gca_allocator_t *a, int device);

/* ------------------------------------------------------------------------ */
/* Private pools (docs/pools.md)                                             */
/* ------------------------------------------------------------------------ */

/* A private pool of one device: its memory serves only the allocations
 * routed to it, and what is freed in it is reused only in it (PyTorch's
 * private pools, as CUDA graphs and torch.cuda.MemPool use them). Pools are
 * named by ids, unique in the allocator and never reused; 0 names the
 * default pool, where every allocation goes unless routed. Memory in a
 * private pool counts in the device's statistics as any other. Calls that
 * name a pool that does not exist (or no longer does) fail with
 * GCA_ERR_INVALID and change nothing. */
typedef uint64_t gca_pool_t;

/* Create a pool on `device`, holding one reference. */
GCA_API int gca_pool_create(gca_allocator_t *a, int device, gca_pool_t *out);
/* The same with flags: GCA_POOL_PAUSABLE makes a pool that can pause (its
 * segments are expandable, whatever expandable_segments says; the backend
 * needs virtual memory, else GCA_ERR_BACKEND). */
/* GCA_POOL_FINE_PAGES: its expandable segments (a pausable pool's, or
 * any with expandable_segments:True) map 2 MiB pages in both size classes,
 * not 20 MiB in the large one: for a caller that sizes its own segments
 * (PyTorch's caching allocator behind a MemPool asks for 2 MiB, 20 MiB,
 * or the request rounded to 2 MiB), so that no page mapped lies beyond
 * what it asked. */
enum { GCA_POOL_PAUSABLE = 1, GCA_POOL_FINE_PAGES = 2 };
GCA_API int gca_pool_create_ex(gca_allocator_t *a, int device, unsigned flags, gca_pool_t *out);
/* Pause a pausable pool: wait for its own streams (not the whole device),
 * with GCA_PAUSE_BACKUP copy every live block to pinned host memory (the
 * pinned host allocator's), give its free cache back for good (the resume
 * maps back only pages that hold live blocks), then unmap and give back all
 * its other physical memory; *released (may be NULL) says how much. Its addresses stay
 * reserved and its blocks stay live: pointers into it stay valid, to be
 * used again after gca_pool_resume. While paused, an allocation routed to
 * it fails (GCA_ERR_INVALID), a free of its blocks is legal (nothing is
 * given back twice; the block's copy is dropped). Pausing a paused pool,
 * or one that cannot pause, is refused and changes nothing; so is a pause
 * during a graph capture on its device. If the device will not unmap some
 * pages they stay mapped and the error is returned (the pool is paused). */
enum { GCA_PAUSE_BACKUP = 1 };
GCA_API int gca_pool_pause(gca_allocator_t *a, gca_pool_t pool, unsigned flags, size_t *released);
/* Resume a paused pool: new memory mapped at the same addresses, the host
 * copies written back (ordered on each block's stream, waited for), then
 * given back to the system (not cached by the pinned host allocator) unless
 * GCA_RESUME_KEEP_BACKUP: then kept until the pool's next pause, which
 * copies into them again where a block kept its address and size (no new
 * pinning), or its end. Room is made as
 * for an allocation: the process's own cache given back, then (with
 * ipc_cooperation:True) the other processes asked. Out of memory:
 * GCA_ERR_OOM naming the pool's need (and, cooperating, what each other
 * process holds and released), and the pages mapped before it ran out
 * given back: the pool is paused exactly as before (call again, free
 * into it, or release it). Resuming a running pool is refused and changes
 * nothing. */
enum { GCA_RESUME_KEEP_BACKUP = 1 };
GCA_API int gca_pool_resume(gca_allocator_t *a, gca_pool_t pool, unsigned flags);
/* Pause every pausable pool of `device` (-1: of every device) that runs, as
 * gca_pool_pause with `flags` each (a sleep mode's "everything"); *released
 * (may be NULL) the sum. Every pool is tried: the first failure is returned
 * (its message names the pool), the others are paused. */
GCA_API int gca_pool_pause_all(gca_allocator_t *a, int device, unsigned flags, size_t *released);
/* Resume every paused pool of `device` (-1: of every device), as
 * gca_pool_resume with `flags` each; every pool is tried, the first failure
 * returned. */
GCA_API int gca_pool_resume_all(gca_allocator_t *a, int device, unsigned flags);
/* Read access to a paused block's host copy (GCA_PAUSE_BACKUP; or kept at
 * resume by GCA_RESUME_KEEP_BACKUP, then as it was at the pause): for
 * `ptr` inside a block that has one, *host points at the copy of ptr's byte
 * and *size says how many bytes of the copy follow. Valid until the pool
 * resumes without GCA_RESUME_KEEP_BACKUP, pauses again, or the block is
 * freed. GCA_ERR_BAD_POINTER when ptr has no copy. */
GCA_API int gca_pool_backup(gca_allocator_t *a, const void *ptr, const void **host, size_t *size);
/* One more reference (a second graph sharing the pool's memory). */
GCA_API int gca_pool_retain(gca_allocator_t *a, gca_pool_t pool);
/* Drop a reference. Dropping the last one ends the pool: it first waits
 * for its frees still waiting for their streams (those held during a
 * capture too), then its cached memory goes back to the device. That is
 * refused, changing nothing (GCA_ERR_INVALID), while blocks of the pool are
 * live or allocations are routed to it; a paused pool whose pages the
 * device still refuses to unmap is refused with GCA_ERR_BACKEND. */
GCA_API int gca_pool_release(gca_allocator_t *a, gca_pool_t pool);
/* Route the calling thread's allocations to `pool` (on the pool's device;
 * pool 0: the default pool on every device) until the matching
 * gca_pool_pop. Pushes nest, up to 16 deep; the innermost wins, and a
 * thread's route wins over a stream's. Push and pop on the same thread. A
 * thread that exits inside pushes has them undone; a push open when its
 * allocator closes goes stale (it routes nothing, in no allocator opened
 * later), and its pop fails with GCA_ERR_INVALID, touching nothing. */
GCA_API int gca_pool_push(gca_allocator_t *a, gca_pool_t pool);
GCA_API int gca_pool_pop(gca_allocator_t *a);
/* Route every allocation on `stream` of the pool's device to `pool` (what
 * graph capture needs), until unrouted. A stream routes to one pool. */
GCA_API int gca_pool_route_stream(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream);
GCA_API int gca_pool_unroute_stream(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream);

/* Graph capture of `stream` into `pool` (PyTorch's beginAllocateToPool and
 * endAllocateToPool; call begin before the driver's stream capture begins
 * and end after it ended). Allocations on the stream go to the pool, as a
 * stream route; and while any capture runs on the device, gcalloc frees
 * nothing to the device, unmaps nothing, synchronizes nothing, records and
 * queries no event, and collects no garbage: an allocation the cache cannot
 * serve takes a new segment or fails. A free of a block used on other
 * streams waits, pending, until the last capture on the device ends, and
 * its events are recorded then. gca_empty_cache, gca_synchronize and
 * gca_pool_release on that device are refused meanwhile (docs/pools.md). */
GCA_API int gca_capture_begin(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream);
GCA_API int gca_capture_end(gca_allocator_t *a, gca_pool_t pool, gca_stream_t stream);

/* A pool's holdings now (counted from its segments when asked: the hot
 * path keeps nothing per pool, so there are no peaks). */
typedef struct gca_pool_stats {
  gca_pool_t id;
  int device;
  int64_t references;
  uint64_t routes;            /* threads' pushes and streams routed to it */
  uint64_t segments;
  uint64_t reserved_bytes;    /* mapped bytes of its segments */
  uint64_t allocated_bytes;   /* its live blocks (rounded sizes) */
  uint64_t requested_bytes;   /* what their callers asked for */
  uint64_t allocations;       /* live blocks */
  uint64_t pending_bytes;     /* freed, still used by queued work */
  uint64_t cached_bytes;      /* free, mapped: what only this pool's allocations may reuse */
  int pausable, paused;
  uint64_t backup_bytes;      /* host copies held (a pause's, or kept at resume) */
} gca_pool_stats_t;

GCA_API int gca_pool_get_stats(gca_allocator_t *a, gca_pool_t pool, gca_pool_stats_t *out);
/* The pool a live allocation belongs to (0: the default pool). */
GCA_API int gca_pool_of(gca_allocator_t *a, void *ptr, gca_pool_t *out);
/* The private pools of `device`: up to `cap` ids into `out`; returns how
 * many there are (or a negative status). */
GCA_API int gca_pool_list(gca_allocator_t *a, int device, gca_pool_t *out, size_t cap);

/* ------------------------------------------------------------------------ */
/* Processes sharing a device (ipc_cooperation:True; docs/sharing.md)        */
/* ------------------------------------------------------------------------ */

/* A process cooperating on a device, as it last published itself. */
typedef struct gca_ipc_peer {
  int32_t pid;
  uint64_t reserved_bytes;  /* obtained from the device */
  uint64_t allocated_bytes; /* handed out, with device memory under it */
  uint64_t cached_bytes;    /* reserved and not allocated: what it could release */
  uint64_t waiting_bytes;   /* what an allocation of it waits for, or 0 */
  uint64_t paused_bytes;    /* handed out in paused pools: no device memory under it (docs/pools.md) */
  /* Its cooperation so far (gca_stats_t's counters, published): */
  uint64_t requests;        /* requests it made (num_ipc_requests) */
  uint64_t bytes_received;  /* what the others released for them (ipc_bytes_received) */
  uint64_t bytes_released;  /* what it released for the others' requests */
  uint64_t timeouts;        /* peers that did not answer its requests in time (num_ipc_timeouts) */
  uint64_t avoidable_ooms;  /* num_avoidable_ooms */
  /* Milliseconds since its cooperation thread last published (every 100
   * ms while it runs), or since it joined where the thread has not yet:
   * above 1000 it has stopped answering (a stopped or wedged process), and
   * no request waits for it. */
  uint64_t silent_ms;
} gca_ipc_peer_t;

/* The processes cooperating on `device` (this one included): up to `cap`
 * copied into out; returns how many there are (GCA_ERR_INVALID, negative,
 * when cooperation is off for the device). */
GCA_API int gca_ipc_peers(gca_allocator_t *a, int device, gca_ipc_peer_t *out, size_t cap);

/* A device with cooperating processes on this host, as `gcalloc top`
 * shows it: its identity (a CUDA UUID, a shared sim's name, an Ascend SoC
 * and index) and its live processes. */
typedef struct gca_ipc_device {
  char identity[96];
  int peer_count;
  gca_ipc_peer_t peers[64];
  /* The device's memory as its driver reported it to the member that asked
   * last (members holding device memory ask every 100 ms); 0 and 0 when
   * none has. other_bytes: in use but not reserved by any member (held by
   * processes that do not cooperate, or by the driver), total - free - the
   * members' reserved bytes, 0 if negative. */
  uint64_t total_bytes, free_bytes, other_bytes;
  /* 1: total, free and other_bytes are one consistent view (the free
   * memory read while no member's reserved bytes changed since); 0: the
   * members' memory kept changing while it was read, and other_bytes is
   * not known (0). Members publish each change as it happens. */
  int settled;
} gca_ipc_device_t;

/* Every rendezvous this user may join (no allocator needed): up to `cap`
 * devices copied into out, read without taking their locks (a snapshot of
 * what each process last published); returns how many there are. Regions
 * that are not gcalloc's are skipped, and so are regions this user may not
 * join (another user's, or another group's, or one that gives more access
 * than gcalloc does: joining refuses them too), whatever they say. What a
 * region says is what its processes wrote: gcalloc top escapes its
 * identity and marks implausible figures. */
GCA_API int gca_ipc_scan(gca_ipc_device_t *out, size_t cap);
/* The same, and *skipped (when not NULL) set to how many regions were
 * skipped as not this user's to join. */
GCA_API int gca_ipc_scan_ex(gca_ipc_device_t *out, size_t cap, int *skipped);

/* ------------------------------------------------------------------------ */
/* Sizing rules (exposed for tools and tests; pure functions)                */
/* ------------------------------------------------------------------------ */

/* The size a request of `size` bytes is rounded to under the allocator's
 * current configuration (PyTorch's round_size), or 0 if it would overflow. */
GCA_API size_t gca_round_size(gca_allocator_t *a, size_t size);

/* The size of the segment the allocator asks the device for when a request of
 * rounded size `size` misses the cache (PyTorch's get_allocation_size). */
GCA_API size_t gca_segment_size(size_t rounded_size);

/* ------------------------------------------------------------------------ */
/* PyTorch drop-in (docs/pytorch.md)                                         */
/* ------------------------------------------------------------------------ */

/* One process-wide allocator for PyTorch. gca_torch_malloc and
 * gca_torch_free have the signatures torch.cuda.memory.CUDAPluggableAllocator
 * loads (void *alloc(ssize_t size, int device, cudaStream_t stream) and
 * void free(void *ptr, ssize_t size, int device, cudaStream_t stream);
 * ptrdiff_t is ssize_t on the platforms PyTorch supports):
 *
 *   torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
 *       "libgcalloc.so", "gca_torch_malloc", "gca_torch_free"))
 *
 * or `gcalloc.torch.install()` from the Python package, which does that.
 * A refused allocation's message (PyTorch's out-of-memory text) is kept for
 * gca_torch_last_failure. With gca_torch_set_raise connected (the Python
 * package does it), it is thrown into PyTorch as a c10::Error, which Python
 * sees as RuntimeError("gcalloc: CUDA out of memory. Tried to allocate ..."),
 * or, out of memory with gca_torch_set_raise_oom connected, as a
 * c10::OutOfMemoryError (torch.OutOfMemoryError).
 * Without, it is logged as an error and NULL returned: PyTorch 2.11 does not
 * check for NULL, so the tensor gets no memory, and the first kernel that
 * writes it is an illegal memory access that ends the process's CUDA
 * context. */

/* Open the process-wide allocator on `backend` (NULL: GCALLOC_TORCH_BACKEND,
 * else "cuda") with `config` on top of the environment's. If it is already
 * open, apply `config` to it (GCA_ERR_INVALID if `backend` names another). */
GCA_API int gca_torch_init(const char *backend, const char *config);
/* The process-wide allocator, opened with the defaults if it is not yet; NULL on failure. */
GCA_API gca_allocator_t *gca_torch_allocator(void);
/* Whether the process-wide allocator is open (1) or not (0); opens nothing. */
GCA_API int gca_torch_is_open(void);
GCA_API void *gca_torch_malloc(ptrdiff_t size, int device, void *stream);
GCA_API void gca_torch_free(void *ptr, ptrdiff_t size, int device, void *stream);
GCA_API void gca_torch_record_stream(void *ptr, void *stream);
GCA_API void gca_torch_empty_cache(void);
GCA_API void gca_torch_set_memory_fraction(double fraction, int device);
/* The pluggable allocator's optional hooks (gcalloc.torch.install() passes
 * them where the running PyTorch offers them): set_reset_fn takes
 * gca_torch_empty_cache, set_memory_fraction_fn gca_torch_set_memory_fraction,
 * set_record_stream_fn gca_torch_record_stream, set_init_fn
 * gca_torch_init_devices (PyTorch's device count at its CUDA
 * initialization: opens the allocator, and warns when the backend has fewer
 * devices), set_base_alloc_fn gca_torch_base_alloc (gca_base_allocation;
 * an unknown pointer is logged and stands for itself, *size 0), and the
 * graph hooks below. */
GCA_API void gca_torch_init_devices(int device_count);
GCA_API void *gca_torch_base_alloc(void *ptr, size_t *size);
/* The pluggable allocator's CUDA graph hooks, with the C signatures its
 * std::function types have under the Itanium C++ ABI on x86-64 and AArch64
 * (c10::cuda::MempoolId_t, a pair of 64-bit integers, trivially copyable,
 * in two registers; the std::function filter by hidden reference, owned
 * and destroyed by the caller): set_begin_allocate_to_pool takes
 * gca_torch_begin_allocate_to_pool, set_end_allocate_to_pool_fn
 * gca_torch_end_allocate_to_pool, set_release_pool gca_torch_release_pool.
 * Each mempool id is a private pool (gca_pool_create) with PyTorch's use
 * count. From a begin to its end the device is capture-safe (as
 * gca_capture_begin), and an allocation on a stream the driver says is in
 * a capture goes to the pool (the first capture seen after a begin binds to
 * the pool begun last; the filter, a C++ call, is not called). Blocks freed
 * into the pool are reused only by the pool; when PyTorch releases it, it
 * ends once its last block is freed, and its memory goes back. */
GCA_API void gca_torch_begin_allocate_to_pool(int device, uint64_t id_first, uint64_t id_second,
                                              const void *filter);
GCA_API void gca_torch_end_allocate_to_pool(int device, uint64_t id_first, uint64_t id_second);
GCA_API void gca_torch_release_pool(int device, uint64_t id_first, uint64_t id_second);
/* PyTorch 2.1 and 2.2's form of the graph hooks, which name the capturing
 * stream: set_begin_allocate_stream_to_pool takes
 * gca_torch_begin_allocate_stream_to_pool (void(int, cudaStream_t,
 * MempoolId_t)), set_end_allocate_stream_to_pool_fn
 * gca_torch_end_allocate_stream_to_pool (void(int, cudaStream_t)); the
 * release is gca_torch_release_pool. The stream's allocations go to the
 * pool from the begin to its end, as above. */
GCA_API void gca_torch_begin_allocate_stream_to_pool(int device, void *stream, uint64_t id_first,
                                                     uint64_t id_second);
GCA_API void gca_torch_end_allocate_stream_to_pool(int device, void *stream);
/* PyTorch's MemPool route (gcalloc.torch.region, docs/pytorch.md, "Sleep
 * mode for part of a program"): the alloc and free functions of
 *
 *   torch.cuda.MemPool(torch.cuda.memory.CUDAPluggableAllocator(
 *       "libgcalloc.so", "gca_torch_region_malloc", "gca_torch_region_free").allocator())
 *
 * PyTorch's own caching allocator then serves the pool's tensors, keeps its
 * tools, and asks gcalloc for each segment on the allocating thread. The
 * segment comes from the private pool the thread pushed (gca_pool_push on
 * the process-wide allocator; the region does it), so that pausing that
 * pool gives the segment's memory back at the same addresses. A request
 * with no pool pushed for the device, or into a paused pool, is refused:
 * NULL, which PyTorch raises as its torch.OutOfMemoryError; the message is
 * kept for gca_torch_last_failure. Nothing is thrown. */
GCA_API void *gca_torch_region_malloc(ptrdiff_t size, int device, void *stream);
GCA_API void gca_torch_region_free(void *ptr, ptrdiff_t size, int device, void *stream);
/* The message of the last failed gca_torch_malloc in the process, from any
 * thread, copied into buf (cap bytes, NUL-terminated, cut to fit); "" if none
 * failed since the allocator was opened. Returns the message's full length. */
GCA_API size_t gca_torch_last_failure(char *buf, size_t cap);
/* Connect the framework's way to refuse an allocation: the address of
 * `void c10::detail::torchCheckFail(const char *func, const char *file,
 * uint32_t line, const char *msg)` in its libc10.so (symbol
 * _ZN3c106detail14torchCheckFailEPKcS2_jS2_), which throws c10::Error.
 * gca_torch_malloc and gca_npu_malloc then call it, holding no lock, instead
 * of returning NULL. NULL disconnects it. Returns GCA_OK. */
GCA_API int gca_torch_set_raise(void *torch_check_fail);
/* Connect a raiser for out of memory: a function with torchCheckFail's
 * signature that throws c10::OutOfMemoryError (Python's
 * torch.OutOfMemoryError, the class training loops catch). Only code
 * compiled against the framework's headers can throw it; gcalloc.torch
 * builds a small one at install() (docs/pytorch.md). Out-of-memory refusals
 * go to it, the others (and out of memory while it is unset) to
 * gca_torch_set_raise's. NULL disconnects it. Returns GCA_OK. */
GCA_API int gca_torch_set_raise_oom(void *throw_out_of_memory);
/* Close the process-wide allocator (every pointer it gave becomes invalid). */
GCA_API void gca_torch_shutdown(void);

/* The same process-wide allocator for PyTorch on Ascend NPUs, with the
 * signatures torch_npu.npu.memory.NPUPluggableAllocator loads
 * (void *alloc(size_t size, int device, aclrtStream stream) and
 * void free(void *ptr, size_t size, int device, aclrtStream stream)):
 *
 *   torch_npu.npu.memory.change_current_allocator(torch_npu.npu.memory.NPUPluggableAllocator(
 *       "libgcalloc.so", "gca_npu_malloc", "gca_npu_free"))
 *
 * or `gcalloc.torch_npu.install()`. Opened at the first call if it is not
 * yet, on GCALLOC_TORCH_BACKEND, else "acl". A failure is logged and kept
 * for gca_torch_last_failure, as gca_torch_malloc's. */
GCA_API void *gca_npu_malloc(size_t size, int device, void *stream);
GCA_API void gca_npu_free(void *ptr, size_t size, int device, void *stream);
/* Keep `backend` and `config` for the process-wide allocator's open at the
 * first allocation or hook call, instead of opening now: torch_npu calls
 * aclInit with its configuration at its lazy initialization, before its
 * first allocation, and a runtime gcalloc initialized first would refuse it
 * (ACL_ERROR_REPEAT_INITIALIZE) and skip the configuration file. The
 * configuration is checked now (GCA_ERR_INVALID names what is wrong). If
 * the allocator is open already, as gca_torch_init. */
GCA_API int gca_torch_defer(const char *backend, const char *config);
/* NPUPluggableAllocator's optional hooks with the C signatures torch_npu's
 * Module.cpp casts them to (gcalloc.torch_npu.install() passes those the
 * running torch_npu offers): set_init_fn gca_npu_init (opens the allocator,
 * warns when the backend has fewer devices), set_reset_fn
 * gca_npu_empty_cache (torch.npu.empty_cache), set_memory_fraction_fn
 * gca_torch_set_memory_fraction, set_base_alloc_fn gca_torch_base_alloc,
 * set_record_stream_fn gca_torch_record_stream (every record_stream, HCCL's
 * from C++ too), set_erase_stream_fn gca_npu_erase_stream (gca_erase_stream). */
GCA_API void gca_npu_init(int device_count);
GCA_API void gca_npu_empty_cache(bool check_error);
GCA_API void gca_npu_erase_stream(void *ptr, void *stream);
/* The record- and erase-stream hooks of a torch_npu whose Module.cpp casts
 * them to void(void *, c10_npu::NPUStream): NPUStream has a user-provided
 * destructor, so under the Itanium C++ ABI the second argument is the
 * address of the caller's NPUStream object, not an aclrtStream. These read
 * the stream through torch_npu's own accessor, connected with
 * gca_npu_set_stream_accessor: the address of `aclrtStream
 * c10_npu::NPUStream::stream(bool need_empty) const` in libtorch_npu.so
 * (symbol _ZNK7c10_npu9NPUStream6streamEb), called with false (no queue
 * emptied), holding no lock. Without it, each use is logged as an error and
 * not recorded. gcalloc.torch_npu.install() picks these or
 * gca_torch_record_stream / gca_npu_erase_stream by the signature the
 * running torch_npu's setter has (docs/acl.md). */
GCA_API void gca_npu_record_stream_object(void *ptr, const void *npu_stream);
GCA_API void gca_npu_erase_stream_object(void *ptr, const void *npu_stream);
GCA_API int gca_npu_set_stream_accessor(void *npu_stream_stream);
/* Record- and erase-stream calls from the framework's hooks on memory the
 * process-wide allocator did not make: the NULL of an empty tensor, memory
 * from from_blob, DLPack or IPC. As PyTorch's own allocator, the hooks
 * ignore them quietly; this counts them, since the process started. */
GCA_API size_t gca_torch_foreign_stream_uses(void);
/* Connect torch_npu's drain of its task queue: the address of
 * `bool c10_npu::npuSynchronizeDevice(bool check_error)` in libtorch_npu.so
 * (symbol _ZN7c10_npu20npuSynchronizeDeviceEb), called with false as the
 * process-wide allocator's gca_set_queue_drain, now or at its open. It gives
 * up the GIL while it waits and takes it back, and throws c10::Error for
 * some device errors even with false: gcalloc calls it holding no lock, and
 * the exception reaches torch_npu through gcalloc's frames. NULL
 * disconnects it. */
GCA_API int gca_npu_set_queue_drain(void *npu_synchronize_device);
/* Connect torch_npu's operator workspace cache (NPUWorkspaceAllocator: a
 * block per stream, allocated with aclrtMallocAlign32 beside gcalloc and
 * kept): the address of its `emptyCache` in libtorch_npu.so and how many
 * arguments it takes in the running release, 3 (int device, bool
 * need_empty_queue, bool check_error: symbol
 * _ZN7c10_npu21NPUWorkspaceAllocator10emptyCacheEibb), 2 (int device, bool
 * check_error: ...emptyCacheEib) or 1 (bool check_error: ...emptyCacheEb).
 * The process-wide allocator then calls it as an OOM handler
 * (gca_add_oom_handler) with no lock held, before an allocation fails for
 * want of memory, and tries again when the device has more free memory
 * after it. NULL disconnects it. GCA_ERR_INVALID for another arity. */
GCA_API int gca_npu_set_workspace_release(void *release, int arity);

#ifdef __cplusplus
}
#endif

#endif /* GCALLOC_H */
