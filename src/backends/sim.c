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
 * Fault injection: fail the Nth allocation (fail_at; with fail_count=K the
 * K allocations from the Nth), every allocation after the Nth (fail_after),
 * or each with a seeded probability (fail_rate, seed); an injected failure
 * looks like a full device (GCA_ERR_OOM). free_fail_at makes the Nth free
 * fail with the memory still allocated, as a driver error would. latency_ns
 * makes every allocate and free take that much longer, as driver calls do.
 * event_fail_at makes the Nth event record fail and wait_fail_at the Nth
 * host wait (event or stream synchronize), as driver errors would.
 * host_fail_at makes the Nth pinned host allocation or registration fail
 * as out of memory; host_capacity bounds the pinned host memory.
 *
 * Pinned host memory is real host memory (the caller writes it): allocated
 * page-aligned, or the caller's own registered; the sim tracks both by
 * address, so is_pinned answers for any pointer inside. Work queued with
 * sim_launch may name host addresses, as a copy from pinned memory would;
 * freeing or unregistering memory such work still uses is a hazard.
 *
 * Asynchrony: simulated time (one clock for all devices) moves only when the
 * driver of the sim advances it or when the host waits. Each stream knows
 * when its queued work completes (ready_at): work queued with sim_launch
 * starts at max(now, ready_at) and pushes ready_at on; an event recorded on a
 * stream completes at the stream's ready_at; a stream made to wait on an
 * event cannot start work before the event completes. With engines=N, at
 * most N pieces of work run at once on a device (streams then share it, as
 * large kernels share a GPU); by default streams never hold each other up. Work that uses memory
 * is remembered until it completes, which makes the sim a race detector for
 * device memory: a launch that touches memory still used by unordered work of
 * another stream, or a device free of memory in use, is a hazard, counted
 * and reported. That is how the tests prove the allocator never hands out or
 * frees memory that queued work may still touch.
 *
 * Virtual memory: address ranges are reserved from the same address space
 * (aligned to `granularity`, 2 MiB by default, as CUDA's); physical memory
 * counts against capacity like an allocation (and fault injection treats it
 * as one); a mapping must lie inside a reservation, at a multiple of the
 * granularity, over nothing mapped, and cover its whole handle. Unmapping
 * memory that queued work still uses is a hazard, as a free is. Mapped
 * memory may be used by sim_launch like allocated memory. In backed mode
 * the mappings are real: a reservation is host address space (PROT_NONE),
 * physical memory is a range of a sparse memfd per device, a mapping maps
 * it there read-write, an unmap maps nothing again, and a destroy punches
 * the range out of the file (its memory goes back to the host).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, fallocate */
#endif
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "base/base.h"
#include "base/tree.h"
#include "backends/backend.h"
#include "backends/sim_driver.h"
#include "backends/sim_shared.h"

#define SIM_ALIGN ((size_t)512)
#define SIM_SPAN ((uintptr_t)1 << 50)        /* address range per device: room for ~100 reservations of 9 TiB */
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
  size_t mapped;     /* reservations: bytes mapped inside */
  void *host;        /* backed mode: the host memory */
  RB_ENTRY(sim_alloc) link;
} sim_alloc_t;

static int compare_allocs(const sim_alloc_t *a, const sim_alloc_t *b) {
  return a->addr < b->addr ? -1 : a->addr > b->addr;
}

RB_HEAD(sim_live, sim_alloc);
RB_GENERATE_STATIC(sim_live, sim_alloc, link, compare_allocs)
/* Reserved address ranges: the same records in a tree of their own. */
RB_HEAD(sim_reserved, sim_alloc);
RB_GENERATE_STATIC(sim_reserved, sim_alloc, link, compare_allocs)
/* Mappings are kept in a page table: for each page (granularity) of device
 * addresses, the physical memory mapped there, found by hashing the page
 * number's high bits to a leaf of MAP_LEAF_PAGES entries. An expandable
 * segment maps and unmaps a page at a time, thousands of them in a replay,
 * and a tree of mappings cost a descent of cache misses for each (half of
 * such a replay's time); a page's entry costs one hash probe, and the pages
 * of one call share their leaf. The physical memory's record says where its
 * mapping starts and how long it is. */
#define MAP_LEAF_BITS 12
#define MAP_LEAF_PAGES ((size_t)1 << MAP_LEAF_BITS)
typedef struct map_leaf {
  uint32_t phys[MAP_LEAF_PAGES]; /* slot + 1 of the physical memory mapped at the page; 0: none */
} map_leaf_t;

/* Physical memory, in a table like the events' (handle = generation << 32
 * | slot + 1), 16 bytes a slot. The table is made of chunks of
 * PHYS_CHUNK_SLOTS that never move, and a slot is first written when it is
 * first handed out: an expandable segment creates a handle per page (a
 * replay's device may make thousands), and a table grown by doubling, its
 * free list threaded through every new slot ahead, would write twice the
 * memory it uses and copy it at each growth, each fresh 4 KiB page a fault
 * in a new process. */
typedef struct sim_phys {
  union {
    uintptr_t mapped_at; /* live: where it is mapped; 0: not mapped */
    uint32_t next_free;  /* free: the free list, slot + 1; 0 ends it */
  };
  uint32_t pages;        /* size in pages of the granularity; 0: a free slot */
  uint32_t generation;   /* bumped when the slot is freed */
  uint64_t unit;         /* backed mode: where it lies in the device's memfd, in pages */
} sim_phys_t;
#define PHYS_CHUNK_BITS 10
#define PHYS_CHUNK_SLOTS ((uint32_t)1 << PHYS_CHUNK_BITS)

typedef struct sim_stream {
  gca_stream_t handle;
  uint64_t ready_at;  /* when the work queued so far completes */
} sim_stream_t;

/* Queued work that uses memory, kept until it completes. */
typedef struct sim_work {
  uintptr_t addr;
  size_t size;
  gca_stream_t stream;
  uint64_t end;
} sim_work_t;

/* Events live in a table per device; a handle is (generation << 32) |
 * (slot + 1), so a stale or made-up handle is recognised, never followed. */
typedef struct sim_event {
  uint64_t at;          /* completes when now >= at */
  uint32_t generation;  /* bumped when the slot is freed */
  uint32_t next_free;   /* free list, slot + 1; 0 ends it */
  bool live;
} sim_event_t;

typedef struct sim_device {
  size_t used;
  sim_range_t *free_ranges; /* address order */
  struct sim_live live;
  sim_counters_t counters;
  sim_stream_t *streams;    /* created on first use; few, so a plain array */
  size_t stream_count, stream_cap;
  sim_work_t *work;         /* pending work that uses memory */
  size_t work_count, work_cap;
  sim_event_t *events;
  uint32_t event_cap;
  uint32_t free_events;     /* head of the free list, slot + 1; 0: none */
  uint64_t *engine_free_at; /* engines=N: when each engine finishes its work */
  struct sim_reserved reserved;
  addr_map_t map_leaves;    /* page number >> MAP_LEAF_BITS -> map_leaf_t * (see map_leaf_t); empty until
                             * the first mapping */
  sim_phys_t **phys_chunks; /* of PHYS_CHUNK_SLOTS slots each (see sim_phys_t) */
  uint32_t phys_chunk_count, phys_chunk_cap;
  uint32_t phys_used;       /* slots handed out at least once: the rest are unwritten */
  uint32_t free_phys;       /* head of the free list, slot + 1; 0: none */
  sim_place_t *places;      /* sim_set_placement's list, addresses made this device's */
  size_t place_count, place_next;
  bool capturing;           /* gca__sim_set_capture: a stream of the device is being captured */
  /* Backed mode's physical memory: a memfd as large as the capacity
   * (sparse), and which of its pages are taken. Made at the first use. */
  int phys_fd1;             /* the memfd + 1; 0: none yet */
  uint8_t *phys_taken;
  size_t phys_units;
} sim_device_t;

