/* The Ascend backend (label acl) against the AscendCL stand-in
 * (tests/fake_acl.c, whole and without the optional entry points, loaded
 * with "acl:library=PATH"): loading and its failures; allocation, free,
 * memory info, properties, peers; events pending then complete under both
 * status forms; threads that never set a device; expandable segments over
 * real mappings; the virtual-memory probe; every error path of every call;
 * the out-of-memory ladder on 207001; torch_npu's 32-byte pad by SoC;
 * configuration precedence; seeded random sequences under the invariant
 * checker, after which the stand-in holds nothing.
 */
#include <dlfcn.h>
#include <pthread.h>

#include "helpers.h"

#define S1 ((gca_stream_t)0x1000)
#define S2 ((gca_stream_t)0x2000)
#define SPEC "acl:library=" FAKE_ACL_PATH
#define SPEC_MINIMAL "acl:library=" FAKE_ACL_MINIMAL_PATH

enum { LIVE_DEVICE = 1, LIVE_HOST = 2, LIVE_RESERVED = 3, LIVE_MAPPED = 4, LIVE_PHYSICAL = 5 };

/* The stand-in's control functions, from a copy (whole or minimal). */
typedef struct fake {
  void *lib;
  void (*reset)(void);
  void (*inject)(const char *entry, unsigned skip, unsigned times, int code);
  unsigned long (*calls)(const char *entry);
  void (*set_capacity)(size_t bytes);
  void (*set_devices)(int n);
  void (*set_soc)(const char *name);
  void (*set_cann_version)(const char *version);
  void (*hold_events)(int on);
  void (*complete_events)(void);
  int (*current_device)(void);
  int (*touched)(int device);
  int (*set_current)(int device);
  int (*init)(const char *config);
  int (*finalize)(void);
  const char *(*init_config)(void);
  int (*queue_work)(uintptr_t addr, size_t size);
  void (*run_queue)(void);
  size_t (*stale_work)(void);
  size_t (*used)(int device);
  size_t (*live)(int kind);
  size_t (*live_events)(void);
} fake_t;

static fake_t full, minimal;

static int load_fake(fake_t *f, const char *path) {
  f->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!f->lib) {
    fprintf(stderr, "cannot load the AscendCL stand-in %s: %s\n", path, dlerror());
    return -1;
  }
#define LOAD(field, name) *(void **)&f->field = dlsym(f->lib, name)
  LOAD(reset, "fakeacl_reset");
  LOAD(inject, "fakeacl_fail");
  LOAD(calls, "fakeacl_calls");
  LOAD(set_capacity, "fakeacl_set_capacity");
  LOAD(set_devices, "fakeacl_set_devices");
  LOAD(set_soc, "fakeacl_set_soc");
  LOAD(set_cann_version, "fakeacl_set_cann_version");
  LOAD(hold_events, "fakeacl_hold_events");
  LOAD(complete_events, "fakeacl_complete_events");
  LOAD(current_device, "fakeacl_current_device");
  LOAD(touched, "fakeacl_touched");
  LOAD(set_current, "fakeacl_set_current");
  LOAD(init, "aclInit");
  LOAD(finalize, "aclFinalize");
  LOAD(init_config, "fakeacl_init_config");
  LOAD(queue_work, "fakeacl_queue_work");
  LOAD(run_queue, "fakeacl_run_queue");
  LOAD(stale_work, "fakeacl_stale_work");
  LOAD(used, "fakeacl_used");
  LOAD(live, "fakeacl_live");
  LOAD(live_events, "fakeacl_live_events");
#undef LOAD
  return f->live_events ? 0 : -1;
}

static int setup(void **state) {
  (void)state;
  return load_fake(&full, FAKE_ACL_PATH) || load_fake(&minimal, FAKE_ACL_MINIMAL_PATH) ? -1 : 0;
}

static int teardown(void **state) {
  (void)state;
  if (full.lib) dlclose(full.lib);
  if (minimal.lib) dlclose(minimal.lib);
  return 0;
}

static int fresh(void **state) {
  (void)state;
  full.reset();
  minimal.reset();
  return 0;
}

/* After gca_close: the stand-in holds nothing of ours. */
static void assert_runtime_empty(const fake_t *f) {
  assert_int_equal(f->used(0), 0);
  assert_int_equal(f->used(1), 0);
  for (int kind = LIVE_DEVICE; kind <= LIVE_PHYSICAL; kind++) {
    if (f->live(kind)) fprintf(stderr, "the stand-in still holds %zu items of kind %d\n", f->live(kind), kind);
    assert_int_equal(f->live(kind), 0);
  }
  if (f->live_events()) fprintf(stderr, "the stand-in still holds %zu events\n", f->live_events());
  assert_int_equal(f->live_events(), 0);
}

/* ---- loading ------------------------------------------------------------- */

static void test_loading_failures(void **state) {
  (void)state;
  gca_allocator_t *a = NULL;
  assert_int_equal(gca_open("acl:library=/nonexistent/libascendcl.so", NULL, &a), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "no AscendCL runtime: cannot load /nonexistent/libascendcl.so");
  assert_null(a);
  /* A library that is not AscendCL (the CUDA driver stand-in). */
  assert_int_equal(gca_open("acl:library=" FAKE_CUDA_PATH, NULL, &a), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "has no aclInit (too old, or not AscendCL's runtime)");
  assert_int_equal(gca_open("acl:nope=1", NULL, &a), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "unknown option 'nope=1' (options: library=PATH)");
  /* No devices. */
  full.set_devices(0);
  assert_int_equal(gca_open(SPEC, NULL, &a), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "aclrtGetDeviceCount (runtime");
  assert_contains(gca_last_error(), "ACL_ERROR_RT_NO_DEVICE (207004)");
  full.set_devices(-1);
  /* aclInit refused (any code but REPEAT_INITIALIZE), on a runtime
   * finalized since gcalloc initialized it (asked again then). */
  a = open_sim(SPEC, NULL);
  gca_close(a);
  assert_int_equal(full.finalize(), 0);
  full.inject("aclInit", 0, 1, 100001);
  assert_int_equal(gca_open(SPEC, NULL, &a), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "aclInit/aclrtGetDeviceCount (runtime");
  assert_contains(gca_last_error(), "ACL_ERROR_UNINITIALIZE (100001)");
  /* A framework that initialized first: REPEAT_INITIALIZE is fine, and
   * gcalloc initializes once per process, however many allocators. */
  assert_int_equal(full.init("framework.json"), 0);
  unsigned long inits = full.calls("aclInit");
  a = open_sim(SPEC, NULL);
  gca_allocator_t *b = open_sim(SPEC, NULL);
  assert_int_equal(full.calls("aclInit"), inits);
  assert_string_equal(full.init_config(), "framework.json");
  assert_int_equal(gca_device_count(b), 2);
  assert_string_equal(gca_backend_name(b), "acl");
  gca_close(b);
  gca_close(a);
  /* From the environment variable. */
  setenv("GCALLOC_ACL_LIBRARY", FAKE_ACL_PATH, 1);
  a = open_sim("acl", NULL);
  unsetenv("GCALLOC_ACL_LIBRARY");
  gca_close(a);
  assert_runtime_empty(&full);
}

