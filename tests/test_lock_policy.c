/* Who the device lock is biased to (src/base/lock.c), step by step: a
 * thread that has had the bias gets it back when it waits for the futex
 * word, and takes over a bias whose owner never used it when its own last
 * one was used. Each step waits for the state it needs (a thread asleep
 * on the futex word, a bias given), so the outcome does not hang on the
 * machine's timing. Without membarrier(2) no lock is biased: skipped. */
#include <pthread.h>

#include "helpers.h"

enum { RUN = 256 + 100 }; /* acquisitions in a row: the bias (after 256), then 100 holds under it */

typedef struct {
  lock_t lock;
  pthread_barrier_t step;
  bool biased_to_me; /* what the thread under test saw in its last hold */
} scene_t;

/* The ticket the lock is biased to is this thread's. With the lock held. */
static bool biased_to_self(lock_t *l) {
  lock_ticket_t *t = atomic_load(&l->owner);
  return t && t->thread == lock_self();
}

static void hold_once(lock_t *l) {
  lock_acquire(l);
  lock_release(l);
}

/* A run of acquisitions: biased, and 100 holds used under the bias. */
static void busy_run(scene_t *s) {
  for (int i = 0; i < RUN; i++) hold_once(&s->lock);
}

static bool bias_possible(scene_t *s) {
  lock_init(&s->lock, RANK_DEVICE);
  if (s->lock.bias_after != UINT32_MAX) return true;
  print_message("no membarrier here: the lock is never biased\n");
  lock_destroy(&s->lock);
  return false;
}

/* ---- a thread that had the bias waits for the futex word ---------------- */

static void *waits_for_word(void *arg) {
  scene_t *s = arg;
  busy_run(s);
  assert_true(atomic_load(&s->lock.owner) != NULL);
  pthread_barrier_wait(&s->step); /* 1: biased, idle */
  pthread_barrier_wait(&s->step); /* 2: the main thread revoked it and holds the word */
  lock_acquire(&s->lock);          /* sleeps on the word until the main thread lets go */
  s->biased_to_me = biased_to_self(&s->lock);
  lock_release(&s->lock);
  return NULL;
}

static void test_a_thread_that_had_the_bias_gets_it_when_it_waits(void **state) {
  (void)state;
  scene_t s = {.biased_to_me = false};
  if (!bias_possible(&s)) skip();
  pthread_barrier_init(&s.step, NULL, 2);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, waits_for_word, &s), 0);
  pthread_barrier_wait(&s.step); /* 1 */
  /* Revoke the idle bias (this thread never had one: it does not take
   * over) and hold the futex word. */
  uint64_t revocations = s.lock.revocations;
  lock_acquire(&s.lock);
  assert_int_equal(s.lock.revocations, revocations + 1);
  assert_null(atomic_load(&s.lock.owner));
  pthread_barrier_wait(&s.step); /* 2 */
  /* Let go only once the other thread sleeps on the word (state 2). */
  double until = now_ms() + 20000;
  while (atomic_load(&s.lock.state) != 2 && now_ms() < until) nanosleep(&(struct timespec){0, 1000000}, NULL);
  assert_int_equal(atomic_load(&s.lock.state), 2);
  lock_release(&s.lock);
  pthread_join(t, NULL);
  /* It waited and it had the bias: biased from its next acquisition on,
   * without a run of 256 of its own. */
  assert_true(s.biased_to_me);
  pthread_barrier_destroy(&s.step);
  lock_destroy(&s.lock);
}

/* ---- a used bias's thread takes over one that was never used ------------ */

typedef struct {
  scene_t *s;
  int role; /* 0: the thread whose bias was used; 1: the one given a bias it never uses */
} actor_t;

static void *actor(void *arg) {
  actor_t *a = arg;
  scene_t *s = a->s;
  if (a->role == 0) {
    busy_run(s);
    pthread_barrier_wait(&s->step); /* 1: biased, 100 holds used */
    pthread_barrier_wait(&s->step); /* 2: the other thread was given a bias and stopped */
    hold_once(&s->lock);            /* revokes it, and takes over */
    lock_acquire(&s->lock);
    s->biased_to_me = biased_to_self(&s->lock);
    lock_release(&s->lock);
  } else {
    pthread_barrier_wait(&s->step); /* 1 */
    /* Revoke the used bias (no takeover: no ticket yet), then acquire
     * until the lock is biased to this thread, and stop: its bias then has
     * no holds. */
    bool mine = false;
    for (int i = 0; i < 100000 && !mine; i++) {
      lock_acquire(&s->lock);
      mine = biased_to_self(&s->lock);
      lock_release(&s->lock);
    }
    assert_true(mine);
    pthread_barrier_wait(&s->step); /* 2 */
  }
  return NULL;
}

static void test_a_used_bias_takes_over_one_never_used(void **state) {
  (void)state;
  scene_t s = {.biased_to_me = false};
  if (!bias_possible(&s)) skip();
  pthread_barrier_init(&s.step, NULL, 2);
  actor_t roles[2] = {{&s, 0}, {&s, 1}};
  pthread_t t[2];
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&t[i], NULL, actor, &roles[i]), 0);
  for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
  /* Taken over in one acquisition, not after a new run of 256 (the bias it
   * revoked had no holds: it was not in use). */
  assert_true(s.biased_to_me);
  pthread_barrier_destroy(&s.step);
  lock_destroy(&s.lock);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_a_thread_that_had_the_bias_gets_it_when_it_waits),
      cmocka_unit_test(test_a_used_bias_takes_over_one_never_used),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
