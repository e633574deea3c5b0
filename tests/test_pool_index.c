/* The free index (pool.c) against a model: seeded random inserts, removals
 * and resizes of free blocks on several streams (a split: smaller, the
 * address moving up; a merge: larger, the address moving down or staying,
 * as the allocator changes keys in place), in a small and a large pool,
 * each followed by the queries the allocator makes (lower bound, the first
 * and last block of a stream, walks forwards and backwards, the first block
 * after a stream, membership), checked against a sorted array of the same
 * blocks in (stream, size, address) order. Sizes run from 512 B to 16 GiB,
 * with runs of equal sizes, so that equal sizes are ordered by address:
 * the classes of one size, those cut from powers of two, and a small
 * pool's top class, with blocks moving between them. */
#include "helpers.h"

enum { STREAMS = 3, MAX_BLOCKS = 600, OPS = 20000 };
static const gca_stream_t stream_ids[STREAMS] = {0, 7, 1u << 20};

static uint64_t rng_state;
static uint64_t next_u64(void) { return splitmix64(&rng_state); }

typedef struct model {
  pool_t *pool;
  segment_t segments[STREAMS];
  block_t blocks[MAX_BLOCKS];
  block_t *in[MAX_BLOCKS]; /* the blocks in the index, in no order */
  size_t count;
  uintptr_t next_addr;
} model_t;

/* A block size, a multiple of 512: 512 B to 4 MiB in a small pool, 1 MiB
 * to 16 GiB in a large one; a fifth of them one of eight small sizes, so
 * that many keys differ by address alone. */
static size_t random_size(bool small) {
  uint64_t r = next_u64() % 10;
  if (r < 2) return (size_t)512 * (1 + next_u64() % 8); /* a few sizes: many equal keys */
  int bits = small ? 9 + (int)(next_u64() % 13) : 20 + (int)(next_u64() % 14);
  size_t base = (size_t)1 << bits;
  return (base + (size_t)(next_u64() % base)) / 512 * 512;
}

static int compare_key(const void *pa, const void *pb) {
  const block_t *a = *(block_t *const *)pa, *b = *(block_t *const *)pb;
  if (block_stream(a) != block_stream(b)) return block_stream(a) < block_stream(b) ? -1 : 1;
  if (a->size != b->size) return a->size < b->size ? -1 : 1;
  return a->addr < b->addr ? -1 : a->addr > b->addr;
}

static void sort_model(model_t *m) { qsort(m->in, m->count, sizeof m->in[0], compare_key); }

static block_t *free_slot(model_t *m) {
  for (size_t i = 0; i < MAX_BLOCKS; i++)
    if (m->blocks[i].segment == NULL) return &m->blocks[i];
  return NULL;
}

static void insert_one(model_t *m) {
  block_t *b = free_slot(m);
  if (!b) return;
  memset(b, 0, sizeof *b);
  b->segment = &m->segments[next_u64() % STREAMS];
  b->size = random_size(m->pool->kind == GCA_POOL_SMALL);
  b->addr = m->next_addr += (uintptr_t)1 << 40; /* (never overlapping: only the order matters here) */
  b->state = BLOCK_FREE;
  gca__pool_insert(m->pool, b);
  m->in[m->count++] = b;
}

static void remove_at(model_t *m, size_t i) {
  block_t *b = m->in[i];
  gca__pool_remove(m->pool, b);
  m->in[i] = m->in[--m->count];
  b->segment = NULL;
}

static void remove_one(model_t *m) {
  if (m->count) remove_at(m, next_u64() % m->count);
}

/* A split (smaller, the address moving up) or a merge (larger, the
 * address moving down or staying). */
static void resize_one(model_t *m) {
  if (!m->count) return;
  block_t *b = m->in[next_u64() % m->count];
  size_t old = b->size;
  if (next_u64() % 2 && b->size > 512) {
    size_t cut = 512 * (1 + next_u64() % (b->size / 512 - 1));
    b->size -= cut;
    b->addr += cut;
  } else {
    size_t more = next_u64() % 4 ? 512 * (1 + next_u64() % 64) : random_size(m->pool->kind == GCA_POOL_SMALL);
    b->size += more;
    if (next_u64() % 2) b->addr -= more;
  }
  gca__pool_resized(m->pool, b, old);
}

/* The model's lower bound on (stream, size): the index of the first block
 * at or after it in sorted order. */
static size_t model_lower(const model_t *m, gca_stream_t stream, size_t size) {
  size_t i = 0;
  while (i < m->count && (block_stream(m->in[i]) < stream || (block_stream(m->in[i]) == stream && m->in[i]->size < size)))
    i++;
  return i;
}

