/* The CUDA backend (label cuda) against the test double of the driver
 * (tests/fake_cuda.c, loaded with "cuda:driver=PATH"): loading and the
 * clean "no CUDA driver" error; devices, properties, peers, priorities;
 * allocation on real (host) memory; events that stay pending; expandable
 * segments over real mappings; every driver error path, injected, turned
 * into a gcalloc status naming the driver call and the driver's error, with
 * the allocator left consistent; and seeded random sequences under the
 * invariant checker, after which the driver holds nothing.
 */
#include <dlfcn.h>

#include <time.h>

#include "helpers.h"

#define S1 ((gca_stream_t)0x1000)
#define S2 ((gca_stream_t)0x2000)

/* The double's control functions, from the copy the backend loads. */
static void *fake;
static void (*fake_reset)(void);
static void (*fake_fail)(const char *entry, unsigned skip, unsigned times, int code);
static unsigned long (*fake_calls)(const char *entry);
static void (*fake_set_capacity)(size_t bytes);
static void (*fake_set_devices)(int n);
static void (*fake_set_no_vmm)(int on);
static void (*fake_hold_events)(int on);
static void (*fake_complete_events)(void);
static size_t (*fake_used)(int device);
static size_t (*fake_live)(int kind);
static size_t (*fake_live_events)(void);
static int (*fake_retained)(int device);
static int (*fake_access)(uintptr_t addr);

enum { LIVE_DEVICE = 1, LIVE_HOST = 2, LIVE_RESERVED = 3, LIVE_MAPPED = 4, LIVE_PHYSICAL = 5, LIVE_REGISTERED = 6 };

#define SPEC "cuda:driver=" FAKE_CUDA_PATH

static int setup(void **state) {
  (void)state;
  fake = dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_LOCAL);
  if (!fake) {
    fprintf(stderr, "cannot load the driver double %s: %s\n", FAKE_CUDA_PATH, dlerror());
    return -1;
  }
#define LOAD(var, name) *(void **)&var = dlsym(fake, name)
  LOAD(fake_reset, "fakecuda_reset");
  LOAD(fake_fail, "fakecuda_fail");
  LOAD(fake_calls, "fakecuda_calls");
  LOAD(fake_set_capacity, "fakecuda_set_capacity");
  LOAD(fake_set_devices, "fakecuda_set_devices");
  LOAD(fake_set_no_vmm, "fakecuda_set_no_vmm");
  LOAD(fake_hold_events, "fakecuda_hold_events");
  LOAD(fake_complete_events, "fakecuda_complete_events");
  LOAD(fake_used, "fakecuda_used");
  LOAD(fake_live, "fakecuda_live");
  LOAD(fake_live_events, "fakecuda_live_events");
  LOAD(fake_retained, "fakecuda_retained");
  LOAD(fake_access, "fakecuda_access");
#undef LOAD
  return fake_retained && fake_access ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  if (fake) dlclose(fake);
  return 0;
}

static int fresh(void **state) {
  (void)state;
  fake_reset();
  fake_set_capacity((size_t)1 << 30);
  return 0;
}

/* After gca_close: the driver holds nothing of ours. */
static void assert_driver_empty(void) {
  assert_int_equal(fake_used(0), 0);
  assert_int_equal(fake_used(1), 0);
  assert_int_equal(fake_live(LIVE_DEVICE), 0);
  assert_int_equal(fake_live(LIVE_HOST), 0);
  assert_int_equal(fake_live(LIVE_RESERVED), 0);
  assert_int_equal(fake_live(LIVE_MAPPED), 0);
  assert_int_equal(fake_live(LIVE_PHYSICAL), 0);
  assert_int_equal(fake_live(LIVE_REGISTERED), 0);
  assert_int_equal(fake_live_events(), 0);
  assert_int_equal(fake_retained(0), 0);
  assert_int_equal(fake_retained(1), 0);
}

static void assert_error(int rc, int status, const char *a, const char *b) {
  if (rc != status || !strstr(gca_last_error(), a) || !strstr(gca_last_error(), b))
    fprintf(stderr, "status %d (wanted %d): %s\n", rc, status, gca_last_error());
  assert_int_equal(rc, status);
  assert_non_null(strstr(gca_last_error(), a));
  assert_non_null(strstr(gca_last_error(), b));
}

/* ---- loading ----------------------------------------------------------- */