typedef struct sim {
  lock_t lock; /* lock.h: the replay maps expandable segments page by page, a call each */
  int device_count;
  size_t capacity;
  sim_shared_t *shared; /* shared=NAME: the capacity is shared with other processes (sim_shared.c) */
  uint64_t fail_at;     /* 0: off */
  uint64_t fail_count;  /* allocations failing from fail_at on (1 by default) */
  uint64_t free_fail_at; /* 0: off */
  uint64_t fail_after;  /* UINT64_MAX: off */
  double fail_rate;
  uint64_t rng;
  uint64_t latency_ns;
  uint64_t event_fail_at; /* 0: off */
  uint64_t wait_fail_at;  /* 0: off */
  uint64_t waits;         /* host waits so far, all devices */
  uint64_t now;         /* simulated ns */
  uint32_t engines;     /* 0: unlimited */
  size_t granularity;   /* of virtual memory */
  bool no_vm;           /* vm=0: the device offers none (as a driver without it) */
  bool backed;
  /* Pinned host memory: real host memory (callers write it), allocated
   * (host_alloc) or registered (host_register), in one tree by address. */
  struct sim_live host;
  size_t host_capacity;   /* SIZE_MAX: only the host's own limit */
  size_t host_used;
  uint64_t host_fail_at;  /* 0: off */
  uint64_t host_calls;    /* host_alloc and host_register calls */
  uint64_t host_live;
  uint64_t host_unbacked_pages;
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
  if (s->fail_at && call >= s->fail_at && call - s->fail_at < s->fail_count) return true;
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

/* [addr, addr + size) out of the device's free ranges, when one holds it
 * whole. False when none does, or the host is out of memory. */
static bool take_range_at(sim_device_t *dev, uintptr_t addr, size_t size) {
  for (sim_range_t **link = &dev->free_ranges; *link; link = &(*link)->next) {
    sim_range_t *r = *link;
    if (r->addr > addr) return false;
    if (addr - r->addr > r->size || r->size - (addr - r->addr) < size) continue;
    size_t before = addr - r->addr, after = r->size - before - size;
    if (before && after) { /* split in two: the part after is a range of its own */
      sim_range_t *rest = malloc(sizeof *rest);
      if (!rest) return false;
      *rest = (sim_range_t){.addr = addr + size, .size = after, .next = r->next};
      r->size = before;
      r->next = rest;
    } else if (before) {
      r->size = before;
    } else if (after) {
      r->addr += size;
      r->size -= size;
    } else {
      *link = r->next;
      free(r);
    }
    return true;
  }
  return false;
}

/* Where an allocation of `footprint` bytes goes: the next placement's
 * address when it is for this size and free, else first fit. */
static bool place_range(sim_device_t *dev, size_t size, size_t footprint, uintptr_t *addr) {
  if (dev->place_next < dev->place_count && dev->places[dev->place_next].size == size) {
    uintptr_t at = (uintptr_t)dev->places[dev->place_next++].addr;
    if (take_range_at(dev, at, footprint)) {
      *addr = at;
      return true;
    }
  }
  return take_range(dev, footprint, addr);
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

/* ---- streams, work and hazards (with the sim lock held) ---------------- */

/* The stream's state, created on first use; NULL only on host OOM (or, with
 * create false, when the stream was never used). */
static sim_stream_t *find_stream(sim_device_t *dev, gca_stream_t handle, bool create) {
  for (size_t i = 0; i < dev->stream_count; i++)
    if (dev->streams[i].handle == handle) return &dev->streams[i];
  if (!create) return NULL;
  if (dev->stream_count == dev->stream_cap) {
    sim_stream_t *grown = gca__grow_array(dev->streams, &dev->stream_cap, sizeof *grown, 8);
    if (!grown) return NULL;
    dev->streams = grown;
  }
  sim_stream_t *st = &dev->streams[dev->stream_count++];
  st->handle = handle;
  st->ready_at = 0;
  return st;
}

/* Forget the work that has completed by `now`. */
static void prune_work(sim_device_t *dev, uint64_t now) {
  size_t kept = 0;
  for (size_t i = 0; i < dev->work_count; i++)
    if (dev->work[i].end > now) dev->work[kept++] = dev->work[i];
  dev->work_count = kept;
}

/* Pending work overlapping [addr, addr + size) that runs past `from`, or NULL. */
static const sim_work_t *conflicting_work(const sim_device_t *dev, uintptr_t addr, size_t size, uint64_t from) {
  for (size_t i = 0; i < dev->work_count; i++) {
    const sim_work_t *w = &dev->work[i];
    if (w->end > from && w->addr < addr + size && addr < w->addr + w->size) return w;
  }
  return NULL;
}

static sim_event_t *event_of(sim_device_t *dev, uintptr_t handle) {
  uint64_t slot = ((uint64_t)handle & 0xffffffffu) - 1;
  if (slot >= dev->event_cap) return NULL;
  sim_event_t *e = &dev->events[slot];
  return e->live && e->generation == (uint32_t)((uint64_t)handle >> 32) ? e : NULL;
}

/* A free slot; false on host OOM. */
static bool new_event(sim_device_t *dev, uint64_t at, uintptr_t *handle) {
  if (!dev->free_events) {
    uint32_t cap = dev->event_cap ? 2 * dev->event_cap : 64;
    if (cap > 0x7fffffffu) return false;
    sim_event_t *grown = realloc(dev->events, (size_t)cap * sizeof *grown);
    if (!grown) return false;
    for (uint32_t i = dev->event_cap; i < cap; i++)
      grown[i] = (sim_event_t){.next_free = i + 1 < cap ? i + 2 : 0};
    dev->free_events = dev->event_cap + 1;
    dev->events = grown;
    dev->event_cap = cap;
  }
  uint32_t slot = dev->free_events - 1;
  sim_event_t *e = &dev->events[slot];
  dev->free_events = e->next_free;
  e->at = at;
  e->live = true;
  *handle = (uintptr_t)(((uint64_t)e->generation << 32) | (slot + 1));
  return true;
}

static int bad_event(int device, uintptr_t handle) {
  return gca__set_error(GCA_ERR_INVALID, "sim: %#" PRIxPTR " is not a live event of device %d", handle, device);
}

static int wait_until(sim_t *s, sim_device_t *dev, uint64_t at) {
  dev->counters.host_waits++;
  if (s->wait_fail_at && ++s->waits == s->wait_fail_at)
    return gca__set_error(GCA_ERR_BACKEND, "sim: injected failure of host wait #%" PRIu64, s->waits);
  if (at > s->now) s->now = at;
  return GCA_OK;
}

/* An allocation of device memory (malloc or vm_create) asks for
 * `footprint` bytes: the injected failures and the capacity may refuse it. */
static int charge(sim_t *s, sim_device_t *dev, int device, size_t size, size_t footprint) {
  uint64_t call = ++dev->counters.malloc_calls;
  if (injected_failure(s, call))
    return gca__set_error(GCA_ERR_OOM, "sim: injected failure of allocation #%llu on device %d",
                          (unsigned long long)call, device);
  size_t free_bytes = 0;
  if (s->shared) { /* taken from the shared device now; uncharge() gives it back if the caller fails after */
    int rc = gca__sim_shared_charge(s->shared, device, footprint, &free_bytes);
    if (rc == GCA_ERR_OOM)
      return gca__set_error(GCA_ERR_OOM, "sim: device %d is out of memory (%zu bytes asked, %zu free to all the "
                            "processes sharing it)", device, size, free_bytes);
    if (rc != GCA_OK) return rc; /* (its lock out of reach: the message says why) */
  } else if (footprint > s->capacity - dev->used) {
    return gca__set_error(GCA_ERR_OOM, "sim: device %d is out of memory (%zu bytes asked, %zu free)", device, size,
                          s->capacity - dev->used);
  }
  return GCA_OK;
}

/* Bytes that stop counting against the device (freed, or charged and then
 * not allocated after all). */
static void uncharge(sim_t *s, int device, size_t footprint) {
  if (s->shared) gca__sim_shared_release(s->shared, device, footprint);
}

static int sim_device_count(void *state) { return ((sim_t *)state)->device_count; }

/* While a stream of the device is captured into a graph, a driver refuses
 * what would synchronize or leave the graph unable to replay: the device
 * frees, unmaps and destroys nothing, and records, queries and waits for no
 * event or stream. The sim refuses them too, and counts each. */
static int refused_in_capture(sim_device_t *dev, int device, const char *what) {
  dev->counters.capture_violations++;
  return gca__set_error(GCA_ERR_BACKEND, "sim: %s on device %d while one of its streams is captured", what, device);
}

static int sim_malloc(void *state, int device, size_t size, uintptr_t *addr) {
  sim_t *s = state;
  add_latency(s);
  if (size == 0 || size > SIM_MAX_CAPACITY)
    return gca__set_error(size ? GCA_ERR_OOM : GCA_ERR_INVALID, "sim: device %d cannot allocate %zu bytes",
                          device, size);
  size_t footprint = (size + SIM_ALIGN - 1) & ~(SIM_ALIGN - 1);
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  int rc = charge(s, dev, device, size, footprint);
  bool charged = rc == GCA_OK;
  sim_alloc_t *rec = NULL;
  if (rc == GCA_OK) {
    rec = calloc(1, sizeof *rec);
    if (!rec) rc = gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  }
  if (rc == GCA_OK && s->backed) {
    rec->host = aligned_alloc(SIM_ALIGN, footprint);
    if (!rec->host) rc = gca__set_error(GCA_ERR_OOM, "sim: backed mode cannot get %zu bytes of host memory", size);
    else rec->addr = (uintptr_t)rec->host;
  } else if (rc == GCA_OK && !place_range(dev, size, footprint, &rec->addr)) {
    /* Capacity is at most half the span, so only fragmentation of the
     * address space itself can bring us here. */
    rc = gca__set_error(GCA_ERR_OOM, "sim: device %d has no free address range of %zu bytes", device, size);
  }
  if (rc != GCA_OK) {
    if (charged) uncharge(s, device, footprint); /* (charged, then not allocated) */
    free(rec);
    lock_release(&s->lock);
    return rc;
  }
  rec->size = size;
  rec->footprint = footprint;
  RB_INSERT(sim_live, &dev->live, rec);
  dev->used += footprint;
  dev->counters.mallocs++;
  dev->counters.live++;
  *addr = rec->addr;
  lock_release(&s->lock);
  return GCA_OK;
}

static int sim_free(void *state, int device, uintptr_t addr, size_t size) {
  sim_t *s = state;
  add_latency(s);
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  sim_alloc_t key = {.addr = addr};
  sim_alloc_t *rec = RB_FIND(sim_live, &dev->live, &key);
  uint64_t call = ++dev->counters.free_calls;
  int rc = GCA_OK;
  if (dev->capturing) {
    rc = refused_in_capture(dev, device, "free");
  } else if (!rec) {
    rc = gca__set_error(GCA_ERR_BAD_POINTER, "sim: device %d never allocated %p (or it was freed already)", device,
                        (void *)addr);
  } else if (rec->size != size) {
    rc = gca__set_error(GCA_ERR_BAD_POINTER, "sim: free of %p on device %d with size %zu, allocated with %zu",
                        (void *)addr, device, size, rec->size);
  } else if (s->free_fail_at && call == s->free_fail_at) {
    rc = gca__set_error(GCA_ERR_BACKEND, "sim: injected failure of free #%" PRIu64 " on device %d", call, device);
  } else {
    prune_work(dev, s->now);
    const sim_work_t *w = conflicting_work(dev, rec->addr, rec->footprint, s->now);
    if (w) {
      dev->counters.hazards++;
      rc = gca__set_error(GCA_ERR_CORRUPT,
                          "sim: hazard: device %d frees [%#" PRIxPTR ", +%zu) while work of stream %#" PRIxPTR
                          " on [%#" PRIxPTR ", +%zu) runs until t=%" PRIu64 " ns (now %" PRIu64 ")",
                          device, rec->addr, rec->size, (uintptr_t)w->stream, w->addr, w->size, w->end, s->now);
    }
    RB_REMOVE(sim_live, &dev->live, rec);
    if (rec->host) free(rec->host);
    /* On host OOM the range is lost to the address model; capacity is not. */
    else (void)give_range(dev, rec->addr, rec->footprint);
    dev->used -= rec->footprint;
    uncharge(s, device, rec->footprint);
    dev->counters.frees++;
    dev->counters.live--;
    free(rec);
  }
  lock_release(&s->lock);
  return rc;
}

static int sim_mem_get_info(void *state, int device, size_t *free_bytes, size_t *total_bytes) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  *free_bytes = s->shared ? gca__sim_shared_free(s->shared, device) : s->capacity - s->devices[device].used;
  *total_bytes = s->capacity;
  lock_release(&s->lock);
  return GCA_OK;
}

static int sim_event_record(void *state, int device, gca_stream_t stream, uintptr_t *event) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  uint64_t call = ++dev->counters.events_recorded;
  int rc = GCA_OK;
  sim_stream_t *st = NULL;
  if (dev->capturing) {
    rc = refused_in_capture(dev, device, "event record");
  } else if (s->event_fail_at && call == s->event_fail_at) {
    rc = gca__set_error(GCA_ERR_BACKEND, "sim: injected failure of event record #%" PRIu64 " on device %d", call,
                        device);
  } else if (!(st = find_stream(dev, stream, true)) || !new_event(dev, st->ready_at, event)) {
    rc = gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory recording an event");
  } else {
    dev->counters.events_live++;
  }
  lock_release(&s->lock);
  return rc;
}

