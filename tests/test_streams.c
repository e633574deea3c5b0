/* Stream-ordered reuse (label `streams`): the sim's model of streams and
 * events, record_stream and event-deferred frees, the order events are
 * processed in, synchronize, launch-blocking mode, deferred device frees,
 * cross-stream reuse, the statistics during and after, bad input and
 * backend failures.
 *
 * The sim is a race detector for device memory (see sim.c): every test
 * launches simulated work on the memory it is handed, and a block handed out
 * while unordered work still uses it, or a segment freed on the device under
 * queued work, shows up as a hazard. Each test ends by asserting none did.
 */
#include "helpers.h"

#define S1 ((gca_stream_t)0x100)
#define S2 ((gca_stream_t)0x200)
#define S3 ((gca_stream_t)0x300)

static const backend_t *sim_of_allocator(gca_allocator_t *a) { return &a->backend; }

/* Launch work on [p, p + size) and assert the sim saw no hazard. */
static void use(gca_allocator_t *a, void *p, size_t size, gca_stream_t stream, uint64_t ns) {
  int rc = gca__sim_launch(sim_of_allocator(a), 0, stream, ns, (uintptr_t)p, size);
  if (rc) fprintf(stderr, "%s\n", gca_last_error());
  assert_int_equal(rc, GCA_OK);
}

static void assert_no_hazards(gca_allocator_t *a) {
  assert_int_equal(sim_counters(a, 0).hazards, 0);
}

static void close_clean(gca_allocator_t *a) {
  assert_consistent(a);
  assert_no_hazards(a);
  gca_close(a);
}

/* ---- the sim's model ---------------------------------------------------- */

static void test_sim_model(void **state) {
  (void)state;
  backend_t b;
  assert_int_equal(gca__backend_open("sim", &b), GCA_OK);
  const backend_ops_t *ops = b.ops;
  uintptr_t addr;
  assert_int_equal(ops->malloc(b.state, 0, 4096, &addr), GCA_OK);

  /* Work queues per stream; time stands still until advanced. */
  assert_int_equal(gca__sim_launch(&b, 0, S1, 100, addr, 1024), GCA_OK);
  assert_int_equal(gca__sim_launch(&b, 0, S1, 50, addr, 1024), GCA_OK); /* same stream: ordered */
  assert_int_equal(gca__sim_stream_ready_at(&b, 0, S1), 150);
  assert_int_equal(gca__sim_stream_ready_at(&b, 0, S2), 0);

  uintptr_t e1, e2;
  assert_int_equal(ops->event_record(b.state, 0, S1, &e1), GCA_OK);
  assert_int_equal(ops->event_record(b.state, 0, S2, &e2), GCA_OK); /* idle stream: complete */
  assert_int_equal(ops->event_query(b.state, 0, e1), BACKEND_NOT_READY);
  assert_int_equal(ops->event_query(b.state, 0, e2), GCA_OK);
  gca__sim_advance(&b, 149);
  assert_int_equal(ops->event_query(b.state, 0, e1), BACKEND_NOT_READY);
  gca__sim_advance(&b, 1);
  assert_int_equal(ops->event_query(b.state, 0, e1), GCA_OK);

  /* Unordered use of memory still in use by another stream is a hazard... */
  assert_int_equal(gca__sim_launch(&b, 0, S1, 100, addr, 1024), GCA_OK); /* until 250 */
  assert_int_equal(gca__sim_launch(&b, 0, S2, 10, addr + 512, 16), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "hazard");
  sim_counters_t c;
  assert_int_equal(gca__sim_get_counters(&b, 0, &c), GCA_OK);
  assert_int_equal(c.hazards, 1);
  /* ...disjoint memory is not, and a stream made to wait is ordered. */
  assert_int_equal(gca__sim_launch(&b, 0, S2, 10, addr + 2048, 16), GCA_OK);
  uintptr_t e3;
  assert_int_equal(ops->event_record(b.state, 0, S1, &e3), GCA_OK);
  assert_int_equal(ops->stream_wait_event(b.state, 0, S3, e3), GCA_OK);
  assert_int_equal(gca__sim_launch(&b, 0, S3, 10, addr, 1024), GCA_OK);
  assert_int_equal(gca__sim_stream_ready_at(&b, 0, S3), 260);

  /* A device free under queued work is a hazard; waiting first is not. */
  assert_int_equal(ops->free(b.state, 0, addr, 4096), GCA_ERR_CORRUPT);
  assert_contains(gca_last_error(), "frees");
  gca__sim_advance(&b, 1000);
  assert_int_equal(ops->malloc(b.state, 0, 4096, &addr), GCA_OK);
  assert_int_equal(gca__sim_launch(&b, 0, S2, 1000, addr, 4096), GCA_OK);
  assert_int_equal(ops->stream_synchronize(b.state, 0, S2), GCA_OK);
  assert_true(gca__sim_now(&b) >= gca__sim_stream_ready_at(&b, 0, S2));
  assert_int_equal(ops->free(b.state, 0, addr, 4096), GCA_OK);

  /* Event synchronize moves time to the event; destroyed events are gone. */
  uintptr_t e4;
  assert_int_equal(gca__sim_launch(&b, 0, S1, 5000, 0, 0), GCA_OK);
  assert_int_equal(ops->event_record(b.state, 0, S1, &e4), GCA_OK);
  uint64_t due = gca__sim_stream_ready_at(&b, 0, S1);
  assert_int_equal(ops->event_synchronize(b.state, 0, e4), GCA_OK);
  assert_int_equal(gca__sim_now(&b), due);
  uintptr_t all[] = {e1, e2, e3, e4};
  for (int i = 0; i < 4; i++) ops->event_destroy(b.state, 0, all[i]);
  assert_int_equal(gca__sim_get_counters(&b, 0, &c), GCA_OK);
  assert_int_equal(c.events_live, 0);
  assert_int_equal(c.events_recorded, 4);
  assert_int_equal(c.stream_waits, 1);
  assert_int_equal(c.hazards, 2);
  assert_int_equal(ops->event_query(b.state, 0, 12345), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "not a live event");
  gca__backend_close(&b);
}

