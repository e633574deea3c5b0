/* The device lock: a mutex whose uncontended acquire and release are one
 * atomic instruction each, inline, with no call into the C library.
 *
 * Why not pthread_mutex_t: on the cached alloc/free path the two lock/unlock
 * pairs were a sixth of the instructions executed (glibc checks the mutex
 * kind, elision and robustness on every call). This is the classic
 * three-state futex mutex (0 free, 1 held, 2 held with waiters; Drepper,
 * "Futexes Are Tricky"): a short spin, then the thread sleeps in the kernel,
 * so a thread waiting behind a slow device call does not burn a core.
 * On Linux it is also biased to the thread that uses it (below). Acquire/
 * release atomics give ThreadSanitizer the happens-before edges it needs.
 * Elsewhere than Linux it falls back to pthread_mutex_t.
 */
#ifndef GCALLOC_LOCK_H
#define GCALLOC_LOCK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/* Every lock of the library has a rank, and a thread takes locks in
 * increasing rank only: no two threads can then wait for each other
 * (docs/design.md says why each lock sits where it does). Equal ranks do
 * not nest: the devices' locks are taken one at a time. */
enum lock_rank {
  RANK_TORCH = 1,       /* torch.c: the drop-in's allocator and settings (its open calls everything) */
  RANK_RECORD,          /* record.c: the trace file, held across a whole recorded call */
  RANK_POOL_REGISTRY,   /* mempool.c: the threads' routes to private pools, before their devices */
  RANK_CONFIG,          /* gca_set_config, which writes every device's copy under its lock */
  RANK_DEVICE,          /* a device: everything it owns (blocks, segments, pools, statistics) */
  RANK_HOST_REGISTRY,   /* host.c: the pinned caches of the process (fork takes it, then every cache) */
  RANK_HOST,            /* host.c: one pinned host cache, reached from a pause's backup copies */
  RANK_RENDEZVOUS,      /* coop.c: the region shared with the peers on a device */
  RANK_CALLBACKS,       /* the user's callback lists (copied, then called with no lock held) */
  RANK_DEVICE_WAIT,     /* oom.c: allocations waiting for memory to come back */
  RANK_BACKEND,         /* a backend's own state: the sim's pages, the drivers' contexts and virtual memory */
  RANK_BACKEND_EVENTS,  /* the cuda and acl backends' event pools, taken inside the above */
  RANK_BACKEND_CONTEXT, /* the cuda backend's primary contexts, the acl backend's runtime start */
  RANK_SIM_SHARED,      /* sim_shared.c: the region a shared simulated device keeps its accounting in */
  RANK_PIDFDS,          /* shm.c: the processes known alive, each with a pidfd (only ever tried) */
  RANK_SETTINGS,        /* the allocator's master configuration, read by the host cache and gca_get_config */
  RANK_TORCH_FAILURE,   /* torch.c: the last failed allocation's message */
  RANK_COMPLETIONS,     /* record.c: pending frees' completions, taken under a device and the trace file */
  RANK_HELPERS,         /* helpers.c: the kept helper threads' queue */
  RANK_LOG,             /* error.c: the log's settings and handler */
  RANK_COUNT
};

/* Checked builds (Debug and the sanitizer builds: GCALLOC_LOCK_CHECK)
 * keep the locks each thread holds, with where each was taken, and abort
 * at an acquisition out of rank order naming both locks and both sites.
 * What must run with no lock held (a log handler, a user callback, a wait
 * for other threads) asserts it with LOCKS_HELD(). */
#if !defined(NDEBUG) && !defined(GCALLOC_LOCK_CHECK)
#define GCALLOC_LOCK_CHECK 1
#endif
/* How an acquisition is checked: in rank order; a sibling may also follow
 * locks of its own rank (taken in an order a lock held above them fixes). */
