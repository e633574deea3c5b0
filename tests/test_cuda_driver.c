/* The cuda backend against a real CUDA driver, with the device's own work
 * checking what the allocator hands out.
 *
 * test_cuda drives the backend through the driver double's controls
 * (failures, pending events); this test only uses what a real driver has, so
 * it runs on a GPU: libcuda.so.1 when it loads and sees a device, else the
 * double (tests/fake_cuda.c), so CI runs it too. GCALLOC_REQUIRE_GPU=1 makes
 * a missing GPU a failure (for runs on a machine that has one).
 *
 * What the device checks: every allocation is filled with a pattern of its
 * own by the device (cuMemsetD32Async on the streams that use it), and the
 * first, middle and last words of every live allocation are read back: two
 * live allocations that overlapped, or memory reused while another stream's
 * work on it was still queued, would show as a wrong word. With a real GPU
 * the other stream's work is slow (a large fill repeated), so a reuse that
 * did not wait for its event would be overwritten after the new owner's fill.
 */
#include <dlfcn.h>
#include <inttypes.h>

#include "helpers.h"

enum { CU_OK = 0, CU_NOT_READY = 600 };

static struct driver {
  void *lib;
  int real; /* libcuda.so.1, not the double */
  int (*cuInit)(unsigned);
  int (*cuDeviceGet)(int *, int);
  int (*cuDevicePrimaryCtxRetain)(void **, int);
  int (*cuDevicePrimaryCtxRelease_v2)(int);
  int (*cuCtxSetCurrent)(void *);
  int (*cuCtxSynchronize)(void);
  int (*cuStreamCreate)(uintptr_t *, unsigned);
  int (*cuStreamDestroy_v2)(uintptr_t);
  int (*cuStreamQuery)(uintptr_t);
  int (*cuStreamSynchronize)(uintptr_t);
  int (*cuMemsetD32Async)(uint64_t, unsigned, size_t, uintptr_t);
  int (*cuMemcpyDtoH_v2)(void *, uint64_t, size_t);
  int (*cuMemcpyHtoD_v2)(uint64_t, const void *, size_t);
  int (*cuMemcpyHtoDAsync_v2)(uint64_t, const void *, size_t, uintptr_t);
  int (*cuMemGetInfo_v2)(size_t *, size_t *);
} cu;

static const char *spec; /* "cuda", or "cuda:driver=<the double>" */
static char spec_buf[1024];
static uintptr_t streams[2];

#define DRV(call)                                                         \
  do {                                                                    \
    int rc_ = (call);                                                     \
    if (rc_ != CU_OK) fprintf(stderr, "%s failed: CUDA error %d\n", #call, rc_); \
    assert_int_equal(rc_, CU_OK);                                         \
  } while (0)

static int load(const char *path) {
  cu.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!cu.lib) return -1;
#define LOAD(name) *(void **)&cu.name = dlsym(cu.lib, #name)
  LOAD(cuInit);
  LOAD(cuDeviceGet);
  LOAD(cuDevicePrimaryCtxRetain);
  LOAD(cuDevicePrimaryCtxRelease_v2);
  LOAD(cuCtxSetCurrent);
  LOAD(cuCtxSynchronize);
  LOAD(cuStreamCreate);
  LOAD(cuStreamDestroy_v2);
  LOAD(cuStreamQuery);
  LOAD(cuStreamSynchronize);
  LOAD(cuMemsetD32Async);
  LOAD(cuMemcpyDtoH_v2);
  LOAD(cuMemcpyHtoD_v2);
  LOAD(cuMemcpyHtoDAsync_v2);
  LOAD(cuMemGetInfo_v2);
#undef LOAD
  int device;
  void *ctx;
  if (!cu.cuMemGetInfo_v2 || !cu.cuMemcpyHtoD_v2 || !cu.cuMemcpyHtoDAsync_v2 || cu.cuInit(0) != CU_OK || cu.cuDeviceGet(&device, 0) != CU_OK ||
      cu.cuDevicePrimaryCtxRetain(&ctx, device) != CU_OK) {
    dlclose(cu.lib);
    cu.lib = NULL;
    return -1;
  }
  /* The test's own calls (streams, fills, copies) run in device 0's primary
   * context, the one the backend uses, as PyTorch's do. */
  return cu.cuCtxSetCurrent(ctx) == CU_OK ? 0 : -1;
}

