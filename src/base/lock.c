/* The device lock's slow path (lock.h): the futex word, taking a bias away
 * from the thread that holds it, and deciding when to give one.
 *
 * Revoking costs a membarrier(2) system call: interrupts to the processors
 * running the process's threads, 1-2 us on a quiet machine, 34 us on a
 * virtual machine whose other processor was busy. A biased hold saves two
 * locked instructions. So a lock is biased after a run of `bias_after`
 * acquisitions by one thread; the run doubles (up to BIAS_AFTER_MAX) each
 * time a bias is revoked before its holds saved what revoking it took (and
 * before it was in use: 64 holds), and halves back when one did: threads
 * that alternate closely keep the futex word, a loop that hands the device
 * from its thread to the autograd thread and back biases it once per phase.
 *
 * Threads that all keep asking take turns a slice each, not an acquisition
 * each. A bias, once given, runs for a slice (at least 50 us, and 8 times
 * what the last revocation took, at most 500 us) before another thread
 * takes it away; that is the longest a thread waits for a lock whose bias
 * is in use (one whose thread takes no hold for 10 us is idle, and revoked
 * at once). The waiting thread asks a busy owner to yield (lock.h), which
 * it does at the end of its next hold: no membarrier. And the turn passes
 * whole: the waiting thread takes the bias over if it has had it before
 * and the bias was in use, or its own last one was (an owner given the
 * bias and descheduled before it used it looks idle: more threads than
 * processors); and a thread that has had the bias and had to wait for the
 * futex word takes the bias with it. Waiting for a run of its own instead,
 * threads that keep asking alternate on the futex word, each acquisition a
 * wake or a wait, and rarely get one (4 to 8 threads on 2 processors: 10^5
 * futex holds a second, at two thirds of one thread's pairs a second). A
 * thread that wants the lock for a call now and then never had the bias,
 * so it never takes it over, and never stalls the busy thread for a slice.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sched.h>
#include <time.h>

enum {
  BIAS_AFTER_MIN = 256,     /* acquisitions in a row before the first bias */
  BIAS_AFTER_MAX = 1 << 24, /* never more (a bias revoked at every run) */
  HOLD_SAVES_NS = 8,        /* what a biased hold saves (two locked instructions, some of them) */
  SLICE_MIN_NS = 50000,     /* a bias runs at least this long before another thread revokes it, */
  SLICE_REVOKES = 8,        /* and at least this many times what the last revocation took, */
  SLICE_MAX_NS = 500000,    /* but never longer */
  IDLE_NS = 10000,          /* a bias whose thread takes no hold this long is idle */
  YIELD_WAIT_NS = 20000,    /* how long a busy owner asked to yield is waited for before revoking */
  HANDOFF_HOLDS = 64        /* a revoked bias with this many holds was in use: its revoker may take it over */
};

static int64_t now_ns(void) { return (int64_t)gca__now_ns(); }

