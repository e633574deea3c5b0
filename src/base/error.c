/* Errors and logging.
 *
 * A failing call leaves its status and a message in thread-local storage, so
 * concurrent callers never see each other's errors and the hot path pays
 * nothing when it succeeds. Log messages go through one process-wide handler,
 * filtered by a level (GCALLOC_LOG, gca_set_log_level) that every call site
 * tests first, so a disabled level costs one predictable branch. The default
 * handler writes to stderr or GCALLOC_LOG_FILE, and prints each distinct
 * warning once, because a warning about a configuration key would otherwise
 * repeat on every device and every gca_set_config call. The dedup table is
 * bounded; once it is full, warnings are still printed (never dropped), just
 * no longer deduplicated.
 *
 * A handler may call back into gcalloc, so it never runs while this thread
 * holds one of the library's locks: code that may log under a lock brackets
 * the locked region with log_hold()/log_release(), and messages logged
 * meanwhile are kept (per thread, in order) and delivered when the
 * outermost hold ends. Debug builds assert that no message is logged under
 * a lock outside such a region.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/base.h"

#define ERROR_TEXT_MAX 2048

#ifndef NDEBUG
GCA_COLD void gca__assert_failed(const char *cond, const char *file, int line) {
  fprintf(stderr, "gcalloc: internal invariant broken at %s:%d: %s\n", file, line, cond);
  abort();
}
#endif

static _Thread_local int last_status;
static _Thread_local char last_text[ERROR_TEXT_MAX];

GCA_COLD int gca__set_error(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_text, sizeof last_text, fmt, ap);
  va_end(ap);
  last_status = status;
  return status;
}

int gca__prefix_error(const char *fmt, ...) {
  char prefix[ERROR_TEXT_MAX / 2 + 1];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  size_t n = strlen(prefix);
  if (n > ERROR_TEXT_MAX / 2) n = ERROR_TEXT_MAX / 2;
  size_t keep = strlen(last_text);
  if (keep > ERROR_TEXT_MAX - n - 3) keep = ERROR_TEXT_MAX - n - 3;
  memmove(last_text + n + 2, last_text, keep);
  last_text[n + 2 + keep] = '\0';
  memcpy(last_text, prefix, n);
  last_text[n] = ':';
  last_text[n + 1] = ' ';
  return last_status;
}

int gca__append_error(const char *fmt, ...) {
  size_t len = strlen(last_text);
  if (len + 1 < ERROR_TEXT_MAX) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_text + len, ERROR_TEXT_MAX - len, fmt, ap);
    va_end(ap);
  }
  return last_status;
}

void gca__clear_error(void) {
  last_status = GCA_OK;
  last_text[0] = '\0';
}

const char *gca_last_error(void) { return last_text; }

gca_status gca_last_status(void) { return (gca_status)last_status; }

const char *gca_status_name(int status) {
  switch (status) {
    case GCA_OK: return "GCA_OK";
    case GCA_ERR_INVALID: return "GCA_ERR_INVALID";
    case GCA_ERR_OOM: return "GCA_ERR_OOM";
    case GCA_ERR_CONFIG: return "GCA_ERR_CONFIG";
    case GCA_ERR_BACKEND: return "GCA_ERR_BACKEND";
    case GCA_ERR_BAD_POINTER: return "GCA_ERR_BAD_POINTER";
    case GCA_ERR_NOMEM: return "GCA_ERR_NOMEM";
    case GCA_ERR_CORRUPT: return "GCA_ERR_CORRUPT";
    case GCA_ERR_IO: return "GCA_ERR_IO";
    default: return "GCA_ERR_UNKNOWN";
  }
}

const char *gca_version(void) { return GCALLOC_VERSION_STRING; }

/* ---- logging ------------------------------------------------------------ */

#define SEEN_SLOTS 1024

/* Read without a lock on every call that might log: one relaxed load. It
 * starts at "warning" and takes GCALLOC_LOG's value at the first gca_open. */
_Atomic int gca__log_level_now = GCA_LOG_WARNING;
/* Nonzero while any call must take the observed (slow) entry: trace-level
 * logging or a trace file. The API's entry points test it once. */
_Atomic int gca__calls_observed;

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;
static gca_log_fn log_fn;
static void *log_user;
static FILE *log_file; /* GCALLOC_LOG_FILE, else stderr */
static uint64_t seen_hashes[SEEN_SLOTS];
static size_t seen_count;

static const char *const level_names[] = {"off", "error", "warning", "info", "debug", "trace"};

/* True the first time a message is seen (or when the table is full). */
static bool first_sighting(const char *msg) {
  uint64_t h = gca__text_hash(msg);
  size_t slot = (size_t)h & (SEEN_SLOTS - 1);
  for (size_t probe = 0; probe < SEEN_SLOTS; probe++) {
    size_t i = (slot + probe) & (SEEN_SLOTS - 1);
    if (seen_hashes[i] == h) return false;
    if (seen_hashes[i] == 0) {
      if (seen_count < SEEN_SLOTS / 2) {
        seen_hashes[i] = h;
        seen_count++;
      }
      return true;
    }
  }
  return true;
}

/* Set by trace recording (src/observe/record.c) while a file is written. */
static _Atomic bool calls_recorded;

/* Devices whose history wants Python frames (gca__log_python_frames). */
static _Atomic int python_devices;

/* The flags, recomputed; the guards above them (counted by
 * gca__calls_guard, from any thread at any time) kept. */