static int setup(void **state) {
  (void)state;
  if (load("libcuda.so.1") == 0) {
    cu.real = 1;
    spec = "cuda";
  } else if (getenv("GCALLOC_REQUIRE_GPU") && !strcmp(getenv("GCALLOC_REQUIRE_GPU"), "1")) {
    fprintf(stderr, "GCALLOC_REQUIRE_GPU=1 but no CUDA driver with a device loads\n");
    return -1;
  } else if (load(FAKE_CUDA_PATH) == 0) {
    snprintf(spec_buf, sizeof spec_buf, "cuda:driver=%s", FAKE_CUDA_PATH);
    spec = spec_buf;
  } else {
    fprintf(stderr, "neither libcuda.so.1 nor the double %s loads\n", FAKE_CUDA_PATH);
    return -1;
  }
  printf("[ driver   ] %s\n", cu.real ? "libcuda.so.1 (a real GPU)" : "the driver double (no GPU here)");
  for (int i = 0; i < 2; i++)
    if (cu.cuStreamCreate(&streams[i], 1 /* non-blocking */) != CU_OK) return -1;
  return 0;
}

static int teardown(void **state) {
  (void)state;
  for (int i = 0; i < 2; i++)
    if (streams[i]) cu.cuStreamDestroy_v2(streams[i]);
  cu.cuDevicePrimaryCtxRelease_v2(0);
  return 0;
}

static size_t device_free(void) {
  size_t free_bytes, total;
  DRV(cu.cuMemGetInfo_v2(&free_bytes, &total));
  return free_bytes;
}

static void fill(void *p, size_t size, unsigned pattern, uintptr_t stream) {
  DRV(cu.cuMemsetD32Async((uint64_t)(uintptr_t)p, pattern, size / 4, stream));
}

static unsigned word_at(const void *p, size_t offset) {
  unsigned w;
  DRV(cu.cuMemcpyDtoH_v2(&w, (uint64_t)(uintptr_t)p + offset, sizeof w));
  return w;
}

/* The first, middle and last words of [p, p + size) hold `pattern`. */
static void expect_filled(const void *p, size_t size, unsigned pattern) {
  size_t offsets[3] = {0, size / 8 * 4, size - 4};
  for (int i = 0; i < 3; i++) {
    unsigned w = word_at(p, offsets[i]);
    if (w != pattern)
      fprintf(stderr, "%p + %zu (of %zu bytes): 0x%08x, expected 0x%08x\n", p, offsets[i], size, w, pattern);
    assert_int_equal(w, pattern);
  }
}

static gca_allocator_t *open_cuda(const char *conf) {
  gca_allocator_t *a = NULL;
  int rc = gca_open(spec, conf, &a);
  if (rc != GCA_OK) fprintf(stderr, "gca_open(%s, %s): %s\n", spec, conf ? conf : "", gca_last_error());
  assert_int_equal(rc, GCA_OK);
  return a;
}

/* ---- the tests -------------------------------------------------------- */

static void test_device_facts(void **state) {
  (void)state;
  size_t before = device_free();
  gca_allocator_t *a = open_cuda(NULL);
  assert_true(gca_device_count(a) >= 1);
  gca_device_properties_t props;
  assert_int_equal(gca_device_properties(a, 0, &props), GCA_OK);
  size_t free_bytes, total;
  assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
  printf("[ device   ] %s, compute capability %d.%d, %d multiprocessors, %zu MiB, %zu MiB free\n", props.name,
         props.major, props.minor, props.multiprocessor_count, total / MiB, free_bytes / MiB);
  assert_int_equal(props.total_memory, total);
  assert_true(free_bytes <= total && free_bytes > 0);
  int least, greatest;
  assert_int_equal(gca_stream_priority_range(a, 0, &least, &greatest), GCA_OK);
  assert_true(greatest <= least);
  gca_close(a);
  assert_int_equal(device_free(), before);
}