/* ---- memory, properties, peers --------------------------------------------- */

static void test_allocation_and_facts(void **state) {
  (void)state;
  full.set_capacity((size_t)256 << 20);
  gca_allocator_t *a = open_sim(SPEC, NULL);
  char *p = gca_malloc(a, 1000, 0, S1);
  assert_non_null(p);
  memset(p, 0xab, 1000); /* real memory behind it */
  char *q = gca_malloc(a, 30 * MiB, 1, S1);
  assert_non_null(q);
  q[30 * MiB - 1] = 1;
  /* aclrtMallocAlign32 when the runtime has it: no padding. */
  assert_int_equal(full.calls("aclrtMallocAlign32"), 2);
  assert_int_equal(full.calls("aclrtMalloc"), 0);
  assert_int_equal(full.used(0), 2 * MiB);
  size_t free_bytes = 0, total = 0;
  assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
  assert_int_equal(total, (size_t)256 << 20);
  assert_int_equal(free_bytes, total - 2 * MiB);
  gca_device_properties_t props;
  assert_int_equal(gca_device_properties(a, 1, &props), GCA_OK);
  assert_string_equal(props.name, "Ascend910B3");
  assert_int_equal(props.total_memory, (size_t)256 << 20);
  int can = -1;
  assert_int_equal(gca_can_access_peer(a, 0, 1, &can), GCA_OK);
  assert_int_equal(can, 1);
  assert_int_equal(gca_enable_peer_access(a, 0, 1), GCA_OK);
  assert_int_equal(gca_disable_peer_access(a, 0, 1), GCA_OK);
  assert_int_equal(gca_disable_peer_access(a, 0, 1), GCA_ERR_INVALID); /* not enabled */
  assert_contains(gca_last_error(), "aclrtDeviceDisablePeerAccess (device 0, peer 1) failed: ACL_ERROR_INVALID_PARAM");
  int least, greatest;
  assert_int_equal(gca_stream_priority_range(a, 0, &least, &greatest), GCA_ERR_BACKEND); /* not offered */
  /* Pinned host memory through aclrtMallocHost. */
  void *h = gca_host_malloc(a, 4096);
  assert_non_null(h);
  assert_int_equal(full.live(LIVE_HOST), 1);
  assert_int_equal(gca_host_free(a, h), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_consistent(a);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* Without aclrtMallocAlign32, aclrtMalloc pads by 32 bytes; the optional
 * calls are absent and said to be. */
static void test_minimal_runtime(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC_MINIMAL, "expandable_segments:True");
  void *p = gca_malloc(a, 4096, 0, S1);
  assert_non_null(p);
  assert_int_equal(minimal.calls("aclrtMalloc"), 1);
  assert_int_equal(minimal.used(0), 2 * MiB + 32);
  /* No virtual memory: ordinary segments (reserved is a whole segment). */
  assert_int_equal(gca_reserved_bytes(a, 0), 2 * MiB);
  gca_device_properties_t props;
  assert_int_equal(gca_device_properties(a, 0, &props), GCA_OK);
  assert_string_equal(props.name, "Ascend NPU");
  int can;
  assert_int_equal(gca_can_access_peer(a, 0, 1, &can), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "the AscendCL runtime has no aclrtDeviceCanAccessPeer");
  assert_null(gca_host_malloc(a, 4096));
  assert_int_equal(gca_free(a, p), GCA_OK);
  gca_close(a);
  assert_runtime_empty(&minimal);
}

/* ---- events: pending, then complete, in both status forms ---------------- */

static void events_under(const char *spec, fake_t *f, const char *query) {
  gca_allocator_t *a = open_sim(spec, NULL);
  f->hold_events(1);
  void *p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* Pending: another allocation on S1 does not get it. */
  void *q = gca_malloc(a, 4096, 0, S1);
  assert_ptr_not_equal(p, q);
  assert_true(f->calls(query) >= 1);
  assert_int_equal(stats_of(a, 0).active_bytes[GCA_POOL_ALL].current, 2 * (int64_t)gca_round_size(a, 4096));
  /* Complete: the next allocation reuses it. */
  f->complete_events();
  assert_int_equal(gca_process_events(a, 0), GCA_OK);
  void *r = gca_malloc(a, 4096, 0, S1);
  assert_ptr_equal(p, r);
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_int_equal(gca_free(a, r), GCA_OK);
  f->hold_events(0);
  assert_consistent(a);
  gca_close(a);
  assert_int_equal(f->live_events(), 0);
  assert_runtime_empty(f);
}

static void test_events_both_status_forms(void **state) {
  (void)state;
  events_under(SPEC, &full, "aclrtQueryEventStatus"); /* COMPLETE = 1 */
  assert_int_equal(full.calls("aclrtQueryEvent"), 0);
  assert_true(full.calls("aclrtCreateEventWithFlag") >= 1);
  events_under(SPEC_MINIMAL, &minimal, "aclrtQueryEvent"); /* COMPLETE = 0 */
  assert_true(minimal.calls("aclrtCreateEvent") >= 1);
}

/* ---- the current device is per thread ----------------------------------- */

typedef struct thread_job {
  gca_allocator_t *a;
  int device;
  int before, after;
  void *p;
} thread_job_t;

static void *allocate_on_a_fresh_thread(void *arg) {
  thread_job_t *j = arg;
  j->before = full.current_device(); /* none set on a new thread */
  j->p = gca_malloc(j->a, 8192, j->device, S1);
  j->after = full.current_device();
  return NULL;
}

/* Run fn on a new thread, which has no current device, and expect it to
 * have got its block. */
static thread_job_t on_a_fresh_thread(gca_allocator_t *a, int device, void *(*fn)(void *)) {
  thread_job_t j = {a, device, 0, 0, NULL};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, fn, &j), 0);
  pthread_join(t, NULL);
  assert_int_equal(j.before, -1);
  assert_non_null(j.p);
  return j;
}

static void test_thread_that_never_set_a_device(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  thread_job_t j = on_a_fresh_thread(a, 1, allocate_on_a_fresh_thread);
  assert_int_equal(j.after, 1);
  assert_int_equal(gca_free(a, j.p), GCA_OK); /* from this thread, whose device differs */
  gca_close(a);
  assert_runtime_empty(&full);
}

/* The devices touched (a context made on each by an aclrtSetDevice), as a bit set. */
static unsigned touched_set(int devices) {
  unsigned set = 0;
  for (int i = 0; i < devices; i++) set |= (unsigned)(full.touched(i) != 0) << i;
  return set;
}

/* A framework's thread on device 0 of 8 (torch_npu caches the thread's
 * device and skips aclrtSetDevice when it thinks it is there): every call
 * gives the thread its device back, and only the devices used get a
 * context. */