static int sim_event_query(void *state, int device, uintptr_t event) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  sim_event_t *e = event_of(&s->devices[device], event);
  int rc = s->devices[device].capturing ? refused_in_capture(&s->devices[device], device, "event query")
           : !e                         ? bad_event(device, event)
           : e->at <= s->now            ? GCA_OK
                                        : BACKEND_NOT_READY;
  lock_release(&s->lock);
  return rc;
}

static int sim_event_synchronize(void *state, int device, uintptr_t event) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  sim_event_t *e = event_of(&s->devices[device], event);
  int rc = GCA_OK;
  if (s->devices[device].capturing) rc = refused_in_capture(&s->devices[device], device, "event synchronize");
  else if (!e) rc = bad_event(device, event);
  else rc = wait_until(s, &s->devices[device], e->at);
  lock_release(&s->lock);
  return rc;
}

static void sim_event_destroy(void *state, int device, uintptr_t event) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  sim_event_t *e = event_of(&s->devices[device], event);
  if (e) {
    sim_device_t *dev = &s->devices[device];
    e->live = false;
    e->generation++;
    e->next_free = dev->free_events;
    dev->free_events = (uint32_t)(e - dev->events) + 1;
    dev->counters.events_live--;
  }
  lock_release(&s->lock);
}

static int sim_stream_wait_event(void *state, int device, gca_stream_t stream, uintptr_t event) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  sim_event_t *e = event_of(&s->devices[device], event);
  sim_stream_t *st = NULL;
  int rc = GCA_OK;
  if (dev->capturing) rc = refused_in_capture(dev, device, "stream wait");
  else if (!e) rc = bad_event(device, event);
  else if (!(st = find_stream(dev, stream, true))) rc = gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  else {
    if (e->at > st->ready_at) st->ready_at = e->at;
    dev->counters.stream_waits++;
  }
  lock_release(&s->lock);
  return rc;
}

static int sim_stream_synchronize(void *state, int device, gca_stream_t stream) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  sim_stream_t *st = find_stream(dev, stream, false);
  int rc = dev->capturing ? refused_in_capture(dev, device, "stream synchronize") : wait_until(s, dev, st ? st->ready_at : 0);
  lock_release(&s->lock);
  return rc;
}

/* ---- virtual memory ----------------------------------------------------- */

/* First fit of `size` bytes at a multiple of `align` in the free address ranges. */
static bool take_aligned_range(sim_device_t *dev, size_t size, size_t align, uintptr_t *addr) {
  for (sim_range_t **link = &dev->free_ranges; *link; link = &(*link)->next) {
    sim_range_t *r = *link;
    uintptr_t start = (r->addr + align - 1) & ~(uintptr_t)(align - 1);
    if (start < r->addr || start - r->addr > r->size || r->size - (start - r->addr) < size) continue;
    uintptr_t end = start + size, r_end = r->addr + r->size;
    if (end < r_end) {
      /* The part after the reservation stays free: a node of its own, or r
       * itself when nothing is left before. */
      if (start == r->addr) {
        r->addr = end;
        r->size = r_end - end;
        *addr = start;
        return true;
      }
      sim_range_t *after = malloc(sizeof *after);
      if (!after) return false;
      after->addr = end;
      after->size = r_end - end;
      after->next = r->next;
      r->next = after;
    }
    r->size = start - r->addr;
    if (r->size == 0) {
      *link = r->next;
      free(r);
    }
    *addr = start;
    return true;
  }
  return false;
}

static bool vm_aligned(const sim_t *s, uintptr_t v) { return (v & (s->granularity - 1)) == 0; }

/* ---- backed mode's real mappings (with the sim lock held) ---- */

/* The device's memfd and its page map, made at the first use. */
static int backed_ready(sim_t *s, sim_device_t *dev, int device) {
  if (dev->phys_fd1) return GCA_OK;
  size_t units = s->capacity / s->granularity;
  int fd = memfd_create("gcalloc-sim", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)(units * s->granularity)) != 0 || !(dev->phys_taken = calloc(units ? units : 1, 1))) {
    if (fd >= 0) close(fd);
    return gca__set_error(GCA_ERR_NOMEM, "sim: device %d cannot make its backed physical memory", device);
  }
  dev->phys_fd1 = fd + 1;
  dev->phys_units = units;
  return GCA_OK;
}

/* n free pages of the memfd, first fit; false if no run is free. */
static bool backed_take(sim_device_t *dev, size_t n, uint64_t *first) {
  for (size_t i = 0, run = 0; i < dev->phys_units; i++) {
    run = dev->phys_taken[i] ? 0 : run + 1;
    if (run == n) {
      *first = i + 1 - n;
      memset(dev->phys_taken + *first, 1, n);
      return true;
    }
  }
  return false;
}

/* Give n pages back: their memory returns to the host. */
static void backed_give(const sim_t *s, sim_device_t *dev, uint64_t first, size_t n) {
  (void)fallocate(dev->phys_fd1 - 1, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(first * s->granularity),
                  (off_t)(n * s->granularity));
  memset(dev->phys_taken + first, 0, n);
}

