/* Opening a backend by name: "NAME" or "NAME:options". The registry is a
 * plain table; backends that need a driver (cuda) load it at run time, so
 * the library never links one.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"
#include "backends/backend.h"

typedef struct backend_entry {
  const char *name;
  int (*create)(const char *options, backend_t *out);
} backend_entry_t;

static const backend_entry_t registry[] = {
    {"sim", gca__sim_backend_create},
    {"cuda", gca__cuda_backend_create},
    {"acl", gca__acl_backend_create},
};

int gca__backend_open(const char *spec, backend_t *out) {
  if (!spec || !*spec) spec = "sim";
  const char *colon = strchr(spec, ':');
  size_t name_len = colon ? (size_t)(colon - spec) : strlen(spec);
  const char *options = colon ? colon + 1 : "";
  for (size_t i = 0; i < sizeof registry / sizeof registry[0]; i++) {
    if (strlen(registry[i].name) == name_len && strncmp(registry[i].name, spec, name_len) == 0)
      return registry[i].create(options, out);
  }
  return gca__set_error(GCA_ERR_BACKEND, "unknown backend '%.*s' (available: sim, cuda, acl)", (int)name_len, spec);
}

void gca__backend_close(backend_t *b) { gca__backend_close_as(b, false); }

void gca__backend_close_as(backend_t *b, bool forked) {
  if (b && b->ops) (forked ? b->ops->forget : b->ops->destroy)(b->state);
  if (b) {
    b->ops = NULL;
    b->state = NULL;
  }
}

int gca__backend_library_path(const char *backend, const char *options, const char *key, const char *env,
                              const char *fallback, char *path, size_t cap) {
  size_t key_len = strlen(key);
  path[0] = 0;
  for (const char *p = options ? options : ""; *p;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len > key_len + 1 && strncmp(p, key, key_len) == 0 && p[key_len] == '=' && len - key_len - 1 < cap) {
      memcpy(path, p + key_len + 1, len - key_len - 1);
      path[len - key_len - 1] = 0;
    } else if (len > 0) {
      return gca__set_error(GCA_ERR_BACKEND, "%s backend: unknown option '%.*s' (options: %s=PATH)", backend, (int)len,
                            p, key);
    }
    p += len + (end ? 1 : 0);
  }
  if (!path[0]) {
    const char *value = getenv(env);
    snprintf(path, cap, "%s", value && *value ? value : fallback);
  }
  return GCA_OK;
}

bool gca__kept_handles_add(kept_handles_t *k, uintptr_t h, const char *what) {
  if (k->count == k->cap) {
    uintptr_t *grown = gca__grow_array(k->items, &k->cap, sizeof *grown, 8);
    if (!grown) {
      gca__log_message(GCA_LOG_ERROR, "%s: one the driver refused to destroy is lost (out of host memory to keep it)",
                       what);
      return false;
    }
    k->items = grown;
  }
  k->items[k->count++] = h;
  return true;
}

void gca__kept_handles_retry(kept_handles_t *k, int (*destroy)(void *ctx, uintptr_t h), void *ctx, bool last,
                             const char *what) {
  size_t kept = 0;
  for (size_t i = 0; i < k->count; i++)
    if (destroy(ctx, k->items[i]) != 0) k->items[kept++] = k->items[i];
  k->count = kept;
  if (!last) return;
  if (kept) gca__log_message(GCA_LOG_ERROR, "%s: %zu the driver refused to destroy, left to it at close", what, kept);
  free(k->items);
  *k = (kept_handles_t){0};
}

void gca__kept_handles_destroy(kept_handles_t *k, int (*destroy)(void *ctx, uintptr_t h), void *ctx, uintptr_t h,
                               const char *what) {
  if (k->count) gca__kept_handles_retry(k, destroy, ctx, false, what);
  if (destroy(ctx, h) != 0) (void)gca__kept_handles_add(k, h, what);
}
