/* `gcalloc replay TRACE`: replay a recorded trace on the simulated device
 * and compare with what PyTorch's allocator reserved (docs/replay.md).
 *
 *   gcalloc replay TRACE [--conf STRING] [--capacity SIZE] [--device N] [--json] [--no-empty-cache]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/internal.h"
#include "../src/export/replay.h"
#include "tool.h"

static double gib(uint64_t b) { return (double)b / (double)((uint64_t)1 << 30); }

static void usage(void) {
  fprintf(stderr, "usage: gcalloc replay TRACE [--conf STRING] [--capacity SIZE] [--device N] [--json] "
                  "[--no-empty-cache]\n");
}

static void print_text(const char *path, const trace_t *t, const replay_result_t *r, double load_s) {
  printf("trace %s: %zu events, %d device%s, loaded in %.1f ms\n", path, t->count, t->device_count,
         t->device_count == 1 ? "" : "s", load_s * 1e3);
  printf("configuration: %s\n", r->conf[0] ? r->conf : "(defaults)");
  for (int i = 0; i < r->device_count; i++) {
    const replay_device_t *d = &r->devices[i];
    printf("\ndevice %d: %zu operations replayed (%zu allocations live at the start, seeded first) in %.2f ms, "
           "%.1f M operations/s\n",
           d->device, d->events, d->seeded, d->seconds * 1e3, d->seconds > 0 ? (double)d->events / d->seconds / 1e6 : 0);
    printf("  peak requested   %10.3f GiB\n", gib(d->peak_requested));
    printf("  peak allocated   %10.3f GiB\n", gib(d->peak_allocated));
    printf("  peak reserved    %10.3f GiB  (%.3f x peak requested)\n", gib(d->peak_reserved),
           d->peak_requested ? (double)d->peak_reserved / (double)d->peak_requested : 0);
    if (d->recorded_peak_reserved >= 0)
      printf("  PyTorch reserved %10.3f GiB  (recorded; gcalloc / PyTorch = %.3f)\n",
             gib((uint64_t)d->recorded_peak_reserved),
             d->recorded_peak_reserved ? (double)d->peak_reserved / (double)d->recorded_peak_reserved : 0);
    else
      printf("  PyTorch reserved    unknown  (the trace records no segments)\n");
    printf("  device allocations %" PRIu64 ", frees %" PRIu64 "; empty_cache calls inferred from the record: %zu\n",
           d->device_allocs, d->device_frees, d->empty_cache_calls);
    printf("  PyTorch's segment events reproduced in order: %zu of %zu\n", d->segment_events_matched,
           d->segment_events_recorded);
    if (d->oom)
      printf("  DOES NOT FIT: operation %zu (%" PRIu64 " bytes) fails: %s\n", d->oom_event, d->oom_size,
             d->oom_message);
  }
}

static void json_string(const char *s) {
  putchar('"');
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') printf("\\%c", *s);
    else if ((unsigned char)*s < 0x20) printf("\\u%04x", *s);
    else putchar(*s);
  }
  putchar('"');
}

static void print_json(const char *path, const trace_t *t, const replay_result_t *r, double load_s) {
  printf("{\"trace\": ");
  json_string(path);
  printf(", \"trace_events\": %zu, \"load_seconds\": %.6f, \"conf\": ", t->count, load_s);
  json_string(r->conf);
  printf(", \"devices\": [");
  for (int i = 0; i < r->device_count; i++) {
    const replay_device_t *d = &r->devices[i];
    printf("%s\n  {\"device\": %d, \"events\": %zu, \"seeded\": %zu, \"peak_requested_bytes\": %" PRIu64
           ", \"peak_allocated_bytes\": %" PRIu64 ", \"peak_reserved_bytes\": %" PRIu64
           ", \"recorded_peak_reserved_bytes\": ",
           i ? "," : "", d->device, d->events, d->seeded, d->peak_requested, d->peak_allocated, d->peak_reserved);
    if (d->recorded_peak_reserved >= 0) printf("%" PRId64, d->recorded_peak_reserved);
    else printf("null");
    printf(", \"device_allocs\": %" PRIu64 ", \"device_frees\": %" PRIu64 ", \"empty_cache_calls\": %zu"
           ", \"segment_events_matched\": %zu, \"segment_events_recorded\": %zu, \"events_per_second\": %.0f"
           ", \"oom\": ",
           d->device_allocs, d->device_frees, d->empty_cache_calls, d->segment_events_matched,
           d->segment_events_recorded, d->seconds > 0 ? (double)d->events / d->seconds : 0.0);
    if (d->oom) {
      printf("{\"operation\": %zu, \"size\": %" PRIu64 ", \"message\": ", d->oom_event, d->oom_size);
      json_string(d->oom_message);
      printf("}");
    } else {
      printf("null");
    }
    printf("}");
  }
  printf("\n]}\n");
}

int replay_main(int argc, char **argv) {
  const char *path = NULL;
  replay_options_t o = {.device = -1, .infer_empty_cache = true, .match_segments = true};
  bool json = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--conf") && i + 1 < argc) o.conf = argv[++i];
    else if (!strcmp(argv[i], "--capacity") && i + 1 < argc) {
      uint64_t c;
      if (!parse_size(argv[i + 1], strlen(argv[i + 1]), &c) || c == 0) {
        fprintf(stderr, "gcalloc replay: --capacity '%s' is not a size like 24GiB\n", argv[i + 1]);
        return 2;
      }
      o.capacity = c;
      i++;
    } else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
      char *end;
      long d = strtol(argv[++i], &end, 10);
      if (*end || d < 0 || d > 255) {
        fprintf(stderr, "gcalloc replay: --device '%s' is not a device number\n", argv[i]);
        return 2;
      }
      o.device = (int)d;
    } else if (!strcmp(argv[i], "--json")) json = true;
    else if (!strcmp(argv[i], "--no-empty-cache")) o.infer_empty_cache = false;
    else if (argv[i][0] != '-' && !path) path = argv[i];
    else {
      fprintf(stderr, "gcalloc replay: unknown option '%s'\n", argv[i]);
      usage();
      return 2;
    }
  }
  if (!path) {
    usage();
    return 2;
  }
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  trace_t t;
  if (trace_load(path, &t) != GCA_OK) {
    fprintf(stderr, "gcalloc replay: %s\n", gca_last_error());
    return 1;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double load_s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  replay_result_t r;
  if (replay_trace(&t, &o, &r) != GCA_OK) {
    fprintf(stderr, "gcalloc replay: %s: %s\n", path, gca_last_error());
    trace_free(&t);
    return 1;
  }
  if (json) print_json(path, &t, &r, load_s);
  else print_text(path, &t, &r, load_s);
  bool oom = false;
  for (int i = 0; i < r.device_count; i++) oom |= r.devices[i].oom;
  replay_result_free(&r);
  trace_free(&t);
  return oom ? 3 : 0;
}