static void test_sim_stream_faults(void **state) {
  (void)state;
  backend_t b;
  assert_int_equal(gca__backend_open("sim:event_fail_at=2,wait_fail_at=1", &b), GCA_OK);
  uintptr_t e;
  assert_int_equal(b.ops->event_record(b.state, 0, S1, &e), GCA_OK);
  assert_int_equal(b.ops->event_record(b.state, 0, S1, &e), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "injected failure of event record #2");
  assert_int_equal(b.ops->stream_synchronize(b.state, 0, S1), GCA_ERR_BACKEND);
  assert_contains(gca_last_error(), "injected failure of host wait #1");
  assert_int_equal(b.ops->stream_synchronize(b.state, 0, S1), GCA_OK);
  b.ops->event_destroy(b.state, 0, e);
  gca__backend_close(&b);
  gca_allocator_t *a = NULL;
  assert_int_equal(gca_open("sim:event_fail_at=0", NULL, &a), GCA_ERR_BACKEND);
  assert_int_equal(gca_open("sim:wait_fail_at=x", NULL, &a), GCA_ERR_BACKEND);
}

/* ---- record_stream and deferred frees ---------------------------------- */

static void test_same_stream_reuse_is_immediate(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *p = gca_malloc(a, 4096, 0, S1);
  use(a, p, 4096, S1, 1000);
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* Work on S1 is still queued, but reuse on S1 is ordered after it. */
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.active[GCA_POOL_ALL].current, 0);
  assert_ptr_equal(gca_malloc(a, 4096, 0, S1), p);
  use(a, p, 4096, S1, 10);
  assert_int_equal(sim_counters(a, 0).events_recorded, 0);
  /* A use recorded on the allocation stream itself needs no event. */
  assert_int_equal(gca_record_stream(a, p, S1), GCA_OK);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(sim_counters(a, 0).events_recorded, 0);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 0);
  close_clean(a);
}

static void test_record_stream_defers_reuse(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *p = gca_malloc(a, 1000, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK); /* a set: recorded once */
  use(a, p, 1000, S2, 500);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(sim_counters(a, 0).events_recorded, 1);
  assert_consistent(a);

  /* Pending: the same request on S1 gets other memory, free of hazards. */
  void *q = gca_malloc(a, 1000, 0, S1);
  assert_ptr_not_equal(q, p);
  use(a, q, 1000, S1, 10);
  assert_int_equal(gca_free(a, q), GCA_OK);
  gca__sim_advance(sim_of_allocator(a), 499);
  void *r = gca_malloc(a, 1000, 0, S1);
  assert_ptr_not_equal(r, p);
  assert_int_equal(gca_free(a, r), GCA_OK);

  /* The moment S2's work completes, the next malloc reuses p. */
  gca__sim_advance(sim_of_allocator(a), 1);
  void *again = gca_malloc(a, 1000, 0, S1);
  assert_ptr_equal(again, p);
  use(a, again, 1000, S1, 10);
  assert_int_equal(sim_counters(a, 0).events_live, 0);
  assert_int_equal(gca_free(a, again), GCA_OK);
  close_clean(a);
}

