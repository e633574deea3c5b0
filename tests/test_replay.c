/* Replay (label `replay`): traces built in the test (allocatorSim lines,
 * gcalloc's own trace format, a snapshot gcalloc wrote itself with
 * allocations live before recording began), the real traces of
 * ../shared/traces against the figures SOURCES.txt gives for them, the
 * capacity check, and the tool's JSON. */
#include <json-c/json.h>
#include <math.h>
#include <sys/wait.h>

#include "helpers.h"
#include "replay/replay.h"
#include "replay/util.h"

static replay_options_t defaults(void) { return (replay_options_t){.device = -1, .infer_empty_cache = true, .match_segments = true}; }

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

/* The trace `text` is refused, with `message` in the error, and nothing is
 * left loaded. */
static void expect_refused(const char *path, const char *text, const char *message) {
  write_file(path, text);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), message);
  assert_int_equal(t.count, 0);
  assert_null(t.events);
}

/* Each of `count` files refused as expect_refused says. */
typedef struct refusal {
  const char *text, *message;
} refusal_t;

static void expect_all_refused(const char *path, const refusal_t *bad, size_t count) {
  for (size_t i = 0; i < count; i++) expect_refused(path, bad[i].text, bad[i].message);
}

/* `gcalloc ARGS --json`, run to its end (exit status 0) and its output
 * parsed; the caller puts the root. */
static json_object *tool_json(const char *args) {
  char cmd[4096];
  int n = snprintf(cmd, sizeof cmd, "%s %s --json > gcalloc-scratch-tool.json", GCALLOC_TOOL_PATH, args);
  assert_true(n > 0 && (size_t)n < sizeof cmd);
  assert_int_equal(system(cmd), 0);
  json_object *root = json_object_from_file("gcalloc-scratch-tool.json");
  assert_non_null(root);
  return root;
}

/* A trace whose last line is `head`, `count` times `fill`, then `tail`, is
 * refused with `message`. */
static void expect_long_line_refused(const char *path, const char *head, char fill, int count, const char *tail,
                                     const char *message) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(head, f);
  for (int i = 0; i < count; i++) fputc(fill, f);
  fputs(tail, f);
  fclose(f);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), message);
}

/* The trace `text`, written to `path`, replayed with the defaults into *r. */
static void replay_text(const char *path, const char *text, replay_result_t *r) {
  write_file(path, text);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_OK);
  replay_options_t o = defaults();
  assert_int_equal(replay_trace(&t, &o, r), GCA_OK);
  trace_free(&t);
}

/* allocatorSim: "<alloc_op> <free_op> <size>"; live at op 2: a and b. */
static void test_allocsim_lines(void **state) {
  (void)state;
  replay_result_t r;
  replay_text("gcalloc-scratch-replay.log", "0 2 3000000\n1 3 5000000\n2 4 1000\n", &r);
  assert_int_equal(r.device_count, 1);
  assert_int_equal(r.devices[0].events, 6);
  assert_int_equal(r.devices[0].peak_requested, 8000000); /* 3 MB + 5 MB */
  assert_int_equal(r.devices[0].recorded_peak_reserved, -1);
  assert_false(r.devices[0].oom);
  replay_result_free(&r);
}

/* allocatorSim's order: by op index, frees before allocations there, each
 * in line order, and a block allocated and freed at one index freed after
 * the allocations there. Op indices are the file's to choose: a hundred
 * billion costs no more than ten. */
/* An allocatorSim line's end, as the rule orders them: by op index, then
 * kind (0 frees, 1 allocations, 2 frees of what was allocated at the same
 * index), then line. */
typedef struct ref_end {
  uint64_t op, kind, line, size;
} ref_end_t;

static int compare_ref_ends(const void *a, const void *b) {
  const ref_end_t *x = a, *y = b;
  if (x->op != y->op) return x->op < y->op ? -1 : 1;
  if (x->kind != y->kind) return x->kind < y->kind ? -1 : 1;
  return x->line < y->line ? -1 : x->line > y->line;
}

static void test_allocsim_order(void **state) {
  (void)state;
  write_file("gcalloc-scratch-replay.log", "5 100000000000 10\n"   /* line 0 */
                                        "3 5 20\n"               /* 1: freed at 5, before 0's and 3's allocs */
                                        "5 5 30\n"               /* 2: allocated and freed at 5 */
                                        "5 7 40\n"               /* 3 */
                                        "# a comment\n\n"
                                        "1 5 50\n");             /* 4: freed at 5, after 1 (line order) */
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-replay.log", &t), GCA_OK);
  assert_int_equal(t.count, 10);
  const struct {
    trace_action action;
    uint64_t size;
    int64_t op;
  } want[] = {{TA_ALLOC, 50, 1},          {TA_ALLOC, 20, 3},          {TA_FREE_COMPLETED, 20, 5},
              {TA_FREE_COMPLETED, 50, 5}, {TA_ALLOC, 10, 5},          {TA_ALLOC, 30, 5},
              {TA_ALLOC, 40, 5},          {TA_FREE_COMPLETED, 30, 5}, {TA_FREE_COMPLETED, 40, 7},
              {TA_FREE_COMPLETED, 10, 100000000000}};
  for (size_t i = 0; i < t.count; i++) {
    assert_int_equal(t.events[i].action, want[i].action);
    assert_int_equal(t.events[i].size, want[i].size);
    assert_int_equal(t.events[i].time_us, want[i].op);
  }
  /* Each allocation and its free share an address; no two live ones do. */
  assert_int_equal(t.events[0].addr, t.events[3].addr);
  assert_int_equal(t.events[5].addr, t.events[7].addr);
  assert_int_not_equal(t.events[4].addr, t.events[5].addr);
  trace_free(&t);

  /* Many lines, many ties: the order is (op, kind, line), worked out here
   * with qsort from the rule above. */
  enum { LINES = 3000 };
  static ref_end_t ref[2 * LINES];
  FILE *f = fopen("gcalloc-scratch-replay.log", "w");
  assert_non_null(f);
  uint64_t seed = 29;
  for (uint64_t i = 0; i < LINES; i++) {
    seed = seed * 6364136223846793005u + 1442695040888963407u;
    uint64_t a = (seed >> 33) % 400, b = a + (seed >> 20) % 3 * ((seed >> 40) % 50), size = 1 + (seed >> 45) % 4096;
    fprintf(f, "%" PRIu64 " %" PRIu64 " %" PRIu64 "\n", a, b, size);
    ref[2 * i] = (ref_end_t){a, 1, i, size};
    ref[2 * i + 1] = (ref_end_t){b, a == b ? 2 : 0, i, size};
  }
  fclose(f);
  qsort(ref, 2 * LINES, sizeof *ref, compare_ref_ends);
  assert_int_equal(trace_load("gcalloc-scratch-replay.log", &t), GCA_OK);
  assert_int_equal(t.count, 2 * LINES);
  for (size_t i = 0; i < t.count; i++) {
    assert_int_equal(t.events[i].action, ref[i].kind == 1 ? TA_ALLOC : TA_FREE_COMPLETED);
    assert_int_equal(t.events[i].time_us, ref[i].op);
    assert_int_equal(t.events[i].size, ref[i].size);
    assert_int_equal(t.events[i].addr, (ref[i].line + 1) * 512);
  }
  trace_free(&t);

  write_file("gcalloc-scratch-replay.log", "0 2 3000000\n4 3 10\n");
  assert_int_equal(trace_load("gcalloc-scratch-replay.log", &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "gcalloc-scratch-replay.log:2: expected '<alloc_op> <free_op> <size>'");
  expect_long_line_refused("gcalloc-scratch-replay.log", "0 2 3000000\n0 1 ", '0', 300, "7\n",
                           "gcalloc-scratch-replay.log:2: longer than 256 characters");
}

/* gcalloc's own trace: frees take the device of their allocation. */
static void test_gcalloc_trace_format(void **state) {
  (void)state;
  write_file("gcalloc-scratch-replay.trace", "# gcalloc trace 1\n"
                                           "1 7 open 0 sim:devices=2 -\n"
                                           "2 7 malloc 0 1 100 4096 200000000000\n"
                                           "3 7 malloc 0 1 100 8192 200000001000\n"
                                           "4 7 free 0 200000000000 0\n"
                                           "5 7 malloc 0 1 100 0 0\n"
                                           "6 7 free 0 deadbeef -5\n"
                                           "7 7 empty_cache 0 1 0\n"
                                           "8 7 close 0\n");
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-replay.trace", &t), GCA_OK);
  assert_int_equal(t.device_count, 2);
  assert_int_equal(t.count, 4); /* two mallocs, one free, one empty_cache marker */
  assert_int_equal(t.events[2].device, 1);
  replay_options_t o = defaults();
  o.device = 1;
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].events, 4); /* 2 allocs, 1 free, 1 empty_cache */
  assert_int_equal(r.devices[0].empty_cache_calls, 1);
  assert_int_equal(r.devices[0].peak_requested, 4096 + 8192);
  assert_int_equal(r.devices[0].segment_events_recorded, 0);
  replay_result_free(&r);
  o.device = 5;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "no device 5");
  trace_free(&t);
}

/* Version 2 of gcalloc's trace: a free that left its block pending (it
 * was used on another stream) is the program's request, and the memory
 * comes back at its free_completed line. Worked out by hand: A and B are 12
 * MiB (a segment of their own each, above 10 MiB); B comes while A is
 * pending, so the job had both segments, 24 MiB; C reuses A's after its
 * completion. Read as a version 1 trace (the free the release), B would
 * have taken A's segment: 12 MiB. */
