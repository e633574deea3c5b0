/* Kept helper threads for the tools' parallel steps: the trace reader's
 * second reader, the replay's device workers, and unmapping a file read;
 * and for the pinned host allocator's page touching before registering
 * (pinned_num_register_threads, host.c).
 *
 * Starting a thread costs its creator tens of microseconds, and the thread
 * starts up to a hundred later (its processor is woken), while a replay of
 * a snapshot takes a few milliseconds and starts two. So threads are kept from one
 * job to the next: one that finishes a job looks for the next one for a
 * while (pausing its processor, spin_pause) before it sleeps,
 * and a job submitted then starts at once. `gcalloc tune` and the
 * benchmark replay many times in a process; a single `gcalloc replay`
 * gains the unmapping, which no longer delays it.
 *
 * A job is queued; a thread is started only when more jobs wait than kept
 * threads are free, so a caller gets at least the concurrency that starting
 * one thread per job gave. The device allocator's paths never use them. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <limits.h>
#include <time.h>
#include <unistd.h>

#include "base/base.h"

/* How long a thread that finished a job looks for the next before it
 * sleeps: longer than the gaps between a replay's steps (reading, the
 * plan, the next trace of a benchmark), short enough to cost nothing
 * noticeable when no job comes. */
#define HELPER_LOOK_NS 2000000
/* A detached job (a chore: unmapping a file read) waits this long for a
 * thread that is looking, in case a job someone waits for comes first: the
 * reader's unmapping came just before the replay wanted a thread, and
 * took it for 0.1 ms. */
#define HELPER_CHORE_DELAY_NS 300000

enum { JOB_QUEUED = 1, JOB_RUNNING, JOB_DONE };

typedef struct job_queue {
  helper_job_t *head, *tail;
  atomic_size_t length; /* read without the lock by threads looking for work */
} job_queue_t;

static pthread_mutex_t helpers_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t helpers_wake = PTHREAD_COND_INITIALIZER; /* a job was queued, or closing */
static pthread_cond_t helpers_done = PTHREAD_COND_INITIALIZER; /* a job finished, or a thread left */
static job_queue_t waited_jobs, chore_jobs; /* waited for; detached */
static int helper_count, helper_looking;
static atomic_int helper_busy; /* changed under the lock, read without it by threads looking */
static atomic_bool helpers_closing;
static bool atfork_set;

int gca__processors_usable(void) {
#ifdef CPU_COUNT
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online < 1 ? 1 : online > INT_MAX ? INT_MAX : (int)online;
}

/* A wait's step is the processor's pause hint, a few dozen times (about a
 * microsecond), not sched_yield: a thread waiting by yielding enters the
 * kernel's scheduler some hundred thousand times a second (a fifth of a
 * replay's samples under `perf`), and slows the work on the other
 * processor, which on a virtual machine may be the other thread of the
 * same core. Every 16th step still yields, so that a thread of the process
 * that wants this processor gets it. */
void gca__spin_pause(void) {
  static _Thread_local unsigned steps;
  if (++steps % 16 == 0) {
    sched_yield();
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  for (int i = 0; i < 32; i++) __builtin_ia32_pause();
#elif defined(__aarch64__)
  for (int i = 0; i < 32; i++) __asm__ volatile("yield");
#else
  sched_yield();
#endif
}

/* Under the lock. */
static void push_job(job_queue_t *q, helper_job_t *job) {
  job->next = NULL;
  if (q->tail) q->tail->next = job;
  else q->head = job;
  q->tail = job;
  atomic_fetch_add_explicit(&q->length, 1, memory_order_relaxed);
}

static helper_job_t *pop_job(job_queue_t *q) {
  helper_job_t *job = q->head;
  if (!job) return NULL;
  q->head = job->next;
  if (!q->head) q->tail = NULL;
  atomic_fetch_sub_explicit(&q->length, 1, memory_order_relaxed);
  return job;
}

static void remove_job(job_queue_t *q, helper_job_t *job) {
  helper_job_t **at = &q->head, *prev = NULL;
  while (*at != job) prev = *at, at = &(*at)->next;
  *at = job->next;
  if (q->tail == job) q->tail = prev;
  atomic_fetch_sub_explicit(&q->length, 1, memory_order_relaxed);
}

static size_t queued(const job_queue_t *q) { return atomic_load_explicit(&q->length, memory_order_relaxed); }

/* Threads that may look for work at once: one processor is the caller's,
 * and a thread looking on a processor that the others need slows them. */
static int look_limit(void) {
  static atomic_int limit; /* found once (threads may race to: they find the same) */
  int n = atomic_load_explicit(&limit, memory_order_relaxed);
  if (!n) {
    n = gca__processors_usable() - 1;
    n = n > 1 ? n : 1;
    atomic_store_explicit(&limit, n, memory_order_relaxed);
  }
  return n;
}

/* A new thread starts on a processor other than its creator's, which is
 * about to run flat out (the first reader, the first device): Linux placed
 * it on the creator's own run queue in half of the new processes measured,
 * and there it waited until the creator yielded, 2 ms later, when the
 * first reader had read its whole part (the second reader then read
 * nothing). So it is created allowed everywhere but there, and once it
 * runs it is allowed everywhere again: `arg`, when given, is the creator's
 * set, the thread's to free. */
#if defined(__linux__) && defined(__GLIBC__) && defined(CPU_COUNT)
#define HELPER_START_ELSEWHERE 1
#endif

static void *helper_main(void *arg) {
#ifdef HELPER_START_ELSEWHERE
  if (arg) {
    (void)pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), arg);
    free(arg);
  }