static void test_no_driver(void **state) {
  (void)state;
  gca_allocator_t *a = NULL;
  assert_error(gca_open("cuda:driver=/nonexistent/libcuda.so.1", NULL, &a), GCA_ERR_BACKEND, "no CUDA driver",
               "/nonexistent/libcuda.so.1");
  assert_null(a);
  /* GCALLOC_CUDA_DRIVER names it when the spec does not. */
  setenv("GCALLOC_CUDA_DRIVER", "/nonexistent/other.so", 1);
  assert_error(gca_open("cuda", NULL, &a), GCA_ERR_BACKEND, "no CUDA driver", "/nonexistent/other.so");
  unsetenv("GCALLOC_CUDA_DRIVER");
  /* The real one, where the host has none (CI): the same clean error. */
  void *real = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (real) {
    dlclose(real);
  } else {
    assert_error(gca_open("cuda", NULL, &a), GCA_ERR_BACKEND, "no CUDA driver", "libcuda.so.1");
  }
  /* A library that is not a CUDA driver. */
  assert_error(gca_open("cuda:driver=libm.so.6", NULL, &a), GCA_ERR_BACKEND, "has no cuInit", "libm.so.6");
  assert_error(gca_open("cuda:devices=2", NULL, &a), GCA_ERR_BACKEND, "unknown option", "devices=2");
  /* The sim still opens: nothing was left behind. */
  a = open_sim("sim", NULL);
  gca_close(a);
}

static void test_open_failures(void **state) {
  (void)state;
  gca_allocator_t *a = NULL;
  fake_fail("cuInit", 0, 1, 999);
  assert_error(gca_open(SPEC, NULL, &a), GCA_ERR_BACKEND, "cuInit", "CUDA_ERROR_UNKNOWN");
  fake_set_devices(0);
  assert_error(gca_open(SPEC, NULL, &a), GCA_ERR_BACKEND, "sees no CUDA device", FAKE_CUDA_PATH);
  fake_set_devices(2);
  /* A device's primary context is retained at the device's first use, not
   * at open; when it cannot be had, that use fails and the next tries again. */
  a = open_sim(SPEC, NULL);
  assert_int_equal(fake_retained(0) + fake_retained(1), 0);
  fake_fail("cuDevicePrimaryCtxRetain", 0, 1, 101);
  assert_null(gca_malloc(a, MiB, 1, S1));
  assert_error(GCA_ERR_BACKEND, GCA_ERR_BACKEND, "cuDevicePrimaryCtxRetain (device 1)", "CUDA_ERROR_INVALID_DEVICE");
  void *p = gca_malloc(a, MiB, 1, S1);
  assert_non_null(p);
  assert_int_equal(fake_retained(0), 0);
  assert_int_equal(fake_retained(1), 1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  gca_close(a);
  assert_driver_empty();
}

/* The thread's context is the framework's: every call puts it back, and no
 * device's context is made before the device is used. */
typedef struct ctx_job {
  gca_allocator_t *a;
  void *before, *after;
  int rc;
} ctx_job_t;

static void *allocate_on_a_thread_without_context(void *arg) {
  ctx_job_t *j = arg;
  int (*get)(void **) = (int (*)(void **))dlsym(fake, "cuCtxGetCurrent");
  get(&j->before);
  void *p = gca_malloc(j->a, MiB, 2, S1);
  j->rc = p ? gca_free(j->a, p) : GCA_ERR_OOM;
  get(&j->after);
  return NULL;
}

static void test_context_discipline(void **state) {
  (void)state;
  int (*retain)(void **, int) = (int (*)(void **, int))dlsym(fake, "cuDevicePrimaryCtxRetain");
  int (*release)(int) = (int (*)(int))dlsym(fake, "cuDevicePrimaryCtxRelease_v2");
  int (*get)(void **) = (int (*)(void **))dlsym(fake, "cuCtxGetCurrent");
  int (*set)(void *) = (int (*)(void *))dlsym(fake, "cuCtxSetCurrent");
  int (*init)(unsigned) = (int (*)(unsigned))dlsym(fake, "cuInit");
  fake_set_devices(8);
  assert_int_equal(init(0), 0);
  void *mine = NULL, *now = NULL;
  assert_int_equal(retain(&mine, 0), 0); /* the framework, on device 0 */
  assert_int_equal(set(mine), 0);
  gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True,per_process_memory_fraction:0.9");
  for (int i = 0; i < 8; i++) assert_int_equal(fake_retained(i), i == 0);
  void *p = gca_malloc(a, 30 * MiB, 1, S1), *small = gca_malloc(a, 4096, 3, S1);
  assert_non_null(p);
  assert_non_null(small);
  get(&now);
  assert_ptr_equal(now, mine);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_free(a, small), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  void *h = gca_host_malloc(a, 4096);
  assert_non_null(h);
  assert_int_equal(gca_host_free(a, h), GCA_OK);
  get(&now);
  assert_ptr_equal(now, mine);
  for (int i = 0; i < 8; i++) assert_int_equal(fake_retained(i), i == 0 || i == 1 || i == 3);
  /* A thread with no context is left with none. */
  ctx_job_t j = {a, NULL, NULL, -1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, allocate_on_a_thread_without_context, &j), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(j.rc, GCA_OK);
  assert_null(j.before);
  assert_null(j.after);
  gca_close(a);
  get(&now);
  assert_ptr_equal(now, mine);
  for (int i = 0; i < 8; i++) assert_int_equal(fake_retained(i), i == 0);
  assert_int_equal(release(0), 0);
  assert_int_equal(set(NULL), 0);
  fake_set_devices(2);
  assert_driver_empty();
}

/* ---- the basics ---------------------------------------------------------- */

static void test_devices_and_memory(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  assert_string_equal(gca_backend_name(a), "cuda");
  assert_int_equal(gca_device_count(a), 2);
  gca_device_properties_t p;
  assert_int_equal(gca_device_properties(a, 1, &p), GCA_OK);
  assert_string_equal(p.name, "gcalloc fake CUDA device");
  assert_int_equal(p.major, 9);
  assert_int_equal(p.minor, 0);
  assert_int_equal(p.multiprocessor_count, 132);
  assert_int_equal(p.total_memory, (uint64_t)1 << 30);
  size_t free_bytes = 0, total = 0;
  assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
  assert_int_equal(total, (size_t)1 << 30);
  /* Real memory behind each device's allocations; one 2 MiB segment for a small request. */
  char *x = gca_malloc(a, 1000, 0, 0), *y = gca_malloc(a, 5 * MiB, 1, S1);
  assert_non_null(x);
  assert_non_null(y);
  memset(x, 0xab, 1000);
  memset(y, 0xcd, 5 * MiB);
  assert_int_equal(fake_used(0), 2 * MiB);
  assert_int_equal(fake_used(1), 20 * MiB);
  assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
  assert_int_equal(free_bytes, ((size_t)1 << 30) - 2 * MiB);
  assert_int_equal(stats_of(a, 1).reserved_bytes[GCA_POOL_ALL].current, 20 * MiB);
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_free(a, y), GCA_ERR_BAD_POINTER);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(fake_used(0) + fake_used(1), 0);
  assert_consistent(a);
  /* Peers and priorities. */
  int can = 0, least = 1, greatest = 1;
  assert_int_equal(gca_can_access_peer(a, 0, 1, &can), GCA_OK);
  assert_int_equal(can, 1);
  assert_int_equal(gca_enable_peer_access(a, 0, 1), GCA_OK);
  assert_error(gca_enable_peer_access(a, 0, 1), GCA_ERR_BACKEND, "cuCtxEnablePeerAccess",
               "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED");
  assert_int_equal(gca_disable_peer_access(a, 0, 1), GCA_OK);
  assert_error(gca_disable_peer_access(a, 0, 1), GCA_ERR_BACKEND, "cuCtxDisablePeerAccess",
               "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED");
  assert_error(gca_enable_peer_access(a, 1, 1), GCA_ERR_INVALID, "its own peer", "device 1");
  assert_error(gca_can_access_peer(a, 0, 2, &can), GCA_ERR_INVALID, "device 2", "does not exist");
  assert_int_equal(gca_stream_priority_range(a, 1, &least, &greatest), GCA_OK);
  assert_int_equal(least, 0);
  assert_int_equal(greatest, -5);
  gca_close(a);
  assert_driver_empty();
  /* The sim has device facts but no peers. */
  a = open_sim("sim:capacity=4GiB", NULL);
  assert_int_equal(gca_device_properties(a, 0, &p), GCA_OK);
  assert_string_equal(p.name, "gcalloc sim device");
  assert_int_equal(p.total_memory, (uint64_t)4 << 30);
  assert_error(gca_can_access_peer(a, 0, 0, &can), GCA_ERR_INVALID, "its own peer", "device 0");
  assert_error(gca_stream_priority_range(a, 0, &least, &greatest), GCA_ERR_BACKEND, "sim backend", "does not offer");
  gca_close(a);
}