static void test_gcalloc_trace_pending_frees(void **state) {
  (void)state;
  const char *pending = "# gcalloc trace 2\n"
                        "1 7 open 0 sim -\n"
                        "2 7 malloc 0 0 100 12582912 200000000000\n"
                        "3 7 record_stream 0 200000000000 200 0\n"
                        "4 7 free 0 200000000000 0 1\n"
                        "5 7 free 0 200000000000 0 1\n" /* (asked twice: the first stands) */
                        "6 7 malloc 0 0 100 12582912 200001000000\n"
                        "7 7 free 0 200001000000 0\n"
                        "8 7 free_completed 0 200000000000\n"
                        "9 7 malloc 0 0 100 12582912 200000000000\n"
                        "10 7 free_completed 0 deadbeef\n" /* not live: nothing */
                        "11 7 free 0 200000000000 0\n"
                        "12 7 close 0\n";
  write_file("gcalloc-scratch-replay-pending.trace", pending);
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-replay-pending.trace", &t), GCA_OK);
  static const trace_action want[] = {TA_ALLOC, TA_FREE_REQUESTED, TA_ALLOC, TA_FREE_COMPLETED,
                                      TA_FREE_COMPLETED, TA_ALLOC, TA_FREE_COMPLETED};
  static const uint64_t at[] = {0x200000000000, 0x200000000000, 0x200001000000, 0x200001000000,
                                0x200000000000, 0x200000000000, 0x200000000000};
  assert_int_equal(t.count, 7);
  for (size_t i = 0; i < t.count; i++) {
    assert_int_equal(t.events[i].action, want[i]);
    assert_int_equal(t.events[i].addr, at[i]);
  }
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].peak_reserved, 24 * MiB);
  assert_int_equal(r.devices[0].device_allocs, 2);
  replay_result_free(&r);
  trace_free(&t);
  /* The same calls as version 1 wrote them. */
  write_file("gcalloc-scratch-replay-pending.trace", "# gcalloc trace 1\n"
                                                   "2 7 malloc 0 0 100 12582912 200000000000\n"
                                                   "3 7 record_stream 0 200000000000 200 0\n"
                                                   "4 7 free 0 200000000000 0\n"
                                                   "6 7 malloc 0 0 100 12582912 200000000000\n"
                                                   "7 7 free 0 200000000000 0\n");
  assert_int_equal(trace_load("gcalloc-scratch-replay-pending.trace", &t), GCA_OK);
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].peak_reserved, 12 * MiB);
  replay_result_free(&r);
  trace_free(&t);
  /* A completion kept by another thread may be written before the free
   * it completes (that free's line comes after the completion's): the
   * completion is the release, and the free then frees nothing more. */
  write_file("gcalloc-scratch-replay-pending.trace", "# gcalloc trace 2\n"
                                                   "2 7 malloc 0 0 100 12582912 200000000000\n"
                                                   "3 8 free_completed 0 200000000000\n"
                                                   "4 7 free 0 200000000000 0 1\n"
                                                   "5 7 malloc 0 0 100 12582912 200000000000\n");
  assert_int_equal(trace_load("gcalloc-scratch-replay-pending.trace", &t), GCA_OK);
  assert_int_equal(t.count, 3);
  assert_int_equal(t.events[1].action, TA_FREE_COMPLETED);
  assert_int_equal(t.events[2].action, TA_ALLOC);
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].peak_reserved, 12 * MiB);
  replay_result_free(&r);
  trace_free(&t);
  /* A free's flag is 0 or 1; a completion names its pointer. */
  write_file("gcalloc-scratch-replay-pending.trace", "# gcalloc trace 2\n1 7 free 0 1000 0 2\n");
  assert_int_equal(trace_load("gcalloc-scratch-replay-pending.trace", &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "line 2: the pending flag (0 or 1) is missing or out of range");
  write_file("gcalloc-scratch-replay-pending.trace", "# gcalloc trace 2\n1 7 free_completed 0\n");
  assert_int_equal(trace_load("gcalloc-scratch-replay-pending.trace", &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "line 2: the pointer (at most 16 hex digits) is missing");
  remove("gcalloc-scratch-replay-pending.trace");
}

/* gcalloc's own trace from a process with two allocators: each may hand
 * out the same address (two sim devices), so a free takes the device of
 * its own allocator's allocation; empty_cache(-1) is replayed on every
 * device its allocator had allocated on; a closed allocator's allocations
 * are forgotten. */
static void test_gcalloc_trace_allocators(void **state) {
  (void)state;
  write_file("gcalloc-scratch-replay-two.trace", "# gcalloc trace 1\n"
                                               "1 7 open 0 sim:devices=4 -\n"
                                               "2 8 open 1 sim -\n"
                                               "3 7 malloc 0 2 0 4096 1000\n"
                                               "4 8 malloc 1 0 0 8192 1000\n"
                                               "5 7 malloc 0 3 0 512 2000\n"
                                               "6 7 free 0 1000 0\n"
                                               "7 8 free 1 1000 0\n"
                                               "8 7 empty_cache 0 -1 0\n"
                                               "9 8 close 1\n"
                                               "10 8 free 1 1000 0\n");
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-replay-two.trace", &t), GCA_OK);
  assert_int_equal(t.device_count, 4);
  assert_null(t.origins); /* no device number is two allocators': the trace's own numbers */
  assert_int_equal(t.count, 7); /* the free after the close frees nothing replayed */
  assert_int_equal(t.events[3].action, TA_FREE_COMPLETED);
  assert_int_equal(t.events[3].device, 2); /* allocator 0's 0x1000 */
  assert_int_equal(t.events[4].device, 0); /* allocator 1's */
  /* empty_cache(-1) on allocator 0's devices 2 and 3, not 0 or 1. */
  assert_int_equal(t.events[5].action, TA_SEGMENT_FREE);
  assert_int_equal(t.events[5].device, 2);
  assert_int_equal(t.events[6].action, TA_SEGMENT_FREE);
  assert_int_equal(t.events[6].device, 3);
  trace_free(&t);

  /* Two allocators on device 0, one after the other: each replays as an
   * allocator of its own. As one, the second's 20 MiB would have been
   * served from the first's cached segment, which it never had. */
  write_file("gcalloc-scratch-replay-shared.trace", "# gcalloc trace 1\n"
                                                  "1 7 open 1 sim -\n"
                                                  "2 7 open 2 sim -\n"
                                                  "3 7 malloc 1 0 0 20971520 7f0000000000\n"
                                                  "4 7 malloc 2 0 0 4096 7f0000000000\n"
                                                  "5 7 free 1 7f0000000000 0\n"
                                                  "6 7 malloc 2 0 0 20971520 7f0000200000\n"
                                                  "7 7 malloc 1 1 0 512 7f0000000000\n"
                                                  "8 7 empty_cache 2 -1 0\n"
                                                  "9 7 empty_cache 1 3 0\n"
                                                  "10 7 free 2 7f0000000000 0\n");
  assert_int_equal(trace_load("gcalloc-scratch-replay-shared.trace", &t), GCA_OK);
  assert_int_equal(t.device_count, 3);
  assert_non_null(t.origins);
  const trace_origin_t expected[] = {{1, 0}, {2, 0}, {1, 1}}; /* in the order they first allocated */
  for (int d = 0; d < 3; d++) {
    assert_int_equal(t.origins[d].allocator, expected[d].allocator);
    assert_int_equal(t.origins[d].device, expected[d].device);
  }
  /* The free of allocator 2's 0x7f0000000000 is its own block's, on device 1. */
  static const int devices[] = {0, 1, 0, 1, 2, 1, 1};
  static const trace_action actions[] = {TA_ALLOC,           TA_ALLOC, TA_FREE_COMPLETED, TA_ALLOC,
                                         TA_ALLOC,           TA_SEGMENT_FREE, TA_FREE_COMPLETED};
  assert_int_equal(t.count, 7); /* empty_cache of device 3, where allocator 1 had nothing: no event */
  for (size_t i = 0; i < t.count; i++) {
    assert_int_equal(t.events[i].device, devices[i]);
    assert_int_equal(t.events[i].action, actions[i]);
  }
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.device_count, 3);
  assert_int_equal(r.devices[0].peak_reserved, 20 << 20);
  assert_int_equal(r.devices[1].peak_reserved, (20 << 20) + (2 << 20)); /* its own large and small segments */
  assert_int_equal(r.devices[1].allocator, 2);
  assert_int_equal(r.devices[1].recorded_device, 0);
  assert_int_equal(r.devices[2].recorded_device, 1);
  replay_result_free(&r);
  trace_free(&t);
  /* The tool names each, text and JSON (allocator 2 replays its empty_cache too: 4 operations). */
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s replay gcalloc-scratch-replay-shared.trace > gcalloc-scratch-replay-shared.txt",
           GCALLOC_TOOL_PATH);
  assert_int_equal(system(cmd), 0);
  FILE *f = fopen("gcalloc-scratch-replay-shared.txt", "r");
  assert_non_null(f);
  size_t len;
  unsigned char *text = gca__read_stream(f, "the tool's output", &len);
  fclose(f);
  assert_non_null(text);
  assert_contains((const char *)text, "\ndevice 1 (allocator 2's device 0): 4 operations replayed");
  free(text);
  json_object *root = tool_json("replay gcalloc-scratch-replay-shared.trace"), *list, *v;
  assert_true(json_object_object_get_ex(root, "devices", &list));
  json_object *d2 = json_object_array_get_idx(list, 2);
  assert_true(json_object_object_get_ex(d2, "allocator", &v));
  assert_int_equal(json_object_get_int(v), 1);
  assert_true(json_object_object_get_ex(d2, "recorded_device", &v));
  assert_int_equal(json_object_get_int(v), 1);
  json_object_put(root);

  /* Bad lines are named, nothing is half-loaded. */
  static const refusal_t bad[] = {
      {"# gcalloc trace 1\n1 7 malloc 0 256 0 4096 1000\n", "line 2: the device (0-255) is missing or out of range"},
      {"# gcalloc trace 1\n1 7 malloc 0 -1 0 4096 1000\n", "line 2: the device (0-255) is missing or out of range"},
      {"# gcalloc trace 1\n1 7 empty_cache 0 -2 0\n", "line 2: the device (-1 for all, or 0-255)"},
      {"# gcalloc trace 1\n1 7 malloc 0 0 0 4096 ffffffffffffffff\n", "line 2: pointer ffffffffffffffff out of range"},
      {"# gcalloc trace 1\n1 7 free 0 fffffffffffffffe 0\n", "line 2: pointer fffffffffffffffe out of range"},
      {"# gcalloc trace 1\n1 7 frees 0 1000 0\n", "line 2: the call (open, close, malloc"},
  };
  expect_all_refused("gcalloc-scratch-replay-bad.trace", bad, sizeof bad / sizeof bad[0]);
  /* A line longer than any the recorder writes. */
  expect_long_line_refused("gcalloc-scratch-replay-bad.trace", "# gcalloc trace 1\n1 7 open 0 sim ", 'x', 2000, "\n",
                           "line 2: longer than 1024 characters");
}

/* The allocator's snapshot, written as a pickle at `path` and read back as
 * a trace into *t. */
static void record_as_trace(gca_allocator_t *a, const char *path, trace_t *t) {
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  assert_int_equal(gca_snapshot_write(s, path, GCA_SNAPSHOT_PICKLE), GCA_OK);
  gca_snapshot_free(s);
  assert_int_equal(trace_load(path, t), GCA_OK);
}

/* `steps` random operations on `slots` slots of `live`: a slot's block
 * freed, or an empty slot given one of 512 B << (0 .. shifts - 1); and
 * gca_empty_cache once, after operation `empty_cache_at`. */
static void random_history(gca_allocator_t *a, uint64_t *rng, void **live, int slots, int steps, int shifts,
                           int empty_cache_at) {
  for (int i = 0; i < steps; i++) {
    int k = (int)(next_random(rng) % (uint64_t)slots);
    if (live[k]) {
      gca_free(a, live[k]);
      live[k] = NULL;
    } else {
      live[k] = gca_malloc(a, (size_t)1 << (9 + next_random(rng) % (uint64_t)shifts), 0, 0);
    }
    if (i == empty_cache_at) gca_empty_cache(a, 0);
  }
}

/* A snapshot gcalloc wrote itself, with three allocations live before the
 * history began: the replay seeds them, and with the same settings makes
 * exactly gcalloc's own segment decisions and reaches its reserved peak. */
static void test_own_snapshot_round_trip(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "max_split_size_mb:64");
  void *early[3] = {gca_malloc(a, 3 * MiB, 0, 0), gca_malloc(a, 700 * KiB, 0, 0), gca_malloc(a, 90 * MiB, 0, 0)};
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_NONE, 100000), GCA_OK);
  uint64_t rng = 5;
  void *live[64] = {0};
  random_history(a, &rng, live, 64, 3000, 18, 1500);
  gca_free(a, early[1]);
  int64_t reserved_peak = stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].peak;
  trace_t t;
  record_as_trace(a, "gcalloc-scratch-replay.pickle", &t);
  /* The settings in force travel with it (gca_get_config's form). */
  assert_non_null(t.settings);
  assert_contains(t.settings, "max_split_size_mb:64");
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  replay_device_t *d = &r.devices[0];
  assert_int_equal(d->seeded, 3);
  assert_true(d->segment_events_recorded > 0);
  assert_int_equal(d->segment_events_matched, d->segment_events_recorded);
  assert_int_equal(d->empty_cache_calls, 1);
  /* Reserved at the start (the three early segments) is included in both. */
  assert_int_equal(d->recorded_peak_reserved, reserved_peak);
  assert_int_equal(d->peak_reserved, (uint64_t)reserved_peak);
  replay_result_free(&r);
  trace_free(&t);
  for (int k = 0; k < 64; k++) gca_free(a, live[k]);
  gca_free(a, early[0]);
  gca_free(a, early[2]);
  gca_close(a);
}

/* The start as PyTorch had it: memory cached free in the segments of the
 * history before recording began (a gap between two blocks, a segment's
 * free rest, a segment cached whole, gaps in a small segment, blocks that
 * kept a half megabyte after them unsplit, between two blocks and at a
 * segment's end). The job's first requests
 * are served from that cache; a replay that packed the live blocks into
 * new segments would ask the device instead. With the segments made as
 * recorded, the replay makes every one of the record's segment decisions,
 * nothing more, and reaches its reserved peak exactly. */
static void test_start_as_recorded(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *three = gca_malloc(a, 3 * MiB, 0, 0), *five = gca_malloc(a, 5 * MiB, 0, 0);
  void *other = gca_malloc(a, 3 * MiB, 0, 0);
  gca_free(a, five); /* a 5 MiB gap, and 9 MiB free after `other` */
  /* Best fit puts 4.5 MiB in that gap, and leaves its last half megabyte
   * in the block (a large block splits only above 1 MiB): between two
   * blocks, a block longer than its rounded size. */
  void *mid = gca_malloc(a, 4 * MiB + 512 * KiB, 0, 0);
  void *unsplit = gca_malloc(a, 19 * MiB + 512 * KiB, 0, 0); /* its 20 MiB segment's rest stays in it */
  void *small[4];
  for (int i = 0; i < 4; i++) small[i] = gca_malloc(a, 256 * KiB, 0, 0);
  gca_free(a, small[1]);
  gca_free(a, small[3]);
  gca_free(a, gca_malloc(a, 64 * MiB, 0, 0)); /* cached whole */
  int64_t start_reserved = stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current;
  assert_int_equal(start_reserved, (20 + 20 + 2 + 64) * MiB);
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_NONE, 100000), GCA_OK);
  void *served[4] = {gca_malloc(a, 4 * MiB, 0, 0), gca_malloc(a, 8 * MiB, 0, 0), gca_malloc(a, 40 * MiB, 0, 0),
                     gca_malloc(a, 200 * KiB, 0, 0)};
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, start_reserved); /* all from the cache */
  gca_free(a, three);
  gca_free(a, mid);
  gca_free(a, small[2]);
  uint64_t rng = 11;
  void *live[48] = {0};
  random_history(a, &rng, live, 48, 2000, 17, 1200);
  int64_t reserved_peak = stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].peak;
  trace_t t;
  record_as_trace(a, "gcalloc-scratch-replay-start.pickle", &t);
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  replay_device_t *d = &r.devices[0];
  assert_int_equal(d->seeded, 6); /* three, mid, other, unsplit, small[0], small[2] */
  assert_int_equal(d->start_segments, 4);
  assert_true(d->segment_events_recorded > 4);
  assert_int_equal(d->segment_events_matched, d->segment_events_recorded);
  assert_int_equal(d->segment_events_replayed, d->segment_events_recorded);
  assert_int_equal(d->recorded_peak_reserved, reserved_peak);
  assert_int_equal(d->peak_reserved, (uint64_t)reserved_peak);
  replay_result_free(&r);
  /* Settings that cannot make some of it: the 64 MiB segment is oversize
   * with max_split_size_mb:32 (its cache is not carved, the rest is), and
   * expandable segments make none of it; both replay without error (the
   * state after the seeding passes the invariant checker, or the replay
   * fails). */
  o.conf = "max_split_size_mb:32";
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].seeded, 6);
  assert_int_equal(r.devices[0].start_segments, 3);
  replay_result_free(&r);
  o.conf = "expandable_segments:True";
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].start_segments, 0);
  replay_result_free(&r);
  trace_free(&t);
  for (int k = 0; k < 48; k++) gca_free(a, live[k]);
  for (int k = 0; k < 4; k++) gca_free(a, served[k]);
  gca_free(a, other);
  gca_free(a, unsplit);
  gca_free(a, small[0]);
  gca_close(a);
  /* Nothing live at the start, a segment cached: the same. */
  a = open_sim("sim", NULL);
  gca_free(a, gca_malloc(a, 64 * MiB, 0, 0));
  assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_NONE, 1000), GCA_OK);
  void *from_cache = gca_malloc(a, 40 * MiB, 0, 0), *fresh = gca_malloc(a, 40 * MiB, 0, 0);
  record_as_trace(a, "gcalloc-scratch-replay-start.pickle", &t);
  o = defaults();
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  d = &r.devices[0];
  assert_int_equal(d->seeded, 0);
  assert_int_equal(d->start_segments, 1);
  assert_int_equal(d->segment_events_recorded, 1); /* the second 40 MiB's */
  assert_int_equal(d->segment_events_replayed, 1);
  assert_int_equal(d->peak_reserved, 104 * MiB);
  replay_result_free(&r);
  trace_free(&t);
  gca_free(a, from_cache);
  gca_free(a, fresh);
  gca_close(a);
}

