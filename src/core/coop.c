/* Processes sharing a device release cache for each other
 * (ipc_cooperation:True): gcalloc's inter-process memory pressure protocol.
 *
 * Every process that turns it on joins a rendezvous for the device: a
 * POSIX shared-memory region named from the device's identity (which does
 * not change with CUDA_VISIBLE_DEVICES: backend_ops_t.device_identity),
 * mode 0600 (0660 with ipc_group_access:True). It holds a header checked
 * by every joiner (magic, version, size, the identity), a process-shared
 * robust mutex, and a slot per process: pid and start time (a reused pid
 * is not taken for the peer), what it reserves, allocates and waits for
 * (published by its cooperation thread, never by the hot path), and two
 * futex words, a request sequence its peers bump and the answer sequence
 * it sets.
 *
 * A process whose request would fail after its own ladder released its
 * cache asks the peers that cache most (reserved less allocated) to
 * release, wakes them, and waits for their answers: the request is tried
 * again as soon as they cover the need (the others' requests withdrawn),
 * every other peer is asked when the first have not covered it within a
 * quarter of ipc_release_timeout_ms (at most 100 ms), and the wait ends at
 * ipc_release_timeout_ms (gca__coop_ask). A peer answers
 * on a thread of its own (so a peer idle in Python still answers): it
 * gives back its largest cached segments until the request's need (written
 * in its slot) is covered, after its streams' work as gca_empty_cache (so
 * never memory they may still use), and reports what it released. A peer
 * that is stopped or wedged does not answer; the requester says which in
 * its out-of-memory message. One that dies or leaves while asked is not
 * waited for. Slots of dead processes are reclaimed; a
 * region that is not one (the wrong size, magic, version or identity) is
 * refused with a warning, and cooperation stays off.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/coop.h"
#include "core/core.h"

#define COOP_MAGIC 0x504f4f434147435full /* "_GCACOOP" */
#define COOP_VERSION 9u
#define COOP_IDENTITY 96
#define PUBLISH_EVERY_MS 100
/* A peer whose thread has not published for this long is stopped or
 * wedged (it publishes every PUBLISH_EVERY_MS while alive): asked, never
 * waited for, and marked in gcalloc top. */
#define STALE_NS (10u * PUBLISH_EVERY_MS * 1000000u)
#define WITHDRAWN_KEPT 8

typedef struct coop_slot {
  _Atomic int32_t pid; /* 0: free */
  uint64_t start_time;
  uint64_t pidns;      /* the pid namespace the pid is in (gca__pid_namespace) */
  _Atomic uint32_t locked; /* its process holds the slot's lock byte (gca__slot_alive) */
  _Atomic uint64_t reserved, allocated, waiting;
  _Atomic uint64_t paused; /* allocated in paused pools (not in `allocated`: no device memory under it) */
  _Atomic uint32_t request_seq; /* futex: bumped by a requester */
  _Atomic uint32_t answer_seq;  /* futex: set to request_seq by the answer */
  _Atomic uint64_t released;    /* bytes released by the last answer */
  _Atomic int32_t asked_by;     /* the pid of the latest requester (for the history) */
  /* The requests their requesters no longer wait for, each kept at
   * withdrawn[seq % WITHDRAWN_KEPT] (a sequence number names one request). */
  _Atomic uint32_t withdrawn[WITHDRAWN_KEPT];
  _Atomic uint64_t need;        /* the most any pending request needs (0: release everything) */
  /* Its cooperation so far, for gcalloc top. */
  _Atomic uint64_t requests, received, released_sum, timeouts, avoidable;
  /* The device's memory, as the driver told this process at info_ns
   * (CLOCK_MONOTONIC; 0: never asked), when the region's `changes` was
   * info_changes and no change was under way. info_begin and info_end
   * count the writes of these four, before and after (a reader that finds
   * them unequal, in memory order, read a write half done). */
  _Atomic uint64_t info_begin;
  _Atomic uint64_t total, free_bytes, info_ns, info_changes;
  _Atomic uint64_t info_end;
  _Atomic uint64_t published_ns; /* when it joined or its thread last published (CLOCK_MONOTONIC) */
} coop_slot_t;

typedef struct coop_region {
  _Atomic uint64_t magic;
  uint32_t version, size;
  char identity[COOP_IDENTITY];
  pthread_mutex_t lock;
  _Atomic int32_t holder; /* the pid holding the lock, for the message when it does not let go */
  /* Every member's reserved bytes change in its slot as they change on the
   * device (gca__coop_reserved, after the driver's call): `changes` counts
   * them, so that free memory read at one count, with the slots' reserved
   * bytes read at the same count, is one consistent view of the device. */
  _Atomic uint64_t changes;
  coop_slot_t slots[COOP_SLOTS];
} coop_region_t;