/* A block used on another stream waits for that stream's event. */
static void test_events_pending(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  fake_hold_events(1);
  void *p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 1);
  assert_int_equal(gca_process_events(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 1); /* cuEventQuery: CUDA_ERROR_NOT_READY */
  /* Another request of the stream does not get the pending block. */
  void *q = gca_malloc(a, 4096, 0, S1);
  assert_ptr_not_equal(p, q);
  fake_complete_events();
  assert_int_equal(gca_process_events(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 1); /* q only */
  /* gca_synchronize waits with cuEventSynchronize. */
  assert_int_equal(gca_record_stream(a, q, S2), GCA_OK);
  assert_int_equal(gca_free(a, q), GCA_OK);
  unsigned long syncs = fake_calls("cuEventSynchronize");
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  assert_true(fake_calls("cuEventSynchronize") > syncs);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 0);
  assert_consistent(a);
  gca_close(a);
  assert_driver_empty();
}

/* Expandable segments over the driver's virtual memory: real mappings. */
static void test_expandable_segments(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
  char *x = gca_malloc(a, 30 * MiB, 0, S1), *y = gca_malloc(a, 50 * MiB, 0, S1);
  assert_non_null(x);
  assert_ptr_equal(y, x + 30 * MiB);
  memset(x, 1, 80 * MiB); /* both, across page boundaries: all mapped read-write */
  assert_int_equal(fake_live(LIVE_RESERVED), 1);
  assert_int_equal(fake_live(LIVE_MAPPED), 4); /* four 20 MiB pages */
  assert_int_equal(fake_used(0), 80 * MiB);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 80 * MiB);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(fake_live(LIVE_MAPPED), 2); /* [40, 80) MiB unmapped; [30, 40) shares a page with x */
  assert_int_equal(fake_used(0), 40 * MiB);
  memset(x, 2, 30 * MiB);
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(fake_live(LIVE_MAPPED) + fake_live(LIVE_RESERVED) + fake_live(LIVE_PHYSICAL), 0);
  assert_consistent(a);
  gca_close(a);
  assert_driver_empty();
  /* A device without virtual memory management: ordinary segments, and a warning. */
  fake_set_no_vmm(1);
  log_capture_t log = {0};
  gca_set_log_handler(capture_log, &log);
  a = open_sim(SPEC, "expandable_segments:True");
  x = gca_malloc(a, 30 * MiB, 0, S1); /* (virtual memory is asked at the device's first segment) */
  gca_set_log_handler(NULL, NULL);
  assert_non_null(strstr(log.all, "expandable_segments:True: device 0 of backend cuda has no virtual memory"));
  assert_int_equal(stats_of(a, 0).segment[GCA_POOL_ALL].current, 1);
  assert_int_equal(fake_live(LIVE_RESERVED), 0);
  assert_int_equal(gca_free(a, x), GCA_OK);
  gca_close(a);
  assert_driver_empty();
}