/* The same on random histories: whatever gcalloc's own allocator left
 * before recording began (sizes of both pools, powers of two mostly and
 * odd ones, frees, an empty_cache now and then), the replay's state after
 * its seeding is that state, segment by segment and block by block
 * (sizes, offsets, states, requested bytes), unless the start held what no
 * record tells: a block that kept a tail of its free block unsplit, now
 * followed by free memory, and freed before recording ended (the record
 * gives a freed block's requested size only, so how much of the free
 * memory after it was its tail is unknown; the replay takes none). Both
 * kinds must occur among the seeds. (The decisions after the start are
 * counted, not required: where free blocks of one size tie, best fit takes
 * the lowest address, and the simulator hands out addresses in its own
 * order, not the recorded one.) */
/* What a random history did after recording began, for telling whether
 * the record tells a start block's tail. */
typedef struct recorded_history {
  void *at_start[96];  /* the slots' blocks when recording began */
  int freed_at[96];    /* the step their block was freed at, or RECORD_STEPS */
  void *made[600];     /* every block allocated after, and its step */
  int made_at[600];
  int made_count;
} recorded_history_t;
#define RECORD_STEPS 600

/* Whether the start holds a block the record cannot size: one that kept an
 * unsplit tail of a large free block, with free memory after it, freed
 * before recording ended, and whose free memory no allocation took before
 * that (the first one would land at the tail's end). */
static bool tail_unknown_to_the_record(const gca_snapshot_t *start, const recorded_history_t *h) {
  for (size_t i = 0; i < start->segment_count; i++) {
    const gca_snapshot_segment_t *g = &start->segments[i];
    for (size_t j = 0; g->pool == GCA_POOL_LARGE && j + 1 < g->block_count; j++) {
      const gca_snapshot_block_t *b = &g->blocks[j];
      if (b->state != GCA_BLOCK_ACTIVE_ALLOCATED || b->size <= (b->requested_size + 511) / 512 * 512 ||
          g->blocks[j + 1].state != GCA_BLOCK_INACTIVE)
        continue;
      int freed = RECORD_STEPS;
      for (int k = 0; k < 96; k++)
        if ((uintptr_t)h->at_start[k] == b->address) freed = h->freed_at[k];
      bool told = freed == RECORD_STEPS; /* live to the end: the final state sizes it */
      for (int m = 0; m < h->made_count && !told; m++)
        told = (uintptr_t)h->made[m] == b->address + b->size && h->made_at[m] < freed;
      if (!told) return true;
    }
  }
  return false;
}

/* Whether two states have the same segments (in address order) with the
 * same blocks at the same offsets, wherever each device put them. */
static bool same_layout(const gca_snapshot_t *x, const gca_snapshot_t *y) {
  if (x->segment_count != y->segment_count) return false;
  for (size_t i = 0; i < x->segment_count; i++) {
    const gca_snapshot_segment_t *g = &x->segments[i], *h = &y->segments[i];
    if (g->total_size != h->total_size || g->pool != h->pool || g->block_count != h->block_count) return false;
    for (size_t j = 0; j < g->block_count; j++) {
      const gca_snapshot_block_t *b = &g->blocks[j], *c = &h->blocks[j];
      if (b->address - g->address != c->address - h->address || b->size != c->size || b->state != c->state ||
          b->requested_size != c->requested_size)
        return false;
    }
  }
  return true;
}

static void test_start_as_recorded_random(void **state) {
  (void)state;
  int told = 0, untold = 0, untold_same = 0, decisions_same = 0;
  for (uint64_t seed = 1; seed <= 24; seed++) {
    uint64_t rng = seed * 7919;
    gca_allocator_t *a = open_sim("sim", NULL);
    void *live[96] = {0};
    static recorded_history_t h;
    memset(&h, 0, sizeof h);
    gca_snapshot_t *at_start = NULL;
    for (int phase = 0; phase < 2; phase++) {
      if (phase == 1) {
        assert_int_equal(gca_snapshot_take(a, &at_start), GCA_OK);
        assert_int_equal(gca_record_history(a, 1, GCA_CONTEXT_NONE, 100000), GCA_OK);
        memcpy(h.at_start, live, sizeof h.at_start);
        for (int k = 0; k < 96; k++) h.freed_at[k] = RECORD_STEPS;
      }
      for (int i = 0; i < RECORD_STEPS; i++) {
        int k = (int)(next_random(&rng) % 96);
        if (live[k]) {
          if (phase == 1 && live[k] == h.at_start[k] && h.freed_at[k] == RECORD_STEPS) h.freed_at[k] = i;
          gca_free(a, live[k]);
          live[k] = NULL;
        } else {
          size_t size = (size_t)1 << (9 + next_random(&rng) % 18); /* 512 B to 64 MiB */
          if (next_random(&rng) % 6 == 0) size += next_random(&rng) % 4096 * 512;
          live[k] = gca_malloc(a, size, 0, 0);
          assert_non_null(live[k]);
          if (phase == 1) {
            h.made[h.made_count] = live[k];
            h.made_at[h.made_count++] = i;
          }
        }
        if (next_random(&rng) % 400 == 0) gca_empty_cache(a, 0);
      }
    }
    bool known = !tail_unknown_to_the_record(at_start, &h);
    trace_t t;
    record_as_trace(a, "gcalloc-scratch-replay-random.pickle", &t);
    replay_options_t o = defaults();
    o.start_snapshot = true;
    replay_result_t r;
    assert_int_equal(replay_trace(&t, &o, &r), GCA_OK); /* (the checker ran after the seeding) */
    replay_device_t *d = &r.devices[0];
    assert_true(d->start_segments > 0);
    assert_non_null(d->start_snapshot);
    bool same = same_layout(at_start, d->start_snapshot);
    if (known && !same) fail_msg("seed %" PRIu64 ": the start made is not the start recorded", seed);
    bool decisions = d->segment_events_matched == d->segment_events_recorded &&
                     d->segment_events_replayed == d->segment_events_recorded &&
                     d->peak_reserved == (uint64_t)d->recorded_peak_reserved;
    if (known && !decisions)
      fail_msg("seed %" PRIu64 ": %zu of %zu segment events, %zu made; peak %" PRIu64 " against %" PRId64, seed,
               d->segment_events_matched, d->segment_events_recorded, d->segment_events_replayed, d->peak_reserved,
               d->recorded_peak_reserved);
    told += known;
    untold += !known;
    untold_same += !known && same;
    decisions_same += decisions;
    gca_snapshot_free(at_start);
    replay_result_free(&r);
    trace_free(&t);
    for (int k = 0; k < 96; k++) gca_free(a, live[k]);
    gca_close(a);
  }
  print_message("start as recorded, 24 random histories: %d told by the record, made exactly, and every later "
                "segment decision the same; %d with a tail it does not tell (%d made exactly all the same); all "
                "decisions the same in %d in all\n", told, untold, untold_same, decisions_same);
  assert_true(told >= 8);
  assert_true(untold >= 1);
}


/* RMM's logging_resource_adaptor CSV: both spellings of a free, a clock
 * passing midnight, two streams, and an allocation that failed in the
 * original run (kept as an oom entry, not replayed). */
/* A trace's streams by number: 0 is stream 0 without a table, others
 * numbered in the order first met, the same number each time after (a
 * thousand streams, past every growth of the table and its index, and the
 * values a hash table might keep for itself: all ones, one less). */
static void test_stream_numbers(void **state) {
  (void)state;
  trace_streams_t s = {0};
  uint32_t n = 99;
  assert_int_equal(trace_stream_number(&s, 0, &n), GCA_OK);
  assert_int_equal(n, 0);
  assert_null(s.values);
  uint64_t seed = 0x5eed;
  static uint64_t values[1000];
  for (int i = 0; i < 1000; i++) {
    values[i] = i == 0 ? UINT64_MAX : i == 1 ? UINT64_MAX - 1 : i == 2 ? 1 : next_random(&seed) | 1;
    assert_int_equal(trace_stream_number(&s, values[i], &n), GCA_OK);
    assert_int_equal(n, (uint32_t)i + 1);
    assert_int_equal(trace_stream_number(&s, values[i], &n), GCA_OK); /* (the last one, cached) */
    assert_int_equal(n, (uint32_t)i + 1);
  }
  assert_int_equal(s.count, 1001);
  for (int i = 999; i >= 0; i--) {
    assert_int_equal(trace_stream_number(&s, values[i], &n), GCA_OK);
    assert_int_equal(n, (uint32_t)i + 1);
    assert_int_equal(s.values[n], values[i]);
  }
  assert_int_equal(trace_stream_number(&s, 0, &n), GCA_OK);
  assert_int_equal(n, 0);
  assert_int_equal(s.count, 1001);
  trace_streams_free(&s);
  assert_null(s.values);
}

static void test_rmm_csv(void **state) {
  (void)state;
  write_file("gcalloc-scratch-replay-rmm.csv",
             "Thread,Time,Action,Pointer,Size,Stream\n"
             "140573312345856,23:59:59.500000,allocate,0x7f8a40000000,3000000,0x0\n"
             "140573312345856,23:59:59.750000,allocate,0x7f8a40400000,5000000,0x7f8a38001020\n"
             "140573312345856,00:00:00.250000,free,0x7f8a40000000,3000000,0x0\n"
             "140573312345856,00:00:00.500000,allocate failure,nullptr,99999999999999,0x0\n"
             "140573312345856,00:00:01.000000,deallocate,0x7f8a40400000,5000000,0x7f8a38001020\n");
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-replay-rmm.csv", &t), GCA_OK);
  assert_int_equal(t.count, 5);
  assert_int_equal(t.device_count, 1);
  assert_int_equal(t.events[0].action, TA_ALLOC);
  assert_int_equal(t.events[0].stream, 0); /* the default stream, 0x0 */
  assert_int_equal(t.events[1].stream, 1); /* the first other stream met */
  assert_int_equal(trace_event_stream(&t, &t.events[1]), 0x7f8a38001020ull);
  assert_int_equal(t.events[4].stream, 1);
  assert_int_equal(t.events[2].action, TA_FREE_COMPLETED);
  assert_int_equal(t.events[3].action, TA_OOM);
  assert_int_equal(t.events[4].action, TA_FREE_COMPLETED);
  /* 23:59:59.5 then the next day: time keeps increasing. */
  assert_int_equal(t.events[0].time_us, (int64_t)86399500000);
  assert_int_equal(t.events[2].time_us, (int64_t)86400250000);
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].events, 4);
  assert_int_equal(r.devices[0].peak_requested, 8000000);
  assert_int_equal(r.devices[0].recorded_peak_reserved, -1);
  replay_result_free(&r);
  trace_free(&t);

  /* Newer RMM: seconds since the epoch. */
  write_file("gcalloc-scratch-replay-rmm.csv", "Thread,Time,Action,Pointer,Size,Stream\n"
                                           "1,1634567890.123456,allocate,0x7f8a40000000,1024,0x0\n");
  assert_int_equal(trace_load("gcalloc-scratch-replay-rmm.csv", &t), GCA_OK);
  assert_int_equal(t.events[0].time_us, (int64_t)1634567890123456);
  trace_free(&t);

  static const refusal_t bad[] = {
      {"Thread,Time,Action,Pointer\n1,2,allocate,0x1\n", ":1: an RMM log header needs the columns Action, Pointer and Size"},
      {"Thread,Time,Action,Pointer,Size,Stream\n1,1.0,alloc,0x1,2,0x0\n", ":2: unknown action 'alloc'"},
      {"Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x1,-2,0x0\n", ":2: Pointer '0x1' or Size '-2'"},
      {"Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x1,2,0x0\n1,1.0,allocate,0x1\n",
       ":3: 4 fields where the header has 6"},
      {"Thread,Time,Action,Pointer,Size,Stream\n1,noon,allocate,0x1,2,0x0\n", ":2: Time 'noon'"},
      /* (Found by fuzz_text: hours past what microseconds hold, and a
       * negative or infinite second, had been converted regardless.) */
      {"Thread,Time,Action,Pointer,Size,Stream\n1,3333333333:59:59.75,allocate,0x1,2,0x0\n",
       ":2: Time '3333333333:59:59.75'"},
      {"Thread,Time,Action,Pointer,Size,Stream\n1,10:00:-5,allocate,0x1,2,0x0\n", ":2: Time '10:00:-5'"},
      {"Thread,Time,Action,Pointer,Size,Stream\n1,10:00:-inf,allocate,0x1,2,0x0\n", ":2: Time '10:00:-inf'"},
      {"Thread,Time,Action,Pointer,Size,Stream\n1,1e13,allocate,0x1,2,0x0\n", ":2: Time '1e13'"},
      {"Thread,Time,Action,Pointer,Size,Stream\n1,1.0,allocate,0x1,2,stream\n", ":2: Stream 'stream'"},
      {"Thread,Time,Action,Pointer,Size,Stream\n", "no calls in the RMM log"},
  };
  expect_all_refused("gcalloc-scratch-replay-rmm.csv", bad, sizeof bad / sizeof bad[0]);
}