/* Allocations of every kind of size are real, writable, and apart. */
static void test_allocations_hold_their_data(void **state) {
  (void)state;
  size_t before = device_free();
  gca_allocator_t *a = open_cuda(NULL);
  const size_t sizes[] = {4, 512, 1000, 1 * MiB, 1 * MiB + 4, 3 * MiB, 10 * MiB, 20 * MiB + 512, 100 * MiB};
  enum { N = sizeof sizes / sizeof sizes[0] };
  void *p[N];
  for (int i = 0; i < N; i++) {
    p[i] = gca_malloc(a, sizes[i], 0, streams[0]);
    assert_non_null(p[i]);
    assert_int_equal((uintptr_t)p[i] % 512, 0);
    fill(p[i], sizes[i] < 4 ? 4 : sizes[i], 0xa0000000u + (unsigned)i, streams[0]);
  }
  DRV(cu.cuCtxSynchronize());
  for (int i = 0; i < N; i++) expect_filled(p[i], sizes[i], 0xa0000000u + (unsigned)i);
  gca_stats_t s = stats_of(a, 0);
  assert_true(s.reserved_bytes[0].current > 0);
  assert_true(before - device_free() >= (size_t)s.reserved_bytes[0].current);
  for (int i = 0; i < N; i++) assert_int_equal(gca_free(a, p[i]), GCA_OK);
  assert_consistent(a);
  assert_int_equal(gca_empty_cache(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).reserved_bytes[0].current, 0);
  gca_close(a);
  assert_int_equal(device_free(), before);
}

/* A block used on another stream is not handed out again while that
 * stream's work is queued, and is once the work has run. */
static void test_reuse_waits_for_the_other_stream(void **state) {
  (void)state;
  gca_allocator_t *a = open_cuda(NULL);
  const size_t size = 64 * MiB, busy_size = cu.real ? 2048 * MiB : 16 * MiB;
  void *busy = gca_malloc(a, busy_size, 0, streams[1]);
  void *p = gca_malloc(a, size, 0, streams[0]);
  void *keep = gca_malloc(a, size, 0, streams[0]);
  assert_non_null(busy);
  assert_non_null(p);
  assert_non_null(keep);
  fill(p, size, 0x11111111u, streams[0]);
  fill(keep, size, 0x22222222u, streams[0]);
  DRV(cu.cuCtxSynchronize());
  assert_int_equal(gca_record_stream(a, p, streams[1]), GCA_OK);
  /* Stream 1 is kept busy (2 GiB filled 80 times on a GPU: about 60 ms),
   * then writes p: the last use of p, on stream 1. */
  for (int i = 0; i < 80; i++) fill(busy, busy_size, (unsigned)i, streams[1]);
  fill(p, size, 0x33333333u, streams[1]);
  assert_int_equal(gca_free(a, p), GCA_OK);
  int pending = cu.cuStreamQuery(streams[1]) == CU_NOT_READY;
  void *q = gca_malloc(a, size, 0, streams[0]);
  assert_non_null(q);
  if (pending) assert_ptr_not_equal(q, p); /* p's event has not completed */
  fill(q, size, 0x44444444u, streams[0]);
  printf("[ streams  ] stream 1 %s when p was freed; the next block %s p\n", pending ? "busy" : "idle",
         q == p ? "is" : "is not");
  DRV(cu.cuCtxSynchronize());
  expect_filled(keep, size, 0x22222222u);
  expect_filled(q, size, 0x44444444u);
  /* Once stream 1 has run, p is free for stream 0 again: best fit gives it. */
  DRV(cu.cuStreamSynchronize(streams[1]));
  assert_int_equal(gca_process_events(a, 0), GCA_OK);
  void *r = gca_malloc(a, size, 0, streams[0]);
  assert_non_null(r);
  if (q != p) assert_ptr_equal(r, p);
  assert_consistent(a);
  void *all[] = {busy, keep, q, r};
  for (int i = 0; i < 4; i++) assert_int_equal(gca_free(a, all[i]), GCA_OK);
  gca_close(a);
}

/* Expandable segments on the driver's virtual memory: a range written across
 * page boundaries; pages given back by empty_cache while the pages of live
 * blocks stay mapped with their data. */