/* Nothing mapped at [addr, +size): address space only. */
static void backed_unmap(uintptr_t addr, size_t size) {
  (void)mmap((void *)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

static int sim_vm_granularity(void *state, int device, size_t *granularity) {
  sim_t *s = state;
  (void)device;
  if (s->no_vm) return gca__set_error(GCA_ERR_BACKEND, "sim: the device offers no virtual memory (vm=0)");
  if (s->backed && s->granularity % (size_t)sysconf(_SC_PAGESIZE))
    return gca__set_error(GCA_ERR_BACKEND, "sim: backed virtual memory needs a granularity of whole host pages, not %zu",
                          s->granularity);
  *granularity = s->granularity;
  return GCA_OK;
}

/* Backed mode: host address space, aligned to the granularity, nothing
 * mapped (PROT_NONE); false if the host has none. */
static bool backed_reserve(const sim_t *s, size_t size, uintptr_t *addr) {
  size_t extra = s->granularity;
  char *base = mmap(NULL, size + extra, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return false;
  uintptr_t at = ((uintptr_t)base + extra - 1) & ~(uintptr_t)(extra - 1);
  if (at > (uintptr_t)base) munmap(base, at - (uintptr_t)base);
  munmap((void *)(at + size), (uintptr_t)base + size + extra - (at + size));
  *addr = at;
  return true;
}

static int sim_vm_reserve(void *state, int device, size_t size, uintptr_t *addr) {
  sim_t *s = state;
  if (size == 0 || !vm_aligned(s, size))
    return gca__set_error(GCA_ERR_INVALID, "sim: cannot reserve %zu bytes: not a positive multiple of %zu", size,
                          s->granularity);
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  int rc = GCA_OK;
  sim_alloc_t *rec = calloc(1, sizeof *rec);
  if (!rec) rc = gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  else if (s->backed ? !backed_reserve(s, size, &rec->addr) : !take_aligned_range(dev, size, s->granularity, &rec->addr))
    rc = gca__set_error(GCA_ERR_OOM, "sim: device %d has no free address range of %zu bytes to reserve", device, size);
  if (rc == GCA_OK) {
    rec->size = rec->footprint = size;
    RB_INSERT(sim_reserved, &dev->reserved, rec);
    dev->counters.vm_reserved += size;
    *addr = rec->addr;
  } else {
    free(rec);
  }
  lock_release(&s->lock);
  return rc;
}

/* The record with the greatest address at or below addr, in the tree whose
 * root is `node`, or NULL: one descent (NFIND followed by PREV is two, and a
 * walk back up). */
static sim_alloc_t *floor_record(sim_alloc_t *node, uintptr_t addr) {
  sim_alloc_t *best = NULL;
  while (node) {
    if (node->addr <= addr) {
      best = node;
      node = RB_RIGHT(node, link);
    } else {
      node = RB_LEFT(node, link);
    }
  }
  return best;
}

/* The reservation holding [addr, addr + size), or NULL. */
static sim_alloc_t *reservation_of(sim_device_t *dev, uintptr_t addr, size_t size) {
  sim_alloc_t *r = floor_record(RB_ROOT(&dev->reserved), addr);
  if (!r || addr - r->addr > r->size || r->size - (addr - r->addr) < size) return NULL;
  return r;
}

/* The slot of physical memory (see sim_phys_t), handed out already. */
static inline sim_phys_t *phys_slot(const sim_device_t *dev, uint32_t slot) {
  return &dev->phys_chunks[slot >> PHYS_CHUNK_BITS][slot & (PHYS_CHUNK_SLOTS - 1)];
}

/* The bytes of a live slot. */
static inline size_t phys_bytes(const sim_t *s, const sim_phys_t *p) {
  return (size_t)p->pages << __builtin_ctzll(s->granularity);
}

/* The page table's entries of up to `pages` pages from the page at addr
 * (granularity-aligned) that lie in one leaf: a pointer to the first, and
 * in *run how many (at least one); NULL when the leaf does not exist. With
 * `create`, the leaf is made (NULL then only when the host is out of
 * memory). `*leaf_key`/`*leaf` cache the last leaf between calls on
 * neighbouring pages (key UINT64_MAX: none). A mapping's pages are walked a
 * leaf at a time, not looked up one by one: a 20 MiB page of an expandable
 * segment is ten entries of 2 MiB, and a replay maps and unmaps thousands
 * of them. */
static uint32_t *map_run(const sim_t *s, sim_device_t *dev, uintptr_t addr, size_t pages, bool create,
                         uint64_t *leaf_key, map_leaf_t **leaf, size_t *run) {
  /* (A shift: the granularity is a power of two, and a division was most
   * of this function's time.) */
  uint64_t page = addr >> __builtin_ctzll(s->granularity), key = page >> MAP_LEAF_BITS;
  if (key != *leaf_key) {
    /* The table is made at the first mapping: most sims never map. */
    if (!dev->map_leaves.keys && (!create || !gca__addr_map_init(&dev->map_leaves))) return NULL;
    uint64_t *found = gca__addr_map_get(&dev->map_leaves, key);
    map_leaf_t *l = found ? (map_leaf_t *)(uintptr_t)*found : NULL;
    if (!l && create) {
      if (!(l = calloc(1, sizeof *l))) return NULL;
      /* Each page written now: calloc leaves fresh memory untouched, the
       * check that follows a creation reads it (the kernel's shared zero
       * page), and the first entry set then took a copy-on-write fault,
       * which flushes every processor's TLB for the page (an
       * interprocessor call each, four per leaf, while another device
       * replays on the other processor). (Through a volatile pointer: a
       * compiler folds malloc and memset into calloc.) */
      for (size_t at = 0; at < sizeof *l; at += 4096) ((volatile unsigned char *)l)[at] = 0;
      if (!gca__addr_map_put(&dev->map_leaves, key, (uint64_t)(uintptr_t)l)) {
        free(l);
        return NULL;
      }
    }
    if (!l) return NULL;
    *leaf_key = key;
    *leaf = l;
  }
  size_t first = (size_t)(page & (MAP_LEAF_PAGES - 1)), room = MAP_LEAF_PAGES - first;
  *run = pages < 1 ? 1 : pages < room ? pages : room;
  return &(*leaf)->phys[first];
}

/* The entry of the page at addr alone (as map_run). */
static uint32_t *map_entry(const sim_t *s, sim_device_t *dev, uintptr_t addr, bool create, uint64_t *leaf_key,
                           map_leaf_t **leaf) {
  size_t run;
  return map_run(s, dev, addr, 1, create, leaf_key, leaf, &run);
}

/* The physical memory mapped at the page of addr, or NULL. */
static sim_phys_t *mapped_at_page(const sim_t *s, sim_device_t *dev, uintptr_t addr, uint64_t *leaf_key,
                                  map_leaf_t **leaf) {
  uint32_t *e = map_entry(s, dev, addr, false, leaf_key, leaf);
  return e && *e ? phys_slot(dev, *e - 1) : NULL;
}

/* The first mapping that starts in [addr, addr + size) or covers addr, or
 * NULL, for the message of a refused unreserve (the reservation's count of
 * mapped bytes is what refuses). Walks the pages, skipping the leaves that
 * do not exist. */
static sim_phys_t *first_mapping_in(const sim_t *s, sim_device_t *dev, uintptr_t addr, size_t size) {
  uint64_t leaf_key = UINT64_MAX;
  map_leaf_t *leaf = NULL;
  size_t leaf_span = MAP_LEAF_PAGES * s->granularity;
  for (uintptr_t at = addr; at - addr < size;) {
    uint32_t *e = map_entry(s, dev, at, false, &leaf_key, &leaf);
    if (e && *e) return phys_slot(dev, *e - 1);
    /* No leaf: skip to the next one. */
    at = e ? at + s->granularity : (at | (leaf_span - 1)) + 1;
  }
  return NULL;
}

static int sim_vm_unreserve(void *state, int device, uintptr_t addr, size_t size) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  sim_alloc_t key = {.addr = addr};
  sim_alloc_t *r = RB_FIND(sim_reserved, &dev->reserved, &key);
  sim_phys_t *m = NULL;
  int rc = GCA_OK;
  if (dev->capturing) {
    rc = refused_in_capture(dev, device, "address range release");
    lock_release(&s->lock);
    return rc;
  }
  if (!r || r->size != size)
    rc = gca__set_error(GCA_ERR_BAD_POINTER, "sim: device %d has no reservation of %zu bytes at %#" PRIxPTR, device,
                        size, addr);
  else if (r->mapped) {
    m = first_mapping_in(s, dev, addr, size);
    rc = gca__set_error(GCA_ERR_INVALID,
                        "sim: cannot give back the reservation at %#" PRIxPTR ": %#" PRIxPTR " (+%zu) is still mapped",
                        addr, m ? m->mapped_at : addr, m ? phys_bytes(s, m) : r->mapped);
  }
  if (rc == GCA_OK) {
    RB_REMOVE(sim_reserved, &dev->reserved, r);
    if (s->backed) munmap((void *)r->addr, r->size);
    else (void)give_range(dev, r->addr, r->size);
    dev->counters.vm_reserved -= r->size;
    free(r);
  }
  lock_release(&s->lock);
  return rc;
}

static sim_phys_t *phys_of(sim_device_t *dev, uintptr_t handle) {
  uint64_t slot = ((uint64_t)handle & 0xffffffffu) - 1;
  if (slot >= dev->phys_used) return NULL;
  sim_phys_t *p = phys_slot(dev, (uint32_t)slot);
  return p->pages && p->generation == (uint32_t)((uint64_t)handle >> 32) ? p : NULL;
}

/* A slot for physical memory: a freed one, else the next never used (its
 * chunk made when it is the first of one); UINT32_MAX when the host is out
 * of memory. */
static uint32_t take_phys_slot(sim_device_t *dev) {
  if (dev->free_phys) {
    uint32_t slot = dev->free_phys - 1;
    dev->free_phys = phys_slot(dev, slot)->next_free;
    return slot;
  }
  if (dev->phys_used == UINT32_MAX - 1) return UINT32_MAX; /* (handles are slot + 1, 32 bits) */
  if (dev->phys_used == (size_t)dev->phys_chunk_count * PHYS_CHUNK_SLOTS) {
    if (dev->phys_chunk_count == dev->phys_chunk_cap) {
      uint32_t cap = dev->phys_chunk_cap ? 2 * dev->phys_chunk_cap : 8;
      sim_phys_t **grown = realloc(dev->phys_chunks, (size_t)cap * sizeof *grown);
      if (!grown) return UINT32_MAX;
      dev->phys_chunks = grown;
      dev->phys_chunk_cap = cap;
    }
    sim_phys_t *chunk = malloc(PHYS_CHUNK_SLOTS * sizeof *chunk);
    if (!chunk) return UINT32_MAX;
    dev->phys_chunks[dev->phys_chunk_count++] = chunk;
  }
  uint32_t slot = dev->phys_used++;
  phys_slot(dev, slot)->generation = 0;
  return slot;
}

/* Physical memory of `size` bytes (a positive multiple of the granularity,
 * of at most 2^32 - 1 pages), with the sim lock held; `charged`: its bytes
 * were taken from the shared device already (precharge). */
static int create_locked(sim_t *s, sim_device_t *dev, int device, size_t size, uintptr_t *handle, bool charged) {
  int rc = s->backed ? backed_ready(s, dev, device) : GCA_OK;
  if (rc == GCA_OK && charged) ++dev->counters.malloc_calls;
  else if (rc == GCA_OK) rc = charge(s, dev, device, size, size);
  if (rc != GCA_OK) return rc;
  uint64_t unit = 0;
  size_t pages = size >> __builtin_ctzll(s->granularity);
  if (s->backed && !backed_take(dev, pages, &unit)) {
    uncharge(s, device, size);
    return gca__set_error(GCA_ERR_OOM, "sim: device %d has no run of %zu free bytes of backed memory", device, size);
  }
  uint32_t slot = take_phys_slot(dev);
  if (slot == UINT32_MAX) {
    if (s->backed) backed_give(s, dev, unit, pages);
    uncharge(s, device, size);
    return gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  }
  sim_phys_t *p = phys_slot(dev, slot);
  p->unit = unit;
  p->pages = (uint32_t)pages;
  p->mapped_at = 0;
  *handle = (uintptr_t)(((uint64_t)p->generation << 32) | (slot + 1));
  dev->used += size;
  dev->counters.mallocs++;
  dev->counters.live++;
  dev->counters.vm_handles++;
  return GCA_OK;
}

/* A shared device's bytes for up to n pieces of `size` bytes, taken in one
 * or two visits to its region instead of one a piece (each visit takes the
 * region's lock and sums every process's share: a 768 MiB mapping of 2 MiB
 * pages made 384 of them): as many pieces as fit, counted from the free
 * memory the first visit saw; the pieces past them are charged one by one,
 * so the first that does not fit fails with charge()'s message. Not where
 * failures are injected: those count each piece as a call. Returns how many
 * pieces were charged. */
static size_t precharge(sim_t *s, int device, size_t size, size_t n) {
  if (!s->shared || n < 2 || n > SIZE_MAX / size || s->fail_at || s->fail_after != UINT64_MAX || s->fail_rate > 0)
    return 0;
  size_t free_bytes = 0;
  int rc = gca__sim_shared_charge(s->shared, device, n * size, &free_bytes);
  if (rc == GCA_OK) return n;
  gca__clear_error();
  size_t fit = rc == GCA_ERR_OOM ? free_bytes / size : 0;
  if (fit < 2 || gca__sim_shared_charge(s->shared, device, fit * size, &free_bytes) != GCA_OK) {
    gca__clear_error();
    return 0;
  }
  return fit;
}

/* n pieces of physical memory under one lock: what n vm_create calls do,
 * each counted as a call (fail_at reaches the one it names). */
static int sim_vm_create_many(void *state, int device, size_t size, size_t n, uintptr_t *handles, size_t *made) {
  sim_t *s = state;
  *made = 0;
  if (size == 0 || !vm_aligned(s, size))
    return gca__set_error(GCA_ERR_INVALID, "sim: cannot create %zu bytes of physical memory: not a positive multiple of %zu",
                          size, s->granularity);
  if (size / s->granularity > UINT32_MAX)
    return gca__set_error(GCA_ERR_INVALID, "sim: cannot create %zu bytes of physical memory: more than 2^32 - 1 pages of %zu",
                          size, s->granularity);
  for (size_t i = 0; i < n; i++) add_latency(s);
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  int rc = GCA_OK;
  size_t charged = precharge(s, device, size, n);
  while (*made < n && (rc = create_locked(s, dev, device, size, &handles[*made], *made < charged)) == GCA_OK) ++*made;
  if (*made < charged) uncharge(s, device, (charged - *made) * size);
  lock_release(&s->lock);
  return rc;
}

static int sim_vm_create(void *state, int device, size_t size, uintptr_t *handle) {
  size_t made;
  return sim_vm_create_many(state, device, size, 1, handle, &made);
}

/* Destroys one piece of physical memory, with the sim lock held; its bytes
 * are added to *uncharged, for the caller to give back to a shared device
 * in one visit. */
static int destroy_locked(sim_t *s, sim_device_t *dev, int device, uintptr_t handle, size_t *uncharged) {
  sim_phys_t *p = phys_of(dev, handle);
  uint64_t call = ++dev->counters.free_calls;
  if (dev->capturing) return refused_in_capture(dev, device, "physical memory destroy");
  if (!p)
    return gca__set_error(GCA_ERR_BAD_POINTER, "sim: %#" PRIxPTR " is not live physical memory of device %d", handle,
                          device);
  if (p->mapped_at)
    return gca__set_error(GCA_ERR_INVALID, "sim: physical memory %#" PRIxPTR " is still mapped at %#" PRIxPTR, handle,
                          p->mapped_at);
  if (s->free_fail_at && call == s->free_fail_at)
    return gca__set_error(GCA_ERR_BACKEND, "sim: injected failure of free #%" PRIu64 " on device %d", call, device);
  dev->used -= phys_bytes(s, p);
  *uncharged += phys_bytes(s, p);
  if (s->backed) backed_give(s, dev, p->unit, p->pages);
  p->pages = 0;
  p->generation++;
  p->next_free = dev->free_phys;
  dev->free_phys = (uint32_t)(handle & 0xffffffffu); /* (slot + 1, checked by phys_of) */
  dev->counters.frees++;
  dev->counters.live--;
  dev->counters.vm_handles--;
  return GCA_OK;
}

/* n vm_destroy calls under one lock: each destroyed if it can be; the
 * status of the last refused (its message the last error), how many were
 * in *refused, and those at the front of handles[]. */
static int sim_vm_destroy_many(void *state, int device, uintptr_t *handles, size_t n, size_t *refused) {
  sim_t *s = state;
  *refused = 0;
  for (size_t i = 0; i < n; i++) add_latency(s);
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  int rc = GCA_OK;
  size_t uncharged = 0;
  for (size_t i = 0; i < n; i++) {
    int one = destroy_locked(s, dev, device, handles[i], &uncharged);
    if (one != GCA_OK) {
      rc = one;
      handles[(*refused)++] = handles[i];
    }
  }
  if (uncharged) uncharge(s, device, uncharged);
  lock_release(&s->lock);
  return rc;
}

static int sim_vm_destroy(void *state, int device, uintptr_t handle) {
  size_t refused;
  return sim_vm_destroy_many(state, device, &handle, 1, &refused);
}

/* Maps handles[i] (each `size` bytes) at addr + i * size, all of them or
 * none: n vm_map calls, under one lock, with one look for the reservation
 * and one walk over the page table. */
static int sim_vm_map_many(void *state, int device, uintptr_t addr, size_t size, size_t n, const uintptr_t *handles) {
  sim_t *s = state;
  if (n == 0) return GCA_OK;
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  sim_alloc_t *r = NULL;
  int rc = GCA_OK;
  size_t marked = 0;
  /* Each handle live, unmapped and of the size; marked as it is checked,
   * so that one named twice is caught, and unmarked if anything fails. */
  for (; marked < n; marked++) {
    uintptr_t handle = handles[marked], at = addr + marked * size;
    sim_phys_t *p = phys_of(dev, handle);
    if (!p)
      rc = gca__set_error(GCA_ERR_BAD_POINTER, "sim: %#" PRIxPTR " is not live physical memory of device %d", handle,
                          device);
    else if (p->mapped_at)
      rc = gca__set_error(GCA_ERR_INVALID, "sim: physical memory %#" PRIxPTR " is mapped already (at %#" PRIxPTR ")",
                          handle, p->mapped_at);
    else if (size != phys_bytes(s, p) || !vm_aligned(s, at))
      rc = gca__set_error(GCA_ERR_INVALID, "sim: a mapping at %#" PRIxPTR " of %zu bytes must be aligned to %zu and "
                          "cover its whole physical memory (%zu bytes)", at, size, s->granularity, phys_bytes(s, p));
    else
      p->mapped_at = at;
    if (rc != GCA_OK) break;
  }
  if (rc == GCA_OK && (n > UINTPTR_MAX / size || !(r = reservation_of(dev, addr, n * size))))
    rc = gca__set_error(GCA_ERR_INVALID, "sim: [%#" PRIxPTR ", +%zu) is not inside a reserved range of device %d", addr,
                        n * size, device);
  /* Every page's entry first, free or not (leaves are made here, so a host
   * out of memory changes nothing but empty leaves), then the entries set. */
  uint64_t leaf_key = UINT64_MAX;
  map_leaf_t *leaf = NULL;
  size_t per = (size + s->granularity - 1) / s->granularity, run = 1;
  for (size_t j = 0; rc == GCA_OK && j < n; j++) {
    uintptr_t at = addr + j * size;
    for (size_t done = 0; rc == GCA_OK && done < per; done += run) {
      uint32_t *e = map_run(s, dev, at + done * s->granularity, per - done, true, &leaf_key, &leaf, &run);
      if (!e) {
        rc = gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
        break;
      }
      for (size_t i = 0; i < run; i++)
        if (e[i]) {
          sim_phys_t *m = phys_slot(dev, e[i] - 1);
          rc = gca__set_error(GCA_ERR_INVALID, "sim: cannot map at %#" PRIxPTR ": %#" PRIxPTR " (+%zu) is mapped there",
                              at, m->mapped_at, phys_bytes(s, m));
          break;
        }
    }
  }
  /* Backed: the memory itself, mapped there. */
  for (size_t j = 0; rc == GCA_OK && s->backed && j < n; j++) {
    sim_phys_t *p = phys_of(dev, handles[j]);
    void *at = (void *)(addr + j * size);
    if (mmap(at, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, dev->phys_fd1 - 1,
             (off_t)(p->unit * s->granularity)) == MAP_FAILED) {
      rc = gca__set_error(GCA_ERR_NOMEM, "sim: cannot map backed memory at %p", at);
      if (j) backed_unmap(addr, j * size);
    }
  }
  if (rc != GCA_OK) {
    for (size_t i = 0; i < marked; i++) phys_of(dev, handles[i])->mapped_at = 0;
    lock_release(&s->lock);
    return rc;
  }
  for (size_t j = 0; j < n; j++) {
    uintptr_t at = addr + j * size;
    uint32_t slot = (uint32_t)(handles[j] & 0xffffffffu); /* (checked above: index + 1) */
    for (size_t done = 0; done < per; done += run) {
      uint32_t *e = map_run(s, dev, at + done * s->granularity, per - done, false, &leaf_key, &leaf, &run);
      for (size_t i = 0; i < run; i++) e[i] = slot;
    }
  }
  r->mapped += n * size;
  dev->counters.vm_mapped += n * size;
  dev->counters.vm_maps += n;
  lock_release(&s->lock);
  return rc;
}

static int sim_vm_map(void *state, int device, uintptr_t addr, size_t size, uintptr_t handle) {
  return sim_vm_map_many(state, device, addr, size, 1, &handle);
}

static int sim_vm_unmap(void *state, int device, uintptr_t addr, size_t size) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  int rc = GCA_OK;
  uint64_t leaf_key = UINT64_MAX;
  map_leaf_t *leaf = NULL;
  /* Whole mappings only, and no holes: check before changing anything. */
  uintptr_t at = addr, end = addr + size;
  if (dev->capturing)
    rc = refused_in_capture(dev, device, "unmap"), end = at;
  else if (end < addr)
    rc = gca__set_error(GCA_ERR_INVALID, "sim: [%#" PRIxPTR ", +%zu) wraps around the address space", addr, size);
  while (rc == GCA_OK && at < end) {
    sim_phys_t *m = vm_aligned(s, at) ? mapped_at_page(s, dev, at, &leaf_key, &leaf) : NULL;
    if (!m || m->mapped_at != at || phys_bytes(s, m) > end - at) {
      rc = gca__set_error(GCA_ERR_INVALID, "sim: [%#" PRIxPTR ", +%zu) is not a run of whole mappings of device %d "
                          "(at %#" PRIxPTR ")", addr, size, device, at);
      break;
    }
    at += phys_bytes(s, m);
  }
  if (rc == GCA_OK && size) {
    prune_work(dev, s->now);
    const sim_work_t *w = conflicting_work(dev, addr, size, s->now);
    if (w) {
      dev->counters.hazards++;
      rc = gca__set_error(GCA_ERR_CORRUPT,
                          "sim: hazard: device %d unmaps [%#" PRIxPTR ", +%zu) while work of stream %#" PRIxPTR
                          " on [%#" PRIxPTR ", +%zu) runs until t=%" PRIu64 " ns (now %" PRIu64 ")",
                          device, addr, size, (uintptr_t)w->stream, w->addr, w->size, w->end, s->now);
    }
    /* Unmapped either way, as the driver would. */
    for (at = addr; at < end;) {
      sim_phys_t *m = mapped_at_page(s, dev, at, &leaf_key, &leaf);
      size_t mapping = phys_bytes(s, m);
      sim_alloc_t *r = reservation_of(dev, at, mapping);
      if (r) r->mapped -= mapping;
      size_t pages = (mapping + s->granularity - 1) / s->granularity, run = 1;
      for (size_t done = 0; done < pages; done += run) {
        uint32_t *e = map_run(s, dev, at + done * s->granularity, pages - done, false, &leaf_key, &leaf, &run);
        if (e) memset(e, 0, run * sizeof *e); /* (its leaf exists: it is mapped) */
      }
      m->mapped_at = 0;
      if (s->backed) backed_unmap(at, mapping);
      dev->counters.vm_mapped -= mapping;
      dev->counters.vm_unmaps++;
      at += mapping;
    }
  }
  lock_release(&s->lock);
  return rc;
}

/* `forked`: a child of fork's copy (backend.h, forget): a shared device's
 * region is left as the parent holds it. */
static void sim_close(sim_t *s, bool forked) {
  for (sim_alloc_t *rec = RB_MIN(sim_live, &s->host), *next; rec; rec = next) {
    next = RB_NEXT(sim_live, &s->host, rec);
    RB_REMOVE(sim_live, &s->host, rec);
    free(rec->host);
    free(rec);
  }
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
    for (rec = RB_MIN(sim_reserved, &dev->reserved); rec; rec = next) {
      next = RB_NEXT(sim_reserved, &dev->reserved, rec);
      RB_REMOVE(sim_reserved, &dev->reserved, rec);
      if (s->backed) munmap((void *)rec->addr, rec->size);
      free(rec);
    }
    if (dev->phys_fd1) close(dev->phys_fd1 - 1);
    free(dev->phys_taken);
    for (size_t k = 0; k < dev->map_leaves.cap; k++)
      if (dev->map_leaves.keys && dev->map_leaves.keys[k] && dev->map_leaves.keys[k] != ADDR_MAP_DELETED)
        free((map_leaf_t *)(uintptr_t)dev->map_leaves.vals[k]);
    gca__addr_map_free(&dev->map_leaves);
    free(dev->places);
    for (uint32_t k = 0; k < dev->phys_chunk_count; k++) free(dev->phys_chunks[k]);
    free(dev->phys_chunks);
    free(dev->streams);
    free(dev->work);
    free(dev->events);
    free(dev->engine_free_at);
  }
  if (forked) gca__sim_shared_forget(s->shared);
  else gca__sim_shared_leave(s->shared); /* (what this process held goes back with its slot) */
  lock_destroy(&s->lock);
  free(s);
}