/* With a timeline: the bytes after every operation, the peak's position and
 * the segment map there, and PyTorch's recorded reserved alongside. */
static void test_timeline(void **state) {
  (void)state;
  /* op 0: +3 MB, op 1: +5 MB, op 2: free a, op 3: +1000 B ... */
  write_file("gcalloc-scratch-replay.log", "0 2 3000000\n1 3 5000000\n2 4 1000\n");
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-replay.log", &t), GCA_OK);
  replay_options_t o = defaults();
  o.timeline = true;
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  replay_device_t *d = &r.devices[0];
  assert_int_equal(d->timeline_count, 6);
  assert_null(d->recorded_reserved_at);
  static const uint64_t requested[] = {3000000, 8000000, 5000000, 5001000, 1000, 0};
  uint64_t max_reserved = 0;
  for (size_t i = 0; i < 6; i++) {
    assert_int_equal(d->requested_at[i], requested[i]);
    assert_true(d->allocated_at[i] >= d->requested_at[i]);
    assert_true(d->reserved_at[i] >= d->allocated_at[i]);
    if (d->reserved_at[i] > max_reserved) max_reserved = d->reserved_at[i];
  }
  assert_int_equal(max_reserved, d->peak_reserved);
  assert_int_equal(d->reserved_at[d->peak_op], d->peak_reserved);
  /* The snapshot at the peak holds exactly the peak's segments. */
  assert_non_null(d->peak_snapshot);
  uint64_t total = 0;
  for (size_t i = 0; i < d->peak_snapshot->segment_count; i++) total += d->peak_snapshot->segments[i].total_size;
  assert_int_equal(total, d->peak_reserved);
  replay_result_free(&r);
  trace_free(&t);

  assert_int_equal(trace_load(big_snapshot(0), &t), GCA_OK);
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  d = &r.devices[0];
  assert_non_null(d->recorded_reserved_at);
  int64_t recorded_max = 0;
  for (size_t i = 0; i < d->timeline_count; i++)
    if (d->recorded_reserved_at[i] > recorded_max) recorded_max = d->recorded_reserved_at[i];
  assert_int_equal(recorded_max, d->recorded_peak_reserved);
  replay_result_free(&r);
  trace_free(&t);
}

typedef struct progress_seen {
  size_t calls, last;
  bool increasing;
} progress_seen_t;

static void count_progress(void *ctx, int device, size_t done, size_t total) {
  progress_seen_t *p = ctx;
  p->increasing &= done > p->last && done <= total && device == 0;
  p->last = done;
  p->calls++;
}

/* A long replay reports its progress (the tool shows it on a terminal). */
static void test_progress(void **state) {
  (void)state;
  FILE *f = fopen("gcalloc-scratch-replay-long.log", "w");
  assert_non_null(f);
  for (int i = 0; i < 100000; i++) fprintf(f, "%d %d %d\n", i, i + 3, 4096 + (i % 7) * 512);
  fclose(f);
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-replay-long.log", &t), GCA_OK);
  replay_options_t o = defaults();
  progress_seen_t seen = {0, 0, true};
  o.progress = count_progress;
  o.progress_ctx = &seen;
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].events, 200000);
  assert_int_equal(seen.calls, 200000 / 65536); /* every 65,536 operations */
  assert_true(seen.increasing);
  replay_result_free(&r);
  trace_free(&t);
}

typedef struct device_progress {
  size_t calls[4], last[4];
  bool increasing;
} device_progress_t;

static void count_device_progress(void *ctx, int device, size_t done, size_t total) {
  device_progress_t *p = ctx; /* not atomic: the replay makes the calls one at a time */
  assert_true(device >= 0 && device < 4);
  p->increasing &= done > p->last[device] && done <= total;
  p->last[device] = done;
  p->calls[device]++;
}

/* Devices replay on threads of their own: the results are those of one
 * thread, device by device, whatever the number of threads, progress calls
 * come one at a time, and a device's failure reaches the caller with its
 * message. */
static void test_devices_in_parallel(void **state) {
  (void)state;
  FILE *f = fopen("gcalloc-scratch-replay-devices.trace", "w");
  assert_non_null(f);
  fputs("# gcalloc trace 1\n1 7 open 0 sim:devices=4 -\n", f);
  uint64_t rng = 42;
  uint64_t live[4][64] = {{0}};
  int time = 2;
  /* Devices 0 and 2 get over 65,536 operations each, for progress calls. */
  for (int i = 0; i < 160000; i++) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    int dev = (int)(rng >> 60) % 4, k = (int)(rng >> 50) % 64;
    /* Device 3 only takes a few: uneven devices, as in real traces. */
    if (dev == 3 && i % 50) dev = 0;
    if (dev == 1 && i % 4) dev = 2;
    if (live[dev][k]) {
      fprintf(f, "%d 7 free 0 %llx 0\n", time++, (unsigned long long)live[dev][k]);
      live[dev][k] = 0;
    } else {
      uint64_t size = 512 + (rng >> 20) % (dev == 1 ? (64u << 20) : (1u << 20));
      live[dev][k] = ((uint64_t)(dev + 1) << 40) + (uint64_t)i * 4096;
      fprintf(f, "%d 7 malloc 0 %d 0 %llu %llx\n", time++, dev, (unsigned long long)size,
              (unsigned long long)live[dev][k]);
    }
  }
  fputs("9999999 7 close 0\n", f);
  fclose(f);
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-replay-devices.trace", &t), GCA_OK);
  assert_int_equal(t.device_count, 4);
  const char *confs[] = {"", "expandable_segments:True"};
  for (int c = 0; c < 2; c++) {
    replay_options_t o = defaults();
    o.conf = confs[c];
    o.threads = 1;
    replay_result_t one, many;
    assert_int_equal(replay_trace(&t, &o, &one), GCA_OK);
    o.threads = 4;
    device_progress_t seen = {.increasing = true};
    o.progress = count_device_progress;
    o.progress_ctx = &seen;
    assert_int_equal(replay_trace(&t, &o, &many), GCA_OK);
    assert_true(seen.increasing);
    assert_int_equal(one.device_count, 4);
    assert_int_equal(many.device_count, 4);
    for (int d = 0; d < 4; d++) {
      const replay_device_t *x = &one.devices[d], *y = &many.devices[d];
      assert_int_equal(x->device, d);
      assert_int_equal(y->device, d);
      assert_true(x->events > 0);
      assert_int_equal(x->events, y->events);
      assert_int_equal(x->peak_requested, y->peak_requested);
      assert_int_equal(x->peak_allocated, y->peak_allocated);
      assert_int_equal(x->peak_reserved, y->peak_reserved);
      assert_int_equal(x->device_allocs, y->device_allocs);
      assert_int_equal(x->device_frees, y->device_frees);
      assert_int_equal(x->segment_events_replayed, y->segment_events_replayed);
      assert_int_equal(x->pages_mapped, y->pages_mapped);
      assert_int_equal(seen.calls[d], y->events / 65536);
    }
    assert_true(seen.calls[0] > 0 && seen.calls[2] > 0);
    assert_true(one.devices[1].peak_reserved > one.devices[3].peak_reserved);
    assert_int_equal(c == 1, one.devices[0].pages_mapped > 0);
    replay_result_free(&one);
    replay_result_free(&many);
  }
  /* Every device's allocator refuses the configuration: the caller gets the
   * error, whichever thread met it. */
  replay_options_t o = defaults();
  o.conf = "max_split_size_mb:banana";
  o.threads = 4;
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_ERR_CONFIG);
  assert_contains(gca_last_error(), "max_split_size_mb");
  assert_null(r.devices);
  trace_free(&t);
}

/* Two results alike, device by device, in every figure a replay reports. */
static void expect_same_result(const replay_result_t *x, const replay_result_t *y) {
  assert_int_equal(x->device_count, y->device_count);
  for (int d = 0; d < x->device_count; d++) {
    const replay_device_t *a = &x->devices[d], *b = &y->devices[d];
    assert_int_equal(a->device, b->device);
    assert_int_equal(a->events, b->events);
    assert_int_equal(a->seeded, b->seeded);
    assert_int_equal(a->start_segments, b->start_segments);
    assert_int_equal(a->peak_requested, b->peak_requested);
    assert_int_equal(a->peak_allocated, b->peak_allocated);
    assert_int_equal(a->peak_reserved, b->peak_reserved);
    assert_int_equal(a->recorded_peak_reserved, b->recorded_peak_reserved);
    assert_int_equal(a->device_allocs, b->device_allocs);
    assert_int_equal(a->device_frees, b->device_frees);
    assert_int_equal(a->segment_events_recorded, b->segment_events_recorded);
    assert_int_equal(a->segment_events_matched, b->segment_events_matched);
    assert_int_equal(a->segment_events_replayed, b->segment_events_replayed);
    assert_int_equal(a->empty_cache_calls, b->empty_cache_calls);
    assert_int_equal(a->oom, b->oom);
    assert_int_equal(a->oom_event, b->oom_event);
    assert_int_equal(a->pages_mapped, b->pages_mapped);
    assert_int_equal(a->pages_unmapped, b->pages_unmapped);
  }
}

/* replay_plan: a trace planned once and replayed under several settings
 * (as gcalloc tune does, on several threads) gives what planning each time
 * gives; plans made with other options are refused. */
static void test_plans_reused(void **state) {
  (void)state;
  const char *files[] = {
      GCALLOC_SOURCE_DIR "/tests/data/snapshot_small.pickle", big_snapshot(1), big_snapshot(2),
      real_traces_dir() ? real_path("Lin-Mao__allocatorSim/alexnet_train.log")
                        : GCALLOC_SOURCE_DIR "/tests/fuzz/text-seeds/allocsim.log",
  };
  size_t file_count = sizeof files / sizeof files[0];
  const char *confs[] = {"", "expandable_segments:True", "max_split_size_mb:64,roundup_power2_divisions:4",
                         "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0"};
  for (size_t i = 0; i < file_count; i++) {
    trace_t t;
    assert_int_equal(trace_load(files[i], &t), GCA_OK);
    for (int device = -1; device < (t.device_count > 1 ? 2 : 0); device++) {
      replay_options_t o = defaults();
      o.device = device;
      o.capacity = (uint64_t)6 << 30; /* (cranberrii does not fit: the first OOM must match too) */
      replay_plans_t *plans;
      assert_int_equal(replay_plan(&t, &o, &plans), GCA_OK);
      for (size_t c = 0; c < sizeof confs / sizeof confs[0]; c++) {
        o.conf = confs[c];
        o.plans = NULL;
        replay_result_t fresh, planned;
        assert_int_equal(replay_trace(&t, &o, &fresh), GCA_OK);
        o.plans = plans;
        assert_int_equal(replay_trace(&t, &o, &planned), GCA_OK);
        expect_same_result(&fresh, &planned);
        replay_result_free(&fresh);
        replay_result_free(&planned);
      }
      /* Made with other options, or of another trace: refused by name. */
      replay_result_t r;
      o.infer_empty_cache = false;
      assert_int_equal(replay_trace(&t, &o, &r), GCA_ERR_INVALID);
      assert_contains(gca_last_error(), "plans given were made");
      o.infer_empty_cache = true;
      trace_t other = t;
      assert_int_equal(replay_trace(&other, &o, &r), GCA_ERR_INVALID);
      replay_plans_free(plans);
    }
    trace_free(&t);
  }
  /* A device the trace does not have. */
  trace_t t;
  assert_int_equal(trace_load(files[0], &t), GCA_OK);
  replay_options_t o = defaults();
  o.device = t.device_count;
  replay_plans_t *plans = (replay_plans_t *)&o; /* (set to NULL on failure) */
  assert_int_equal(replay_plan(&t, &o, &plans), GCA_ERR_INVALID);
  assert_null(plans);
  trace_free(&t);
}