static void test_expandable_segments(void **state) {
  (void)state;
  size_t before = device_free();
  gca_allocator_t *a = open_cuda("expandable_segments:True");
  void *x = gca_malloc(a, 30 * MiB, 0, streams[0]);
  void *y = gca_malloc(a, 50 * MiB, 0, streams[0]);
  void *z = gca_malloc(a, 30 * MiB, 0, streams[0]);
  assert_non_null(x);
  assert_non_null(y);
  assert_non_null(z);
  /* One segment: the blocks follow each other in one reserved range. */
  assert_ptr_equal((char *)y, (char *)x + 30 * MiB);
  assert_ptr_equal((char *)z, (char *)y + 50 * MiB);
  fill(x, 30 * MiB, 0x55555555u, streams[0]);
  fill(y, 50 * MiB, 0x66666666u, streams[0]);
  fill(z, 30 * MiB, 0x77777777u, streams[0]);
  DRV(cu.cuCtxSynchronize());
  expect_filled(y, 50 * MiB, 0x66666666u);
  size_t mapped = before - device_free();
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  size_t given_back = mapped - (before - device_free());
  printf("[ expandable ] 110 MiB of blocks mapped %zu MiB; freeing the middle 50 MiB gave back %zu MiB\n",
         mapped / MiB, given_back / MiB);
  assert_true(given_back >= 20 * MiB); /* [40, 60) MiB at least held y alone */
  expect_filled(x, 30 * MiB, 0x55555555u);
  expect_filled(z, 30 * MiB, 0x77777777u);
  /* Growing into the hole maps pages again, and the new block is real. */
  void *w = gca_malloc(a, 48 * MiB, 0, streams[0]);
  assert_non_null(w);
  fill(w, 48 * MiB, 0x88888888u, streams[0]);
  DRV(cu.cuCtxSynchronize());
  expect_filled(w, 48 * MiB, 0x88888888u);
  expect_filled(x, 30 * MiB, 0x55555555u);
  expect_filled(z, 30 * MiB, 0x77777777u);
  assert_consistent(a);
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_free(a, z), GCA_OK);
  assert_int_equal(gca_free(a, w), GCA_OK);
  gca_close(a);
  assert_int_equal(device_free(), before);
}

/* The device really runs out: PyTorch's message, nothing lost, and all the
 * memory back after. Ordinary and expandable segments. */
static void test_out_of_memory(void **state) {
  (void)state;
  const char *confs[] = {NULL, "expandable_segments:True"};
  for (int c = 0; c < 2; c++) {
    size_t before = device_free();
    gca_allocator_t *a = open_cuda(confs[c]);
    size_t free_bytes, total;
    assert_int_equal(gca_mem_get_info(a, 0, &free_bytes, &total), GCA_OK);
    const size_t chunk = (total / 24) & ~(2 * MiB - 1);
    void *held[64];
    int n = 0;
    while (n < 64) {
      void *p = gca_malloc(a, chunk, 0, streams[0]);
      if (!p) break;
      held[n++] = p;
    }
    assert_true(n > 0 && n < 64);
    assert_int_equal(gca_last_status(), GCA_ERR_OOM);
    assert_contains(gca_last_error(), "out of memory. Tried to allocate");
    printf("[ oom      ] %s: %d blocks of %zu MiB, then: %.160s...\n", confs[c] ? confs[c] : "default", n,
           chunk / MiB, gca_last_error());
    /* Far beyond the device: the same. */
    assert_null(gca_malloc(a, total * 2, 0, streams[0]));
    assert_int_equal(gca_last_status(), GCA_ERR_OOM);
    assert_consistent(a);
    /* What was held is intact. */
    fill(held[n - 1], chunk, 0x99999999u, streams[0]);
    DRV(cu.cuCtxSynchronize());
    expect_filled(held[n - 1], chunk, 0x99999999u);
    for (int i = 0; i < n; i++) assert_int_equal(gca_free(a, held[i]), GCA_OK);
    gca_close(a);
    assert_int_equal(device_free(), before);
  }
}

/* Pinned host memory: the driver sees it as host memory and copies through
 * it. */
