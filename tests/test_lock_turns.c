/* The device lock's turns (src/base/lock.c): threads that all keep asking
 * for one device take turns a slice each, and a turn costs a futex hold or
 * two. Run alone (RUN_SERIAL): on a processor shared with other tests, an
 * owner descheduled mid-slice is rightly taken from without a handover, and
 * the turns this checks do not happen. */
#include <inttypes.h>
#include <pthread.h>

#include "helpers.h"

/* Under ThreadSanitizer every lock word access is instrumented and its
 * threads are scheduled by it: the turns are timed by it, not by the lock,
 * so there the test drives the turn-taking for races only (TSan fails it on
 * one) and does not require the turns' cost. */
#if defined(__SANITIZE_THREAD__)
#define TURNS_TIMED 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TURNS_TIMED 0
#endif
#endif
#ifndef TURNS_TIMED
#define TURNS_TIMED 1
#endif

/* Threads that all keep asking for one device take turns a slice each:
 * the thread that revokes a busy bias takes it over if it has had the bias
 * before, rather than both alternating on the futex word until one gets a
 * run of its own (hundreds of futex holds for each bias, half one thread's
 * pairs a second: hundreds of thousands of futex holds a revocation). So
 * once both have had the bias, a revocation costs a futex hold or two. Two
 * threads run in phases of TURN_MS, parked on a barrier between them while
 * the lock's counters are read. */
enum { TURN_MS = 200, TURN_CAP_MS = 10000, TURNS_CAP_MS = 30000, TURN_REVOCATIONS = 8 };

typedef struct {
  gca_allocator_t *a;
  pthread_barrier_t *phase;
  long failures;
} asker_t;

static double turns_until; /* (written between phases, read in them: the barrier orders them) */
static bool turns_over;

static void *keep_asking(void *arg) {
  asker_t *k = arg;
  for (;;) {
    pthread_barrier_wait(k->phase);
    if (turns_over) return NULL;
    while (now_ms() < turns_until)
      for (int i = 0; i < 1000; i++) {
        void *p = gca_malloc(k->a, 4096, 0, 0);
        if (!p || gca_free(k->a, p) != GCA_OK) k->failures++;
      }
    pthread_barrier_wait(k->phase);
  }
}

static void run_phase(pthread_barrier_t *phase) {
  turns_until = now_ms() + TURN_MS;
  pthread_barrier_wait(phase);
  pthread_barrier_wait(phase);
}

static void test_threads_that_keep_asking_take_turns(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  lock_t *l = &a->devices[0].lock;
  pthread_barrier_t phase;
  pthread_barrier_init(&phase, NULL, 3);
  asker_t k[2] = {{a, &phase, 0}, {a, &phase, 0}};
  pthread_t t[2];
  turns_over = false;
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&t[i], NULL, keep_asking, &k[i]), 0);
  double start = now_ms();
  int tickets = 0;
  while (tickets < 2 && now_ms() - start < TURN_CAP_MS) { /* until both have had the bias */
    run_phase(&phase);
    tickets = 0;
    for (lock_ticket_t *x = l->tickets; x; x = x->next) tickets++;
  }
  /* Then phases until one shows the turns: a revocation per futex hold or
   * two. (Not every phase: on a loaded machine a thread descheduled while
   * it waits on the futex word, or in its turn, costs a phase more holds.
   * Before a thread that had the bias took it back when it waited for the
   * word, the threads could alternate on the word for over 10 s on a shared
   * virtual machine: hence up to TURNS_CAP_MS.) */
  uint64_t holds = 0, revocations = 0;
  int phases = 0;
  bool turns = false;
  start = now_ms();
  while (tickets == 2 && !turns && now_ms() - start < (TURNS_TIMED ? TURNS_CAP_MS : 10 * TURN_MS)) {
    uint64_t holds0 = l->slow_holds, revocations0 = l->revocations;
    run_phase(&phase);
    phases++;
    holds = l->slow_holds - holds0;
    revocations = l->revocations - revocations0;
    turns = revocations >= TURN_REVOCATIONS && holds <= 2 * revocations + 8;
  }
  turns_over = true;
  pthread_barrier_wait(&phase);
  for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
  pthread_barrier_destroy(&phase);
  print_message("after both had the bias, phase %d: %" PRIu64 " futex holds, %" PRIu64 " revocations\n", phases,
                holds, revocations);
  assert_int_equal(k[0].failures + k[1].failures, 0);
  assert_int_equal(tickets, 2);
  if (TURNS_TIMED) assert_true(turns);
  assert_consistent(a);
  gca_close(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_threads_that_keep_asking_take_turns)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
