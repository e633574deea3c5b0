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

#include "../internal.h"
#include "record.h"

static pthread_mutex_t record_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t record_once = PTHREAD_ONCE_INIT;
static FILE *_Atomic record_file;
static const char *record_path; /* (the environment's string, which outlives it) */
static _Atomic int next_allocator_id;

bool trace_file_active(void) { return atomic_load_explicit(&record_file, memory_order_relaxed) != NULL; }

static void open_from_environment(void) {
  const char *path = getenv("GCALLOC_TRACE_FILE");
  if (!path || !*path) return;
  FILE *f = fopen(path, "w");
  if (!f) {
    log_message(GCA_LOG_WARNING, "GCALLOC_TRACE_FILE=%s cannot be opened (%s); nothing is recorded", path,
                strerror(errno));
    return;
  }
  fputs("# gcalloc trace 2\n", f);
  if (fflush(f) != 0 || ferror(f)) {
    log_message(GCA_LOG_WARNING, "GCALLOC_TRACE_FILE=%s cannot be written (%s); nothing is recorded", path,
                strerror(errno));
    fclose(f);
    return;
  }
  record_path = path;
  atomic_store(&record_file, f);
  log_refresh_observed();
}

/* A write failed (a full disk): say so once, and stop recording rather
 * than leave a trace that silently lacks calls. The caller holds
 * record_lock (and a log hold). */
static void write_failed(FILE *f) {
  log_message(GCA_LOG_WARNING, "GCALLOC_TRACE_FILE=%s: a write failed (%s); recording stops here, and the trace "
              "ends before this call", record_path ? record_path : "?", strerror(errno));
  atomic_store(&record_file, NULL);
  fclose(f);
  log_refresh_observed();
}

int record_init(void) {
  pthread_once(&record_once, open_from_environment);
  return atomic_fetch_add(&next_allocator_id, 1);
}

/* How deep this thread holds record_lock: a call made from inside a traced
 * call on the same thread (a log handler's, say) counts, not locks again. */
static _Thread_local int record_depth;

void record_lock_calls(void) {
  if (!trace_file_active()) return;
  log_hold();
  if (record_depth++ == 0) mutex_lock(&record_lock);
}

void record_unlock_calls(void) {
  if (record_depth == 0) return; /* (not taken: no trace file then) */
  if (--record_depth == 0) mutex_unlock(&record_lock);
  log_release();
}

int record_suspend(void) {
  int depth = record_depth;
  if (depth == 0) return 0;
  record_depth = 0;
  mutex_unlock(&record_lock);
  for (int i = 0; i < depth; i++) log_release();
  return depth;
}

void record_resume(int depth) {
  if (depth == 0) return;
  for (int i = 0; i < depth; i++) log_hold();
  mutex_lock(&record_lock);
  record_depth = depth;
}

/* ---- pending frees ------------------------------------------------------ */

static _Thread_local bool free_left_pending;

void record_note_free_pending(void) { free_left_pending = true; }