#else
  (void)arg;
#endif
  for (;;) {
    mutex_lock(&helpers_lock, RANK_HELPERS);
    bool look = helper_busy + helper_looking < look_limit();
    helper_looking += look;
    mutex_unlock(&helpers_lock);
    if (look) {
      uint64_t start = gca__now_ns(), give_up = start + HELPER_LOOK_NS, chore_at = start + HELPER_CHORE_DELAY_NS;
      /* Till a job comes, or a chore has waited, or others started enough
       * jobs to fill the processors (helper_busy read without the lock: a
       * hint). */
      for (;;) {
        if (queued(&waited_jobs) || atomic_load_explicit(&helpers_closing, memory_order_relaxed)) break;
        uint64_t now = gca__now_ns();
        if (now >= give_up || (queued(&chore_jobs) && now >= chore_at)) break;
        if (atomic_load_explicit(&helper_busy, memory_order_relaxed) + 1 > look_limit()) break;
        gca__spin_pause();
      }
    }
    mutex_lock(&helpers_lock, RANK_HELPERS);
    helper_looking -= look;
    while (!waited_jobs.head && !chore_jobs.head && !atomic_load_explicit(&helpers_closing, memory_order_relaxed))
      pthread_cond_wait(&helpers_wake, &helpers_lock);
    helper_job_t *job = pop_job(&waited_jobs);
    if (!job) job = pop_job(&chore_jobs);
    if (!job) { /* closing */
      helper_count--;
      pthread_cond_broadcast(&helpers_done);
      mutex_unlock(&helpers_lock);
      return NULL;
    }
    helper_busy++;
    atomic_store_explicit(&job->state, JOB_RUNNING, memory_order_relaxed);
    mutex_unlock(&helpers_lock);

    bool detached = job->detached;
    job->run(job->arg);
    if (detached) free(job);

    mutex_lock(&helpers_lock, RANK_HELPERS);
    helper_busy--;
    /* The waiter may return and free the job as soon as it reads DONE:
     * nothing here touches it after. */
    if (!detached) atomic_store_explicit(&job->state, JOB_DONE, memory_order_release);
    pthread_cond_broadcast(&helpers_done);
    mutex_unlock(&helpers_lock);
  }
}

/* A child of fork has none of the parent's threads: it starts afresh (a
 * job queued in the parent at that moment is the parent's). */
static void helpers_after_fork(void) {
  pthread_mutex_init(&helpers_lock, NULL);
  pthread_cond_init(&helpers_wake, NULL);
  pthread_cond_init(&helpers_done, NULL);
  waited_jobs.head = waited_jobs.tail = chore_jobs.head = chore_jobs.tail = NULL;
  atomic_store(&waited_jobs.length, 0);
  atomic_store(&chore_jobs.length, 0);
  helper_count = helper_looking = 0;
  atomic_store(&helper_busy, 0);
}

/* A detached helper thread; with `others`, started there, and given
 * `allowed` (the creator's set) to take once it runs and free. */
static bool create_helper(const void *others, void *allowed) { /* (cpu_set_t, where there is one) */
  pthread_t thread;
  pthread_attr_t attr;
  if (pthread_attr_init(&attr) != 0) return false;
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  bool placed = true;
#ifdef HELPER_START_ELSEWHERE
  if (others) placed = pthread_attr_setaffinity_np(&attr, sizeof(cpu_set_t), others) == 0;
#else
  (void)others;
#endif
  bool started = placed && pthread_create(&thread, &attr, helper_main, allowed) == 0;
  pthread_attr_destroy(&attr);
  return started;
}

