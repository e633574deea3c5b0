/* The base utilities every layer of the library may use, and nothing
 * else: errors and logging, compiler hints and debug assertions, locks
 * (lock.h), growing arrays, big arrays and arenas, helper threads, a small
 * integer map, bounded text, and parsing of sizes. A backend sees this and
 * the backend interface only.
 */
#ifndef GCALLOC_BASE_H
#define GCALLOC_BASE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <stdio.h>

#include "gcalloc.h"
#include "base/lock.h"

#if defined(__GNUC__)
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)
#define GCA_PRINTF(f, a) __attribute__((format(printf, f, a)))
/* The library is built as one translation unit, so the compiler sees the
 * whole cached path: GCA_FLATTEN on the two entry points inlines it into
 * them; GCA_COLD keeps the miss and error paths out of line, GCA_NOINLINE
 * the paths that are not cold but not the common case either. */
#define GCA_FLATTEN __attribute__((flatten))
#define GCA_COLD __attribute__((noinline, cold))
#define GCA_NOINLINE __attribute__((noinline))
#else
#define GCA_FLATTEN
#define GCA_COLD
#define GCA_NOINLINE
#define likely(x) (x)
#define unlikely(x) (x)
#define GCA_PRINTF(f, a)
#endif

/* Invariants checked in debug builds, as SQLite's assert(): a broken one
 * stops the process with its place and condition. Release builds drop
 * them. */
#ifndef NDEBUG
#define GCA_ASSERT(cond) ((cond) ? (void)0 : gca__assert_failed(#cond, __FILE__, __LINE__))
__attribute__((noreturn)) void gca__assert_failed(const char *cond, const char *file, int line);
#else
#define GCA_ASSERT(cond) ((void)0)
#endif

/* ------------------------------------------------------------------------ */
/* Errors and logging (error.c)                                              */
/* ------------------------------------------------------------------------ */

/* Record a failure for gca_last_error(); returns `status` for tail calls. */
int gca__set_error(int status, const char *fmt, ...) GCA_PRINTF(2, 3);
/* Put "prefix: " (formatted) before the current error message; returns
 * its status. */
int gca__prefix_error(const char *fmt, ...) GCA_PRINTF(1, 2);
/* Add text after the current error's message (cut to fit); returns its status. */
int gca__append_error(const char *fmt, ...) GCA_PRINTF(1, 2);
void gca__clear_error(void);
/* Log a message through the installed handler. The handler never runs under
 * a lock of the library: a region that holds one and may log is bracketed
 * by log_hold() and log_release(), which delivers what was logged inside
 * once the outermost hold ends. */
