/* libFuzzer target for the text trace readers (label `replay`): gcalloc's
 * own trace ("# gcalloc trace"), RMM's logging_resource_adaptor CSV and the
 * allocatorSim log, told apart by their first byte as `gcalloc replay`
 * does, on arbitrary bytes; then a replay of what loads, when it is small.
 * The input goes to a memory file named by path, since the readers take a
 * path (snapshot pickles, first byte 0x80, are fuzz_pickle's); one input in
 * 8 is also read through a pipe, and must give the same. Built only
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

#include "core/core.h"
#include "replay/replay.h"
#include "replay/trace.h"
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
  if (rc != GCA_OK && !*gca_last_error()) {
    fprintf(stderr, "refused with no message (status %d)\n", rc);
    abort();
  }
  /* For one input in 8, through a pipe too (read whole into memory first):
   * the same trace, or the same refusal. An input fits in the pipe. */
  if (size > 1 && size <= 16384 && data[size / 2] % 8 == 0) {
    char error[1024];
    snprintf(error, sizeof error, "%s", rc ? gca_last_error() : "");
    int fds[2];
    if (pipe(fds) || write(fds[1], data, size) != (ssize_t)size) abort();
    close(fds[1]);
    char path[64];
    snprintf(path, sizeof path, "/dev/fd/%d", fds[0]);
    trace_t piped;
    int piped_rc = trace_load(path, &piped);
    close(fds[0]);
    /* (Messages name the path, which differs: compared from the first ': '.) */
    const char *a = strstr(error, ": "), *b = strstr(gca_last_error(), ": ");
    if (piped_rc != rc || (rc && (!a || !b || strcmp(a, b))) || (!rc && !trace_equal(&t, &piped))) {
      fprintf(stderr, "a pipe and a file disagree: file \"%s\", pipe \"%s\"\n", error,
              piped_rc ? gca_last_error() : "");
      abort();
    }
    if (!piped_rc) trace_free(&piped);
  }
  if (rc != GCA_OK) return 0;
  fuzz_replay_small(&t);
  trace_free(&t);
  return 0;
}
