/* One simulated device shared by several processes ("sim:shared=NAME"):
 * the capacity, and what each process holds of it, live in a POSIX
 * shared-memory region, so that processes on it run out of memory as they
 * would on one GPU. Everything else of the sim (addresses, streams, events)
 * stays per process, as a GPU's address space is.
 *
 * A process may be stopped (SIGSTOP, a suspended job) at any point, the
 * lock held: the free memory is read without the lock, and every wait for
 * it lasts at most a second, after which a charge fails naming the holder
 * and a release is kept back for the next time the lock is taken.
 *
 * The region, /gcalloc-sim-NAME (mode 0600: the same user only), holds a
 * header checked by every joiner (magic, version, size, devices,
 * capacity), a process-shared robust mutex, and a slot per process: its
 * pid, its start time (so that a reused pid is not taken for it) and its
 * bytes on each device. The slot of a process that died is reclaimed, its
 * memory given back, as a driver does, whenever a request would not fit,
 * and a mutex its owner died holding is repaired by the next locker. Every
 * value read from the region is bounds-checked: a region that is not one
 * (a foreign or corrupted object) is refused with a message naming it.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/base.h"
#include "backends/backend.h"
#include "backends/sim_driver.h"
#include "backends/sim_shared.h"

#define SHARED_MAGIC 0x4843534d49534347ull /* "GCSIMSCH" */
#define SHARED_VERSION 4u
/* How long a process waits for the region's lock: a holder may be stopped
 * (SIGSTOP, a suspended job), and a robust mutex waits for a stopped
 * process for ever. */
#define LOCK_WAIT_NS 1000000000u
#define SHARED_SLOTS 64
#define SHARED_DEVICES 64

/* Written under the region's lock, and read without it too (the free
 * memory a process asks for): atomics. */
typedef struct shared_slot {
  _Atomic int32_t pid; /* 0: free */
  _Atomic uint64_t start_time;
  _Atomic uint64_t pidns; /* the pid namespace the pid is in */
  _Atomic uint32_t locked; /* its process holds the slot's lock byte (gca__slot_alive) */
  _Atomic uint64_t used[SHARED_DEVICES];
} shared_slot_t;

typedef struct shared_region {
  _Atomic uint64_t magic; /* set last by the creator */
  uint32_t version, size;
  uint32_t devices;
  uint64_t capacity;
  pthread_mutex_t lock;
  _Atomic int32_t holder; /* the pid holding the lock (for a message) */
  shared_slot_t slots[SHARED_SLOTS];
} shared_region_t;

struct sim_shared {
  shared_region_t *r;
  int fd; /* the region's file, open while the slot is held: its lock byte (-1: none) */
  int slot;
  int32_t pid; /* this process's */
  char name[96]; /* the region's path, for shm_unlink */
  /* Releases that could not take the lock in time, given back at the next
   * that does (the bytes stay charged meanwhile: never counted free twice). */
  _Atomic uint64_t unreleased[SHARED_DEVICES];
  _Atomic bool any_unreleased;
  /* GCALLOC_TEST_SIM_SHARED_STOP_LOCKED set at join (tests only): the
   * process stops itself at its first charge, the lock held. */
  _Atomic bool stop_locked;
};

/* Slot i's process alive, looked at through the region's file `fd`. With the lock held. */
static bool slot_alive(const shared_region_t *r, int fd, int i) {
  const shared_slot_t *s = &r->slots[i];
  return gca__slot_alive(fd, i, atomic_load(&s->locked) != 0, atomic_load(&s->pid), atomic_load(&s->start_time),
                         atomic_load(&s->pidns));
}

/* A slot emptied, its pid first (a reader without the lock then skips it). */
static void slot_clear(shared_slot_t *s) {
  atomic_store(&s->pid, 0);
  atomic_store(&s->start_time, 0);
  atomic_store(&s->pidns, 0);
  atomic_store(&s->locked, 0);
  for (int d = 0; d < SHARED_DEVICES; d++) atomic_store(&s->used[d], 0);
}

/* The region's lock within `ns`; false (not held) past it. `pid` is the
 * caller's (kept: getpid is a system call). */