struct coop {
  device_t *d;
  coop_region_t *r;
  int fd;      /* the region's file, open while the slot is held: its lock byte (-1: none) */
  int slot;
  char path[64];
  pthread_t thread;
  _Atomic bool stop;
  /* What the last request saw, for the out-of-memory message (under the
   * device's lock: each request writes its own outcome, kept after). */
  char last[1024];
  /* GCALLOC_TEST_COOP_HOLD_US (tests only): the thread holds the region's
   * lock this long at every round, so a test can kill a process inside it.
   * GCALLOC_TEST_COOP_LATE_US (tests only): the thread starts running this
   * late, as a thread of a loaded machine may. */
  long hold_us, late_us;
  uint32_t seen; /* the slot's request sequence when it was taken */
  bool touched;  /* the process has held device memory (the cooperation thread's) */
  /* Requests answered in a row, each within STREAK_NS of the last (the
   * cooperation thread's): each releases twice what the one before did. */
  uint32_t streak;
  uint64_t answered_ns;
};

/* A requester that grows by many blocks asks once per block; doubling what
 * is released while the requests keep coming makes that a few round trips
 * (a driver's release and allocation cost milliseconds each), while a lone
 * request still releases only what it needs. */
#define STREAK_NS 250000000u

/* ---- the region ------------------------------------------------------------ */

/* Slot i's process alive, looked at through the region's file `fd`. */
static bool coop_slot_alive(const coop_region_t *r, int fd, int i) {
  const coop_slot_t *s = &r->slots[i];
  return gca__slot_alive(fd, i, atomic_load(&s->locked) != 0, atomic_load(&s->pid), s->start_time, s->pidns);
}

/* Slot i's process known dead by its lock (no /proc read: cheap enough
 * for every round of a request). */
static bool coop_slot_lock_gone(const coop_region_t *r, int fd, int i) {
  return atomic_load(&r->slots[i].locked) && gca__slot_lock_held(fd, i) == 0;
}

/* Every wait for the region's lock has a deadline: a process stopped
 * while it holds it (SIGSTOP, Ctrl-Z, a suspended job, docker pause) is not
 * dead, so the robust mutex would wait for it for ever. Who holds it is
 * kept in the region for the message. */
#define LOCK_WAIT_NS 1000000000u
static bool coop_lock(coop_region_t *r) {
  if (!gca__shared_mutex_lock_within(&r->lock, RANK_RENDEZVOUS, LOCK_WAIT_NS)) return false;
  atomic_store(&r->holder, (int32_t)getpid());
  return true;
}

/* The error for a lock not had within its deadline. */
static int coop_lock_stuck(const coop_region_t *r, const char *path) {
  return gca__set_error(GCA_ERR_BACKEND, "%s: the rendezvous's lock is held by pid %d, which has not let it go "
                        "for %u ms (stopped?)", path, (int)atomic_load(&r->holder), LOCK_WAIT_NS / 1000000u);
}

static void coop_unlock(coop_region_t *r) {
  atomic_store(&r->holder, 0);
  gca__shared_mutex_unlock(&r->lock);
}

/* Free the slots of dead processes, this process's own (`own`, whose lock
 * its own file does not see as another's) aside. */
static void coop_reclaim_dead(coop_region_t *r, int fd, int own) {
  for (int i = 0; i < COOP_SLOTS; i++)
    if (i != own && atomic_load(&r->slots[i].pid) && !coop_slot_alive(r, fd, i))
      memset(&r->slots[i], 0, sizeof r->slots[i]);
}

static long coop_futex(_Atomic uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
  /* (Not FUTEX_PRIVATE_FLAG: the word is in memory shared between processes.) */
  return syscall(SYS_futex, (uint32_t *)word, op, value, timeout, NULL, 0);
}

static void coop_wait_word(_Atomic uint32_t *word, uint32_t seen, uint64_t ns) {
  struct timespec t = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
  (void)coop_futex(word, FUTEX_WAIT, seen, &t);
}

