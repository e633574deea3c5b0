/* `gcalloc replay TRACE`: replay a recorded trace on the simulated device
 * and compare with what PyTorch's allocator reserved (docs/replay.md).
 *
 *   gcalloc replay TRACE [--conf STRING] [--capacity SIZE] [--device N] [--json] [--report FILE.html]
 *                        [--no-empty-cache]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__) && defined(__GLIBC__)
#include <sys/mman.h>
#include <stdatomic.h>
#include <sys/stat.h>
#endif

#include "backends/sim_driver.h"
#include "base/base.h"
#include "backends/sim_driver.h"
#include "replay/replay.h"
#include "tool.h"


const tool_command_t replay_command = {
    "replay", "TRACE",
    "TRACE [--conf STRING] [--capacity SIZE] [--device N] [--json] [--report FILE.html [--stacks]]\n"
    "      [--no-empty-cache]",
    "replay a PyTorch snapshot, RMM log, allocatorSim log or gcalloc trace on the simulated device",
    "\n"
    "Replays a recorded allocation trace on the simulated device, and compares what gcalloc reserves with\n"
    "what PyTorch's allocator reserved on the same sequence (docs/replay.md).\n"
    "\n"
    "TRACE is a PyTorch snapshot pickle (torch.cuda.memory._dump_snapshot), an RMM logging_resource_adaptor\n"
    "CSV log, a gcalloc trace (GCALLOC_TRACE_FILE) or an allocatorSim log, told apart by its first bytes;\n"
    "plain or compressed with gzip, zstd, xz or bzip2; a file or a pipe (- for standard input). While a\n"
    "long one is read and replayed, its progress is shown on stderr when that is a terminal.\n"
    "\n"
    "  --conf STRING       allocator settings in PYTORCH_CUDA_ALLOC_CONF's syntax (default: those the\n"
    "                      snapshot recorded, else gcalloc's defaults)\n"
    "  --capacity SIZE     the device's memory, like 80GiB: whether the job fits, and if not the first\n"
    "                      allocation that fails, with gcalloc's out-of-memory message (default: 8 TiB)\n"
    "  --device N          replay only device N of the trace\n"
    "  --json              the result as JSON\n"
    "  --report FILE.html  also write a self-contained HTML report: memory over time against PyTorch's,\n"
    "                      the segments at the peak with where each block was allocated (the\n"
    "                      snapshot's call stacks, read from a snapshot of up to 64 MiB), the settings\n"
    "  --stacks            with --report, read the call stacks from a snapshot of any size (about 3x the\n"
    "                      reading time, and 4 bytes of memory more per byte of snapshot)\n"
    "  --no-empty-cache    do not replay the runs of segment frees the replay did not cause as\n"
    "                      empty_cache() calls of the original job\n"
    "  -h, --help          this help\n"
    "\n"
    "Exit status: 0 replayed; 1 the trace could not be read or replayed, or the report written; 2 bad\n"
    "arguments; 3 the job did not fit --capacity.\n",
    replay_main};

static void print_text(const char *path, const trace_t *t, const replay_result_t *r, double load_s, double total_s,
                       uint64_t capacity) {
  printf("trace %s: %zu events, %d device%s, loaded in %.1f ms; end to end %.1f ms, %.2f M events/s\n", path,
         t->count, t->device_count, t->device_count == 1 ? "" : "s", load_s * 1e3, total_s * 1e3,
         total_s > 0 ? (double)t->count / total_s / 1e6 : 0);
  printf("configuration: %s\n", r->conf[0] ? r->conf : "(defaults)");
  for (int i = 0; i < r->device_count; i++) {
    const replay_device_t *d = &r->devices[i];
    char name[64];
    replay_device_name(d, name, sizeof name);
    if (replay_device_empty(d)) { /* (a device the record lists with nothing on it) */
      printf("\n%s: nothing recorded on it\n", name);
      continue;
    }
    printf("\n%s: %zu operations replayed (%zu allocations live at the start, seeded first) in %.2f ms, "
           "%.1f M operations/s\n",
           name, d->events, d->seeded, d->seconds * 1e3, d->seconds > 0 ? (double)d->events / d->seconds / 1e6 : 0);
    if (d->start_segments)
      printf("  the start made as PyTorch had it: %zu segments at their recorded sizes, the live blocks at their "
             "offsets, the rest cached free\n", d->start_segments);
    printf("  peak requested   %10.3f GiB\n", gib(d->peak_requested));
    printf("  peak allocated   %10.3f GiB\n", gib(d->peak_allocated));
    printf("  peak reserved    %10.3f GiB  (%.3f x peak requested)\n", gib(d->peak_reserved),
           d->peak_requested ? (double)d->peak_reserved / (double)d->peak_requested : 0);
    if (d->bound_reserved && !d->oom)
      printf("  lower bound      %10.3f GiB  (peak reserved %.2f%% above it: the least any allocator could reserve,"
             " in 2 MiB pages with PyTorch's two pools)\n", gib(d->bound_reserved),
             100.0 * ((double)d->peak_reserved / (double)d->bound_reserved - 1.0));
    else if (d->bound_reserved)
      printf("  lower bound      %10.3f GiB  (the whole sequence's, in 2 MiB pages with PyTorch's two pools)\n",
             gib(d->bound_reserved));
    /* A record whose segments and segment events add up to nothing
     * reserved (its segment events left out) has no ratio to show. */
    if (d->recorded_peak_reserved > 0)
      printf("  PyTorch reserved %10.3f GiB  (recorded; gcalloc / PyTorch = %.3f)\n",
             gib((uint64_t)d->recorded_peak_reserved), (double)d->peak_reserved / (double)d->recorded_peak_reserved);
    else if (d->recorded_peak_reserved == 0)
      printf("  PyTorch reserved      0 GiB  (recorded: no segment at the end, none allocated in the record)\n");
    else
      printf("  recorded reserved   unknown  (the trace records no segments)\n");
    printf("  device allocations %" PRIu64 ", frees %" PRIu64 "; empty_cache calls inferred from the record: %zu\n",
           d->device_allocs, d->device_frees, d->empty_cache_calls);
    if (d->recorded_peak_reserved >= 0)
      printf("  PyTorch's segment events reproduced in order: %zu of %zu (gcalloc made %zu)\n",
             d->segment_events_matched, d->segment_events_recorded, d->segment_events_replayed);
    if (d->expandable) {
      const page_census_t *c = &d->peak_pages;
      printf("  pages of expandable segments: %" PRIu64 " mapped, %" PRIu64 " unmapped over the replay"
             " (%" PRIu64 " of each moved by stitching, after %" PRIu64 " waits for the stream)\n", d->pages_mapped,
             d->pages_unmapped, d->pages_moved, d->stitch_waits);
      printf("  at peak reserved: %" PRIu64 " pages mapped (%.3f GiB, %" PRIu64 " of them free), %" PRIu64
             " unmapped below the top of %zu range%s (%.3f GiB)\n",
             c->mapped_pages, gib(c->mapped_bytes), c->free_pages, c->unmapped_pages, c->ranges,
             c->ranges == 1 ? "" : "s", gib(c->unmapped_bytes));
    }
    if (d->oom && d->oom_event < d->seeded)
      printf("  DOES NOT FIT: the allocations live at the start do not: seeding %zu of %zu (%" PRIu64
             " bytes) fails: %s\n", d->oom_event + 1, d->seeded, d->oom_size, d->oom_message);
    else if (d->oom)
      printf("  DOES NOT FIT: after %zu operations, the next (%" PRIu64 " bytes) fails: %s\n", d->events, d->oom_size,
             d->oom_message);
    else if (capacity)
      printf("  fits in %.3f GiB: %.3f GiB to spare at the peak reserved\n", gib(capacity),
             gib(capacity > d->peak_reserved ? capacity - d->peak_reserved : 0));
  }
}