static bool region_lock_within(shared_region_t *r, int32_t pid, uint64_t ns) {
  if (!gca__shared_mutex_lock_within(&r->lock, RANK_SIM_SHARED, ns)) return false;
  atomic_store_explicit(&r->holder, pid, memory_order_relaxed);
  return true;
}

static bool region_lock(shared_region_t *r, int32_t pid) { return region_lock_within(r, pid, LOCK_WAIT_NS); }

static void region_unlock(shared_region_t *r) {
  atomic_store_explicit(&r->holder, 0, memory_order_relaxed);
  gca__shared_mutex_unlock(&r->lock);
}

/* The error of a wait for the lock that ran out, after `what` ("sim: ..."). */
static int lock_stuck(const shared_region_t *r, const char *what) {
  return gca__set_error(GCA_ERR_BACKEND, "%s: the region's lock is held by pid %d, which has not let it go for %u ms "
                        "(stopped?)", what, (int)atomic_load(&r->holder), LOCK_WAIT_NS / 1000000u);
}

/* `bytes` no longer held by this process on `device`; with the lock held. */
static void give_back(sim_shared_t *sh, int device, uint64_t bytes) {
  _Atomic uint64_t *u = &sh->r->slots[sh->slot].used[device];
  uint64_t held = atomic_load(u);
  atomic_store(u, bytes > held ? 0 : held - bytes);
}

/* Releases kept back while the lock was out of reach; with the lock held. */
static void settle_unreleased(sim_shared_t *sh) {
  if (!atomic_load_explicit(&sh->any_unreleased, memory_order_acquire)) return;
  atomic_store(&sh->any_unreleased, false);
  for (int d = 0; d < SHARED_DEVICES; d++) {
    uint64_t bytes = atomic_exchange(&sh->unreleased[d], 0);
    if (bytes) give_back(sh, d, bytes);
  }
}

/* Give back the slots of dead processes, this process's own (`own`, whose
 * lock its own file does not see as another's) aside; with the lock held. */
static void reclaim_dead(shared_region_t *r, int fd, int own) {
  for (int i = 0; i < SHARED_SLOTS; i++)
    if (i != own && atomic_load(&r->slots[i].pid) && !slot_alive(r, fd, i)) slot_clear(&r->slots[i]);
}

/* Bytes held on `device` by every process (with `saw_dead`, by those
 * alive, *saw_dead set when one is not: the memory of a dead one is the
 * device's again, as a driver's, before its slot is reclaimed), saturating
 * at the capacity (a value beyond it can only be a corrupted region). */
static uint64_t used_total(const shared_region_t *r, int fd, int own, int device, bool *saw_dead) {
  uint64_t total = 0;
  for (int i = 0; i < SHARED_SLOTS; i++) {
    if (!atomic_load(&r->slots[i].pid)) continue;
    if (saw_dead && i != own && !slot_alive(r, fd, i)) {
      *saw_dead = true;
      continue;
    }
    uint64_t u = atomic_load(&r->slots[i].used[device]);
    total = u > r->capacity - total ? r->capacity : total + u;
  }
  return total;
}

static bool name_ok(const char *name) {
  size_t n = strlen(name);
  if (n == 0 || n > 64) return false;
  for (size_t i = 0; i < n; i++)
    if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
          (name[i] >= '0' && name[i] <= '9') || name[i] == '_' || name[i] == '-' || name[i] == '.'))
      return false;
  return true;
}

static int create_region(shared_region_t *r, size_t capacity, int devices) {
  if (gca__shared_mutex_init(&r->lock) != 0) return -1;
  r->version = SHARED_VERSION;
  r->size = (uint32_t)sizeof *r;
  r->devices = (uint32_t)devices;
  r->capacity = capacity;
  atomic_store_explicit(&r->magic, SHARED_MAGIC, memory_order_release);
  return 0;
}

