/* Sizing rules against values worked out by hand from PyTorch's round_size,
 * roundup_power2_next_division, roundup_power2_divisions (interval index)
 * and get_allocation_size. */
#include "helpers.h"

static config_t with(const char *text) {
  config_t c;
  gca__config_defaults(&c);
  assert_int_equal(gca__config_apply(&c, text, NULL), GCA_OK);
  return c;
}

static void test_round_default(void **state) {
  (void)state;
  config_t c = with("");
  assert_int_equal(gca__round_size(&c, 0), 512);
  assert_int_equal(gca__round_size(&c, 1), 512);
  assert_int_equal(gca__round_size(&c, 511), 512);
  assert_int_equal(gca__round_size(&c, 512), 512);
  assert_int_equal(gca__round_size(&c, 513), 1024);
  assert_int_equal(gca__round_size(&c, 1000), 1024);
  assert_int_equal(gca__round_size(&c, 4096), 4096);
  assert_int_equal(gca__round_size(&c, 1048576), 1048576);
  assert_int_equal(gca__round_size(&c, 1048577), 1049088);
  assert_int_equal(gca__round_size(&c, (size_t)5 << 30), (size_t)5 << 30);
}

static void test_round_overflow(void **state) {
  (void)state;
  config_t c = with("");
  assert_int_equal(gca__round_size(&c, SIZE_MAX), 0);
  assert_int_equal(gca__round_size(&c, SIZE_MAX - 510), 0);
  assert_int_equal(gca__round_size(&c, SIZE_MAX - 511), SIZE_MAX - 511); /* already a multiple of 512 */
  c = with("roundup_power2_divisions:2");
  assert_int_equal(gca__round_size(&c, SIZE_MAX), 0);
}

static void test_division_steps(void **state) {
  (void)state;
  assert_int_equal(gca__round_to_division(1200, 4), 1280); /* the reference's example */
  assert_int_equal(gca__round_to_division(1024, 4), 1024); /* powers of two stay */
  assert_int_equal(gca__round_to_division(5000, 4), 5120);
  assert_int_equal(gca__round_to_division(5120, 4), 5120);
  assert_int_equal(gca__round_to_division(3, 8), 4);       /* step 0: next power of two */
  assert_int_equal(gca__round_to_division(1048577, 8), 1179648);
}

static void test_round_single_division(void **state) {
  (void)state;
  config_t c = with("roundup_power2_divisions:4");
  for (int i = 0; i < ROUNDUP_INTERVALS; i++) assert_int_equal(c.roundup_divisions[i], 4);
  assert_int_equal(gca__round_size(&c, 1200), 1536);    /* not above 512 * 4: plain rounding */
  assert_int_equal(gca__round_size(&c, 2048), 2048);
  assert_int_equal(gca__round_size(&c, 2049), 2560);
  assert_int_equal(gca__round_size(&c, 5000), 5120);
  assert_int_equal(gca__round_size(&c, 1048577), 1310720);
  assert_int_equal(gca__round_size(&c, 3145729), 3670016);
  assert_int_equal(gca__round_size(&c, 4194304), 4194304);
}