/* ---- every driver error path --------------------------------------------- */

typedef struct error_case {
  const char *entry;
  int code;
  const char *code_name;
  int status;
} error_case_t;

static void test_allocation_errors(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  void *keep = gca_malloc(a, 1000, 0, 0);
  /* Out of memory from the driver: the core's ladder, then PyTorch's OOM message. */
  fake_fail("cuMemAlloc_v2", 0, 100, 2);
  assert_null(gca_malloc(a, 100 * MiB, 0, 0));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  assert_non_null(strstr(gca_last_error(), "out of memory"));
  fake_reset();
  /* Any other driver failure is final, and named. */
  fake_fail("cuMemAlloc_v2", 0, 1, 999);
  assert_null(gca_malloc(a, 100 * MiB, 0, 0));
  assert_error(gca_last_status(), GCA_ERR_BACKEND, "cuMemAlloc_v2 (104857600 bytes, device 0)", "CUDA_ERROR_UNKNOWN");
  /* A refused device free keeps the segment cached and counts it. */
  void *big = gca_malloc(a, 100 * MiB, 0, 0);
  assert_int_equal(gca_free(a, big), GCA_OK);
  fake_fail("cuMemFree_v2", 0, 1, 999);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).num_device_free_failures, 1);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 100 * MiB);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 0);
  /* So does one refused as an invalid value (the driver may still hold it),
   * and one refused twice at close goes at the third try. */
  big = gca_malloc(a, 100 * MiB, 0, 0);
  assert_int_equal(gca_free(a, big), GCA_OK);
  fake_fail("cuMemFree_v2", 0, 1, 1);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).num_device_free_failures, 2);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 100 * MiB);
  assert_int_equal(fake_used(0), 100 * MiB + 2 * MiB);
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 0);
  size_t f, t;
  fake_fail("cuMemGetInfo_v2", 0, 1, 201);
  assert_error(gca_mem_get_info(a, 0, &f, &t), GCA_ERR_BACKEND, "cuMemGetInfo_v2", "CUDA_ERROR_INVALID_CONTEXT");
  gca_device_properties_t p;
  static const char *const facts[] = {"cuDeviceGetName", "cuDeviceGetAttribute", "cuDeviceTotalMem_v2"};
  for (size_t i = 0; i < 3; i++) {
    fake_fail(facts[i], 0, 1, 999);
    assert_error(gca_device_properties(a, 0, &p), GCA_ERR_BACKEND, facts[i], "CUDA_ERROR_UNKNOWN");
  }
  int can, least, greatest;
  fake_fail("cuDeviceCanAccessPeer", 0, 1, 101);
  assert_error(gca_can_access_peer(a, 0, 1, &can), GCA_ERR_BACKEND, "cuDeviceCanAccessPeer", "CUDA_ERROR_INVALID_DEVICE");
  fake_fail("cuCtxGetStreamPriorityRange", 0, 1, 999);
  assert_error(gca_stream_priority_range(a, 0, &least, &greatest), GCA_ERR_BACKEND, "cuCtxGetStreamPriorityRange",
               "CUDA_ERROR_UNKNOWN");
  /* Without the primary context current, nothing is asked of the driver. */
  void *other_ctx = NULL;
  int (*set_current)(void *) = (int (*)(void *))dlsym(fake, "cuCtxSetCurrent");
  set_current(other_ctx);
  fake_fail("cuCtxSetCurrent", 0, 1, 201);
  assert_error(gca_mem_get_info(a, 0, &f, &t), GCA_ERR_BACKEND, "cuCtxSetCurrent", "CUDA_ERROR_INVALID_CONTEXT");
  assert_int_equal(gca_mem_get_info(a, 0, &f, &t), GCA_OK);
  assert_int_equal(gca_free(a, keep), GCA_OK);
  assert_consistent(a);
  void *left = gca_malloc(a, 4 * MiB, 0, 0);
  assert_non_null(left);
  fake_fail("cuMemFree_v2", 0, 2, 1);
  gca_close(a);
  assert_driver_empty();
}