/* FNV-1a of the identity: the region's name. */
static uint64_t identity_hash(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static int coop_init_region(coop_region_t *r, const char *identity) {
  if (gca__shared_mutex_init(&r->lock) != 0) return -1;
  r->version = COOP_VERSION;
  r->size = (uint32_t)sizeof *r;
  snprintf(r->identity, sizeof r->identity, "%s", identity);
  atomic_store_explicit(&r->magic, COOP_MAGIC, memory_order_release);
  return 0;
}

/* The region for `identity`, joined; NULL with the error set. */
static coop_region_t *coop_open_region(const char *identity, bool group, char *path, size_t path_cap, int *fd) {
  snprintf(path, path_cap, "/gcalloc-coop-%016" PRIx64, identity_hash(identity));
  bool created = false;
  coop_region_t *r = gca__shared_region_open(path, sizeof *r, group ? 0660 : 0600, &created, fd);
  if (!r) return NULL;
  if (created && coop_init_region(r, identity) != 0) {
    gca__set_error(GCA_ERR_BACKEND, "cannot make the lock of %s", path);
    munmap(r, sizeof *r);
    close(*fd);
    shm_unlink(path);
    return NULL;
  }
  if (!created) (void)gca__shared_region_wait(&r->magic);
  uint64_t magic = atomic_load_explicit(&r->magic, memory_order_acquire);
  const char *why = magic != COOP_MAGIC                                    ? "its magic is wrong"
                    : r->version != COOP_VERSION || r->size != sizeof *r   ? "another version made it"
                    : strncmp(r->identity, identity, sizeof r->identity) != 0 ? "it is another device's"
                                                                            : NULL;
  if (why) {
    gca__set_error(GCA_ERR_BACKEND, "%s is not this device's gcalloc cooperation region: %s (remove /dev/shm%s "
                   "when no gcalloc process uses it)", path, why, path);
    munmap(r, sizeof *r);
    close(*fd);
    return NULL;
  }
  return r;
}

/* ---- answering ------------------------------------------------------------- */

/* The device's free and total memory, asked of the driver, kept in the
 * slot with the count of changes it was read at: only where no member's
 * change completed while it was asked. */
static void refresh_info(coop_t *c) {
  coop_region_t *r = c->r;
  coop_slot_t *s = &r->slots[c->slot];
  device_t *d = c->d;
  size_t free_bytes = 0, total = 0;
  uint64_t before = atomic_load(&r->changes);
  int rc = d->backend->ops->mem_get_info(d->backend->state, d->index, &free_bytes, &total);
  gca__clear_error();
  if (rc != GCA_OK || atomic_load(&r->changes) != before) return;
  atomic_fetch_add(&s->info_begin, 1);
  atomic_store(&s->total, (uint64_t)total);
  atomic_store(&s->free_bytes, (uint64_t)free_bytes);
  atomic_store(&s->info_ns, gca__now_ns());
  atomic_store(&s->info_changes, before);
  atomic_fetch_add(&s->info_end, 1);
}

void gca__coop_reserved(coop_t *c, int64_t reserved) {
  atomic_store(&c->r->slots[c->slot].reserved, (uint64_t)(reserved > 0 ? reserved : 0));
  atomic_fetch_add(&c->r->changes, 1);
  refresh_info(c);
}

/* Publish what this process holds (read from the device's lock-free mirrors). */
static void coop_publish(coop_t *c) {
  coop_slot_t *s = &c->r->slots[c->slot];
  device_t *d = c->d;
  /* The device's memory first, asked of the driver only by a process that
   * has held some (its context exists: asking would not make one); the
   * process's own figures after it, so that one taken between the two
   * reads makes a reader count less in use outside the members, not more. */
  c->touched = c->touched || atomic_load(&d->reserved_now) > 0;
  if (c->touched) refresh_info(c);
  int64_t allocated = atomic_load(&d->allocated_now), paused = atomic_load(&d->paused_now);
  atomic_store(&s->reserved, (uint64_t)atomic_load(&d->reserved_now));
  atomic_store(&s->allocated, (uint64_t)(allocated > paused ? allocated - paused : 0));
  atomic_store(&s->paused, (uint64_t)(paused > 0 ? paused : 0));
  atomic_store(&s->waiting, (uint64_t)atomic_load(&d->coop_waiting));
  atomic_store(&s->published_ns, gca__now_ns());
}

void gca__coop_count(coop_t *c, const coop_outcome_t *got, bool avoidable) {
  coop_slot_t *s = &c->r->slots[c->slot];
  if (got) {
    atomic_fetch_add(&s->received, (uint64_t)got->received);
    atomic_fetch_add(&s->timeouts, (uint64_t)got->timeouts);
  }
  if (avoidable) atomic_fetch_add(&s->avoidable, 1);
}

static void *answer_main(void *arg) {
  coop_t *c = arg;
  coop_slot_t *s = &c->r->slots[c->slot];
  if (c->late_us) nanosleep(&(struct timespec){c->late_us / 1000000, (c->late_us % 1000000) * 1000}, NULL);
  /* The sequence as it was when the slot was taken, not as the thread first
   * finds it: a request made before it first runs is answered. */
  uint32_t seen = c->seen;
  while (!atomic_load(&c->stop)) {
    coop_publish(c);
    if (c->hold_us && coop_lock(c->r)) {
      struct timespec t = {c->hold_us / 1000000, (c->hold_us % 1000000) * 1000};
      nanosleep(&t, NULL);
      coop_unlock(c->r);
    }
    coop_wait_word(&s->request_seq, seen, (uint64_t)(c->hold_us ? 1 : PUBLISH_EVERY_MS) * 1000000u);
    uint32_t seq = atomic_load(&s->request_seq);
    if (seq == seen || atomic_load(&c->stop)) continue;
    uint32_t requests = seq - seen;
    seen = seq;
    /* Release cached segments, largest first, until the largest need of
     * the requests answered is covered (doubled for each request in a
     * streak), in stream order (as gca_empty_cache), unless the requester
     * got what it needed from others meanwhile: a cache grown since would
     * go back for nothing. One answer serves every request made since the
     * last: it releases nothing only when every one of them was withdrawn
     * (another requester's may still wait for it). */
    bool withdrawn = requests <= WITHDRAWN_KEPT;
    for (uint32_t k = seq - requests + 1; withdrawn && k != seq + 1; k++)
      withdrawn = atomic_load(&s->withdrawn[k % WITHDRAWN_KEPT]) == k;
    uint64_t need = atomic_exchange(&s->need, 0), now = gca__now_ns();
    c->streak = c->answered_ns && now - c->answered_ns < STREAK_NS ? c->streak + 1 : 0;
    c->answered_ns = now;
    if (need) need = c->streak >= 20 || need > (UINT64_MAX >> c->streak) ? UINT64_MAX : need << c->streak;
    uint64_t released = withdrawn ? 0 : (uint64_t)gca__device_release_for_peer(c->d, atomic_load(&s->asked_by), need);
    atomic_store(&s->released, released);
    atomic_fetch_add(&s->released_sum, released);
    coop_publish(c);
    atomic_store(&s->answer_seq, seq);
    coop_futex(&s->answer_seq, FUTEX_WAKE, INT32_MAX, NULL);
  }
  return NULL;
}

/* A test hook's microseconds, 0 to 1 s (0 when unset or out of range). */
static long test_hook_us(const char *variable) {
  const char *text = getenv(variable);
  long us = text ? strtol(text, NULL, 10) : 0;
  return us >= 0 && us <= 1000000 ? us : 0;
}

int gca__coop_join(device_t *d, const char *identity, coop_t **out) {
  *out = NULL;
  coop_t *c = calloc(1, sizeof *c);
  if (!c) return gca__set_error(GCA_ERR_NOMEM, "out of host memory");
  c->d = d;
  c->hold_us = test_hook_us("GCALLOC_TEST_COOP_HOLD_US");
  c->late_us = test_hook_us("GCALLOC_TEST_COOP_LATE_US");
  c->r = coop_open_region(identity, d->config.ipc_group_access, c->path, sizeof c->path, &c->fd);
  if (!c->r) {
    free(c);
    return gca_last_status();
  }
  coop_region_t *r = c->r;
  if (!coop_lock(r)) {
    int rc = coop_lock_stuck(r, c->path);
    munmap(r, sizeof *r);
    close(c->fd);
    free(c);
    return rc;
  }
  coop_reclaim_dead(r, c->fd, -1);
  c->slot = -1;
  for (int i = 0; i < COOP_SLOTS && c->slot < 0; i++)
    if (!atomic_load(&r->slots[i].pid)) c->slot = i;
  if (c->slot >= 0) {
    coop_slot_t *s = &r->slots[c->slot];
    memset(s, 0, sizeof *s);
    s->start_time = gca__process_start_time((int)getpid());
    s->pidns = gca__pid_namespace();
    /* Joining counts as publishing: a process stopped before its thread
     * first runs is stale a second later, as one stopped after. */
    atomic_store(&s->published_ns, gca__now_ns());
    /* The lock byte first, then the word that says it is held: a look
     * between the two judges by the pid. */
    if (gca__slot_lock(c->fd, c->slot, true)) atomic_store(&s->locked, 1);
    atomic_store(&s->pid, (int32_t)getpid());
    c->seen = atomic_load(&s->request_seq);
  }
  coop_unlock(r);
  if (c->slot < 0 || pthread_create(&c->thread, NULL, answer_main, c) != 0) {
    int rc = gca__set_error(GCA_ERR_BACKEND, "%s: %s", c->path,
                            c->slot < 0 ? "64 processes cooperate on this device already" : "cannot start a thread");
    if (c->slot >= 0) atomic_store(&r->slots[c->slot].pid, 0);
    munmap(r, sizeof *r);
    close(c->fd);
    free(c);
    return rc;
  }
  *out = c;
  return GCA_OK;
}

void gca__coop_after_fork_child(coop_t *c) {
  if (!c || c->fd < 0) return;
  close(c->fd); /* (the parent's lock byte is on the description: the child's copy goes) */
  c->fd = -1;
}

void gca__coop_forget(coop_t *c) {
  if (!c) return;
  gca__coop_after_fork_child(c);
  munmap(c->r, sizeof *c->r);
  free(c);
}

void gca__coop_leave(coop_t *c) {
  if (!c) return;
  atomic_store(&c->stop, true);
  coop_futex(&c->r->slots[c->slot].request_seq, FUTEX_WAKE, INT32_MAX, NULL);
  pthread_join(c->thread, NULL);
  bool locked = coop_lock(c->r);
  /* (Without the lock: the slot is freed all the same, its pid last, and
   * whoever holds the lock is left to remove the region.) */
  coop_slot_t *s = &c->r->slots[c->slot];
  atomic_store(&s->pid, 0);
  /* (a peer waiting for this process's answer learns it left) */
  coop_futex(&s->answer_seq, FUTEX_WAKE, INT32_MAX, NULL);
  if (locked) {
    memset(s, 0, sizeof *s);
    coop_reclaim_dead(c->r, c->fd, c->slot);
    bool alone = true;
    for (int i = 0; i < COOP_SLOTS; i++) alone &= atomic_load(&c->r->slots[i].pid) == 0;
    if (alone) shm_unlink(c->path);
    coop_unlock(c->r);
  }
  (void)gca__slot_lock(c->fd, c->slot, false); /* (after the slot is free: a new owner takes it anew) */
  close(c->fd);
  munmap(c->r, sizeof *c->r);
  free(c);
}

/* A slot as gca_ipc_peer_t, seen at `now` (CLOCK_MONOTONIC). */
static gca_ipc_peer_t published(const coop_slot_t *s, int32_t pid, uint64_t now) {
  uint64_t reserved = atomic_load(&s->reserved), allocated = atomic_load(&s->allocated);
  uint64_t at = atomic_load(&s->published_ns);
  return (gca_ipc_peer_t){pid,
                          reserved,
                          allocated,
                          reserved > allocated ? reserved - allocated : 0,
                          atomic_load(&s->waiting),
                          atomic_load(&s->paused),
                          atomic_load(&s->requests),
                          atomic_load(&s->received),
                          atomic_load(&s->released_sum),
                          atomic_load(&s->timeouts),
                          atomic_load(&s->avoidable),
                          at && now > at ? (now - at) / 1000000u : 0};
}

/* ---- asking ------------------------------------------------------------------ */

/* PENDING: waited for; STALE: its answer taken if it comes, never waited
 * for (it has not published for STALE_NS). */
typedef enum { PENDING, ANSWERED, GONE, STALE } answer_t;

typedef struct asked {
  int slot;
  int32_t pid;
  uint64_t start_time;
  uint32_t seq;
  uint64_t cached, reserved; /* as it published them */
  uint64_t silent_ns;        /* since it last published (0: within STALE_NS) */
  int rank;                  /* 0: live with cache, 1: stale with cache, 2: live without, 3: stale without */
  answer_t state;
  uint64_t released;         /* its answer's */
} asked_t;

/* The live peers with cache first (most cached first, then most
 * reserved), then the stale ones with cache, then the live ones without. */
static int by_cached(const void *x, const void *y) {
  const asked_t *a = x, *b = y;
  if (a->rank != b->rank) return a->rank < b->rank ? -1 : 1;
  if (a->cached != b->cached) return a->cached < b->cached ? 1 : -1;
  return a->reserved < b->reserved ? 1 : a->reserved > b->reserved ? -1 : 0;
}

/* Ask peers[from, to): bump each one's request word (its slot still the
 * same process's) and wake it. With the region's lock taken here. */
static void send_requests(coop_region_t *r, asked_t *peers, int from, int to, uint64_t need) {
  bool locked = coop_lock(r); /* (without it, a slot taken meanwhile by another process is told apart by its pid) */
  for (int k = from; k < to; k++) {
    coop_slot_t *s = &r->slots[peers[k].slot];
    if (atomic_load(&s->pid) != peers[k].pid) {
      peers[k].state = GONE;
      continue;
    }
    atomic_store(&s->asked_by, (int32_t)getpid());
    uint64_t was = atomic_load(&s->need); /* (the largest of the requests it has not answered yet) */
    while (was < need && !atomic_compare_exchange_weak(&s->need, &was, need)) {}
    peers[k].seq = atomic_fetch_add(&s->request_seq, 1) + 1;
    if (peers[k].silent_ns) peers[k].state = STALE;
  }
  if (locked) coop_unlock(r);
  for (int k = from; k < to; k++)
    if (peers[k].state == PENDING || peers[k].state == STALE) coop_futex(&r->slots[peers[k].slot].request_seq, FUTEX_WAKE, INT32_MAX, NULL);
}

/* Look at every peer still pending: answered, or gone (its slot taken by
 * another process, its lock byte let go, or, when `check_alive`, dead by
 * its pid). The bytes answered are added to *received. Returns how many
 * are still pending. */
static int collect_answers(coop_region_t *r, int fd, asked_t *peers, int m, bool check_alive, size_t *received) {
  int pending = 0;
  for (int k = 0; k < m; k++) {
    asked_t *a = &peers[k];
    if (a->state != PENDING && a->state != STALE) continue;
    coop_slot_t *s = &r->slots[a->slot];
    bool same = atomic_load(&s->pid) == a->pid;
    if (same && (int32_t)(atomic_load(&s->answer_seq) - a->seq) >= 0) {
      a->state = ANSWERED;
      a->released = atomic_load(&s->released);
      *received += a->released;
    } else if (!same || coop_slot_lock_gone(r, fd, a->slot) || (check_alive && !coop_slot_alive(r, fd, a->slot))) {
      a->state = GONE;
    } else {
      pending += a->state == PENDING;
    }
  }
  return pending;
}

/* The request protocol: ask the live peers that cache most, until what
 * they published covers the need (every peer with cache when it does not:
 * what they published may be 100 ms old). Return as soon as the answers
 * cover the need, so that the requester takes the memory before a peer
 * grows its cache again; ask the peers that published no cache too when
 * the first ones have not covered it within a quarter of the timeout (at
 * most 100 ms: a stopped peer with the most cache must not block a request
 * another could serve), or when they all answered short; stop at
 * ipc_release_timeout_ms. A peer that dies or leaves while asked is not
 * waited for, nor is one that has not published for STALE_NS (stopped or
 * wedged): it is asked, and its answer taken if it comes in time. */
size_t gca__coop_ask(coop_t *c, size_t need, uint64_t deadline_ns, uint64_t timeout_ms, coop_outcome_t *out) {
  memset(out, 0, sizeof *out);
  coop_region_t *r = c->r;
  asked_t peers[COOP_SLOTS];
  int n = 0;
  if (!coop_lock(r)) { /* nobody asked: the message says why */
    (void)coop_lock_stuck(r, c->path);
    snprintf(out->note, sizeof out->note, "%s", gca_last_error());
    gca__clear_error();
    return 0;
  }
  coop_reclaim_dead(r, c->fd, c->slot);
  uint64_t asked_at = gca__now_ns();
  for (int i = 0; i < COOP_SLOTS; i++) {
    coop_slot_t *s = &r->slots[i];
    int32_t pid = atomic_load(&s->pid);
    if (i == c->slot || !pid) continue;
    gca_ipc_peer_t p = published(s, pid, asked_at);
    uint64_t silent = p.silent_ms * 1000000u > STALE_NS ? p.silent_ms * 1000000u : 0;
    int rank = (p.cached_bytes ? 0 : 2) + (silent ? 1 : 0);
    peers[n++] = (asked_t){i, pid, s->start_time, 0, p.cached_bytes, p.reserved_bytes, silent, rank, PENDING, 0};
  }
  coop_unlock(r);
  qsort(peers, (size_t)n, sizeof peers[0], by_cached);
  int live_cached = 0, cached = 0, askable = 0; /* (peers[] is in rank order) */
  for (int k = 0; k < n; k++) {
    live_cached += peers[k].rank == 0;
    cached += peers[k].rank <= 1;
    askable += peers[k].rank <= 2; /* (a stale peer without cache is not asked) */
  }
  uint64_t covered = 0;
  int m = 0;
  while (m < live_cached && covered < need) covered += peers[m++].cached;
  if (covered < need) m = cached;
  send_requests(r, peers, 0, m, need);

  const uint64_t timeout = timeout_ms * 1000000u, slice = (uint64_t)PUBLISH_EVERY_MS * 1000000u;
  uint64_t now = gca__now_ns(), deadline = now + timeout;
  if (deadline_ns && deadline_ns < deadline) deadline = deadline_ns > now ? deadline_ns : now;
  uint64_t escalate_at = now + (timeout / 4 < slice ? timeout / 4 : slice), check_at = now + slice;
  size_t received = 0;
  for (;;) {
    bool check_alive = now >= check_at; /* (reading /proc at once would slow every round trip) */
    if (check_alive) check_at = now + slice;
    int pending = collect_answers(r, c->fd, peers, m, check_alive, &received);
    if (received >= need) break;
    if (m < askable && (pending == 0 || now >= escalate_at)) { /* short, or slow: ask the others too */
      send_requests(r, peers, m, askable, need);
      m = askable;
      continue;
    }
    if (pending == 0 || now >= deadline) break;
    /* Wait on one pending peer's answer word: alone, until it answers;
     * with others, in 2 ms steps, looking at all of them after each. */
    int first = 0;
    while (peers[first].state != PENDING) first++;
    uint64_t until = deadline < check_at ? deadline : check_at;
    if (m < askable && escalate_at < until) until = escalate_at;
    if (pending > 1 && now + 2000000u < until) until = now + 2000000u;
    coop_slot_t *s = &r->slots[peers[first].slot];
    uint32_t answer = atomic_load(&s->answer_seq);
    if ((int32_t)(answer - peers[first].seq) < 0 && until > now) coop_wait_word(&s->answer_seq, answer, until - now);
    now = gca__now_ns();
  }

  for (int k = 0; k < m; k++) {
    coop_answer_t *a = &out->peers[out->n++];
    *a = (coop_answer_t){peers[k].pid, 0, peers[k].released, peers[k].cached, peers[k].silent_ns / 1000000u};
    switch (peers[k].state) {
    case ANSWERED:
      a->state = COOP_ANSWERED;
      break;
    case GONE:
      out->gone++;
      a->state = COOP_GONE;
      break;
    case PENDING:
    case STALE:
      if (received >= need) { /* not waited for: enough came back, so withdrawn */
        coop_slot_t *s = &r->slots[peers[k].slot];
        if (atomic_load(&s->pid) == peers[k].pid) atomic_store(&s->withdrawn[peers[k].seq % WITHDRAWN_KEPT], peers[k].seq);
        a->state = COOP_WITHDRAWN;
        break;
      }
      out->timeouts++; /* (silent) */
      a->state = peers[k].state == STALE ? COOP_STALE : COOP_SILENT;
      break;
    }
  }
  out->asked = m;
  out->received = received;
  return received;
}

void gca__coop_tally_add(coop_tally_t *t, const coop_outcome_t *got, uint64_t timeout_ms) {
  if (got->note[0]) snprintf(t->note, sizeof t->note, "%s", got->note);
  if (!got->asked) return;
  t->rounds++;
  t->timeout_ms = timeout_ms;
  for (int k = 0; k < got->n; k++) {
    const coop_answer_t *a = &got->peers[k];
    int i = 0;
    while (i < t->n && t->peers[i].pid != a->pid) i++;
    if (i == t->n) {
      if (t->n == COOP_SLOTS) continue;
      t->peers[t->n++] = (coop_answer_t){a->pid, 0, 0, a->cached, 0};
    }
    coop_answer_t *p = &t->peers[i];
    p->released += a->state == COOP_ANSWERED ? a->released : 0;
    /* What it did last says most, but a release is never hidden by a
     * later round it was not waited for in. */
    if (a->state != COOP_WITHDRAWN || !p->state) p->state = a->state;
    if (a->state == COOP_STALE) p->silent_ms = a->silent_ms;
  }
}

void gca__coop_tally_keep(coop_t *c, const coop_tally_t *t) {
  if (t->rounds) atomic_fetch_add(&c->r->slots[c->slot].requests, 1);
  text_t o = {c->last, sizeof c->last, 0};
  c->last[0] = 0;
  if (!t->rounds && t->note[0]) gca__text_put(&o, "none asked: %s", t->note);
  for (int i = 0; i < t->n; i++) {
    const coop_answer_t *p = &t->peers[i];
    const char *comma = o.len ? ", " : "";
    char b[32];
    gca__format_bytes(p->released, b, sizeof b);
    if (p->released || p->state == COOP_ANSWERED || p->state == COOP_WITHDRAWN) {
      gca__text_put(&o, "%spid %d released %s", comma, (int)p->pid, b);
      if (t->rounds > 1) gca__text_put(&o, " over %d requests", t->rounds);
      continue;
    }
    gca__format_bytes(p->cached, b, sizeof b);
    if (p->state == COOP_GONE)
      gca__text_put(&o, "%spid %d left the device", comma, (int)p->pid);
    else if (p->state == COOP_STALE)
      gca__text_put(&o, "%spid %d (caching %s) has not answered for %" PRIu64 " ms (stopped?)", comma, (int)p->pid,
                    b, p->silent_ms);
    else
      gca__text_put(&o, "%spid %d (caching %s) did not answer within %" PRIu64 " ms", comma, (int)p->pid, b,
                    t->timeout_ms);
  }
}

const char *gca__coop_last(const coop_t *c) { return c ? c->last : ""; }

void gca__coop_describe_others(const coop_t *c, char *buf, size_t cap) {
  text_t o = {buf, cap, 0};
  buf[0] = 0;
  uint64_t now = gca__now_ns();
  for (int i = 0; i < COOP_SLOTS; i++) {
    const coop_slot_t *s = &c->r->slots[i];
    int32_t pid = atomic_load(&s->pid);
    if (i == c->slot || !pid) continue;
    gca_ipc_peer_t p = published(s, pid, now);
    char held[32], cached[32], paused[32];
    gca__format_bytes(p.reserved_bytes, held, sizeof held);
    gca__format_bytes(p.cached_bytes, cached, sizeof cached);
    gca__format_bytes(p.paused_bytes, paused, sizeof paused);
    gca__text_put(&o, "%spid %d holds %s, %s of it cached", o.len ? "; " : "", (int)pid, held, cached);
    if (p.paused_bytes) gca__text_put(&o, " (%s more paused)", paused);
  }
  if (!o.len) gca__text_put(&o, "no other process");
}

size_t gca__coop_outside(const coop_t *c, size_t total, size_t free_bytes) {
  uint64_t reserved = 0;
  for (int i = 0; i < COOP_SLOTS; i++) {
    const coop_slot_t *s = &c->r->slots[i];
    if (atomic_load(&s->pid)) reserved += atomic_load(&s->reserved);
  }
  uint64_t used = total > free_bytes ? total - free_bytes : 0;
  return used > reserved ? (size_t)(used - reserved) : 0;
}

size_t gca__coop_peers_live(const coop_t *c) {
  size_t live = 0;
  for (int i = 0; i < COOP_SLOTS; i++) {
    const coop_slot_t *s = &c->r->slots[i];
    if (i != c->slot && atomic_load(&s->pid)) live += (size_t)atomic_load(&s->allocated);
  }
  return live;
}

int gca__coop_peers(coop_t *c, gca_ipc_peer_t *out, size_t cap) {
  coop_region_t *r = c->r;
  size_t n = 0;
  if (!coop_lock(r)) return coop_lock_stuck(r, c->path);
  coop_reclaim_dead(r, c->fd, c->slot);
  for (int i = 0; i < COOP_SLOTS; i++) {
    coop_slot_t *s = &r->slots[i];
    int32_t pid = atomic_load(&s->pid);
    if (!pid) continue;
    if (n < cap) {
      out[n] = published(s, pid, gca__now_ns());
    }
    n++;
  }
  coop_unlock(r);
  return (int)n;
}

/* ---- looking from outside (gcalloc top) ------------------------------------ */

/* Whether this user may join the region of `fd`, as joining decides
 * (gca__shared_region_open): its own, or its group's where the region
 * gives the group access, and no access beyond what gcalloc gives. A
 * region of another user may say anything: it is not read. */
static bool region_joinable(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || (st.st_mode & 0777 & ~(mode_t)0660)) return false;
  return st.st_uid == geteuid() || ((st.st_mode & 0060) && st.st_gid == getegid());
}

