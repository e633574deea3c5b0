/* The configuration string: every key, every error, precedence of the three
 * environment variables, all-or-nothing application, warnings. */
#include <math.h>
#include <unistd.h>

#include "helpers.h"

static log_capture_t logs;

static int setup(void **state) {
  (void)state;
  memset(&logs, 0, sizeof logs);
  gca_set_log_handler(capture_log, &logs);
  unsetenv("GCALLOC_ALLOC_CONF");
  unsetenv("PYTORCH_ALLOC_CONF");
  unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  return 0;
}

static int teardown(void **state) {
  (void)state;
  gca_set_log_handler(NULL, NULL);
  return 0;
}

static config_t apply_ok(const char *text) {
  config_t c;
  gca__config_defaults(&c);
  int rc = gca__config_apply(&c, text, NULL);
  if (rc) fprintf(stderr, "unexpected error for '%s': %s\n", text, gca_last_error());
  assert_int_equal(rc, GCA_OK);
  return c;
}

/* Fails, names every fragment given, and leaves the config untouched. */
static void apply_bad(const char *text, const char *frag1, const char *frag2) {
  config_t c, before;
  gca__config_defaults(&c);
  assert_int_equal(gca__config_apply(&c, "max_split_size_mb:64", NULL), GCA_OK);
  before = c;
  assert_int_equal(gca__config_apply(&c, text, NULL), GCA_ERR_CONFIG);
  assert_int_equal(gca_last_status(), GCA_ERR_CONFIG);
  if (frag1) assert_contains(gca_last_error(), frag1);
  if (frag2) assert_contains(gca_last_error(), frag2);
  assert_memory_equal(&c, &before, sizeof c);
}

/* A thread's own handler takes that thread's messages, before the
 * process-wide one; another thread's still go to the process-wide one. */
static log_capture_t thread_logs;

static void *warn_elsewhere(void *arg) {
  (void)arg;
  gca_allocator_t *a = open_sim("sim", "no_such_key_other_thread:1");
  gca_close(a);
  return NULL;
}

static void test_thread_log_handler(void **state) {
  (void)state;
  memset(&thread_logs, 0, sizeof thread_logs);
  gca_set_thread_log_handler(capture_log, &thread_logs);
  gca_allocator_t *a = open_sim("sim", "no_such_key_here:1");
  assert_int_equal(thread_logs.count, 1);
  assert_contains(thread_logs.last, "no_such_key_here");
  assert_int_equal(logs.count, 0);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, warn_elsewhere, NULL), 0);
  pthread_join(t, NULL);
  assert_int_equal(thread_logs.count, 1);
  assert_contains(logs.all, "no_such_key_other_thread");
  gca_set_thread_log_handler(NULL, NULL);
  assert_int_equal(gca_set_config(a, "no_such_key_after:1"), GCA_OK);
  assert_int_equal(thread_logs.count, 1);
  assert_contains(logs.all, "no_such_key_after");
  gca_close(a);
}

static void test_defaults(void **state) {
  (void)state;
  config_t c = apply_ok("");
  assert_true(c.max_split_size == SIZE_MAX);
  assert_int_equal(c.max_non_split_rounding, 20 * MiB);
  assert_true(c.gc_threshold == 0.0);
  assert_true(c.memory_fraction == 1.0);
  assert_false(c.expandable_segments);
  assert_int_equal(c.pinned_num_register_threads, 1);
  assert_int_equal(logs.count, 0);
}

static void test_valid_keys(void **state) {
  (void)state;
  config_t c = apply_ok("max_split_size_mb:20,max_non_split_rounding_mb:40");
  assert_int_equal(c.max_split_size, 20 * MiB);
  assert_int_equal(c.max_non_split_rounding, 40 * MiB);
  c = apply_ok(" max_split_size_mb : 300 , expandable_segments : False ,");
  assert_int_equal(c.max_split_size, 300 * MiB);
  assert_int_equal(logs.count, 0);
  c = apply_ok("backend:native,pinned_use_cuda_host_register:False,release_lock_on_cudamalloc:False");
  assert_int_equal(logs.count, 0);
  c = apply_ok("pinned_use_hip_host_register:False,release_lock_on_hipmalloc:False");
  assert_int_equal(logs.count, 0);
}