static void test_pinned_host(void **state) {
  (void)state;
  gca_allocator_t *a = open_cuda(NULL);
  const size_t size = 3 * MiB;
  unsigned *h = gca_host_malloc(a, size), *back = gca_host_malloc(a, size);
  assert_non_null(h);
  assert_non_null(back);
  int pinned = 0;
  assert_int_equal(gca_host_is_pinned(a, h, &pinned), GCA_OK);
  assert_int_equal(pinned, 1);
  int local = 0;
  assert_int_equal(gca_host_is_pinned(a, &local, &pinned), GCA_OK);
  assert_int_equal(pinned, 0);
  for (size_t i = 0; i < size / 4; i++) h[i] = (unsigned)(i * 2654435761u);
  void *d = gca_malloc(a, size, 0, streams[0]);
  assert_non_null(d);
  DRV(cu.cuMemcpyHtoD_v2((uint64_t)(uintptr_t)d, h, size));
  DRV(cu.cuMemcpyDtoH_v2(back, (uint64_t)(uintptr_t)d, size));
  assert_memory_equal(h, back, size);
  assert_int_equal(gca_free(a, d), GCA_OK);
  assert_int_equal(gca_host_free(a, h), GCA_OK);
  assert_int_equal(gca_host_free(a, back), GCA_OK);
  gca_close(a);
}

/* Keeps stream 1 busy for a while (2 GiB filled 40 times on a GPU: about
 * 30 ms), so that what is queued after it waits. */
static void keep_busy(void *busy, size_t busy_size) {
  for (int i = 0; i < 40; i++) fill(busy, busy_size, (unsigned)i, streams[1]);
}

/* The pinned keys of newer PyTorch on the driver, each way of pinning:
 * pinned_reserve_segment_size_mb carves blocks from one pinned segment, and
 * the device copies through them as through any pinned memory, the
 * asynchronous copies included; a carved block freed under a queued copy is
 * not handed out again until the copy has run; with
 * pinned_use_background_threads such a block comes back to its list once
 * the copy is done, with no allocation to collect it, and without the key
 * it waits for the next allocation. */
