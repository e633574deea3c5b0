/* Trace recording: with GCALLOC_TRACE_FILE=path set when the first allocator
 * opens, every allocation call of the process (open, malloc, free,
 * record_stream, empty_cache, close) is written to that file, one line each,
 * so the run can be replayed elsewhere (`gcalloc replay` reads it).
 *
 *   # gcalloc trace 2
 *   TIME_US THREAD open ID BACKEND CONFIG
 *   TIME_US THREAD malloc ID DEVICE STREAM SIZE PTR
 *   TIME_US THREAD free ID PTR STATUS [1]
 *   TIME_US THREAD record_stream ID PTR STREAM STATUS
 *   TIME_US THREAD empty_cache ID DEVICE STATUS
 *   TIME_US THREAD close ID
 *   TIME_US THREAD free_completed ID PTR
 *
 * TIME_US: microseconds since the Unix epoch; THREAD: the calling thread's
 * id; ID: which allocator of the process; STREAM and PTR in hex (PTR 0: the
 * malloc failed); STATUS: the call's gca_status; BACKEND and CONFIG as given
 * to gca_open ("-" for none; they hold no spaces). Lines starting with '#'
 * are comments.
 *
 * Version 2 adds what a replay needs of record_stream: a free whose block
 * was used on other streams leaves it pending until their work is done, and
 * the memory is reused only then. Such a free ends in " 1", and a
 * free_completed line follows when its block became reusable (PyTorch's
 * snapshots have free_requested and free_completed for the same reason).
 * A completion happens inside some call, traced or not (a malloc or a
 * synchronize looks at the events), under the device's lock: it is kept
 * and written before the next line, so before any call that could reuse
 * the memory; its time and thread are the completion's. Version 1 traces
 * have neither, and read as before.
 *
 * While recording, a traced call holds the file's lock across the call and
 * its line, so the file's order is the order the allocator saw: a pointer is
 * never freed in the file before it is allocated, even across threads. That
 * serializes the allocator while a trace is written; it is a debugging aid.
 * The lock is given up while the call runs the user's callbacks or waits
 * for memory (record_suspend): a callback may call gcalloc, and the memory
 * waited for comes from other threads' traced frees. Nothing the call has
 * done is visible to another thread then, so the order still holds.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "observe/observe.h"

static pthread_mutex_t record_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t record_once = PTHREAD_ONCE_INIT;
static FILE *_Atomic record_file;
static const char *record_path; /* (the environment's string, which outlives it) */
static _Atomic int next_allocator_id;

bool gca__trace_file_active(void) { return atomic_load_explicit(&record_file, memory_order_relaxed) != NULL; }

static const call_recorder_t hooks; /* (below) */

static void open_from_environment(void) {
  const char *path = getenv("GCALLOC_TRACE_FILE");
  if (!path || !*path) return;
  FILE *f = fopen(path, "w");
  if (!f) {
    gca__log_message(GCA_LOG_WARNING, "GCALLOC_TRACE_FILE=%s cannot be opened (%s); nothing is recorded", path,
                     strerror(errno));
    return;
  }
  fputs("# gcalloc trace 2\n", f);
  if (fflush(f) != 0 || ferror(f)) {
    gca__log_message(GCA_LOG_WARNING, "GCALLOC_TRACE_FILE=%s cannot be written (%s); nothing is recorded", path,
                     strerror(errno));
    fclose(f);
    return;
  }
  record_path = path;
  atomic_store(&record_file, f);
  atomic_store(&gca__call_recorder, &hooks);
  gca__log_set_calls_recorded(true);
}

/* A write failed (a full disk): say so once, and stop recording rather
 * than leave a trace that silently lacks calls. The caller holds
 * record_lock (and a log hold). */
static void write_failed(FILE *f) {
  gca__log_message(GCA_LOG_WARNING, "GCALLOC_TRACE_FILE=%s: a write failed (%s); recording stops here, and the trace "
                   "ends before this call", record_path ? record_path : "?", strerror(errno));
  atomic_store(&record_file, NULL);
  atomic_store(&gca__call_recorder, NULL);
  fclose(f);
  gca__log_set_calls_recorded(false);
}