/* Statistics through a deferred free, worked out by hand from PyTorch's
 * rules: allocation drops at the free, active when the free completes, and
 * active's peak counts the pending block alongside a new allocation. */
static void test_statistics_during_and_after(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  const int ALL = GCA_POOL_ALL, SMALL = GCA_POOL_SMALL;
  void *p = gca_malloc(a, 1000, 0, S1); /* 1024 bytes of a 2 MiB segment */
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  use(a, p, 1000, S2, 100);
  assert_int_equal(gca_free(a, p), GCA_OK);

  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.allocation[ALL].current, 0);
  assert_int_equal(s.allocation[ALL].freed, 1);
  assert_int_equal(s.allocated_bytes[SMALL].current, 0);
  assert_int_equal(s.active[ALL].current, 1);
  assert_int_equal(s.active[SMALL].current, 1);
  assert_int_equal(s.active[ALL].freed, 0);
  assert_int_equal(s.active_bytes[ALL].current, 1024);
  assert_int_equal(s.requested_bytes[ALL].current, 1000);
  assert_int_equal(s.inactive_split[ALL].current, 1); /* the remainder only */
  assert_int_equal(s.inactive_split_bytes[ALL].current, 2 * MiB - 1024);

  void *q = gca_malloc(a, 1000, 0, S1); /* from the remainder, p is pending */
  s = stats_of(a, 0);
  assert_int_equal(s.allocation[ALL].current, 1);
  assert_int_equal(s.allocation[ALL].peak, 1);
  assert_int_equal(s.allocation[ALL].allocated, 2);
  assert_int_equal(s.active[ALL].current, 2);
  assert_int_equal(s.active[ALL].peak, 2);
  assert_int_equal(s.active[SMALL].peak, 2);
  assert_int_equal(s.active[ALL].allocated, 2);
  assert_int_equal(s.active_bytes[ALL].peak, 2048);
  assert_int_equal(s.requested_bytes[ALL].current, 2000);
  assert_int_equal(s.inactive_split_bytes[ALL].current, 2 * MiB - 2048);

  gca__sim_advance(sim_of_allocator(a), 100);
  assert_int_equal(gca_process_events(a, 0), GCA_OK);
  s = stats_of(a, 0);
  assert_int_equal(s.active[ALL].current, 1);
  assert_int_equal(s.active[ALL].freed, 1);
  assert_int_equal(s.active[ALL].peak, 2);
  assert_int_equal(s.active_bytes[ALL].current, 1024);
  assert_int_equal(s.active_bytes[ALL].freed, 1024);
  assert_int_equal(s.requested_bytes[ALL].current, 1000);
  assert_int_equal(s.requested_bytes[ALL].freed, 1000);
  /* p's block is back and free: the segment is q plus one free piece. */
  assert_int_equal(s.inactive_split[ALL].current, 2);
  assert_int_equal(s.inactive_split_bytes[ALL].current, 2 * MiB - 1024);

  assert_int_equal(gca_free(a, q), GCA_OK);
  s = stats_of(a, 0);
  assert_int_equal(s.active[ALL].current, 0);
  assert_int_equal(s.active[ALL].freed, 2);
  assert_int_equal(s.allocation[ALL].freed, 2);
  assert_int_equal(s.inactive_split[ALL].current, 0);

  /* Resets: peaks come down to current, totals to zero, pending included. */
  void *t = gca_malloc(a, 1000, 0, S1);
  assert_int_equal(gca_record_stream(a, t, S2), GCA_OK);
  use(a, t, 1000, S2, 100);
  assert_int_equal(gca_free(a, t), GCA_OK);
  assert_int_equal(gca_reset_peak_stats(a, 0), GCA_OK);
  assert_int_equal(gca_reset_accumulated_stats(a, 0), GCA_OK);
  s = stats_of(a, 0);
  assert_int_equal(s.active[ALL].current, 1);
  assert_int_equal(s.active[ALL].peak, 1);
  assert_int_equal(s.allocation[ALL].peak, 0);
  assert_int_equal(s.active[ALL].allocated, 0);
  assert_int_equal(s.active[ALL].freed, 0);
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  s = stats_of(a, 0);
  assert_int_equal(s.active[ALL].current, 0);
  assert_int_equal(s.active[ALL].freed, 1);
  assert_int_equal(s.active[ALL].peak, 1);
  close_clean(a);
}

/* ---- event processing order -------------------------------------------- */