static void test_pinned_keys(void **state) {
  (void)state;
  const size_t busy_size = cu.real ? 2048 * MiB : 16 * MiB;
  for (int c = 0; c < 4; c++) {
    int background = c & 1, registered = c >> 1;
    char conf[160];
    snprintf(conf, sizeof conf, "pinned_reserve_segment_size_mb:4%s%s",
             background ? ",pinned_use_background_threads:True" : "",
             registered ? ",pinned_use_cuda_host_register:True,pinned_num_register_threads:4" : "");
    gca_allocator_t *a = open_cuda(conf);
    void *busy = gca_malloc(a, busy_size, 0, streams[1]);
    void *d = gca_malloc(a, 2 * MiB, 0, streams[1]);
    assert_non_null(busy);
    assert_non_null(d);
    /* Carved one after another from the segment: one pin for three blocks. */
    char *p1 = gca_host_malloc(a, 64 * KiB), *p2 = gca_host_malloc(a, MiB), *p3 = gca_host_malloc(a, MiB);
    assert_non_null(p1);
    assert_non_null(p2);
    assert_non_null(p3);
    assert_int_equal(p2 - p1, 64 * KiB);
    assert_int_equal(p3 - p2, MiB);
    gca_host_stats_t s = host_stats(a);
    assert_int_equal(s.host_alloc_time.count, 1);
    assert_int_equal(s.segment.current, 3);
    int pinned = 0;
    assert_int_equal(gca_host_is_pinned(a, p1 + 4 * MiB - 1, &pinned), GCA_OK); /* the segment's last byte */
    assert_int_equal(pinned, 1);
    /* A round trip through two carved blocks. */
    unsigned *w2 = (unsigned *)p2, *w3 = (unsigned *)p3;
    for (size_t i = 0; i < MiB / 4; i++) w2[i] = (unsigned)(i * 2654435761u) ^ (unsigned)c;
    DRV(cu.cuMemcpyHtoD_v2((uint64_t)(uintptr_t)d, p2, MiB));
    DRV(cu.cuMemcpyDtoH_v2(p3, (uint64_t)(uintptr_t)d, MiB));
    assert_memory_equal(w2, w3, MiB);

    /* A copy from p1 queued behind stream 1's work; p1 freed at once. */
    unsigned *w1 = (unsigned *)p1;
    for (size_t i = 0; i < 64 * KiB / 4; i++) w1[i] = 0x5a5a0000u + (unsigned)c;
    keep_busy(busy, busy_size);
    DRV(cu.cuMemcpyHtoDAsync_v2((uint64_t)(uintptr_t)d, p1, 64 * KiB, streams[1]));
    assert_int_equal(gca_host_record_stream(a, p1, 0, streams[1]), GCA_OK);
    assert_int_equal(gca_host_free(a, p1), GCA_OK);
    int queued = cu.cuStreamQuery(streams[1]) == CU_NOT_READY;
    char *q = gca_host_malloc(a, 64 * KiB);
    assert_non_null(q);
    if (queued) assert_ptr_not_equal(q, p1); /* its copy has not run */
    memset(q, 0xee, 64 * KiB);                /* would spoil the copy if q were p1 */
    DRV(cu.cuStreamSynchronize(streams[1]));
    expect_filled(d, 64 * KiB, 0x5a5a0000u + (unsigned)c);
    assert_int_equal(gca_host_empty_cache(a), GCA_OK); /* collects p1; carved blocks stay */
    assert_int_equal(host_stats(a).pending_blocks, 0);
    printf("[ pinned   ] %s: stream 1 %s at the free; the next block %s the freed one\n", conf,
           queued ? "busy" : "idle", q == (char *)p1 ? "is" : "is not");

    /* Background collection: a block freed under a queued copy, then the
     * copy done, and no allocation. */
    keep_busy(busy, busy_size);
    DRV(cu.cuMemcpyHtoDAsync_v2((uint64_t)(uintptr_t)d, p2, MiB, streams[1]));
    assert_int_equal(gca_host_record_stream(a, p2, 0, streams[1]), GCA_OK);
    assert_int_equal(gca_host_free(a, p2), GCA_OK);
    /* Pending until the copy has run, and, without the thread, until an
     * allocation collects it (the double's copies run at once, and its
     * thread may have collected it already). */
    int64_t pending = host_stats(a).pending_blocks;
    if (!background || cu.cuStreamQuery(streams[1]) == CU_NOT_READY) assert_int_equal(pending, 1);
    DRV(cu.cuStreamSynchronize(streams[1]));
    s = host_stats(a);
    for (int i = 0; i < 2000 && s.pending_blocks; i++) { /* up to 2 s; the thread looks every 100 us */
      struct timespec pause = {0, 1000000};
      nanosleep(&pause, NULL);
      if (!background && i == 20) break; /* 20 ms: nothing collects without the thread */
      s = host_stats(a);
    }
    assert_int_equal(s.pending_blocks, background ? 0 : 1);
    assert_true(gca_host_malloc(a, MiB) == p2); /* collected here at the latest */

    /* A block larger than what is left of the segment is pinned alone, and
     * the device copies through it too. */
    char *big = gca_host_malloc(a, 4 * MiB);
    assert_non_null(big);
    assert_true(big + 4 * MiB <= p1 || big >= p1 + 4 * MiB);
    assert_int_equal(host_stats(a).host_alloc_time.count, 2);
    memset(big, 0x77, 2 * MiB);
    DRV(cu.cuMemcpyHtoDAsync_v2((uint64_t)(uintptr_t)d, big, 2 * MiB, streams[0]));
    DRV(cu.cuStreamSynchronize(streams[0]));
    expect_filled(d, 2 * MiB, 0x77777777u);
    char *all[] = {q, p2, p3, big};
    for (int i = 0; i < 4; i++) assert_int_equal(gca_host_free(a, all[i]), GCA_OK);
    assert_int_equal(gca_host_empty_cache(a), GCA_OK); /* big is unpinned, carved blocks stay */
    s = host_stats(a);
    assert_int_equal(s.num_host_free, 1);
    assert_int_equal(s.segment.current, q == (char *)p1 ? 3 : 4); /* p1 too, if q was carved apart */
    assert_int_equal(gca_free(a, busy), GCA_OK);
    assert_int_equal(gca_free(a, d), GCA_OK);
    gca_close(a); /* the segment is unpinned */
  }
}