static void test_event_errors(void **state) {
  (void)state;
  /* Event failures are handled by waiting for the stream instead: the
   * block is reused only once that stream's work is done, and the
   * allocator stays consistent. */
  static const error_case_t cases[] = {
      {"cuEventCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY", 0},
      {"cuEventRecord", 999, "CUDA_ERROR_UNKNOWN", 0},
      {"cuEventQuery", 999, "CUDA_ERROR_UNKNOWN", 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    fake_reset();
    gca_allocator_t *a = open_sim(SPEC, NULL);
    fake_hold_events(1);
    void *p = gca_malloc(a, 4096, 0, S1);
    assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
    fake_fail(cases[i].entry, 0, 1, cases[i].code);
    log_capture_t log = {0};
    gca_set_log_handler(capture_log, &log);
    assert_int_equal(gca_free(a, p), GCA_OK);
    assert_int_equal(gca_process_events(a, 0), GCA_OK);
    fake_complete_events();
    assert_int_equal(gca_synchronize(a, 0), GCA_OK);
    gca_set_log_handler(NULL, NULL);
    if (!strstr(log.all, cases[i].code_name)) fprintf(stderr, "%s: logged %s\n", cases[i].entry, log.all);
    assert_non_null(strstr(log.all, cases[i].entry));
    assert_non_null(strstr(log.all, cases[i].code_name));
    assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 0);
    assert_consistent(a);
    gca_close(a);
    assert_driver_empty();
  }
  /* Events the driver will not destroy: after a failed record (kept, and
   * destroyed at the next destroy), and at close (tried again). */
  fake_reset();
  gca_allocator_t *a = open_sim(SPEC, NULL);
  void *p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  fake_fail("cuEventRecord", 0, 1, 999);
  fake_fail("cuEventDestroy_v2", 0, 1, 999);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(fake_live_events(), 1); /* (kept: the driver still has it) */
  p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  fake_fail("cuEventDestroy_v2", 0, 2, 999);
  gca_close(a);
  assert_driver_empty();
}

/* Peer access reaches expandable segments: cuCtxEnablePeerAccess does not
 * cover cuMemMap'd memory, so each mapping's access is set for the peer. */
static void test_peer_access_to_mappings(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
  const int own1 = 1 << 1, both = (1 << 0) | (1 << 1);
  char *p = gca_malloc(a, 30 * MiB, 1, S1);
  char *r = gca_malloc(a, 30 * MiB, 0, S1);
  assert_non_null(p);
  assert_int_equal(fake_access((uintptr_t)p), own1);
  /* Device 0 may use device 1's memory: what is mapped already, and what is mapped next. */
  assert_int_equal(gca_enable_peer_access(a, 0, 1), GCA_OK);
  assert_int_equal(fake_access((uintptr_t)p), both);
  assert_int_equal(fake_access((uintptr_t)p + 30 * MiB - 1), both);
  char *q = gca_malloc(a, 60 * MiB, 1, S1);
  assert_non_null(q);
  assert_int_equal(fake_access((uintptr_t)q + 60 * MiB - 1), both);
  assert_int_equal(fake_access((uintptr_t)r), 1 << 0); /* the other direction is not enabled */
  memset(q, 3, 60 * MiB);
  /* Disabled: the peer's access is taken back from every mapping. */
  assert_int_equal(gca_disable_peer_access(a, 0, 1), GCA_OK);
  assert_int_equal(fake_access((uintptr_t)p), own1);
  assert_int_equal(fake_access((uintptr_t)q + 60 * MiB - 1), own1);
  /* A mapping's access refused: nothing enabled (a second try is not "already enabled"). */
  fake_fail("cuMemSetAccess", 0, 1, 999);
  assert_error(gca_enable_peer_access(a, 0, 1), GCA_ERR_BACKEND, "cuMemSetAccess", "peer access not enabled");
  assert_int_equal(fake_access((uintptr_t)p), own1);
  assert_int_equal(gca_enable_peer_access(a, 0, 1), GCA_OK);
  assert_int_equal(fake_access((uintptr_t)p), both);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_int_equal(gca_free(a, r), GCA_OK);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  /* Mapped again after the unmap: still opened to the enabled peer. */
  p = gca_malloc(a, 30 * MiB, 1, S1);
  assert_int_equal(fake_access((uintptr_t)p), both);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_consistent(a);
  gca_close(a);
  assert_driver_empty();
}

/* ---- the pinned host allocator over the driver -------------------------- */

/* The statistics, the cache checked first. */
static gca_host_stats_t checked_host_stats(gca_allocator_t *a) {
  assert_int_equal(gca__host_cache_check(a), GCA_OK);
  return host_stats(a);
}