static void test_device_discipline(void **state) {
  (void)state;
  full.set_devices(8);
  full.set_capacity((size_t)64 << 20);
  int init = full.init(NULL); /* the framework's aclInit (100002: an earlier test's already ran) */
  assert_true(init == 0 || init == 100002);
  assert_int_equal(full.set_current(0), 0);
  gca_allocator_t *a = open_sim(SPEC, NULL);
  assert_int_equal(full.current_device(), 0);
  assert_int_equal(touched_set(8), 1u); /* opening touched no other device */
  void *p = gca_malloc(a, 40 * MiB, 1, S1);
  assert_non_null(p);
  assert_int_equal(full.current_device(), 0);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK); /* an event recorded on device 1 */
  assert_int_equal(full.current_device(), 0);
  void *q = gca_malloc(a, 50 * MiB, 1, S1); /* the ladder: the cached 40 MiB released first */
  assert_non_null(q);
  assert_int_equal(full.current_device(), 0);
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(full.current_device(), 0);
  void *h = gca_host_malloc(a, 4096);
  assert_non_null(h);
  assert_int_equal(gca_host_free(a, h), GCA_OK);
  size_t free_bytes = 0, total = 0;
  assert_int_equal(gca_mem_get_info(a, 3, &free_bytes, &total), GCA_OK);
  assert_int_equal(full.current_device(), 0);
  assert_int_equal(touched_set(8), 0x0Bu); /* devices 0, 1 and 3 */
  gca_close(a);
  assert_int_equal(full.current_device(), 0);
  assert_int_equal(touched_set(8), 0x0Bu);
  /* Expandable segments probe each device's virtual memory at open; the
   * thread's device is given back after each probe. */
  a = open_sim(SPEC, "expandable_segments:True");
  assert_int_equal(full.current_device(), 0);
  p = gca_malloc(a, 30 * MiB, 2, S1);
  assert_non_null(p);
  assert_int_equal(full.current_device(), 0);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK); /* unmaps on device 2 */
  assert_int_equal(full.current_device(), 0);
  gca_close(a);
  assert_int_equal(full.current_device(), 0);
  assert_runtime_empty(&full);
}

/* A fraction or expandable segments configured: still nothing asked of a
 * device before it is used (its bytes and its virtual memory are asked
 * there at its first segment). */
static void test_device_discipline_configured(void **state) {
  (void)state;
  full.set_devices(8);
  full.set_capacity((size_t)64 << 20);
  int init = full.init(NULL);
  assert_true(init == 0 || init == 100002);
  assert_int_equal(full.set_current(5), 0);
  unsigned long infos = full.calls("aclrtGetMemInfo");
  gca_allocator_t *a = open_sim(SPEC, "per_process_memory_fraction:0.5,expandable_segments:True");
  assert_int_equal(full.current_device(), 5);
  assert_int_equal(touched_set(8), 1u << 5);
  assert_int_equal(full.calls("aclrtGetMemInfo"), infos);
  assert_int_equal(full.calls("aclrtReserveMemAddress"), 0);
  void *p = gca_malloc(a, 10 * MiB, 5, S1); /* one 20 MiB page */
  assert_non_null(p);
  assert_null(gca_malloc(a, 20 * MiB, 5, S1)); /* two more: 32 MiB allowed of 64 */
  assert_contains(gca_last_error(), "per_process_memory_fraction");
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(full.current_device(), 5);
  assert_int_equal(touched_set(8), 1u << 5);
  /* A pool paused and resumed on device 6: that device gets a context, and the thread stays on 5. */
  gca_pool_t pool = 0;
  assert_int_equal(gca_pool_create_ex(a, 6, GCA_POOL_PAUSABLE, &pool), GCA_OK);
  assert_int_equal(gca_pool_push(a, pool), GCA_OK);
  p = gca_malloc(a, 4 * MiB, 6, S1);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_non_null(p);
  assert_int_equal(gca_pool_pause(a, pool, 0, NULL), GCA_OK);
  assert_int_equal(full.current_device(), 5);
  assert_int_equal(gca_pool_resume(a, pool, 0), GCA_OK);
  assert_int_equal(full.current_device(), 5);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_pool_release(a, pool), GCA_OK);
  assert_int_equal(full.current_device(), 5);
  assert_int_equal(touched_set(8), 1u << 5 | 1u << 6);
  gca_close(a);
  assert_int_equal(full.current_device(), 5);
  assert_int_equal(touched_set(8), 1u << 5 | 1u << 6);
  assert_runtime_empty(&full);
}

/* ---- the framework's host queue -------------------------------------------
 * torch_npu launches operators from a host queue after the allocator has
 * seen their memory freed: without the queue drained before a release, the
 * runtime takes memory back that queued work will still write. */

static void run_the_queue(int device, void *user) {
  (void)device;
  ++*(int *)user;
  full.run_queue();
}

/* Free `p` with an operator that writes its first page still queued. */
static void free_with_queued_work(gca_allocator_t *a, void *p) {
  assert_int_equal(full.queue_work((uintptr_t)p, 4096), 0);
  assert_int_equal(gca_free(a, p), GCA_OK);
}

static void test_queue_drained_before_release(void **state) {
  (void)state;
  full.set_capacity((size_t)64 << 20);
  gca_allocator_t *a = open_sim(SPEC, NULL);
  /* Without the drain: the ladder gives back memory with work queued on it. */
  void *p = gca_malloc(a, 40 * MiB, 0, S1);
  free_with_queued_work(a, p);
  void *q = gca_malloc(a, 50 * MiB, 0, S1);
  assert_non_null(q);
  full.run_queue();
  assert_int_equal(full.stale_work(), 1);
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  /* With the drain connected: the ladder, gca_empty_cache, and expandable
   * pages unmapped each run the queue first, and only when a free happened
   * since the last time. */
  int drains = 0;
  assert_int_equal(gca_set_queue_drain(a, run_the_queue, &drains), GCA_OK);
  p = gca_malloc(a, 40 * MiB, 0, S1);
  free_with_queued_work(a, p);
  q = gca_malloc(a, 50 * MiB, 0, S1);
  assert_non_null(q);
  assert_int_equal(drains, 1);
  free_with_queued_work(a, q);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(drains, 2);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK); /* (nothing freed since) */
  assert_int_equal(drains, 2);
  full.run_queue();
  assert_int_equal(full.stale_work(), 1);
  gca_close(a);
  a = open_sim(SPEC, "expandable_segments:True");
  assert_int_equal(gca_set_queue_drain(a, run_the_queue, &drains), GCA_OK);
  p = gca_malloc(a, 30 * MiB, 0, S1);
  free_with_queued_work(a, p);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK); /* pages unmapped */
  assert_int_equal(drains, 3);
  /* A pool paused: its live blocks' queued work runs first, whatever was freed. */
  gca_pool_t pool = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &pool), GCA_OK);
  assert_int_equal(gca_pool_push(a, pool), GCA_OK);
  p = gca_malloc(a, 4 * MiB, 0, S1);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  int before = drains;
  assert_int_equal(full.queue_work((uintptr_t)p, 4096), 0);
  assert_int_equal(gca_pool_pause(a, pool, 0, NULL), GCA_OK);
  assert_int_equal(drains, before + 1);
  assert_int_equal(gca_pool_resume(a, pool, 0), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_pool_release(a, pool), GCA_OK);
  full.run_queue();
  assert_int_equal(full.stale_work(), 1);
  assert_int_equal(gca_set_queue_drain(a, NULL, NULL), GCA_OK);
  assert_consistent(a);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* ---- events a stream waits on ---------------------------------------------
 * The runtime refuses a wait on an event without ACL_EVENT_SYNC, and
 * destroying or recording again an event while a wait on it is pending:
 * an event the core lets go then is reused only after it completed. */
