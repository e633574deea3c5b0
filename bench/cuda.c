/* `gcalloc bench-cuda`: gcalloc's cuda backend against the driver's own
 * allocators, measured in one run on a real GPU.
 *
 * Workloads (ns per operation, best of 5 repetitions after a warm-up):
 *   pair SIZE      allocate SIZE then free it, in a loop on one stream:
 *                  gcalloc (cached after the first), cuMemAlloc/cuMemFree
 *                  (what an allocator without a cache pays), and
 *                  cuMemAllocAsync/cuMemFreeAsync on the device's default
 *                  memory pool (cudaMallocAsync, PyTorch's other backend);
 *   grow 64 MiB    64 blocks of 64 MiB (fewer where they would take more than
 *                  half the device) from an empty cache, then freed and
 *                  the cache emptied: per block, the cost of obtaining memory
 *                  from the device (gcalloc ordinary segments: one cuMemAlloc
 *                  each; expandable segments: cuMemCreate + cuMemMap +
 *                  cuMemSetAccess per 20 MiB page; the driver's pool);
 *   pinned host    64 blocks of 64 KiB, 1 MiB and 16 MiB from an empty pinned
 *                  cache (a fresh allocator each repetition), µs per block:
 *                  cuMemHostAlloc per block (the default, and the driver
 *                  called directly), one reserve segment carved
 *                  (pinned_reserve_segment_size_mb, its pin counted), and
 *                  malloc + page touching + cuMemHostRegister with 1 and 8
 *                  threads (pinned_use_cuda_host_register); then ns per
 *                  cached host alloc+free pair.
 * Needs libcuda.so.1 (or the driver GCALLOC_CUDA_DRIVER names, as for the
 * backend) and a device: without one it says so and exits 1. CI has no
 * GPU: it runs this on the tests' driver double, where the figures mean
 * nothing but every path runs (test bench_cuda_on_double).
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "gcalloc.h"
#include "tools/tool.h"

static struct {
  int (*cuInit)(unsigned);
  int (*cuDeviceGet)(int *, int);
  int (*cuDevicePrimaryCtxRetain)(void **, int);
  int (*cuDevicePrimaryCtxRelease_v2)(int);
  int (*cuCtxSetCurrent)(void *);
  int (*cuStreamCreate)(uintptr_t *, unsigned);
  int (*cuStreamDestroy_v2)(uintptr_t);
  int (*cuStreamSynchronize)(uintptr_t);
  int (*cuMemAlloc_v2)(uint64_t *, size_t);
  int (*cuMemFree_v2)(uint64_t);
  int (*cuMemAllocAsync)(uint64_t *, size_t, uintptr_t);
  int (*cuMemFreeAsync)(uint64_t, uintptr_t);
  int (*cuMemHostAlloc)(void **, size_t, unsigned);
  int (*cuMemFreeHost)(void *);
} drv;

static int load_driver(void) {
  /* The driver the cuda backend loads: GCALLOC_CUDA_DRIVER names another
   * (the tests' driver double), as for the backend. */
  const char *name = getenv("GCALLOC_CUDA_DRIVER");
  void *lib = dlopen(name && *name ? name : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "bench-cuda: no CUDA driver (%s); this benchmark needs a GPU\n", dlerror());
    return -1;
  }
