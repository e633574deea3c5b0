/* Trace recording: every allocation call written to GCALLOC_TRACE_FILE as a
 * line, and read back (docs/observability.md has the format). */
#ifndef GCALLOC_RECORD_H
#define GCALLOC_RECORD_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef enum record_call {
  RC_OPEN,          /* id backend config */
  RC_CLOSE,         /* id */
  RC_MALLOC,        /* id device stream size ptr */
  RC_FREE,          /* id ptr status */
  RC_RECORD_STREAM, /* id ptr stream status */
  RC_EMPTY_CACHE,   /* id device status */
  RC_FREE_COMPLETED /* id ptr: a pending free's block became reusable (version 2) */
} record_call;

typedef struct recorded_call {
  int64_t time_us;
  uint64_t thread;
  int call;          /* record_call */
  int allocator;
  int device;
  uint64_t stream;
  uint64_t size;
  uint64_t ptr;
  int status;
  int pending;       /* free: 1 when it left its block pending (a free_completed line follows) */
  char text[2][256]; /* open: backend, config ("-" for none) */
} recorded_call_t;

typedef struct recorded_calls {
  recorded_call_t *calls;
  size_t count;
} recorded_calls_t;

/* Read a trace file; GCA_ERR_IO or GCA_ERR_INVALID (naming the line) on failure. */
int record_read(const char *path, recorded_calls_t *out);
/* Read it a call at a time, without holding the calls (a recorded call is
 * 600 bytes): `each` gets every call and its line number, and reading stops
 * at the first status other than GCA_OK it returns, which is returned. */
typedef int (*record_each_fn)(void *ctx, const recorded_call_t *call, size_t lineno);
int record_read_each(const char *path, record_each_fn each, void *ctx);
/* The same from an open file, from where it is; `path` names it in errors. */
int record_read_each_file(FILE *f, const char *path, record_each_fn each, void *ctx);
void record_free(recorded_calls_t *calls);

#endif