static void sim_destroy(void *state) { sim_close(state, false); }
static void sim_after_fork_child(void *state) { gca__sim_shared_after_fork_child(((sim_t *)state)->shared); }
static void sim_forget(void *state) { sim_close(state, true); }

/* ---- pinned host memory ------------------------------------------------ */

/* The pinned range starting last at or below `ptr`, or NULL. With the sim lock held. */
static sim_alloc_t *pinned_range_below(sim_t *s, uintptr_t ptr) {
  sim_alloc_t key = {.addr = ptr};
  sim_alloc_t *r = RB_NFIND(sim_live, &s->host, &key);
  if (!r || r->addr != ptr) r = r ? RB_PREV(sim_live, &s->host, r) : RB_MAX(sim_live, &s->host);
  return r;
}

/* The pinned range holding `ptr`, or NULL. */
static sim_alloc_t *pinned_range_of(sim_t *s, uintptr_t ptr) {
  sim_alloc_t *r = pinned_range_below(s, ptr);
  return r && ptr - r->addr < r->size ? r : NULL;
}

/* Pinning `size` bytes more: fault injection and host_capacity may refuse. */
static int charge_host(sim_t *s, size_t size) {
  uint64_t call = ++s->host_calls;
  if (s->host_fail_at && call == s->host_fail_at)
    return gca__set_error(GCA_ERR_OOM, "sim: injected failure of pinned host allocation #%" PRIu64, call);
  if (size > s->host_capacity - s->host_used)
    return gca__set_error(GCA_ERR_OOM, "sim: out of pinned host memory (%zu bytes asked, %zu free)", size,
                          s->host_capacity - s->host_used);
  return GCA_OK;
}

