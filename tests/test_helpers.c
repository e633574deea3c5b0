/* The kept helper threads (src/base/helpers.c) that the trace reader and the
 * replay run their parallel steps on: every job submitted runs exactly
 * once, or is taken back unrun and says so; chores run without anyone
 * waiting; many threads submit at once; the pool has a ceiling and refuses
 * past it; a child of fork gets a pool of its own; a thread started on
 * another processor than its creator's runs its jobs allowed on all of the
 * creator's processors again, and one starts where only one processor is
 * allowed. ThreadSanitizer runs it (label `threads`). */
#include <pthread.h>
#include <sched.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"

typedef struct counted {
  atomic_int runs;
  atomic_int *total;
  atomic_bool *hold; /* when set, the job waits till it is cleared */
} counted_t;

static void count_run(void *arg) {
  counted_t *c = arg;
  while (c->hold && atomic_load(c->hold)) sched_yield();
  atomic_fetch_add(&c->runs, 1);
  if (c->total) atomic_fetch_add(c->total, 1);
}

static void test_jobs_run_once(void **state) {
  (void)state;
  atomic_int total = 0;
  counted_t c[16];
  helper_job_t jobs[16];
  int submitted = 0, ran = 0;
  for (int i = 0; i < 16; i++) {
    c[i] = (counted_t){.total = &total};
    atomic_init(&c[i].runs, 0);
    jobs[i] = (helper_job_t){.run = count_run, .arg = &c[i]};
    submitted += gca__helper_submit(&jobs[i]);
  }
  assert_int_equal(submitted, 16);
  for (int i = 0; i < 16; i++) {
    bool did = gca__helper_wait(&jobs[i]);
    assert_int_equal(atomic_load(&c[i].runs), did ? 1 : 0);
    ran += did;
  }
  assert_int_equal(atomic_load(&total), ran);
}

/* Waiting at once races with a thread taking the job: either way, the
 * answer must be what happened. */
static void test_wait_takes_back_or_waits(void **state) {
  (void)state;
  int taken_back = 0;
  for (int i = 0; i < 3000; i++) {
    counted_t c = {0};
    atomic_init(&c.runs, 0);
    helper_job_t job = {.run = count_run, .arg = &c};
    assert_true(gca__helper_submit(&job));
    bool did = gca__helper_wait(&job);
    assert_int_equal(atomic_load(&c.runs), did ? 1 : 0);
    taken_back += !did;
  }
  /* (Both ways are taken on a loaded machine; neither is required.) */
  print_message("taken back unrun: %d of 3000\n", taken_back);
}

static void test_chores_run(void **state) {
  (void)state;
  static atomic_int total;
  static counted_t c[100];
  atomic_store(&total, 0);
  int inline_runs = 0;
  for (int i = 0; i < 100; i++) {
    c[i] = (counted_t){.total = &total};
    atomic_init(&c[i].runs, 0);
    if (!gca__helper_detach(count_run, &c[i])) {
      count_run(&c[i]);
      inline_runs++;
    }
  }
  struct timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    if (atomic_load(&total) == 100) break;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    assert_true(now.tv_sec - start.tv_sec < 30); /* chores must not be left queued */
    sched_yield();
  }
  for (int i = 0; i < 100; i++) assert_int_equal(atomic_load(&c[i].runs), 1);
  assert_int_equal(inline_runs, 0);
}

typedef struct submitter {
  atomic_int *total;
  int ran;
} submitter_t;

static void *submit_many(void *arg) {
  submitter_t *s = arg;
  for (int i = 0; i < 400; i++) {
    counted_t c = {.total = s->total};
    atomic_init(&c.runs, 0);
    helper_job_t job = {.run = count_run, .arg = &c};
    if (!gca__helper_submit(&job)) continue;
    if (gca__helper_wait(&job)) s->ran++;
    else count_run(&c); /* taken back: the caller does it, as the replay does */
    if (atomic_load(&c.runs) != 1) abort();
  }
  return NULL;
}

static void test_many_submitters(void **state) {
  (void)state;
  atomic_int total = 0;
  pthread_t threads[4];
  submitter_t s[4];
  for (int i = 0; i < 4; i++) {
    s[i] = (submitter_t){.total = &total};
    assert_int_equal(pthread_create(&threads[i], NULL, submit_many, &s[i]), 0);
  }
  for (int i = 0; i < 4; i++) pthread_join(threads[i], NULL);
  assert_int_equal(atomic_load(&total), 4 * 400);
}

/* GCA_HELPERS_MAX jobs that hold their threads: one more is refused (the
 * caller runs it), and the held ones all run once let go. */
static void test_ceiling(void **state) {
  (void)state;
  atomic_bool hold = true;
  atomic_int total = 0;
  static counted_t c[GCA_HELPERS_MAX + 1];
  static helper_job_t jobs[GCA_HELPERS_MAX + 1];
  int accepted = 0;
  for (int i = 0; i < GCA_HELPERS_MAX + 1; i++) {
    c[i] = (counted_t){.total = &total, .hold = &hold};
    atomic_init(&c[i].runs, 0);
    jobs[i] = (helper_job_t){.run = count_run, .arg = &c[i]};
    if (!gca__helper_submit(&jobs[i])) break;
    accepted++;
    /* Each held job has a thread before the next is submitted, so that the
     * count does not depend on how fast threads start. */
    while (atomic_load_explicit(&jobs[i].state, memory_order_acquire) == 1 /* queued */) sched_yield();
  }
  assert_int_equal(accepted, GCA_HELPERS_MAX);
  assert_int_equal(atomic_load(&c[GCA_HELPERS_MAX].runs), 0);
  atomic_store(&hold, false);
  for (int i = 0; i < accepted; i++) assert_true(gca__helper_wait(&jobs[i]));
  assert_int_equal(atomic_load(&total), GCA_HELPERS_MAX);
}