static void test_waited_events(void **state) {
  (void)state;
  log_capture_t cap = {0};
  gca_set_log_handler(capture_log, &cap);
  full.hold_events(1);
  gca_allocator_t *a = open_sim(SPEC, "cross_stream_reuse:True");
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  void *q = gca_malloc(a, 30 * MiB, 0, S2); /* S2 waits on S1's event */
  assert_ptr_equal(p, q);
  assert_int_equal(full.calls("aclrtStreamWaitEvent"), 1);
  /* More events recorded while the wait is pending: none is the waited one. */
  for (int i = 0; i < 4; i++) {
    assert_int_equal(gca_record_stream(a, q, S1), GCA_OK);
    assert_int_equal(gca_free(a, q), GCA_OK);
    q = gca_malloc(a, 30 * MiB, 0, S2);
    assert_non_null(q);
  }
  assert_int_equal(gca_free(a, q), GCA_OK);
  full.complete_events();
  assert_int_equal(gca_synchronize(a, -1), GCA_OK);
  assert_string_equal(cap.all, "");
  gca_stats_t st;
  assert_int_equal(gca_get_stats(a, 0, &st), GCA_OK);
  assert_int_equal(st.num_device_free_failures, 0);
  full.hold_events(0);
  assert_consistent(a);
  gca_close(a);
  gca_set_log_handler(NULL, NULL);
  assert_runtime_empty(&full);
}

/* torch_npu's switches, read at open on acl: PYTORCH_NO_NPU_MEMORY_CACHING
 * (not PyTorch's CUDA one) and ASCEND_LAUNCH_BLOCKING. */
