/* libFuzzer target for the text trace readers (label `replay`): gcalloc's
 * own trace ("# gcalloc trace"), RMM's logging_resource_adaptor CSV and the
 * allocatorSim log, told apart by their first byte as `gcalloc replay`
 * does, on arbitrary bytes; then a replay of what loads, when it is small.
 * The input goes to a memory file named by path, since the readers take a
 * path (snapshot pickles, first byte 0x80, are fuzz_pickle's). Built only
 * with clang (-fsanitize=fuzzer), with AddressSanitizer and UBSan; CTest
 * runs it for a short while from tests/fuzz/text-seeds, and any crash,
 * leak, sanitizer report or slow input fails the test. A refusal must name
 * its problem: an empty message aborts. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"
#include "export/replay.h"
#include "export/trace.h"
#include "fuzz_common.h"

static int input_fd = -1;
static char input_path[64];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size && data[0] == 0x80) return 0;
  if (input_fd < 0) {
    input_fd = memfd_create("fuzz_text", 0);
    if (input_fd < 0) abort();
    snprintf(input_path, sizeof input_path, "/proc/self/fd/%d", input_fd);
  }
  if (ftruncate(input_fd, 0) || (size && pwrite(input_fd, data, size, 0) != (ssize_t)size)) abort();
  trace_t t;
  int rc = trace_load(input_path, &t);
  if (rc != GCA_OK) {
    if (!*gca_last_error()) {
      fprintf(stderr, "refused with no message (status %d)\n", rc);
      abort();
    }
    return 0;
  }
  fuzz_replay_small(&t);
  trace_free(&t);
  return 0;
}