bool record_free_left_pending(void) {
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

void record_free_completed(int allocator, uintptr_t ptr) {
  completion_t c = {history_now_us(), (long)syscall(SYS_gettid), allocator, ptr};
  pthread_mutex_lock(&completions_lock);
  if (completion_count == completion_cap) {
    completion_t *grown = grow_array(completions, &completion_cap, sizeof *grown, 64);
    if (grown) completions = grown;
  }
  if (completion_count < completion_cap) completions[completion_count++] = c;
  else completions_lost++;
  pthread_mutex_unlock(&completions_lock);
}

/* Write the completions kept; the caller holds record_lock. */
static void write_completions(FILE *f) {
  pthread_mutex_lock(&completions_lock);
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
  pthread_mutex_unlock(&completions_lock);
}

/* Write one line; the caller holds record_lock. */
void record_line(const char *call, const char *fmt, ...) {
  FILE *f = atomic_load(&record_file);
  if (!f) return;
  write_completions(f);
  fprintf(f, "%" PRId64 " %ld %s ", history_now_us(), (long)syscall(SYS_gettid), call);
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  if (fflush(f) != 0 || ferror(f)) write_failed(f);
}

/* ---- reading ------------------------------------------------------------ */

static const char *const call_names[] = {"open",          "close",       "malloc",        "free",
                                          "record_stream", "empty_cache", "free_completed"};

/* Strict fields: digits only (no sign where none belongs, no overflow, at
 * most 16 hex digits), separated by blanks; sscanf would wrap a negative
 * size or an out-of-range device silently. Each returns false with *why
 * naming the field. */
typedef struct fields {
  const char *at;
  const char *why;
} fields_t;

static bool field_start(fields_t *f, const char *name) {
  while (*f->at == ' ' || *f->at == '\t') f->at++;
  if (!*f->at || *f->at == '\n' || *f->at == '\r') {
    f->why = name;
    return false;
  }
  return true;
}

static bool field_end(fields_t *f, const char *name) {
  if (*f->at && *f->at != ' ' && *f->at != '\t' && *f->at != '\n' && *f->at != '\r') {
    f->why = name;
    return false;
  }
  return true;
}

static bool field_u64(fields_t *f, const char *name, uint64_t *out) {
  if (!field_start(f, name)) return false;
  size_t n = parse_decimal(f->at, strlen(f->at), out);
  if (n == 0) {
    f->why = name;
    return false;
  }
  f->at += n;
  return field_end(f, name);
}

static bool field_i64(fields_t *f, const char *name, int64_t *out) {
  if (!field_start(f, name)) return false;
  bool negative = *f->at == '-';
  if (negative) f->at++;
  uint64_t v;
  if (!field_u64(f, name, &v) || v > (uint64_t)INT64_MAX) {
    f->why = name;
    return false;
  }
  *out = negative ? -(int64_t)v : (int64_t)v;
  return true;
}

static bool field_int(fields_t *f, const char *name, int lo, int hi, int *out) {
  int64_t v;
  if (!field_i64(f, name, &v) || v < lo || v > hi) {
    f->why = name;
    return false;
  }
  *out = (int)v;
  return true;
}

static bool field_hex(fields_t *f, const char *name, uint64_t *out) {
  if (!field_start(f, name)) return false;
  const char *p = f->at;
  if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) p += 2;
  uint64_t v = 0;
  size_t digits = 0;
  for (;; p++, digits++) {
    int d = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10
          : *p >= 'A' && *p <= 'F' ? *p - 'A' + 10 : -1;
    if (d < 0) break;
    if (digits == 16) { /* (leading zeros beyond 16 digits are still too many) */
      f->why = name;
      return false;
    }
    v = v << 4 | (uint64_t)d;
  }
  f->at = p;
  if (digits == 0) {
    f->why = name;
    return false;
  }
  *out = v;
  return field_end(f, name);
}

static bool field_word(fields_t *f, const char *name, char *out, size_t cap) {
  if (!field_start(f, name)) return false;
  size_t n = 0;
  while (f->at[n] && f->at[n] != ' ' && f->at[n] != '\t' && f->at[n] != '\n' && f->at[n] != '\r') n++;
  if (n >= cap) {
    f->why = name;
    return false;
  }
  memcpy(out, f->at, n);
  out[n] = '\0';
  f->at += n;
  return true;
}

/* Nothing but blanks left. */
static bool fields_done(fields_t *f) {
  while (*f->at == ' ' || *f->at == '\t' || *f->at == '\r' || *f->at == '\n') f->at++;
  if (*f->at) f->why = "the end of the line";
  return !*f->at;
}

/* Devices a trace line may name (a process has at most this many). */
#define RECORD_DEVICE_MAX 255
/* Statuses are gca_status values: 0 and small negatives. */
#define RECORD_STATUS_MIN (-99)