/* Track [ptr, ptr + size) as pinned; `owned`: the sim allocated it. */
static int pin_range(sim_t *s, void *ptr, size_t size, bool owned) {
  sim_alloc_t *rec = calloc(1, sizeof *rec);
  if (!rec) return gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  rec->addr = (uintptr_t)ptr;
  rec->size = rec->footprint = size;
  rec->host = owned ? ptr : NULL;
  RB_INSERT(sim_live, &s->host, rec);
  s->host_used += size;
  s->host_live++;
  return GCA_OK;
}

/* Stop tracking a pinned range, as a free or an unregister. Queued work
 * still using it (sim_launch on host addresses, as a copy from pinned
 * memory would) is a hazard: the memory may be reused under it. */
static int unpin_range(sim_t *s, sim_alloc_t *rec, const char *what) {
  int rc = GCA_OK;
  for (int i = 0; i < s->device_count && rc == GCA_OK; i++) {
    sim_device_t *dev = &s->devices[i];
    prune_work(dev, s->now);
    const sim_work_t *w = conflicting_work(dev, rec->addr, rec->size, s->now);
    if (w) {
      dev->counters.hazards++;
      rc = gca__set_error(GCA_ERR_CORRUPT,
                          "sim: hazard: %s of pinned [%#" PRIxPTR ", +%zu) while work of stream %#" PRIxPTR
                          " of device %d runs until t=%" PRIu64 " ns (now %" PRIu64 ")",
                          what, rec->addr, rec->size, (uintptr_t)w->stream, i, w->end, s->now);
    }
  }
  RB_REMOVE(sim_live, &s->host, rec);
  s->host_used -= rec->size;
  s->host_live--;
  free(rec->host);
  free(rec);
  return rc;
}

static int sim_host_alloc(void *state, size_t size, void **ptr) {
  sim_t *s = state;
  *ptr = NULL;
  if (size == 0) return gca__set_error(GCA_ERR_INVALID, "sim: pinned host allocation of 0 bytes");
  add_latency(s);
  lock_acquire(&s->lock);
  int rc = charge_host(s, size);
  void *p = NULL;
  if (rc == GCA_OK && posix_memalign(&p, 4096, size) != 0)
    rc = gca__set_error(GCA_ERR_OOM, "sim: the host has no %zu bytes to pin", size);
  if (rc == GCA_OK && (rc = pin_range(s, p, size, true)) != GCA_OK) free(p);
  if (rc == GCA_OK) *ptr = p;
  lock_release(&s->lock);
  return rc;
}

static int sim_host_free(void *state, void *ptr) {
  sim_t *s = state;
  add_latency(s);
  lock_acquire(&s->lock);
  sim_alloc_t key = {.addr = (uintptr_t)ptr};
  sim_alloc_t *rec = RB_FIND(sim_live, &s->host, &key);
  int rc = !rec || !rec->host
               ? gca__set_error(GCA_ERR_BAD_POINTER, "sim: %p is not pinned host memory the sim allocated", ptr)
               : unpin_range(s, rec, "free");
  lock_release(&s->lock);
  return rc;
}

/* Pages of [ptr, ptr + size) the kernel has not backed yet (mincore): a
 * real driver faults them in one by one under its lock, which is why
 * PyTorch, and gcalloc, touch them first. 0 if it cannot tell. */
static uint64_t unbacked_pages(const void *ptr, size_t size) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  uintptr_t from = (uintptr_t)ptr / page * page, to = ((uintptr_t)ptr + size + page - 1) / page * page;
  size_t pages = (to - from) / page;
  unsigned char *resident = malloc(pages);
  uint64_t missing = 0;
  if (resident && mincore((void *)from, to - from, resident) == 0)
    for (size_t i = 0; i < pages; i++) missing += !(resident[i] & 1);
  free(resident);
  return missing;
}

