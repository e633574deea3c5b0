/* `gcalloc bench-pools`: what private pools cost the hot path, and what
 * pausing and resuming one takes (docs/pools.md), in one run.
 *
 * A 4 KiB malloc+free loop, rounds interleaved, best of the rounds after a
 * warm-up one, on four allocators of the sim: without pools; with eight
 * pools that no route leads to (the device pays one branch); inside a
 * thread's push of a pool (every allocation looks at the thread's pushes);
 * on a stream routed to a pool (and at the device's stream routes). Each
 * against the first, as a ratio.
 *
 * Pause and resume of a pausable pool holding 1, 8 and 64 GiB in 256 MiB
 * blocks, on the sim (an 80 GiB device): the time of each, best of three,
 * without host copies and, up to 8 GiB, with them. On the sim that is the
 * bookkeeping, the unmapping and mapping calls and the pinned host
 * buffers; the copies themselves cost nothing there (no bytes move without
 * backed=1, which could not hold 64 GiB): a GPU's copy time is not in
 * these figures.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "gcalloc.h"
#include "tools/tool.h"

#define PAIRS 1000000
#define ROUNDS 7
#define ROUTED_STREAM ((gca_stream_t)0x700)

enum { PLAIN, IDLE_POOLS, THREAD_PUSH, STREAM_ROUTE, SETTINGS };

static const char *const setting_names[SETTINGS] = {"no pools", "8 pools, none routed", "in a thread's push",
                                                    "on a routed stream"};

#define BLOCK ((size_t)256 << 20)

/* Pause and resume of a pool holding `gib` GiB: the best times, in ms. */
static int pause_resume(int gib, bool backup, double *pause_ms, double *resume_ms) {
  gca_allocator_t *a = NULL;
  gca_pool_t pool = 0;
  int rc = gca_open("sim:capacity=80GiB", NULL, &a);
  if (rc == GCA_OK) rc = gca_pool_create_ex(a, 0, GCA_POOL_PAUSABLE, &pool);
  if (rc == GCA_OK) rc = gca_pool_push(a, pool);
  size_t blocks = (size_t)gib * ((size_t)1 << 30) / BLOCK;
  for (size_t i = 0; rc == GCA_OK && i < blocks; i++)
    if (!gca_malloc(a, BLOCK, 0, 0)) rc = gca_last_status();
  if (a) gca_pool_pop(a);
  *pause_ms = *resume_ms = 1e30;
  for (int r = 0; rc == GCA_OK && r < 3; r++) {
    double t0 = tool_seconds();
    rc = gca_pool_pause(a, pool, backup ? GCA_PAUSE_BACKUP : 0, NULL);
    double t1 = tool_seconds();
    if (rc == GCA_OK) rc = gca_pool_resume(a, pool, 0);
    double t2 = tool_seconds();
    if ((t1 - t0) * 1e3 < *pause_ms) *pause_ms = (t1 - t0) * 1e3;
    if ((t2 - t1) * 1e3 < *resume_ms) *resume_ms = (t2 - t1) * 1e3;
  }
  gca_close(a); /* (the pool's blocks go with it) */
  return rc;
}

static double hot_loop(gca_allocator_t *a, gca_stream_t stream) {
  double t0 = tool_seconds();
  for (int i = 0; i < PAIRS; i++) gca_free(a, gca_malloc(a, 4096, 0, stream));
  return (tool_seconds() - t0) * 1e9 / PAIRS;
}

const tool_command_t bench_pools_command = {
    "bench-pools", NULL, "[--json]", "private pools: the hot path with them against without; pause and resume",
    "\n"
    "A 4 KiB malloc+free loop on the simulated device without pools, with pools no route leads to, inside\n"
    "a thread's push of a pool, and on a stream routed to a pool: ns per pair and the ratio to the first.\n"
    "Then pause and resume of a pool holding 1, 8 and 64 GiB, with and without host copies (docs/pools.md).\n"
    "\n"
    "  --json      the figures as JSON\n"
    "  -h, --help  this help\n",
    bench_pools_main};