bool replay_device_empty(const replay_device_t *d) {
  return d->events == 0 && d->seeded == 0 && d->recorded_peak_reserved <= 0 && !d->oom && d->peak_reserved == 0;
}

void replay_device_name(const replay_device_t *d, char *out, size_t size) {
  if (d->allocator >= 0)
    snprintf(out, size, "device %d (allocator %d's device %d)", d->device, d->allocator, d->recorded_device);
  else
    snprintf(out, size, "device %d", d->device);
}

void device_origin_json_put(FILE *f, const replay_device_t *d) {
  if (d->allocator >= 0) fprintf(f, ", \"allocator\": %d", d->allocator);
  else fprintf(f, ", \"allocator\": null");
  fprintf(f, ", \"recorded_device\": %d", d->recorded_device);
}

void pages_json_put(FILE *f, const replay_device_t *d) {
  if (!d->expandable) {
    fprintf(f, "null");
    return;
  }
  const page_census_t *c = &d->peak_pages;
  fprintf(f, "{\"mapped\": %" PRIu64 ", \"unmapped\": %" PRIu64 ", \"moved\": %" PRIu64 ", \"stitch_waits\": %" PRIu64
         ", \"at_peak\": {\"ranges\": %zu, \"reserved_address_bytes\": %" PRIu64 ", \"mapped_pages\": %" PRIu64
         ", \"mapped_bytes\": %" PRIu64 ", \"free_pages\": %" PRIu64 ", \"free_bytes\": %" PRIu64
         ", \"unmapped_pages\": %" PRIu64 ", \"unmapped_bytes\": %" PRIu64 "}}",
         d->pages_mapped, d->pages_unmapped, d->pages_moved, d->stitch_waits, c->ranges, c->reserved_bytes, c->mapped_pages,
         c->mapped_bytes, c->free_pages, c->free_bytes, c->unmapped_pages, c->unmapped_bytes);
}

