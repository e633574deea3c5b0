/* `gcalloc bench-acl`: gcalloc's acl backend against AscendCL's own device
 * allocation, measured in one run.
 *
 * Workload (ns per alloc+free pair, best of 5 repetitions after a warm-up,
 * at 512 B, 64 KiB, 4 MiB and 64 MiB): gcalloc's cached pair on the acl
 * backend, against aclrtMallocAlign32 (else aclrtMalloc) + aclrtFree called
 * directly, what an allocator without a cache pays. The runtime is the one
 * the backend loads: libascendcl.so, or GCALLOC_ACL_LIBRARY. On the tests'
 * stand-in (no NPU is reachable here) the "raw" column is the stand-in's
 * host malloc, so the figures measure gcalloc's backend layer, not an NPU:
 * the output says so when the runtime reports the stand-in's SoC.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gcalloc.h"
#include "tools/tool.h"

static struct {
  int (*aclInit)(const char *);
  int (*aclrtSetDevice)(int32_t);
  int (*aclrtMalloc)(void **, size_t, int);
  int (*aclrtMallocAlign32)(void **, size_t, int);
  int (*aclrtFree)(void *);
  const char *(*aclrtGetSocName)(void);
  void (*fakeacl_set_capacity)(size_t); /* the stand-in's, when it is the stand-in */
} rt;

static const char *runtime_path(void) {
  const char *env = getenv("GCALLOC_ACL_LIBRARY");
  return env && *env ? env : "libascendcl.so";
}

static int load_runtime(void) {
  void *lib = dlopen(runtime_path(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "gcalloc bench-acl: no AscendCL runtime: cannot load %s (%s)\n", runtime_path(), dlerror());
    return -1;
  }
#define LOOK_UP(name) *(void **)&rt.name = dlsym(lib, #name)
  LOOK_UP(aclInit);
  LOOK_UP(aclrtSetDevice);
  LOOK_UP(aclrtMalloc);
  LOOK_UP(aclrtMallocAlign32);
  LOOK_UP(aclrtFree);
  LOOK_UP(aclrtGetSocName);
  LOOK_UP(fakeacl_set_capacity);
#undef LOOK_UP
  if (!rt.aclInit || !rt.aclrtSetDevice || !rt.aclrtMalloc || !rt.aclrtFree) {
    fprintf(stderr, "gcalloc bench-acl: %s is not AscendCL's runtime\n", runtime_path());
    return -1;
  }
  int r = rt.aclInit(NULL);
  if ((r != 0 && r != 100002) || rt.aclrtSetDevice(0) != 0) {
    fprintf(stderr, "gcalloc bench-acl: the runtime %s did not start (aclInit %d)\n", runtime_path(), r);
    return -1;
  }
  return 0;
}

#define REPS 5
#define PAIRS 2000

/* ns per raw pair, best of REPS; -1 when the runtime refused. */
static double raw_pair(size_t size) {
  double best = 1e30;
  for (int rep = -1; rep < REPS; rep++) {
    double t0 = tool_seconds();
    for (int i = 0; i < PAIRS; i++) {
      void *p = NULL;
      int r = rt.aclrtMallocAlign32 ? rt.aclrtMallocAlign32(&p, size, 0) : rt.aclrtMalloc(&p, size, 0);
      if (r != 0 || rt.aclrtFree(p) != 0) return -1;
    }
    double t = (tool_seconds() - t0) * 1e9 / PAIRS;
    if (rep >= 0 && t < best) best = t;
  }
  return best;
}

static double cached_pair(gca_allocator_t *a, size_t size) {
  double best = 1e30;
  for (int rep = -1; rep < REPS; rep++) {
    double t0 = tool_seconds();
    for (int i = 0; i < PAIRS; i++) {
      void *p = gca_malloc(a, size, 0, 0);
      if (!p || gca_free(a, p) != GCA_OK) return -1;
    }
    double t = (tool_seconds() - t0) * 1e9 / PAIRS;
    if (rep >= 0 && t < best) best = t;
  }
  return best;
}

const tool_command_t bench_acl_command = {
    "bench-acl", NULL, "[--json]",
    "on an NPU (or the AscendCL stand-in): gcalloc's alloc+free against aclrtMalloc",
    "\n"
    "gcalloc's acl backend against AscendCL's own allocation in the same run: a cached alloc+free pair\n"
    "against aclrtMallocAlign32 (or aclrtMalloc) + aclrtFree, at 512 B, 64 KiB, 4 MiB and 64 MiB\n"
    "(docs/acl.md). Loads libascendcl.so, or what GCALLOC_ACL_LIBRARY names; exits 1 without it. On the\n"
    "tests' stand-in it measures gcalloc's backend layer only, and says so.\n"
    "\n"
    "  --json      the figures as JSON\n"
    "  -h, --help  this help\n",
    bench_acl_main};

int bench_acl_main(int argc, char **argv) {
  bool json = false;
  const tool_option_t options[] = {
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&bench_acl_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  if (load_runtime()) return 1;
  bool stand_in = rt.fakeacl_set_capacity != NULL;
  if (stand_in) rt.fakeacl_set_capacity((size_t)8 << 30);
  gca_allocator_t *a = NULL;
  char spec[600];
  snprintf(spec, sizeof spec, "acl:library=%s", runtime_path());
  if (gca_open(spec, NULL, &a) != GCA_OK) {
    fprintf(stderr, "gcalloc bench-acl: %s\n", gca_last_error());
    return 1;
  }
  static const size_t sizes[] = {512, 64 << 10, 4 << 20, 64 << 20};
  double g[4], r[4];
  int rc = 0;
  for (int i = 0; i < 4; i++) {
    g[i] = cached_pair(a, sizes[i]);
    r[i] = raw_pair(sizes[i]);
    if (g[i] < 0 || r[i] < 0) rc = 1;
  }
  const char *soc = rt.aclrtGetSocName ? rt.aclrtGetSocName() : NULL;
  if (json) {
    printf("{\"runtime\": \"%s\", \"soc\": \"%s\", \"stand_in\": %s, \"pairs_ns\": [", runtime_path(),
           soc ? soc : "", stand_in ? "true" : "false");
    for (int i = 0; i < 4; i++)
      printf("%s{\"size\": %zu, \"gcalloc_ns\": %.1f, \"acl_ns\": %.1f, \"ratio\": %.2f}", i ? ", " : "", sizes[i],
             g[i], r[i], g[i] > 0 ? r[i] / g[i] : 0);
    printf("]}\n");
  } else {
    printf("%s: ns per alloc+free pair (best of %d x %d)%s\n", soc && *soc ? soc : "AscendCL", REPS, PAIRS,
           stand_in ? "\n  on the AscendCL stand-in (host memory): this measures gcalloc's backend layer only, "
                      "not an NPU" : "");
    printf("                   512 B     64 KiB      4 MiB     64 MiB\n");
    printf("gcalloc       %10.0f %10.0f %10.0f %10.0f\n", g[0], g[1], g[2], g[3]);
    printf("aclrtMalloc   %10.0f %10.0f %10.0f %10.0f\n", r[0], r[1], r[2], r[3]);
    printf("acl / gcalloc %9.2fx %9.2fx %9.2fx %9.2fx\n", r[0] / g[0], r[1] / g[1], r[2] / g[2], r[3] / g[3]);
  }
  gca_close(a);
  if (rc) fprintf(stderr, "gcalloc bench-acl: a measurement was refused\n");
  return rc;
}
