/* Small helpers the tool's subcommands share: the command line's parsing
 * and help, a monotonic clock, a progress line on a terminal (and a trace
 * loaded with it), a comparison for qsort of timings, JSON strings. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "replay/trace.h"
#include "base/base.h"
#include "backends/sim_driver.h"
#include "tool.h"

static void print_usage(FILE *f, const tool_command_t *c) {
  fprintf(f, "usage: gcalloc %s%s%s\n", c->name, *c->usage ? " " : "", c->usage);
}

/* Complains about argv's `what` on stderr: 2. */
static int refuse(const tool_command_t *c, const char *what) {
  fprintf(stderr, "gcalloc %s: %s\n", c->name, what);
  print_usage(stderr, c);
  fprintf(stderr, "('gcalloc %s --help' says what each option does)\n", c->name);
  return 2;
}

/* The value of option `o` in `text`, stored; else 2, with the message. */
static int take_value(const tool_command_t *c, const tool_option_t *o, const char *text) {
  char why[512];
  char *end;
  switch (o->kind) {
    case OPTION_TEXT:
      *(const char **)o->out = text;
      return 0;
    case OPTION_NUMBER: {
      errno = 0;
      long n = strtol(text, &end, 10);
      if (*text && !*end && !errno && n >= o->min && n <= o->max) {
        *(long *)o->out = n;
        return 0;
      }
      snprintf(why, sizeof why, "%s '%s' is not a whole number from %ld to %ld", o->name, text, o->min, o->max);
      return refuse(c, why);
    }
    case OPTION_SECONDS: {
      double x = strtod(text, &end);
      if (*text && !*end && isfinite(x) && x >= (double)o->min && x <= (double)o->max) {
        *(double *)o->out = x;
        return 0;
      }
      snprintf(why, sizeof why, "%s '%s' is not a number of seconds from %ld to %ld", o->name, text, o->min, o->max);
      return refuse(c, why);
    }
    case OPTION_SIZE: {
      uint64_t size;
      if (gca__parse_size(text, strlen(text), &size) && size > 0 && (o->max <= 0 || size <= (uint64_t)o->max)) {
        *(uint64_t *)o->out = size;
        return 0;
      }
      if (o->max > 0 && gca__parse_size(text, strlen(text), &size) && size > 0)
        snprintf(why, sizeof why, "%s '%s' is more than the most it may be, %ld bytes", o->name, text, o->max);
      else
        snprintf(why, sizeof why, "%s '%s' is not a size like 24GiB", o->name, text);
      return refuse(c, why);
    }
    case OPTION_FLAG: break;
  }
  return refuse(c, "internal error: an option of no known kind");
}

void tool_help(const tool_command_t *c) {
  print_usage(stdout, c);
  fputs(c->help, stdout);
}

int tool_parse(const tool_command_t *c, const tool_option_t *options, int argc, char **argv, const char **operand) {
  char why[512];
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      tool_help(c);
      return -1;
    }
  if (argc == 2 && !strcmp(argv[1], "--list-options")) {
    for (const tool_option_t *o = options; o->name; o++) printf("%s\n", o->name);
    printf("--help\n");
    return -1;
  }
  if (operand) *operand = NULL;
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (arg[0] != '-' || !arg[1]) { /* ("-" alone is an operand: standard input) */
      if (!c->operand) {
        snprintf(why, sizeof why, "takes no operand ('%s' given)", arg);
        return refuse(c, why);
      }
      if (*operand) {
        snprintf(why, sizeof why, "one %s at a time ('%s', then '%s')", c->operand, *operand, arg);
        return refuse(c, why);
      }
      *operand = strcmp(arg, "-") ? arg : "/dev/stdin";
      continue;
    }
    const tool_option_t *o = options;
    while (o->name && strcmp(o->name, arg)) o++;
    if (!o->name) {
      snprintf(why, sizeof why, "unknown option '%s'", arg);
      return refuse(c, why);
    }
    if (o->kind == OPTION_FLAG) {
      *(bool *)o->out = true;
      continue;
    }
    if (i + 1 >= argc) {
      snprintf(why, sizeof why, "%s needs a value (%s %s)", o->name, o->name, o->value);
      return refuse(c, why);
    }
    int rc = take_value(c, o, argv[++i]);
    if (rc) return rc;
  }
  if (c->operand && !*operand) {
    snprintf(why, sizeof why, "which %s? (none given)", c->operand);
    return refuse(c, why);
  }
  return 0;
}