static void print_json(const char *path, const trace_t *t, const replay_result_t *r, double load_s, double total_s) {
  printf("{\"trace\": ");
  gca__json_string(stdout, path);
  printf(", \"trace_events\": %zu, \"load_seconds\": %.6f, \"seconds\": %.6f, \"end_to_end_events_per_second\": %.0f"
         ", \"conf\": ", t->count, load_s, total_s, total_s > 0 ? (double)t->count / total_s : 0.0);
  gca__json_string(stdout, r->conf);
  printf(", \"devices\": [");
  for (int i = 0; i < r->device_count; i++) {
    const replay_device_t *d = &r->devices[i];
    printf("%s\n  {\"device\": %d, \"events\": %zu, \"seeded\": %zu, \"start_segments\": %zu, "
           "\"peak_requested_bytes\": %" PRIu64 ", \"peak_allocated_bytes\": %" PRIu64
           ", \"peak_reserved_bytes\": %" PRIu64 ", \"bound_reserved_bytes\": %" PRIu64 ", \"empty\": %s"
           ", \"recorded_peak_reserved_bytes\": ",
           i ? "," : "", d->device, d->events, d->seeded, d->start_segments, d->peak_requested, d->peak_allocated,
           d->peak_reserved, d->bound_reserved, replay_device_empty(d) ? "true" : "false");
    if (d->recorded_peak_reserved >= 0) printf("%" PRId64, d->recorded_peak_reserved);
    else printf("null");
    device_origin_json_put(stdout, d);
    printf(", \"pages\": ");
    pages_json_put(stdout, d);
    printf(", \"device_allocs\": %" PRIu64 ", \"device_frees\": %" PRIu64 ", \"empty_cache_calls\": %zu"
           ", \"segment_events_matched\": %zu, \"segment_events_recorded\": %zu, \"segment_events_replayed\": %zu"
           ", \"events_per_second\": %.0f, \"oom\": ",
           d->device_allocs, d->device_frees, d->empty_cache_calls, d->segment_events_matched,
           d->segment_events_recorded, d->segment_events_replayed, d->seconds > 0 ? (double)d->events / d->seconds : 0.0);
    if (d->oom) {
      printf("{\"operation\": %zu, \"size\": %" PRIu64 ", \"message\": ", d->oom_event, d->oom_size);
      gca__json_string(stdout, d->oom_message);
      printf("}");
    } else {
      printf("null");
    }
    printf("}");
  }
  printf("\n]}\n");
}

/* Progress on stderr, when it is a terminal, at most five times a second. */
static void show_progress(void *ctx, int device, size_t done, size_t total) {
  tool_progress_show(ctx, "replaying device %d: %3.0f%% (%zu of %zu operations", device,
                     100.0 * (double)done / (double)(total ? total : 1), done, total);
}

/* The heap a replay grows into, faulted in ahead of it by a helper thread.
 * In a new process the trace's entries and the simulated device's tables,
 * blocks and records come from heap pages never touched before: reading
 * and replaying a snapshot faults in 100-180 of them, 2-3 us each on a
 * virtual machine, on the reading and replaying thread's path (a tenth of
 * a new process's replay), while the other processor has finished the second
 * reader's part and waits. So before the trace is read the heap is grown,
 * by a block freed at once (gcalloc.c keeps malloc from trimming it or
 * mapping such a block apart), and a helper asks the kernel to map those
 * pages (MADV_POPULATE_WRITE, which writes nothing: what is allocated there
 * meanwhile is left as it is), 64 KiB at a time, so that the reader's own
 * calls on the memory map never wait long behind it. It is a chore
 * (helpers.c): the second reader's job, queued just after, goes first, and
 * the thread it starts is there for that job. Only for a file of 1 MiB or
 * more (a small trace's replay is over sooner than a helper would start),
 * and only a hint: without the kernel's support, or with a heap laid out
 * otherwise, it does nothing. */
#if defined(__linux__) && defined(__GLIBC__) && defined(MADV_POPULATE_WRITE)
#define HEAP_WARM_BYTES ((size_t)1 << 20)
#define HEAP_WARM_STEP ((size_t)64 << 10)
#define HEAP_WARM_MIN_FILE ((off_t)1 << 20)
static struct {
  char *start;
  size_t bytes;
  atomic_bool called_off; /* the replay will keep both processors busy */
} heap_warm_range;