static void test_pinned_host(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  char *p = gca_host_malloc(a, 3000);
  assert_non_null(p);
  assert_int_equal(fake_calls("cuMemHostAlloc"), 1);
  assert_int_equal(fake_live(LIVE_HOST), 1);
  assert_int_equal(gca_host_usable_size(a, p), 4096);
  memset(p, 1, 4096);
  int pinned = 0;
  assert_int_equal(gca_host_is_pinned(a, p + 4000, &pinned), GCA_OK);
  assert_int_equal(pinned, 1);
  /* Memory the allocator does not know: the driver is asked. */
  char *plain = malloc(64);
  assert_int_equal(gca_host_is_pinned(a, plain, &pinned), GCA_OK);
  assert_int_equal(pinned, 0);
  assert_int_equal(fake_calls("cuPointerGetAttribute"), 1);
  free(plain);

  /* Used on a stream of device 1: reused only after its event completes. */
  fake_hold_events(1);
  assert_int_equal(gca_host_record_stream(a, p, 1, S1), GCA_OK);
  assert_int_equal(gca_host_free(a, p), GCA_OK);
  assert_int_equal(fake_calls("cuEventRecord"), 1);
  char *q = gca_host_malloc(a, 3000);
  assert_true(q != p);
  assert_int_equal(fake_calls("cuMemHostAlloc"), 2);
  fake_complete_events();
  assert_ptr_equal(gca_host_malloc(a, 4096), p);
  assert_int_equal(checked_host_stats(a).pending_blocks, 0);
  assert_int_equal(gca_host_free(a, p), GCA_OK);
  assert_int_equal(gca_host_free(a, q), GCA_OK);
  assert_int_equal(gca_host_empty_cache(a), GCA_OK);
  assert_int_equal(fake_calls("cuMemFreeHost"), 2);
  assert_int_equal(fake_live(LIVE_HOST), 0);

  /* The register path: malloc, touch, cuMemHostRegister; undone in reverse. */
  assert_int_equal(gca_set_config(a, "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"), GCA_OK);
  char *r = gca_host_malloc(a, 256 * KiB);
  assert_non_null(r);
  memset(r, 2, 256 * KiB);
  assert_int_equal(fake_calls("cuMemHostRegister_v2"), 1);
  assert_int_equal(fake_live(LIVE_REGISTERED), 1);
  assert_int_equal(gca_host_is_pinned(a, r, &pinned), GCA_OK);
  assert_int_equal(pinned, 1);
  assert_int_equal(gca_host_free(a, r), GCA_OK);
  assert_int_equal(gca_host_empty_cache(a), GCA_OK);
  assert_int_equal(fake_calls("cuMemHostUnregister"), 1);
  assert_int_equal(fake_live(LIVE_REGISTERED), 0);
  /* Blocks still in use at close are unpinned with it. */
  assert_non_null(gca_host_malloc(a, 100));
  gca_close(a);
  assert_driver_empty();
}

/* The pinned allocator's reserve segment and background thread on the
 * driver: one cuMemHostAlloc for the segment, blocks carved from it, a
 * freed block collected by the thread (cuEventQuery from a thread of its
 * own) with no allocation, the segment kept through empty_cache and freed
 * at close. */
static void test_pinned_host_reserve_and_thread(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, "pinned_reserve_segment_size_mb:1,pinned_use_background_threads:True");
  char *p = gca_host_malloc(a, 3000), *q = gca_host_malloc(a, 100);
  assert_non_null(p);
  assert_non_null(q);
  assert_int_equal(q - p, 4096);
  assert_int_equal(fake_calls("cuMemHostAlloc"), 1);
  assert_int_equal(fake_live(LIVE_HOST), 1);
  memset(p, 1, 4096);
  fake_hold_events(1);
  assert_int_equal(gca_host_record_stream(a, p, 1, S1), GCA_OK);
  assert_int_equal(gca_host_free(a, p), GCA_OK);
  assert_int_equal(checked_host_stats(a).pending_blocks, 1);
  fake_complete_events();
  gca_host_stats_t s = checked_host_stats(a);
  for (int i = 0; i < 2000 && s.pending_blocks; i++) { /* up to 2 s for the thread's next round */
    struct timespec pause = {0, 1000000};
    nanosleep(&pause, NULL);
    s = checked_host_stats(a);
  }
  assert_int_equal(s.pending_blocks, 0);
  assert_int_equal(s.num_event_errors, 0);
  assert_int_equal(gca_host_free(a, q), GCA_OK);
  assert_int_equal(gca_host_empty_cache(a), GCA_OK);
  assert_int_equal(fake_calls("cuMemFreeHost"), 0); /* carved blocks stay, and the segment */
  assert_int_equal(fake_live(LIVE_HOST), 1);
  fake_hold_events(0);
  gca_close(a);
  assert_int_equal(fake_calls("cuMemFreeHost"), 1);
  assert_driver_empty();
}

