/* The subcommands of the gcalloc tool, each in its own file. */
#ifndef GCALLOC_TOOL_H
#define GCALLOC_TOOL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
struct replay_result;
struct replay_options;
/* The replay's HTML report (report.c). A run of tune's shown beside the
 * replay: its label ("gcalloc's best"), its result (replayed with a
 * timeline) and the variable its configuration is for. */
typedef struct report_run {
  const char *label;
  const struct replay_result *r;
  const char *env; /* "PYTORCH_CUDA_ALLOC_CONF"; NULL: GCALLOC_ALLOC_CONF */
} report_run_t;
/* The run as the report embeds it (malloc'd; NULL: the host out of
 * memory), so that its replay can be freed before the next one. */
char *report_answer_json(const report_run_t *a);
typedef struct report_input {
  const char *command;            /* "replay": names the command in messages */
  const char *trace_path;
  const struct replay_result *r;  /* the run shown, replayed with a timeline */
  uint64_t capacity;              /* the device's, 0: none given */
  char *const *answers;           /* tune's (report_answer_json), drawn over r's timeline; NULL, 0: none */
  size_t answer_count;
  const char *answers_note;       /* a line under the answers (NULL: none) */
  const struct trace *trace;      /* the trace replayed: its call stacks name where blocks were allocated; NULL: none */
} report_input_t;
/* Writes the report to out_path: 0, or 1 with a message on stderr. */
int report_write(const char *out_path, const report_input_t *in);
/* The pages of a device's expandable segments as `gcalloc replay --json`
 * writes them (replay.c), or null without them; the report embeds the same. */
struct replay_device;
void pages_json_put(FILE *f, const struct replay_device *d);
/* "device N", and where the trace's allocators shared a device number
 * (trace_t.origins) which allocator's device it replays:
 * "device 1 (allocator 2's device 0)". */
void replay_device_name(const struct replay_device *d, char *out, size_t size);
/* A device the record lists with nothing on it (no operation, nothing
 * live at the start, no segment): shown as one line. */
bool replay_device_empty(const struct replay_device *d);
/* The same as JSON fields: , "allocator": ID or null, "recorded_device": N */
void device_origin_json_put(FILE *f, const struct replay_device *d);
/* The command line, parsed alike by every command (common.c). */
typedef enum option_kind {
  OPTION_FLAG,    /* bool *: set when given */
  OPTION_TEXT,    /* const char **: the value as given */
  OPTION_NUMBER,  /* long *: a whole number within [min, max] */
  OPTION_SECONDS, /* double *: a number of seconds within [min, max] */
  OPTION_SIZE,    /* uint64_t *: a size like 24GiB, above 0 */
} option_kind;

typedef struct tool_option {
  const char *name;  /* "--runs" */
  option_kind kind;
  void *out;
  long min, max;     /* OPTION_NUMBER's and OPTION_SECONDS' bounds; OPTION_SIZE's largest (0: none) */
  const char *value; /* the value's name in messages: "N", "DIR" */
} tool_option_t;

typedef struct tool_command {
  const char *name;    /* "replay" */
  const char *operand; /* "TRACE" where the command takes one, else NULL */
  const char *usage;   /* what follows "gcalloc NAME" on the usage line */
  const char *summary; /* one line for `gcalloc --help`'s list of commands */
  const char *help;    /* what --help prints after the usage line */
  int (*run)(int argc, char **argv); /* argv[0] is the command's name */
} tool_command_t;

/* The commands, in `gcalloc --help`'s order: the one list that the tool's
 * dispatch, its help and its shell completion (`gcalloc completion`) come
 * from. Each NAME is NAME_command, with NAME_main its run, beside its code
 * (tools/ and bench/); `version`, `help` and `completion` are main.c's. */
#define TOOL_COMMANDS(X)                                                                                      \
  X(demo) X(replay) X(tune) X(top) X(bench) X(bench_replay) X(bench_streams) X(bench_cuda) X(bench_acl)        \
  X(bench_sharing) X(bench_pools)
#define TOOL_DECLARE(name)                    \
  extern const tool_command_t name##_command; \
  int name##_main(int argc, char **argv);
TOOL_COMMANDS(TOOL_DECLARE)

/* Parses argv[1..argc) by `options` (ended by a NULL name): 0 when all of
 * it was taken (*operand set where the command takes one; "-" is given as
 * "/dev/stdin", standard input, which the readers take as any pipe); -1
 * when -h or --help was given (the help printed on stdout: exit 0), or
 * --list-options (the options' names, a line each: what the shell
 * completion offers); 2 with
 * a message on stderr naming what is wrong (an unknown option, a value
 * missing or out of range, an operand missing or one too many). */
int tool_parse(const tool_command_t *c, const tool_option_t *options, int argc, char **argv, const char **operand);
/* A command's usage line and help, on stdout (its --help, and `gcalloc
 * help COMMAND`). */
void tool_help(const tool_command_t *c);

/* Shared helpers (common.c): seconds on the monotonic clock; a qsort
 * comparison of doubles; bytes in GiB. (JSON strings: gca__json_string,
 * base.h.) */
double tool_seconds(void);
/* A progress line on stderr, shown only when stderr is a terminal and
 * half a second has passed since tool_progress_start (a long replay's or
 * tuning's: reading the trace, then each device or setting), rewritten in
 * place at most five times a second with the seconds since the start, and
 * wiped by tool_progress_done. A format given to tool_progress_show leaves
 * its parenthesis open: ", 2.1 s)" is added. */
typedef struct tool_progress {
  bool on, shown;
  double start, last;
} tool_progress_t;
void tool_progress_start(tool_progress_t *p);
void tool_progress_show(tool_progress_t *p, const char *format, ...) __attribute__((format(printf, 2, 3)));
void tool_progress_done(tool_progress_t *p);
/* Loads the trace at `path` into *t (trace.h), its progress told on `p`
 * ("reading the trace: 45% (52 of 116 MB, 0.6 s)"); false when it cannot,
 * with "gcalloc COMMAND: why" on stderr and the progress line wiped. */
struct trace;
/* With `stacks`, the allocations' call stacks are kept (trace_load_options)
 * for a report, from a snapshot of up to TOOL_STACKS_LIMIT bytes, or of any
 * size with `any_size` (--stacks). */
#define TOOL_STACKS_LIMIT ((uint64_t)64 << 20)
bool tool_load_trace(const char *command, const char *path, struct trace *t, tool_progress_t *p, bool stacks,
                     bool any_size);
int compare_doubles(const void *a, const void *b);
/* The folder of the sample snapshots the project ships (data/snapshots,
 * one folder each): beside the tool in the Python package
 * (gcalloc/data/snapshots), else the source tree's, else the installed
 * one; NULL when none is there. */
const char *tool_samples_dir(void);
static inline double gib(double bytes) { return bytes / (double)(1 << 30); }

#endif
