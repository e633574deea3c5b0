/* The sim backend: a model of an accelerator, so the allocator can be built,
 * tested and benchmarked with no hardware, and an 80 GiB workload replays on
 * a laptop.
 *
 * Each device has a capacity and an address range of its own (16 TiB apart,
 * so a pointer names its device). Unless `backed=1`, addresses are never
 * touched: allocating hands out a range, nothing more. Address space is
 * managed like a device's: first fit over an address-ordered list of free
 * ranges, merged on free, so addresses are reused as on real hardware. Live
 * allocations are kept in a tree so that a free of an address the device
 * never gave out, or of the wrong size, is caught: the sim is a checker of
 * the allocator as much as a stand-in for a device.
 *
 * Fault injection: fail the Nth allocation (fail_at), every allocation after
 * the Nth (fail_after), or each with a seeded probability (fail_rate, seed);
 * an injected failure looks like a full device (GCA_ERR_OOM). latency_ns
 * makes every allocate and free take that much longer, as driver calls do.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../internal.h"

#define SIM_ALIGN ((size_t)512)
#define SIM_SPAN ((uintptr_t)1 << 44)        /* address range per device */
#define SIM_MAX_CAPACITY ((size_t)1 << 43)   /* 8 TiB: half the range */
#define SIM_MAX_DEVICES 64

typedef struct sim_range {
  uintptr_t addr;
  size_t size;
  struct sim_range *next;
} sim_range_t;

typedef struct sim_alloc {
  uintptr_t addr;
  size_t size;       /* as asked */
  size_t footprint;  /* rounded to SIM_ALIGN, what counts against capacity */
  void *host;        /* backed mode: the host memory */
  RB_ENTRY(sim_alloc) link;
} sim_alloc_t;

static int compare_allocs(const sim_alloc_t *a, const sim_alloc_t *b) {
  return a->addr < b->addr ? -1 : a->addr > b->addr;
}

RB_HEAD(sim_live, sim_alloc);
RB_GENERATE_STATIC(sim_live, sim_alloc, link, compare_allocs)

typedef struct sim_device {
  size_t used;
  sim_range_t *free_ranges; /* address order */
  struct sim_live live;
  sim_counters_t counters;
} sim_device_t;

typedef struct sim {
  pthread_mutex_t lock;
  int device_count;
  size_t capacity;
  uint64_t fail_at;     /* 0: off */
  uint64_t fail_after;  /* UINT64_MAX: off */
  double fail_rate;
  uint64_t rng;
  uint64_t latency_ns;
  bool backed;
  sim_device_t devices[];
} sim_t;

static uint64_t next_random(sim_t *s) { /* xorshift64* */
  s->rng ^= s->rng >> 12;
  s->rng ^= s->rng << 25;
  s->rng ^= s->rng >> 27;
  return s->rng * 2685821657736338717ull;
}