enum { ORDER_WAITS = 1, ORDER_SIBLING = 2 };
#ifdef GCALLOC_LOCK_CHECK
void gca__lock_order_take(const void *lock, int rank, const char *file, int line, int mode);
void gca__lock_order_drop(const void *lock);
int gca__lock_order_depth(void);
/* The rank's name, for messages (and tests). */
const char *gca__lock_rank_name(int rank);
#define LOCK_ORDER_TAKE(l, rank, file, line, mode) gca__lock_order_take(l, rank, file, line, mode)
#define LOCK_ORDER_DROP(l) gca__lock_order_drop(l)
#define LOCKS_HELD() gca__lock_order_depth()
#else
#define LOCK_ORDER_TAKE(l, rank, file, line, mode) ((void)(file), (void)(line))
#define LOCK_ORDER_DROP(l) ((void)0)
#define LOCKS_HELD() 0
#endif

/* The library's other mutexes, taken with their rank. */
static inline void mutex_lock_at(pthread_mutex_t *m, int rank, const char *file, int line) {
  (void)rank;
  LOCK_ORDER_TAKE(m, rank, file, line, ORDER_WAITS);
  pthread_mutex_lock(m);
}
#define mutex_lock(m, rank) mutex_lock_at(m, rank, __FILE__, __LINE__)

static inline void mutex_unlock(pthread_mutex_t *m) {
  LOCK_ORDER_DROP(m);
  pthread_mutex_unlock(m);
}

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Biased to one thread. A device is mostly used by one thread at a time
 * (the training loop, then the autograd thread), and even uncontended, the
 * futex word's two locked instructions were 40% of a cached alloc+free.
 * So after a run of acquisitions by one thread (`bias_after`, adapted), the
 * lock is biased to it: `owner` points to that thread's ticket, and the
 * thread enters and leaves with plain loads and stores (an asymmetric
 * Dekker protocol): it sets its ticket's `inside`, then checks that `owner`
 * still points to the ticket. Any other thread takes the futex word, clears
 * `owner`, makes every thread of the process execute a full memory barrier
 * (membarrier(2), lock.c) and waits for the ticket's `inside` to clear:
 * after the barrier, either the owner's store to `inside` is visible, or
 * the owner's second load sees `owner` cleared and it turns to the futex
 * word. Each thread writes only its own ticket (one per thread and lock,
 * kept until the lock goes), so a late store of a revoked owner cannot
 * clear the flag of the next one. A thread taking turns with a busy owner
 * asks it to yield instead (`yield_asked`, set and cleared under the futex
 * word): the owner, leaving a biased hold, sees the request and clears
 * `owner` itself with a compare-and-swap, a full barrier after its last
 * store under the lock, so the asking thread needs neither membarrier nor
 * a wait for `inside` once it sees `owner` cleared (it revokes as above if
 * no yield comes). tests/test_lock_model.c checks the protocol
 * exhaustively under x86's memory model. Without membarrier (before Linux
 * 4.14, or refused by a seccomp filter) no lock is biased. */
typedef struct lock_ticket {
  _Alignas(64) _Atomic uint32_t inside; /* written by its thread alone: in a biased hold */
  _Atomic uint32_t holds;               /* biased holds since the bias was given (written by its thread;
                                         * read by one waiting for the bias, to tell an idle owner) */
  void *thread;                         /* its thread (thread pointer) */
  struct lock_ticket *next;             /* the lock's tickets */
} lock_ticket_t;

typedef struct lock {
  _Atomic uint32_t state;   /* the futex word */
  uint32_t streak;          /* (under the futex word:) acquisitions in a row by `last` */
  _Atomic(lock_ticket_t *) owner; /* the ticket of the thread it is biased to; NULL: none */
  lock_ticket_t *held;      /* the ticket of the biased hold in progress (written by holders) */
  _Atomic uint32_t yield_asked; /* (written under the futex word:) the owner is asked to clear `owner` */
  void *last;               /* (under the futex word:) the thread that took it last */
  lock_ticket_t *tickets;   /* (under the futex word:) one per thread that had the bias */
  uint32_t bias_after;      /* (under the futex word:) the run that biases it */
  int64_t biased_at;        /* (under the futex word:) when the bias was given (ns, monotonic) */
  int64_t revoke_ns;        /* (under the futex word:) what the last revocation took */
  uint64_t slow_holds;      /* (under the futex word:) holds taken on it, and */
  uint64_t revocations;     /*  biases revoked: how well the bias serves (tests read them) */
  int rank;                 /* its rank (enum lock_rank) */
} lock_t;

