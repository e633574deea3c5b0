/* Snapshots: the state of every device (segments, their blocks and states,
 * the stacks that allocated them) and the recorded history, at one moment.
 *
 * Each device is copied under its lock, as raw data (addresses, sizes, return
 * addresses); turning return addresses into names (dladdr: the object file
 * and the exported symbol) happens after, outside every lock, with a cache,
 * since histories repeat the same few hundred call sites. C++ names are
 * demangled when the process has the C++ runtime loaded (PyTorch's does;
 * gcalloc does not load it). Everything a snapshot holds lives in one arena,
 * freed at once by gca_snapshot_free.
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "observe/observe.h"
#include "core/expandable.h"
#include "core/history.h"
#include "core/mempool.h"

/* ---- the snapshot ------------------------------------------------------- */

/* A block or history entry copied under the lock, its stack still raw. */
typedef struct raw_stack {
  const uintptr_t *ips;
  uint8_t depth;
  const gca_frame_t **frames; /* where to store the resolved frames */
  size_t *frame_count;
} raw_stack_t;

typedef struct symbol {
  uintptr_t ip;
  gca_frame_t frame;
} symbol_t;

typedef struct snapshot_impl {
  gca_snapshot_t pub; /* first: the public view */
  arena_t arena;
  config_t config;    /* for the exporters' allocator_settings */
  raw_stack_t *raw;   /* stacks to resolve */
  size_t raw_count, raw_cap;
  symbol_t *symbols;  /* ip -> frame cache, open addressing */
  size_t symbol_cap, symbol_count;
  demangle_fn demangle; /* the C++ runtime's, if loaded */
} snapshot_impl_t;

const config_t *gca__snapshot_config(const gca_snapshot_t *s) { return &((const snapshot_impl_t *)s)->config; }

static void remember_stack(snapshot_impl_t *sn, const uintptr_t *ips, uint8_t depth, const gca_frame_t **frames,
                           size_t *count) {
  *frames = NULL;
  *count = 0;
  if (!depth) return;
  if (sn->raw_count == sn->raw_cap) {
    raw_stack_t *grown = gca__grow_array(sn->raw, &sn->raw_cap, sizeof *grown, 256);
    if (!grown) {
      sn->arena.failed = true;
      return;
    }
    sn->raw = grown;
  }
  /* Copy the addresses: the block may change once the lock is released. */
  uintptr_t *copy = gca__arena_alloc(&sn->arena, depth * sizeof *copy);
  if (!copy) return;
  memcpy(copy, ips, depth * sizeof *copy);
  sn->raw[sn->raw_count++] = (raw_stack_t){copy, depth, frames, count};
}

static int compare_segments(const void *x, const void *y) {
  const gca_snapshot_segment_t *a = x, *b = y;
  if (a->device != b->device) return a->device < b->device ? -1 : 1;
  return a->address < b->address ? -1 : a->address > b->address;
}

/* Fill one snapshot segment from `head` on: the whole segment, or for an
 * expandable one (as PyTorch reports them) one run of mapped blocks. */
static void copy_run(snapshot_impl_t *sn, device_t *d, segment_t *seg, block_t *head, gca_snapshot_segment_t *s) {
  size_t n = 0;
  for (block_t *b = head; b && b->state != BLOCK_UNMAPPED; b = b->next) n++;
  gca_snapshot_block_t *blocks = gca__arena_zalloc(&sn->arena, n * sizeof *blocks);
  s->device = d->index;
  s->address = head->addr;
  s->stream = seg->stream;
  s->pool = seg->pool->kind;
  s->pool_id = seg->pool->owner ? seg->pool->owner->id : 0;
  s->is_expandable = seg->expandable;
  s->blocks = blocks;
  s->block_count = blocks ? n : 0;
  size_t k = 0;
  for (block_t *b = head; b && b->state != BLOCK_UNMAPPED; b = b->next, k++) {
    s->total_size += b->size;
    if (!blocks) continue;
    gca_snapshot_block_t *bl = &blocks[k];
    bl->address = b->addr;
    bl->size = b->size;
    bl->state = block_state_of(b);
    if (bl->state == GCA_BLOCK_INACTIVE) continue;
    bl->requested_size = b->requested;
    s->active_size += b->size;
    s->requested_size += b->requested;
    if (bl->state == GCA_BLOCK_ACTIVE_ALLOCATED) s->allocated_size += b->size;
    if (b->stack) remember_stack(sn, b->stack->ips, b->stack->depth, &bl->frames, &bl->frame_count);
  }
}

/* Copy one device's segments (with the lock held); room for
 * expandable_snapshot_count(d). */
static void copy_segments(snapshot_impl_t *sn, device_t *d, gca_snapshot_segment_t *out) {
  size_t i = 0;
  for (segment_t *seg = d->segments; seg; seg = seg->next) {
    for (block_t *b = seg->head; b; b = b->next) {
      bool starts_run = b->state != BLOCK_UNMAPPED && (!b->prev || b->prev->state == BLOCK_UNMAPPED);
      if (starts_run) copy_run(sn, d, seg, b, &out[i++]);
      if (!seg->expandable) break;
    }
  }
}