/* gcalloc tune: the best configuration it prints reserves what a replay with
 * it reserves, and no more than the defaults. */
static void test_tune(void **state) {
  (void)state;
  char args[1024];
  snprintf(args, sizeof args, "tune %s", big_snapshot(1));
  json_object *root = tool_json(args), *best, *v, *defaults_obj, *ranked;
  assert_true(json_object_object_get_ex(root, "best", &best));
  assert_true(json_object_object_get_ex(root, "defaults", &defaults_obj));
  assert_true(json_object_object_get_ex(root, "ranked", &ranked));
  /* 7 splits x 6 divisions x 3 expandable modes, one stream, no capacity */
  assert_int_equal(json_object_array_length(ranked), 126);
  assert_true(json_object_object_get_ex(best, "conf", &v));
  char conf[256];
  snprintf(conf, sizeof conf, "%s", json_object_get_string(v));
  assert_true(json_object_object_get_ex(best, "peak_reserved_bytes", &v));
  uint64_t best_peak = (uint64_t)json_object_get_int64(v);
  assert_true(json_object_object_get_ex(defaults_obj, "peak_reserved_bytes", &v));
  assert_true(best_peak <= (uint64_t)json_object_get_int64(v));
  for (size_t i = 1; i < json_object_array_length(ranked); i++) {
    json_object *a = json_object_array_get_idx(ranked, i - 1), *b = json_object_array_get_idx(ranked, i), *pa, *pb;
    json_object_object_get_ex(a, "peak_reserved_bytes", &pa);
    json_object_object_get_ex(b, "peak_reserved_bytes", &pb);
    assert_true(json_object_get_int64(pa) <= json_object_get_int64(pb));
  }
  json_object_put(root);
  trace_t t;
  assert_int_equal(trace_load(big_snapshot(1), &t), GCA_OK);
  replay_options_t o = defaults();
  o.conf = conf;
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.devices[0].peak_reserved, best_peak);
  replay_result_free(&r);
  trace_free(&t);
  /* Under a capacity nothing fits in: exit status 3. */
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s tune %s --capacity 256MiB > /dev/null", GCALLOC_TOOL_PATH, big_snapshot(0));
  assert_int_equal(WEXITSTATUS(system(cmd)), 3);
}

/* A job that fragments (allocatorSim lines: alloc index, free index,
 * size): 100 MiB freed, five 4 MiB blocks carved from its segment, four of
 * them freed, then 90 MiB. By default the live 4 MiB block pins the 100 MiB
 * segment and 90 MiB needs another (190 MiB); with max_split_size_mb at 32
 * or 64 the 100 MiB block is not split, the 4 MiB blocks get a segment of
 * their own, and 90 MiB reuses the big one (110 MiB at most). */
static const char *fragmenting_trace(void) {
  write_file("gcalloc-scratch-fragmenting.log", "0 1 104857600\n2 10 4194304\n3 10 4194304\n4 10 4194304\n"
                                                 "5 10 4194304\n6 30 4194304\n20 30 94371840\n");
  return "gcalloc-scratch-fragmenting.log";
}

static json_object *member(json_object *o, const char *key) {
  json_object *v = NULL;
  if (!json_object_object_get_ex(o, key, &v)) fail_msg("no \"%s\" in the JSON", key);
  return v;
}

/* tune under a capacity: a setting that does not fit never beats one that
 * does, nor the defaults; among those that do not, the furthest ranks
 * first; the answer takes the fewest keys; where only gcalloc's keys fit,
 * PyTorch's allocator is not told to keep its defaults; when nothing fits
 * it says so, names no answer and says by how much the capacity falls
 * short. */
static void test_tune_under_a_capacity(void **state) {
  (void)state;
  char args[512];
  snprintf(args, sizeof args, "tune %s --capacity 110MiB", fragmenting_trace());
  json_object *root = tool_json(args), *ranked = member(root, "ranked");
  assert_false(json_object_get_boolean(member(root, "nothing_fits")));
  assert_false(json_object_get_boolean(member(member(root, "defaults"), "fits")));
  json_object *best = member(root, "best"), *torch_best = member(root, "best_pytorch");
  assert_true(json_object_get_boolean(member(best, "fits")));
  /* gcalloc's: stitching fits in 100 MiB, the bound (and takes the fewest
   * keys of the many settings with it); PyTorch's: 110 MiB, one key. */
  assert_string_equal(json_object_get_string(member(best, "conf")), "expandable_segments:True,stitching:True");
  assert_int_equal(json_object_get_int64(member(best, "peak_reserved_bytes")), 100 * MiB);
  assert_non_null(torch_best);
  assert_string_equal(json_object_get_string(member(torch_best, "conf")), "max_split_size_mb:32");
  bool failing_seen = false;
  int64_t last_replayed = INT64_MAX;
  for (size_t i = 0; i < json_object_array_length(ranked); i++) {
    json_object *c = json_object_array_get_idx(ranked, i);
    bool fits = json_object_get_boolean(member(c, "fits"));
    assert_true(!fits || !failing_seen); /* every fitting one before every failing one */
    if (fits) continue;
    failing_seen = true;
    int64_t replayed = json_object_get_int64(member(c, "operations_replayed"));
    assert_true(replayed <= last_replayed); /* the furthest first */
    last_replayed = replayed;
  }
  assert_true(failing_seen);
  json_object_put(root);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s %s > gcalloc-scratch-tune.txt", GCALLOC_TOOL_PATH, args);
  assert_int_equal(system(cmd), 0);
  size_t len;
  char *text = (char *)read_whole("gcalloc-scratch-tune.txt", &len);
  assert_non_null(text);
  assert_contains(text, "(the defaults do not fit); paste:\nGCALLOC_ALLOC_CONF=expandable_segments:True,stitching:True");
  assert_contains(text, "(the defaults do not fit); paste:\nPYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:32");
  assert_null(strstr(text, "below the defaults")); /* (a peak of a run that stopped compares with nothing) */
  free(text);

  /* 105 MiB: gcalloc's answer fits, nothing of PyTorch's does: no "keep them". */
  snprintf(cmd, sizeof cmd, "%s tune %s --capacity 105MiB > gcalloc-scratch-tune.txt", GCALLOC_TOOL_PATH,
           fragmenting_trace());
  assert_int_equal(system(cmd), 0);
  text = (char *)read_whole("gcalloc-scratch-tune.txt", &len);
  assert_non_null(text);
  assert_contains(text, "paste:\nGCALLOC_ALLOC_CONF=expandable_segments:True,stitching:True");
  assert_contains(text, "with PyTorch's own allocator: neither the defaults nor any setting of its keys searched "
                        "fits in 0.103 GiB; the job needs gcalloc with the setting above, or a larger device");
  assert_null(strstr(text, "keep them"));
  free(text);

  /* 40 MiB: the job's 94 MiB live never fit. */
  snprintf(cmd, sizeof cmd, "%s tune %s --capacity 40MiB --json > gcalloc-scratch-tool.json", GCALLOC_TOOL_PATH,
           fragmenting_trace());
  assert_int_equal(WEXITSTATUS(system(cmd)), 3);
  root = json_object_from_file("gcalloc-scratch-tool.json");
  assert_non_null(root);
  assert_true(json_object_get_boolean(member(root, "nothing_fits")));
  assert_false(json_object_get_boolean(member(member(root, "best"), "beats_defaults")));
  assert_null(member(root, "best_pytorch"));
  json_object *furthest = member(root, "furthest");
  assert_true(json_object_get_int64(member(furthest, "operations_replayed")) <
              json_object_get_int64(member(furthest, "operations")));
  assert_true(json_object_get_int64(member(furthest, "shortfall_bytes")) > 0);
  json_object_put(root);
  snprintf(cmd, sizeof cmd, "%s tune %s --capacity 40MiB > gcalloc-scratch-tune.txt", GCALLOC_TOOL_PATH,
           fragmenting_trace());
  assert_int_equal(WEXITSTATUS(system(cmd)), 3);
  text = (char *)read_whole("gcalloc-scratch-tune.txt", &len);
  assert_non_null(text);
  assert_contains(text, "nothing searched fits in 0.039 GiB: the furthest, ");
  assert_contains(text, "the capacity is ");
  assert_null(strstr(text, "paste"));
  free(text);
}

/* The lower bound: 3 MiB and 512 KiB live together need at least 4 MiB of
 * large pages and 2 MiB of small ones; and on random sequences no setting
 * reserves less than the bound at its peak. */
static void test_lower_bound(void **state) {
  (void)state;
  replay_result_t r;
  replay_text("gcalloc-scratch-bound.log", "0 3 3145728\n1 2 524288\n", &r);
  assert_int_equal(r.devices[0].bound_reserved, 6 * MiB);
  replay_result_free(&r);
  trace_t t;
  replay_options_t o;
  static const char *const confs[] = {"", "expandable_segments:True", "expandable_segments:True,stitching:True",
                                      "max_split_size_mb:32", "roundup_power2_divisions:4",
                                      "max_split_size_mb:64,expandable_segments:True"};
  uint64_t seed = 20261128;
  for (int round = 0; round < 20; round++) {
    static char text[64 * 1024];
    size_t n = 0;
    for (int i = 0; i < 300; i++) {
      uint64_t r1 = next_random(&seed), size = (r1 & 1) ? 1 + (r1 >> 8) % (2 * MiB) : 1 + (r1 >> 8) % (96 * MiB);
      int life = 1 + (int)(next_random(&seed) % 60);
      n += (size_t)snprintf(text + n, sizeof text - n, "%d %d %" PRIu64 "\n", i, i + life, size);
    }
    write_file("gcalloc-scratch-bound.log", text);
    assert_int_equal(trace_load("gcalloc-scratch-bound.log", &t), GCA_OK);
    for (size_t k = 0; k < sizeof confs / sizeof confs[0]; k++) {
      o = defaults();
      o.conf = confs[k];
      assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
      const replay_device_t *d = &r.devices[0];
      if (d->bound_reserved > d->peak_reserved || d->bound_reserved < d->peak_requested)
        fail_msg("round %d, %s: bound %" PRIu64 ", peak reserved %" PRIu64 ", requested %" PRIu64, round, confs[k],
                 d->bound_reserved, d->peak_reserved, d->peak_requested);
      replay_result_free(&r);
    }
    trace_free(&t);
  }
}

/* The text of `gcalloc ARGS`, which must exit with `status`. */
static char *tool_text(const char *args, int status) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s %s > gcalloc-scratch-tool.txt 2>&1", GCALLOC_TOOL_PATH, args);
  assert_int_equal(WEXITSTATUS(system(cmd)), status);
  size_t len;
  char *text = (char *)read_whole("gcalloc-scratch-tool.txt", &len);
  assert_non_null(text);
  return text;
}

/* Trace t under `conf` fits on `capacity` and not on 2 MiB less. */
static void assert_least_capacity(const trace_t *t, const char *conf, uint64_t capacity) {
  for (int less = 0; less < 2; less++) {
    replay_options_t o = defaults();
    o.conf = conf;
    o.capacity = capacity - (uint64_t)less * 2 * MiB;
    replay_result_t r;
    assert_int_equal(replay_trace(t, &o, &r), GCA_OK);
    assert_int_equal(r.devices[0].oom, less);
    replay_result_free(&r);
  }
}

/* tune --min-capacity: the smallest device for the defaults, each answer
 * and any setting searched, to 2 MiB: the job fits on it and not on 2 MiB
 * less. */
static void test_smallest_device(void **state) {
  (void)state;
  char args[512];
  snprintf(args, sizeof args, "tune %s --min-capacity", fragmenting_trace());
  json_object *root = tool_json(args), *m = member(root, "min_capacity"), *smallest = member(m, "smallest");
  assert_int_equal(json_object_get_int64(member(m, "bound_reserved_bytes")), 100 * MiB);
  assert_int_equal(json_object_array_length(smallest), 4);
  /* The defaults, PyTorch's best (max_split_size_mb:32), gcalloc's
   * (stitching moves the four free 4 MiB blocks' pages under the 90 MiB:
   * the bound), and the least of any setting (no less than the bound). */
  uint64_t expect[4] = {190 * MiB, 110 * MiB, 100 * MiB, 100 * MiB};
  trace_t t;
  assert_int_equal(trace_load(fragmenting_trace(), &t), GCA_OK);
  assert_string_equal(json_object_get_string(member(json_object_array_get_idx(smallest, 3), "what")), "any setting");
  for (size_t i = 0; i < 4; i++) {
    json_object *s = json_object_array_get_idx(smallest, i);
    uint64_t capacity = (uint64_t)json_object_get_int64(member(s, "capacity_bytes"));
    assert_int_equal(capacity, expect[i]);
    assert_true(json_object_get_boolean(member(s, "monotone")));
    assert_least_capacity(&t, json_object_get_string(member(s, "conf")), capacity);
  }
  trace_free(&t);
  json_object_put(root);
  snprintf(args, sizeof args, "tune %s --min-capacity", fragmenting_trace());
  char *text = tool_text(args, 0);
  assert_contains(text, "the smallest device gcalloc-scratch-fragmenting.log fits on (to 2 MiB");
  assert_contains(text, "  defaults             0.186 GiB  (0.186 GiB without a limit)  (defaults)");
  assert_contains(text, "  any setting          0.098 GiB");
  free(text);
  snprintf(args, sizeof args, "tune %s --min-capacity --capacity 1GiB", fragmenting_trace());
  free(tool_text(args, 2));
}