/* Under the lock: a new thread; false when none starts. */
static bool start_helper(void) {
  if (helper_count >= GCA_HELPERS_MAX) return false;
  bool started = false;
#ifdef HELPER_START_ELSEWHERE
  cpu_set_t *allowed = malloc(sizeof *allowed);
  int here = sched_getcpu();
  if (allowed && here >= 0 && here < CPU_SETSIZE && pthread_getaffinity_np(pthread_self(), sizeof *allowed, allowed) == 0 &&
      CPU_ISSET(here, allowed) && CPU_COUNT(allowed) > 1) {
    cpu_set_t others = *allowed;
    CPU_CLR(here, &others);
    started = create_helper(&others, allowed);
  }
  if (!started) free(allowed);
#endif
  /* Anywhere: one processor allowed, or the others refused. */
  if (!started) started = create_helper(NULL, NULL);
  helper_count += started;
  return started;
}

/* Queues a job: a thread is started when more jobs wait than threads are
 * free (a chore waits for one, unless there is none); false when it cannot
 * be run. Under the lock. */
static bool queue_job(helper_job_t *job) {
  if (atomic_load_explicit(&helpers_closing, memory_order_relaxed)) return false;
  if (!atfork_set) atfork_set = pthread_atfork(NULL, NULL, helpers_after_fork) == 0;
  atomic_store_explicit(&job->state, JOB_QUEUED, memory_order_relaxed);
  job_queue_t *q = job->detached ? &chore_jobs : &waited_jobs;
  push_job(q, job);
  size_t free_threads = (size_t)(helper_count - helper_busy);
  bool short_of_threads = job->detached ? helper_count == 0 : queued(&waited_jobs) > free_threads;
  /* (A thread that cannot start changes nothing: still short, it is refused.) */
  if (short_of_threads && !start_helper()) {
    remove_job(q, job);
    atomic_store_explicit(&job->state, 0, memory_order_relaxed);
    return false;
  }
  /* A thread looking finds it; else one is woken (a chore only when no
   * thread looks: one that finishes its job will look). */
  if (!job->detached || !helper_looking) pthread_cond_signal(&helpers_wake);
  return true;
}

bool gca__helper_submit(helper_job_t *job) {
  job->detached = false;
  mutex_lock(&helpers_lock, RANK_HELPERS);
  bool queued_it = queue_job(job);
  mutex_unlock(&helpers_lock);
  return queued_it;
}

bool gca__helper_wait(helper_job_t *job) {
  /* A short wait is looked for, not slept through: waking a sleeper costs
   * what the helper saved. */
  uint64_t give_up = gca__now_ns() + HELPER_LOOK_NS;
  while (atomic_load_explicit(&job->state, memory_order_acquire) == JOB_RUNNING && gca__now_ns() < give_up)
    gca__spin_pause();
  mutex_lock(&helpers_lock, RANK_HELPERS);
  bool ran = true;
  if (atomic_load_explicit(&job->state, memory_order_relaxed) == JOB_QUEUED) {
    remove_job(&waited_jobs, job);
    ran = false;
  }
  while (ran && atomic_load_explicit(&job->state, memory_order_acquire) != JOB_DONE)
    pthread_cond_wait(&helpers_done, &helpers_lock);
  mutex_unlock(&helpers_lock);
  return ran;
}

bool gca__helper_detach(void (*run)(void *), void *arg) {
  helper_job_t *job = malloc(sizeof *job);
  if (!job) return false;
  *job = (helper_job_t){.run = run, .arg = arg, .detached = true};
  mutex_lock(&helpers_lock, RANK_HELPERS);
  bool queued_it = queue_job(job);
  mutex_unlock(&helpers_lock);
  if (!queued_it) free(job);
  return queued_it;
}

/* At exit, or when the library is unloaded: kept threads leave (they run
 * the library's code). A thread still in a job is not waited for beyond a
 * moment: the process is ending under a call in flight. */
__attribute__((destructor)) static void helpers_close(void) {
  mutex_lock(&helpers_lock, RANK_HELPERS);
  atomic_store(&helpers_closing, true);
  pthread_cond_broadcast(&helpers_wake);
  uint64_t give_up = gca__now_ns() + 100000000u;
  while (helper_count > helper_busy && gca__now_ns() < give_up) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 10000000;
    if (until.tv_nsec >= 1000000000) until.tv_sec++, until.tv_nsec -= 1000000000;
    pthread_cond_timedwait(&helpers_done, &helpers_lock, &until);
  }
  mutex_unlock(&helpers_lock);
}