/* One region, copied (not mapped: a region truncated meanwhile would kill
 * the reader with SIGBUS; a short read is only a region skipped) and
 * checked; its live slots into *out. A region with no live process (one
 * whose processes were all killed) is litter, not a device: skipped; one
 * this user may not join is counted in *foreign. */
static bool scan_region(const char *file, gca_ipc_device_t *out, int *foreign) {
  char path[300];
  snprintf(path, sizeof path, "/%s", file);
  int fd = shm_open(path, O_RDONLY, 0);
  if (fd < 0) return false;
  if (!region_joinable(fd)) {
    close(fd);
    ++*foreign;
    return false;
  }
  coop_region_t *r = malloc(sizeof *r);
  bool ok = r && pread(fd, r, sizeof *r, 0) == (ssize_t)sizeof *r; /* (fd kept: the slots' lock bytes) */
  ok = ok && atomic_load(&r->magic) == COOP_MAGIC && r->version == COOP_VERSION && r->size == sizeof *r;
  if (ok) {
    memset(out, 0, sizeof *out);
    memcpy(out->identity, r->identity, sizeof out->identity);
    out->identity[sizeof out->identity - 1] = 0;
    /* The device's figures from one consistent view: a member's free
     * memory read at the region's current count of changes, the members'
     * reserved bytes at that same count (re-read after the copy: no change
     * completed meanwhile). Otherwise other_bytes is not known. */
    uint64_t reserved = 0, newest = 0, changes = atomic_load(&r->changes), settled_free = 0, settled_total = 0;
    bool settled = false;
    uint64_t now = gca__now_ns();
    for (int i = 0; i < COOP_SLOTS; i++) {
      const coop_slot_t *s = &r->slots[i];
      int32_t pid = atomic_load(&s->pid);
      if (!pid || !coop_slot_alive(r, fd, i)) continue;
      out->peers[out->peer_count++] = published(s, pid, now);
      reserved += atomic_load(&s->reserved);
      uint64_t at = atomic_load(&s->info_ns);
      if (at > newest) {
        newest = at;
        out->total_bytes = atomic_load(&s->total);
        out->free_bytes = atomic_load(&s->free_bytes);
      }
      if (atomic_load(&s->info_begin) == atomic_load(&s->info_end) && atomic_load(&s->info_changes) == changes && at) {
        settled = true;
        settled_total = atomic_load(&s->total);
        settled_free = atomic_load(&s->free_bytes);
      }
    }
    uint64_t again = 0;
    settled = settled && pread(fd, &again, sizeof again, (off_t)offsetof(coop_region_t, changes)) == sizeof again &&
              again == changes;
    if (settled) {
      out->total_bytes = settled_total;
      out->free_bytes = settled_free;
    }
    uint64_t used = out->total_bytes - out->free_bytes;
    out->settled = settled;
    out->other_bytes = settled && out->total_bytes >= out->free_bytes && used > reserved ? used - reserved : 0;
    ok = out->peer_count > 0;
  }
  close(fd);
  free(r);
  return ok;
}

