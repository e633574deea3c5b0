/* `gcalloc demo`: the main job for now. It drives a training-like allocation
 * sequence through gcalloc on a device (the simulated 80 GiB one by default)
 * and prints how memory evolves and the statistics at the end.
 *
 * The sequence imitates a 24-layer transformer (hidden 2048, ~1.2 B
 * parameters, fp16 weights, fp32 Adam states) trained with batches whose
 * sequence length changes every step, the pattern that fragments a caching
 * allocator: forward saves activations per layer and makes short-lived
 * workspaces, the loss makes a large logits buffer, backward frees the saved
 * activations in reverse while creating gradients, the optimizer creates its
 * states once, and zero_grad(set_to_none) frees the gradients every step.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gcalloc.h"
#include "tool.h"

#define LAYERS 24
#define HIDDEN 2048
#define VOCAB 32000
#define BATCH 8
#define SAVED_PER_LAYER 6

typedef struct demo {
  gca_allocator_t *a;
  uint64_t rng;
  int failures;
} demo_t;

static uint64_t next_random(demo_t *d) {
  d->rng = d->rng * 6364136223846793005ull + 1442695040888963407ull;
  return d->rng >> 33;
}

static void *take(demo_t *d, size_t bytes) {
  void *p = gca_malloc(d->a, bytes, 0, 0);
  if (!p) {
    d->failures++;
    fprintf(stderr, "demo: allocation of %zu bytes failed: %s\n", bytes, gca_last_error());
  }
  return p;
}

static void give(demo_t *d, void **p) {
  if (*p && gca_free(d->a, *p) != GCA_OK) {
    d->failures++;
    fprintf(stderr, "demo: free failed: %s\n", gca_last_error());
  }
  *p = NULL;
}

/* Per-layer parameter tensors: qkv, attention output, MLP up, MLP down, two norms. */
static const size_t param_elems[] = {3 * HIDDEN * HIDDEN, HIDDEN * HIDDEN, 4 * HIDDEN * HIDDEN,
                                     4 * HIDDEN * HIDDEN, 2 * HIDDEN,      2 * HIDDEN};
#define PARAMS_PER_LAYER (sizeof param_elems / sizeof param_elems[0])

static void print_gib_line(demo_t *d, int step, size_t tokens) {
  gca_stats_t s;
  gca_get_stats(d->a, 0, &s);
  printf("step %3d  tokens %6zu  allocated %7.2f GiB  reserved %7.2f GiB  peak allocated %7.2f GiB  "
         "segments %4" PRId64 "\n",
         step, tokens, s.allocated_bytes[0].current / 1073741824.0, s.reserved_bytes[0].current / 1073741824.0,
         s.allocated_bytes[0].peak / 1073741824.0, s.segment[0].current);
}

static void print_stats(gca_allocator_t *a) {
  gca_stats_t s;
  gca_get_stats(a, 0, &s);
  char table[8192];
  gca_memory_summary(a, 0, 0, table, sizeof table);
  printf("\n%s", table);
  printf("num_alloc_retries %" PRId64 "  num_ooms %" PRId64 "  num_sync_all_streams %" PRId64
         "  num_device_alloc %" PRId64 "  num_device_free %" PRId64 "  max_split_size %" PRId64 "\n",
         s.num_alloc_retries, s.num_ooms, s.num_sync_all_streams, s.num_device_alloc, s.num_device_free,
         s.max_split_size);
  printf("peak reserved / peak allocated = %.3f\n",
         s.allocated_bytes[0].peak ? (double)s.reserved_bytes[0].peak / (double)s.allocated_bytes[0].peak : 0.0);
}