void gca__log_message(gca_log_level level, const char *fmt, ...) GCA_PRINTF(2, 3);
void gca__log_hold(void);
void gca__log_release(void);
extern _Atomic int gca__log_level_now;
extern _Atomic int gca__calls_observed;
/* CLOCK_MONOTONIC in nanoseconds. */
static inline uint64_t gca__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A count that grows at a steady rate, for timestamps taken on the hot
 * path (the history): the time-stamp counter on x86-64 where it is
 * invariant (constant rate, runs in every power state, as cpuid says), the
 * virtual counter on AArch64, else CLOCK_MONOTONIC's nanoseconds. A few ns
 * where clock_gettime costs 20-30 (a virtual machine's clock source).
 * Ticks become time through two readings of both (gca__ticks_pair,
 * gca__ticks_to_us). gca__ticks_init first, once (it is idempotent). */
extern _Atomic bool gca__ticks_counter;
void gca__ticks_init(void);
static inline uint64_t gca__ticks(void) {
#if defined(__x86_64__)
  if (likely(atomic_load_explicit(&gca__ticks_counter, memory_order_relaxed))) return __builtin_ia32_rdtsc();
#elif defined(__aarch64__)
  uint64_t v;
  __asm__ __volatile__("mrs %0, cntvct_el0" : "=r"(v));
  return v;
#endif
  return gca__now_ns();
}
/* The wall clock (CLOCK_REALTIME) in microseconds since the epoch: the
 * history's and the trace file's timestamps. */
int64_t gca__wall_us(void);
/* Ticks and the wall clock (gca__wall_us) read together. */
typedef struct ticks_pair {
  uint64_t ticks;
  int64_t us;
} ticks_pair_t;
ticks_pair_t gca__ticks_pair(void);
/* The wall-clock time of `ticks`, on the line through two pairs (exact at
 * both; the counter's rate is steady, so exact within its precision
 * between them, and extended past them). */
int64_t gca__ticks_to_us(uint64_t ticks, ticks_pair_t from, ticks_pair_t to);

static inline bool log_on(int level) {
  return unlikely(level <= atomic_load_explicit(&gca__log_level_now, memory_order_relaxed));
}
/* Read GCALLOC_LOG and GCALLOC_LOG_FILE once (gca_open calls it). */
void gca__log_init(void);
/* Whether every call must be observed for a trace file being written
 * (trace recording says; calls_observed follows it and the log level). */
void gca__log_set_calls_recorded(bool on);
/* A device's history starts (+1) or stops (-1) wanting Python frames: while
 * any does, calls take the observed entry, which gathers them before any
 * lock (GCA_OBSERVED_PYTHON in gca__calls_observed). */
#define GCA_OBSERVED_PYTHON 4
void gca__log_python_frames(int delta);
/* Calls must be guarded (+1) or need not be any more (-1): while any guard
 * is up (a callback running under a device's lock, an allocator inherited
 * across fork), gca_malloc and gca_free take the observed entry, which
 * checks whether the call may run before anything else; the other calls
 * check always. Guards count in the bits above GCA_OBSERVED_FLAGS. */
#define GCA_OBSERVED_FLAGS 0xff
#define GCA_OBSERVED_GUARD (GCA_OBSERVED_FLAGS + 1)
void gca__calls_guard(int delta);

/* ------------------------------------------------------------------------ */
/* Small helpers (util.c)                                                    */
/* ------------------------------------------------------------------------ */

/* Grow a dynamic array: realloc to twice *cap elements (`first` when empty).
 * Returns the new array and updates *cap, or returns NULL on host OOM and
 * leaves both untouched. */
void *gca__grow_array(void *array, size_t *cap, size_t elem_size, size_t first);
/* FNV-1a of `len` bytes. */
uint64_t gca__bytes_hash(const void *data, size_t len);
/* FNV-1a of a string's bytes, never 0 (so 0 can mark an empty slot). */
uint64_t gca__text_hash(const char *s);
#if defined(__SANITIZE_ADDRESS__)
#define GCA_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GCA_UNDER_ASAN 1
#endif
#endif
/* Whether big buffers (the pinned allocator's large blocks, the trace
 * reader's big arrays) are mappings of their own: on Linux, but not under
 * AddressSanitizer, which checks the bounds of what malloc gives only. */
#if defined(__linux__) && !defined(GCA_UNDER_ASAN)
#define GCA_BIG_MAPPED 1
#else
#define GCA_BIG_MAPPED 0
#endif
/* `bytes` of fresh, zeroed memory mapped on its own, aligned to a 2 MiB
 * huge page, with the kernel asked for transparent huge pages (a hint);
 * NULL if it cannot be mapped. munmap(p, bytes) gives it back. The pinned
 * allocator's large registered blocks use it: long-lived, and registered
 * with the driver page by page. */
#define HUGE_PAGE_BYTES ((size_t)2 << 20)
void *gca__huge_map(size_t bytes);
/* Python frames of the calling thread (pyframes.c): CPython's functions
 * found in the running process, no link to libpython. A frame is one word,
 * tagged with the top bit, that travels among a stack's return addresses.
 * gca__py_gather writes the calling thread's frames, innermost first, and
 * returns how many: 0 where the process runs no Python or the thread has no
 * Python thread state. It takes the GIL: call it with no gcalloc lock held.
 * gca__py_frame resolves a tagged word (false for a return address), from
 * any thread, without the GIL. */
#define GCA_PY_FRAME_TAG ((uintptr_t)1 << 63)
size_t gca__py_gather(uintptr_t *out, size_t cap);
/* Whether the process runs Python (its interpreter is initialized). */
bool gca__py_present(void);
bool gca__py_frame(uintptr_t tagged, const char **file, const char **name, int *line);

/* A bump allocator for things freed all at once (a snapshot, a parsed
 * pickle). Chunks of `chunk` bytes (64 KiB when 0); with `limit` nonzero,
 * no more than that many bytes in all. A refused allocation sets `failed`,
 * and `over_limit` too when the limit refused it. Memory is 16-aligned. */
typedef struct arena_chunk arena_chunk_t;
typedef struct arena {
  arena_chunk_t *head;
  size_t chunk, limit, bytes;
  /* Where chunks come from: malloc and free when NULL. The trace reader
   * gives big arrays (replay/util.h), whose mappings are kept for the next
   * parse; chunk_round (when nonzero) rounds a chunk's bytes up to the
   * mapping's step so that none of it is wasted. */
  void *(*chunk_alloc)(size_t bytes);
  void (*chunk_free)(void *chunk, size_t bytes);
  size_t chunk_round;
  bool failed, over_limit;
} arena_t;
void *gca__arena_alloc(arena_t *ar, size_t n);
void *gca__arena_zalloc(arena_t *ar, size_t n);
/* Grows p, the arena's latest allocation (old_n bytes), to new_n bytes
 * where it is: true when it was the last thing in its chunk and the chunk
 * has the room; else false, and nothing changed. */
bool gca__arena_extend(arena_t *ar, void *p, size_t old_n, size_t new_n);
char *gca__arena_strdup(arena_t *ar, const char *s);

void gca__arena_free(arena_t *ar);

/* Kept helper threads (helpers.c) for the tools' parallel steps: the trace
 * reader's second reader, the replay's device workers; and the pinned host
 * allocator's page touching (host.c). A job runs
 * run(arg) on one of them. helper_submit queues it, and returns false when
 * no thread could be had (the caller runs it itself). helper_wait returns
 * once it has run, or takes it back if no thread has started it yet and
 * returns false. helper_detach runs run(arg) soon, and nobody waits. */
typedef struct helper_job {
  void (*run)(void *arg);
  void *arg;
  struct helper_job *next;
  atomic_int state;
  bool detached;
} helper_job_t;
#define GCA_HELPERS_MAX 64 /* threads kept at most */
bool gca__helper_submit(helper_job_t *job);
bool gca__helper_wait(helper_job_t *job);
bool gca__helper_detach(void (*run)(void *arg), void *arg);
/* The processors this thread may run on (its affinity: a `taskset` or a
 * container's set counts), at least 1. A system call of a few
 * microseconds: sysconf's count of those online reads a file under /sys,
 * tens of microseconds in a new process. */
int gca__processors_usable(void);
/* One step of a thread's wait for another that runs on another processor
 * (helpers looking for work, the trace readers waiting for each other). */
void gca__spin_pause(void);
/* Integer key -> integer value, open addressing with linear probing,
 * growing as it fills; for the trace readers and the replay (not the hot
 * path, which has block_map). Keys must be below UINT64_MAX - 1. */
typedef struct addr_map {
  uint64_t *keys; /* key + 1; 0 empty, UINT64_MAX deleted */
  uint64_t *vals;
  size_t cap, used; /* used counts deleted slots too, until the next growth */
} addr_map_t;
#define ADDR_MAP_DELETED UINT64_MAX
bool gca__addr_map_init(addr_map_t *m);
uint64_t *gca__addr_map_get(const addr_map_t *m, uint64_t key); /* NULL if absent */
bool gca__addr_map_put(addr_map_t *m, uint64_t key, uint64_t val); /* false on host OOM */
void gca__addr_map_del(addr_map_t *m, uint64_t key);
void gca__addr_map_free(addr_map_t *m);
/* A bounded text being written; `len` counts what did not fit too. */
typedef struct text {
  char *buf;
  size_t cap, len;
} text_t;
void gca__text_put(text_t *t, const char *fmt, ...) GCA_PRINTF(2, 3);
/* Parse "24GiB", "1.5GB", "4096" into bytes. Returns false on bad text or overflow. */
bool gca__parse_size(const char *text, size_t len, uint64_t *out);
/* The decimal digits at the start of text[0, len) into *out: how many were
 * read, 0 when none or when the value overflows 64 bits (no sign, no
 * blanks: callers decide what may surround the number). */
size_t gca__parse_decimal(const char *text, size_t len, uint64_t *out);
/* Format bytes as PyTorch's OOM message does: "N bytes" up to 1023, else
 * "X.YY KiB/MiB/GiB". */
void gca__format_bytes(uint64_t bytes, char *buf, size_t cap);
/* How many bytes at s start one valid UTF-8 character (1 to 4; an ASCII
 * byte is 1), or 0 when they start none (a stray continuation byte, an
 * overlong form, a surrogate, past U+10FFFF, cut short by the NUL). */
size_t gca__utf8_length(const unsigned char *s);
/* Write s as a JSON string literal, quotes included, that is valid UTF-8
 * whatever s holds: '"', '\\', control characters and '<', '>', '&' (so
 * that it is also safe inside an HTML script) as \u escapes, valid UTF-8
 * as it is, and each byte that is not part of valid UTF-8 as \udcNN (NN
 * its value): Python's surrogateescape, so that
 * json.load(f)[...].encode("utf-8", "surrogateescape") gives the bytes
 * back. NULL is written as "". */
void gca__json_string(FILE *f, const char *s);

/* Regions shared between processes (shm.c). A process is still the one a
 * slot names when it lives with the start time recorded
 * (/proc/PID/stat: a reused pid has another). */
uint64_t gca__process_start_time(int pid);
bool gca__process_alive(int pid, uint64_t start_time);
/* This process's pid namespace (the inode of /proc/self/ns/pid; 0 when it
 * cannot be read). A process in another one (a container sharing /dev/shm
 * with --ipc=host) has pids this one's /proc does not show. */
uint64_t gca__pid_namespace(void);
/* gca__process_alive for a process recorded with its pid namespace: one of
 * another namespace counts as alive (its pid cannot be checked from here;
 * the processes of its own namespace reclaim its slot). */
bool gca__slot_process_alive(int pid, uint64_t start_time, uint64_t pidns);
/* A slot's liveness by lock (shm.c): its process takes (or lets go of,
 * `on` false) a lock on byte `slot` of the region's file `fd`, and keeps
 * the file open while it holds the slot. */
bool gca__slot_lock(int fd, int slot, bool on);
/* Whether another open file holds slot's byte: 1, 0, or -1 (cannot tell). */
int gca__slot_lock_held(int fd, int slot);
/* A slot's process alive: its lock (when `locked`, the owner said it took
 * one) gone means dead, whatever its namespace; held, alive when its pid
 * is another namespace's; else its pid and start time decide
 * (gca__slot_process_alive). No wait in any case. */
bool gca__slot_alive(int fd, int slot, bool locked, int pid, uint64_t start_time, uint64_t pidns);
/* A process-shared robust mutex; locking one whose owner died makes it
 * consistent (the caller repairs what the dead owner held). */
int gca__shared_mutex_init(pthread_mutex_t *m);
void gca__shared_mutex_lock_at(pthread_mutex_t *m, int rank, const char *file, int line);
#define gca__shared_mutex_lock(m, rank) gca__shared_mutex_lock_at(m, rank, __FILE__, __LINE__)
/* The same, giving up after `ns` nanoseconds (false: not locked): a
 * process stopped while it holds the lock (SIGSTOP, a suspended job) is not
 * dead, and a robust mutex waits for it for ever. */
bool gca__shared_mutex_lock_within_at(pthread_mutex_t *m, int rank, uint64_t ns, const char *file, int line);
#define gca__shared_mutex_lock_within(m, rank, ns) gca__shared_mutex_lock_within_at(m, rank, ns, __FILE__, __LINE__)
#define gca__shared_mutex_unlock(m) mutex_unlock(m)
/* The POSIX shared-memory object `path` of exactly `size` bytes, mapped:
 * created (zeroed, with `mode`) when it does not exist, *created then
 * true. NULL with the error set (GCA_ERR_BACKEND naming it) when it cannot
 * be had or has another size. With fd_out, its file stays open there (for
 * the slot locks; -1 when none). */
void *gca__shared_region_open(const char *path, size_t size, unsigned mode, bool *created, int *fd_out);
/* Wait (up to a second) for a region's creator to set its magic; false
 * when it never did. */
bool gca__shared_region_wait(_Atomic uint64_t *magic);

#endif /* GCALLOC_BASE_H */