static void heap_warm_run(void *arg) {
  (void)arg;
  char *start = heap_warm_range.start;
  size_t bytes = heap_warm_range.bytes;
  for (size_t at = 0; at < bytes && !atomic_load_explicit(&heap_warm_range.called_off, memory_order_relaxed);
       at += HEAP_WARM_STEP)
    if (madvise(start + at, bytes - at < HEAP_WARM_STEP ? bytes - at : HEAP_WARM_STEP, MADV_POPULATE_WRITE) != 0)
      break;
}

static void heap_warm(const char *path) {
  struct stat st;
  if (heap_warm_range.start || stat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < HEAP_WARM_MIN_FILE)
    return;
  char *volatile block = malloc(HEAP_WARM_BYTES); /* (volatile: kept, not folded away with its free) */
  if (!block) return;
  uintptr_t page = 4096, start = ((uintptr_t)block + page - 1) & ~(page - 1),
            end = ((uintptr_t)block + HEAP_WARM_BYTES) & ~(page - 1);
  free(block);
  heap_warm_range.start = (char *)start;
  heap_warm_range.bytes = end - start;
  (void)gca__helper_detach(heap_warm_run, NULL);
}

/* Devices replayed at once fill the processors, each in a heap of its own
 * (one per thread): the chore, if it has not run yet, would only delay one
 * of them. */
static void heap_warm_call_off(const trace_t *t, int device) {
  if (t->device_count > 1 && device < 0) atomic_store_explicit(&heap_warm_range.called_off, true, memory_order_relaxed);
}
#else
static void heap_warm(const char *path) { (void)path; }
static void heap_warm_call_off(const trace_t *t, int device) { (void)t, (void)device; }
#endif

int replay_main(int argc, char **argv) {
  const char *path = NULL, *report = NULL;
  replay_options_t o = {.device = -1, .infer_empty_cache = true, .match_segments = true};
  bool json = false, no_empty_cache = false, stacks = false;
  long device = -1;
  const tool_option_t options[] = {
      {"--conf", OPTION_TEXT, &o.conf, 0, 0, "STRING"},
      {"--capacity", OPTION_SIZE, &o.capacity, 0, (long)SIM_MAX_CAPACITY, "SIZE"},
      {"--device", OPTION_NUMBER, &device, 0, 255, "N"},
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {"--report", OPTION_TEXT, &report, 0, 0, "FILE.html"},
      {"--no-empty-cache", OPTION_FLAG, &no_empty_cache, 0, 0, NULL},
      {"--stacks", OPTION_FLAG, &stacks, 0, 0, NULL},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&replay_command, options, argc, argv, &path);
  if (parsed) return parsed < 0 ? 0 : parsed;
  if (stacks && !report) {
    fprintf(stderr, "gcalloc replay: --stacks reads the call stacks for --report: give it with --report\n");
    return 2;
  }
  o.device = (int)device;
  o.infer_empty_cache = !no_empty_cache;
  o.timeline = report != NULL;
  o.page_census = true;
  double t0 = tool_seconds();
  tool_progress_t progress;
  tool_progress_start(&progress);
  if (progress.on) {
    o.progress = show_progress;
    o.progress_ctx = &progress;
  }
  heap_warm(path);
  trace_t t;
  if (!tool_load_trace("replay", path, &t, &progress, report != NULL, stacks)) return 1;
  double load_s = tool_seconds() - t0;
  heap_warm_call_off(&t, o.device);
  replay_result_t r;
  if (replay_trace(&t, &o, &r) != GCA_OK) {
    tool_progress_done(&progress);
    fprintf(stderr, "gcalloc replay: %s: %s\n", path, gca_last_error());
    trace_free(&t);
    return 1;
  }
  double total_s = tool_seconds() - t0;
  tool_progress_done(&progress);
  if (json) print_json(path, &t, &r, load_s, total_s);
  else print_text(path, &t, &r, load_s, total_s, o.capacity);
  int rc = 0;
  if (report) {
    report_input_t in = {.command = "replay", .trace_path = path, .r = &r, .capacity = o.capacity, .trace = &t};
    rc = report_write(report, &in);
    if (!rc && !json) printf("\nreport written to %s\n", report);
  }
  bool oom = false;
  for (int i = 0; i < r.device_count; i++) oom |= r.devices[i].oom;
  replay_result_free(&r);
  trace_free(&t);
  return rc ? rc : oom ? 3 : 0;
}
