/* `gcalloc bench-pools`: what private pools cost the hot path
 * (docs/pools.md), in one run.
 *
 * A 4 KiB malloc+free loop, rounds interleaved, best of the rounds after a
 * warm-up one, on four allocators of the sim: without pools; with eight
 * pools that no route leads to (the device pays one branch); inside a
 * thread's push of a pool (every allocation looks at the thread's pushes);
 * on a stream routed to a pool (and at the device's stream routes). Each
 * against the first, as a ratio.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "gcalloc.h"
#include "../tools/tool.h"

#define PAIRS 1000000
#define ROUNDS 7
#define ROUTED_STREAM ((gca_stream_t)0x700)

enum { PLAIN, IDLE_POOLS, THREAD_PUSH, STREAM_ROUTE, SETTINGS };

static const char *const setting_names[SETTINGS] = {"no pools", "8 pools, none routed", "in a thread's push",
                                                    "on a routed stream"};

static double hot_loop(gca_allocator_t *a, gca_stream_t stream) {
  double t0 = tool_seconds();
  for (int i = 0; i < PAIRS; i++) gca_free(a, gca_malloc(a, 4096, 0, stream));
  return (tool_seconds() - t0) * 1e9 / PAIRS;
}

const tool_command_t bench_pools_command = {
    "bench-pools", NULL, "[--json]", "the hot path's cost with private pools in use, against without",
    "\n"
    "A 4 KiB malloc+free loop on the simulated device without pools, with pools no route leads to, inside\n"
    "a thread's push of a pool, and on a stream routed to a pool: ns per pair and the ratio to the first\n"
    "(docs/pools.md).\n"
    "\n"
    "  --json      the figures as JSON\n"
    "  -h, --help  this help\n"};

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
  if (json) {
    printf("{\"hot_path_ns\": {");
    for (int s = 0; s < SETTINGS; s++)
      printf("%s\"%s\": {\"ns\": %.2f, \"ratio\": %.3f}", s ? ", " : "", setting_names[s], best[s],
             best[s] / best[PLAIN]);
    printf("}}\n");
  } else {
    printf("hot path, 4 KiB malloc+free, best of %d rounds of %d pairs, interleaved:\n", ROUNDS - 1, PAIRS);
    for (int s = 0; s < SETTINGS; s++)
      printf("  %-22s %6.1f ns  (%.3fx)\n", setting_names[s], best[s], best[s] / best[PLAIN]);
  }
  return 0;
}
