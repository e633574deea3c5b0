/* The acl backend against a real AscendCL runtime, with the device's own
 * fills checking what the allocator hands out.
 *
 * test_acl drives the backend through the stand-in's controls (failures,
 * pending events, the task queue); this test only uses what libascendcl.so
 * has, so it runs on an NPU: the real runtime when it loads and sees a
 * device, else the stand-in (tests/fake_acl.c), so CI runs it too.
 * GCALLOC_REQUIRE_NPU=1 makes a missing NPU a failure (scripts/npu-check.sh
 * sets it). What it checks: allocations of several sizes, all live at once,
 * each filled by the device (aclrtMemset) with a byte of its own and read
 * back (aclrtMemcpy) at its first and last byte, in ordinary and expandable
 * segments; the device's free memory back where it was after empty_cache;
 * the calling thread's device unchanged after calls on every device, and a
 * thread that never set one; pinned host memory.
 */
#include <dlfcn.h>
#include <pthread.h>

#include "helpers.h"

enum { ACL_OK = 0, ACL_HBM = 1, ACL_MEMCPY_DEVICE_TO_HOST = 2 };

static struct runtime {
  void *lib;
  int real;
  int (*aclInit)(const char *);
  int (*aclrtSetDevice)(int32_t);
  int (*aclrtGetDevice)(int32_t *);
  int (*aclrtGetDeviceCount)(uint32_t *);
  int (*aclrtGetMemInfo)(int, size_t *, size_t *);
  int (*aclrtMemset)(void *, size_t, int32_t, size_t);
  int (*aclrtMemcpy)(void *, size_t, const void *, size_t, int);
} rt;

static const char *spec; /* "acl", or "acl:library=<the stand-in>" */
static char spec_buf[1024];
static int devices;

#define RT(call)                                                            \
  do {                                                                      \
    int rc_ = (call);                                                       \
    if (rc_ != ACL_OK) fprintf(stderr, "%s failed: AscendCL error %d\n", #call, rc_); \
    assert_int_equal(rc_, ACL_OK);                                          \
  } while (0)

static int load(const char *path) {
  rt.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!rt.lib) return -1;
#define LOAD(name) *(void **)&rt.name = dlsym(rt.lib, #name)
  LOAD(aclInit);
  LOAD(aclrtSetDevice);
  LOAD(aclrtGetDevice);
  LOAD(aclrtGetDeviceCount);
  LOAD(aclrtGetMemInfo);
  LOAD(aclrtMemset);
  LOAD(aclrtMemcpy);
#undef LOAD
  uint32_t count = 0;
  int init = rt.aclInit ? rt.aclInit(NULL) : -1;
  if (!rt.aclrtMemcpy || !rt.aclrtMemset || (init != ACL_OK && init != 100002) ||
      rt.aclrtGetDeviceCount(&count) != ACL_OK || count == 0 || rt.aclrtSetDevice(0) != ACL_OK) {
    dlclose(rt.lib);
    rt.lib = NULL;
    return -1;
  }
  devices = (int)count;
  return 0;
}

static int setup(void **state) {
  (void)state;
  if (load("libascendcl.so") == 0) {
    rt.real = 1;
    spec = "acl";
  } else if (getenv("GCALLOC_REQUIRE_NPU") && !strcmp(getenv("GCALLOC_REQUIRE_NPU"), "1")) {
    fprintf(stderr, "GCALLOC_REQUIRE_NPU=1 but no AscendCL runtime with an NPU loads\n");
    return -1;
  } else if (load(FAKE_ACL_PATH) == 0) {
    snprintf(spec_buf, sizeof spec_buf, "acl:library=%s", FAKE_ACL_PATH);
    spec = spec_buf;
  } else {
    fprintf(stderr, "neither libascendcl.so nor the stand-in %s loads\n", FAKE_ACL_PATH);
    return -1;
  }
  printf("[ runtime  ] %s, %d NPU%s\n", rt.real ? "libascendcl.so (a real NPU)" : "the AscendCL stand-in (no NPU here)",
         devices, devices == 1 ? "" : "s");
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (rt.lib) dlclose(rt.lib);
  return 0;
}

static size_t device_free(int device) {
  int32_t before = -1;
  RT(rt.aclrtGetDevice(&before));
  RT(rt.aclrtSetDevice(device));
  size_t free_bytes = 0, total = 0;
  RT(rt.aclrtGetMemInfo(ACL_HBM, &free_bytes, &total));
  RT(rt.aclrtSetDevice(before));
  return free_bytes;
}