/* 0, or -1 with *why naming the field that is wrong. */
static int parse_line(const char *line, recorded_call_t *c, const char **why) {
  char name[32];
  memset(c, 0, sizeof *c);
  fields_t f = {line, NULL};
  bool ok = field_i64(&f, "the time", &c->time_us) && field_u64(&f, "the thread", &c->thread) &&
            field_word(&f, "the call", name, sizeof name) &&
            field_int(&f, "the allocator id", 0, INT32_MAX, &c->allocator);
  c->call = -1;
  for (int i = 0; ok && i < (int)(sizeof call_names / sizeof call_names[0]); i++)
    if (!strcmp(name, call_names[i])) c->call = i;
  if (ok && c->call < 0) {
    f.why = "the call (open, close, malloc, free, record_stream, empty_cache, free_completed)";
    ok = false;
  }
  if (ok) {
    switch (c->call) {
      case RC_OPEN:
        ok = field_word(&f, "the backend", c->text[0], sizeof c->text[0]) &&
             field_word(&f, "the configuration", c->text[1], sizeof c->text[1]);
        break;
      case RC_CLOSE: break;
      case RC_MALLOC:
        ok = field_int(&f, "the device (0-255)", 0, RECORD_DEVICE_MAX, &c->device) &&
             field_hex(&f, "the stream (at most 16 hex digits)", &c->stream) &&
             field_u64(&f, "the size (a decimal number of bytes)", &c->size) &&
             field_hex(&f, "the pointer (at most 16 hex digits)", &c->ptr);
        break;
      case RC_FREE:
        ok = field_hex(&f, "the pointer (at most 16 hex digits)", &c->ptr) &&
             field_int(&f, "the status", RECORD_STATUS_MIN, 0, &c->status);
        if (ok && !fields_done(&f)) {
          f.why = NULL;
          ok = field_int(&f, "the pending flag (0 or 1)", 0, 1, &c->pending);
        }
        break;
      case RC_FREE_COMPLETED: ok = field_hex(&f, "the pointer (at most 16 hex digits)", &c->ptr); break;
      case RC_RECORD_STREAM:
        ok = field_hex(&f, "the pointer (at most 16 hex digits)", &c->ptr) &&
             field_hex(&f, "the stream (at most 16 hex digits)", &c->stream) &&
             field_int(&f, "the status", RECORD_STATUS_MIN, 0, &c->status);
        break;
      case RC_EMPTY_CACHE:
        ok = field_int(&f, "the device (-1 for all, or 0-255)", -1, RECORD_DEVICE_MAX, &c->device) &&
             field_int(&f, "the status", RECORD_STATUS_MIN, 0, &c->status);
        break;
      default: ok = false;
    }
  }
  if (ok) ok = fields_done(&f);
  *why = f.why ? f.why : "the line";
  return ok ? 0 : -1;
}

/* Lines longer than this are refused: a recorded line is under 600
 * characters (an open line's backend and configuration, 255 each, are the
 * longest). */
#define RECORD_LINE_MAX 1024

int record_read_each(const char *path, record_each_fn each, void *ctx) {
  FILE *f = fopen(path, "r");
  if (!f) return set_error(GCA_ERR_IO, "cannot read the trace %s: %s", path, strerror(errno));
  int rc = record_read_each_file(f, path, each, ctx);
  fclose(f);
  return rc;
}

int record_read_each_file(FILE *f, const char *path, record_each_fn each, void *ctx) {
  char line[RECORD_LINE_MAX + 2];
  size_t lineno = 0;
  int rc = GCA_OK;
  recorded_call_t call;
  while (rc == GCA_OK && fgets(line, sizeof line, f)) {
    lineno++;
    size_t n = strlen(line);
    if (n && line[n - 1] != '\n' && !feof(f)) {
      /* fgets stops at a full buffer or a newline: short of both, the
       * line has a NUL where strlen stopped. */
      if (n + 1 < sizeof line) rc = set_error(GCA_ERR_INVALID, "trace %s, line %zu: holds a NUL character", path, lineno);
      else rc = set_error(GCA_ERR_INVALID, "trace %s, line %zu: longer than %d characters", path, lineno,
                          RECORD_LINE_MAX);
      break;
    }
    if (line[0] == '#' || line[0] == '\n') continue;
    const char *why;
    if (parse_line(line, &call, &why) != 0) {
      line[strcspn(line, "\n")] = '\0';
      rc = set_error(GCA_ERR_INVALID, "trace %s, line %zu: %s is missing or out of range: '%.80s'", path, lineno, why,
                     line);
      break;
    }
    rc = each(ctx, &call, lineno);
  }
  if (rc == GCA_OK && ferror(f)) rc = set_error(GCA_ERR_IO, "cannot read the trace %s", path);
  return rc;
}

typedef struct record_collect {
  const char *path;
  recorded_calls_t *out;
  size_t cap;
} record_collect_t;

static int collect_call(void *ctx, const recorded_call_t *call, size_t lineno) {
  (void)lineno;
  record_collect_t *c = ctx;
  if (c->out->count == c->cap) {
    recorded_call_t *grown = grow_array(c->out->calls, &c->cap, sizeof *grown, 1024);
    if (!grown) return set_error(GCA_ERR_NOMEM, "out of host memory reading the trace %s", c->path);
    c->out->calls = grown;
  }
  c->out->calls[c->out->count++] = *call;
  return GCA_OK;
}

int record_read(const char *path, recorded_calls_t *out) {
  memset(out, 0, sizeof *out);
  record_collect_t c = {.path = path, .out = out};
  int rc = record_read_each(path, collect_call, &c);
  if (rc) record_free(out);
  return rc;
}

void record_free(recorded_calls_t *calls) {
  free(calls->calls);
  calls->calls = NULL;
  calls->count = 0;
}