/* One spin-wait hint, where the processor has one. */
static inline void spin_hint(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static pthread_once_t barrier_once = PTHREAD_ONCE_INIT;
static bool barrier_ready; /* membarrier registered: locks may be biased */

static long membarrier_call(int cmd) { return syscall(SYS_membarrier, cmd, 0, 0); }

static void barrier_register(void) {
  const char *off = getenv("GCALLOC_LOCK_BIAS");
  if (off && strcmp(off, "0") == 0) return;
  long cmds = membarrier_call(MEMBARRIER_CMD_QUERY);
  barrier_ready = cmds > 0 && (cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) &&
                  membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
}

void gca__lock_init_bias(lock_t *l) {
  pthread_once(&barrier_once, barrier_register);
  l->bias_after = barrier_ready ? BIAS_AFTER_MIN : UINT32_MAX;
}

/* Every thread of the process executes a full memory barrier before this
 * returns. A process made by fork keeps the registration; should the kernel
 * refuse anyway, register again once. No lock is biased unless the
 * registration succeeded, so a refusal here leaves no safe way on. */
static void barrier_all_threads(void) {
  if (membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return;
  if (errno == EPERM && membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 &&
      membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0)
    return;
  fprintf(stderr, "gcalloc: membarrier failed (%s) after it was registered: cannot revoke a biased lock\n",
          strerror(errno));
  abort();
}

/* Wait for the owner to leave a biased hold: as long as that hold (a device
 * call may be in it), spinning briefly, then yielding, then sleeping. */
static void wait_owner_out(const lock_ticket_t *t) {
  for (unsigned i = 0; atomic_load_explicit(&t->inside, memory_order_acquire); i++) {
    if (i < 200) {
      spin_hint();
    } else if (i < 400) {
      sched_yield();
    } else {
      nanosleep(&(struct timespec){0, 50000}, NULL);
    }
  }
}

/* The bias's thread takes no hold for a moment and is in none: it stopped
 * using the lock (say a bias handed over, below, to a thread that wanted
 * the lock for one call), and waiting out its slice would only stall this
 * thread. A busy one takes a hold every few tens of nanoseconds. Spins:
 * a sleep that short lasts the timer's slack (50 us) instead. */
static bool owner_idle(lock_ticket_t *t) {
  uint32_t before = atomic_load_explicit(&t->holds, memory_order_relaxed);
  int64_t until = now_ns() + IDLE_NS;
  do {
    for (int i = 0; i < 64; i++) spin_hint(); /* (reading its line at every hint would slow the owner) */
    if (atomic_load_explicit(&t->holds, memory_order_relaxed) != before) return false;
  } while (now_ns() < until);
  return !atomic_load_explicit(&t->inside, memory_order_acquire);
}

/* Asked to yield (lock.h): this thread, out of its biased hold, clears
 * `owner` if it still points to its ticket (a revocation may have cleared
 * it, and the bias gone to another since). The compare-and-swap is a full
 * barrier after the hold's stores. */
void gca__lock_yield(lock_t *l, lock_ticket_t *t) {
  lock_ticket_t *expected = t;
  atomic_compare_exchange_strong_explicit(&l->owner, &expected, NULL, memory_order_release, memory_order_relaxed);
}

/* Ask the busy owner of ticket t to yield, and wait a moment for it to.
 * True: `owner` was cleared by its thread after its last hold. False: no
 * yield came (the owner is in a long hold, or not running). */
static bool ask_yield(lock_t *l, const lock_ticket_t *t) {
  atomic_store_explicit(&l->yield_asked, 1, memory_order_relaxed);
  int64_t until = now_ns() + YIELD_WAIT_NS;
  do {
    for (int i = 0; i < 16; i++) {
      if (atomic_load_explicit(&l->owner, memory_order_acquire) != t) return true;
      spin_hint();
    }
  } while (now_ns() < until);
  return false;
}

/* Take the futex word. True: another thread held it (this one waited). */
static bool futex_acquire(lock_t *l) {
  uint32_t expected = 0;
  if (atomic_compare_exchange_strong_explicit(&l->state, &expected, 1, memory_order_acquire, memory_order_relaxed))
    return false;
  for (int spin = 0; spin < 100; spin++) {
    expected = 0;
    if (atomic_load_explicit(&l->state, memory_order_relaxed) == 0 &&
        atomic_compare_exchange_weak_explicit(&l->state, &expected, 1, memory_order_acquire,
                                              memory_order_relaxed))
      return true;
    spin_hint();
  }
  /* Mark the lock contended, and sleep until it is released. */
  while (atomic_exchange_explicit(&l->state, 2, memory_order_acquire) != 0) lock_futex(l, FUTEX_WAIT, 2);
  return true;
}

/* This thread's ticket, if it has had the bias. (A thread that ended left
 * its ticket to the next with its thread pointer.) */
static lock_ticket_t *ticket_find(lock_t *l, void *self) {
  for (lock_ticket_t *t = l->tickets; t; t = t->next)
    if (t->thread == self) return t;
  return NULL;
}

/* This thread's ticket, made the first time it gets the bias. NULL: out
 * of memory (then the lock stays unbiased). */
static lock_ticket_t *ticket_of(lock_t *l, void *self) {
  lock_ticket_t *t = ticket_find(l, self);
  if (t) return t;
  t = aligned_alloc(64, sizeof *t);
  if (!t) return NULL;
  memset(t, 0, sizeof *t);
  atomic_init(&t->inside, 0);
  t->thread = self;
  t->next = l->tickets;
  l->tickets = t;
  return t;
}

/* Bias the lock to this thread from its next acquisition on (this hold,
 * on the futex word, is not a biased one). False: no memory for a ticket. */
static bool give_bias(lock_t *l, void *self) {
  lock_ticket_t *t = ticket_of(l, self);
  if (!t) return false;
  atomic_store_explicit(&t->holds, 0, memory_order_relaxed);
  l->biased_at = now_ns();
  l->last = self;
  l->streak = 0;
  atomic_store_explicit(&l->owner, t, memory_order_release);
  return true;
}

void gca__lock_acquire_slow(lock_t *l, void *self) {
  bool waited = futex_acquire(l);
  l->slow_holds++;
  /* Biased to another thread (never to this one: only this thread biases
   * it to itself, and then takes the biased way until revoked). */
  lock_ticket_t *owner = atomic_load_explicit(&l->owner, memory_order_relaxed);
  if (owner) {
    /* A bias younger than its slice runs out first (this thread sleeps,
     * holding the futex word): revoked at once, threads that all keep
     * asking took turns at almost every acquisition, each turn a futex
     * wake or a revocation. */
    int64_t slice = l->revoke_ns * SLICE_REVOKES;
    slice = slice < SLICE_MIN_NS ? SLICE_MIN_NS : slice > SLICE_MAX_NS ? SLICE_MAX_NS : slice;
    bool idle = owner_idle(owner);
    if (!idle && l->biased_at + slice > now_ns()) {
      int64_t left = l->biased_at + slice - now_ns();
      if (left > 0) nanosleep(&(struct timespec){0, (long)left}, NULL);
    }
    int64_t start = now_ns();
    /* (only this thread writes `owner` now: the owner may only clear it) */
    if (idle || !ask_yield(l, owner)) {
      atomic_store_explicit(&l->owner, NULL, memory_order_relaxed);
      barrier_all_threads();
      wait_owner_out(owner);
    }
    atomic_store_explicit(&l->yield_asked, 0, memory_order_relaxed);
    uint32_t after = l->bias_after;
    l->revoke_ns = now_ns() - start;
    l->revocations++;
    uint32_t holds = atomic_load_explicit(&owner->holds, memory_order_relaxed);
    bool in_use = holds >= HANDOFF_HOLDS;
    if ((int64_t)holds * HOLD_SAVES_NS < l->revoke_ns && !in_use)
      l->bias_after = after < BIAS_AFTER_MAX / 2 ? after * 2 : BIAS_AFTER_MAX;
    else if (after > BIAS_AFTER_MIN)
      l->bias_after = after / 2;
    /* This thread had the bias before, and either the bias it waited for
     * was in use or its own last one was: it takes the bias over (see
     * above). The second case is a busy owner taken from before it was in
     * use: given the bias, then descheduled (more threads than processors)
     * and found idle. */
    lock_ticket_t *mine = ticket_find(l, self);
    if (mine && (in_use || atomic_load_explicit(&mine->holds, memory_order_relaxed) >= HANDOFF_HOLDS) &&
        give_bias(l, self))
      return;
  }
  /* Waited for the futex word, and had the bias before: threads that keep
   * asking contend here, and take turns by the bias rather than by the
   * word (see above). */
  if (waited && barrier_ready && ticket_find(l, self) && give_bias(l, self)) return;
  if (l->last != self) {
    l->last = self;
    l->streak = 1;
  } else if (++l->streak >= l->bias_after && barrier_ready) {
    /* Biased from the next acquisition on; this hold ends on the futex
     * word (`held` is not set). */
    l->streak = 0;
    give_bias(l, self);
  }
}

void gca__lock_destroy(lock_t *l) {
  for (lock_ticket_t *t = l->tickets, *next; t; t = next) {
    next = t->next;
    free(t);
  }
  l->tickets = NULL;
}

#endif
