/* `gcalloc demo`: allocation sequences of real-shaped jobs driven through
 * gcalloc on a device (the simulated 80 GiB one by default), with how
 * memory evolves and the statistics at the end; with --snapshot, the
 * history of the run written as a PyTorch snapshot (what the project's
 * sample data in data/snapshots is made of: scripts/make-samples.sh).
 *
 * The workloads (--workload):
 * - training: a 24-layer transformer (hidden 2048, ~1.2 B parameters, fp16
 *   weights, fp32 Adam states) trained with batches whose sequence length
 *   changes every step, the pattern that fragments a caching allocator:
 *   forward saves activations per layer and makes short-lived workspaces,
 *   the loss makes a large logits buffer, backward frees the saved
 *   activations in reverse while creating gradients, the optimizer creates
 *   its states once, zero_grad(set_to_none) frees the gradients, and every
 *   third step ends with torch.cuda.empty_cache();
 * - inference: a server decoding for up to 16 requests at once on a 7 B
 *   model's layer shapes: each request's key-value cache grows as it
 *   decodes (a bigger tensor, the old one freed, as torch.cat does),
 *   requests end after random lengths and new ones arrive, prompts are
 *   prefilled at once, and each step makes short-lived activations;
 * - cnn: a ResNet-50-shaped network trained on 224x224 images, batch 64:
 *   convolution activations from 112x112 down to 7x7, batch-norm statistics
 *   and convolution workspaces of changing sizes, and its gradients.
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

/* ---- inference -------------------------------------------------------- */

#define INF_LAYERS 32
#define INF_HIDDEN 4096
#define INF_SLOTS 16

typedef struct request {
  void *kv[INF_LAYERS]; /* keys and values of each layer, fp16 */
  size_t tokens, cap, remaining;
} request_t;

/* Room for `tokens` in a request's caches: grown by a quarter and 64
 * tokens at a time, each layer's cache copied into a bigger tensor. */
static void kv_grow(demo_t *d, request_t *r, size_t tokens) {
  if (tokens <= r->cap) return;
  size_t cap = tokens + tokens / 4 + 64;
  for (int l = 0; l < INF_LAYERS; l++) {
    void *bigger = take(d, cap * INF_HIDDEN * 2 * 2);
    give(d, &r->kv[l]);
    r->kv[l] = bigger;
  }
  r->cap = cap;
}

static void inference_step(demo_t *d, request_t *slots, int step) {
  /* Arrivals: an empty slot takes a new request now and then; its prompt is prefilled at once. */
  for (int i = 0; i < INF_SLOTS; i++) {
    request_t *r = &slots[i];
    if (r->tokens || next_random(d) % 4) continue;
    size_t prompt = 32 + next_random(d) % 2000;
    r->remaining = 16 + next_random(d) % 512;
    kv_grow(d, r, prompt);
    r->tokens = prompt;
    for (int l = 0; l < INF_LAYERS; l++) { /* prefill activations, layer by layer */
      void *qkv = take(d, prompt * INF_HIDDEN * 3 * 2), *mlp = take(d, prompt * INF_HIDDEN * 4 * 2);
      give(d, &qkv);
      give(d, &mlp);
    }
  }
  /* One decode step for every running request. */
  size_t running = 0;
  for (int i = 0; i < INF_SLOTS; i++) running += slots[i].tokens != 0;
  if (running) {
    void *hidden = take(d, running * INF_HIDDEN * 2);
    for (int l = 0; l < INF_LAYERS; l++) {
      void *qkv = take(d, running * INF_HIDDEN * 3 * 2), *attn = take(d, running * INF_HIDDEN * 2);
      void *mlp = take(d, running * INF_HIDDEN * 4 * 2);
      give(d, &qkv);
      give(d, &attn);
      give(d, &mlp);
    }
    void *logits = take(d, running * VOCAB * 4);
    give(d, &logits);
    give(d, &hidden);
  }
  for (int i = 0; i < INF_SLOTS; i++) {
    request_t *r = &slots[i];
    if (!r->tokens) continue;
    kv_grow(d, r, r->tokens + 1);
    r->tokens++;
    if (--r->remaining == 0) { /* done: its caches go */
      for (int l = 0; l < INF_LAYERS; l++) give(d, &r->kv[l]);
      r->tokens = r->cap = 0;
    }
  }
  (void)step;
}

/* ---- cnn ------------------------------------------------------------------ */

#define CNN_BATCH 64

/* ResNet-50's stages: blocks, channels out, spatial size. */
static const struct {
  int blocks, channels, side;
} cnn_stages[] = {{3, 256, 56}, {4, 512, 28}, {6, 1024, 14}, {3, 2048, 7}};
#define CNN_SAVED 512