/* The header of a region someone else made, checked. */
static int check_region(const shared_region_t *r, const char *name, size_t capacity, bool capacity_given,
                        int devices) {
  uint64_t magic = atomic_load_explicit(&r->magic, memory_order_acquire);
  if (magic != SHARED_MAGIC)
    return gca__set_error(GCA_ERR_BACKEND, "sim backend: shared=%s: /gcalloc-sim-%s is not a gcalloc sim region "
                          "(magic %#" PRIx64 ")", name, name, magic);
  if (r->version != SHARED_VERSION || r->size != sizeof *r)
    return gca__set_error(GCA_ERR_BACKEND, "sim backend: shared=%s: the region is version %u of %u bytes, not version "
                          "%u of %zu (another gcalloc?)", name, r->version, r->size, SHARED_VERSION, sizeof *r);
  if (r->devices < 1 || r->devices > SHARED_DEVICES || r->capacity == 0 || r->capacity > SIM_MAX_CAPACITY)
    return gca__set_error(GCA_ERR_BACKEND, "sim backend: shared=%s: the region's header is corrupt (%u devices, "
                          "capacity %" PRIu64 ")", name, r->devices, r->capacity);
  if ((int)r->devices != devices || (capacity_given && r->capacity != capacity))
    return gca__set_error(GCA_ERR_BACKEND, "sim backend: shared=%s is a device of %u device%s of %" PRIu64 " bytes; "
                          "this one asks for %d of %zu", name, r->devices, r->devices == 1 ? "" : "s", r->capacity,
                          devices, capacity);
  return GCA_OK;
}

int gca__sim_shared_join(const char *name, size_t capacity, bool capacity_given, int devices, size_t *capacity_out,
                         sim_shared_t **out) {
  *out = NULL;
  if (!name_ok(name))
    return gca__set_error(GCA_ERR_BACKEND, "sim backend: shared=%s: a name is 1 to 64 letters, digits, '_', '-' or '.'",
                          name);
  if (devices > SHARED_DEVICES)
    return gca__set_error(GCA_ERR_BACKEND, "sim backend: shared=%s: at most %d devices", name, SHARED_DEVICES);
  char path[96];
  snprintf(path, sizeof path, "/gcalloc-sim-%s", name);
  bool created = false;
  int rc = GCA_OK;
  int fd = -1;
  shared_region_t *r = gca__shared_region_open(path, sizeof *r, 0600, &created, &fd);
  if (!r) return gca__prefix_error("sim backend: shared=%s", name);
  if (created && create_region(r, capacity, devices) != 0)
    rc = gca__set_error(GCA_ERR_BACKEND, "sim backend: shared=%s: cannot make the region's lock", name);
  if (rc == GCA_OK && !created) {
    (void)gca__shared_region_wait(&r->magic);
    rc = check_region(r, name, capacity, capacity_given, devices);
  }
  sim_shared_t *sh = rc == GCA_OK ? calloc(1, sizeof *sh) : NULL;
  if (rc == GCA_OK && !sh) rc = gca__set_error(GCA_ERR_NOMEM, "sim: out of host memory");
  if (rc == GCA_OK && !region_lock(r, (int32_t)getpid())) {
    char what[96];
    snprintf(what, sizeof what, "sim backend: shared=%s", name);
    rc = lock_stuck(r, what);
    free(sh);
    sh = NULL;
  }
  if (rc == GCA_OK) {
    reclaim_dead(r, fd, -1);
    int slot = -1;
    for (int i = 0; i < SHARED_SLOTS && slot < 0; i++)
      if (!atomic_load(&r->slots[i].pid)) slot = i;
    if (slot >= 0) {
      shared_slot_t *s = &r->slots[slot];
      slot_clear(s);
      atomic_store(&s->start_time, gca__process_start_time((int)getpid()));
      atomic_store(&s->pidns, gca__pid_namespace());
      atomic_store(&s->locked, gca__slot_lock(fd, slot, true)); /* (under the region's lock: seen whole) */
      atomic_store(&s->pid, (int32_t)getpid()); /* (last: a reader without the lock sees the slot whole) */
    }
    region_unlock(r);
    if (slot < 0) rc = gca__set_error(GCA_ERR_BACKEND, "sim backend: shared=%s: %d processes use it already", name,
                                      SHARED_SLOTS);
    else sh->slot = slot;
  }
  if (rc != GCA_OK) {
    free(sh);
    munmap(r, sizeof *r);
    close(fd);
    if (created) shm_unlink(path);
    return rc;
  }
  sh->r = r;
  sh->fd = fd;
  sh->pid = (int32_t)getpid();
  atomic_store(&sh->stop_locked, getenv("GCALLOC_TEST_SIM_SHARED_STOP_LOCKED") != NULL);
  snprintf(sh->name, sizeof sh->name, "%s", path);
  *capacity_out = (size_t)r->capacity;
  *out = sh;
  return GCA_OK;
}