int gca__record_init(void) {
  pthread_once(&record_once, open_from_environment);
  return atomic_fetch_add(&next_allocator_id, 1);
}

/* How deep this thread holds record_lock: a call made from inside a traced
 * call on the same thread (a log handler's, say) counts, not locks again. */
static _Thread_local int record_depth;

void gca__record_lock_calls(void) {
  if (!gca__trace_file_active()) return;
  gca__log_hold();
  if (record_depth++ == 0) mutex_lock(&record_lock, RANK_RECORD);
}

void gca__record_unlock_calls(void) {
  if (record_depth == 0) return; /* (not taken: no trace file then) */
  if (--record_depth == 0) mutex_unlock(&record_lock);
  gca__log_release();
}

int gca__record_suspend(void) {
  int depth = record_depth;
  if (depth == 0) return 0;
  record_depth = 0;
  mutex_unlock(&record_lock);
  for (int i = 0; i < depth; i++) gca__log_release();
  return depth;
}

void gca__record_resume(int depth) {
  if (depth == 0) return;
  for (int i = 0; i < depth; i++) gca__log_hold();
  mutex_lock(&record_lock, RANK_RECORD);
  record_depth = depth;
}

/* ---- pending frees ------------------------------------------------------ */

static _Thread_local bool free_left_pending;

void gca__record_note_free_pending(void) { free_left_pending = true; }

bool gca__record_free_left_pending(void) {
  bool was = free_left_pending;
  free_left_pending = false;
  return was;
}

/* Completions not written yet. Their lock is taken under a device's lock
 * and under record_lock, and nothing is taken under it. */
typedef struct completion {
  int64_t time_us;
  long thread;
  int allocator;
  uintptr_t ptr;
} completion_t;

static pthread_mutex_t completions_lock = PTHREAD_MUTEX_INITIALIZER;
static completion_t *completions;
static size_t completion_count, completion_cap, completions_lost;

void gca__record_free_completed(int allocator, uintptr_t ptr) {
  completion_t c = {gca__wall_us(), (long)syscall(SYS_gettid), allocator, ptr};
  mutex_lock(&completions_lock, RANK_COMPLETIONS);
  if (completion_count == completion_cap) {
    completion_t *grown = gca__grow_array(completions, &completion_cap, sizeof *grown, 64);
    if (grown) completions = grown;
  }
  if (completion_count < completion_cap) completions[completion_count++] = c;
  else completions_lost++;
  mutex_unlock(&completions_lock);
}

/* Write the completions kept; the caller holds record_lock. */
static void write_completions(FILE *f) {
  mutex_lock(&completions_lock, RANK_COMPLETIONS);
  for (size_t i = 0; i < completion_count; i++) {
    const completion_t *c = &completions[i];
    fprintf(f, "%" PRId64 " %ld free_completed %d %" PRIxPTR "\n", c->time_us, c->thread, c->allocator, c->ptr);
  }
  completion_count = 0;
  if (completions_lost) {
    /* (A replay then keeps those blocks live to the end: it says more than it should, never less.) */
    fprintf(f, "# %zu completions of pending frees lost here: out of host memory\n", completions_lost);
    completions_lost = 0;
  }
  mutex_unlock(&completions_lock);
}

/* Write one line; the caller holds record_lock. */
void gca__record_line(const char *call, const char *fmt, ...) {
  FILE *f = atomic_load(&record_file);
  if (!f) return;
  write_completions(f);
  fprintf(f, "%" PRId64 " %ld %s ", gca__wall_us(), (long)syscall(SYS_gettid), call);
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  if (fflush(f) != 0 || ferror(f)) write_failed(f);
}

static const call_recorder_t hooks = {gca__record_note_free_pending, gca__record_free_completed,
                                      gca__record_suspend, gca__record_resume};