static void test_event_processing_order(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  const backend_t *sim = sim_of_allocator(a);
  /* x waits for slow S2, y for quick S3, z for both. */
  void *x = gca_malloc(a, 4096, 0, S1), *y = gca_malloc(a, 4096, 0, S1), *z = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, x, S2), GCA_OK);
  assert_int_equal(gca_record_stream(a, y, S3), GCA_OK);
  assert_int_equal(gca_record_stream(a, z, S2), GCA_OK);
  assert_int_equal(gca_record_stream(a, z, S3), GCA_OK);
  use(a, x, 4096, S2, 1000);
  use(a, y, 4096, S3, 10);
  use(a, z, 2048, S2, 10);                      /* S2: x's work then z's, done at 1010 */
  use(a, (char *)z + 2048, 2048, S3, 10);       /* S3: y's then z's, done at 20 */
  assert_int_equal(gca_free(a, x), GCA_OK);
  assert_int_equal(gca_free(a, y), GCA_OK);
  assert_int_equal(gca_free(a, z), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 3);

  /* S3 done: y completes; z still waits for S2. A slow stream does not
   * hold up another's queue. */
  gca__sim_advance(sim, 20);
  assert_int_equal(gca_process_events(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 2);
  assert_int_equal(a->devices[0].ev.pending_events, 2);
  assert_consistent(a);
  /* y is reusable now (lowest-address fit of its size on S1). */
  void *y2 = gca_malloc(a, 4096, 0, S1);
  assert_ptr_equal(y2, y);

  /* S2 done at 1010: x and z complete in their queue's order. */
  gca__sim_advance(sim, 990);
  assert_int_equal(gca_process_events(a, -1), GCA_OK);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 1);
  assert_int_equal(a->devices[0].ev.pending_events, 0);
  assert_int_equal(sim_counters(a, 0).events_live, 0);
  assert_int_equal(gca_free(a, y2), GCA_OK);
  close_clean(a);
}

/* ---- synchronize and launch-blocking ----------------------------------- */

static void test_synchronize_drains_everything(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:devices=2", NULL);
  const backend_t *sim = sim_of_allocator(a);
  gca_stream_t streams[] = {S1, S2, S3};
  void *p[12];
  for (int i = 0; i < 12; i++) {
    p[i] = gca_malloc(a, (size_t)(i + 1) * 300 * KiB, 0, S1);
    gca_stream_t other = streams[1 + i % 2];
    assert_int_equal(gca_record_stream(a, p[i], other), GCA_OK);
    use(a, p[i], 1024, other, (uint64_t)(i + 1) * 1000);
  }
  for (int i = 0; i < 12; i++) assert_int_equal(gca_free(a, p[i]), GCA_OK);
  int64_t syncs = stats_of(a, 0).num_sync_all_streams;
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 12);
  assert_int_equal(gca_synchronize(a, -1), GCA_OK);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.active[GCA_POOL_ALL].current, 0);
  assert_int_equal(s.active_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(s.num_sync_all_streams, syncs + 1);
  assert_int_equal(a->devices[0].ev.pending_events, 0);
  assert_int_equal(sim_counters(a, 0).events_live, 0);
  /* The host waited until the last of that work. */
  assert_true(gca__sim_now(sim) >= gca__sim_stream_ready_at(sim, 0, S2));
  assert_true(gca__sim_now(sim) >= gca__sim_stream_ready_at(sim, 0, S3));
  assert_int_equal(gca_synchronize(a, 2), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "device 2 does not exist");
  close_clean(a);
}

static gca_allocator_t *open_with_env(const char *gcalloc, const char *cuda, const char *acl) {
  const char *names[] = {"GCALLOC_LAUNCH_BLOCKING", "CUDA_LAUNCH_BLOCKING", "ASCEND_LAUNCH_BLOCKING"};
  const char *values[] = {gcalloc, cuda, acl};
  for (int i = 0; i < 3; i++) {
    if (values[i]) setenv(names[i], values[i], 1);
    else unsetenv(names[i]);
  }
  gca_allocator_t *a = open_sim("sim", NULL);
  for (int i = 0; i < 3; i++) unsetenv(names[i]);
  return a;
}

static int launch_blocking_of(const char *gcalloc, const char *cuda, const char *acl) {
  gca_allocator_t *a = open_with_env(gcalloc, cuda, acl);
  int on = gca_launch_blocking(a);
  gca_close(a);
  return on;
}

/* PYTORCH_NO_CUDA_MEMORY_CACHING (PYTORCH_NO_NPU_MEMORY_CACHING on acl, not
 * read elsewhere): set and not "0", every free gives back what nothing
 * still uses, after the streams that used it. */
