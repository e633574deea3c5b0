/* Replay (label `replay`): traces built in the test (allocatorSim lines,
 * gcalloc's own trace format, a snapshot gcalloc wrote itself with
 * allocations live before recording began), the real traces of
 * ../shared/traces against the figures SOURCES.txt gives for them, the
 * capacity check, and the tool's JSON. */
#include <json-c/json.h>
#include <math.h>

#include "helpers.h"
#include "export/replay.h"

static replay_options_t defaults(void) { return (replay_options_t){.device = -1, .infer_empty_cache = true, .match_segments = true}; }

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

/* allocatorSim: "<alloc_op> <free_op> <size>"; live at op 2: a and b. */
static void test_allocsim_lines(void **state) {
  (void)state;
  write_file("/tmp/gcalloc-replay.log", "0 2 3000000\n1 3 5000000\n2 4 1000\n");
  trace_t t;
  assert_int_equal(trace_load("/tmp/gcalloc-replay.log", &t), GCA_OK);
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  assert_int_equal(r.device_count, 1);
  assert_int_equal(r.devices[0].events, 6);
  assert_int_equal(r.devices[0].peak_requested, 8000000); /* 3 MB + 5 MB */
  assert_int_equal(r.devices[0].recorded_peak_reserved, -1);
  assert_false(r.devices[0].oom);
  replay_result_free(&r);
  trace_free(&t);
}

/* gcalloc's own trace: frees take the device of their allocation. */
static void test_gcalloc_trace_format(void **state) {
  (void)state;
  write_file("/tmp/gcalloc-replay.trace", "# gcalloc trace 1\n"
                                           "1 7 open 0 sim:devices=2 -\n"
                                           "2 7 malloc 0 1 100 4096 200000000000\n"
                                           "3 7 malloc 0 1 100 8192 200000001000\n"
                                           "4 7 free 0 200000000000 0\n"
                                           "5 7 malloc 0 1 100 0 0\n"
                                           "6 7 free 0 deadbeef -5\n"
                                           "7 7 empty_cache 0 1 0\n"
                                           "8 7 close 0\n");
  trace_t t;
  assert_int_equal(trace_load("/tmp/gcalloc-replay.trace", &t), GCA_OK);
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
  for (int i = 0; i < 3000; i++) {
    int k = (int)(next_random(&rng) % 64);
    if (live[k]) {
      gca_free(a, live[k]);
      live[k] = NULL;
    } else {
      live[k] = gca_malloc(a, (size_t)1 << (9 + next_random(&rng) % 18), 0, 0);
    }
    if (i == 1500) gca_empty_cache(a, 0);
  }
  gca_free(a, early[1]);
  int64_t reserved_peak = stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].peak;
  gca_snapshot_t *s;
  assert_int_equal(gca_snapshot_take(a, &s), GCA_OK);
  assert_int_equal(gca_snapshot_write(s, "/tmp/gcalloc-replay.pickle", GCA_SNAPSHOT_PICKLE), GCA_OK);
  gca_snapshot_free(s);
  trace_t t;
  assert_int_equal(trace_load("/tmp/gcalloc-replay.pickle", &t), GCA_OK);
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

static bool have_traces(void) {
  FILE *f = fopen(GCALLOC_TRACES_DIR "/SOURCES.txt", "r");
  if (f) fclose(f);
  return f != NULL;
}

/* DeComFL starts empty; SOURCES.txt: peak_res 1.898 GB. gcalloc reproduces
 * every one of PyTorch's segment events and its reserved peak exactly. */
static void test_real_trace_decomfl(void **state) {
  (void)state;
  if (!have_traces()) skip();
  trace_t t;
  assert_int_equal(trace_load(GCALLOC_TRACES_DIR "/ZidongLiu__DeComFL/memory.pickle", &t), GCA_OK);
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

/* cranberrii starts with 1.096 GB live (SOURCES.txt); peak_res 6.472 GB. */
static void test_real_trace_seeded(void **state) {
  (void)state;
  if (!have_traces()) skip();
  trace_t t;
  assert_int_equal(trace_load(GCALLOC_TRACES_DIR "/cranberrii__ftcourse/memory_snapshot.pickle", &t), GCA_OK);
  replay_options_t o = defaults();
  replay_result_t r;
  assert_int_equal(replay_trace(&t, &o, &r), GCA_OK);
  replay_device_t *d = &r.devices[0];
  assert_true(d->seeded > 0);
  assert_true(fabs((double)d->recorded_peak_reserved - 6.472e9) < 0.5e6);
  assert_true(d->segment_events_matched * 10 >= d->segment_events_recorded * 9);
  replay_result_free(&r);
  trace_free(&t);
}

/* The tool's JSON carries the documented keys. */
static void test_tool_json(void **state) {
  (void)state;
  if (!have_traces()) skip();
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s replay %s/ZidongLiu__DeComFL/memory.pickle --json > /tmp/gcalloc-replay.json",
           GCALLOC_TOOL_PATH, GCALLOC_TRACES_DIR);
  assert_int_equal(system(cmd), 0);
  json_object *root = json_object_from_file("/tmp/gcalloc-replay.json"), *devices, *v;
  assert_non_null(root);
  assert_true(json_object_object_get_ex(root, "devices", &devices));
  json_object *d0 = json_object_array_get_idx(devices, 0);
  static const char *const keys[] = {"events", "peak_requested_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                                     "recorded_peak_reserved_bytes", "device_allocs", "device_frees", "oom",
                                     "events_per_second", "segment_events_matched", "segment_events_recorded"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) assert_true(json_object_object_get_ex(d0, keys[i], &v));
  json_object_object_get_ex(d0, "oom", &v);
  assert_null(v);
  json_object_put(root);
  /* A capacity too small: exit status 3, oom filled in. */
  snprintf(cmd, sizeof cmd, "%s replay %s/ZidongLiu__DeComFL/memory.pickle --capacity 512MiB --json > /dev/null",
           GCALLOC_TOOL_PATH, GCALLOC_TRACES_DIR);
  int status = system(cmd);
  assert_int_equal(WEXITSTATUS(status), 3);
  snprintf(cmd, sizeof cmd, "%s replay /nonexistent.pickle 2>/dev/null", GCALLOC_TOOL_PATH);
  assert_int_equal(WEXITSTATUS(system(cmd)), 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_allocsim_lines),        cmocka_unit_test(test_gcalloc_trace_format),
      cmocka_unit_test(test_own_snapshot_round_trip), cmocka_unit_test(test_real_trace_decomfl),
      cmocka_unit_test(test_real_trace_seeded),     cmocka_unit_test(test_tool_json),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