static void test_pinned_host_errors(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(SPEC, NULL);
  /* Out of memory with nothing cached: the driver's error, named. */
  fake_fail("cuMemHostAlloc", 0, 1, 2);
  assert_null(gca_host_malloc(a, 5000));
  assert_error(gca_last_status(), GCA_ERR_OOM, "cuMemHostAlloc", "CUDA_ERROR_OUT_OF_MEMORY");
  assert_non_null(strstr(gca_last_error(), "rounded to 8192"));
  /* With a block cached: it is given back and the pin tried again. */
  void *p = gca_host_malloc(a, 5000);
  assert_non_null(p);
  assert_int_equal(gca_host_free(a, p), GCA_OK);
  fake_fail("cuMemHostAlloc", 0, 1, 2);
  void *q = gca_host_malloc(a, 100000);
  assert_non_null(q);
  gca_host_stats_t st = checked_host_stats(a);
  assert_int_equal(st.num_alloc_retries, 1);
  assert_int_equal(st.num_host_free, 1);
  /* Another failure is final at once. */
  fake_fail("cuMemHostAlloc", 0, 1, 999);
  assert_null(gca_host_malloc(a, 1));
  assert_error(gca_last_status(), GCA_ERR_BACKEND, "cuMemHostAlloc", "CUDA_ERROR_UNKNOWN");
  assert_int_equal(checked_host_stats(a).num_alloc_retries, 1);

  /* A refused unpin: the block stays cached and pinned; the next try unpins it. */
  assert_int_equal(gca_host_free(a, q), GCA_OK);
  fake_fail("cuMemFreeHost", 0, 1, 999);
  assert_error(gca_host_empty_cache(a), GCA_ERR_BACKEND, "cuMemFreeHost", "CUDA_ERROR_UNKNOWN");
  assert_non_null(strstr(gca_last_error(), "stays pinned"));
  st = checked_host_stats(a);
  assert_int_equal(st.segment.current, 1);
  assert_int_equal(st.cached_bytes, 128 * (int64_t)KiB);
  assert_int_equal(gca_host_empty_cache(a), GCA_OK);
  assert_int_equal(checked_host_stats(a).segment.current, 0);

  /* Registering refused: the driver's error, the malloc'd memory given back. */
  assert_int_equal(gca_set_config(a, "pinned_use_cuda_host_register:True"), GCA_OK);
  fake_fail("cuMemHostRegister_v2", 0, 1, 712);
  assert_null(gca_host_malloc(a, 4096));
  assert_error(gca_last_status(), GCA_ERR_BACKEND, "cuMemHostRegister", "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED");
  fake_fail("cuMemHostUnregister", 0, 1, 713);
  void *r = gca_host_malloc(a, 4096);
  assert_int_equal(gca_host_free(a, r), GCA_OK);
  assert_error(gca_host_empty_cache(a), GCA_ERR_BACKEND, "cuMemHostUnregister",
               "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED");
  assert_int_equal(gca_host_empty_cache(a), GCA_OK);
  assert_int_equal(fake_live(LIVE_REGISTERED), 0);
  assert_int_equal(gca_set_config(a, "pinned_use_cuda_host_register:False"), GCA_OK);

  /* Event failures: the stream is waited for instead, and the log says so. */
  /* cuEventCreate first: later frees reuse the backend's cached events. */
  static const char *const entries[] = {"cuEventCreate", "cuEventRecord", "cuEventQuery"};
  for (size_t i = 0; i < 3; i++) {
    fake_hold_events(1);
    void *b = gca_host_malloc(a, 4096);
    assert_int_equal(gca_host_record_stream(a, b, 0, S2), GCA_OK);
    unsigned long syncs = fake_calls("cuStreamSynchronize");
    fake_fail(entries[i], 0, 1, 999);
    log_capture_t log = {0};
    gca_set_log_handler(capture_log, &log);
    assert_int_equal(gca_host_free(a, b), GCA_OK);
    assert_ptr_equal(gca_host_malloc(a, 4096), b); /* waited for: reusable */
    gca_set_log_handler(NULL, NULL);
    assert_int_equal(fake_calls("cuStreamSynchronize"), syncs + 1);
    assert_non_null(strstr(log.all, entries[i]));
    assert_non_null(strstr(log.all, "CUDA_ERROR_UNKNOWN"));
    assert_int_equal(checked_host_stats(a).num_event_errors, (int64_t)i + 1);
    assert_int_equal(gca_host_free(a, b), GCA_OK);
    fake_complete_events();
    fake_hold_events(0);
  }
  gca_close(a);
  assert_driver_empty();
}