/* The least device of any setting is not always the answers': on the
 * sample inference snapshot a setting that reserves more without a limit
 * than gcalloc's best fits a smaller device, which "any setting" finds. */
static void test_smallest_device_of_any_setting(void **state) {
  (void)state;
  const char *path = GCALLOC_SOURCE_DIR "/data/snapshots/inference/memory.pickle";
  char args[512];
  snprintf(args, sizeof args, "tune %s --min-capacity", path);
  json_object *root = tool_json(args), *smallest = member(member(root, "min_capacity"), "smallest");
  json_object *best = json_object_array_get_idx(smallest, 2), *any = json_object_array_get_idx(smallest, 3);
  int64_t best_at = json_object_get_int64(member(best, "capacity_bytes"));
  int64_t any_at = json_object_get_int64(member(any, "capacity_bytes"));
  assert_true(any_at < best_at);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_OK);
  assert_least_capacity(&t, json_object_get_string(member(any, "conf")), (uint64_t)any_at);
  trace_free(&t);
  json_object_put(root);
}

/* replay says what happened: where the job fits, that it does and with
 * how much to spare; where it does not, after how many operations, naming
 * the trace's device; a device with nothing on it in one line. */
static void test_replay_says_what_happened(void **state) {
  (void)state;
  char args[512];
  snprintf(args, sizeof args, "replay %s --capacity 110MiB", fragmenting_trace());
  char *text = tool_text(args, 3);
  assert_contains(text, "device 0: 11 operations replayed"); /* (of 14: the twelfth fails) */
  assert_contains(text, "DOES NOT FIT: after 11 operations, the next (94371840 bytes) fails: out of memory.");
  free(text);
  snprintf(args, sizeof args, "replay %s --capacity 110MiB --conf max_split_size_mb:64", fragmenting_trace());
  text = tool_text(args, 0);
  assert_contains(text, "device 0: 14 operations replayed");
  assert_contains(text, "fits in 0.107 GiB: 0.000 GiB to spare at the peak reserved");
  free(text);
  write_file("gcalloc-scratch-two-devices.trace", "# gcalloc trace 1\n"
                                                  "1 7 open 0 sim:devices=2 -\n"
                                                  "2 7 malloc 0 1 0 209715200 1000\n"
                                                  "3 7 free 0 1000 0\n");
  text = tool_text("replay gcalloc-scratch-two-devices.trace --capacity 100MiB", 3);
  assert_contains(text, "\ndevice 0: nothing recorded on it\n");
  assert_contains(text, "\ndevice 1: 0 operations replayed");
  assert_contains(text, "DOES NOT FIT: after 0 operations, the next (209715200 bytes) fails: out of memory. Tried to "
                        "allocate 200.00 MiB. Device 1 has a total capacity of 100.00 MiB");
  free(text);
}

/* A report that cannot be written fails the command, saying why. */
static void test_report_unwritable(void **state) {
  (void)state;
  write_file("gcalloc-scratch-replay.log", "0 2 3000000\n1 3 5000000\n");
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "%s replay gcalloc-scratch-replay.log --report /nonexistent-gcalloc-dir/r.html > /dev/null "
           "2> gcalloc-scratch-report-error.txt",
           GCALLOC_TOOL_PATH);
  assert_int_equal(WEXITSTATUS(system(cmd)), 1);
  FILE *f = fopen("gcalloc-scratch-report-error.txt", "r");
  assert_non_null(f);
  char text[512] = "";
  assert_non_null(fgets(text, sizeof text, f));
  fclose(f);
  assert_contains(text, "cannot write the report /nonexistent-gcalloc-dir/r.html: No such file or directory");
}

/* Every sample: PyTorch's segment events reproduced, one by one, and its
 * reserved peak to the byte (data/README.md). */
static void test_samples_reproduced(void **state) {
  (void)state;
  for (size_t i = 0; i < BIG_SNAPSHOTS; i++) {
    trace_t t;
    assert_int_equal(trace_load(big_snapshot(i), &t), GCA_OK);
    replay_options_t o = defaults();
    replay_result_t r;
    assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
    replay_device_t *d = &r.devices[0];
    assert_true(d->segment_events_recorded > 50);
    assert_int_equal(d->segment_events_matched, d->segment_events_recorded);
    assert_int_equal(d->peak_reserved, (uint64_t)d->recorded_peak_reserved);
    replay_result_free(&r);
    trace_free(&t);
  }
}

/* DeComFL starts empty; SOURCES.txt: peak_res 1.898 GB. gcalloc reproduces
 * every one of PyTorch's segment events and its reserved peak exactly. */
static void test_real_trace_decomfl(void **state) {
  (void)state;
  trace_t t;
  assert_int_equal(trace_load(real_path("ZidongLiu__DeComFL/memory.pickle"), &t), GCA_OK);
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  replay_device_t *d = &r.devices[0];
  assert_int_equal(d->seeded, 0);
  assert_true(fabs((double)d->recorded_peak_reserved - 1.898e9) < 0.5e6);
  assert_int_equal(d->segment_events_recorded, 61);
  assert_int_equal(d->segment_events_matched, 61);
  assert_int_equal(d->peak_reserved, (uint64_t)d->recorded_peak_reserved);
  /* On a 1 GiB device it does not fit, and says why. */
  replay_result_free(&r);
  o.capacity = (uint64_t)1 << 30;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_true(r.devices[0].oom);
  assert_contains(r.devices[0].oom_message, "out of memory. Tried to allocate");
  replay_result_free(&r);
  trace_free(&t);
}

/* The page census at the peak, counted on the way at each new peak
 * (page_census alone), is the one a second run stopped at the peak walks
 * (timeline), field by field, on every real snapshot with expandable
 * segments (Constructor-Sun's own settings, the others turned to them;
 * the inferred empty_cache calls unmap pages) and with garbage collection
 * unmapping more. */
static void test_page_census_on_the_way(void **state) {
  (void)state;
  const char *paths[] = {big_snapshot(2), big_snapshot(1), big_snapshot(0)};
  const char *confs[] = {NULL, "expandable_segments:True",
                         "expandable_segments:True,garbage_collection_threshold:0.6,max_split_size_mb:64,"
                         "per_process_memory_fraction:0.5,stitching:True"};
  uint64_t mapped = 0, free_pages = 0, holes = 0;
  for (size_t k = 0; k < 3; k++) {
    trace_t t;
    assert_int_equal(trace_load(paths[k], &t), GCA_OK);
    for (size_t c = k == 0 ? 0 : 1; c < 3; c++) {
      replay_options_t o = defaults();
      o.conf = confs[c];
      o.page_census = true;
      replay_result_t counted, walked;
      assert_int_equal(replay_trace(&t, &o, &counted), GCA_OK);
      o.timeline = true;
      assert_int_equal(replay_trace(&t, &o, &walked), GCA_OK);
      assert_int_equal(counted.device_count, walked.device_count);
      for (int d = 0; d < counted.device_count; d++) {
        const page_census_t *a = &counted.devices[d].peak_pages, *b = &walked.devices[d].peak_pages;
        assert_int_equal(counted.devices[d].peak_op, walked.devices[d].peak_op);
        assert_int_equal(counted.devices[d].expandable, walked.devices[d].expandable);
        assert_null(a->maps);
        assert_census_counts_equal(a, b);
        mapped += a->mapped_pages;
        free_pages += a->free_pages;
        holes += a->unmapped_pages;
      }
      replay_result_free(&counted);
      replay_result_free(&walked);
    }
    trace_free(&t);
  }
  /* (Counts that were all zero would prove nothing.) */
  assert_true(mapped > 0);
  assert_true(free_pages > 0);
  assert_true(holes > 0);
}

/* Stitching (with its 2 MiB pages and pages moved across the pools) never
 * reserves more than expandable segments alone, device by device, on the
 * big snapshots; on the real ones (and Lin-Mao's log) it is within 1% of
 * the lower bound. */
static void test_stitching_never_above_expandable(void **state) {
  (void)state;
  const char *paths[BIG_SNAPSHOTS + 1];
  size_t n = 0;
  for (size_t i = 0; i < BIG_SNAPSHOTS; i++) paths[n++] = big_snapshot(i);
  if (real_traces_dir()) paths[n++] = real_path("Lin-Mao__allocatorSim/alexnet_train.log");
  size_t devices = 0, moved = 0;
  for (size_t k = 0; k < n; k++) {
    trace_t t;
    assert_int_equal(trace_load(paths[k], &t), GCA_OK);
    replay_options_t o = defaults();
    o.conf = "expandable_segments:True";
    replay_result_t alone, stitched;
    assert_int_equal(replay_trace(&t, &o, &alone), GCA_OK);
    o.conf = "expandable_segments:True,stitching:True";
    assert_int_equal(replay_trace(&t, &o, &stitched), GCA_OK);
    assert_int_equal(alone.device_count, stitched.device_count);
    for (int d = 0; d < alone.device_count; d++) {
      const replay_device_t *a = &alone.devices[d], *s = &stitched.devices[d];
      if (!a->events) continue;
      printf("%s device %d: expandable %.3f GiB, stitching %.3f GiB, bound %.3f GiB (+%.2f%%), %" PRIu64
             " pages moved after %" PRIu64 " waits\n", paths[k], a->device, a->peak_reserved / 1073741824.0,
             s->peak_reserved / 1073741824.0, s->bound_reserved / 1073741824.0,
             100.0 * ((double)s->peak_reserved / (double)s->bound_reserved - 1), s->pages_moved, s->stitch_waits);
      assert_true(s->peak_reserved <= a->peak_reserved);
      if (real_traces_dir()) assert_true((double)s->peak_reserved <= 1.01 * (double)s->bound_reserved);
      devices++;
      moved += s->pages_moved;
    }
    replay_result_free(&alone);
    replay_result_free(&stitched);
    trace_free(&t);
  }
  assert_true(devices >= 3);
  assert_true(moved > 0); /* (a stitching that never moved would prove nothing) */
}

/* cranberrii starts with 1.096 GB live (SOURCES.txt); peak_res 6.472 GB. */
static void test_real_trace_seeded(void **state) {
  (void)state;
  trace_t t;
  assert_int_equal(trace_load(real_path("cranberrii__ftcourse/memory_snapshot.pickle"), &t), GCA_OK);
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  replay_device_t *d = &r.devices[0];
  assert_int_equal(d->seeded, 622);
  assert_int_equal(d->start_segments, 63);
  assert_true(fabs((double)d->recorded_peak_reserved - 6.472e9) < 0.5e6);
  /* With PyTorch's start segments made as recorded (1,336 MiB for 1,053
   * MiB live), every decision of the record is made, and no other. */
  assert_int_equal(d->segment_events_recorded, 152);
  assert_int_equal(d->segment_events_matched, 152);
  assert_int_equal(d->segment_events_replayed, 152);
  assert_int_equal(d->peak_reserved, (uint64_t)d->recorded_peak_reserved);
  replay_result_free(&r);
  trace_free(&t);
}