static void test_no_caching_variables(void **state) {
  (void)state;
  const char *values[] = {NULL, "1", "0", "yes"};
  const int expect[] = {0, 1, 0, 1};
  for (int i = 0; i < 4; i++) {
    if (values[i]) setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", values[i], 1);
    setenv("PYTORCH_NO_NPU_MEMORY_CACHING", "1", 1); /* (an NPU's variable: not read on the sim) */
    gca_allocator_t *a = open_sim("sim", NULL);
    unsetenv("PYTORCH_NO_CUDA_MEMORY_CACHING");
    unsetenv("PYTORCH_NO_NPU_MEMORY_CACHING");
    assert_int_equal(gca_no_caching(a), expect[i]);
    void *p = gca_malloc(a, 3 * MiB, 0, S1), *q = gca_malloc(a, 1000, 0, S1);
    assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
    assert_int_equal(gca_free(a, p), GCA_OK);
    gca_stats_t st;
    assert_int_equal(gca_get_stats(a, 0, &st), GCA_OK);
    /* Off: both segments cached. On: only q's, which q still uses. */
    assert_int_equal(st.reserved_bytes[GCA_POOL_ALL].current, expect[i] ? 2 * MiB : 22 * MiB);
    assert_int_equal(gca_free(a, q), GCA_OK);
    assert_int_equal(gca_get_stats(a, 0, &st), GCA_OK);
    assert_int_equal(st.reserved_bytes[GCA_POOL_ALL].current, expect[i] ? 0 : 22 * MiB);
    assert_int_equal(gca_no_caching(NULL), GCA_ERR_INVALID);
    close_clean(a);
  }
}

static void test_launch_blocking_variables(void **state) {
  (void)state;
  assert_int_equal(launch_blocking_of(NULL, NULL, NULL), 0);
  assert_int_equal(launch_blocking_of("1", NULL, NULL), 1);
  assert_int_equal(launch_blocking_of(NULL, "1", NULL), 1);
  assert_int_equal(launch_blocking_of(NULL, NULL, "1"), 1);
  assert_int_equal(launch_blocking_of("0", "1", NULL), 0); /* the first set decides */
  assert_int_equal(launch_blocking_of(NULL, "0", "1"), 0);
  assert_int_equal(launch_blocking_of("true", NULL, NULL), 1);
  log_capture_t log = {0};
  gca_set_log_handler(capture_log, &log);
  assert_int_equal(launch_blocking_of("maybe", NULL, NULL), 0);
  gca_set_log_handler(NULL, NULL);
  assert_contains(log.all, "GCALLOC_LAUNCH_BLOCKING=maybe is not 1 or 0");
  assert_int_equal(gca_launch_blocking(NULL), GCA_ERR_INVALID);
}

static void test_launch_blocking_frees_complete_at_once(void **state) {
  (void)state;
  gca_allocator_t *a = open_with_env(NULL, "1", NULL);
  const backend_t *sim = sim_of_allocator(a);
  void *p = gca_malloc(a, 8 * MiB, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  use(a, p, 8 * MiB, S2, 777);
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* Complete before gca_free returned: the host waited for S2. */
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.active[GCA_POOL_ALL].current, 0);
  assert_int_equal(s.active_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(gca__sim_now(sim), 777);
  assert_int_equal(a->devices[0].ev.pending_events, 0);
  assert_int_equal(sim_counters(a, 0).events_live, 0);
  /* The block is reusable right away, on S2's work being done. */
  assert_ptr_equal(gca_malloc(a, 8 * MiB, 0, S1), p);
  use(a, p, 8 * MiB, S1, 1);
  close_clean(a);
}

/* ---- deferred device frees --------------------------------------------- */

static void test_device_free_waits_for_the_stream(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  const backend_t *sim = sim_of_allocator(a);
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  use(a, p, 30 * MiB, S1, 5000);
  assert_int_equal(gca_free(a, p), GCA_OK); /* cached for S1 at once */
  assert_int_equal(gca__sim_now(sim), 0);
  /* empty_cache gives the segment back, but only once S1 is done with it. */
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(gca__sim_now(sim), 5000);
  assert_int_equal(sim_counters(a, 0).frees, 1);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 0);
  assert_int_equal(sim_counters(a, 0).events_live, 0);
  close_clean(a);
}

/* A release that does not wait: the segment stays reserved (RELEASING)
 * until its stream is done, and a later malloc or process_events finishes
 * it. (The garbage collector releases this way.) */