const char *gca__sim_shared_name(const sim_shared_t *sh) { return sh->name; }

void gca__sim_shared_after_fork_child(sim_shared_t *sh) {
  if (!sh || sh->fd < 0) return;
  close(sh->fd); /* (the parent's lock byte is on the description: the child's copy goes) */
  sh->fd = -1;
}

void gca__sim_shared_forget(sim_shared_t *sh) {
  if (!sh) return;
  gca__sim_shared_after_fork_child(sh);
  munmap(sh->r, sizeof *sh->r);
  free(sh);
}

void gca__sim_shared_leave(sim_shared_t *sh) {
  if (!sh) return;
  shared_region_t *r = sh->r;
  bool locked = region_lock(r, sh->pid); /* (not: its holder, when it runs again, finds the slot free) */
  slot_clear(&r->slots[sh->slot]);
  (void)gca__slot_lock(sh->fd, sh->slot, false);
  if (locked) {
    reclaim_dead(r, sh->fd, sh->slot);
    bool alone = true;
    for (int i = 0; i < SHARED_SLOTS; i++) alone &= atomic_load(&r->slots[i].pid) == 0;
    if (alone) shm_unlink(sh->name); /* the last one out; a process joining meanwhile keeps its mapping */
    region_unlock(r);
  }
  close(sh->fd);
  munmap(r, sizeof *r);
  free(sh);
}

int gca__sim_shared_charge(sim_shared_t *sh, int device, size_t bytes, size_t *free_bytes) {
  shared_region_t *r = sh->r;
  if (!region_lock(r, sh->pid)) {
    *free_bytes = gca__sim_shared_free(sh, device);
    char what[160];
    snprintf(what, sizeof what, "sim: device %d of %s", device, sh->name);
    return lock_stuck(r, what);
  }
  if (atomic_exchange(&sh->stop_locked, false)) raise(SIGSTOP); /* (test hook: stopped holding the lock) */
  settle_unreleased(sh);
  uint64_t used = used_total(r, sh->fd, sh->slot, device, NULL);
  if (bytes > r->capacity - used) { /* dead processes' memory comes back first */
    reclaim_dead(r, sh->fd, sh->slot);
    used = used_total(r, sh->fd, sh->slot, device, NULL);
  }
  bool fits = bytes <= r->capacity - used;
  if (fits) atomic_fetch_add(&r->slots[sh->slot].used[device], bytes);
  *free_bytes = (size_t)(r->capacity - used - (fits ? bytes : 0));
  region_unlock(r);
  return fits ? GCA_OK : GCA_ERR_OOM;
}

void gca__sim_shared_release(sim_shared_t *sh, int device, size_t bytes) {
  shared_region_t *r = sh->r;
  if (!region_lock(r, sh->pid)) {
    atomic_fetch_add(&sh->unreleased[device], bytes);
    atomic_store_explicit(&sh->any_unreleased, true, memory_order_release);
    gca__clear_error();
    return;
  }
  settle_unreleased(sh);
  give_back(sh, device, bytes);
  region_unlock(r);
}

/* The device's free memory, read without the lock (a process stopped while
 * it holds the lock does not stop the others asking): what every process
 * alive holds, this one's releases kept back counted free. A dead process's
 * slot seen on the way is reclaimed if the lock is free at once (else a
 * later look does it): each look at a dead slot costs system calls. */
size_t gca__sim_shared_free(sim_shared_t *sh, int device) {
  shared_region_t *r = sh->r;
  bool saw_dead = false;
  uint64_t used = used_total(r, sh->fd, sh->slot, device, &saw_dead);
  if (saw_dead && region_lock_within(r, sh->pid, 0)) {
    reclaim_dead(r, sh->fd, sh->slot);
    region_unlock(r);
  }
  uint64_t kept = atomic_load(&sh->unreleased[device]);
  used = kept > used ? 0 : used - kept;
  return (size_t)(r->capacity - used);
}