/* Copy one device's history (with the lock held). */
static void copy_history(snapshot_impl_t *sn, device_t *d, gca_trace_entry_t **out, size_t *count) {
  *out = NULL;
  *count = 0;
  size_t kept = gca__history_entries(d);
  if (!kept) return;
  history_entry_t *raw = gca__arena_alloc(&sn->arena, kept * sizeof *raw);
  uintptr_t(*stacks)[MAX_FRAMES] = d->obs.history->frames ? gca__arena_alloc(&sn->arena, kept * sizeof *stacks) : NULL;
  gca_trace_entry_t *entries = gca__arena_zalloc(&sn->arena, kept * sizeof *entries);
  if (!raw || !entries || (d->obs.history->frames && !stacks)) return;
  size_t n = gca__history_copy(d, raw, stacks);
  for (size_t i = 0; i < n; i++) {
    gca_trace_entry_t *e = &entries[i];
    e->action = raw[i].action;
    e->addr = raw[i].addr;
    e->size = raw[i].size;
    e->stream = raw[i].stream;
    e->time_us = raw[i].when.time_us;
    /* (the unions: each field only for its action) */
    e->device_free = raw[i].action == GCA_TRACE_OOM ? raw[i].device_free : 0;
    e->ipc_bytes_received = raw[i].action == GCA_TRACE_IPC_REQUEST ? raw[i].ipc.received : 0;
    e->ipc_peers_asked = raw[i].action == GCA_TRACE_IPC_REQUEST ? raw[i].ipc_asked : 0;
    e->ipc_peers_silent = raw[i].action == GCA_TRACE_IPC_REQUEST ? raw[i].ipc.silent : 0;
    e->ipc_requester = raw[i].action == GCA_TRACE_IPC_RELEASE ? raw[i].ipc_requester : 0;
    remember_stack(sn, stacks ? stacks[i] : NULL, stacks ? raw[i].depth : 0, &e->frames, &e->frame_count);
  }
  *out = entries;
  *count = n;
}

/* ---- symbols ------------------------------------------------------------ */

demangle_fn gca__find_demangler(void) {
  /* Found once, then kept: the C++ runtime is not unloaded once loaded, and
   * the handle taken below holds it. */
  static _Atomic(demangle_fn) found;
  demangle_fn fn = atomic_load(&found);
  if (fn) return fn;
  *(void **)&fn = dlsym(RTLD_DEFAULT, "__cxa_demangle");
  /* Python loads extension modules with RTLD_LOCAL, so PyTorch's C++ runtime
   * is not in the global scope: ask for it by name, without loading it. */
  static const char *const runtimes[] = {"libstdc++.so.6", "libc++abi.so.1", "libc++.so.1"};
  for (size_t i = 0; !fn && i < sizeof runtimes / sizeof runtimes[0]; i++) {
    void *lib = dlopen(runtimes[i], RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib) *(void **)&fn = dlsym(lib, "__cxa_demangle");
  }
  if (fn) atomic_store(&found, fn);
  return fn;
}

const char *gca__readable_name(arena_t *ar, demangle_fn demangle, const char *name) {
  if (!demangle || strncmp(name, "_Z", 2) != 0) return gca__arena_strdup(ar, name);
  int status = -1;
  char *plain = demangle(name, NULL, NULL, &status);
  const char *kept = gca__arena_strdup(ar, status == 0 && plain ? plain : name);
  free(plain);
  return kept;
}

