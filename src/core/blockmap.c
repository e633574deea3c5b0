/* The allocation map: allocated blocks by address, so gca_free finds its
 * block in O(1). A chained hash table whose chain link lives in the block
 * itself: inserting or removing never allocates, and the table doubles when
 * chains average more than one block. Growth is the only allocation; if it
 * fails the table keeps working with longer chains, so a free can never fail
 * for want of host memory.
 *
 * Why not uthash: its handle is seven words per block and its out-of-memory
 * policy is to exit the process (or, in non-fatal mode, to drop the insert),
 * neither acceptable on the allocator's hot path.
 */
#include <stdlib.h>

#include "core/core.h"

#define INITIAL_BUCKETS 256

static size_t bucket_of(uintptr_t addr, size_t bucket_count) {
  /* Addresses are multiples of 512: drop those bits, then mix (Fibonacci
   * hashing) so that consecutive blocks spread over the table. The bucket
   * is the product's top bits, the only ones every bit of the key reaches:
   * the bits from 32 up left 4 KiB blocks (keys 8 apart) in one bucket of
   * nine at 10^5 of them. */
  uint64_t h = ((uint64_t)addr >> 9) * 0x9E3779B97F4A7C15ull;
  return (size_t)(h >> (64 - __builtin_ctzll((unsigned long long)bucket_count)));
}

int gca__block_map_init(block_map_t *m) {
  m->buckets = calloc(INITIAL_BUCKETS, sizeof *m->buckets);
  m->bucket_count = INITIAL_BUCKETS;
  m->count = 0;
  return m->buckets ? GCA_OK : GCA_ERR_NOMEM;
}

void gca__block_map_destroy(block_map_t *m) {
  free(m->buckets);
  m->buckets = NULL;
  m->bucket_count = 0;
  m->count = 0;
}

GCA_COLD static void grow(block_map_t *m) {
  size_t new_count = m->bucket_count * 2;
  block_t **fresh = calloc(new_count, sizeof *fresh);
  if (!fresh) return; /* keep the old table; chains just get longer */
  for (size_t i = 0; i < m->bucket_count; i++) {
    block_t *b = m->buckets[i];
    while (b) {
      block_t *next = b->hash_next;
      size_t j = bucket_of(b->addr, new_count);
      b->hash_next = fresh[j];
      fresh[j] = b;
      b = next;
    }
  }
  free(m->buckets);
  m->buckets = fresh;
  m->bucket_count = new_count;
}

void gca__block_map_insert(block_map_t *m, block_t *b) {
  if (unlikely(m->count >= m->bucket_count)) grow(m);
  size_t i = bucket_of(b->addr, m->bucket_count);
  b->hash_next = m->buckets[i];
  m->buckets[i] = b;
  m->count++;
}

block_t *gca__block_map_find(const block_map_t *m, uintptr_t addr) {
  block_t *b = m->buckets[bucket_of(addr, m->bucket_count)];
  while (b && b->addr != addr) b = b->hash_next;
  return b;
}

block_t *gca__block_map_take(block_map_t *m, uintptr_t addr) {
  block_t **link = &m->buckets[bucket_of(addr, m->bucket_count)];
  while (*link && (*link)->addr != addr) link = &(*link)->hash_next;
  block_t *b = *link;
  if (b) {
    *link = b->hash_next;
    b->hash_next = NULL;
    m->count--;
  }
  return b;
}