static void train_step(demo_t *d, void **params, void **grads, void **adam, bool *have_adam, size_t tokens) {
  static void *saved[LAYERS][SAVED_PER_LAYER];
  size_t act = tokens * HIDDEN * 2; /* fp16 activations */
  size_t heads = 16;
  void *input = take(d, tokens * 8); /* token ids, int64 */
  for (int l = 0; l < LAYERS; l++) {
    size_t sizes[SAVED_PER_LAYER] = {act, 3 * act, tokens * heads * 4, act, 4 * act, 4 * act};
    for (int k = 0; k < SAVED_PER_LAYER; k++) saved[l][k] = take(d, sizes[k]);
    void *norm_stats = take(d, tokens * 4 * 2); /* mean and rstd, fp32 */
    void *workspace = take(d, 4 * act);
    give(d, &workspace);
    give(d, &norm_stats);
  }
  void *logits = take(d, tokens * VOCAB * 4);
  void *loss = take(d, 4);
  void *dlogits = take(d, tokens * VOCAB * 4);
  give(d, &logits);
  give(d, &loss);
  void *dx = take(d, act);
  give(d, &dlogits);
  for (int l = LAYERS - 1; l >= 0; l--) {
    for (size_t k = 0; k < PARAMS_PER_LAYER; k++)
      if (!grads[l * PARAMS_PER_LAYER + k]) grads[l * PARAMS_PER_LAYER + k] = take(d, param_elems[k] * 2);
    void *dmlp = take(d, 4 * act);
    void *dattn = take(d, 3 * act);
    void *dnext = take(d, act);
    for (int k = SAVED_PER_LAYER - 1; k >= 0; k--) give(d, &saved[l][k]);
    give(d, &dmlp);
    give(d, &dattn);
    give(d, &dx);
    dx = dnext;
  }
  give(d, &dx);
  give(d, &input);
  /* optimizer: states once (two fp32 tensors per parameter), small temporaries each step */
  for (size_t i = 0; i < LAYERS * PARAMS_PER_LAYER; i++) {
    size_t elems = param_elems[i % PARAMS_PER_LAYER];
    if (!*have_adam) {
      adam[2 * i] = take(d, elems * 4);
      adam[2 * i + 1] = take(d, elems * 4);
    }
    void *norm = take(d, 4);
    give(d, &norm);
    (void)params;
  }
  *have_adam = true;
  for (size_t i = 0; i < LAYERS * PARAMS_PER_LAYER; i++) give(d, &grads[i]); /* zero_grad(set_to_none) */
}

const tool_command_t demo_command = {
    "demo", NULL, "[--backend SPEC] [--conf CONF] [--steps N] [--seed S]",
    "run a training-like allocation sequence and print the statistics",
    "\n"
    "Runs a training-like allocation sequence (a transformer's weights, activations and gradients, step\n"
    "after step) on a device and prints the statistics and the summary table.\n"
    "\n"
    "  --backend SPEC  the device: sim (the simulated device of 80 GiB, the default), sim:capacity=40GiB,\n"
    "                  ... (docs/sim-backend.md), or cuda (docs/cuda.md)\n"
    "  --conf CONF     allocator settings in PYTORCH_CUDA_ALLOC_CONF's syntax\n"
    "  --steps N       training steps, 1 to 100000 (default 12)\n"
    "  --seed S        the sequence's random seed, 0 to 2^62 (default 42)\n"
    "  -h, --help      this help\n",
    demo_main};

int demo_main(int argc, char **argv) {
  const char *backend = "sim";
  const char *conf = NULL;
  long steps = 12, seed = 42;
  const tool_option_t options[] = {
      {"--backend", OPTION_TEXT, &backend, 0, 0, "SPEC"},
      {"--conf", OPTION_TEXT, &conf, 0, 0, "CONF"},
      {"--steps", OPTION_NUMBER, &steps, 1, 100000, "N"},
      {"--seed", OPTION_NUMBER, &seed, 0, (long)1 << 62, "S"},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&demo_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  demo_t d = {.rng = (uint64_t)seed};
  if (gca_open(backend, conf, &d.a) != GCA_OK) {
    fprintf(stderr, "gcalloc demo: %s\n", gca_last_error());
    return 1;
  }
  size_t total, free_bytes;
  gca_mem_get_info(d.a, 0, &free_bytes, &total);
  printf("gcalloc %s demo on backend '%s' (device 0: %.2f GiB), %ld training steps of a %d-layer model\n",
         gca_version(), gca_backend_name(d.a), total / 1073741824.0, steps, LAYERS);

  static void *params[LAYERS * PARAMS_PER_LAYER];
  static void *grads[LAYERS * PARAMS_PER_LAYER];
  static void *adam[2 * LAYERS * PARAMS_PER_LAYER];
  bool have_adam = false;
  for (size_t i = 0; i < LAYERS * PARAMS_PER_LAYER; i++) params[i] = take(&d, param_elems[i % PARAMS_PER_LAYER] * 2);
  for (int step = 0; step < steps && d.failures == 0; step++) {
    size_t seq = 512 + 128 * (size_t)(next_random(&d) % 13); /* 512 .. 2048 */
    train_step(&d, params, grads, adam, &have_adam, BATCH * seq);
    print_gib_line(&d, step, BATCH * seq);
  }
  print_stats(d.a);
  int check = gca_check(d.a, -1);
  printf("invariant check: %s\n", check == GCA_OK ? "ok" : gca_last_error());
  for (size_t i = 0; i < LAYERS * PARAMS_PER_LAYER; i++) give(&d, &params[i]);
  for (size_t i = 0; i < 2 * LAYERS * PARAMS_PER_LAYER; i++) give(&d, &adam[i]);
  gca_empty_cache(d.a, -1);
  printf("after freeing everything and empty_cache: reserved %" PRId64 " bytes\n", gca_reserved_bytes(d.a, 0));
  gca_close(d.a);
  return (check == GCA_OK && d.failures == 0) ? 0 : 1;
}