static void test_release_without_waiting(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  const backend_t *sim = sim_of_allocator(a);
  device_t *d = &a->devices[0];
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  use(a, p, 30 * MiB, S1, 5000);
  assert_int_equal(gca_free(a, p), GCA_OK);
  lock_acquire(&d->lock);
  gca__segment_release(d, gca__pool_first(&d->large_pool));
  lock_release(&d->lock);
  assert_int_equal(d->ev.releasing_count, 1);
  assert_int_equal(sim_counters(a, 0).frees, 0);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_ALL].current, 30 * MiB);
  assert_consistent(a);
  assert_int_equal(gca_process_events(a, 0), GCA_OK); /* not yet */
  assert_int_equal(d->ev.releasing_count, 1);
  gca__sim_advance(sim, 5000);
  void *q = gca_malloc(a, 4096, 0, S1); /* malloc finishes it */
  assert_int_equal(d->ev.releasing_count, 0);
  assert_int_equal(sim_counters(a, 0).frees, 1);
  assert_int_equal(stats_of(a, 0).reserved_bytes[GCA_POOL_LARGE].current, 0);
  assert_int_equal(stats_of(a, 0).num_device_free, 1);
  assert_int_equal(gca_free(a, q), GCA_OK);
  close_clean(a);
}

/* A full device: the retry path waits for pending frees and for the
 * streams of the segments it gives back, never freeing under queued work. */
static void test_out_of_memory_path_waits(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=100MiB", NULL);
  const backend_t *sim = sim_of_allocator(a);
  void *p = gca_malloc(a, 60 * MiB, 0, S1);
  use(a, p, 60 * MiB, S1, 3000);
  /* The usual pattern: S2 uses p after S1 produced it. */
  assert_int_equal(order_streams(sim, S1, S2), GCA_OK);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  use(a, p, 60 * MiB, S2, 4000); /* 3000 .. 7000 */
  assert_int_equal(gca_free(a, p), GCA_OK); /* pending on S2 */
  void *q = gca_malloc(a, 60 * MiB, 0, S3);   /* needs p's memory */
  assert_non_null(q);
  assert_ptr_equal(q, p); /* the sim reuses the address it got back */
  assert_int_equal(gca__sim_now(sim), 7000);
  use(a, q, 60 * MiB, S3, 10);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_alloc_retries, 1);
  assert_int_equal(s.num_sync_all_streams, 1);
  assert_int_equal(s.num_ooms, 0);
  assert_int_equal(gca_free(a, q), GCA_OK);
  close_clean(a);
}

/* After the sync, a pending block that just came back is found in the cache
 * (PyTorch would ask the device again and could fail). */
static void test_out_of_memory_path_finds_completed_free(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:capacity=40MiB", NULL);
  /* One 20 MiB segment: keep (4 MiB), p (2 MiB), keep2 (the other 14). */
  void *keep = gca_malloc(a, 4 * MiB, 0, S1);
  void *p = gca_malloc(a, 2 * MiB, 0, S1);
  void *keep2 = gca_malloc(a, 14 * MiB, 0, S1);
  assert_int_equal(stats_of(a, 0).segment[GCA_POOL_ALL].current, 1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  use(a, p, 2 * MiB, S2, 100);
  assert_int_equal(gca_free(a, p), GCA_OK);
  void *big = gca_malloc(a, 20 * MiB, 0, S1); /* the other 20 MiB: the device is full */
  assert_non_null(big);
  void *q = gca_malloc(a, 2 * MiB, 0, S1); /* only p's piece can serve it, once complete */
  assert_non_null(q);
  assert_ptr_equal(q, p);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_ooms, 0);
  assert_int_equal(s.num_alloc_retries, 0);
  assert_int_equal(s.num_sync_all_streams, 1);
  gca_free(a, q);
  gca_free(a, big);
  gca_free(a, keep);
  gca_free(a, keep2);
  close_clean(a);
}

/* ---- cross-stream reuse ------------------------------------------------ */

static void test_cross_stream_reuse_off_by_default(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  assert_int_equal(gca_free(a, p), GCA_OK);
  void *q = gca_malloc(a, 30 * MiB, 0, S2); /* PyTorch: cached per stream */
  assert_ptr_not_equal(q, p);
  assert_int_equal(stats_of(a, 0).num_device_alloc, 2);
  assert_int_equal(stats_of(a, 0).num_cross_stream_reuses, 0);
  gca_free(a, q);
  char conf[512];
  assert_true(gca_get_config(a, conf, sizeof conf) > 0);
  assert_contains(conf, "cross_stream_reuse:False");
  close_clean(a);
}

