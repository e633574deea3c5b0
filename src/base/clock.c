/* The history's clock: a cheap steady counter (base.h, gca__ticks) read on
 * the hot path, turned into wall-clock time only when entries are read.
 *
 * Why not clock_gettime per entry: a cached alloc+free pair records three
 * entries, and on a virtual machine's clock source each read costs 20-30
 * ns, twice what the pair costs without the history. The counter costs a
 * few ns; two (counter, wall clock) readings, one when recording starts and
 * one when the entries are read, put every entry on the wall clock's line,
 * as PyTorch's approximate clock does for its own history.
 */
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "base/base.h"

_Atomic bool gca__ticks_counter;

static pthread_once_t ticks_once = PTHREAD_ONCE_INIT;

/* The counter only where its rate is steady: cpuid leaf 0x80000007, EDX
 * bit 8 (invariant TSC). GCALLOC_TEST_TICKS_CLOCK=1 (tests) keeps the
 * clock. */
static void ticks_decide(void) {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  const char *test = getenv("GCALLOC_TEST_TICKS_CLOCK");
  bool invariant = __get_cpuid(0x80000007u, &a, &b, &c, &d) && (d & (1u << 8));
  atomic_store(&gca__ticks_counter, invariant && !(test && test[0] == '1'));
#endif
}

void gca__ticks_init(void) { pthread_once(&ticks_once, ticks_decide); }

int64_t gca__wall_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

ticks_pair_t gca__ticks_pair(void) {
  /* (the counter read on both sides of the clock, their middle taken: the
   * pair then lies within one clock read of the truth) */
  uint64_t before = gca__ticks();
  int64_t us = gca__wall_us();
  uint64_t after = gca__ticks();
  return (ticks_pair_t){before + (after - before) / 2, us};
}

int64_t gca__ticks_to_us(uint64_t ticks, ticks_pair_t from, ticks_pair_t to) {
  if (to.ticks <= from.ticks) return from.us;
  double rate = (double)(to.us - from.us) / (double)(to.ticks - from.ticks);
  double since = ticks >= from.ticks ? (double)(ticks - from.ticks) : -(double)(from.ticks - ticks);
  return from.us + (int64_t)(since * rate);
}