/* Seeded random sequences on two streams, every allocation filled by the
 * device on its streams, under the invariant checker; the device's words
 * checked every 64 operations. */
typedef struct live {
  void *p;
  size_t size;
  unsigned pattern;
} live_t;

static size_t random_size(uint64_t *rng) {
  uint64_t r = next_random(rng);
  switch (r % 8) {
    case 0: case 1: case 2: return 4 + (size_t)(r >> 8) % (64 * KiB);        /* small pool */
    case 3: case 4: return 1 * MiB + (size_t)(r >> 8) % (9 * MiB);           /* large, < 10 MiB */
    case 5: case 6: return 10 * MiB + (size_t)(r >> 8) % (30 * MiB);         /* large */
    default: return (cu.real ? 100 : 40) * MiB + (size_t)(r >> 8) % (100 * MiB); /* oversize-ish */
  }
}

static void check_live(const live_t *live, int n) {
  DRV(cu.cuCtxSynchronize());
  for (int i = 0; i < n; i++) expect_filled(live[i].p, live[i].size & ~(size_t)3, live[i].pattern);
}

static void test_random_sequences(void **state) {
  (void)state;
  const char *confs[] = {NULL, "expandable_segments:True",
                         "max_split_size_mb:64,garbage_collection_threshold:0.5,roundup_power2_divisions:4"};
  const int ops = cu.real ? 3000 : 600;
  for (int c = 0; c < 3; c++) {
    size_t before = device_free();
    gca_allocator_t *a = open_cuda(confs[c]);
    if (c == 2) assert_int_equal(gca_set_memory_fraction(a, cu.real ? 0.05 : 0.5, 0), GCA_OK);
    uint64_t rng = 0x9e3779b97f4a7c15ull + (uint64_t)c;
    live_t live[256];
    int n = 0, ooms = 0;
    unsigned next_pattern = 0x10000000u;
    for (int op = 0; op < ops; op++) {
      uint64_t r = next_random(&rng);
      if (n < 256 && (n == 0 || r % 100 < 55)) {
        size_t size = random_size(&rng) & ~(size_t)3;
        uintptr_t s = streams[next_random(&rng) % 2];
        void *p = gca_malloc(a, size, 0, s);
        if (!p) {
          assert_int_equal(gca_last_status(), GCA_ERR_OOM);
          ooms++;
          continue;
        }
        live[n] = (live_t){p, size, next_pattern++};
        fill(p, size, live[n].pattern, s);
        /* Used on the other stream too, some of the time. */
        if (next_random(&rng) % 4 == 0) {
          uintptr_t other = streams[s == streams[0]];
          assert_int_equal(gca_record_stream(a, p, other), GCA_OK);
          fill(p, size, live[n].pattern, other);
        }
        n++;
      } else {
        int i = (int)(r % (uint64_t)n);
        assert_int_equal(gca_free(a, live[i].p), GCA_OK);
        live[i] = live[--n];
      }
      if (op % 64 == 63) {
        assert_consistent(a);
        check_live(live, n);
      }
      if (op % 500 == 499) assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
    }
    check_live(live, n);
    gca_stats_t s = stats_of(a, 0);
    printf("[ random   ] %s: %d ops, peak reserved %" PRId64 " MiB, %d out of memory\n",
           confs[c] ? confs[c] : "default", ops, s.reserved_bytes[0].peak / (int64_t)MiB, ooms);
    for (int i = 0; i < n; i++) assert_int_equal(gca_free(a, live[i].p), GCA_OK);
    assert_consistent(a);
    gca_close(a);
    assert_int_equal(device_free(), before);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_device_facts),
      cmocka_unit_test(test_allocations_hold_their_data),
      cmocka_unit_test(test_reuse_waits_for_the_other_stream),
      cmocka_unit_test(test_expandable_segments),
      cmocka_unit_test(test_out_of_memory),
      cmocka_unit_test(test_pinned_host),
      cmocka_unit_test(test_pinned_keys),
      cmocka_unit_test(test_random_sequences),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