static int32_t current_device(void) {
  int32_t d = -1;
  return rt.aclrtGetDevice(&d) == ACL_OK ? d : -1;
}

/* Allocations of these sizes, all live at once, each filled by the device
 * with its own byte and read back at both ends; then freed, the cache
 * emptied, and the device's free memory where it was. */
static void fill_and_check(const char *conf, int device) {
  static const size_t sizes[] = {512, 4096, 1000 * 1000, 3 * MiB, 20 * MiB + 512, 64 * MiB};
  enum { N = sizeof sizes / sizeof sizes[0] };
  RT(rt.aclrtSetDevice(device));
  size_t before = device_free(device);
  gca_allocator_t *a = open_sim(spec, conf);
  unsigned char *p[N];
  for (int i = 0; i < N; i++) {
    p[i] = gca_malloc(a, sizes[i], device, 0);
    assert_non_null(p[i]);
    RT(rt.aclrtMemset(p[i], sizes[i], 0x11 * (i + 1), sizes[i]));
  }
  for (int i = 0; i < N; i++) {
    unsigned char ends[2] = {0, 0};
    RT(rt.aclrtMemcpy(&ends[0], 1, p[i], 1, ACL_MEMCPY_DEVICE_TO_HOST));
    RT(rt.aclrtMemcpy(&ends[1], 1, p[i] + sizes[i] - 1, 1, ACL_MEMCPY_DEVICE_TO_HOST));
    if (ends[0] != (unsigned char)(0x11 * (i + 1)) || ends[1] != ends[0])
      fprintf(stderr, "allocation %d (%zu bytes): read back %#x %#x\n", i, sizes[i], ends[0], ends[1]);
    assert_int_equal(ends[0], (unsigned char)(0x11 * (i + 1)));
    assert_int_equal(ends[1], ends[0]);
  }
  assert_int_equal(current_device(), device);
  assert_consistent(a);
  for (int i = 0; i < N; i++) assert_int_equal(gca_free(a, p[i]), GCA_OK);
  assert_int_equal(gca_empty_cache(a, device), GCA_OK);
  assert_int_equal(gca_reserved_bytes(a, device), 0);
  gca_close(a);
  /* Another process may use the device too: within 64 MiB. */
  size_t after = device_free(device);
  assert_true(after + 64 * MiB >= before);
  assert_int_equal(current_device(), device);
}

static void test_ordinary_segments(void **state) {
  (void)state;
  fill_and_check(NULL, 0);
}

static void test_expandable_segments(void **state) {
  (void)state;
  fill_and_check("expandable_segments:True", 0);
}

/* The thread's device stays where it was, whichever device a call works on. */
static void test_device_discipline(void **state) {
  (void)state;
  RT(rt.aclrtSetDevice(0));
  gca_allocator_t *a = open_sim(spec, "expandable_segments:True");
  assert_int_equal(current_device(), 0);
  for (int d = 0; d < devices; d++) {
    void *p = gca_malloc(a, 30 * MiB, d, 0);
    assert_non_null(p);
    assert_int_equal(current_device(), 0);
    assert_int_equal(gca_free(a, p), GCA_OK);
    assert_int_equal(gca_empty_cache(a, d), GCA_OK);
    assert_int_equal(current_device(), 0);
  }
  gca_close(a);
  assert_int_equal(current_device(), 0);
}

static void *allocate_without_a_device(void *arg) {
  gca_allocator_t *a = arg;
  void *p = gca_malloc(a, MiB, devices - 1, 0);
  void *h = gca_host_malloc(a, 4096);
  intptr_t ok = p && h && gca_free(a, p) == GCA_OK && gca_host_free(a, h) == GCA_OK;
  return (void *)ok;
}

static void test_thread_without_a_device(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim(spec, NULL);
  pthread_t t;
  void *ok = NULL;
  assert_int_equal(pthread_create(&t, NULL, allocate_without_a_device, a), 0);
  assert_int_equal(pthread_join(t, &ok), 0);
  assert_true(ok != NULL);
  gca_close(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ordinary_segments),
      cmocka_unit_test(test_expandable_segments),
      cmocka_unit_test(test_device_discipline),
      cmocka_unit_test(test_thread_without_a_device),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