static void cnn_step(demo_t *d, void **weights, size_t nweights, void **grads) {
  void *saved[CNN_SAVED];
  size_t nsaved = 0;
  void *images = take(d, (size_t)CNN_BATCH * 3 * 224 * 224 * 4);
  saved[nsaved++] = take(d, (size_t)CNN_BATCH * 64 * 112 * 112 * 2); /* the stem */
  for (size_t s = 0; s < sizeof cnn_stages / sizeof cnn_stages[0]; s++) {
    size_t side = (size_t)cnn_stages[s].side, out = (size_t)cnn_stages[s].channels, mid = out / 4;
    for (int b = 0; b < cnn_stages[s].blocks; b++) {
      size_t convs[3] = {mid, mid, out};
      for (int c = 0; c < 3; c++) {
        size_t act = (size_t)CNN_BATCH * convs[c] * side * side * 2;
        /* cuDNN's workspace: its size depends on the algorithm chosen for this shape. */
        void *workspace = take(d, act / 2 + (next_random(d) % 8) * ((size_t)1 << 20));
        saved[nsaved++] = take(d, act);          /* the convolution's output */
        saved[nsaved++] = take(d, convs[c] * 8); /* batch norm's mean and variance */
        give(d, &workspace);
      }
    }
  }
  void *logits = take(d, (size_t)CNN_BATCH * 1000 * 4);
  void *dlogits = take(d, (size_t)CNN_BATCH * 1000 * 4);
  give(d, &logits);
  void *dx = dlogits;
  for (size_t i = nsaved; i-- > 0;) { /* backward, in reverse: gradients made, activations freed */
    if (i < nweights && !grads[i]) grads[i] = take(d, (size_t)1 << (12 + i % 10));
    void *workspace = take(d, (size_t)1 << (20 + next_random(d) % 6));
    void *dnext = take(d, (size_t)CNN_BATCH * 64 * (1 + i % 56) * 56 * 2);
    give(d, &saved[i]);
    give(d, &workspace);
    give(d, &dx);
    dx = dnext;
  }
  give(d, &dx);
  give(d, &images);
  for (size_t i = 0; i < nweights; i++) give(d, &grads[i]); /* zero_grad(set_to_none) */
  (void)weights;
}

/* ---- the command ---------------------------------------------------------- */

typedef enum workload { TRAINING, INFERENCE, CNN } workload_t;
static const char *const workload_names[] = {"training", "inference", "cnn"};

const tool_command_t demo_command = {
    "demo", NULL, "[--workload NAME] [--backend SPEC] [--conf CONF] [--steps N] [--seed S] [--snapshot FILE]",
    "run a real-shaped job's allocations and print the statistics",
    "\n"
    "Runs a job's allocation sequence on a device and prints how memory evolves, the statistics and the\n"
    "summary table.\n"
    "\n"
    "  --workload NAME  training (the default: a 24-layer transformer trained with changing sequence\n"
    "                   lengths), inference (a server decoding for up to 16 requests, their key-value\n"
    "                   caches growing) or cnn (a ResNet-50-shaped network trained on images)\n"
    "  --backend SPEC   the device: sim (the simulated device of 80 GiB, the default), sim:capacity=40GiB,\n"
    "                   ... (docs/sim-backend.md), or cuda (docs/cuda.md)\n"
    "  --conf CONF      allocator settings in PYTORCH_CUDA_ALLOC_CONF's syntax\n"
    "  --steps N        steps, 1 to 100000 (default 12)\n"
    "  --seed S         the sequence's random seed, 0 to 2^62 (default 42)\n"
    "  --snapshot FILE  record the history and write it, with the state at the end, as a PyTorch\n"
    "                   snapshot (torch.cuda.memory._dump_snapshot's format) that gcalloc replay and\n"
    "                   memory_viz read\n"
    "  -h, --help       this help\n",
    demo_main};

/* Record the history from the start (no call stacks: a sample is the same
 * whoever makes it), and write the snapshot. */
static int write_snapshot(gca_allocator_t *a, const char *path) {
  gca_snapshot_t *snap = NULL;
  int rc = gca_snapshot_take(a, &snap);
  if (rc == GCA_OK) rc = gca_snapshot_write(snap, path, GCA_SNAPSHOT_PICKLE);
  gca_snapshot_free(snap);
  if (rc != GCA_OK) fprintf(stderr, "gcalloc demo: cannot write the snapshot %s: %s\n", path, gca_last_error());
  return rc;
}

