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
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

#define ERROR_TEXT_MAX 2048

static _Thread_local int last_status;
static _Thread_local char last_text[ERROR_TEXT_MAX];

GCA_COLD int set_error(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_text, sizeof last_text, fmt, ap);
  va_end(ap);
  last_status = status;
  return status;
}

int prefix_error(const char *prefix) {
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

void clear_error(void) {
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

const char *gca_version(void) {
#define GCA_STR2(x) #x
#define GCA_STR(x) GCA_STR2(x)
  return GCA_STR(GCALLOC_VERSION_MAJOR) "." GCA_STR(GCALLOC_VERSION_MINOR) "." GCA_STR(
      GCALLOC_VERSION_PATCH);
}

/* ---- logging ------------------------------------------------------------ */

#define SEEN_SLOTS 1024

/* Read without a lock on every call that might log: one relaxed load. It
 * starts at "warning" and takes GCALLOC_LOG's value at the first gca_open. */
_Atomic int log_level_now = GCA_LOG_WARNING;
/* Nonzero while any call must take the observed (slow) entry: trace-level
 * logging or a trace file. The API's entry points test it once. */
_Atomic int calls_observed;

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
  uint64_t h = text_hash(msg);
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

static void update_observed(void) {
  int trace = atomic_load(&log_level_now) >= GCA_LOG_TRACE;
  atomic_store(&calls_observed, trace | (trace_file_active() ? 2 : 0));
}

static void load_log_settings(void) {
  const char *level = getenv("GCALLOC_LOG");
  if (level && *level) {
    static const char *const aliases[] = {"off", "error", "warn", "info", "debug", "trace"};
    int found = -1;
    for (int i = 0; i <= GCA_LOG_TRACE; i++)
      if (!strcasecmp(level, aliases[i]) || !strcasecmp(level, level_names[i])) found = i;
    if (found >= 0) atomic_store(&log_level_now, found);
    else
      log_message(GCA_LOG_WARNING, "GCALLOC_LOG=%s is not one of off, error, warn, info, debug, trace; "
                                   "the level stays warn", level);
  }
  const char *path = getenv("GCALLOC_LOG_FILE");
  if (path && *path) {
    FILE *f = fopen(path, "a");
    if (f) {
      setvbuf(f, NULL, _IOLBF, 0);
      pthread_mutex_lock(&log_lock);
      log_file = f;
      pthread_mutex_unlock(&log_lock);
    } else {
      log_message(GCA_LOG_WARNING, "GCALLOC_LOG_FILE=%s cannot be opened (%s); logging to stderr", path,
                  strerror(errno));
    }
  }
  update_observed();
}

void log_init(void) { pthread_once(&log_once, load_log_settings); }

void log_refresh_observed(void) { update_observed(); }

gca_log_level gca_set_log_level(gca_log_level level) {
  log_init();
  if (level < GCA_LOG_OFF) level = GCA_LOG_OFF;
  if (level > GCA_LOG_TRACE) level = GCA_LOG_TRACE;
  gca_log_level old = (gca_log_level)atomic_exchange(&log_level_now, (int)level);
  update_observed();
  return old;
}

gca_log_level gca_get_log_level(void) { return (gca_log_level)atomic_load(&log_level_now); }

void gca_set_log_handler(gca_log_fn fn, void *user) {
  pthread_mutex_lock(&log_lock);
  log_fn = fn;
  log_user = user;
  pthread_mutex_unlock(&log_lock);
}

void log_message(gca_log_level level, const char *fmt, ...) {
  if (!log_on(level)) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);

  pthread_mutex_lock(&log_lock);
  gca_log_fn fn = log_fn;
  void *user = log_user;
  /* Warnings repeat (every device, every set_config): print each once. */
  bool print = fn == NULL && (level != GCA_LOG_WARNING || first_sighting(msg));
  FILE *out = log_file ? log_file : stderr;
  if (print) fprintf(out, "gcalloc: %s: %s\n", level_names[level], msg);
  pthread_mutex_unlock(&log_lock);
  if (fn) fn(level, msg, user);
}