static void test_cross_stream_reuse_whole_segment(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "cross_stream_reuse:True");
  const backend_t *sim = sim_of_allocator(a);
  void *p = gca_malloc(a, 30 * MiB, 0, S1);
  use(a, p, 30 * MiB, S1, 2000);
  assert_int_equal(gca_free(a, p), GCA_OK);
  void *q = gca_malloc(a, 30 * MiB, 0, S2);
  assert_ptr_equal(q, p);
  /* S2 now waits for S1's work: using q on S2 is ordered, not a hazard. */
  assert_int_equal(sim_counters(a, 0).stream_waits, 1);
  assert_true(gca__sim_stream_ready_at(sim, 0, S2) >= 2000);
  use(a, q, 30 * MiB, S2, 10);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_cross_stream_reuses, 1);
  assert_int_equal(s.num_device_alloc, 1);
  /* The segment moved to S2: freed there, it serves S2 without waiting. */
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_ptr_equal(gca_malloc(a, 30 * MiB, 0, S2), q);
  assert_int_equal(gca_free(a, q), GCA_OK);
  assert_int_equal(stats_of(a, 0).num_cross_stream_reuses, 1);
  assert_int_equal(sim_counters(a, 0).events_live, 0);
  /* Turned off, S1 no longer takes S2's cached segment. */
  assert_int_equal(gca_set_config(a, "cross_stream_reuse:False"), GCA_OK);
  void *r = gca_malloc(a, 30 * MiB, 0, S1);
  assert_ptr_not_equal(r, q);
  assert_int_equal(stats_of(a, 0).num_device_alloc, 2);
  close_clean(a);
}

/* Pieces of another stream's split segment are not taken: that was
 * measured to fragment both streams' segments (docs/benchmarks.md). */
static void test_cross_stream_reuse_leaves_split_segments(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "cross_stream_reuse:True");
  void *live = gca_malloc(a, 4 * MiB, 0, S1); /* a 20 MiB segment of S1, split */
  void *q = gca_malloc(a, 8 * MiB, 0, S2);    /* 16 MiB free in S1's segment: not taken */
  assert_ptr_not_equal((char *)q, (char *)live + 4 * MiB);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.num_cross_stream_reuses, 0);
  assert_int_equal(s.num_device_alloc, 2);
  gca_free(a, q);
  gca_free(a, live);
  close_clean(a);
}

/* Among other streams' segments that fit, one whose stream is idle wins
 * (no wait), even over a smaller one on a busy stream; a busy stream's
 * segment is taken only with a wait. */
static void test_cross_stream_reuse_prefers_idle_streams(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "cross_stream_reuse:True");
  const backend_t *sim = sim_of_allocator(a);
  void *busy = gca_malloc(a, 30 * MiB, 0, S1);
  void *idle = gca_malloc(a, 40 * MiB, 0, S3);
  use(a, busy, 30 * MiB, S1, 9000);
  use(a, idle, 40 * MiB, S3, 10);
  gca__sim_advance(sim, 10);
  gca_free(a, busy);
  gca_free(a, idle);
  void *q = gca_malloc(a, 30 * MiB, 0, S2);
  assert_ptr_equal(q, idle);
  assert_int_equal(sim_counters(a, 0).stream_waits, 0);
  use(a, q, 30 * MiB, S2, 5);
  void *r = gca_malloc(a, 30 * MiB, 0, S2); /* only S1's busy segment is left */
  assert_ptr_equal(r, busy);
  assert_int_equal(sim_counters(a, 0).stream_waits, 1);
  assert_true(gca__sim_stream_ready_at(sim, 0, S2) >= 9000);
  use(a, r, 30 * MiB, S2, 5);
  assert_int_equal(stats_of(a, 0).num_cross_stream_reuses, 2);
  assert_int_equal(stats_of(a, 0).num_device_alloc, 2);
  gca_free(a, q);
  gca_free(a, r);
  close_clean(a);
}

/* With a ratio, a segment much larger than the device would be asked for
 * stays with its stream (moving it would split it); one within the ratio
 * moves. */
static void test_cross_stream_reuse_ratio(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "cross_stream_reuse:1.5");
  void *big = gca_malloc(a, 100 * MiB, 0, S1);
  gca_free(a, big);
  void *q = gca_malloc(a, 60 * MiB, 0, S2); /* a fresh one would be 60 MiB: 100 > 1.5 x 60 */
  assert_ptr_not_equal(q, big);
  assert_int_equal(stats_of(a, 0).num_cross_stream_reuses, 0);
  void *r = gca_malloc(a, 70 * MiB, 0, S3); /* 100 <= 1.5 x 70: moves */
  assert_ptr_equal(r, big);
  assert_int_equal(stats_of(a, 0).num_cross_stream_reuses, 1);
  gca_free(a, q);
  gca_free(a, r);
  close_clean(a);
}