/* The tool's JSON carries the documented keys. */
static void test_tool_json(void **state) {
  (void)state;
  char args[1024];
  snprintf(args, sizeof args, "replay %s", big_snapshot(0));
  json_object *root = tool_json(args), *devices, *v;
  assert_true(json_object_object_get_ex(root, "devices", &devices));
  json_object *d0 = json_object_array_get_idx(devices, 0);
  assert_true(json_object_object_get_ex(root, "end_to_end_events_per_second", &v));
  assert_true(json_object_get_double(v) > 0);
  static const char *const keys[] = {"events", "peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                                     "recorded_peak_reserved_bytes", "device_allocs", "device_frees", "oom",
                                     "events_per_second", "segment_events_matched", "segment_events_recorded",
                                     "seeded", "start_segments"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) assert_true(json_object_object_get_ex(d0, keys[i], &v));
  json_object_object_get_ex(d0, "oom", &v);
  assert_null(v);
  assert_true(json_object_object_get_ex(d0, "pages", &v));
  assert_null(v); /* no expandable segments */
  json_object_put(root);
  /* With expandable segments: the pages, and at the peak the mapped bytes are the reserved ones. */
  snprintf(args, sizeof args, "replay %s --conf expandable_segments:True", big_snapshot(0));
  root = tool_json(args);
  json_object_object_get_ex(root, "devices", &devices);
  d0 = json_object_array_get_idx(devices, 0);
  json_object *pages, *at_peak;
  assert_true(json_object_object_get_ex(d0, "pages", &pages) && pages);
  assert_true(json_object_object_get_ex(pages, "at_peak", &at_peak) && at_peak);
  json_object_object_get_ex(d0, "peak_reserved_bytes", &v);
  int64_t peak = json_object_get_int64(v);
  json_object_object_get_ex(at_peak, "mapped_bytes", &v);
  assert_int_equal(json_object_get_int64(v), peak);
  json_object_object_get_ex(at_peak, "mapped_pages", &v);
  int64_t mapped_at_peak = json_object_get_int64(v);
  json_object_object_get_ex(pages, "mapped", &v);
  assert_true(mapped_at_peak > 0 && mapped_at_peak <= json_object_get_int64(v));
  json_object_object_get_ex(at_peak, "ranges", &v);
  assert_int_equal(json_object_get_int64(v), 2); /* one per pool, one stream */
  json_object_put(root);
  /* A capacity too small: exit status 3, oom filled in. */
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s replay %s --capacity 512MiB --json > /dev/null", GCALLOC_TOOL_PATH, big_snapshot(0));
  int status = system(cmd);
  assert_int_equal(WEXITSTATUS(status), 3);
  snprintf(cmd, sizeof cmd, "%s replay /nonexistent.pickle 2>/dev/null", GCALLOC_TOOL_PATH);
  assert_int_equal(WEXITSTATUS(system(cmd)), 1);
}

/* The start state and the operations, against the rule worked out by hand
 * on random traces of two devices, with the odd things a record can hold
 * (a free of what was never allocated, two frees, an alloc at a live
 * address, free_requested without free_completed, duplicate and inactive
 * final blocks): a literal walk back from the final blocks (going back, an
 * alloc takes its address out, a release puts it in if absent) gives the
 * seeds, and a forward run of the plan's rule (alloc: a new block at the
 * address, the old one left allocated; free_completed: frees the block
 * there, if any) the requested bytes; the replay's seeded count and peak
 * requested must be those, and the seeds must be made in address order
 * (the requested bytes after each, from the timeline). The addresses differ
 * in every byte, as the plan's sort of the seeds goes byte by byte. */
typedef struct ref_block {
  uint64_t addr, size;
  bool live;
} ref_block_t;

static ref_block_t *ref_find(ref_block_t *blocks, size_t n, uint64_t addr) {
  for (size_t i = 0; i < n; i++)
    if (blocks[i].live && blocks[i].addr == addr) return &blocks[i];
  return NULL;
}

static void test_plan_matches_walk_back(void **state) {
  (void)state;
  uint64_t seed = 0x91a;
  for (int round = 0; round < 400; round++) {
    trace_t t = {0};
    size_t n = next_random(&seed) % 80, addrs = 2 + next_random(&seed) % 6;
    uint64_t addr_of[8];
    for (size_t i = 0; i < 8; i++) addr_of[i] = (next_random(&seed) << 3 ^ next_random(&seed) << 35) | i;
    t.events = calloc(n + 1, sizeof *t.events);
    t.count = n;
    t.device_count = 2;
    for (size_t i = 0; i < n; i++) {
      trace_event_t *e = &t.events[i];
      int r = (int)(next_random(&seed) % 10);
      e->device = (int)(next_random(&seed) % 2);
      e->action = r < 4 ? TA_ALLOC : r < 7 ? TA_FREE_COMPLETED : r < 9 ? TA_FREE_REQUESTED : TA_OOM;
      e->addr = addr_of[next_random(&seed) % addrs];
      e->size = (1 + next_random(&seed) % 8) << 9;
      e->time_us = -1;
    }
    t.final_block_count = next_random(&seed) % 5;
    t.final_blocks = calloc(t.final_block_count + 1, sizeof *t.final_blocks);
    for (size_t i = 0; i < t.final_block_count; i++)
      t.final_blocks[i] = (trace_block_t){(int)(next_random(&seed) % 2), addr_of[next_random(&seed) % addrs], 1 << 20,
                                          (1 + next_random(&seed) % 8) << 9, 0, next_random(&seed) % 3 != 0};
    t.has_segment_state = true;
    replay_options_t o = defaults();
    o.match_segments = false;
    o.timeline = true;
    replay_result_t r;
    assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
    for (int d = 0; d < 2; d++) {
      ref_block_t blocks[256];
      size_t nb = 0;
      /* The walk back. */
      for (size_t i = 0; i < t.final_block_count; i++) {
        const trace_block_t *b = &t.final_blocks[i];
        if (b->device != d || !b->active) continue;
        ref_block_t *had = ref_find(blocks, nb, b->addr);
        if (had) had->size = b->requested;
        else blocks[nb++] = (ref_block_t){b->addr, b->requested, true};
      }
      for (size_t k = n; k-- > 0;) {
        const trace_event_t *e = &t.events[k];
        if (e->device != d) continue;
        ref_block_t *there = ref_find(blocks, nb, e->addr);
        if (e->action == TA_ALLOC && there) there->live = false;
        else if ((e->action == TA_FREE_COMPLETED || e->action == TA_FREE_REQUESTED) && !there)
          blocks[nb++] = (ref_block_t){e->addr, e->size, true};
      }
      size_t seeds = 0;
      uint64_t requested = 0, peak = 0;
      ref_block_t live[256];
      size_t nl = 0;
      for (size_t i = 0; i < nb; i++)
        if (blocks[i].live) {
          seeds++;
          requested += blocks[i].size;
          live[nl++] = blocks[i];
        }
      peak = requested;
      /* Forward. */
      for (size_t k = 0; k < n; k++) {
        const trace_event_t *e = &t.events[k];
        if (e->device != d) continue;
        ref_block_t *there = ref_find(live, nl, e->addr);
        if (e->action == TA_ALLOC) {
          if (there) there->live = false; /* left allocated: its bytes stay counted */
          live[nl++] = (ref_block_t){e->addr, e->size, true};
          requested += e->size;
        } else if (e->action == TA_FREE_COMPLETED && there) {
          there->live = false;
          requested -= there->size;
        }
        if (requested > peak) peak = requested;
      }
      const replay_device_t *dv = NULL;
      for (int i = 0; i < r.device_count; i++)
        if (r.devices[i].device == d) dv = &r.devices[i];
      if (!dv) {
        assert_int_equal(seeds, 0);
        continue;
      }
      assert_int_equal(dv->seeded, seeds);
      assert_int_equal(dv->peak_requested, peak);
      /* The seeds in address order: the requested bytes after each. */
      ref_block_t sorted[256];
      size_t ns = 0;
      for (size_t i = 0; i < nb; i++) {
        if (!blocks[i].live) continue;
        size_t at = ns++;
        for (; at > 0 && sorted[at - 1].addr > blocks[i].addr; at--) sorted[at] = sorted[at - 1];
        sorted[at] = blocks[i];
      }
      uint64_t sum = 0;
      assert_true(dv->timeline_count >= ns);
      for (size_t i = 0; i < ns; i++) {
        sum += sorted[i].size;
        assert_int_equal(dv->requested_at[i], sum);
      }
    }
    replay_result_free(&r);
    trace_free(&t);
  }
}

/* The segment matching's LCS with its common prefix and suffix taken first
 * gives what the whole table gives, on seeded random logs that agree at
 * the ends, in the middle, or nowhere; and two logs of 20,000 identical
 * events cost a pass (the table would be 400 million cells). */
static size_t full_table_lcs(const seg_event_t *x, size_t n, const seg_event_t *y, size_t m) {
  size_t *t = calloc((n + 1) * (m + 1), sizeof *t);
  assert_non_null(t);
  for (size_t i = 1; i <= n; i++)
    for (size_t j = 1; j <= m; j++) {
      size_t up = t[(i - 1) * (m + 1) + j], left = t[i * (m + 1) + j - 1];
      bool same = x[i - 1].alloc == y[j - 1].alloc && x[i - 1].size == y[j - 1].size;
      t[i * (m + 1) + j] = same ? t[(i - 1) * (m + 1) + j - 1] + 1 : up > left ? up : left;
    }
  size_t result = t[n * (m + 1) + m];
  free(t);
  return result;
}

static void test_segment_matching(void **state) {
  (void)state;
  uint64_t seed = 0x5e9;
  seg_event_t x[64], y[64];
  for (int round = 0; round < 2000; round++) {
    size_t n = next_random(&seed) % 40, m = next_random(&seed) % 40;
    for (size_t i = 0; i < n; i++) x[i] = (seg_event_t){next_random(&seed) & 1, (next_random(&seed) % 3 + 1) << 20};
    for (size_t j = 0; j < m; j++) y[j] = (seg_event_t){next_random(&seed) & 1, (next_random(&seed) % 3 + 1) << 20};
    /* Often the same ends, as a replay close to PyTorch gives. */
    size_t shared = next_random(&seed) % 8;
    for (size_t k = 0; k < shared && k < n && k < m; k++) {
      y[k] = x[k];
      if (round % 2) y[m - 1 - k] = x[n - 1 - k];
    }
    assert_int_equal(replay_segment_lcs(x, n, y, m), full_table_lcs(x, n, y, m));
  }
  size_t big = 20000;
  seg_event_t *a = malloc(big * sizeof *a);
  assert_non_null(a);
  for (size_t i = 0; i < big; i++) a[i] = (seg_event_t){i % 2 == 0, (i % 7 + 1) << 21};
  assert_int_equal(replay_segment_lcs(a, big, a, big), big);
  assert_int_equal(replay_segment_lcs(a, big, a + 1, big - 1), big - 1);
  free(a);
}

/* `gcalloc COMMAND ARGS`, its output in gcalloc-scratch-cli.out and .err:
 * its exit status. */
static int run_tool(const char *args) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s %s > gcalloc-scratch-cli.out 2> gcalloc-scratch-cli.err", GCALLOC_TOOL_PATH, args);
  int status = system(cmd);
  assert_true(WIFEXITED(status));
  return WEXITSTATUS(status);
}

static char *cli_output(const char *which) {
  char path[64];
  snprintf(path, sizeof path, "gcalloc-scratch-cli.%s", which);
  size_t len;
  char *text = (char *)read_whole(path, &len);
  assert_non_null(text);
  return text;
}

/* The command line: every command's --help (on stdout, exit status 0, the
 * same as `gcalloc help COMMAND`), and what is wrong in one named on
 * stderr with exit status 2, before anything is read or run. */