static void test_torch_npu_switches(void **state) {
  (void)state;
  setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1", 1);
  gca_allocator_t *a = open_sim(SPEC, NULL);
  assert_int_equal(gca_no_caching(a), 0);
  gca_close(a);
  unsetenv("PYTORCH_NO_CUDA_MEMORY_CACHING");
  setenv("PYTORCH_NO_NPU_MEMORY_CACHING", "1", 1);
  setenv("ASCEND_LAUNCH_BLOCKING", "1", 1);
  a = open_sim(SPEC, NULL);
  unsetenv("PYTORCH_NO_NPU_MEMORY_CACHING");
  unsetenv("ASCEND_LAUNCH_BLOCKING");
  assert_int_equal(gca_no_caching(a), 1);
  assert_int_equal(gca_launch_blocking(a), 1);
  void *p = gca_malloc(a, 3 * MiB, 0, S1);
  assert_non_null(p);
  assert_int_equal(full.live(LIVE_DEVICE), 1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(full.live(LIVE_DEVICE), 0); /* given back at the free */
  gca_close(a);
  assert_runtime_empty(&full);
}

/* torch_npu's eraseStream: a use recorded and erased is not waited for; an
 * erase after the free leaves the free waiting for what was recorded. */
static void test_erase_stream(void **state) {
  (void)state;
  full.hold_events(1);
  gca_allocator_t *a = open_sim(SPEC, NULL);
  void *p = gca_malloc(a, MiB, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_erase_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_erase_stream(a, p, S2), GCA_OK); /* (not recorded: nothing) */
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 0);
  p = gca_malloc(a, MiB, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 1); /* waits for S2 */
  assert_int_equal(gca_erase_stream(a, p, S2), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 1);
  assert_int_equal(gca_erase_stream(a, (char *)p + 512, S2), GCA_ERR_BAD_POINTER);
  assert_int_equal(gca_erase_stream(a, (void *)0x1000, S2), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "cannot erase a stream use of 0x1000");
  full.complete_events();
  assert_int_equal(gca_synchronize(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 0);
  full.hold_events(0);
  assert_consistent(a);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* Pinned host memory needs a current context: a thread with no device
 * gets device 0 for the call (and keeps it: AscendCL cannot unset one). */
static void *host_alloc_on_a_fresh_thread(void *arg) {
  thread_job_t *j = arg;
  j->before = full.current_device();
  j->p = gca_host_malloc(j->a, 4096);
  j->after = full.current_device();
  if (j->p) j->device = gca_host_free(j->a, j->p);
  return NULL;
}

static void test_host_memory_needs_a_context(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  thread_job_t j = on_a_fresh_thread(a, -1, host_alloc_on_a_fresh_thread);
  assert_int_equal(j.after, 0);
  assert_int_equal(j.device, GCA_OK); /* (the free's status) */
  gca_close(a);
  assert_runtime_empty(&full);
}

/* ---- expandable segments over real mappings ------------------------------ */

static void test_expandable_segments(void **state) {
  (void)state;
  full.set_capacity((size_t)512 << 20);
  gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
  /* Virtual memory is probed (a 512-byte reservation) on a device's first
   * use of it, not at open. */
  assert_int_equal(full.calls("aclrtReserveMemAddress"), 0);
  unsigned char *p = gca_malloc(a, 50 * MiB, 0, S1); /* three 20 MiB pages */
  assert_non_null(p);
  assert_int_equal(full.calls("aclrtReserveMemAddress"), 2); /* the probe and the segment's range */
  for (size_t i = 0; i < 50 * MiB; i += 4096) p[i] = (unsigned char)(i >> 12);
  for (size_t i = 0; i < 50 * MiB; i += 4096) assert_int_equal(p[i], (unsigned char)(i >> 12));
  assert_int_equal(full.live(LIVE_MAPPED), 3);
  assert_int_equal(full.live(LIVE_PHYSICAL), 3);
  assert_int_equal(full.used(0), 60 * MiB);
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* A refusal in the middle of a run: all or none, the run stays mapped
   * and the memory cached. */
  full.inject("aclrtUnmapMem", 1, 1, 507000);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(full.live(LIVE_MAPPED), 3);
  assert_int_equal(gca_reserved_bytes(a, 0), 60 * MiB);
  assert_consistent(a);
  p = gca_malloc(a, 50 * MiB, 0, S1); /* still usable, and readable where written */
  assert_int_equal(p[20 * MiB], (unsigned char)((20 * MiB) >> 12));
  assert_int_equal(gca_free(a, p), GCA_OK);
  unsigned long before = full.calls("aclrtUnmapMem");
  /* The cache released: exactly the three mappings unmapped, one call each. */
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(full.calls("aclrtUnmapMem") - before, 3);
  assert_int_equal(full.live(LIVE_MAPPED), 0);
  assert_int_equal(full.live(LIVE_PHYSICAL), 0);
  assert_int_equal(full.used(0), 0);
  assert_consistent(a);
  gca_close(a);
  assert_runtime_empty(&full);
}

static void test_virtual_memory_probe_failing(void **state) {
  (void)state;
  log_capture_t cap = {0};
  gca_set_log_handler(capture_log, &cap);
  full.inject("aclrtReserveMemAddress", 0, 1, 207000); /* the probe, at device 0's first segment */
  gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
  assert_string_equal(cap.all, "");
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_non_null(p);
  assert_contains(cap.all, "expandable_segments:True: device 0 of backend acl has no virtual memory; ordinary segments");
  assert_int_equal(full.live(LIVE_MAPPED), 0);
  assert_int_equal(full.live(LIVE_DEVICE), 1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  gca_set_log_handler(NULL, NULL);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* The probe's reservation, its release refused: kept, and given back at
 * the next release of a reservation, or at close. */
static void test_virtual_memory_probe_release_refused(void **state) {
  (void)state;
  full.inject("aclrtReleaseMemAddress", 0, 1, 207000); /* the probe's release */
  gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_non_null(p); /* (the probe's answer stands: virtual memory works) */
  assert_int_equal(full.live(LIVE_RESERVED), 2); /* the probe's and the segment's */
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK); /* the segment's range goes, and the probe's */
  assert_int_equal(full.live(LIVE_RESERVED), 0);
  gca_close(a);
  /* No other release before close: close gives it back. */
  full.inject("aclrtReleaseMemAddress", 0, 1, 207000);
  a = open_sim(SPEC, "expandable_segments:True");
  assert_non_null(p = gca_malloc(a, 30 * MiB, 0, S1));
  assert_int_equal(full.live(LIVE_RESERVED), 2);
  assert_int_equal(gca_free(a, p), GCA_OK);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* ---- every error path ----------------------------------------------------- */

typedef struct error_case {
  const char *entry;
  int code;
  int status;          /* what the allocator call returns */
  const char *message; /* what its message names */
} error_case_t;

/* A workload that reaches every entry point the backend uses; returns the
 * first failing status (its message in gca_last_error). */
static int workload(gca_allocator_t *a) {
  int rc = GCA_OK;
  size_t f, t;
  if ((rc = gca_mem_get_info(a, 0, &f, &t))) return rc;
  void *p = gca_malloc(a, 50 * MiB, 0, S1);
  if (!p) return gca_last_status();
  if ((rc = gca_record_stream(a, p, S2)) || (rc = gca_free(a, p))) return rc;
  if ((rc = gca_process_events(a, 0)) || (rc = gca_synchronize(a, 0))) return rc;
  if ((rc = gca_empty_cache(a, 0))) return rc;
  int stats_rc = gca_check(a, 0);
  if (stats_rc) return stats_rc;
  gca_stats_t s = stats_of(a, 0);
  if (s.num_device_free_failures) return gca__set_error(GCA_ERR_BACKEND, "%s", "a device free was refused");
  return GCA_OK;
}

static void test_every_error_path(void **state) {
  (void)state;
  static const error_case_t cases[] = {
      {"aclrtGetMemInfo", 507000, GCA_ERR_BACKEND, "aclrtGetMemInfo (ACL_HBM_MEM, device 0) failed: ACL_ERROR_RT_INTERNAL_ERROR (507000)"},
      {"aclrtReserveMemAddress", 207001, GCA_ERR_OOM, "aclrtReserveMemAddress"},
      {"aclrtMallocPhysical", 107000, GCA_ERR_INVALID, "aclrtMallocPhysical (20971520 bytes, device 0) failed: ACL_ERROR_RT_PARAM_INVALID (107000)"},
      {"aclrtMapMem", 507000, GCA_ERR_BACKEND, "aclrtMapMem"},
      {"aclrtCreateEventWithFlag", 507000, GCA_ERR_BACKEND, ""},
      {"aclrtRecordEvent", 507000, GCA_ERR_BACKEND, ""},
      {"aclrtQueryEventStatus", 507000, GCA_ERR_BACKEND, ""},
      {"aclrtSynchronizeEvent", 507000, GCA_ERR_BACKEND, ""},
      {"aclrtSynchronizeStream", 507000, GCA_ERR_BACKEND, ""},
      {"aclrtUnmapMem", 507000, GCA_ERR_BACKEND, ""},
      {"aclrtFreePhysical", 207002, GCA_ERR_BACKEND, "a device free was refused"},
      {"aclrtSetDevice", 107001, GCA_ERR_BACKEND, "aclrtSetDevice (device 0) failed: ACL_ERROR_RT_INVALID_DEVICEID (107001)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const error_case_t *c = &cases[i];
    full.reset();
    full.hold_events(1); /* queries say "not ready", so synchronizations follow */
    gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
    /* aclrtGetDevice says "none" so that the next call sets the device. */
    if (!strcmp(c->entry, "aclrtSetDevice")) full.inject("aclrtGetDevice", 0, 1, 107002);
    full.inject(c->entry, 0, 1, c->code);
    int rc = workload(a);
    unsigned long called = full.calls(c->entry);
    /* Events and synchronizations that fail are waited out, and memory
     * kept, by the core: the workload may pass. Those that surface say so. */
    if (rc != GCA_OK && c->message[0]) {
      if (!strstr(gca_last_error(), c->message))
        fprintf(stderr, "%s: status %d, message \"%s\"\n", c->entry, rc, gca_last_error());
      assert_contains(gca_last_error(), c->message);
      if (c->status != GCA_ERR_BACKEND || rc != GCA_ERR_OOM) assert_true(rc == c->status || rc == GCA_ERR_OOM);
    }
    if (called == 0) fprintf(stderr, "%s was never called\n", c->entry);
    assert_true(called >= 1);
    assert_consistent(a);
    full.hold_events(0);
    full.complete_events();
    /* The next call works. */
    void *p = gca_malloc(a, 4096, 0, S1);
    assert_non_null(p);
    assert_int_equal(gca_free(a, p), GCA_OK);
    assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
    assert_int_equal(gca_empty_cache(a, -1), GCA_OK); /* (a refused free given back now) */
    assert_consistent(a);
    gca_close(a);
    assert_runtime_empty(&full);
  }
  /* Plain segments: aclrtMallocAlign32 and aclrtFree. */
  full.reset();
  gca_allocator_t *a = open_sim(SPEC, NULL);
  full.inject("aclrtMallocAlign32", 0, 1, 100000);
  assert_null(gca_malloc(a, 4096, 0, S1));
  assert_int_equal(gca_last_status(), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "aclrtMallocAlign32 (2097152 bytes, device 0) failed: ACL_ERROR_INVALID_PARAM (100000)");
  void *p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  full.inject("aclrtFree", 0, 1, 207002);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).num_device_free_failures, 1); /* refused: kept cached */
  assert_int_equal(gca_reserved_bytes(a, 0), 2 * MiB);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(gca_reserved_bytes(a, 0), 0);
  assert_consistent(a);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* The calls the workload above does not reach: peers, host memory, giving
 * a range back, ordering a segment moved between streams. */
static void test_more_error_paths(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
  int can = -1;
  full.inject("aclrtDeviceCanAccessPeer", 0, 1, 100000);
  assert_int_equal(gca_can_access_peer(a, 0, 1, &can), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "aclrtDeviceCanAccessPeer (device 0, peer 1) failed: ACL_ERROR_INVALID_PARAM (100000)");
  full.inject("aclrtDeviceEnablePeerAccess", 0, 1, 507000);
  assert_int_equal(gca_enable_peer_access(a, 1, 0), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "aclrtDeviceEnablePeerAccess (device 1, peer 0) failed: ACL_ERROR_RT_INTERNAL_ERROR");
  assert_int_equal(gca_enable_peer_access(a, 1, 0), GCA_OK); /* the next call works */
  assert_int_equal(gca_disable_peer_access(a, 1, 0), GCA_OK);
  full.inject("aclrtMallocHost", 0, 1, 207001); /* (nothing cached to give back: no retry) */
  assert_null(gca_host_malloc(a, 4096));
  assert_contains(gca_last_error(), "aclrtMallocHost (4096 bytes) failed: ACL_ERROR_RT_MEMORY_ALLOCATION (207001)");
  void *h = gca_host_malloc(a, 4096);
  assert_non_null(h);
  assert_int_equal(gca_host_free(a, h), GCA_OK);
  full.inject("aclrtFreeHost", 0, 1, 507000);
  assert_int_equal(gca_host_empty_cache(a), GCA_ERR_BACKEND); /* refused: stays pinned and cached */
  assert_int_equal(gca_host_empty_cache(a), GCA_OK);
  /* A range the runtime will not take back stays reserved (address space
   * only), serves the next allocation, and goes at close. */
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  full.inject("aclrtReleaseMemAddress", 0, 1, 507000);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(full.live(LIVE_RESERVED), 1);
  assert_int_equal(full.live(LIVE_PHYSICAL), 0);
  assert_consistent(a);
  void *again = gca_malloc(a, 30 * MiB, 0, S1);
  assert_ptr_equal(again, p);
  assert_int_equal(full.live(LIVE_RESERVED), 1);
  assert_int_equal(gca_free(a, again), GCA_OK);
  gca_close(a);
  assert_int_equal(full.live(LIVE_RESERVED), 0);
  /* A segment moved to another stream is ordered with aclrtStreamWaitEvent;
   * refused, the move waits for the stream instead. */
  full.hold_events(1);
  a = open_sim(SPEC, "cross_stream_reuse:True");
  p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  full.inject("aclrtStreamWaitEvent", 0, 1, 507000);
  void *q = gca_malloc(a, 30 * MiB, 0, S2);
  assert_ptr_equal(p, q);
  assert_int_equal(full.calls("aclrtStreamWaitEvent"), 1);
  assert_int_equal(gca_free(a, q), GCA_OK);
  full.hold_events(0);
  full.complete_events();
  assert_consistent(a);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* Threads allocating and freeing on both devices at once (ThreadSanitizer
 * runs this): each call sets its thread's device. */
typedef struct churn {
  gca_allocator_t *a;
  uint64_t seed;
  int failures;
} churn_t;

static void *churn_main(void *arg) {
  churn_t *c = arg;
  void *live[16] = {0};
  for (int step = 0; step < 2000; step++) {
    uint64_t r = next_random(&c->seed);
    int slot = (int)(r % 16);
    if (live[slot]) {
      if (gca_free(c->a, live[slot]) != GCA_OK) c->failures++;
      live[slot] = NULL;
    } else {
      live[slot] = gca_malloc(c->a, (r >> 8) % (4 * MiB) + 1, (int)((r >> 4) & 1), (r >> 5) & 1 ? S1 : S2);
      if (!live[slot]) c->failures++;
    }
  }
  for (int i = 0; i < 16; i++)
    if (live[i] && gca_free(c->a, live[i]) != GCA_OK) c->failures++;
  return NULL;
}

/* Refused frees are kept and offered again (label hardening): aclrtFree
 * refusing with 107000 (the runtime still holds the memory), a range
 * aclrtReleaseMemAddress refuses, an event aclrtDestroyEvent refuses; and
 * at close, each is tried again: the runtime holds nothing after. */
static void test_refused_frees_are_kept_and_retried(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  void *p = gca_malloc(a, 20 * MiB, 0, S1);
  assert_non_null(p);
  assert_int_equal(gca_free(a, p), GCA_OK);
  full.inject("aclrtFree", 0, 1, 107000);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).num_device_free_failures, 1);
  assert_true(gca_reserved_bytes(a, 0) >= (int64_t)(20 * MiB)); /* kept, and still the runtime's */
  assert_int_equal(full.used(0), gca_reserved_bytes(a, 0));
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(full.used(0), 0);
  assert_consistent(a);
  /* Refused at close, twice: the third try gives it back. */
  p = gca_malloc(a, 4 * MiB, 0, S1);
  assert_non_null(p);
  full.inject("aclrtFree", 0, 2, 107000);
  gca_close(a);
  assert_runtime_empty(&full);

  /* A range the runtime would not release: offered again at the next release. */
  full.reset();
  a = open_sim(SPEC, "expandable_segments:True");
  p = gca_malloc(a, 4 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  full.inject("aclrtReleaseMemAddress", 0, 1, 107000);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(full.live(LIVE_RESERVED), 1);
  assert_int_equal(full.live(LIVE_PHYSICAL), 0);
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(full.live(LIVE_RESERVED), 0);
  assert_consistent(a);
  gca_close(a);
  assert_runtime_empty(&full);

  /* Events the runtime would not destroy: after a failed record, and at close. */
  full.reset();
  a = open_sim(SPEC, NULL);
  p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  full.inject("aclrtRecordEvent", 0, 1, 107000);
  full.inject("aclrtDestroyEvent", 0, 1, 107000);
  (void)gca_free(a, p); /* (its event cannot be recorded: the free waits the stream out) */
  assert_consistent(a);
  void *q = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, q, S2), GCA_OK);
  assert_int_equal(gca_free(a, q), GCA_OK); /* an event recorded, kept in the cache at completion */
  full.complete_events();
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  full.inject("aclrtDestroyEvent", 0, 2, 107000);
  gca_close(a);
  assert_runtime_empty(&full);
}

static void test_threads(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  churn_t jobs[4];
  pthread_t t[4];
  for (int i = 0; i < 4; i++) {
    jobs[i] = (churn_t){a, 0x1234567u + (uint64_t)i * 7919, 0};
    assert_int_equal(pthread_create(&t[i], NULL, churn_main, &jobs[i]), 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    assert_int_equal(jobs[i].failures, 0);
  }
  assert_consistent(a);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* ---- out of memory: 207001 runs the ladder -------------------------------- */

static void test_ladder_on_207001(void **state) {
  (void)state;
  full.set_capacity((size_t)100 << 20);
  gca_allocator_t *a = open_sim(SPEC, "pad_32_bytes:False"); /* (round figures) */
  void *p = gca_malloc(a, 60 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* Full, with p's segment cached for S1: S2's request releases it and retries. */
  void *q = gca_malloc(a, 50 * MiB, 0, S2);
  assert_non_null(q);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_alloc_retries, 1);
  assert_int_equal(s.num_device_free, 1);
  /* An injected 207018 (device OOM) too. */
  full.inject("aclrtMallocAlign32", 0, 1, 207018);
  void *r = gca_malloc(a, 30 * MiB, 0, S2);
  assert_non_null(r);
  assert_int_equal(stats_of(a, 0).num_alloc_retries, 2);
  /* Beyond the device: gcalloc's message. */
  assert_null(gca_malloc(a, 200 * MiB, 0, S2));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "out of memory. Tried to allocate 200.00 MiB");
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_int_equal(gca_free(a, r), GCA_OK);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* ---- torch_npu's sizing ---------------------------------------------------- */

static void test_pad_by_soc(void **state) {
  (void)state;
  /* Ascend910B3: 32 bytes before rounding, so 1000 -> 1032 -> 1536 and a
   * request of exactly 512 takes 1024; 480 + 32 = 512 stays 512. */
  full.set_soc("Ascend910B3");
  gca_allocator_t *a = open_sim(SPEC, NULL);
  assert_int_equal(gca_round_size(a, 1000), 1536);
  assert_int_equal(gca_round_size(a, 512), 1024);
  assert_int_equal(gca_round_size(a, 480), 512);
  void *p = gca_malloc(a, 512, 0, S1);
  assert_int_equal(gca_usable_size(a, p), 1024);
  assert_int_equal(stats_of(a, 0).requested_bytes[GCA_POOL_ALL].current, 512);
  assert_int_equal(gca_free(a, p), GCA_OK);
  gca_close(a);
  /* Ascend950 and later, with CANN 9.1.0 and later: no pad. CANN's
   * version as torch_npu compares it: a pre-release comes before its
   * release; a version it cannot read, or none, counts as older. */
  full.set_soc("Ascend950PR_9589");
  const char *versions[] = {"9.1.0", "9.1.0-beta", "8.5.0", "10.0.0", "9.1.1.rc2", "9.2.0-rc", "", "9.1", "x.y.z"};
  const size_t pads[] = {0, 32, 32, 0, 0, 0, 32, 32, 32};
  for (int i = 0; i < 9; i++) {
    full.set_cann_version(versions[i]);
    a = open_sim(SPEC, NULL);
    if (gca_round_size(a, 512) != 512 + (pads[i] ? 512 : 0)) fprintf(stderr, "CANN %s\n", versions[i]);
    assert_int_equal(gca_round_size(a, 512), 512 + (pads[i] ? 512 : 0));
    gca_close(a);
  }
  full.set_cann_version("9.1.0");
  a = open_sim(SPEC, NULL);
  assert_int_equal(gca_round_size(a, 1000), 1024);
  assert_int_equal(gca_round_size(a, 512), 512);
  /* The key overrides the SoC, both ways. */
  assert_int_equal(gca_set_config(a, "pad_32_bytes:True"), GCA_OK);
  assert_int_equal(gca_round_size(a, 512), 1024);
  gca_close(a);
  full.set_soc("Ascend910B3");
  a = open_sim(SPEC, "pad_32_bytes:False");
  assert_int_equal(gca_round_size(a, 512), 512);
  gca_close(a);
  /* Other backends pad nothing unless asked. */
  a = open_sim("sim", NULL);
  assert_int_equal(gca_round_size(a, 512), 512);
  assert_int_equal(gca_set_config(a, "pad_32_bytes:True"), GCA_OK);
  assert_int_equal(gca_round_size(a, 512), 1024);
  assert_int_equal(gca_set_config(a, "pad_32_bytes:maybe"), GCA_ERR_CONFIG);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* ---- configuration: variables by backend, torch_npu's keys ---------------- */

static void unset_all(void) {
  const char *names[] = {"GCALLOC_ALLOC_CONF", "MINDTORCH_NPU_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF",
                         "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) unsetenv(names[i]);
}

static size_t split_of(const char *spec) {
  gca_allocator_t *a = open_sim(spec, NULL);
  size_t split = (size_t)stats_of(a, 0).max_split_size;
  gca_close(a);
  return split;
}

static void test_configuration_precedence(void **state) {
  (void)state;
  unset_all();
  setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:100", 1);
  setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:200", 1);
  assert_int_equal(split_of(SPEC), 200 * MiB);
  setenv("PYTORCH_NPU_ALLOC_CONF", "max_split_size_mb:300", 1);
  assert_int_equal(split_of(SPEC), 300 * MiB);
  assert_int_equal(split_of("sim"), 200 * MiB); /* not read elsewhere */
  setenv("MINDTORCH_NPU_ALLOC_CONF", "max_split_size_mb:400", 1);
  assert_int_equal(split_of(SPEC), 400 * MiB);
  setenv("GCALLOC_ALLOC_CONF", "max_split_size_mb:500", 1);
  assert_int_equal(split_of(SPEC), 500 * MiB);
  assert_int_equal(split_of("sim"), 500 * MiB);
  /* A malformed one is named. */
  setenv("MINDTORCH_NPU_ALLOC_CONF", "max_split_size_mb:x", 1);
  unsetenv("GCALLOC_ALLOC_CONF");
  gca_allocator_t *a = NULL;
  assert_int_equal(gca_open(SPEC, NULL, &a), GCA_ERR_CONFIG);
  assert_contains(gca_last_error(), "MINDTORCH_NPU_ALLOC_CONF");
  unset_all();
  setenv("GCALLOC_ALLOC_CONF", "", 1); /* (as CTest runs it) */
  assert_runtime_empty(&full);
}

static void test_npu_keys(void **state) {
  (void)state;
  log_capture_t cap = {0};
  gca_set_log_handler(capture_log, &cap);
  gca_allocator_t *a = open_sim(SPEC, "base_addr_aligned_kb:16,segment_size_mb:20,multi_stream_lazy_reclaim:False,"
                                      "release_lock_on_npumalloc:False,pinned_mem_register:True");
  assert_int_equal(cap.count, 0); /* defaults or built: nothing to warn of */
  char conf[1024];
  assert_true(gca_get_config(a, conf, sizeof conf) > 0);
  assert_contains(conf, "pinned_use_cuda_host_register:True");
  assert_int_equal(gca_set_config(a, "page_size:1g,base_addr_aligned_kb:4,throw_on_npumalloc_oom:True,"
                                     "pin_memory_expandable_segments:True,segment_size_mb:64"),
                   GCA_OK);
  assert_contains(cap.all, "'page_size:1g' is accepted but its feature is not built yet");
  assert_true(gca_get_config(a, conf, sizeof conf) > 0); /* (these two built: docs/acl.md, docs/oom.md) */
  assert_contains(conf, "base_addr_aligned_kb:4");
  assert_contains(conf, "throw_on_cudamalloc_oom:True");
  assert_contains(cap.all, "'pin_memory_expandable_segments' is accepted");
  assert_contains(cap.all, "'segment_size_mb' is accepted");
  assert_int_equal(gca_set_config(a, "segment_size_mb:1000"), GCA_ERR_CONFIG);
  assert_int_equal(gca_set_config(a, "page_size:2m"), GCA_ERR_CONFIG);
  assert_int_equal(gca_set_config(a, "base_addr_aligned_kb:17"), GCA_ERR_CONFIG);
  gca_set_log_handler(NULL, NULL);
  gca_close(a);
  assert_runtime_empty(&full);
}

/* torch_npu's base_addr_aligned_kb (16 on acl unless set): with expandable
 * segments a request of 2 MiB or more starts at a multiple of it, the bytes
 * below it a free block of their own; 0 turns it off. */
static void test_base_addr_aligned(void **state) {
  (void)state;
  full.set_capacity((size_t)512 << 20);
  const char *confs[] = {"expandable_segments:True", "expandable_segments:True,base_addr_aligned_kb:4",
                         "expandable_segments:True,base_addr_aligned_kb:0", "base_addr_aligned_kb:16"};
  const size_t align[] = {16384, 4096, 0, 0};
  for (int i = 0; i < 4; i++) {
    gca_allocator_t *a = open_sim(SPEC, confs[i]);
    char *first = gca_malloc(a, 1536 * KiB, 0, S1); /* (1.5 MiB, the pad, rounded: 1.5 MiB + 512) */
    char *second = gca_malloc(a, 4 * MiB, 0, S1);
    char *small = gca_malloc(a, 1 * MiB, 0, S1); /* under 2 MiB: never aligned */
    assert_non_null(first);
    assert_non_null(second);
    assert_non_null(small);
    size_t end = (size_t)(gca_usable_size(a, first));
    if (align[i]) {
      assert_int_equal((uintptr_t)second % align[i], 0);
      assert_true(second > first + end && second < first + end + align[i]);
    } else {
      assert_ptr_equal(second, first + end);
    }
    assert_consistent(a);
    assert_int_equal(gca_free(a, second), GCA_OK); /* the piece below merges back */
    assert_int_equal(gca_free(a, first), GCA_OK);
    assert_int_equal(gca_free(a, small), GCA_OK);
    assert_consistent(a);
    gca_close(a);
  }
  assert_runtime_empty(&full);
}

/* ---- random sequences under the invariant checker ------------------------- */

static void random_run(const char *conf, uint64_t seed) {
  full.reset();
  full.set_capacity((size_t)512 << 20);
  full.hold_events(1);
  gca_allocator_t *a = open_sim(SPEC, conf);
  void *live[64] = {0};
  uint64_t s = seed;
  for (int step = 0; step < 3000; step++) {
    uint64_t r = next_random(&s);
    int slot = (int)(r % 64), device = (int)((r >> 8) & 1);
    gca_stream_t stream = (r >> 9) & 1 ? S1 : S2;
    if (live[slot]) {
      if ((r >> 10) % 4 == 0) assert_int_equal(gca_record_stream(a, live[slot], stream == S1 ? S2 : S1), GCA_OK);
      assert_int_equal(gca_free(a, live[slot]), GCA_OK);
      live[slot] = NULL;
    } else {
      size_t size = (r >> 12) % 3 == 0 ? ((r >> 16) % (24 * MiB)) + 1 : ((r >> 16) % (512 * KiB)) + 1;
      live[slot] = gca_malloc(a, size, device, stream);
      if (!live[slot]) assert_int_equal(gca_last_status(), GCA_ERR_OOM);
    }
    if (step % 97 == 0) full.complete_events();
    if (step % 500 == 0) assert_consistent(a);
  }
  for (int i = 0; i < 64; i++)
    if (live[i]) assert_int_equal(gca_free(a, live[i]), GCA_OK);
  full.complete_events();
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(gca_reserved_bytes(a, 0) + gca_reserved_bytes(a, 1), 0);
  gca_close(a);
  full.hold_events(0);
  assert_runtime_empty(&full);
  assert_int_equal(full.live_events(), 0);
}

static void test_random_sequences(void **state) {
  (void)state;
  random_run(NULL, 0x9e3779b97f4a7c15ull);
  random_run("expandable_segments:True", 0x51ed27f1a2b3c4d5ull);
  random_run("max_split_size_mb:64,roundup_power2_divisions:4,garbage_collection_threshold:0.6,"
             "per_process_memory_fraction:0.8", 0x2545f4914f6cdd1dull);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_loading_failures, fresh),
      cmocka_unit_test_setup(test_allocation_and_facts, fresh),
      cmocka_unit_test_setup(test_minimal_runtime, fresh),
      cmocka_unit_test_setup(test_events_both_status_forms, fresh),
      cmocka_unit_test_setup(test_thread_that_never_set_a_device, fresh),
      cmocka_unit_test_setup(test_expandable_segments, fresh),
      cmocka_unit_test_setup(test_virtual_memory_probe_failing, fresh),
      cmocka_unit_test_setup(test_virtual_memory_probe_release_refused, fresh),
      cmocka_unit_test_setup(test_every_error_path, fresh),
      cmocka_unit_test_setup(test_more_error_paths, fresh),
      cmocka_unit_test_setup(test_refused_frees_are_kept_and_retried, fresh),
      cmocka_unit_test_setup(test_threads, fresh),
      cmocka_unit_test_setup(test_ladder_on_207001, fresh),
      cmocka_unit_test_setup(test_pad_by_soc, fresh),
      cmocka_unit_test_setup(test_device_discipline, fresh),
      cmocka_unit_test_setup(test_device_discipline_configured, fresh),
      cmocka_unit_test_setup(test_queue_drained_before_release, fresh),
      cmocka_unit_test_setup(test_waited_events, fresh),
      cmocka_unit_test_setup(test_erase_stream, fresh),
      cmocka_unit_test_setup(test_torch_npu_switches, fresh),
      cmocka_unit_test_setup(test_host_memory_needs_a_context, fresh),
      cmocka_unit_test_setup(test_configuration_precedence, fresh),
      cmocka_unit_test_setup(test_npu_keys, fresh),
      cmocka_unit_test_setup(test_base_addr_aligned, fresh),
      cmocka_unit_test_setup(test_random_sequences, fresh),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
