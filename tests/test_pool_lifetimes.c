/* A pool's state outlives neither its allocator, its thread, nor a failed
 * resume (labels `hardening`, `pools`): a push left open at close goes
 * stale and never routes or writes, also when another allocator opens at
 * the same address; a thread that exits inside pushes undoes them, so its
 * pool can end; a push on one thread while another closes the allocator;
 * a resume that runs out of memory part way gives back what it mapped, and
 * the pool can then be freed into, released or resumed; a pause gives the
 * pool's free cache back for good, so a resume maps only live pages. */
#include <pthread.h>

#include "helpers.h"

static gca_pool_t new_pool(gca_allocator_t *a, unsigned flags) {
  gca_pool_t id = 0;
  assert_int_equal(gca_pool_create_ex(a, 0, flags, &id), GCA_OK);
  return id;
}

/* Closed with a push open, then an allocator opened at the same address
 * (tried until the host allocator hands the address out again): the
 * stale push neither routes nor is popped through. */
static void test_push_left_open_at_close(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = new_pool(a, 0);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  assert_int_equal(gca_pool_push(a, 0), GCA_OK);
  void *old = a;
  gca_close(a);
  gca_allocator_t *held[64] = {0}, *b = NULL;
  int n = 0;
  for (; n < 64; n++) {
    b = open_sim("sim", NULL);
    if ((void *)b == old) break;
    held[n] = b;
  }
  for (int i = 0; i < n; i++) gca_close(held[i]);
  if ((void *)b != old) b = open_sim("sim", NULL); /* (another address: the test of staleness all the same) */
  gca_pool_t q = new_pool(b, 0);
  void *x = gca_malloc(b, 1 * MiB, 0, 0);
  assert_non_null(x);
  assert_int_equal(pool_of(b, x), 0); /* the stale push to pool p routes nothing */
  assert_int_equal(b->devices[0].priv.routes, 0);
  assert_int_equal(gca_pool_pop(b), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "gca_pool_pop: this thread's last push was not to this allocator");
  assert_int_equal(gca_pool_push(b, q), GCA_OK);
  void *y = gca_malloc(b, 1 * MiB, 0, 0);
  assert_int_equal(pool_of(b, y), q);
  assert_int_equal(gca_pool_pop(b), GCA_OK);
  assert_int_equal(b->devices[0].priv.routes, 0);
  assert_int_equal(gca_free(b, x), GCA_OK);
  assert_int_equal(gca_free(b, y), GCA_OK);
  assert_int_equal(gca_pool_release(b, q), GCA_OK);
  assert_consistent(b);
  gca_close(b);
}

/* Stale pushes take no room: sixteen left open at close, then sixteen more. */
static void test_stale_pushes_take_no_room(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  for (int i = 0; i < 16; i++) assert_int_equal(gca_pool_push(a, 0), GCA_OK);
  assert_int_equal(gca_pool_push(a, 0), GCA_ERR_INVALID);
  gca_close(a);
  a = open_sim("sim", NULL);
  for (int i = 0; i < 16; i++) assert_int_equal(gca_pool_push(a, 0), GCA_OK);
  for (int i = 0; i < 16; i++) assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_pop(a), GCA_ERR_INVALID);
  assert_int_equal(a->devices[0].priv.routes, 0);
  gca_close(a);
}

typedef struct pusher {
  gca_allocator_t *a;
  gca_pool_t pool;
  int pushes;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  int phase; /* 1: pushed; 2: the allocator was closed; 3: popped */
  int pop_status;
} pusher_t;

static void *push_and_exit(void *arg) {
  pusher_t *t = arg;
  for (int i = 0; i < t->pushes; i++) assert_int_equal(gca_pool_push(t->a, (t->pushes - 1 - i) % 2 ? 0 : t->pool), GCA_OK);
  void *x = gca_malloc(t->a, 64 * KiB, 0, 0);
  assert_int_equal(pool_of(t->a, x), t->pool);
  assert_int_equal(gca_free(t->a, x), GCA_OK);
  return NULL; /* (inside its pushes) */
}