static void update_observed(void) {
  int trace = atomic_load(&gca__log_level_now) >= GCA_LOG_TRACE;
  int flags = trace | (atomic_load(&calls_recorded) ? 2 : 0) |
              (atomic_load(&python_devices) > 0 ? GCA_OBSERVED_PYTHON : 0);
  int was = atomic_load(&gca__calls_observed);
  while (!atomic_compare_exchange_weak(&gca__calls_observed, &was, (was & ~GCA_OBSERVED_FLAGS) | flags)) {
  }
}

void gca__calls_guard(int delta) { atomic_fetch_add(&gca__calls_observed, delta * GCA_OBSERVED_GUARD); }

void gca__log_python_frames(int delta) {
  atomic_fetch_add(&python_devices, delta);
  update_observed();
}

static void load_log_settings(void) {
  const char *level = getenv("GCALLOC_LOG");
  if (level && *level) {
    static const char *const aliases[] = {"off", "error", "warn", "info", "debug", "trace"};
    int found = -1;
    for (int i = 0; i <= GCA_LOG_TRACE; i++)
      if (!strcasecmp(level, aliases[i]) || !strcasecmp(level, level_names[i])) found = i;
    if (found >= 0) atomic_store(&gca__log_level_now, found);
    else
      gca__log_message(GCA_LOG_WARNING, "GCALLOC_LOG=%s is not one of off, error, warn, info, debug, trace; "
                                   "the level stays warn", level);
  }
  const char *path = getenv("GCALLOC_LOG_FILE");
  if (path && *path) {
    FILE *f = fopen(path, "a");
    if (f) {
      setvbuf(f, NULL, _IOLBF, 0);
      mutex_lock(&log_lock, RANK_LOG);
      log_file = f;
      mutex_unlock(&log_lock);
    } else {
      gca__log_message(GCA_LOG_WARNING, "GCALLOC_LOG_FILE=%s cannot be opened (%s); logging to stderr", path,
                       strerror(errno));
    }
  }
  update_observed();
}

void gca__log_init(void) { pthread_once(&log_once, load_log_settings); }

void gca__log_set_calls_recorded(bool on) {
  atomic_store(&calls_recorded, on);
  update_observed();
}

gca_log_level gca_set_log_level(gca_log_level level) {
  gca__log_init();
  if (level < GCA_LOG_OFF) level = GCA_LOG_OFF;
  if (level > GCA_LOG_TRACE) level = GCA_LOG_TRACE;
  gca_log_level old = (gca_log_level)atomic_exchange(&gca__log_level_now, (int)level);
  update_observed();
  return old;
}

gca_log_level gca_get_log_level(void) { return (gca_log_level)atomic_load(&gca__log_level_now); }

/* The calling thread's own handler (gca_set_thread_log_handler). */
static _Thread_local gca_log_fn thread_fn;
static _Thread_local void *thread_user;

void gca_set_thread_log_handler(gca_log_fn fn, void *user) {
  thread_fn = fn;
  thread_user = fn ? user : NULL;
}

void gca_set_log_handler(gca_log_fn fn, void *user) {
  mutex_lock(&log_lock, RANK_LOG);
  log_fn = fn;
  log_user = user;
  mutex_unlock(&log_lock);
}

/* ---- messages held while a lock is ------------------------------------- */

typedef struct held_message {
  struct held_message *next;
  gca_log_level level;
  char text[];
} held_message_t;

static _Thread_local int hold_depth;
static _Thread_local held_message_t *held_first, *held_last;
static _Thread_local size_t held_lost; /* not kept: out of host memory */

static void deliver(gca_log_level level, const char *msg);

void gca__log_hold(void) { hold_depth++; }

void gca__log_release(void) {
  if (--hold_depth > 0 || (!held_first && !held_lost)) return;
  /* Taken off the list first: a handler may log, and hold, again. */
  held_message_t *m = held_first;
  size_t lost = held_lost;
  held_first = held_last = NULL;
  held_lost = 0;
  while (m) {
    held_message_t *next = m->next;
    deliver(m->level, m->text);
    free(m);
    m = next;
  }
  if (lost) {
    char note[96];
    snprintf(note, sizeof note, "%zu log message%s lost: out of host memory", lost, lost == 1 ? "" : "s");
    deliver(GCA_LOG_ERROR, note);
  }
}

static void keep_held(gca_log_level level, const char *msg) {
  size_t n = strlen(msg) + 1;
  held_message_t *m = malloc(sizeof *m + n);
  if (!m) {
    held_lost++;
    return;
  }
  m->next = NULL;
  m->level = level;
  memcpy(m->text, msg, n);
  if (held_last) held_last->next = m;
  else held_first = m;
  held_last = m;
}

void gca__log_message(gca_log_level level, const char *fmt, ...) {
  if (!log_on(level)) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (hold_depth > 0) {
    keep_held(level, msg);
    return;
  }
  GCA_ASSERT(LOCKS_HELD() == 0);
  deliver(level, msg);
}

static void deliver(gca_log_level level, const char *msg) {
  mutex_lock(&log_lock, RANK_LOG);
  gca_log_fn fn = thread_fn ? thread_fn : log_fn;
  void *user = thread_fn ? thread_user : log_user;
  /* Warnings repeat (every device, every set_config): print each once. */
  bool print = fn == NULL && (level != GCA_LOG_WARNING || first_sighting(msg));
  FILE *out = log_file ? log_file : stderr;
  if (print) fprintf(out, "gcalloc: %s: %s\n", level_names[level], msg);
  mutex_unlock(&log_lock);
  if (!fn) return;
  /* The handler may call gcalloc: the caller's error survives it. */
  int status = last_status;
  char saved[ERROR_TEXT_MAX];
  memcpy(saved, last_text, sizeof saved);
  fn(level, msg, user);
  last_status = status;
  memcpy(last_text, saved, sizeof saved);
}