static int sim_host_register(void *state, void *ptr, size_t size) {
  sim_t *s = state;
  if (!ptr || size == 0 || (uintptr_t)ptr + size < (uintptr_t)ptr)
    return gca__set_error(GCA_ERR_INVALID, "sim: cannot register [%p, +%zu)", ptr, size);
  add_latency(s);
  lock_acquire(&s->lock);
  int rc = GCA_OK;
  /* Ranges are disjoint: only the last one starting before the new one's
   * end can overlap it. */
  sim_alloc_t *r = pinned_range_below(s, (uintptr_t)ptr + size - 1);
  if (r && r->addr + r->size > (uintptr_t)ptr)
    rc = gca__set_error(GCA_ERR_INVALID, "sim: [%p, +%zu) overlaps pinned [%#" PRIxPTR ", +%zu)", ptr, size, r->addr,
                        r->size);
  if (rc == GCA_OK) rc = charge_host(s, size);
  if (rc == GCA_OK) rc = pin_range(s, ptr, size, false);
  if (rc == GCA_OK) s->host_unbacked_pages += unbacked_pages(ptr, size);
  lock_release(&s->lock);
  return rc;
}

static int sim_host_unregister(void *state, void *ptr) {
  sim_t *s = state;
  add_latency(s);
  lock_acquire(&s->lock);
  sim_alloc_t key = {.addr = (uintptr_t)ptr};
  sim_alloc_t *rec = RB_FIND(sim_live, &s->host, &key);
  int rc = !rec || rec->host ? gca__set_error(GCA_ERR_BAD_POINTER, "sim: %p was not registered", ptr)
                             : unpin_range(s, rec, "unregister");
  lock_release(&s->lock);
  return rc;
}

static int sim_host_is_pinned(void *state, const void *ptr, int *pinned) {
  sim_t *s = state;
  lock_acquire(&s->lock);
  *pinned = pinned_range_of(s, (uintptr_t)ptr) != NULL;
  lock_release(&s->lock);
  return GCA_OK;
}

static int sim_device_properties(void *state, int device, gca_device_properties_t *out) {
  sim_t *s = state;
  (void)device;
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "gcalloc sim device");
  out->total_memory = s->capacity;
  return GCA_OK;
}

/* A shared device is named by its region; another sim device is this
 * process's alone. */
/* A private sim device is this process's alone: nothing to share, and a
 * rendezvous named after it would be left behind by a killed process for
 * nobody to reuse. */
static int sim_device_identity(void *state, int device, char *out, size_t cap) {
  sim_t *s = state;
  if (!s->shared)
    return gca__set_error(GCA_ERR_BACKEND, "sim device %d is this process's alone (a shared one is "
                          "sim:shared=NAME): there is nothing to share", device);
  snprintf(out, cap, "sim:%s:%d", gca__sim_shared_name(s->shared), device);
  return GCA_OK;
}

/* ---- copies ------------------------------------------------------------- */

/* Whether [addr, +size) is device memory of the device: inside one live
 * allocation, or mapped at every page. */
static bool device_range(const sim_t *s, sim_device_t *dev, uintptr_t addr, size_t size) {
  sim_alloc_t *rec = floor_record(RB_ROOT(&dev->live), addr);
  if (rec && addr >= rec->addr && addr - rec->addr <= rec->size && size <= rec->size - (addr - rec->addr)) return true;
  if (!size || addr + size < addr) return false;
  uint64_t leaf_key = UINT64_MAX;
  map_leaf_t *leaf = NULL;
  uintptr_t first = addr & ~(uintptr_t)(s->granularity - 1);
  for (uintptr_t at = first; at < addr + size; at += s->granularity)
    if (!mapped_at_page(s, dev, at, &leaf_key, &leaf)) return false;
  return true;
}

/* A copy, in stream order: work of `size` bytes on the stream; in backed
 * mode the bytes move (the device's memory is host memory). */
static int sim_copy(sim_t *s, int device, gca_stream_t stream, void *host, uintptr_t addr, size_t size, bool to_host) {
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  int rc = GCA_OK;
  if (dev->capturing) {
    rc = refused_in_capture(dev, device, "copy");
  } else if (!host || !device_range(s, dev, addr, size)) {
    rc = gca__set_error(GCA_ERR_INVALID, "sim: copy %s [%#" PRIxPTR ", +%zu): %s", to_host ? "from" : "to", addr, size,
                        host ? "not device memory of this device" : "no host buffer");
  } else if (!find_stream(dev, stream, true)) {
    rc = gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  } else {
    if (s->backed) {
      if (to_host) memcpy(host, (const void *)addr, size);
      else memcpy((void *)addr, host, size);
    }
    if (to_host) dev->counters.copied_to_host += size;
    else dev->counters.copied_to_device += size;
  }
  lock_release(&s->lock);
  return rc;
}

static int sim_copy_to_host(void *state, int device, gca_stream_t stream, void *dst, uintptr_t src, size_t size) {
  return sim_copy(state, device, stream, dst, src, size, true);
}

static int sim_copy_to_device(void *state, int device, gca_stream_t stream, uintptr_t dst, const void *src,
                              size_t size) {
  return sim_copy(state, device, stream, (void *)src, dst, size, false);
}

static const backend_ops_t sim_ops = {
    .name = "sim",
    .device_count = sim_device_count,
    .malloc = sim_malloc,
    .free = sim_free,
    .mem_get_info = sim_mem_get_info,
    .event_record = sim_event_record,
    .event_query = sim_event_query,
    .event_synchronize = sim_event_synchronize,
    .event_destroy = sim_event_destroy,
    .stream_wait_event = sim_stream_wait_event,
    .stream_synchronize = sim_stream_synchronize,
    .copy_to_host = sim_copy_to_host,
    .copy_to_device = sim_copy_to_device,
    .vm_granularity = sim_vm_granularity,
    .vm_reserve = sim_vm_reserve,
    .vm_unreserve = sim_vm_unreserve,
    .vm_create = sim_vm_create,
    .vm_destroy = sim_vm_destroy,
    .vm_map = sim_vm_map,
    .vm_create_many = sim_vm_create_many,
    .vm_destroy_many = sim_vm_destroy_many,
    .vm_map_many = sim_vm_map_many,
    .vm_unmap = sim_vm_unmap,
    .device_properties = sim_device_properties,
    .host_alloc = sim_host_alloc,
    .host_free = sim_host_free,
    .host_register = sim_host_register,
    .host_unregister = sim_host_unregister,
    .host_is_pinned = sim_host_is_pinned,
    .device_identity = sim_device_identity,
    .destroy = sim_destroy,
    .forget = sim_forget,
    .after_fork_child = sim_after_fork_child,
    .destroy_releases_memory = true,
};

/* The sim behind a backend handle, or NULL with the error set. */
static sim_t *sim_of(const backend_t *b, int device) {
  if (!b || b->ops != &sim_ops) {
    gca__set_error(GCA_ERR_INVALID, "not a sim backend");
    return NULL;
  }
  sim_t *s = b->state;
  if (device < 0 || device >= s->device_count) {
    gca__set_error(GCA_ERR_INVALID, "sim: no device %d", device);
    return NULL;
  }
  return s;
}

int gca__sim_set_placement(const backend_t *b, int device, const sim_place_t *places, size_t n, uint64_t origin) {
  sim_t *s = sim_of(b, device);
  if (!s) return GCA_ERR_INVALID;
  sim_place_t *copy = n ? malloc(n * sizeof *copy) : NULL;
  if (n && !copy) return gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  /* Made this device's: a distance from the origin past the device's
   * range, or misaligned, leaves the entry to first fit. */
  uintptr_t base = (uintptr_t)(device + 1) * SIM_SPAN;
  for (size_t i = 0; i < n; i++) {
    uint64_t d = places[i].addr - origin;
    bool fits = places[i].addr >= origin && d < SIM_SPAN && SIM_SPAN - d >= places[i].size && d % SIM_ALIGN == 0;
    copy[i] = (sim_place_t){places[i].size, fits ? base + d : 0};
  }
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  free(dev->places);
  dev->places = copy;
  dev->place_count = n;
  dev->place_next = 0;
  lock_release(&s->lock);
  return GCA_OK;
}

int gca__sim_set_capture(const backend_t *b, int device, bool on) {
  sim_t *s = sim_of(b, device);
  if (!s) return GCA_ERR_INVALID;
  lock_acquire(&s->lock);
  s->devices[device].capturing = on;
  lock_release(&s->lock);
  return GCA_OK;
}

int gca__sim_get_counters(const backend_t *b, int device, sim_counters_t *out) {
  sim_t *s = sim_of(b, device);
  if (!s) return GCA_ERR_INVALID;
  lock_acquire(&s->lock);
  *out = s->devices[device].counters;
  out->used = s->devices[device].used;
  out->capacity = s->capacity;
  out->host_calls = s->host_calls;
  out->host_live = s->host_live;
  out->host_used = s->host_used;
  out->host_unbacked_pages = s->host_unbacked_pages;
  lock_release(&s->lock);
  return GCA_OK;
}


