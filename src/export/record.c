/* Trace recording: with GCALLOC_TRACE_FILE=path set when the first allocator
 * opens, every allocation call of the process (open, malloc, free,
 * record_stream, empty_cache, close) is written to that file, one line each,
 * so the run can be replayed elsewhere (issue 6's replay tool reads it).
 *
 *   # gcalloc trace 1
 *   TIME_US THREAD open ID BACKEND CONFIG
 *   TIME_US THREAD malloc ID DEVICE STREAM SIZE PTR
 *   TIME_US THREAD free ID PTR STATUS
 *   TIME_US THREAD record_stream ID PTR STREAM STATUS
 *   TIME_US THREAD empty_cache ID DEVICE STATUS
 *   TIME_US THREAD close ID
 *
 * TIME_US: microseconds since the Unix epoch; THREAD: the calling thread's
 * id; ID: which allocator of the process; STREAM and PTR in hex (PTR 0: the
 * malloc failed); STATUS: the call's gca_status; BACKEND and CONFIG as given
 * to gca_open ("-" for none; they hold no spaces). Lines starting with '#'
 * are comments.
 *
 * While recording, a traced call holds the file's lock across the call and
 * its line, so the file's order is the order the allocator saw: a pointer is
 * never freed in the file before it is allocated, even across threads. That
 * serializes the allocator while a trace is written; it is a debugging aid.
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
  fputs("# gcalloc trace 1\n", f);
  fflush(f);
  atomic_store(&record_file, f);
  log_refresh_observed();
}

int record_init(void) {
  pthread_once(&record_once, open_from_environment);
  return atomic_fetch_add(&next_allocator_id, 1);
}

void record_lock_calls(void) {
  if (trace_file_active()) pthread_mutex_lock(&record_lock);
}

void record_unlock_calls(void) {
  if (trace_file_active()) pthread_mutex_unlock(&record_lock);
}

/* Write one line; the caller holds record_lock. */
void record_line(const char *call, const char *fmt, ...) {
  FILE *f = atomic_load(&record_file);
  if (!f) return;
  fprintf(f, "%" PRId64 " %ld %s ", history_now_us(), (long)syscall(SYS_gettid), call);
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  fflush(f);
}

/* ---- reading ------------------------------------------------------------ */

static const char *const call_names[] = {"open", "close", "malloc", "free", "record_stream", "empty_cache"};

static int parse_line(const char *line, recorded_call_t *c) {
  char name[32];
  int used = 0;
  memset(c, 0, sizeof *c);
  if (sscanf(line, "%" SCNd64 " %" SCNu64 " %31s %d%n", &c->time_us, &c->thread, name, &c->allocator, &used) != 4)
    return -1;
  const char *rest = line + used;
  c->call = -1;
  for (int i = 0; i < 6; i++)
    if (!strcmp(name, call_names[i])) c->call = i;
  int n;
  switch (c->call) {
    case RC_OPEN: return sscanf(rest, " %255s %255s", c->text[0], c->text[1]) == 2 ? 0 : -1;
    case RC_CLOSE: return 0;
    case RC_MALLOC:
      n = sscanf(rest, " %d %" SCNx64 " %" SCNu64 " %" SCNx64, &c->device, &c->stream, &c->size, &c->ptr);
      return n == 4 ? 0 : -1;
    case RC_FREE: return sscanf(rest, " %" SCNx64 " %d", &c->ptr, &c->status) == 2 ? 0 : -1;
    case RC_RECORD_STREAM:
      return sscanf(rest, " %" SCNx64 " %" SCNx64 " %d", &c->ptr, &c->stream, &c->status) == 3 ? 0 : -1;
    case RC_EMPTY_CACHE: return sscanf(rest, " %d %d", &c->device, &c->status) == 2 ? 0 : -1;
    default: return -1;
  }
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
      rc = set_error(GCA_ERR_INVALID, "trace %s, line %zu: longer than %d characters", path, lineno,
                     RECORD_LINE_MAX);
      break;
    }
    if (line[0] == '#' || line[0] == '\n') continue;
    if (parse_line(line, &call) != 0) {
      line[strcspn(line, "\n")] = '\0';
      rc = set_error(GCA_ERR_INVALID, "trace %s, line %zu: not a gcalloc trace line: '%.80s'", path, lineno, line);
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