int bench_pools_main(int argc, char **argv) {
  bool json = false;
  const tool_option_t options[] = {
      {"--json", OPTION_FLAG, &json, 0, 0, NULL},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&bench_pools_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  gca_allocator_t *a[SETTINGS] = {0};
  gca_pool_t pool[SETTINGS] = {0};
  int rc = 0;
  for (int s = 0; s < SETTINGS && rc == 0; s++) {
    rc = gca_open("sim", NULL, &a[s]);
    for (int k = 0; rc == 0 && s != PLAIN && k < (s == IDLE_POOLS ? 8 : 1); k++) rc = gca_pool_create(a[s], 0, &pool[s]);
  }
  if (rc == 0) rc = gca_pool_route_stream(a[STREAM_ROUTE], pool[STREAM_ROUTE], ROUTED_STREAM);
  if (rc == 0) rc = gca_pool_push(a[THREAD_PUSH], pool[THREAD_PUSH]);
  double best[SETTINGS];
  for (int s = 0; s < SETTINGS; s++) best[s] = 1e30;
  for (int r = 0; rc == 0 && r < ROUNDS; r++)
    for (int s = 0; s < SETTINGS; s++) {
      double t = hot_loop(a[s], s == STREAM_ROUTE ? ROUTED_STREAM : 0);
      if (r > 0 && t < best[s]) best[s] = t;
    }
  /* The loops really went to the pools. */
  gca_pool_stats_t st;
  for (int s = THREAD_PUSH; rc == 0 && s <= STREAM_ROUTE; s++)
    if ((rc = gca_pool_get_stats(a[s], pool[s], &st)) == GCA_OK && st.segments == 0) rc = GCA_ERR_CORRUPT;
  if (rc) fprintf(stderr, "gcalloc bench-pools: %s\n", gca_last_status() ? gca_last_error() : "a loop missed its pool");
  if (a[THREAD_PUSH]) gca_pool_pop(a[THREAD_PUSH]);
  for (int s = 0; s < SETTINGS; s++) gca_close(a[s]);
  if (rc) return 1;
  static const int gibs[3] = {1, 8, 64};
  double pause_ms[3][2], resume_ms[3][2]; /* [size][backup] */
  for (int i = 0; i < 3 && rc == 0; i++)
    for (int backup = 0; backup < 2 && rc == 0; backup++) {
      pause_ms[i][backup] = resume_ms[i][backup] = -1;
      if (backup && gibs[i] > 8) continue; /* (the host copies of 64 GiB would need 64 GiB of host memory) */
      rc = pause_resume(gibs[i], backup, &pause_ms[i][backup], &resume_ms[i][backup]);
    }
  if (rc) {
    fprintf(stderr, "gcalloc bench-pools: pause and resume: %s\n", gca_last_error());
    return 1;
  }
  if (json) {
    printf("{\"hot_path_ns\": {");
    for (int s = 0; s < SETTINGS; s++)
      printf("%s\"%s\": {\"ns\": %.2f, \"ratio\": %.3f}", s ? ", " : "", setting_names[s], best[s],
             best[s] / best[PLAIN]);
    printf("}, \"pause_resume_ms\": [");
    for (int i = 0; i < 3; i++)
      printf("%s{\"gib\": %d, \"pause\": %.3f, \"resume\": %.3f, \"pause_backup\": %.3f, \"resume_backup\": %.3f}",
             i ? ", " : "", gibs[i], pause_ms[i][0], resume_ms[i][0], pause_ms[i][1], resume_ms[i][1]);
    printf("]}\n");
  } else {
    printf("hot path, 4 KiB malloc+free, best of %d rounds of %d pairs, interleaved:\n", ROUNDS - 1, PAIRS);
    for (int s = 0; s < SETTINGS; s++)
      printf("  %-22s %6.1f ns  (%.3fx)\n", setting_names[s], best[s], best[s] / best[PLAIN]);
    printf("\npause and resume of a pool in 256 MiB blocks (sim, best of 3; copies cost nothing on the sim):\n");
    printf("  %6s  %10s  %10s  %16s  %16s\n", "GiB", "pause ms", "resume ms", "pause+copy ms", "resume+copy ms");
    for (int i = 0; i < 3; i++) {
      printf("  %6d  %10.3f  %10.3f", gibs[i], pause_ms[i][0], resume_ms[i][0]);
      if (pause_ms[i][1] >= 0) printf("  %16.3f  %16.3f\n", pause_ms[i][1], resume_ms[i][1]);
      else printf("  %16s  %16s\n", "-", "-");
    }
  }
  return 0;
}
