/* The subcommands of the gcalloc tool, each in its own file. */
#ifndef GCALLOC_TOOL_H
#define GCALLOC_TOOL_H

int demo_main(int argc, char **argv);
int bench_main(int argc, char **argv);
int bench_streams_main(int argc, char **argv);
int replay_main(int argc, char **argv);
int tune_main(int argc, char **argv);
int bench_replay_main(int argc, char **argv);
int bench_cuda_main(int argc, char **argv);

#include <stdio.h>
struct replay_result;
struct replay_options;
/* The options replay and tune share (--capacity SIZE, --device N): 1 when
 * argv[*i] was one (and *i is moved past its value), 0 when it was not, -1
 * when its value is bad (the message is printed). */
int replay_common_option(const char *command, int argc, char **argv, int *i, struct replay_options *o);
/* The replay's HTML report (report.c); 0, or 1 with a message on stderr. */
int report_write(const char *out_path, const char *trace_path, const struct replay_result *r);
/* The pages of a device's expandable segments as `gcalloc replay --json`
 * writes them (replay.c), or null without them; the report embeds the same. */
struct replay_device;
void pages_json_put(FILE *f, const struct replay_device *d);
/* "device N", and where the trace's allocators shared a device number
 * (trace_t.origins) which allocator's device it replays:
 * "device 1 (allocator 2's device 0)". */
void replay_device_name(const struct replay_device *d, char *out, size_t size);
/* The same as JSON fields: , "allocator": ID or null, "recorded_device": N */
void device_origin_json_put(FILE *f, const struct replay_device *d);
/* Shared helpers (common.c): a JSON string, escaped so that it is also safe
 * inside an HTML script; seconds on the monotonic clock; a qsort comparison
 * of doubles; bytes in GiB. */
void json_put_string(FILE *f, const char *s);
double tool_seconds(void);
int compare_doubles(const void *a, const void *b);
static inline double gib(double bytes) { return bytes / (double)(1 << 30); }

#endif