static void test_not_built_keys_warn(void **state) {
  (void)state;
  static const char *const keys[] = {
      "release_lock_on_cudamalloc:True", "backend:cudaMallocAsync", "graph_capture_record_stream_reuse:True"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    int before = logs.count;
    apply_ok(keys[i]);
    assert_int_equal(logs.count, before + 1);
    assert_contains(logs.last, "not built yet");
  }
  int warned = logs.count;
  /* The pinned host allocator's register path and reserve segment are built. */
  config_t c = apply_ok("pinned_use_cuda_host_register:True,pinned_num_register_threads:8");
  assert_true(c.pinned_use_host_register);
  assert_int_equal(c.pinned_num_register_threads, 8);
  assert_int_equal(c.pinned_reserve_segment_mb, 0);
  c = apply_ok("pinned_reserve_segment_size_mb:64,pinned_use_background_threads:True");
  assert_int_equal(c.pinned_reserve_segment_mb, 64);
  assert_true(c.pinned_use_background_threads);
  assert_int_equal(logs.count, warned);
  c = apply_ok("expandable_segments:True,stitching:True");
  assert_true(c.expandable_segments && c.stitching);
  assert_int_equal(logs.count, warned); /* built: no warning */
  c = apply_ok("stitching:True");
  assert_int_equal(logs.count, warned + 1); /* alone it does nothing, and says so */
  assert_contains(logs.last, "only with expandable_segments:True");
  warned = logs.count;
  c = apply_ok("garbage_collection_threshold:0.25,per_process_memory_fraction:0.75");
  assert_true(c.gc_threshold == 0.25);
  assert_true(c.memory_fraction == 0.75);
  assert_true(c.memory_fraction_set);
  assert_int_equal(logs.count, warned); /* both built: no warning */
  c = apply_ok("oom_retry_timeout_ms:2500,oom_handler_retries:0");
  assert_int_equal(c.oom_retry_timeout_ms, 2500);
  assert_int_equal(c.oom_handler_retries, 0);
  assert_int_equal(apply_ok("").oom_handler_retries, 3);
  apply_bad("oom_retry_timeout_ms:-1", "oom_retry_timeout_ms", "milliseconds");
  apply_bad("oom_retry_timeout_ms:3600001", "oom_retry_timeout_ms", "3600000");
  apply_bad("oom_handler_retries:101", "oom_handler_retries", "0 to 100");
}

static void test_unknown_key_warns_and_is_ignored(void **state) {
  (void)state;
  config_t c = apply_ok("foo:bar,max_split_size_mb:30");
  assert_int_equal(c.max_split_size, 30 * MiB);
  assert_int_equal(logs.count, 1);
  assert_contains(logs.last, "unrecognized configuration key 'foo'");
  c = apply_ok("colors:[1:2,3:[4:5]],max_split_size_mb:40");
  assert_int_equal(c.max_split_size, 40 * MiB);
  assert_int_equal(logs.count, 2);
}

static void test_errors_name_key_value_rule(void **state) {
  (void)state;
  apply_bad("max_split_size_mb:19", "max_split_size_mb", ">= 20");
  apply_bad("max_split_size_mb:19", "'19'", NULL);
  apply_bad("max_split_size_mb:abc", "'abc'", "integer");
  apply_bad("max_split_size_mb:-5", "max_split_size_mb", NULL);
  apply_bad("max_split_size_mb:", "missing value", "max_split_size_mb");
  apply_bad("max_split_size_mb", "max_split_size_mb", "':'");
  apply_bad("max_split_size_mb:30:40", "expected ','", NULL);
  apply_bad("max_non_split_rounding_mb:10", "max_non_split_rounding_mb", ">= 20");
  apply_bad("garbage_collection_threshold:1.0", "garbage_collection_threshold", "(0.0, 1.0)");
  apply_bad("garbage_collection_threshold:0", "'0'", "(0.0, 1.0)");
  apply_bad("garbage_collection_threshold:x", "'x'", NULL);
  apply_bad("expandable_segments:true", "'true'", "True or False");
  apply_bad("release_lock_on_cudamalloc:1", "release_lock_on_cudamalloc", "True or False");
  apply_bad("pinned_use_cuda_host_register:yes", "pinned_use_cuda_host_register", NULL);
  apply_bad("pinned_use_background_threads:no", "pinned_use_background_threads", NULL);
  apply_bad("pinned_num_register_threads:3", "pinned_num_register_threads", "power of two");
  apply_bad("pinned_num_register_threads:256", "'256'", "<= 128");
  apply_bad("per_process_memory_fraction:1.5", "per_process_memory_fraction", "[0.0, 1.0]");
  apply_bad("backend:foo", "'foo'", "native or cudaMallocAsync");
  apply_bad("roundup_power2_divisions:3", "roundup_power2_divisions", "power of two");
  apply_bad("roundup_power2_divisions:0", "roundup_power2_divisions", NULL);
  apply_bad("roundup_power2_divisions:[256:3]", "'3'", "0 or a power of two");
  apply_bad("roundup_power2_divisions:[300:2]", "'300'", "powers of two");
  apply_bad("roundup_power2_divisions:[256:1", "closing ']'", NULL);
  apply_bad("roundup_power2_divisions:[256]", "roundup_power2_divisions", NULL);
  apply_bad(":30", "expected a key", NULL);
  apply_bad("pinned_reserve_segment_size_mb:0", "pinned_reserve_segment_size_mb", "> 0");
  apply_bad("pinned_reserve_segment_size_mb:1073741825", "pinned_reserve_segment_size_mb", "at most 2^30");
}

