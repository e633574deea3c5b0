/* libFuzzer target for compressed traces (label `hardening`): the
 * decompressing path of trace_load and the readers behind it. The first
 * byte picks a compressor (gzip, zstd, xz, bzip2) and a mode: either the
 * rest is a trace (a pickle or a text format) compressed here, so that the
 * readers see fuzzed content through each decoder; or the rest follows the
 * compressor's magic bytes as they are, so that the decoders see damaged
 * data. Built only with clang (-fsanitize=fuzzer), with AddressSanitizer and
 * UBSan; CTest runs it for a short while from tests/fuzz/seeds and
 * tests/fuzz/text-seeds with a 512 MB limit on the process's memory (a
 * reading's bound is 96 MiB plus 1,024 bytes per compressed byte), and any
 * crash, leak, sanitizer report, slow input or refusal without a message
 * fails the test. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <bzlib.h>
#include <lzma.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include "core/core.h"
#include "replay/trace.h"
#include "fuzz_common.h"

static int input_fd = -1;
static char input_path[64];

/* data compressed by `how` into a buffer from malloc; NULL if it failed. */
static unsigned char *pack(int how, const uint8_t *data, size_t size, size_t *out_len) {
  size_t cap = size + size / 2 + 4096;
  unsigned char *out = malloc(cap);
  if (!out) return NULL;
  size_t n = 0;
  bool ok = false;
  if (how == 0) {
    z_stream z;
    memset(&z, 0, sizeof z);
    if (deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK) {
      z.next_in = (unsigned char *)data;
      z.avail_in = (uInt)size;
      z.next_out = out;
      z.avail_out = (uInt)cap;
      ok = deflate(&z, Z_FINISH) == Z_STREAM_END;
      n = z.total_out;
      deflateEnd(&z);
    }
  } else if (how == 1) {
    n = ZSTD_compress(out, cap, data, size, 1);
    ok = !ZSTD_isError(n);
  } else if (how == 2) {
    ok = lzma_easy_buffer_encode(0, LZMA_CHECK_CRC32, NULL, data, size, out, &n, cap) == LZMA_OK;
  } else {
    unsigned int got = (unsigned int)cap;
    ok = BZ2_bzBuffToBuffCompress((char *)out, &got, (char *)data, (unsigned int)size, 1, 0, 0) == BZ_OK;
    n = got;
  }
  if (!ok) {
    free(out);
    return NULL;
  }
  *out_len = n;
  return out;
}

static const struct {
  const char *bytes;
  size_t len;
} magic[] = {{"\x1f\x8b", 2}, {"\x28\xb5\x2f\xfd", 4}, {"\xfd" "7zXZ\0", 6}, {"BZh", 3}};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > (1 << 20)) return 0;
  int how = data[0] & 3;
  bool raw = data[0] & 4;
  if (input_fd < 0) {
    input_fd = memfd_create("fuzz_packed", 0);
    if (input_fd < 0) abort();
    snprintf(input_path, sizeof input_path, "/proc/self/fd/%d", input_fd);
  }
  unsigned char *file;
  size_t len = 0;
  if (raw) { /* the compressor's magic, then the rest as it is */
    len = magic[how].len + size - 1;
    if (!(file = malloc(len))) return 0;
    memcpy(file, magic[how].bytes, magic[how].len);
    memcpy(file + magic[how].len, data + 1, size - 1);
  } else if (!(file = pack(how, data + 1, size - 1, &len))) {
    return 0;
  }
  if (ftruncate(input_fd, 0) || (len && pwrite(input_fd, file, len, 0) != (ssize_t)len)) abort();
  free(file);
  trace_t t;
  int rc = trace_load(input_path, &t);
  if (rc != GCA_OK && !*gca_last_error()) {
    fprintf(stderr, "refused with no message (status %d)\n", rc);
    abort();
  }
  if (rc != GCA_OK) return 0;
  fuzz_replay_small(&t);
  trace_free(&t);
  return 0;
}