static void test_virtual_memory_errors(void **state) {
  (void)state;
  static const error_case_t cases[] = {
      {"cuMemAddressReserve", 999, "CUDA_ERROR_UNKNOWN", GCA_ERR_BACKEND},
      {"cuMemCreate", 999, "CUDA_ERROR_UNKNOWN", GCA_ERR_BACKEND},
      {"cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE", GCA_ERR_INVALID},
      {"cuMemSetAccess", 999, "CUDA_ERROR_UNKNOWN", GCA_ERR_BACKEND},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    fake_reset();
    gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
    fake_fail(cases[i].entry, 0, 1, cases[i].code);
    assert_null(gca_malloc(a, 30 * MiB, 0, S1));
    assert_error(gca_last_status(), cases[i].status, cases[i].entry, cases[i].code_name);
    /* Nothing half-made is left mapped, and the next try works. */
    assert_int_equal(fake_live(LIVE_MAPPED), 0);
    assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
    assert_consistent(a);
    void *p = gca_malloc(a, 30 * MiB, 0, S1);
    assert_non_null(p);
    assert_int_equal(gca_free(a, p), GCA_OK);
    gca_close(a);
    assert_driver_empty();
  }
  /* Physical memory runs out: the ladder, then the OOM message. */
  fake_reset();
  gca_allocator_t *a = open_sim(SPEC, "expandable_segments:True");
  fake_fail("cuMemCreate", 0, 100, 2);
  assert_null(gca_malloc(a, 30 * MiB, 0, S1));
  assert_int_equal(gca_last_status(), GCA_ERR_OOM);
  fake_reset();
  /* An unmap the driver refuses keeps the pages mapped and cached. */
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  fake_fail("cuMemUnmap", 0, 1, 999);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).num_device_free_failures, 1);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 40 * MiB);
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
  gca_close(a);
  assert_driver_empty();
}

/* ---- random sequences ----------------------------------------------------- */

static uint64_t rng;
static uint64_t below(uint64_t n) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng % n;
}

static void random_run(const char *conf, uint64_t seed) {
  fake_reset();
  fake_set_capacity((size_t)256 << 20);
  rng = seed;
  gca_allocator_t *a = open_sim(SPEC, conf);
  enum { SLOTS = 64 };
  void *slots[SLOTS] = {0};
  int ooms = 0;
  for (int op = 0; op < 4000; op++) {
    int s = (int)below(SLOTS);
    uint64_t r = below(100);
    int device = s & 1;
    gca_stream_t stream = (gca_stream_t)(0x1000 * (below(2) + 1));
    if (r < 45 && !slots[s]) {
      size_t size = below(4) == 0 ? below(40 * MiB) + 1 : below(MiB) + 1;
      slots[s] = gca_malloc(a, size, device, stream);
      if (!slots[s]) {
        assert_int_equal(gca_last_status(), GCA_ERR_OOM);
        ooms++;
      } else {
        memset(slots[s], (int)s, size < 4096 ? size : 4096); /* device memory is real here */
      }
    } else if (r < 55 && slots[s]) {
      assert_int_equal(gca_record_stream(a, slots[s], (gca_stream_t)0x3000), GCA_OK);
    } else if (r < 90 && slots[s]) {
      assert_int_equal(gca_free(a, slots[s]), GCA_OK);
      slots[s] = NULL;
    } else if (r < 95) {
      fake_hold_events((int)below(2));
      fake_complete_events();
    } else if (r < 97) {
      assert_int_equal(gca_empty_cache(a, device), GCA_OK);
    } else if (r < 98) {
      fake_fail(below(2) ? "cuMemAlloc_v2" : "cuMemCreate", 0, 1, 2);
    }
    if (op % 128 == 0) assert_consistent(a);
  }
  for (int s = 0; s < SLOTS; s++)
    if (slots[s]) assert_int_equal(gca_free(a, slots[s]), GCA_OK);
  fake_complete_events();
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(stats_of(a, 1).reserved_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(fake_used(0) + fake_used(1), 0);
  assert_consistent(a);
  printf("%-40s %d OOMs\n", conf, ooms);
  gca_close(a);
  assert_driver_empty();
}

static void test_random(void **state) {
  (void)state;
  random_run("", 1);
  random_run("expandable_segments:True", 2);
  random_run("expandable_segments:True,stitching:True,max_split_size_mb:20", 3);
  random_run("cross_stream_reuse:True,garbage_collection_threshold:0.6,per_process_memory_fraction:0.8", 4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_no_driver, fresh),
      cmocka_unit_test_setup(test_open_failures, fresh),
      cmocka_unit_test_setup(test_context_discipline, fresh),
      cmocka_unit_test_setup(test_devices_and_memory, fresh),
      cmocka_unit_test_setup(test_events_pending, fresh),
      cmocka_unit_test_setup(test_expandable_segments, fresh),
      cmocka_unit_test_setup(test_allocation_errors, fresh),
      cmocka_unit_test_setup(test_event_errors, fresh),
      cmocka_unit_test_setup(test_virtual_memory_errors, fresh),
      cmocka_unit_test_setup(test_peer_access_to_mappings, fresh),
      cmocka_unit_test_setup(test_pinned_host, fresh),
      cmocka_unit_test_setup(test_pinned_host_errors, fresh),
      cmocka_unit_test_setup(test_pinned_host_reserve_and_thread, fresh),
      cmocka_unit_test_setup(test_random, fresh),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