int demo_main(int argc, char **argv) {
  const char *backend = "sim", *conf = NULL, *workload_name = "training", *snapshot = NULL;
  long steps = 12, seed = 42;
  const tool_option_t options[] = {
      {"--workload", OPTION_TEXT, &workload_name, 0, 0, "NAME"},
      {"--backend", OPTION_TEXT, &backend, 0, 0, "SPEC"},
      {"--conf", OPTION_TEXT, &conf, 0, 0, "CONF"},
      {"--steps", OPTION_NUMBER, &steps, 1, 100000, "N"},
      {"--seed", OPTION_NUMBER, &seed, 0, (long)1 << 62, "S"},
      {"--snapshot", OPTION_TEXT, &snapshot, 0, 0, "FILE"},
      {NULL, OPTION_FLAG, NULL, 0, 0, NULL},
  };
  int parsed = tool_parse(&demo_command, options, argc, argv, NULL);
  if (parsed) return parsed < 0 ? 0 : parsed;
  workload_t workload = TRAINING;
  while (strcmp(workload_name, workload_names[workload]))
    if (++workload > CNN) {
      fprintf(stderr, "gcalloc demo: no workload '%s' (training, inference or cnn)\n", workload_name);
      return 2;
    }
  demo_t d = {.rng = (uint64_t)seed};
  if (gca_open(backend, conf, &d.a) != GCA_OK) {
    fprintf(stderr, "gcalloc demo: %s\n", gca_last_error());
    return 1;
  }
  if (snapshot && gca_record_history(d.a, 1, GCA_CONTEXT_NONE, (size_t)1 << 22) != GCA_OK) {
    fprintf(stderr, "gcalloc demo: %s\n", gca_last_error());
    gca_close(d.a);
    return 1;
  }
  size_t total, free_bytes;
  gca_mem_get_info(d.a, 0, &free_bytes, &total);
  printf("gcalloc %s demo on backend '%s' (device 0: %.2f GiB): %ld %s steps\n", gca_version(), gca_backend_name(d.a),
         total / 1073741824.0, steps, workload_name);

  static void *params[LAYERS * PARAMS_PER_LAYER];
  static void *grads[LAYERS * PARAMS_PER_LAYER];
  static void *adam[2 * LAYERS * PARAMS_PER_LAYER];
  static request_t slots[INF_SLOTS];
  static void *weights[INF_LAYERS * 4];
  /* (the CNN's 128 weight tensors stand for ResNet-50's 161, their sizes spread the same way) */
  size_t nweights = workload == TRAINING ? LAYERS * PARAMS_PER_LAYER : INF_LAYERS * 4;
  bool have_adam = false;
  for (size_t i = 0; i < nweights; i++) {
    size_t bytes = workload == INFERENCE ? (size_t)INF_HIDDEN * INF_HIDDEN * (i % 4 == 3 ? 8 : 2) * 2
                   : workload == CNN     ? (size_t)1 << (12 + i % 10)
                                         : param_elems[i % PARAMS_PER_LAYER] * 2;
    (workload == TRAINING ? params : weights)[i] = take(&d, bytes);
  }
  for (int step = 0; step < steps && d.failures == 0; step++) {
    size_t tokens = 0;
    if (workload == TRAINING) {
      tokens = BATCH * (512 + 128 * (size_t)(next_random(&d) % 13)); /* 512 .. 2048 a sequence */
      train_step(&d, params, grads, adam, &have_adam, tokens);
      if (step % 3 == 2) gca_empty_cache(d.a, -1); /* (torch.cuda.empty_cache() after an evaluation, say) */
    } else if (workload == INFERENCE) {
      inference_step(&d, slots, step);
      if (step % 3 == 2) gca_empty_cache(d.a, -1); /* (a server trimming its cache) */
      for (int i = 0; i < INF_SLOTS; i++) tokens += slots[i].tokens;
    } else {
      cnn_step(&d, weights, nweights, grads);
      tokens = CNN_BATCH;
    }
    print_gib_line(&d, step, tokens);
  }
  print_stats(d.a);
  int check = gca_check(d.a, -1);
  printf("invariant check: %s\n", check == GCA_OK ? "ok" : gca_last_error());
  int written = snapshot ? write_snapshot(d.a, snapshot) : GCA_OK;
  if (snapshot && written == GCA_OK) printf("snapshot written: %s\n", snapshot);
  for (size_t i = 0; i < nweights; i++) give(&d, &(workload == TRAINING ? params : weights)[i]);
  for (size_t i = 0; i < 2 * LAYERS * PARAMS_PER_LAYER; i++) give(&d, &adam[i]);
  for (int i = 0; i < INF_SLOTS; i++)
    for (int l = 0; l < INF_LAYERS; l++) give(&d, &slots[i].kv[l]);
  gca_empty_cache(d.a, -1);
  printf("after freeing everything and empty_cache: reserved %" PRId64 " bytes\n", gca_reserved_bytes(d.a, 0));
  gca_close(d.a);
  return (check == GCA_OK && d.failures == 0 && written == GCA_OK) ? 0 : 1;
}