void gca__lock_init_bias(lock_t *l);
void gca__lock_acquire_slow(lock_t *l, void *self);
void gca__lock_yield(lock_t *l, lock_ticket_t *t);
void gca__lock_destroy(lock_t *l);

static inline int lock_init(lock_t *l, int rank) {
  l->rank = rank;
  atomic_init(&l->state, 0);
  atomic_init(&l->owner, NULL);
  atomic_init(&l->yield_asked, 0);
  l->held = NULL;
  l->last = NULL;
  l->tickets = NULL;
  l->streak = 0;
  l->biased_at = l->revoke_ns = 0;
  l->slow_holds = l->revocations = 0;
  gca__lock_init_bias(l);
  return 0;
}

static inline void lock_destroy(lock_t *l) { gca__lock_destroy(l); }

/* A token of the calling thread, unique among the live threads. */
static inline void *lock_self(void) { return __builtin_thread_pointer(); }

static inline void lock_futex(lock_t *l, int op, uint32_t value) {
  syscall(SYS_futex, (uint32_t *)&l->state, op | FUTEX_PRIVATE_FLAG, value, NULL, NULL, 0);
}

static inline void lock_acquire_at(lock_t *l, int mode, const char *file, int line) {
  (void)mode;
  LOCK_ORDER_TAKE(l, l->rank, file, line, mode);
  void *self = lock_self();
  lock_ticket_t *t = atomic_load_explicit(&l->owner, memory_order_acquire);
  if (__builtin_expect(t && t->thread == self, 1)) {
    atomic_store_explicit(&t->inside, 1, memory_order_relaxed);
    /* The store stays before the load in program order; the processor's
     * order comes from the revoking thread's membarrier. */
    atomic_signal_fence(memory_order_seq_cst);
    if (__builtin_expect(atomic_load_explicit(&l->owner, memory_order_acquire) == t, 1)) {
      atomic_store_explicit(&t->holds, atomic_load_explicit(&t->holds, memory_order_relaxed) + 1,
                            memory_order_relaxed);
      l->held = t;
      return;
    }
    atomic_store_explicit(&t->inside, 0, memory_order_release); /* revoked: take the futex word */
  }
  gca__lock_acquire_slow(l, self);
}
#define lock_acquire(l) lock_acquire_at(l, ORDER_WAITS, __FILE__, __LINE__)
#define lock_acquire_sibling(l) lock_acquire_at(l, ORDER_SIBLING, __FILE__, __LINE__)

static inline void lock_release(lock_t *l) {
  LOCK_ORDER_DROP(l);
  lock_ticket_t *t = l->held; /* (only a biased hold sets it, and clears it on leaving) */
  if (__builtin_expect(t != NULL, 1)) {
    l->held = NULL;
    atomic_store_explicit(&t->inside, 0, memory_order_release);
    if (__builtin_expect(atomic_load_explicit(&l->yield_asked, memory_order_relaxed) != 0, 0))
      gca__lock_yield(l, t);
    return;
  }
  if (__builtin_expect(atomic_exchange_explicit(&l->state, 0, memory_order_release) == 2, 0))
    lock_futex(l, FUTEX_WAKE, 1);
}

#else /* portable fallback */

typedef struct lock {
  pthread_mutex_t mutex;
  int rank;
} lock_t;

static inline int lock_init(lock_t *l, int rank) {
  l->rank = rank;
  return pthread_mutex_init(&l->mutex, NULL);
}
static inline void lock_destroy(lock_t *l) { pthread_mutex_destroy(&l->mutex); }
#define lock_acquire(l) mutex_lock_at(&(l)->mutex, (l)->rank, __FILE__, __LINE__)
#define lock_acquire_sibling(l) lock_acquire(l)
static inline void lock_release(lock_t *l) { mutex_unlock(&l->mutex); }

#endif

#endif /* GCALLOC_LOCK_H */