int gca_ipc_scan(gca_ipc_device_t *out, size_t cap) { return gca_ipc_scan_ex(out, cap, NULL); }

int gca_ipc_scan_ex(gca_ipc_device_t *out, size_t cap, int *skipped) {
  if (skipped) *skipped = 0;
  if (!out && cap) return gca__set_error(GCA_ERR_INVALID, "gca_ipc_scan: out is NULL");
  DIR *dir = opendir("/dev/shm");
  if (!dir) return gca__set_error(GCA_ERR_IO, "gca_ipc_scan: cannot read /dev/shm: %s", strerror(errno));
  int n = 0, foreign = 0;
  gca_ipc_device_t scratch;
  for (struct dirent *e; (e = readdir(dir));) {
    if (strncmp(e->d_name, "gcalloc-coop-", 13) != 0) continue;
    gca_ipc_device_t *slot = (size_t)n < cap ? &out[n] : &scratch;
    bool ok = scan_region(e->d_name, slot, &foreign);
    /* A view taken while a member's memory changed is not settled: looked
     * at again, briefly (members publish each change as it happens). */
    for (int tries = 0; ok && !slot->settled && tries < 20; tries++) {
      nanosleep(&(struct timespec){0, 500000}, NULL);
      ok = scan_region(e->d_name, slot, &foreign);
    }
    if (ok) n++;
  }
  closedir(dir);
  if (skipped) *skipped = foreign;
  return n;
}