static void test_tool_command_line(void **state) {
  (void)state;
  static const char *const commands[] = {"demo", "bench", "bench-streams", "bench-replay", "bench-cuda", "replay",
                                         "tune"};
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
    char args[128], usage[128];
    snprintf(args, sizeof args, "%s --help", commands[i]);
    assert_int_equal(run_tool(args), 0);
    char *help = cli_output("out");
    snprintf(usage, sizeof usage, "usage: gcalloc %s ", commands[i]);
    assert_true(strncmp(help, usage, strlen(usage)) == 0);
    assert_contains(help, "-h, --help");
    snprintf(args, sizeof args, "help %s", commands[i]);
    assert_int_equal(run_tool(args), 0);
    char *again = cli_output("out");
    assert_string_equal(help, again);
    free(help);
    free(again);
  }
  static const struct {
    const char *args, *message;
  } bad[] = {
      {"replay", "gcalloc replay: which TRACE? (none given)"},
      {"replay a.pickle b.pickle", "one TRACE at a time ('a.pickle', then 'b.pickle')"},
      {"replay t.pickle --conf", "--conf needs a value (--conf STRING)"},
      {"replay t.pickle --bogus", "unknown option '--bogus'"},
      {"replay t.pickle --report", "--report needs a value (--report FILE.html)"},
      {"tune t.pickle --device 256", "--device '256' is not a whole number from 0 to 255"},
      {"tune t.pickle --device -1", "--device '-1' is not a whole number from 0 to 255"},
      {"tune t.pickle --capacity 0", "--capacity '0' is not a size like 24GiB"},
      {"tune t.pickle --capacity 12XB", "--capacity '12XB' is not a size like 24GiB"},
      {"bench-replay --runs 0", "--runs '0' is not a whole number from 1 to 1000000"},
      {"bench-replay --runs 5x", "--runs '5x' is not a whole number from 1 to 1000000"},
      {"bench-replay --idle nan", "--idle 'nan' is not a number of seconds from 0 to 3600"},
      {"bench-replay --idle -1", "--idle '-1' is not a number of seconds from 0 to 3600"},
      {"demo --steps 12x", "--steps '12x' is not a whole number from 1 to 100000"},
      {"demo --seed -3", "--seed '-3' is not a whole number from 0 to"},
      {"bench-streams extra", "gcalloc bench-streams: takes no operand ('extra' given)"},
      {"bench-cuda --quick", "gcalloc bench-cuda: unknown option '--quick'"},
      {"help nope", "gcalloc help: no command 'nope'"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = run_tool(bad[i].args);
    char *err = cli_output("err");
    if (rc != 2) fprintf(stderr, "gcalloc %s: exit status %d, stderr: %s\n", bad[i].args, rc, err);
    assert_int_equal(rc, 2);
    assert_contains(err, bad[i].message);
    free(err);
  }
  /* "-" is standard input: a file, or a pipe (here of an xz-compressed
   * gcalloc trace, its seven events). */
  char args[512];
  {
    snprintf(args, sizeof args, "replay - --json < %s", big_snapshot(0));
    assert_int_equal(run_tool(args), 0);
    char *out = cli_output("out");
    assert_contains(out, "\"trace\": \"/dev/stdin\"");
    assert_contains(out, real_traces_dir() ? "\"trace_events\": 23105" : "\"trace_events\": 11128");
    free(out);
  }
  snprintf(args, sizeof args, "cat %s/tests/fuzz/text-seeds/gcalloc.trace.xz | %s replay - --json > gcalloc-scratch-cli.out",
           GCALLOC_SOURCE_DIR, GCALLOC_TOOL_PATH);
  assert_int_equal(system(args), 0);
  char *out = cli_output("out");
  assert_contains(out, "\"trace_events\": 7,");
  free(out);
  /* A snapshot whose segments and segment events add up to nothing
   * reserved: PyTorch's recorded 0 is shown, with no ratio to it (it was
   * "gcalloc / PyTorch = 0.000"). */
  static const char no_reserved[] =
      "\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02X\x0d\x00\x00\x00"
      "device_tracesq\x03]q\x04]q\x05}q\x06(X\x06\x00\x00\x00" "actionq\x07X\x05\x00\x00\x00"
      "allocq\x08X\x04\x00\x00\x00"
      "addrq\x09K\x01X\x04\x00\x00\x00sizeq\x0aM\x00\x02X\x06\x00\x00\x00streamq\x0bK\x00uaau.";
  FILE *f = fopen("gcalloc-scratch-cli.pickle", "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(no_reserved, 1, sizeof no_reserved - 1, f), sizeof no_reserved - 1);
  assert_int_equal(fclose(f), 0);
  assert_int_equal(run_tool("replay gcalloc-scratch-cli.pickle"), 0);
  out = cli_output("out");
  assert_contains(out, "PyTorch reserved      0 GiB  (recorded: no segment at the end, none allocated in the record)");
  assert_true(strstr(out, "gcalloc / PyTorch") == NULL);
  free(out);
  assert_int_equal(run_tool("replay gcalloc-scratch-cli.pickle --json"), 0);
  out = cli_output("out");
  assert_contains(out, "\"recorded_peak_reserved_bytes\": 0,");
  free(out);
  /* Its report draws no PyTorch line (a flat one at zero), and says why. */
  assert_int_equal(run_tool("replay gcalloc-scratch-cli.pickle --report gcalloc-scratch-cli.html"), 0);
  size_t html_len;
  char *html = (char *)read_whole("gcalloc-scratch-cli.html", &html_len);
  assert_non_null(html);
  assert_contains(html, "\"recorded\": null");
  assert_contains(html, "\"recorded_peak_reserved\": 0");
  assert_contains(html, "none (no segment in the record)");
  free(html);
  remove("gcalloc-scratch-cli.html");
  remove("gcalloc-scratch-cli.pickle");
  /* --help wins over what else is given. */
  assert_int_equal(run_tool("replay --bogus --help"), 0);
  char *help = cli_output("out");
  assert_contains(help, "usage: gcalloc replay TRACE");
  free(help);
  remove("gcalloc-scratch-cli.out");
  remove("gcalloc-scratch-cli.err");
}

/* A snapshot's call stacks, read when asked (trace_load_options.stacks):
 * each alloc event's stack as tests/data/make_frames_snapshot.py made it
 * (Python frames alone where there are any, the capturing frames left
 * out, 32 frames at most, a Windows path's last component, equal stacks
 * one), the events the same as without them; and at the replay's peak the
 * live blocks' origins, a block live before recording marked so. On the
 * real snapshots too: the same events and replay either way. */
static void expect_same_trace_with_stacks(const char *path, size_t *stacks) {
  trace_t plain, with;
  trace_load_options_t lo = {.stacks = true};
  assert_int_equal(trace_load(path, &plain), GCA_OK);
  assert_int_equal(trace_load_with(path, &lo, &with), GCA_OK);
  assert_true(trace_equal(&plain, &with));
  assert_null(plain.event_stacks);
  assert_int_equal(plain.stack_count, 0);
  *stacks = with.stack_count;
  for (size_t i = 0; with.event_stacks && i < with.count; i++) {
    assert_true(with.event_stacks[i] < with.stack_count);
    if (with.event_stacks[i]) assert_int_equal(with.events[i].action, TA_ALLOC);
  }
  trace_free(&plain);
  trace_free(&with);
}

static void test_call_stacks(void **state) {
  (void)state;
  const char *path = GCALLOC_SOURCE_DIR "/tests/data/snapshot_frames.pickle";
  trace_t t;
  trace_load_options_t lo = {.stacks = true};
  assert_int_equal(trace_load_with(path, &lo, &t), GCA_OK);
  assert_int_equal(t.count, 189);
  assert_non_null(t.event_stacks);
  assert_int_equal(t.stack_count, 5); /* (none, A and D's, B's, C's, E's) */
  assert_null(t.stacks[0]);
  uint32_t at[64]; /* the alloc events' stacks in order: A, B, C, D, then E's */
  size_t allocs = 0;
  for (size_t i = 0; i < t.count; i++) {
    if (t.events[i].action != TA_ALLOC) {
      assert_int_equal(t.event_stacks[i], 0); /* (only allocations' are kept) */
      continue;
    }
    assert_true(allocs < 64);
    at[allocs++] = t.event_stacks[i];
  }
  assert_int_equal(allocs, 64);
  assert_string_equal(t.stacks[at[0]], "train.py:42:step\nmain.py:7:<module>");
  assert_string_equal(t.stacks[at[1]], "??:0:at::native::empty_cuda\napp.cpp:12:main");
  const char *deep = t.stacks[at[2]];
  assert_true(!strncmp(deep, "deep.py:0:f0\ndeep.py:1:f1\n", 26));
  assert_contains(deep, "\ndeep.py:31:f31\n... 8 more frames");
  assert_null(strstr(deep, "f32"));
  assert_int_equal(at[3], at[0]); /* equal frames in other objects */
  assert_string_equal(t.stacks[at[4]], "cache.py:3:evict");
  for (size_t k = 5; k < allocs; k++) assert_int_equal(at[k], at[4]);

  replay_options_t o = defaults();
  o.timeline = true;
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  const replay_device_t *d = &r.devices[0];
  assert_non_null(d->peak_snapshot);
  size_t allocated = 0, before = 0, found[5] = {0};
  for (size_t i = 0; i < d->peak_snapshot->segment_count; i++) {
    const gca_snapshot_segment_t *g = &d->peak_snapshot->segments[i];
    for (size_t b = 0; b < g->block_count; b++) {
          const replay_origin_t *origin = replay_origin_at(d, g->blocks[b].address);
      if (g->blocks[b].state != GCA_BLOCK_ACTIVE_ALLOCATED) {
        assert_null(origin);
        continue;
      }
      allocated++;
      assert_non_null(origin);
      if (origin->stack == REPLAY_BEFORE_RECORDING) {
        before++;
        assert_int_equal(g->blocks[b].requested_size, 512 << 10);
      } else {
        assert_true(origin->stack > 0 && origin->stack < 5);
        found[origin->stack]++;
      }
    }
  }
  /* S, A, B, C, D live at the peak (E came and went after it). */
  assert_int_equal(allocated, 5);
  assert_int_equal(before, 1);
  assert_int_equal(found[at[0]], 2);
  assert_int_equal(found[at[1]], 1);
  assert_int_equal(found[at[2]], 1);
  replay_result_free(&r);
  trace_free(&t);

  /* Over the limit: read without them, and said so. */
  lo.stacks_limit = 1024;
  assert_int_equal(trace_load_with(path, &lo, &t), GCA_OK);
  assert_null(t.event_stacks);
  assert_int_equal(t.stack_count, 0);
  size_t file_len;
  free(read_whole(path, &file_len));
  assert_int_equal(t.stacks_left_out, file_len);
  trace_free(&t);
  lo.stacks_limit = file_len;
  assert_int_equal(trace_load_with(path, &lo, &t), GCA_OK);
  assert_int_equal(t.stack_count, 5);
  assert_int_equal(t.stacks_left_out, 0);
  trace_free(&t);
  /* A page holds 2,000 stacks at most: 2,100 blocks live at the peak from
   * stacks of their own, 100 drawn without. */
  char args[512];
  snprintf(args, sizeof args, "replay %s --report gcalloc-scratch-stacks.html",
           GCALLOC_SOURCE_DIR "/tests/data/snapshot_many_stacks.pickle");
  assert_int_equal(run_tool(args), 0);
  size_t page_len;
  char *page = (char *)read_whole("gcalloc-scratch-stacks.html", &page_len);
  assert_non_null(page);
  assert_contains(page, "\"stacks_unnamed\": 100");
  size_t named = 0;
  for (const char *c = strstr(page, "\"stacks\": {"); c && (c = strstr(c, ":layer")); c++) named++;
  assert_int_equal(named, 2000);
  free(page);
  remove("gcalloc-scratch-stacks.html");
  /* The tool: --stacks is --report's. */
  snprintf(args, sizeof args, "replay %s --stacks", path);
  assert_int_equal(run_tool(args), 2);
  char *err = cli_output("err");
  assert_contains(err, "--stacks reads the call stacks for --report");
  free(err);

  /* Without stacks: the same trace, no stacks; and on the samples and
   * real snapshots (frames shared through the memo, records and dicts). */
  size_t n;
  expect_same_trace_with_stacks(path, &n);
  assert_int_equal(n, 5);
  expect_same_trace_with_stacks(GCALLOC_SOURCE_DIR "/tests/data/snapshot_small.pickle", &n);
  assert_true(n > 1);
  /* (Odd forms: escapes in strings, containers shared across entries.) */
  expect_same_trace_with_stacks(GCALLOC_SOURCE_DIR "/tests/data/snapshot_escape.pickle", &n);
  expect_same_trace_with_stacks(GCALLOC_SOURCE_DIR "/tests/data/snapshot_shared.pickle", &n);
  expect_same_trace_with_stacks(GCALLOC_SOURCE_DIR "/data/snapshots/training/memory.pickle", &n);
  assert_int_equal(n, 0); /* (recorded without frames) */
  if (real_traces_dir()) {
    const char *real[] = {"ZidongLiu__DeComFL/memory.pickle", "cranberrii__ftcourse/memory_snapshot.pickle",
                          "Constructor-Sun__code_location/memory_snapshot.pickle"};
    for (size_t i = 0; i < 3; i++) {
      expect_same_trace_with_stacks(real_path(real[i]), &n);
      assert_true(n > 1);
    }
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_allocsim_lines), cmocka_unit_test(test_allocsim_order),        cmocka_unit_test(test_gcalloc_trace_format),
      cmocka_unit_test(test_gcalloc_trace_pending_frees),
      cmocka_unit_test(test_gcalloc_trace_allocators), cmocka_unit_test(test_report_unwritable),
      cmocka_unit_test(test_own_snapshot_round_trip), cmocka_unit_test(test_start_as_recorded),
      cmocka_unit_test(test_start_as_recorded_random),
      cmocka_unit_test(test_samples_reproduced),   cmocka_unit_test(test_tool_json),
      cmocka_unit_test(test_stream_numbers),        cmocka_unit_test(test_rmm_csv),               cmocka_unit_test(test_timeline),
      cmocka_unit_test(test_progress),               cmocka_unit_test(test_segment_matching),
      cmocka_unit_test(test_plan_matches_walk_back),     cmocka_unit_test(test_page_census_on_the_way),
      cmocka_unit_test(test_devices_in_parallel),              cmocka_unit_test(test_tune),
      cmocka_unit_test(test_tune_under_a_capacity),      cmocka_unit_test(test_replay_says_what_happened),
      cmocka_unit_test(test_lower_bound),                cmocka_unit_test(test_smallest_device),
      cmocka_unit_test(test_smallest_device_of_any_setting),
      cmocka_unit_test(test_plans_reused),
      cmocka_unit_test(test_tool_command_line),          cmocka_unit_test(test_stitching_never_above_expandable),
      cmocka_unit_test(test_call_stacks),
  };
  /* The real-trace group (GCALLOC_REAL_TRACES: CTest's test_replay_real_traces, registered where
   * ../shared/traces is): the real snapshots' figures, and the checks on big snapshots made on them. */
  const struct CMUnitTest real[] = {
      cmocka_unit_test(test_real_trace_decomfl), cmocka_unit_test(test_real_trace_seeded),
      cmocka_unit_test(test_tool_json),          cmocka_unit_test(test_timeline),
      cmocka_unit_test(test_page_census_on_the_way), cmocka_unit_test(test_tune),
      cmocka_unit_test(test_plans_reused),       cmocka_unit_test(test_tool_command_line),
      cmocka_unit_test(test_stitching_never_above_expandable), cmocka_unit_test(test_call_stacks),
  };
  if (real_traces_dir()) return cmocka_run_group_tests_name("real traces", real, NULL, NULL);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