/* A thread that ends inside its pushes: they are undone, and its pool can end. */
static void test_thread_exits_inside_pushes(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t p = new_pool(a, 0);
  pusher_t t = {.a = a, .pool = p, .pushes = 3};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, push_and_exit, &t), 0);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_int_equal(pool_stats(a, p).routes, 0);
  assert_int_equal(a->devices[0].priv.routes, 0);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_consistent(a);
  gca_close(a);
}

static void wait_phase(pusher_t *t, int phase) {
  pthread_mutex_lock(&t->lock);
  while (t->phase < phase) pthread_cond_wait(&t->cond, &t->lock);
  pthread_mutex_unlock(&t->lock);
}

static void set_phase(pusher_t *t, int phase) {
  pthread_mutex_lock(&t->lock);
  t->phase = phase;
  pthread_cond_broadcast(&t->cond);
  pthread_mutex_unlock(&t->lock);
}

static void *push_wait_pop(void *arg) {
  pusher_t *t = arg;
  assert_int_equal(gca_pool_push(t->a, t->pool), GCA_OK);
  set_phase(t, 1);
  wait_phase(t, 2);
  t->pop_status = gca_pool_pop(t->a); /* (the allocator is closed: only compared) */
  set_phase(t, 3);
  return NULL; /* (its exit finds the push gone) */
}

/* Another thread closes the allocator while this one is inside a push. */
static void test_close_while_another_thread_pushed(void **state) {
  (void)state;
  pusher_t t = {.a = open_sim("sim", NULL), .lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
  t.pool = new_pool(t.a, 0);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, push_wait_pop, &t), 0);
  wait_phase(&t, 1);
  gca_close(t.a);
  set_phase(&t, 2);
  wait_phase(&t, 3);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_int_equal(t.pop_status, GCA_ERR_INVALID);
  /* And a thread that exits inside a push to an allocator closed meanwhile. */
  pusher_t u = {.a = open_sim("sim", NULL), .pushes = 2};
  u.pool = new_pool(u.a, 0);
  gca_allocator_t *other = open_sim("sim", NULL);
  assert_int_equal(pthread_create(&th, NULL, push_and_exit, &u), 0);
  assert_int_equal(pthread_join(th, NULL), 0);
  gca_close(u.a);
  gca_close(other);
}

/* Half a resume: 100 of 400 MiB fit; what it mapped goes back, the pool is
 * paused as before; its blocks freed, it ends; another resumes fully. */
static void test_failed_resume_rolls_back(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB", NULL);
  gca_pool_t p = new_pool(a, GCA_POOL_PAUSABLE), q = new_pool(a, GCA_POOL_PAUSABLE);
  void *x[4], *y;
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  for (int i = 0; i < 4; i++) assert_non_null(x[i] = gca_malloc(a, 100 * MiB, 0, 0));
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_push(a, q), GCA_OK);
  assert_non_null(y = gca_malloc(a, 100 * MiB, 0, 0));
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  uint64_t reserved_p = pool_stats(a, p).reserved_bytes;
  assert_int_equal(gca_pool_pause(a, p, 0, NULL), GCA_OK);
  assert_int_equal(gca_pool_pause(a, q, 0, NULL), GCA_OK);
  void *filler = gca_malloc(a, 1024 * MiB - 240 * MiB, 0, 0); /* room for about 100 of the 400 MiB */
  assert_non_null(filler);
  size_t used = sim_counters(a, 0).used;
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_ERR_OOM);
  assert_contains(gca_last_error(), "needs 400.00 MiB mapped back and stays paused");
  gca_pool_stats_t s = pool_stats(a, p);
  assert_true(s.paused);
  assert_int_equal(s.reserved_bytes, 0);
  assert_int_equal(sim_counters(a, 0).used, used); /* nothing mapped is left */
  assert_consistent(a);
  /* It pauses no further, and can be freed into and released. */
  assert_int_equal(gca_pool_pause(a, p, 0, NULL), GCA_ERR_INVALID);
  for (int i = 0; i < 4; i++) assert_int_equal(gca_free(a, x[i]), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_consistent(a);
  /* The other one resumes in full. */
  assert_int_equal(gca_pool_resume(a, q, 0), GCA_OK);
  assert_true(pool_stats(a, q).reserved_bytes >= 100 * MiB);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_free(a, filler), GCA_OK);
  assert_int_equal(gca_pool_release(a, q), GCA_OK);
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_true(reserved_p >= 400 * MiB);
  assert_consistent(a);
  gca_close(a);
}

