/* Reading a gcalloc trace (GCALLOC_TRACE_FILE's format, written by
 * src/observe/record.c; docs/observability.md has it) back into calls,
 * strictly: every field checked, the line and field named on refusal.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "replay/record.h"

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
  size_t n = gca__parse_decimal(f->at, strlen(f->at), out);
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
  const char *p = f->at; /* (written bare: a 0x prefix is not the format) */
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

/* The first line names the format's version: 1 (frees complete at once) or
 * 2 (a free may leave its block pending, with free_completed lines). */
static bool known_version(const char *line) {
  static const char head[] = "# gcalloc trace ";
  if (strncmp(line, head, sizeof head - 1)) return false;
  const char *v = line + sizeof head - 1;
  return (v[0] == '1' || v[0] == '2') && (v[1] == '\n' || v[1] == '\r' || v[1] == ' ' || v[1] == '\0');
}

int record_read_each(const char *path, record_each_fn each, void *ctx) {
  FILE *f = fopen(path, "r");
  if (!f) return gca__set_error(GCA_ERR_IO, "cannot read the trace %s: %s", path, strerror(errno));
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
      if (n + 1 < sizeof line)
        rc = gca__set_error(GCA_ERR_INVALID, "trace %s, line %zu: holds a NUL character", path, lineno);
      else rc = gca__set_error(GCA_ERR_INVALID, "trace %s, line %zu: longer than %d characters", path, lineno,
                               RECORD_LINE_MAX);
      break;
    }
    if (lineno == 1 && !known_version(line)) {
      line[strcspn(line, "\n")] = '\0';
      rc = gca__set_error(GCA_ERR_INVALID, "trace %s, line 1: '%.80s' is not the header of a gcalloc trace this "
                          "version reads ('# gcalloc trace 1' or '# gcalloc trace 2')", path, line);
      break;
    }
    if (line[0] == '#' || line[0] == '\n') continue;
    const char *why;
    if (parse_line(line, &call, &why) != 0) {
      line[strcspn(line, "\n")] = '\0';
      rc = gca__set_error(GCA_ERR_INVALID, "trace %s, line %zu: %s is missing or out of range: '%.80s'", path, lineno, why,
                          line);
      break;
    }
    rc = each(ctx, &call, lineno);
  }
  if (rc == GCA_OK && ferror(f)) rc = gca__set_error(GCA_ERR_IO, "cannot read the trace %s", path);
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
    recorded_call_t *grown = gca__grow_array(c->out->calls, &c->cap, sizeof *grown, 1024);
    if (!grown) return gca__set_error(GCA_ERR_NOMEM, "out of host memory reading the trace %s", c->path);
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