double tool_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define PROGRESS_WIDTH 76 /* a line is padded to this, so that a shorter one wipes a longer */

void tool_progress_start(tool_progress_t *p) {
  *p = (tool_progress_t){.on = isatty(STDERR_FILENO) == 1, .start = tool_seconds()};
}

void tool_progress_show(tool_progress_t *p, const char *format, ...) {
  if (!p->on) return;
  double now = tool_seconds();
  /* Nothing for a job over in half a second: a line flashed on the
   * terminal would only be noise. */
  if (now - p->start < 0.5 || (p->shown && now - p->last < 0.2)) return;
  char line[PROGRESS_WIDTH + 1];
  va_list args;
  va_start(args, format);
  int n = vsnprintf(line, sizeof line, format, args);
  va_end(args);
  if (n >= 0 && (size_t)n < sizeof line) snprintf(line + n, sizeof line - (size_t)n, ", %.1f s)", now - p->start);
  fprintf(stderr, "\r%-*s", PROGRESS_WIDTH, line);
  p->shown = true;
  p->last = now;
}

void tool_progress_done(tool_progress_t *p) {
  if (p->shown) fprintf(stderr, "\r%*s\r", PROGRESS_WIDTH, "");
  p->shown = false;
}

static void tool_trace_progress(void *ctx, const char *stage, uint64_t done, uint64_t total) {
  tool_progress_t *p = ctx;
  double mb = 1e6;
  if (total && done) tool_progress_show(p, "%s the trace: %3.0f%% (%.0f of %.0f MB", stage,
                                        100.0 * (double)done / (double)total, (double)done / mb, (double)total / mb);
  else if (total) tool_progress_show(p, "%s the trace (%.0f MB", stage, (double)total / mb);
  else tool_progress_show(p, "%s the trace (%.0f MB so far", stage, (double)done / mb);
}

bool tool_load_trace(const char *command, const char *path, trace_t *t, tool_progress_t *p, bool stacks,
                     bool any_size) {
  trace_load_options_t options = {.progress = p->on ? tool_trace_progress : NULL, .ctx = p, .stacks = stacks,
                                  .stacks_limit = any_size ? 0 : TOOL_STACKS_LIMIT};
  if (trace_load_with(path, &options, t) == GCA_OK) return true;
  tool_progress_done(p);
  fprintf(stderr, "gcalloc %s: %s\n", command, gca_last_error());
  return false;
}

int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

const char *tool_samples_dir(void) {
  /* Beside the tool first: in the Python package a pip install makes, the
   * tool is gcalloc/bin/gcalloc and the samples gcalloc/data/snapshots. */
  static char beside[4096];
  ssize_t n = readlink("/proc/self/exe", beside, sizeof beside - 1);
  char *slash = n > 0 ? memrchr(beside, '/', (size_t)n) : NULL;
  if (slash && (size_t)(slash - beside) + sizeof "/../data/snapshots" <= sizeof beside)
    memcpy(slash, "/../data/snapshots", sizeof "/../data/snapshots");
  else
    beside[0] = '\0';
  const char *const places[] = {beside, GCALLOC_SAMPLES_DIR, GCALLOC_INSTALLED_SAMPLES_DIR};
  for (size_t i = 0; i < sizeof places / sizeof places[0]; i++) {
    struct stat st;
    if (places[i][0] && stat(places[i], &st) == 0 && S_ISDIR(st.st_mode)) return places[i];
  }
  return NULL;
}