static void check_queries(model_t *m) {
  pool_t *pool = m->pool;
  sort_model(m);
  assert_int_equal(pool->free_count, m->count);
  /* The whole order, both ways. */
  size_t i = 0;
  for (block_t *b = gca__pool_first(pool); b; b = gca__pool_next(pool, b)) {
    assert_true(i < m->count);
    assert_ptr_equal(b, m->in[i]);
    i++;
  }
  assert_int_equal(i, m->count);
  if (m->count) {
    block_t *b = m->in[m->count - 1];
    for (size_t k = m->count; k-- > 0; b = gca__pool_prev(pool, b)) assert_ptr_equal(b, m->in[k]);
    assert_null(b);
  }
  for (size_t k = 0; k < m->count; k++) assert_true(gca__pool_contains(pool, m->in[k]));
  for (int s = 0; s < STREAMS; s++) {
    gca_stream_t stream = stream_ids[s];
    /* Lower bounds at random sizes and at every block's own size. */
    for (int q = 0; q < 24; q++) {
      size_t size = q < 12 && m->count ? m->in[next_u64() % m->count]->size : random_size(pool->kind == GCA_POOL_SMALL);
      size_t at = model_lower(m, stream, size);
      block_t *want = at < m->count && block_stream(m->in[at]) == stream ? m->in[at] : NULL;
      assert_ptr_equal(gca__pool_lower_bound(pool, stream, size), want);
    }
    size_t end = model_lower(m, stream + 1, 0), first = model_lower(m, stream, 0);
    assert_ptr_equal(gca__pool_last_on_stream(pool, stream), end > first ? m->in[end - 1] : NULL);
    assert_ptr_equal(gca__pool_first_after_stream(pool, stream), end < m->count ? m->in[end] : NULL);
  }
}

static void run_pool(int kind, uint64_t seed) {
  rng_state = seed;
  model_t *m = calloc(1, sizeof *m);
  m->pool = calloc(1, sizeof *m->pool);
  assert_non_null(m->pool);
  gca__pool_init(m->pool, kind);
  for (int s = 0; s < STREAMS; s++) {
    m->segments[s].stream = stream_ids[s];
    assert_true(gca__pool_reserve(m->pool, stream_ids[s]));
  }
  m->next_addr = (uintptr_t)1 << 44;
  for (int op = 0; op < OPS; op++) {
    uint64_t r = next_u64() % 100;
    /* Grow to a few hundred blocks, then hover. */
    if (r < (m->count < 300 ? 60u : 35u)) insert_one(m);
    else if (r < 70) remove_one(m);
    else resize_one(m);
    if (op % 97 == 0) check_queries(m);
  }
  check_queries(m);
  /* The middle stream emptied: walks and searches step over it. */
  for (size_t i = m->count; i-- > 0;)
    if (block_stream(m->in[i]) == stream_ids[1]) remove_at(m, i);
  check_queries(m);
  while (m->count) remove_one(m);
  check_queries(m);
  for (int s = 0; s < STREAMS; s++) gca__pool_unreserve(m->pool, stream_ids[s]);
  assert_int_equal(m->pool->stream_count, 0);
  gca__pool_destroy(m->pool);
  free(m->pool);
  free(m);
}

static void test_small_pool_index_matches_the_model(void **state) {
  (void)state;
  run_pool(GCA_POOL_SMALL, 0x5eed0001);
}

static void test_large_pool_index_matches_the_model(void **state) {
  (void)state;
  run_pool(GCA_POOL_LARGE, 0x5eed0002);
}

/* A stream's bins come with its first segment and go with its last; the
 * streams stay in order however they come and go. */
static void test_stream_bins_follow_their_segments(void **state) {
  (void)state;
  pool_t *pool = calloc(1, sizeof *pool);
  gca__pool_init(pool, GCA_POOL_SMALL);
  enum { N = 40 };
  segment_t segs[N];
  block_t blocks[N];
  for (int i = 0; i < N; i++) {
    segs[i] = (segment_t){.stream = (gca_stream_t)(i * 919 % 1000)}; /* (N distinct streams, out of order) */
    blocks[i] = (block_t){.segment = &segs[i], .size = 4096, .addr = ((uintptr_t)i + 1) << 30, .state = BLOCK_FREE};
    assert_true(gca__pool_reserve(pool, segs[i].stream));
    gca__pool_insert(pool, &blocks[i]);
  }
  for (int i = 0; i < N; i += 2) {
    gca__pool_remove(pool, &blocks[i]);
    gca__pool_unreserve(pool, segs[i].stream);
  }
  /* The walk sees the odd blocks' streams in order. */
  gca_stream_t last = 0;
  size_t seen = 0;
  for (block_t *b = gca__pool_first(pool); b; b = gca__pool_next(pool, b), seen++) {
    assert_true(block_stream(b) >= last);
    last = block_stream(b);
  }
  assert_int_equal(seen, N / 2);
  for (int i = 1; i < N; i += 2) {
    assert_ptr_equal(gca__pool_lower_bound(pool, segs[i].stream, 512), &blocks[i]);
    assert_ptr_equal(gca__pool_last_on_stream(pool, segs[i].stream), &blocks[i]);
    gca__pool_remove(pool, &blocks[i]);
    gca__pool_unreserve(pool, segs[i].stream);
    assert_null(gca__pool_lower_bound(pool, segs[i].stream, 512));
  }
  assert_int_equal(pool->stream_count, 0);
  assert_null(gca__pool_first(pool));
  gca__pool_destroy(pool);
  free(pool);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_small_pool_index_matches_the_model),
      cmocka_unit_test(test_large_pool_index_matches_the_model),
      cmocka_unit_test(test_stream_bins_follow_their_segments),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