static const gca_frame_t *resolve(snapshot_impl_t *sn, uintptr_t ip) {
  if (sn->symbol_count * 2 >= sn->symbol_cap) {
    size_t cap = sn->symbol_cap ? 2 * sn->symbol_cap : 1024;
    symbol_t *table = calloc(cap, sizeof *table);
    if (!table) return NULL;
    for (size_t i = 0; i < sn->symbol_cap; i++) {
      if (!sn->symbols[i].ip) continue;
      size_t j = (sn->symbols[i].ip * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
      while (table[j].ip) j = (j + 1) & (cap - 1);
      table[j] = sn->symbols[i];
    }
    free(sn->symbols);
    sn->symbols = table;
    sn->symbol_cap = cap;
  }
  size_t j = (ip * 0x9E3779B97F4A7C15ull >> 20) & (sn->symbol_cap - 1);
  while (sn->symbols[j].ip && sn->symbols[j].ip != ip) j = (j + 1) & (sn->symbol_cap - 1);
  symbol_t *sym = &sn->symbols[j];
  if (sym->ip) return &sym->frame;
  Dl_info info;
  memset(&info, 0, sizeof info);
  const char *file = "??", *name = "??";
  int offset = 0;
  if (gca__py_frame(ip, &file, &name, &offset)) {
    /* (a Python frame: its file, function and line) */
  } else if (dladdr((void *)ip, &info)) {
    if (info.dli_fname) file = info.dli_fname;
    if (info.dli_sname) {
      name = info.dli_sname;
      offset = (int)(ip - (uintptr_t)info.dli_saddr);
    }
  }
  sym->ip = ip;
  sym->frame.filename = gca__arena_strdup(&sn->arena, file);
  sym->frame.name = gca__readable_name(&sn->arena, sn->demangle, name);
  sym->frame.line = offset;
  sn->symbol_count++;
  return sym->frame.filename && sym->frame.name ? &sym->frame : NULL;
}

static void resolve_all(snapshot_impl_t *sn) {
  for (size_t i = 0; i < sn->raw_count; i++) {
    raw_stack_t *r = &sn->raw[i];
    gca_frame_t *frames = gca__arena_alloc(&sn->arena, r->depth * sizeof *frames);
    if (!frames) return;
    size_t n = 0;
    for (uint8_t k = 0; k < r->depth; k++) {
      const gca_frame_t *f = resolve(sn, r->ips[k]);
      if (f) frames[n++] = *f;
    }
    *r->frames = frames;
    *r->frame_count = n;
  }
}

/* ---- public ------------------------------------------------------------- */

int gca_snapshot_take(gca_allocator_t *a, gca_snapshot_t **out) {
  if (!a || !out) return gca__set_error(GCA_ERR_INVALID, "gca_snapshot_take: %s is NULL", a ? "out" : "allocator");
  if (!allocator_usable(a, "gca_snapshot_take")) return GCA_ERR_INVALID;
  *out = NULL;
  snapshot_impl_t *sn = calloc(1, sizeof *sn);
  if (!sn) return gca__set_error(GCA_ERR_NOMEM, "out of host memory taking a snapshot");
  gca_snapshot_t *pub = &sn->pub;
  int n = a->device_count;
  /* Inside a callback under a device's lock, only that device can be read:
   * refused unless it is the allocator's only one (device_read_lock's rule,
   * asked before anything is taken). */
  const callback_frame_t *f = in_locked_callback() ? gca__callback_frame : NULL;
  if (f && (!f->reads || n != 1 || f->device != &a->devices[0])) {
    free(sn);
    return gca__callback_refuses("gca_snapshot_take");
  }
  gca_trace_entry_t **traces = gca__arena_zalloc(&sn->arena, (size_t)n * sizeof *traces);
  size_t *counts = gca__arena_zalloc(&sn->arena, (size_t)n * sizeof *counts);
  size_t total = 0, cap = 0;
  gca_snapshot_segment_t *segments = NULL;
  for (int i = 0; i < n && traces && counts; i++) {
    device_t *d = &a->devices[i];
    int how = device_read_lock(d, "gca_snapshot_take"); /* (never refused: checked above) */
    if (d->obs.recording) gca__history_event(d, GCA_TRACE_SNAPSHOT, 0, 0, 0);
    if (i == 0) sn->config = d->config;
    size_t here = gca__expandable_snapshot_count(d);
    if (total + here > cap) {
      size_t want = total + here;
      gca_snapshot_segment_t *grown = realloc(segments, want * sizeof *grown);
      if (grown) {
        segments = grown;
        cap = want;
      } else {
        sn->arena.failed = true;
      }
    }
    if (here && total + here <= cap) {
      memset(segments + total, 0, here * sizeof *segments);
      copy_segments(sn, d, segments + total);
      total += here;
    }
    copy_history(sn, d, &traces[i], &counts[i]);
    device_read_unlock(d, how);
  }
  /* The segment array moves into the arena, sorted by device and address. */
  gca_snapshot_segment_t *kept = gca__arena_alloc(&sn->arena, total * sizeof *kept + 1);
  if (kept && total) {
    memcpy(kept, segments, total * sizeof *kept);
    qsort(kept, total, sizeof *kept, compare_segments);
  }
  free(segments);
  sn->demangle = gca__find_demangler();
  resolve_all(sn);
  free(sn->raw);
  free(sn->symbols);
  sn->raw = NULL;
  sn->symbols = NULL;
  char settings[1024];
  gca__config_format(&sn->config, settings, sizeof settings);
  pub->segments = kept;
  pub->segment_count = kept ? total : 0;
  pub->device_count = n;
  pub->device_traces = (const gca_trace_entry_t *const *)traces;
  pub->trace_counts = counts;
  pub->settings = gca__arena_strdup(&sn->arena, settings);
  pub->backend = gca__arena_strdup(&sn->arena, a->backend.ops->name);
  if (sn->arena.failed || !traces || !counts || !pub->settings || !pub->backend) {
    gca_snapshot_free(pub);
    return gca__set_error(GCA_ERR_NOMEM, "out of host memory taking a snapshot");
  }
  *out = pub;
  return GCA_OK;
}

void gca_snapshot_free(gca_snapshot_t *s) {
  if (!s) return;
  snapshot_impl_t *sn = (snapshot_impl_t *)s;
  gca__arena_free(&sn->arena);
  free(sn->raw);
  free(sn->symbols);
  free(sn);
}