static void test_fork_child_has_own_pool(void **state) {
  (void)state;
#if UNDER_TSAN
  skip(); /* ThreadSanitizer refuses threads started after a fork of a threaded process */
#endif
  counted_t warm = {0};
  atomic_init(&warm.runs, 0);
  helper_job_t job = {.run = count_run, .arg = &warm};
  assert_true(gca__helper_submit(&job)); /* the parent has threads */
  gca__helper_wait(&job);
  pid_t child = fork();
  assert_true(child >= 0);
  if (child == 0) {
    counted_t c = {0};
    atomic_init(&c.runs, 0);
    helper_job_t mine = {.run = count_run, .arg = &c};
    if (!gca__helper_submit(&mine)) _exit(2);
    bool did = gca__helper_wait(&mine);
    _exit(atomic_load(&c.runs) == (did ? 1 : 0) ? 0 : 3);
  }
  int status = 0;
  assert_int_equal(waitpid(child, &status, 0), child);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
}

#if defined(__linux__) && defined(__GLIBC__) && defined(CPU_COUNT)
#define TEST_AFFINITY 1
#endif

#ifdef TEST_AFFINITY
typedef struct affinity_seen {
  atomic_bool *hold;
  atomic_bool recorded;
  cpu_set_t set;
  int got;
} affinity_seen_t;

static void record_affinity(void *arg) {
  affinity_seen_t *a = arg;
  a->got = pthread_getaffinity_np(pthread_self(), sizeof a->set, &a->set);
  atomic_store(&a->recorded, true);
  while (atomic_load(a->hold)) sched_yield();
}

/* Jobs held on threads of their own, so that fresh threads are started
 * (helpers.c starts each off its creator's processor): each must run
 * allowed on exactly the creator's processors. Dropping the restore in
 * helper_main leaves them off one processor and fails this on any machine
 * with two or more. */
static void test_threads_keep_the_creators_processors(void **state) {
  (void)state;
  enum { HELD = 6 };
  cpu_set_t mine;
  assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof mine, &mine), 0);
  atomic_bool hold = true;
  static affinity_seen_t seen[HELD];
  static helper_job_t jobs[HELD];
  for (int i = 0; i < HELD; i++) {
    seen[i] = (affinity_seen_t){.hold = &hold, .got = -1};
    atomic_init(&seen[i].recorded, false);
    jobs[i] = (helper_job_t){.run = record_affinity, .arg = &seen[i]};
    assert_true(gca__helper_submit(&jobs[i]));
    while (!atomic_load(&seen[i].recorded)) sched_yield(); /* its thread holds it: the next needs another */
  }
  atomic_store(&hold, false);
  for (int i = 0; i < HELD; i++) {
    assert_true(gca__helper_wait(&jobs[i]));
    assert_int_equal(seen[i].got, 0);
    assert_true(CPU_EQUAL(&seen[i].set, &mine));
  }
}

/* A process allowed one processor (taskset -c 0) still gets its helpers:
 * there is nowhere else to start them, so they start there. */
static void test_one_processor_allowed(void **state) {
  (void)state;
#if UNDER_TSAN
  skip(); /* (a fork of a threaded process: see above) */
#endif
  pid_t child = fork();
  assert_true(child >= 0);
  if (child == 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    int cpu = sched_getcpu();
    CPU_SET(cpu >= 0 ? cpu : 0, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) _exit(0); /* (not allowed here: nothing to check) */
    atomic_bool hold = false;
    affinity_seen_t a = {.hold = &hold, .got = -1};
    atomic_init(&a.recorded, false);
    helper_job_t job = {.run = record_affinity, .arg = &a};
    if (!gca__helper_submit(&job)) _exit(2);
    bool did = gca__helper_wait(&job);
    if (!did) record_affinity(&a); /* taken back: the caller runs it */
    _exit(a.got == 0 && CPU_EQUAL(&a.set, &one) ? 0 : 3);
  }
  int status = 0;
  assert_int_equal(waitpid(child, &status, 0), child);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
}
/* The processors usable are the calling thread's affinity, not those
 * online: one when it is held to one, all of its set again after. */
static void test_processors_usable(void **state) {
  (void)state;
  cpu_set_t had, one;
  assert_int_equal(sched_getaffinity(0, sizeof had, &had), 0);
  assert_int_equal(gca__processors_usable(), CPU_COUNT(&had));
  CPU_ZERO(&one);
  int cpu = sched_getcpu();
  CPU_SET(cpu >= 0 ? cpu : 0, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) skip(); /* (not allowed here: nothing to check) */
  assert_int_equal(gca__processors_usable(), 1);
  assert_int_equal(sched_setaffinity(0, sizeof had, &had), 0);
  assert_int_equal(gca__processors_usable(), CPU_COUNT(&had));
}
#endif

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_jobs_run_once),
      cmocka_unit_test(test_wait_takes_back_or_waits),
      cmocka_unit_test(test_chores_run),
      cmocka_unit_test(test_many_submitters),
      cmocka_unit_test(test_ceiling),
      cmocka_unit_test(test_fork_child_has_own_pool),
#ifdef TEST_AFFINITY
      cmocka_unit_test(test_threads_keep_the_creators_processors),
      cmocka_unit_test(test_one_processor_allowed),
      cmocka_unit_test(test_processors_usable),
#endif
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