int gca__sim_launch(const backend_t *b, int device, gca_stream_t stream, uint64_t duration_ns, uintptr_t addr,
                    size_t size) {
  sim_t *s = sim_of(b, device);
  if (!s) return GCA_ERR_INVALID;
  if (size && addr + size < addr) return gca__set_error(GCA_ERR_INVALID, "sim: launch range wraps around");
  lock_acquire(&s->lock);
  sim_device_t *dev = &s->devices[device];
  sim_stream_t *st = find_stream(dev, stream, true);
  int rc = GCA_OK;
  if (!st) {
    lock_release(&s->lock);
    return gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  }
  uint64_t start = st->ready_at > s->now ? st->ready_at : s->now;
  uint64_t *engine = NULL;
  if (s->engines && duration_ns) {
    /* The engine free first takes the work, in launch order. */
    engine = &dev->engine_free_at[0];
    for (uint32_t i = 1; i < s->engines; i++)
      if (dev->engine_free_at[i] < *engine) engine = &dev->engine_free_at[i];
    if (*engine > start) start = *engine;
  }
  uint64_t end = start + duration_ns;
  if (engine) *engine = end;
  dev->counters.launches++;
  if (size) {
    prune_work(dev, s->now);
    const sim_work_t *w = conflicting_work(dev, addr, size, start);
    if (w) {
      dev->counters.hazards++;
      rc = gca__set_error(GCA_ERR_BACKEND,
                          "sim: hazard: work of stream %#" PRIxPTR " on [%#" PRIxPTR ", +%zu) starts at t=%" PRIu64
                          " ns while work of stream %#" PRIxPTR " on [%#" PRIxPTR ", +%zu) runs until t=%" PRIu64
                          " ns, not ordered before it",
                          (uintptr_t)stream, addr, size, start, (uintptr_t)w->stream, w->addr, w->size, w->end);
    }
    if (dev->work_count == dev->work_cap) {
      sim_work_t *grown = gca__grow_array(dev->work, &dev->work_cap, sizeof *grown, 64);
      if (grown) dev->work = grown;
    }
    /* On host OOM the work runs untracked: fewer hazards seen, none invented. */
    if (dev->work_count < dev->work_cap && duration_ns > 0)
      dev->work[dev->work_count++] = (sim_work_t){addr, size, stream, end};
  }
  st->ready_at = end;
  lock_release(&s->lock);
  return rc;
}

void gca__sim_advance(const backend_t *b, uint64_t ns) {
  sim_t *s = sim_of(b, 0);
  if (!s) return;
  lock_acquire(&s->lock);
  s->now = s->now + ns < s->now ? UINT64_MAX : s->now + ns;
  lock_release(&s->lock);
}

uint64_t gca__sim_now(const backend_t *b) {
  sim_t *s = sim_of(b, 0);
  if (!s) return 0;
  lock_acquire(&s->lock);
  uint64_t now = s->now;
  lock_release(&s->lock);
  return now;
}

uint64_t gca__sim_stream_ready_at(const backend_t *b, int device, gca_stream_t stream) {
  sim_t *s = sim_of(b, device);
  if (!s) return 0;
  lock_acquire(&s->lock);
  sim_stream_t *st = find_stream(&s->devices[device], stream, false);
  uint64_t at = st ? st->ready_at : 0;
  lock_release(&s->lock);
  return at;
}

/* ---- options ------------------------------------------------------------ */

typedef struct sim_options {
  uint64_t capacity, devices, fail_at, fail_count, fail_after, free_fail_at, seed, latency_ns, backed, event_fail_at,
      wait_fail_at, engines, granularity, host_capacity, host_fail_at, no_vm;
  double fail_rate;
  char shared[72]; /* shared=NAME */
  bool capacity_given;
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
  return gca__set_error(GCA_ERR_BACKEND, "sim backend: invalid value '%.*s' for %.*s: %s", (int)vlen, val, (int)klen,
                        key, rule);
}

static int parse_option(sim_options_t *o, const char *key, size_t klen, const char *val, size_t vlen) {
#define KEY_IS(s) (klen == strlen(s) && strncmp(key, s, klen) == 0)
  if (KEY_IS("capacity")) {
    if (!gca__parse_size(val, vlen, &o->capacity) || o->capacity == 0 || o->capacity > SIM_MAX_CAPACITY)
      return bad_option(key, klen, val, vlen, "expected a size between 1 byte and 8TiB, like 24GiB");
    o->capacity_given = true;
  } else if (KEY_IS("shared")) {
    if (vlen == 0 || vlen >= sizeof o->shared)
      return bad_option(key, klen, val, vlen, "expected a name of 1 to 64 letters, digits, '_', '-' or '.'");
    memcpy(o->shared, val, vlen);
    o->shared[vlen] = 0;
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
  } else if (KEY_IS("fail_count")) {
    if (!parse_u64(val, vlen, &o->fail_count) || o->fail_count == 0)
      return bad_option(key, klen, val, vlen, "expected a count of allocations >= 1");
  } else if (KEY_IS("free_fail_at")) {
    if (!parse_u64(val, vlen, &o->free_fail_at) || o->free_fail_at == 0)
      return bad_option(key, klen, val, vlen, "expected a free number >= 1");
  } else if (KEY_IS("event_fail_at")) {
    if (!parse_u64(val, vlen, &o->event_fail_at) || o->event_fail_at == 0)
      return bad_option(key, klen, val, vlen, "expected an event record number >= 1");
  } else if (KEY_IS("wait_fail_at")) {
    if (!parse_u64(val, vlen, &o->wait_fail_at) || o->wait_fail_at == 0)
      return bad_option(key, klen, val, vlen, "expected a host wait number >= 1");
  } else if (KEY_IS("engines")) {
    if (!parse_u64(val, vlen, &o->engines) || o->engines > 1024)
      return bad_option(key, klen, val, vlen, "expected 0 (unlimited) to 1024");
  } else if (KEY_IS("granularity")) {
    if (!gca__parse_size(val, vlen, &o->granularity) || o->granularity < SIM_ALIGN ||
        (o->granularity & (o->granularity - 1)) || o->granularity > ((uint64_t)1 << 30))
      return bad_option(key, klen, val, vlen, "expected a power of two from 512 bytes to 1GiB, like 2MiB");
  } else if (KEY_IS("host_capacity")) {
    if (!gca__parse_size(val, vlen, &o->host_capacity) || o->host_capacity == 0)
      return bad_option(key, klen, val, vlen, "expected a size of at least 1 byte, like 4GiB");
  } else if (KEY_IS("host_fail_at")) {
    if (!parse_u64(val, vlen, &o->host_fail_at) || o->host_fail_at == 0)
      return bad_option(key, klen, val, vlen, "expected a pinned host allocation number >= 1");
  } else if (KEY_IS("backed")) {
    if (!parse_u64(val, vlen, &o->backed) || o->backed > 1) return bad_option(key, klen, val, vlen, "expected 0 or 1");
  } else if (KEY_IS("vm")) {
    uint64_t vm = 0;
    if (!parse_u64(val, vlen, &vm) || vm > 1) return bad_option(key, klen, val, vlen, "expected 0 or 1");
    o->no_vm = !vm;
  } else {
    return gca__set_error(GCA_ERR_BACKEND,
                          "sim backend: unknown option '%.*s' (options: capacity, devices, fail_at, fail_count, "
                          "fail_after, fail_rate, seed, free_fail_at, latency_ns, event_fail_at, wait_fail_at, engines, "
                          "granularity, backed, vm, host_capacity, host_fail_at, shared)",
                          (int)klen, key);
  }
  return GCA_OK;
#undef KEY_IS
}

int gca__sim_backend_create(const char *options, backend_t *out) {
  sim_options_t o = {.capacity = (uint64_t)80 << 30, .devices = 1, .fail_after = UINT64_MAX, .seed = 1,
                     .granularity = (uint64_t)2 << 20};
  const char *p = options ? options : "";
  while (*p) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len > 0) {
      const char *eq = memchr(p, '=', len);
      if (!eq)
        return gca__set_error(GCA_ERR_BACKEND, "sim backend: option '%.*s' needs a value (key=value)", (int)len, p);
      int rc = parse_option(&o, p, (size_t)(eq - p), eq + 1, len - (size_t)(eq - p) - 1);
      if (rc) return rc;
    }
    p += len + (end ? 1 : 0);
  }

  sim_t *s = calloc(1, sizeof *s + (size_t)o.devices * sizeof s->devices[0]);
  if (!s) return gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  if (lock_init(&s->lock, RANK_BACKEND) != 0) {
    free(s);
    return gca__set_error(GCA_ERR_NOMEM, "sim: cannot create a lock");
  }
  s->device_count = (int)o.devices;
  s->capacity = (size_t)o.capacity;
  s->fail_at = o.fail_at;
  s->fail_count = o.fail_count ? o.fail_count : 1;
  s->free_fail_at = o.free_fail_at;
  s->fail_after = o.fail_after;
  s->fail_rate = o.fail_rate;
  s->rng = o.seed ? o.seed : 0x9E3779B97F4A7C15ull;
  s->latency_ns = o.latency_ns;
  s->event_fail_at = o.event_fail_at;
  s->wait_fail_at = o.wait_fail_at;
  s->engines = (uint32_t)o.engines;
  s->backed = o.backed != 0;
  s->no_vm = o.no_vm != 0;
  s->granularity = (size_t)o.granularity;
  s->host_capacity = o.host_capacity ? (size_t)o.host_capacity : SIZE_MAX;
  s->host_fail_at = o.host_fail_at;
  RB_INIT(&s->host);
  if (o.shared[0]) {
    size_t capacity = 0;
    int rc = gca__sim_shared_join(o.shared, s->capacity, o.capacity_given, s->device_count, &capacity, &s->shared);
    if (rc != GCA_OK) {
      lock_destroy(&s->lock);
      free(s);
      return rc;
    }
    s->capacity = capacity;
  }
  for (int i = 0; i < s->device_count; i++) {
    sim_device_t *dev = &s->devices[i];
    RB_INIT(&dev->live);
    RB_INIT(&dev->reserved);
    if (s->engines && !(dev->engine_free_at = calloc(s->engines, sizeof *dev->engine_free_at))) {
      sim_destroy(s);
      return gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
    }
    /* Device i owns [(i+1) * SPAN, (i+2) * SPAN): never 0, never shared. */
    if (!give_range(dev, (uintptr_t)(i + 1) * SIM_SPAN, SIM_SPAN)) {
      sim_destroy(s);
      return gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
    }
  }
  out->ops = &sim_ops;
  out->state = s;
  return GCA_OK;
}