static void test_all_or_nothing(void **state) {
  (void)state;
  apply_bad("max_split_size_mb:30,garbage_collection_threshold:2", "garbage_collection_threshold", NULL);
  /* nothing of a failed string warns either */
  int before = logs.count;
  apply_bad("expandable_segments:True,max_split_size_mb:1", "max_split_size_mb", NULL);
  assert_int_equal(logs.count, before);
}

static int64_t max_split_of(gca_allocator_t *a) { return stats_of(a, 0).max_split_size; }

static void test_environment_precedence(void **state) {
  (void)state;
  setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:30", 1);
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(max_split_of(a), 30 * MiB);
  gca_close(a);

  setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:40", 1);
  a = open_sim("sim", NULL);
  assert_int_equal(max_split_of(a), 40 * MiB);
  gca_close(a);

  setenv("GCALLOC_ALLOC_CONF", "max_split_size_mb:50", 1);
  a = open_sim("sim", NULL);
  assert_int_equal(max_split_of(a), 50 * MiB);
  gca_close(a);

  /* set but empty still wins: it is how to ignore PyTorch's variables */
  setenv("GCALLOC_ALLOC_CONF", "", 1);
  a = open_sim("sim", NULL);
  assert_int_equal(max_split_of(a), -1);
  gca_close(a);

  /* the string given to gca_open applies on top of the environment */
  setenv("GCALLOC_ALLOC_CONF", "max_split_size_mb:50,max_non_split_rounding_mb:60", 1);
  a = open_sim("sim", "max_split_size_mb:70");
  assert_int_equal(max_split_of(a), 70 * MiB);
  char buf[512];
  gca_get_config(a, buf, sizeof buf);
  assert_contains(buf, "max_non_split_rounding_mb:60");
  gca_close(a);

  /* a malformed environment string fails the open, naming the variable */
  setenv("GCALLOC_ALLOC_CONF", "max_split_size_mb:5", 1);
  a = (gca_allocator_t *)1;
  assert_int_equal(gca_open("sim", NULL, &a), GCA_ERR_CONFIG);
  assert_null(a);
  assert_contains(gca_last_error(), "GCALLOC_ALLOC_CONF");
  assert_contains(gca_last_error(), "max_split_size_mb");
  unsetenv("GCALLOC_ALLOC_CONF");
  setenv("PYTORCH_ALLOC_CONF", "nonsense", 1);
  assert_int_equal(gca_open("sim", NULL, &a), GCA_ERR_CONFIG);
  assert_contains(gca_last_error(), "PYTORCH_ALLOC_CONF");
  unsetenv("PYTORCH_ALLOC_CONF");
  unsetenv("PYTORCH_CUDA_ALLOC_CONF");
}

static void test_set_config_merges_and_keeps_on_error(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  assert_int_equal(gca_set_config(a, "max_split_size_mb:100"), GCA_OK);
  assert_int_equal(gca_set_config(a, "roundup_power2_divisions:4"), GCA_OK);
  assert_int_equal(max_split_of(a), 100 * MiB); /* kept: PyTorch would reset it */
  assert_int_equal(gca_round_size(a, 5000), 5120);
  char before[1024], after[1024];
  gca_get_config(a, before, sizeof before);
  assert_int_equal(gca_set_config(a, "max_split_size_mb:200,roundup_power2_divisions:5"), GCA_ERR_CONFIG);
  gca_get_config(a, after, sizeof after);
  assert_string_equal(before, after);
  assert_int_equal(max_split_of(a), 100 * MiB);
  assert_int_equal(gca_set_config(NULL, "x:y"), GCA_ERR_INVALID);
  gca_close(a);
}

