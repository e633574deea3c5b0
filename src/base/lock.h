/* The device lock: a mutex whose uncontended acquire and release are one
 * atomic instruction each, inline, with no call into the C library.
 *
 * Why not pthread_mutex_t: on the cached alloc/free path the two lock/unlock
 * pairs were a sixth of the instructions executed (glibc checks the mutex
 * kind, elision and robustness on every call). This is the classic
 * three-state futex mutex (0 free, 1 held, 2 held with waiters; Drepper,
 * "Futexes Are Tricky"): a short spin, then the thread sleeps in the kernel,
 * so a thread waiting behind a slow device call does not burn a core.
 * Acquire/release atomics give ThreadSanitizer the happens-before edges it
 * needs. Elsewhere than Linux it falls back to pthread_mutex_t.
 */
#ifndef GCALLOC_LOCK_H
#define GCALLOC_LOCK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/* Debug builds count the library's locks each thread holds, so that what
 * must run with none held (a log handler, a user callback, a wait for other
 * threads) can assert it: re-entry from there would deadlock. */
#ifndef NDEBUG
extern _Thread_local int gca__locks_held;
#define LOCKS_HELD_ADD(n) (gca__locks_held += (n))
#define LOCKS_HELD() gca__locks_held
#else
#define LOCKS_HELD_ADD(n) ((void)0)
#define LOCKS_HELD() 0
#endif

/* The library's other mutexes (configuration, callbacks, pinned host
 * cache, trace file), counted as above. */
static inline void mutex_lock(pthread_mutex_t *m) {
  pthread_mutex_lock(m);
  LOCKS_HELD_ADD(1);
}

static inline void mutex_unlock(pthread_mutex_t *m) {
  LOCKS_HELD_ADD(-1);
  pthread_mutex_unlock(m);
}

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct lock {
  _Atomic uint32_t state;
} lock_t;

static inline int lock_init(lock_t *l) {
  atomic_init(&l->state, 0);
  return 0;
}

static inline void lock_destroy(lock_t *l) { (void)l; }

static inline void lock_futex(lock_t *l, int op, uint32_t value) {
  syscall(SYS_futex, (uint32_t *)&l->state, op | FUTEX_PRIVATE_FLAG, value, NULL, NULL, 0);
}

__attribute__((noinline, unused)) static void lock_acquire_slow(lock_t *l) {
  for (int spin = 0; spin < 100; spin++) {
    uint32_t expected = 0;
    if (atomic_load_explicit(&l->state, memory_order_relaxed) == 0 &&
        atomic_compare_exchange_weak_explicit(&l->state, &expected, 1, memory_order_acquire,
                                              memory_order_relaxed))
      return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  /* Mark the lock contended, and sleep until it is released. */
  while (atomic_exchange_explicit(&l->state, 2, memory_order_acquire) != 0) lock_futex(l, FUTEX_WAIT, 2);
}

static inline void lock_acquire(lock_t *l) {
  uint32_t expected = 0;
  if (__builtin_expect(atomic_compare_exchange_strong_explicit(&l->state, &expected, 1, memory_order_acquire,
                                                               memory_order_relaxed),
                       1)) {
    LOCKS_HELD_ADD(1);
    return;
  }
  lock_acquire_slow(l);
  LOCKS_HELD_ADD(1);
}

static inline void lock_release(lock_t *l) {
  LOCKS_HELD_ADD(-1);
  if (__builtin_expect(atomic_exchange_explicit(&l->state, 0, memory_order_release) == 2, 0))
    lock_futex(l, FUTEX_WAKE, 1);
}

#else /* portable fallback */

typedef struct lock {
  pthread_mutex_t mutex;
} lock_t;

static inline int lock_init(lock_t *l) { return pthread_mutex_init(&l->mutex, NULL); }
static inline void lock_destroy(lock_t *l) { pthread_mutex_destroy(&l->mutex); }
static inline void lock_acquire(lock_t *l) { mutex_lock(&l->mutex); }
static inline void lock_release(lock_t *l) { mutex_unlock(&l->mutex); }

#endif

#endif /* GCALLOC_LOCK_H */
