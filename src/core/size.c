/* Sizing rules: how a request is rounded and how big a segment a miss asks
 * the device for. These are PyTorch's round_size, roundup_power2_divisions
 * and get_allocation_size, with overflow checks PyTorch does not make: a size
 * that cannot be rounded yields 0, which callers turn into an error.
 */
#include "core/core.h"

static int floor_log2(size_t n) { return 63 - __builtin_clzll((unsigned long long)n); }

static bool is_power_of_two(size_t n) { return n && (n & (n - 1)) == 0; }

int gca__roundup_interval(size_t size) {
  /* Intervals start at 1 MiB (2^20): sizes below fall in interval 0, sizes
   * of 32 GiB and more in interval 15. */
  int index = size ? floor_log2(size) - 20 : 0;
  if (index < 0) index = 0;
  if (index > ROUNDUP_INTERVALS - 1) index = ROUNDUP_INTERVALS - 1;
  return index;
}

/* Round up to the next of `divisions` equal steps between the powers of two
 * around `size`; a power of two stays as it is. */
size_t gca__round_to_division(size_t size, size_t divisions) {
  if (is_power_of_two(size)) return size;
  size_t floor_pow2 = (size_t)1 << floor_log2(size);
  size_t step = floor_pow2 >> floor_log2(divisions);
  if (step == 0) return floor_pow2 << 1; /* more divisions than bytes */
  size_t down = size & ~(step - 1);
  if (down == size) return size;
  if (down > SIZE_MAX - step) return 0;
  return down + step;
}

size_t gca__round_size(const config_t *cfg, size_t size) {
  if (unlikely(cfg->size_pad)) {
    if (size > SIZE_MAX - cfg->size_pad) return 0;
    size += cfg->size_pad;
  }
  if (size < MIN_BLOCK_SIZE) return MIN_BLOCK_SIZE;
  if (unlikely(cfg->any_divisions)) {
    if (cfg->page_rounding && size > SMALL_SIZE)
      return size > SIZE_MAX - (ROUND_LARGE - 1) ? 0 : (size + ROUND_LARGE - 1) & ~(ROUND_LARGE - 1);
    size_t divisions = cfg->roundup_divisions[gca__roundup_interval(size)];
    if (divisions > 1 && size > MIN_BLOCK_SIZE * divisions) return gca__round_to_division(size, divisions);
  }
  if (size > SIZE_MAX - (MIN_BLOCK_SIZE - 1)) return 0;
  return (size + MIN_BLOCK_SIZE - 1) & ~(MIN_BLOCK_SIZE - 1);
}

size_t gca__segment_size_for(size_t rounded) {
  if (rounded <= SMALL_SIZE) return SMALL_BUFFER;
  if (rounded < MIN_LARGE_ALLOC) return LARGE_BUFFER;
  if (rounded > SIZE_MAX - (ROUND_LARGE - 1)) return 0;
  return (rounded + ROUND_LARGE - 1) & ~(ROUND_LARGE - 1);
}

size_t gca_segment_size(size_t rounded_size) { return gca__segment_size_for(rounded_size); }