#define LOAD(name)                                                      \
  if (!(*(void **)&drv.name = dlsym(lib, #name))) {                     \
    fprintf(stderr, "bench-cuda: the driver has no %s\n", #name);      \
    return -1;                                                          \
  }
  LOAD(cuInit);
  LOAD(cuDeviceGet);
  LOAD(cuDevicePrimaryCtxRetain);
  LOAD(cuDevicePrimaryCtxRelease_v2);
  LOAD(cuCtxSetCurrent);
  LOAD(cuStreamCreate);
  LOAD(cuStreamDestroy_v2);
  LOAD(cuStreamSynchronize);
  LOAD(cuMemAlloc_v2);
  LOAD(cuMemFree_v2);
  LOAD(cuMemAllocAsync);
  LOAD(cuMemFreeAsync);
  LOAD(cuMemHostAlloc);
  LOAD(cuMemFreeHost);
#undef LOAD
  int device;
  void *ctx;
  if (drv.cuInit(0) || drv.cuDeviceGet(&device, 0) || drv.cuDevicePrimaryCtxRetain(&ctx, device) ||
      drv.cuCtxSetCurrent(ctx)) {
    fprintf(stderr, "bench-cuda: the driver sees no usable device\n");
    return -1;
  }
  return 0;
}

typedef enum { GCALLOC, GCALLOC_EXPANDABLE, DRIVER, DRIVER_POOL, PEERS } peer_t;
static const char *peer_names[PEERS] = {"gcalloc", "gcalloc expandable", "cuMemAlloc", "cuMemAllocAsync pool"};

typedef struct ctx {
  gca_allocator_t *a[2];
  uintptr_t stream;
} ctx_t;

static int do_alloc(ctx_t *c, peer_t p, size_t size, uint64_t *out) {
  switch (p) {
    case GCALLOC:
    case GCALLOC_EXPANDABLE:
      *out = (uint64_t)(uintptr_t)gca_malloc(c->a[p], size, 0, c->stream);
      return *out ? 0 : -1;
    case DRIVER: return drv.cuMemAlloc_v2(out, size);
    default: return drv.cuMemAllocAsync(out, size, c->stream);
  }
}

static int do_free(ctx_t *c, peer_t p, uint64_t ptr) {
  switch (p) {
    case GCALLOC:
    case GCALLOC_EXPANDABLE: return gca_free(c->a[p], (void *)(uintptr_t)ptr);
    case DRIVER: return drv.cuMemFree_v2(ptr);
    default: return drv.cuMemFreeAsync(ptr, c->stream);
  }
}

/* ns per alloc+free pair, best of 5. */
static double time_pairs(ctx_t *c, peer_t p, size_t size, int n) {
  double best = 1e30;
  for (int rep = -1; rep < 5; rep++) {
    double t0 = tool_seconds();
    for (int i = 0; i < n; i++) {
      uint64_t ptr;
      if (do_alloc(c, p, size, &ptr) || do_free(c, p, ptr)) return -1;
    }
    double t = (tool_seconds() - t0) * 1e9 / n;
    if (rep >= 0 && t < best) best = t;
  }
  drv.cuStreamSynchronize(c->stream);
  return best;
}

/* ns per 64 MiB block obtained from an empty cache, best of 5: `blocks`
 * of them (64, or what half the device holds where that is less). A
 * failure gives -1, with what was obtained before it freed, so that the
 * peers measured after it start from the same device. */
enum { GROWTH_BLOCKS = 64 };
static double time_growth(ctx_t *c, peer_t p, int blocks) {
  const size_t size = (size_t)64 << 20;
  uint64_t ptr[GROWTH_BLOCKS];
  double best = 1e30;
  for (int rep = 0; rep < 5 && best >= 0; rep++) {
    double t0 = tool_seconds();
    int got = 0;
    while (got < blocks && do_alloc(c, p, size, &ptr[got]) == 0) got++;
    if (p == DRIVER_POOL) drv.cuStreamSynchronize(c->stream);
    double t = (tool_seconds() - t0) * 1e9 / blocks;
    best = got < blocks ? -1 : t < best ? t : best;
    for (int i = 0; i < got; i++) do_free(c, p, ptr[i]);
    drv.cuStreamSynchronize(c->stream);
    if (p <= GCALLOC_EXPANDABLE) gca_empty_cache(c->a[p], 0);
  }
  return best;
}

/* Pinned host memory: µs per block of `size` for `blocks` new blocks, best
 * of 5, each repetition on a fresh allocator opened with `conf` (so nothing
 * is cached, and a reserve segment is pinned anew); conf NULL and driver set:
 * cuMemHostAlloc (portable) and cuMemFreeHost called directly. */
enum { PINNED_BLOCKS = 64 };
static double time_pinning(const char *conf, int driver, size_t size) {
  void *ptr[PINNED_BLOCKS];
  double best = 1e30;
  for (int rep = 0; rep < 5 && best >= 0; rep++) {
    gca_allocator_t *a = NULL;
    if (!driver && gca_open("cuda", conf, &a)) return -1;
    double t0 = tool_seconds();
    int got = 0;
    while (got < PINNED_BLOCKS && (driver ? drv.cuMemHostAlloc(&ptr[got], size, 1 /* portable */) == 0
                                          : (ptr[got] = gca_host_malloc(a, size)) != NULL))
      got++;
    double t = (tool_seconds() - t0) * 1e6 / PINNED_BLOCKS;
    /* A failure gives -1, what was pinned before it freed all the same
     * (the ways that follow run in the same process). */
    best = got < PINNED_BLOCKS ? -1 : t < best ? t : best;
    for (int i = 0; i < got; i++) driver ? (void)drv.cuMemFreeHost(ptr[i]) : (void)gca_host_free(a, ptr[i]);
    if (a) gca_close(a);
  }
  return best;
}

/* ns per cached pinned alloc+free pair of `size`, best of 5. */
static double time_pinned_pairs(size_t size) {
  gca_allocator_t *a = NULL;
  if (gca_open("cuda", NULL, &a)) return -1;
  double best = 1e30;
  for (int rep = -1; rep < 5; rep++) {
    double t0 = tool_seconds();
    for (int i = 0; i < 20000; i++) {
      void *p = gca_host_malloc(a, size);
      if (!p) {
        gca_close(a);
        return -1;
      }
      gca_host_free(a, p);
    }
    double t = (tool_seconds() - t0) * 1e9 / 20000;
    if (rep >= 0 && t < best) best = t;
  }
  gca_close(a);
  return best;
}

enum { PINNING_WAYS = 5 };
static const char *pinning_names[PINNING_WAYS] = {"cuMemHostAlloc (driver)", "gcalloc", "gcalloc reserve segment",
                                                  "gcalloc register, 1 thr", "gcalloc register, 8 thr"};

static double time_pinning_way(int way, size_t size) {
  char conf[128];
  switch (way) {
    case 0: return time_pinning(NULL, 1, size);
    case 1: return time_pinning(NULL, 0, size);
    case 2: /* room for every block, in whole MiB */
      snprintf(conf, sizeof conf, "pinned_reserve_segment_size_mb:%zu", (PINNED_BLOCKS * size + (1 << 20) - 1) >> 20);
      return time_pinning(conf, 0, size);
    case 3: return time_pinning("pinned_use_cuda_host_register:True", 0, size);
    default: return time_pinning("pinned_use_cuda_host_register:True,pinned_num_register_threads:8", 0, size);
  }
}

const tool_command_t bench_cuda_command = {
    "bench-cuda", NULL, "[--json]",
    "on a GPU: gcalloc's alloc+free and growth against cuMemAlloc and the driver's pool",
    "\n"
    "On a machine with an NVIDIA GPU: gcalloc's cuda backend against the driver's own allocators in the\n"
    "same run: a cached alloc+free pair, growth by 64 MiB blocks, pinned host blocks (docs/cuda.md).\n"
    "Needs libcuda.so.1; exits 1 without it.\n"
    "\n"
    "  --json      the figures as JSON\n"
    "  -h, --help  this help\n",
    bench_cuda_main};

int bench_cuda_main(int argc, char **argv) {
  bool json = false;
  const tool_option_t options[] = {
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&bench_cuda_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  if (load_driver()) return 1;
  ctx_t c = {0};
  if (drv.cuStreamCreate(&c.stream, 1)) return 1;
  if (gca_open("cuda", NULL, &c.a[0]) || gca_open("cuda", "expandable_segments:True", &c.a[1])) {
    fprintf(stderr, "bench-cuda: %s\n", gca_last_error());
    return 1;
  }
  gca_device_properties_t props;
  gca_device_properties(c.a[0], 0, &props);
  uint64_t half = props.total_memory / 2 / ((uint64_t)64 << 20);
  int growth_blocks = half < GROWTH_BLOCKS ? (half ? (int)half : 1) : GROWTH_BLOCKS;
  const size_t sizes[] = {512, 64 << 10, 4 << 20, 64 << 20};
  enum { SIZES = sizeof sizes / sizeof sizes[0] };
  double pair[PEERS][SIZES], grow[PEERS];
  for (int p = 0; p < PEERS; p++) {
    for (int s = 0; s < SIZES; s++) pair[p][s] = time_pairs(&c, (peer_t)p, sizes[s], p == DRIVER ? 200 : 20000);
    grow[p] = time_growth(&c, (peer_t)p, growth_blocks);
  }
  enum { PINNED_SIZES = 3 };
  const size_t pinned_sizes[PINNED_SIZES] = {64 << 10, 1 << 20, 16 << 20};
  double pinning[PINNING_WAYS][PINNED_SIZES], pinned_pair = time_pinned_pairs(64 << 10);
  for (int w = 0; w < PINNING_WAYS; w++)
    for (int s = 0; s < PINNED_SIZES; s++) pinning[w][s] = time_pinning_way(w, pinned_sizes[s]);
  if (json) {
    printf("{\"device\":");
    gca__json_string(stdout, props.name);
    printf(",\"peers\":[");
    for (int p = 0; p < PEERS; p++) {
      printf("%s{\"name\":\"%s\",\"pair_ns\":{", p ? "," : "", peer_names[p]);
      for (int s = 0; s < SIZES; s++) printf("%s\"%zu\":%.1f", s ? "," : "", sizes[s], pair[p][s]);
      printf("},\"grow_64MiB_ns\":%.0f,\"grow_blocks\":%d}", grow[p], growth_blocks);
    }
    printf("],\"pinned\":{\"new_block_us\":[");
    for (int w = 0; w < PINNING_WAYS; w++) {
      printf("%s{\"name\":\"%s\"", w ? "," : "", pinning_names[w]);
      for (int s = 0; s < PINNED_SIZES; s++) printf(",\"%zu\":%.1f", pinned_sizes[s], pinning[w][s]);
      printf("}");
    }
    printf("],\"cached_pair_64KiB_ns\":%.1f}}\n", pinned_pair);
  } else {
    printf("%s: ns per alloc+free pair on one stream (best of 5), and per 64 MiB block from an empty cache "
           "(%d blocks)\n", props.name, growth_blocks);
    printf("%-22s %10s %10s %10s %10s %14s\n", "", "512 B", "64 KiB", "4 MiB", "64 MiB", "grow 64 MiB");
    for (int p = 0; p < PEERS; p++) {
      printf("%-22s", peer_names[p]);
      for (int s = 0; s < SIZES; s++) printf(" %10.0f", pair[p][s]);
      printf(" %14.0f\n", grow[p]);
    }
    printf("%-22s", "cuMemAlloc / gcalloc");
    for (int s = 0; s < SIZES; s++) printf(" %9.0fx", pair[DRIVER][s] / pair[GCALLOC][s]);
    printf("\n%-22s", "pool / gcalloc");
    for (int s = 0; s < SIZES; s++) printf(" %9.2fx", pair[DRIVER_POOL][s] / pair[GCALLOC][s]);
    printf("\n\npinned host memory: µs per new block (%d from an empty cache, best of 5)\n", PINNED_BLOCKS);
    printf("%-26s %10s %10s %10s   %s\n", "", "64 KiB", "1 MiB", "16 MiB", "driver / this");
    for (int w = 0; w < PINNING_WAYS; w++) {
      printf("%-26s", pinning_names[w]);
      for (int s = 0; s < PINNED_SIZES; s++) printf(" %10.1f", pinning[w][s]);
      printf("  ");
      for (int s = 0; s < PINNED_SIZES; s++) printf(" %5.2fx", pinning[0][s] / pinning[w][s]);
      printf("\n");
    }
    printf("cached pinned alloc+free pair, 64 KiB: %.0f ns\n", pinned_pair);
  }
  gca_close(c.a[0]);
  gca_close(c.a[1]);
  drv.cuStreamDestroy_v2(c.stream);
  drv.cuDevicePrimaryCtxRelease_v2(0);
  /* A measurement that failed (an allocation refused) shows as -1 above;
   * the run fails, so that the check on the driver double can. */
  int failed = pinned_pair < 0;
  for (int p = 0; p < PEERS; p++) {
    failed += grow[p] < 0;
    for (int s = 0; s < SIZES; s++) failed += pair[p][s] < 0;
  }
  for (int w = 0; w < PINNING_WAYS; w++)
    for (int s = 0; s < PINNED_SIZES; s++) failed += pinning[w][s] < 0;
  if (failed) fprintf(stderr, "bench-cuda: %d measurements failed (shown as -1)\n", failed);
  return failed ? 1 : 0;
}