/* gcalloc's own key: True (any size), False, or a size ratio >= 1. */
static void test_cross_stream_reuse_key(void **state) {
  (void)state;
  assert_true(apply_ok("").cross_stream_reuse == 0);
  assert_true(isinf(apply_ok("cross_stream_reuse:True").cross_stream_reuse));
  assert_true(apply_ok("cross_stream_reuse:False").cross_stream_reuse == 0);
  assert_true(apply_ok("cross_stream_reuse:1").cross_stream_reuse == 1.0);
  assert_true(apply_ok("cross_stream_reuse:1.5").cross_stream_reuse == 1.5);
  apply_bad("cross_stream_reuse:0.5", "cross_stream_reuse", "True, False or a size ratio >= 1");
  apply_bad("cross_stream_reuse:yes", "cross_stream_reuse", "'yes'");
  apply_bad("cross_stream_reuse:", "cross_stream_reuse", NULL);
  assert_int_equal(logs.count, 0);
  char text[1024];
  const char *forms[] = {"cross_stream_reuse:True", "cross_stream_reuse:False", "cross_stream_reuse:1.5"};
  for (int i = 0; i < 3; i++) {
    gca_allocator_t *a = open_sim("sim", forms[i]);
    assert_true(gca_get_config(a, text, sizeof text) > 0);
    assert_contains(text, forms[i]);
    gca_close(a);
  }
}

static void test_config_round_trip(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "max_split_size_mb:256,roundup_power2_divisions:[256:1,512:2,>:8],"
                                       "max_non_split_rounding_mb:32,cross_stream_reuse:2.5,"
                                       "pinned_reserve_segment_size_mb:16");
  char text[1024], again[1024];
  int n = gca_get_config(a, text, sizeof text);
  assert_true(n > 0 && (size_t)n < sizeof text);
  assert_contains(text, ",pinned_reserve_segment_size_mb:16");
  gca_allocator_t *b = open_sim("sim", text);
  gca_get_config(b, again, sizeof again);
  assert_string_equal(text, again);
  /* Fractions in their shortest form, read back exactly. */
  gca_allocator_t *f = open_sim("sim", "garbage_collection_threshold:0.7,per_process_memory_fraction:0.1");
  gca_get_config(f, text, sizeof text);
  assert_contains(text, ",garbage_collection_threshold:0.7,per_process_memory_fraction:0.1,");
  gca_close(f);
  f = open_sim("sim", "garbage_collection_threshold:0.123456789012345678");
  gca_get_config(f, text, sizeof text);
  assert_contains(text, ",garbage_collection_threshold:0.12345678901234568,");
  gca_allocator_t *g = open_sim("sim", text);
  gca_get_config(g, again, sizeof again);
  assert_string_equal(text, again);
  gca_close(f);
  gca_close(g);
  /* truncation still terminates and reports the full length */
  char small[8];
  assert_int_equal(gca_get_config(a, small, sizeof small), n);
  assert_int_equal(strlen(small), sizeof small - 1);
  gca_close(a);
  gca_close(b);
}

static void test_default_log_prints_once(void **state) {
  (void)state;
  gca_set_log_handler(NULL, NULL);
  fflush(stderr);
  FILE *tmp = tmpfile();
  assert_non_null(tmp);
  int saved = dup(2);
  dup2(fileno(tmp), 2);
  config_t c;
  gca__config_defaults(&c);
  gca__config_apply(&c, "some_unknown_key_for_dedup:1", NULL);
  gca__config_apply(&c, "some_unknown_key_for_dedup:1", NULL);
  gca__config_apply(&c, "another_unknown_key_for_dedup:1", NULL);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  char out[4096] = {0};
  rewind(tmp);
  size_t n = fread(out, 1, sizeof out - 1, tmp);
  fclose(tmp);
  out[n] = '\0';
  const char *first = strstr(out, "some_unknown_key_for_dedup");
  assert_non_null(first);
  assert_null(strstr(first + 1, "some_unknown_key_for_dedup"));
  assert_contains(out, "another_unknown_key_for_dedup");
  assert_contains(out, "gcalloc: warning:");
  gca_set_log_handler(capture_log, &logs);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_defaults, setup, teardown),
      cmocka_unit_test_setup_teardown(test_valid_keys, setup, teardown),
      cmocka_unit_test_setup_teardown(test_not_built_keys_warn, setup, teardown),
      cmocka_unit_test_setup_teardown(test_unknown_key_warns_and_is_ignored, setup, teardown),
      cmocka_unit_test_setup_teardown(test_errors_name_key_value_rule, setup, teardown),
      cmocka_unit_test_setup_teardown(test_all_or_nothing, setup, teardown),
      cmocka_unit_test_setup_teardown(test_environment_precedence, setup, teardown),
      cmocka_unit_test_setup_teardown(test_set_config_merges_and_keeps_on_error, setup, teardown),
      cmocka_unit_test_setup_teardown(test_cross_stream_reuse_key, setup, teardown),
      cmocka_unit_test_setup_teardown(test_config_round_trip, setup, teardown),
      cmocka_unit_test_setup_teardown(test_default_log_prints_once, setup, teardown),
      cmocka_unit_test_setup_teardown(test_thread_log_handler, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