/* ---- bad input and backend failures ------------------------------------- */

static void test_bad_stream_input(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", NULL);
  char *p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(NULL, p, S2), GCA_ERR_INVALID);
  assert_int_equal(gca_record_stream(a, NULL, S2), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "pointer is NULL");
  assert_int_equal(gca_record_stream(a, p + 512, S2), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "cannot record a stream use of");
  assert_contains(gca_last_error(), "inside the allocation");
  assert_int_equal(gca_record_stream(a, (void *)0x1234, S2), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "not allocated by this allocator");
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  use(a, p, 4096, S2, 100);
  assert_int_equal(gca_free(a, p), GCA_OK);
  /* Freed and pending: a second free or a use is refused, nothing changes. */
  assert_int_equal(gca_free(a, p), GCA_ERR_BAD_POINTER);
  assert_contains(gca_last_error(), "freed already");
  assert_int_equal(gca_record_stream(a, p, S3), GCA_ERR_BAD_POINTER);
  assert_int_equal(gca_process_events(NULL, 0), GCA_ERR_INVALID);
  assert_int_equal(gca_process_events(a, 5), GCA_ERR_INVALID);
  assert_int_equal(gca_synchronize(NULL, -1), GCA_ERR_INVALID);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 1);
  close_clean(a);
}

/* The event record fails: the free waits for the stream instead. */
static void test_event_failure_falls_back_to_waiting(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:event_fail_at=1", NULL);
  const backend_t *sim = sim_of_allocator(a);
  void *p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  use(a, p, 4096, S2, 250);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(gca__sim_now(sim), 250);
  assert_int_equal(stats_of(a, 0).active[GCA_POOL_ALL].current, 0);
  assert_int_equal(a->devices[0].ev.errors, 1);
  assert_ptr_equal(gca_malloc(a, 4096, 0, S1), p);
  close_clean(a);
}

/* Neither the event nor the wait works: the block is quarantined, never
 * reused, still counted as active, and given back at close. */
static void test_quarantine_when_nothing_works(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim:event_fail_at=1,wait_fail_at=1", NULL);
  void *p = gca_malloc(a, 4096, 0, S1);
  assert_int_equal(gca_record_stream(a, p, S2), GCA_OK);
  use(a, p, 4096, S2, 250);
  assert_int_equal(gca_free(a, p), GCA_OK);
  assert_int_equal(a->devices[0].ev.quarantined_blocks, 1);
  gca_stats_t s = stats_of(a, 0);
  assert_int_equal(s.active[GCA_POOL_ALL].current, 1);
  assert_int_equal(s.allocation[GCA_POOL_ALL].current, 0);
  assert_consistent(a);
  assert_int_equal(gca_synchronize(a, 0), GCA_OK);
  for (int i = 0; i < 8; i++) {
    void *q = gca_malloc(a, 4096, 0, S1);
    assert_ptr_not_equal(q, p);
    use(a, q, 4096, S1, 1);
  }
  assert_int_equal(gca_empty_cache(a, 0), GCA_OK);
  assert_int_equal(stats_of(a, 0).segment[GCA_POOL_ALL].current, 1); /* p's segment stays */
  close_clean(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sim_model),
      cmocka_unit_test(test_sim_stream_faults),
      cmocka_unit_test(test_same_stream_reuse_is_immediate),
      cmocka_unit_test(test_record_stream_defers_reuse),
      cmocka_unit_test(test_statistics_during_and_after),
      cmocka_unit_test(test_event_processing_order),
      cmocka_unit_test(test_synchronize_drains_everything),
      cmocka_unit_test(test_launch_blocking_variables),
      cmocka_unit_test(test_no_caching_variables),
      cmocka_unit_test(test_launch_blocking_frees_complete_at_once),
      cmocka_unit_test(test_device_free_waits_for_the_stream),
      cmocka_unit_test(test_release_without_waiting),
      cmocka_unit_test(test_out_of_memory_path_waits),
      cmocka_unit_test(test_out_of_memory_path_finds_completed_free),
      cmocka_unit_test(test_cross_stream_reuse_off_by_default),
      cmocka_unit_test(test_cross_stream_reuse_whole_segment),
      cmocka_unit_test(test_cross_stream_reuse_leaves_split_segments),
      cmocka_unit_test(test_cross_stream_reuse_prefers_idle_streams),
      cmocka_unit_test(test_cross_stream_reuse_ratio),
      cmocka_unit_test(test_bad_stream_input),
      cmocka_unit_test(test_event_failure_falls_back_to_waiting),
      cmocka_unit_test(test_quarantine_when_nothing_works),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