static void test_round_division_list(void **state) {
  (void)state;
  config_t c = with("roundup_power2_divisions:[256:1,512:2,>:8]");
  for (int i = 0; i <= 8; i++) assert_int_equal(c.roundup_divisions[i], 1);
  assert_int_equal(c.roundup_divisions[9], 2);
  for (int i = 10; i < ROUNDUP_INTERVALS; i++) assert_int_equal(c.roundup_divisions[i], 8);
  assert_int_equal(gca__round_size(&c, 300 * MiB), 300 * MiB);
  assert_int_equal(gca__round_size(&c, 300 * MiB + 1), 300 * MiB + 512);
  assert_int_equal(gca__round_size(&c, 600 * MiB + 1), 768 * MiB);
  assert_int_equal(gca__round_size(&c, 1536 * MiB + 1), 1664 * MiB);
  assert_int_equal(gca__round_size(&c, MiB + 1), MiB + 512);

  c = with("roundup_power2_divisions:[64:8]"); /* first key fills the intervals below it */
  for (int i = 0; i <= 6; i++) assert_int_equal(c.roundup_divisions[i], 8);
  for (int i = 7; i < ROUNDUP_INTERVALS; i++) assert_int_equal(c.roundup_divisions[i], 0);

  c = with("roundup_power2_divisions:[>:4]");
  for (int i = 0; i < ROUNDUP_INTERVALS; i++) assert_int_equal(c.roundup_divisions[i], 4);

  c = with("roundup_power2_divisions:[1:4,2:0,>:2]");
  assert_int_equal(c.roundup_divisions[0], 4);
  assert_int_equal(c.roundup_divisions[1], 0);
  for (int i = 2; i < ROUNDUP_INTERVALS; i++) assert_int_equal(c.roundup_divisions[i], 2);

  c = with("roundup_power2_divisions:[65536:2]"); /* keys past the last interval clamp to 15 */
  for (int i = 0; i < ROUNDUP_INTERVALS; i++) assert_int_equal(c.roundup_divisions[i], 2);
}

static void test_interval_index(void **state) {
  (void)state;
  assert_int_equal(gca__roundup_interval(0), 0);
  assert_int_equal(gca__roundup_interval(1), 0);
  assert_int_equal(gca__roundup_interval(MiB - 1), 0);
  assert_int_equal(gca__roundup_interval(MiB), 0);
  assert_int_equal(gca__roundup_interval(2 * MiB - 1), 0);
  assert_int_equal(gca__roundup_interval(2 * MiB), 1);
  assert_int_equal(gca__roundup_interval(3 * MiB), 1);
  assert_int_equal(gca__roundup_interval(4 * MiB), 2);
  assert_int_equal(gca__roundup_interval((size_t)1 << 30), 10);
  assert_int_equal(gca__roundup_interval((size_t)16 << 30), 14);
  assert_int_equal(gca__roundup_interval((size_t)32 << 30), 15);
  assert_int_equal(gca__roundup_interval((size_t)64 << 30), 15);
  assert_int_equal(gca__roundup_interval(SIZE_MAX), 15);
}

static void test_segment_sizes(void **state) {
  (void)state;
  assert_int_equal(gca_segment_size(512), 2 * MiB);
  assert_int_equal(gca_segment_size(MiB), 2 * MiB);
  assert_int_equal(gca_segment_size(MiB + 512), 20 * MiB);
  assert_int_equal(gca_segment_size(10 * MiB - 512), 20 * MiB);
  assert_int_equal(gca_segment_size(10 * MiB), 10 * MiB);
  assert_int_equal(gca_segment_size(10 * MiB + 512), 12 * MiB);
  assert_int_equal(gca_segment_size(21 * MiB), 22 * MiB);
  assert_int_equal(gca_segment_size(22 * MiB), 22 * MiB);
  assert_int_equal(gca_segment_size(SIZE_MAX - 511), 0);
}

static void test_public_round_size(void **state) {
  (void)state;
  gca_allocator_t *a = open_sim("sim", "roundup_power2_divisions:4");
  assert_int_equal(gca_round_size(a, 5000), 5120);
  assert_int_equal(gca_set_config(a, "roundup_power2_divisions:1"), GCA_OK);
  assert_int_equal(gca_round_size(a, 5000), 5120); /* multiple of 512 */
  assert_int_equal(gca_round_size(a, 5121), 5632);
  assert_int_equal(gca_round_size(NULL, 1), 0);
  gca_close(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_round_default),       cmocka_unit_test(test_round_overflow),
      cmocka_unit_test(test_division_steps),      cmocka_unit_test(test_round_single_division),
      cmocka_unit_test(test_round_division_list), cmocka_unit_test(test_interval_index),
      cmocka_unit_test(test_segment_sizes),       cmocka_unit_test(test_public_round_size),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