/* A pause gives the free cache back for good: a pool that cached 300 MiB
 * beside a 10 MiB block maps back one page at the resume. */
static void test_pause_trims_the_free_cache(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=1GiB", NULL);
  gca_pool_t p = new_pool(a, GCA_POOL_PAUSABLE);
  assert_int_equal(gca_pool_push(a, p), GCA_OK);
  void *live = gca_malloc(a, 10 * MiB, 0, 0), *cached = gca_malloc(a, 300 * MiB, 0, 0);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_true(live && cached);
  assert_int_equal(gca_free(a, cached), GCA_OK);
  uint64_t reserved = pool_stats(a, p).reserved_bytes;
  assert_true(reserved >= 310 * MiB);
  size_t released = 0;
  assert_int_equal(gca_pool_pause(a, p, GCA_PAUSE_BACKUP, &released), GCA_OK);
  assert_int_equal(released, reserved);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_int_equal(gca_pool_resume(a, p, 0), GCA_OK);
  assert_int_equal(pool_stats(a, p).reserved_bytes, 20 * MiB); /* the one large page under the live block */
  assert_int_equal(sim_counters(a, 0).used, 20 * MiB);
  assert_consistent(a);
  assert_int_equal(gca_free(a, live), GCA_OK);
  assert_int_equal(gca_pool_release(a, p), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  gca_close(a);
}

/* A pool released just after a capture ends, while a block freed during
 * the capture still waits for another stream's work: the release waits
 * for that work, as PyTorch's does, and the pool ends. */
static void test_release_after_a_capture(void **state) {
  (void)state;
  const gca_stream_t s1 = (gca_stream_t)0x100, s2 = (gca_stream_t)0x200;
  gca_allocator_t *a = open_sim("sim", NULL);
  gca_pool_t g = new_pool(a, 0);
  assert_int_equal(gca_capture_begin(a, g, s1), GCA_OK);
  assert_int_equal(gca__sim_set_capture(&a->backend, 0, true), GCA_OK);
  void *x = gca_malloc(a, 4 * MiB, 0, s1);
  assert_int_equal(pool_of(a, x), g);
  assert_int_equal(gca_record_stream(a, x, s2), GCA_OK);
  assert_int_equal(gca_free(a, x), GCA_OK); /* (held until the capture ends) */
  assert_int_equal(gca__sim_set_capture(&a->backend, 0, false), GCA_OK);
  assert_int_equal(gca_capture_end(a, g, s1), GCA_OK);
  assert_int_equal(gca__sim_launch(&a->backend, 0, s2, 50000000, (uintptr_t)x, 4 * MiB), GCA_OK);
  assert_int_equal(gca_pool_release(a, g), GCA_OK);
  assert_int_equal(sim_counters(a, 0).used, 0);
  assert_int_equal(sim_counters(a, 0).capture_violations, 0);
  assert_consistent(a);
  /* A block still live is named as live, and one only pending is not. */
  g = new_pool(a, 0);
  assert_int_equal(gca_pool_push(a, g), GCA_OK);
  void *y = gca_malloc(a, 1 * MiB, 0, s1);
  assert_int_equal(gca_pool_pop(a), GCA_OK);
  assert_int_equal(gca_pool_release(a, g), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "cannot end: 1 block (1.00 MiB) of it is live");
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_pool_release(a, g), GCA_OK);
  gca_close(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_push_left_open_at_close),
      cmocka_unit_test(test_stale_pushes_take_no_room),
      cmocka_unit_test(test_thread_exits_inside_pushes),
      cmocka_unit_test(test_close_while_another_thread_pushed),
      cmocka_unit_test(test_failed_resume_rolls_back),
      cmocka_unit_test(test_pause_trims_the_free_cache),
      cmocka_unit_test(test_release_after_a_capture),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