static void add_latency(const sim_t *s) {
  if (!s->latency_ns) return;
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  do {
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while ((uint64_t)(now.tv_sec - start.tv_sec) * 1000000000u + (uint64_t)now.tv_nsec -
               (uint64_t)start.tv_nsec <
           s->latency_ns);
}

static bool injected_failure(sim_t *s, uint64_t call) {
  if (s->fail_at && call == s->fail_at) return true;
  if (call > s->fail_after) return true;
  if (s->fail_rate > 0) {
    double u = (double)(next_random(s) >> 11) / 9007199254740992.0;
    if (u < s->fail_rate) return true;
  }
  return false;
}

/* First fit in the device's free address ranges. */
static bool take_range(sim_device_t *dev, size_t size, uintptr_t *addr) {
  for (sim_range_t **link = &dev->free_ranges; *link; link = &(*link)->next) {
    sim_range_t *r = *link;
    if (r->size < size) continue;
    *addr = r->addr;
    r->addr += size;
    r->size -= size;
    if (r->size == 0) {
      *link = r->next;
      free(r);
    }
    return true;
  }
  return false;
}

/* Return a range, merging with its neighbours. False only on host OOM. */
static bool give_range(sim_device_t *dev, uintptr_t addr, size_t size) {
  sim_range_t **link = &dev->free_ranges;
  sim_range_t *prev = NULL;
  while (*link && (*link)->addr < addr) {
    prev = *link;
    link = &(*link)->next;
  }
  sim_range_t *after = *link;
  if (prev && prev->addr + prev->size == addr) {
    prev->size += size;
    if (after && prev->addr + prev->size == after->addr) {
      prev->size += after->size;
      prev->next = after->next;
      free(after);
    }
    return true;
  }
  if (after && addr + size == after->addr) {
    after->addr = addr;
    after->size += size;
    return true;
  }
  sim_range_t *r = malloc(sizeof *r);
  if (!r) return false;
  r->addr = addr;
  r->size = size;
  r->next = after;
  *link = r;
  return true;
}

static int sim_device_count(void *state) { return ((sim_t *)state)->device_count; }

static int sim_malloc(void *state, int device, size_t size, uintptr_t *addr) {
  sim_t *s = state;
  add_latency(s);
  if (size == 0 || size > SIM_MAX_CAPACITY)
    return set_error(size ? GCA_ERR_OOM : GCA_ERR_INVALID, "sim: device %d cannot allocate %zu bytes",
                     device, size);
  size_t footprint = (size + SIM_ALIGN - 1) & ~(SIM_ALIGN - 1);
  pthread_mutex_lock(&s->lock);
  sim_device_t *dev = &s->devices[device];
  uint64_t call = ++dev->counters.malloc_calls;
  int rc = GCA_OK;
  if (injected_failure(s, call)) {
    rc = set_error(GCA_ERR_OOM, "sim: injected failure of allocation #%llu on device %d",
                   (unsigned long long)call, device);
  } else if (footprint > s->capacity - dev->used) {
    rc = set_error(GCA_ERR_OOM, "sim: device %d is out of memory (%zu bytes asked, %zu free)", device, size,
                   s->capacity - dev->used);
  }
  sim_alloc_t *rec = NULL;
  if (rc == GCA_OK) {
    rec = calloc(1, sizeof *rec);
    if (!rec) rc = set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  }
  if (rc == GCA_OK && s->backed) {
    rec->host = aligned_alloc(SIM_ALIGN, footprint);
    if (!rec->host) rc = set_error(GCA_ERR_OOM, "sim: backed mode cannot get %zu bytes of host memory", size);
    else rec->addr = (uintptr_t)rec->host;
  } else if (rc == GCA_OK && !take_range(dev, footprint, &rec->addr)) {
    /* Capacity is at most half the span, so only fragmentation of the
     * address space itself can bring us here. */
    rc = set_error(GCA_ERR_OOM, "sim: device %d has no free address range of %zu bytes", device, size);
  }
  if (rc != GCA_OK) {
    free(rec);
    pthread_mutex_unlock(&s->lock);
    return rc;
  }
  rec->size = size;
  rec->footprint = footprint;
  RB_INSERT(sim_live, &dev->live, rec);
  dev->used += footprint;
  dev->counters.mallocs++;
  dev->counters.live++;
  *addr = rec->addr;
  pthread_mutex_unlock(&s->lock);
  return GCA_OK;
}

static int sim_free(void *state, int device, uintptr_t addr, size_t size) {
  sim_t *s = state;
  add_latency(s);
  pthread_mutex_lock(&s->lock);
  sim_device_t *dev = &s->devices[device];
  sim_alloc_t key = {.addr = addr};
  sim_alloc_t *rec = RB_FIND(sim_live, &dev->live, &key);
  int rc = GCA_OK;
  if (!rec) {
    rc = set_error(GCA_ERR_BACKEND, "sim: device %d never allocated %p (or it was freed already)", device,
                   (void *)addr);
  } else if (rec->size != size) {
    rc = set_error(GCA_ERR_BACKEND, "sim: free of %p on device %d with size %zu, allocated with %zu",
                   (void *)addr, device, size, rec->size);
  } else {
    RB_REMOVE(sim_live, &dev->live, rec);
    if (rec->host) free(rec->host);
    /* On host OOM the range is lost to the address model; capacity is not. */
    else (void)give_range(dev, rec->addr, rec->footprint);
    dev->used -= rec->footprint;
    dev->counters.frees++;
    dev->counters.live--;
    free(rec);
  }
  pthread_mutex_unlock(&s->lock);
  return rc;
}

static int sim_mem_get_info(void *state, int device, size_t *free_bytes, size_t *total_bytes) {
  sim_t *s = state;
  pthread_mutex_lock(&s->lock);
  *free_bytes = s->capacity - s->devices[device].used;
  *total_bytes = s->capacity;
  pthread_mutex_unlock(&s->lock);
  return GCA_OK;
}

static void sim_destroy(void *state) {
  sim_t *s = state;
  for (int i = 0; i < s->device_count; i++) {
    sim_device_t *dev = &s->devices[i];
    sim_alloc_t *rec, *next;
    for (rec = RB_MIN(sim_live, &dev->live); rec; rec = next) {
      next = RB_NEXT(sim_live, &dev->live, rec);
      RB_REMOVE(sim_live, &dev->live, rec);
      free(rec->host);
      free(rec);
    }
    while (dev->free_ranges) {
      sim_range_t *r = dev->free_ranges->next;
      free(dev->free_ranges);
      dev->free_ranges = r;
    }
  }
  pthread_mutex_destroy(&s->lock);
  free(s);
}

static const backend_ops_t sim_ops = {
    .name = "sim",
    .device_count = sim_device_count,
    .malloc = sim_malloc,
    .free = sim_free,
    .mem_get_info = sim_mem_get_info,
    .destroy = sim_destroy,
};

int sim_get_counters(const backend_t *b, int device, sim_counters_t *out) {
  if (!b || b->ops != &sim_ops) return set_error(GCA_ERR_INVALID, "not a sim backend");
  sim_t *s = b->state;
  if (device < 0 || device >= s->device_count) return set_error(GCA_ERR_INVALID, "sim: no device %d", device);
  pthread_mutex_lock(&s->lock);
  *out = s->devices[device].counters;
  out->used = s->devices[device].used;
  out->capacity = s->capacity;
  pthread_mutex_unlock(&s->lock);
  return GCA_OK;
}

/* ---- options ------------------------------------------------------------ */

typedef struct sim_options {
  uint64_t capacity, devices, fail_at, fail_after, seed, latency_ns, backed;
  double fail_rate;
} sim_options_t;

static bool parse_u64(const char *text, size_t len, uint64_t *out) {
  if (len == 0 || len > 20) return false;
  uint64_t v = 0;
  for (size_t i = 0; i < len; i++) {
    if (text[i] < '0' || text[i] > '9') return false;
    unsigned d = (unsigned)(text[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

static int bad_option(const char *key, size_t klen, const char *val, size_t vlen, const char *rule) {
  return set_error(GCA_ERR_BACKEND, "sim backend: invalid value '%.*s' for %.*s: %s", (int)vlen, val, (int)klen,
                   key, rule);
}

static int parse_option(sim_options_t *o, const char *key, size_t klen, const char *val, size_t vlen) {
#define KEY_IS(s) (klen == strlen(s) && strncmp(key, s, klen) == 0)
  if (KEY_IS("capacity")) {
    if (!parse_size(val, vlen, &o->capacity) || o->capacity == 0 || o->capacity > SIM_MAX_CAPACITY)
      return bad_option(key, klen, val, vlen, "expected a size between 1 byte and 8TiB, like 24GiB");
  } else if (KEY_IS("devices")) {
    if (!parse_u64(val, vlen, &o->devices) || o->devices < 1 || o->devices > SIM_MAX_DEVICES)
      return bad_option(key, klen, val, vlen, "expected an integer from 1 to 64");
  } else if (KEY_IS("fail_at")) {
    if (!parse_u64(val, vlen, &o->fail_at) || o->fail_at == 0)
      return bad_option(key, klen, val, vlen, "expected an allocation number >= 1");
  } else if (KEY_IS("fail_after")) {
    if (!parse_u64(val, vlen, &o->fail_after))
      return bad_option(key, klen, val, vlen, "expected a count of allocations >= 0");
  } else if (KEY_IS("fail_rate")) {
    char tmp[64];
    char *end;
    snprintf(tmp, sizeof tmp, "%.*s", (int)(vlen < 63 ? vlen : 63), val);
    o->fail_rate = strtod(tmp, &end);
    if (vlen == 0 || vlen > 63 || *end || !(o->fail_rate >= 0.0 && o->fail_rate <= 1.0))
      return bad_option(key, klen, val, vlen, "expected a probability in [0, 1]");
  } else if (KEY_IS("seed")) {
    if (!parse_u64(val, vlen, &o->seed)) return bad_option(key, klen, val, vlen, "expected an integer");
  } else if (KEY_IS("latency_ns")) {
    if (!parse_u64(val, vlen, &o->latency_ns) || o->latency_ns > 10000000000ull)
      return bad_option(key, klen, val, vlen, "expected nanoseconds, at most 10 s");
  } else if (KEY_IS("backed")) {
    if (!parse_u64(val, vlen, &o->backed) || o->backed > 1) return bad_option(key, klen, val, vlen, "expected 0 or 1");
  } else {
    return set_error(GCA_ERR_BACKEND,
                     "sim backend: unknown option '%.*s' (options: capacity, devices, fail_at, fail_after, "
                     "fail_rate, seed, latency_ns, backed)",
                     (int)klen, key);
  }
  return GCA_OK;
#undef KEY_IS
}

int sim_backend_create(const char *options, backend_t *out) {
  sim_options_t o = {.capacity = (uint64_t)80 << 30, .devices = 1, .fail_after = UINT64_MAX, .seed = 1};
  const char *p = options ? options : "";
  while (*p) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len > 0) {
      const char *eq = memchr(p, '=', len);
      if (!eq)
        return set_error(GCA_ERR_BACKEND, "sim backend: option '%.*s' needs a value (key=value)", (int)len, p);
      int rc = parse_option(&o, p, (size_t)(eq - p), eq + 1, len - (size_t)(eq - p) - 1);
      if (rc) return rc;
    }
    p += len + (end ? 1 : 0);
  }

  sim_t *s = calloc(1, sizeof *s + (size_t)o.devices * sizeof s->devices[0]);
  if (!s) return set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  if (pthread_mutex_init(&s->lock, NULL) != 0) {
    free(s);
    return set_error(GCA_ERR_NOMEM, "sim: cannot create a lock");
  }
  s->device_count = (int)o.devices;
  s->capacity = (size_t)o.capacity;
  s->fail_at = o.fail_at;
  s->fail_after = o.fail_after;
  s->fail_rate = o.fail_rate;
  s->rng = o.seed ? o.seed : 0x9E3779B97F4A7C15ull;
  s->latency_ns = o.latency_ns;
  s->backed = o.backed != 0;
  for (int i = 0; i < s->device_count; i++) {
    sim_device_t *dev = &s->devices[i];
    RB_INIT(&dev->live);
    /* Device i owns [(i+1) * SPAN, (i+2) * SPAN): never 0, never shared. */
    if (!give_range(dev, (uintptr_t)(i + 1) * SIM_SPAN, SIM_SPAN)) {
      sim_destroy(s);
      return set_error(GCA_ERR_NOMEM, "sim: out of host memory");
    }
  }
  out->ops = &sim_ops;
  out->state = s;
  return GCA_OK;
}
