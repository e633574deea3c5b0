/* Hostile input to the readers and the tools (label `hardening`): small
 * files that would take gigabytes (a memo index near the file's length, a
 * gzip of zeros, a device that never ends), a snapshot truncated while it
 * is read, numbers that would wrap, a trace file that cannot be written,
 * options out of range, and tune's advice. Each reader runs in a child
 * process whose peak memory is measured (and, outside AddressSanitizer,
 * bounded with RLIMIT_AS, so a regression fails rather than fills the
 * host). */
#include <inttypes.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>
#include <bzlib.h>
#include <lzma.h>
#include <zstd.h>
#include <json-c/json.h>

#include "helpers.h"
#include "replay/pickle.h"
#include "replay/trace.h"


/* What a sanitizer's own memory multiplies a peak by: AddressSanitizer's
 * shadow (an eighth) and quarantine, ThreadSanitizer's shadow (several
 * times what is touched). Neither runs under RLIMIT_AS: both reserve
 * terabytes of address space. */
#define SANITIZER_FACTOR (UNDER_TSAN ? 6 : UNDER_ASAN ? 2 : 1)

/* Peak growth allowed a reader that must stop at its first step. Under
 * AddressSanitizer an allocation sized from a compressed stream's claimed
 * length costs shadow memory (an eighth of it) before a byte is written;
 * ThreadSanitizer's runtime starts its own tables. */
#define FAST_FAIL_KB (UNDER_TSAN ? 384 * 1024 : UNDER_ASAN ? 160 * 1024 : 64 * 1024)

static char dir[] = "/tmp/gcalloc_hardening_XXXXXX";

static const char *in_dir(const char *name) {
  static char path[4][512];
  static int turn;
  char *p = path[turn++ % 4];
  snprintf(p, 512, "%s/%s", dir, name);
  return p;
}

/* ---- a reader in a child, measured ---------------------------------------- */

typedef struct outcome {
  int status;
  long rss_growth_kb; /* peak resident set over the child's at the start */
  char message[1024];
  bool crashed;
} outcome_t;

static long peak_kb(void) {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

/* trace_load(path) in a child with `env` set (NAME=VALUE or NULL) and
 * `input` (when not -1) as its standard input. */
static outcome_t load_in_child_from(const char *path, const char *env, int input) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    if (input >= 0 && dup2(input, STDIN_FILENO) < 0) _exit(1);
    alarm(60);
    if (!UNDER_ASAN && !UNDER_TSAN) {
      struct rlimit lim = {(rlim_t)2 << 30, (rlim_t)2 << 30};
      setrlimit(RLIMIT_AS, &lim);
    }
    if (env) putenv((char *)env);
    outcome_t o = {0};
    long before = peak_kb();
    trace_t t;
    o.status = trace_load(path, &t);
    if (o.status == GCA_OK) trace_free(&t);
    o.rss_growth_kb = peak_kb() - before;
    snprintf(o.message, sizeof o.message, "%s", gca_last_error());
    (void)!write(fds[1], &o, sizeof o);
    _exit(0);
  }
  close(fds[1]);
  outcome_t o = {.crashed = true};
  ssize_t n = read(fds[0], &o, sizeof o);
  close(fds[0]);
  int ws = 0;
  waitpid(pid, &ws, 0);
  if (n != (ssize_t)sizeof o || !WIFEXITED(ws)) {
    o.crashed = true;
    fprintf(stderr, "reading %s: the child %s\n", path,
            WIFSIGNALED(ws) ? strsignal(WTERMSIG(ws)) : "ended without a result");
  }
  return o;
}

static outcome_t load_in_child(const char *path, const char *env) { return load_in_child_from(path, env, -1); }

static void write_file(const char *path, const void *data, size_t len) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, len, f), len);
  fclose(f);
}

static void write_gzip(const char *path, const void *head, size_t head_len, int fill, size_t fill_len) {
  gzFile g = gzopen(path, "wb9");
  assert_non_null(g);
  if (head_len) assert_int_equal(gzwrite(g, head, (unsigned)head_len), (int)head_len);
  char chunk[65536];
  memset(chunk, fill, sizeof chunk);
  for (size_t done = 0; done < fill_len; done += sizeof chunk)
    assert_int_equal(gzwrite(g, chunk, sizeof chunk), (int)sizeof chunk);
  gzclose(g);
}

/* A memo index near the file's length: refused at once, in memory about
 * the file's size (it was 16 bytes a slot up to the index). */
static void test_memo_index_past_the_stores(void **state) {
  (void)state;
  const char *path = in_dir("memo.pickle");
  const unsigned char head[] = {0x80, 0x02, 'N', 'r', 0x00, 0x00, 0xf0, 0x01, '.'}; /* LONG_BINPUT 0x1f00000 */
  write_file(path, head, sizeof head);
  assert_int_equal(truncate(path, 32 << 20), 0); /* 32 MiB, sparse */
  outcome_t o = load_in_child(path, NULL);
  assert_false(o.crashed);
  assert_int_equal(o.status, GCA_ERR_INVALID);
  assert_contains(o.message, "memo index");
  fprintf(stderr, "memo attack on 32 MiB: peak grew %ld KiB\n", o.rss_growth_kb);
  assert_true(o.rss_growth_kb < SANITIZER_FACTOR * 3 * 32 * 1024); /* the file, once, and change */
}

/* A gzip of zeros: its first decompressed byte is no trace's, and the
 * reader stops there. */
static void test_gzip_of_zeros_fails_at_once(void **state) {
  (void)state;
  const char *path = in_dir("zeros.gz");
  write_gzip(path, NULL, 0, 0, (size_t)512 << 20); /* 512 MiB of zeros, half a MiB packed */
  outcome_t o = load_in_child(path, NULL);
  assert_false(o.crashed);
  assert_int_equal(o.status, GCA_ERR_INVALID);
  assert_contains(o.message, "starts with the byte 0x00");
  fprintf(stderr, "gzip of 512 MiB of zeros: peak grew %ld KiB\n", o.rss_growth_kb);
  assert_true(o.rss_growth_kb < FAST_FAIL_KB);
}

/* A text trace whose line never ends: refused at the line limit. */
static void test_gzip_of_one_endless_line(void **state) {
  (void)state;
  const char *path = in_dir("line.gz");
  static const char head[] = "# gcalloc trace 2\n";
  write_gzip(path, head, sizeof head - 1, ' ', (size_t)512 << 20);
  outcome_t o = load_in_child(path, NULL);
  assert_false(o.crashed);
  assert_int_equal(o.status, GCA_ERR_INVALID);
  assert_contains(o.message, "line longer than");
  assert_true(o.rss_growth_kb < FAST_FAIL_KB);
}

/* A device that never ends, read as a pipe is. */
static void test_endless_device(void **state) {
  (void)state;
  outcome_t o = load_in_child("/dev/zero", NULL);
  assert_false(o.crashed);
  assert_int_equal(o.status, GCA_ERR_INVALID);
  assert_contains(o.message, "/dev/zero");
  assert_true(o.rss_growth_kb < FAST_FAIL_KB);
}

/* ---- a pipe, read as it comes ------------------------------------------ */

/* Seeded bytes that no format takes for its own: `n` from `at` of an
 * endless sequence (xorshift64). */
static void fill_garbage(unsigned char *out, size_t n, uint64_t *x) {
  for (size_t i = 0; i < n; i++) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    out[i] = (unsigned char)(*x >> 56);
  }
}

/* trace_load("/dev/stdin") in a child whose standard input is a pipe fed
 * `head`, then `garbage` bytes of fill_garbage (seed 1), by a writer that
 * stops when the reader closes its end; `written` is what it got out. */
static outcome_t load_piped(const unsigned char *head, size_t head_len, size_t garbage, const char *env,
                            size_t *written) {
  int data[2], count[2];
  assert_int_equal(pipe(data), 0);
  assert_int_equal(pipe(count), 0);
  pid_t writer = fork();
  assert_true(writer >= 0);
  if (writer == 0) {
    signal(SIGPIPE, SIG_IGN);
    close(data[0]);
    close(count[0]);
    alarm(60);
    size_t done = 0;
    static unsigned char chunk[1 << 16];
    uint64_t x = 1;
    bool open = write(data[1], head, head_len) == (ssize_t)head_len;
    for (size_t left = garbage; open && left;) {
      size_t n = left < sizeof chunk ? left : sizeof chunk;
      fill_garbage(chunk, n, &x);
      open = write(data[1], chunk, n) == (ssize_t)n;
      if (open) done += n, left -= n;
    }
    (void)!write(count[1], &done, sizeof done);
    _exit(0);
  }
  close(data[1]);
  close(count[1]);
  outcome_t o = load_in_child_from("/dev/stdin", env, data[0]);
  close(data[0]);
  *written = 0;
  assert_int_equal(read(count[0], written, sizeof *written), (ssize_t)sizeof *written);
  close(count[0]);
  int ws = 0;
  waitpid(writer, &ws, 0);
  return o;
}

/* The message after the input's name ("PATH: "). */
static const char *after_path(const char *message, const char *path) {
  size_t n = strlen(path);
  assert_true(!strncmp(message, path, n) && message[n] == ':');
  return message + n + 2;
}

/* Input that starts like a pickle or a compressed trace and goes on with
 * bytes no format writes is refused at its first such bytes, from a pipe
 * (of 1 GiB) as from a file (of 1 MiB), with the same message; the pipe's
 * reader holds no more than a reader that stops at its first step. */
static void test_piped_garbage_refused_where_its_file_is(void **state) {
  (void)state;
  static const struct {
    const char *name;
    unsigned char head[16];
    size_t head_len;
  } heads[] = {
      {"pickle", {0x80, 0x04, 0x95, 0x64, 0, 0, 0, 0, 0, 0, 0, '}', 0x94}, 13},
      {"gzip", {0x1f, 0x8b, 0x08, 0, 0, 0, 0, 0, 0, 0x03}, 10},
      {"zstd", {0x28, 0xb5, 0x2f, 0xfd}, 4},
      {"xz", {0xfd, '7', 'z', 'X', 'Z', 0}, 6},
      {"bzip2", {'B', 'Z', 'h', '9'}, 4},
  };
  const size_t file_garbage = (size_t)1 << 20, piped_garbage = (size_t)1 << 30;
  unsigned char *bytes = malloc(16 + file_garbage);
  assert_non_null(bytes);
  for (size_t i = 0; i < sizeof heads / sizeof heads[0]; i++) {
    memcpy(bytes, heads[i].head, heads[i].head_len);
    uint64_t x = 1;
    fill_garbage(bytes + heads[i].head_len, file_garbage, &x);
    const char *path = in_dir("garbage.bin");
    write_file(path, bytes, heads[i].head_len + file_garbage);
    outcome_t from_file = load_in_child(path, NULL);
    size_t written = 0;
    outcome_t piped = load_piped(heads[i].head, heads[i].head_len, piped_garbage, NULL, &written);
    fprintf(stderr, "%-6s garbage: piped %zu MiB of 1024 before the refusal, peak grew %ld KiB: %.80s\n",
            heads[i].name, written >> 20, piped.rss_growth_kb, piped.message);
    assert_false(from_file.crashed);
    assert_false(piped.crashed);
    assert_int_equal(from_file.status, GCA_ERR_INVALID);
    assert_int_equal(piped.status, GCA_ERR_INVALID);
    assert_string_equal(after_path(piped.message, "/dev/stdin"), after_path(from_file.message, path));
    assert_true(piped.rss_growth_kb < FAST_FAIL_KB);
    assert_true(written < ((size_t)64 << 20));
  }
  free(bytes);
}

/* A pickle's reader reads nothing after its STOP opcode: a snapshot in a
 * pipe that goes on past it is read as its file is, and what follows is
 * not taken in. */
static void test_piped_snapshot_ends_at_its_stop(void **state) {
  (void)state;
  size_t len;
  unsigned char *bytes = read_whole(GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle", &len);
  assert_non_null(bytes);
  trace_t expected;
  assert_int_equal(trace_load(GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle", &expected), GCA_OK);
  size_t written = 0;
  outcome_t piped = load_piped(bytes, len, (size_t)1 << 30, NULL, &written);
  fprintf(stderr, "snapshot and 1 GiB after it: %zu MiB piped, peak grew %ld KiB\n", written >> 20,
          piped.rss_growth_kb);
  assert_false(piped.crashed);
  assert_int_equal(piped.status, GCA_OK);
  assert_true(written < ((size_t)64 << 20));
  trace_free(&expected);
  free(bytes);
}

/* The guard on a piped pickle refuses nothing its reader reads: a real
 * snapshot with seeded damage (bytes changed, cut short), read whole by
 * the reader and walked by the guard in pieces; where the guard refuses,
 * the reader fails too. */
static void test_pickle_guard_refuses_only_what_the_reader_does(void **state) {
  (void)state;
  size_t len;
  unsigned char *bytes = read_whole(GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle", &len);
  assert_non_null(bytes);
  unsigned char *copy = malloc(len);
  assert_non_null(copy);
  uint64_t x = 7;
  int refused = 0, failed = 0;
  for (int round = 0; round < 400; round++) {
    memcpy(copy, bytes, len);
    unsigned char r[8];
    fill_garbage(r, sizeof r, &x);
    size_t n = len - (round % 4 == 0 ? (size_t)r[0] * r[1] % len : 0); /* (cut short, one in four) */
    for (int k = 0; k < 1 + r[2] % 4; k++) {
      fill_garbage(r, sizeof r, &x);
      copy[((size_t)r[0] << 16 | (size_t)r[1] << 8 | r[2]) % n] = r[3];
    }
    pickle_scan_t scan = {0};
    bool ok = true;
    for (size_t end = 0; ok && end < n;) {
      end = end + 1 + (end * 7919 % 65536) < n ? end + 1 + (end * 7919 % 65536) : n;
      ok = pickle_scan(&scan, copy, end);
    }
    pickle_doc_t *doc = pickle_parse(copy, n, NULL);
    if (!ok) refused++;
    if (!doc) failed++;
    if (!ok && doc) fprintf(stderr, "round %d: the guard refused what the reader read\n", round);
    assert_false(!ok && doc);
    pickle_free(doc);
  }
  fprintf(stderr, "400 damaged snapshots: the guard refused %d, the reader %d\n", refused, failed);
  assert_true(refused > 0);
  free(copy);
  free(bytes);
}

/* The cap on what is held in memory, which the user can raise. */
static void test_cap_on_decompressed_input(void **state) {
  (void)state;
  const char *path = in_dir("big.trace.gz");
  gzFile g = gzopen(path, "wb");
  assert_non_null(g);
  gzprintf(g, "# gcalloc trace 2\n1 1 open 0 sim -\n");
  for (int i = 0; i < 100000; i++)
    gzprintf(g, "%d 1 malloc 0 0 0 4096 %x\n%d 1 free 0 %x 0\n", i, 0x1000 + i, i, 0x1000 + i);
  gzclose(g);
  outcome_t o = load_in_child(path, "GCALLOC_TRACE_MAX_BYTES=1MiB");
  assert_false(o.crashed);
  assert_int_equal(o.status, GCA_ERR_INVALID);
  assert_contains(o.message, "GCALLOC_TRACE_MAX_BYTES");
  o = load_in_child(path, "GCALLOC_TRACE_MAX_BYTES=64MiB");
  assert_int_equal(o.status, GCA_OK);
  /* A cap that is not a size is refused, by name, not read as the default. */
  static const char *const bad[] = {"GCALLOC_TRACE_MAX_BYTES=12zz", "GCALLOC_TRACE_MAX_BYTES=-5",
                                    "GCALLOC_TRACE_MAX_BYTES=0", "GCALLOC_TRACE_MAX_BYTES=1e3"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    o = load_in_child(path, bad[i]);
    assert_int_equal(o.status, GCA_ERR_INVALID);
    assert_contains(o.message, bad[i]);
    assert_contains(o.message, "is not a size above 0");
  }
  o = load_in_child(path, "GCALLOC_TRACE_MAX_BYTES="); /* (empty: the default) */
  assert_int_equal(o.status, GCA_OK);
}

/* ---- compressed files made to explode ------------------------------------
 * Each payload repeats one cheap construct of its format that makes the
 * reader build something (a list popped at once, a None left on the stack,
 * a mark, a memo slot, an allocatorSim line, a gcalloc-trace malloc), after
 * incompressible padding that makes the file bigger, so that its
 * decompressed size is the most the bound on decompression lets through:
 * the worst a reader can be made to hold for a file of that size. Each is
 * written with the four compressors, each under 100 KB; reading it may
 * take at most 256 MB (under a sanitizer, SANITIZER_FACTOR times that). */

typedef enum { PACK_GZ, PACK_ZSTD, PACK_XZ, PACK_BZ2 } pack_t;
static const char *const pack_names[] = {"gz", "zst", "xz", "bz2"};

static void write_packed(const char *path, pack_t how, const unsigned char *data, size_t len) {
  size_t cap = len + len / 2 + (1 << 20);
  unsigned char *out = malloc(cap);
  assert_non_null(out);
  size_t n = 0;
  if (how == PACK_GZ) {
    z_stream z;
    memset(&z, 0, sizeof z);
    assert_int_equal(deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 9, Z_DEFAULT_STRATEGY), Z_OK);
    z.next_in = (unsigned char *)data;
    z.avail_in = (uInt)len;
    z.next_out = out;
    z.avail_out = (uInt)cap;
    assert_int_equal(deflate(&z, Z_FINISH), Z_STREAM_END);
    n = z.total_out;
    deflateEnd(&z);
  } else if (how == PACK_ZSTD) {
    n = ZSTD_compress(out, cap, data, len, 3);
    assert_false(ZSTD_isError(n));
  } else if (how == PACK_XZ) {
    assert_int_equal(lzma_easy_buffer_encode(1, LZMA_CHECK_CRC64, NULL, data, len, out, &n, cap), LZMA_OK);
  } else {
    unsigned int got = (unsigned int)cap;
    assert_int_equal(BZ2_bzBuffToBuffCompress((char *)out, &got, (char *)data, (unsigned int)len, 9, 0, 0), BZ_OK);
    n = got;
  }
  write_file(path, out, n);
  free(out);
}

/* The payload of `kind`: `pad` bytes of padding, then the construct
 * repeated to `len` bytes in all; NULL when the kind does not exist. */
static unsigned char *bomb(int kind, size_t pad, size_t len, const char **name) {
  unsigned char *b = malloc(len + 64);
  assert_non_null(b);
  uint64_t seed = 0x9e3779b97f4a7c15ull + (uint64_t)kind;
  size_t at = 0;
  if (kind <= 5) { /* pickles: PROTO 2, BINBYTES of random bytes, then the construct */
    static const char *const names[] = {"lists in a list", "Nones on the stack", "marks", "memo slots",
                                        "dicts in a list", "tuples in tuples"};
    static const char *const first[] = {"]", "", "", "N", "]", "N"}, *const again[] = {"]a", "N", "(", "\x94", "}a", "\x85"};
    *name = names[kind];
    b[at++] = 0x80, b[at++] = 2, b[at++] = 'B';
    for (int i = 0; i < 4; i++) b[at++] = (unsigned char)(pad >> (8 * i));
    for (size_t i = 0; i < pad; i++) b[at++] = (unsigned char)(next_random(&seed) >> 56);
    size_t step = strlen(again[kind]);
    memcpy(b + at, first[kind], strlen(first[kind]));
    at += strlen(first[kind]);
    while (at + step + 2 < len) memcpy(b + at, again[kind], step), at += step;
    b[at++] = 'N', b[at++] = '.';
    return b;
  }
  if (kind == 6) { /* an allocatorSim log: random lines, then the shortest ones */
    *name = "allocatorSim lines";
    while (at < pad) at += (size_t)sprintf((char *)b + at, "%u %u %u\n", (unsigned)(next_random(&seed) >> 44),
                                           (unsigned)(next_random(&seed) >> 44) | 1u << 20, (unsigned)(next_random(&seed) >> 40));
    while (at + 6 < len) memcpy(b + at, "0 0 1\n", 6), at += 6;
    b[at] = 0;
    return b;
  }
  if (kind == 7) { /* a gcalloc trace: random mallocs left live, then a malloc and free repeated */
    *name = "gcalloc-trace calls";
    at = (size_t)sprintf((char *)b, "# gcalloc trace 2\n1 1 open 0 sim -\n");
    while (at < pad)
      at += (size_t)sprintf((char *)b + at, "1 1 malloc 0 0 0 1 %" PRIx64 "\n", next_random(&seed) >> 8 | 1);
    while (at + 40 < len / 2) /* (gzip packs these lines 100 to 1 at best: half keeps it under 100 KB) */
      at += (size_t)sprintf((char *)b + at, "1 1 malloc 0 0 0 1 1\n1 1 free 0 1 0\n");
    b[at] = 0;
    return b;
  }
  free(b);
  return NULL;
}

static void test_compressed_bombs_stay_small(void **state) {
  (void)state;
  const long limit_kb = SANITIZER_FACTOR * 256 * 1000;
  const size_t pad = 48 << 10;
  /* The most decompression lets through for a file of at least `pad`
   * bytes (24 MiB and 256 bytes per compressed byte), less a margin. */
  const size_t len = ((size_t)24 << 20) + 256 * pad - ((size_t)1 << 20);
  long worst = 0;
  for (int kind = 0;; kind++) {
    const char *name;
    unsigned char *data = bomb(kind, pad, len, &name);
    if (!data) break;
    size_t n = kind <= 5 ? len : strlen((char *)data);
    for (pack_t how = PACK_GZ; how <= PACK_BZ2; how++) {
      char file[64];
      snprintf(file, sizeof file, "bomb%d.%s", kind, pack_names[how]);
      const char *path = in_dir(file);
      write_packed(path, how, data, n);
      struct stat st;
      assert_int_equal(stat(path, &st), 0);
      outcome_t o = load_in_child(path, NULL);
      fprintf(stderr, "%-22s %3s %6ld bytes -> %zu MiB: peak grew %6ld KiB: %.90s\n", name, pack_names[how],
              (long)st.st_size, n >> 20, o.rss_growth_kb, o.status ? o.message : "read");
      assert_true(st.st_size < 100 * 1000);
      assert_false(o.crashed);
      assert_true(o.rss_growth_kb < limit_kb);
      if (o.rss_growth_kb > worst) worst = o.rss_growth_kb;
      unlink(path);
    }
    free(data);
  }
  fprintf(stderr, "worst peak growth: %ld KiB\n", worst);
}

/* gcalloc traces the format does not allow: an unknown version, a 0x
 * prefix (the writer writes bare hex), two live mallocs at one pointer. */
static void test_gcalloc_trace_format_is_held(void **state) {
  (void)state;
  static const struct {
    const char *text, *message;
  } bad[] = {
      {"# gcalloc trace 3\n1 1 open 0 sim -\n", "line 1: '# gcalloc trace 3' is not the header of a gcalloc trace"},
      {"# gcalloc trace\n1 1 open 0 sim -\n", "is not the header of a gcalloc trace"},
      {"# a comment\n# gcalloc trace 2\n", "line 1: '# a comment' is not the header"},
      {"# gcalloc trace 2\n1 1 malloc 0 0 0 4096 0x1000\n", "line 2: the pointer (at most 16 hex digits) is missing"},
      {"# gcalloc trace 2\n1 1 free 0 0X1000 0\n", "line 2: the pointer (at most 16 hex digits) is missing"},
      {"# gcalloc trace 2\n1 1 malloc 0 0 0 4096 1000\n1 1 malloc 0 0 0 512 1000\n",
       "line 3: a malloc at 1000, which allocator 0 has given out already and not freed"},
  };
  const char *path = in_dir("bad.trace");
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    write_file(path, bad[i].text, strlen(bad[i].text));
    trace_t t;
    assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
    assert_contains(gca_last_error(), bad[i].message);
  }
  /* Both versions, a pointer reused after its free, and the same pointer of two allocators, are read. */
  static const char good[] = "# gcalloc trace 1\n1 1 open 0 sim -\n1 1 open 1 sim -\n1 1 malloc 0 0 0 4096 1000\n"
                             "1 1 malloc 1 0 0 4096 1000\n1 1 free 0 1000 0\n1 1 malloc 0 0 0 512 1000\n";
  write_file(path, good, sizeof good - 1);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_OK);
  assert_int_equal(t.count, 4);
  trace_free(&t);
}

/* A snapshot truncated after it was opened: the document read stays
 * readable (it used to be a mapping of the file: SIGBUS). */
static void test_snapshot_truncated_while_read(void **state) {
  (void)state;
  size_t len;
  unsigned char *bytes = read_whole(GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle", &len);
  assert_non_null(bytes);
  const char *path = in_dir("shrinking.pickle");
  write_file(path, bytes, len);
  pid_t pid = fork();
  if (pid == 0) {
    pickle_doc_t *doc = pickle_load(path, NULL);
    if (!doc) _exit(2);
    if (truncate(path, 0) != 0) _exit(3);
    pickle_doc_t *copy = pickle_parse(bytes, len, NULL);
    size_t budget = 1000000;
    bool same = copy && pv_equal(pickle_root(doc), pickle_root(copy), 0, &budget);
    pickle_free(doc);
    pickle_free(copy);
    _exit(same ? 0 : 4);
  }
  int ws = 0;
  waitpid(pid, &ws, 0);
  if (WIFSIGNALED(ws)) fprintf(stderr, "the reader was killed by %s\n", strsignal(WTERMSIG(ws)));
  assert_true(WIFEXITED(ws));
  assert_int_equal(WEXITSTATUS(ws), 0);
  free(bytes);
}

/* ---- numbers that would wrap --------------------------------------------- */

static void expect_trace_refused(const char *line, const char *field) {
  const char *path = in_dir("bad.trace");
  char text[512];
  snprintf(text, sizeof text, "# gcalloc trace 2\n1 1 open 0 sim -\n%s\n", line);
  write_file(path, text, strlen(text));
  trace_t t;
  int rc = trace_load(path, &t);
  if (rc == GCA_OK) {
    fprintf(stderr, "accepted: %s\n", line);
    trace_free(&t);
  }
  assert_int_equal(rc, GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "line 3");
  assert_contains(gca_last_error(), field);
}

static void test_trace_numbers_out_of_range(void **state) {
  (void)state;
  expect_trace_refused("5 1 malloc 0 4294967296 0 4096 1000", "the device");
  expect_trace_refused("5 1 malloc 0 256 0 4096 1000", "the device");
  expect_trace_refused("5 1 malloc 0 -1 0 4096 1000", "the device");
  expect_trace_refused("5 1 malloc 0 0 0 -18446744073709551104 1000", "the size");
  expect_trace_refused("5 1 malloc 0 0 0 18446744073709551616 1000", "the size");
  expect_trace_refused("5 1 malloc 0 0 123456789abcdef012345 4096 1000", "the stream");
  expect_trace_refused("5 1 malloc 0 0 0 4096 1000 extra", "the end of the line");
  expect_trace_refused("5 1 free 0 1000 7", "the status");
  expect_trace_refused("5 1 free 0 1000 0 2", "the pending flag");
  expect_trace_refused("5 1 malloc 2147483648 0 0 4096 1000", "the allocator id");
  expect_trace_refused("5 1 empty_cache 0 -2 0", "the device");
  expect_trace_refused("5 1 unknown_call 0", "the call");
}

static void test_config_divisions_that_would_wrap(void **state) {
  (void)state;
  gca_allocator_t *a = NULL;
  assert_int_equal(gca_open("sim", "roundup_power2_divisions:36028797018963968", &a), GCA_ERR_CONFIG); /* 2^55 */
  assert_contains(gca_last_error(), "at most 2^54");
  assert_int_equal(gca_open("sim", "roundup_power2_divisions:[256:36028797018963968]", &a), GCA_ERR_CONFIG);
  assert_contains(gca_last_error(), "at most 2^54");
  a = open_sim("sim", "roundup_power2_divisions:18014398509481984"); /* 2^54: taken, and no size wraps */
  assert_int_equal(gca_round_size(a, 3 * MiB + 1), 3 * MiB + 512);
  gca_close(a);
}

static void test_csv_line_with_a_nul(void **state) {
  (void)state;
  const char *path = in_dir("nul.csv");
  static const char text[] = "Time,Action,Pointer,Size\n1,allocate,0x1000,4096\0junk\n2,free,0x1000,4096\n";
  write_file(path, text, sizeof text - 1);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), ":2: holds a NUL character");
}

/* ---- the trace file and the tools ----------------------------------------- */

/* Run in a fresh process (the trace file is opened at a process's first
 * gca_open): writes past RLIMIT_FSIZE fail, and the failure is told. */
static int trace_write_child(void) {
  signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = {4096, 4096};
  setrlimit(RLIMIT_FSIZE, &lim);
  log_capture_t cap = {0};
  gca_set_log_handler(capture_log, &cap);
  gca_allocator_t *a = NULL;
  if (gca_open("sim", NULL, &a) != GCA_OK) return 2;
  for (int i = 0; i < 200; i++) gca_free(a, gca_malloc(a, 4096, 0, 0));
  gca_close(a);
  if (!strstr(cap.all, "a write failed")) {
    fprintf(stderr, "no warning; log: %s\n", cap.all);
    return 1;
  }
  return 0;
}

static void test_trace_file_write_failure_is_told(void **state) {
  (void)state;
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "GCALLOC_TRACE_FILE=%s %s --trace-write-child", in_dir("full.trace"), GCALLOC_SELF_PATH);
  assert_int_equal(system(cmd), 0);
  /* A file that cannot take even the header. */
  snprintf(cmd, sizeof cmd, "GCALLOC_TRACE_FILE=/dev/full %s demo --steps 1 2>%s >/dev/null", GCALLOC_TOOL_PATH,
           in_dir("full.err"));
  assert_int_equal(system(cmd), 0);
  size_t len;
  char *err = (char *)read_whole(in_dir("full.err"), &len);
  assert_non_null(err);
  assert_contains(err, "GCALLOC_TRACE_FILE=/dev/full cannot be written");
  free(err);
}

static int tool_status(const char *args) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "%s %s >%s 2>&1", GCALLOC_TOOL_PATH, args, in_dir("tool.out"));
  int ws = system(cmd);
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

static char *tool_output(void) {
  size_t len;
  char *out = (char *)read_whole(in_dir("tool.out"), &len);
  assert_non_null(out);
  return out;
}

static void test_options_out_of_range(void **state) {
  (void)state;
  assert_int_equal(tool_status("replay some.pickle --capacity 99999TiB"), 2);
  char *out = tool_output();
  assert_contains(out, "--capacity '99999TiB' is more than the most it may be");
  free(out);
  assert_int_equal(tool_status("tune some.pickle --capacity 9PiB"), 2);
  assert_int_equal(tool_status("bench --traces /nonexistent/traces"), 2);
  out = tool_output();
  assert_contains(out, "the traces folder /nonexistent/traces");
  free(out);
}

/* tune's advice on a snapshot whose best setting uses gcalloc's own keys
 * (the training sample; in the real-trace group, a real snapshot): that one
 * is shown for GCALLOC_ALLOC_CONF, and PyTorch is given the best of its own
 * keys, replayed alone, never worse than the defaults. */
static void test_tune_advice_is_never_worse_for_pytorch(void **state) {
  (void)state;
  const char *trace = real_traces_dir() ? real_path("Constructor-Sun__code_location/memory_snapshot.pickle")
                                        : GCALLOC_SAMPLES_DIR "/training/memory.pickle";
  char args[1024];
  snprintf(args, sizeof args, "tune %s", trace);
  assert_int_equal(tool_status(args), 0);
  char *text = tool_output();
  /* (the answer may use gcalloc's keys, as GCALLOC_ALLOC_CONF; a PyTorch one is always given here) */
  assert_contains(text, "PYTORCH_CUDA_ALLOC_CONF=");
  /* Whatever follows PYTORCH_CUDA_ALLOC_CONF= names PyTorch's keys only. */
  for (const char *p = strstr(text, "PYTORCH_CUDA_ALLOC_CONF="); p; p = strstr(p + 1, "PYTORCH_CUDA_ALLOC_CONF=")) {
    const char *end = strchr(p, '\n');
    char line[512];
    snprintf(line, sizeof line, "%.*s", (int)(end ? end - p : 200), p);
    assert_null(strstr(line, "stitching"));
    assert_null(strstr(line, "cross_stream_reuse"));
    assert_null(strstr(line, "per_process_memory_fraction"));
  }
  free(text);
  snprintf(args, sizeof args, "tune %s --json", trace);
  assert_int_equal(tool_status(args), 0);
  json_object *root = json_object_from_file(in_dir("tool.out"));
  assert_non_null(root);
  json_object *best, *torch_best, *defaults, *v;
  assert_true(json_object_object_get_ex(root, "best", &best));
  assert_true(json_object_object_get_ex(root, "best_pytorch", &torch_best));
  assert_true(json_object_object_get_ex(root, "defaults", &defaults));
  assert_true(json_object_object_get_ex(defaults, "peak_reserved_bytes", &v));
  int64_t default_peak = json_object_get_int64(v);
  assert_true(json_object_object_get_ex(best, "peak_reserved_bytes", &v));
  assert_true(json_object_get_int64(v) <= default_peak);
  assert_non_null(torch_best); /* on this trace, plain expandable segments save about 5% */
  assert_true(json_object_object_get_ex(torch_best, "conf", &v));
  const char *conf = json_object_get_string(v);
  assert_null(strstr(conf, "stitching"));
  assert_true(json_object_object_get_ex(torch_best, "peak_reserved_bytes", &v));
  assert_true(json_object_get_int64(v) < default_peak);
  json_object_put(root);
}

static int setup(void **state) {
  (void)state;
  return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  return system(cmd) == 0 ? 0 : -1;
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "--trace-write-child")) return trace_write_child();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_memo_index_past_the_stores),
      cmocka_unit_test(test_gzip_of_zeros_fails_at_once),
      cmocka_unit_test(test_gzip_of_one_endless_line),
      cmocka_unit_test(test_endless_device),
      cmocka_unit_test(test_piped_garbage_refused_where_its_file_is),
      cmocka_unit_test(test_piped_snapshot_ends_at_its_stop),
      cmocka_unit_test(test_pickle_guard_refuses_only_what_the_reader_does),
      cmocka_unit_test(test_cap_on_decompressed_input),
      cmocka_unit_test(test_compressed_bombs_stay_small),
      cmocka_unit_test(test_gcalloc_trace_format_is_held),
      cmocka_unit_test(test_snapshot_truncated_while_read),
      cmocka_unit_test(test_trace_numbers_out_of_range),
      cmocka_unit_test(test_config_divisions_that_would_wrap),
      cmocka_unit_test(test_csv_line_with_a_nul),
      cmocka_unit_test(test_trace_file_write_failure_is_told),
      cmocka_unit_test(test_options_out_of_range),
      cmocka_unit_test(test_tune_advice_is_never_worse_for_pytorch),
  };
  const struct CMUnitTest real[] = {cmocka_unit_test(test_tune_advice_is_never_worse_for_pytorch)};
  if (real_traces_dir()) return cmocka_run_group_tests_name("real traces", real, setup, teardown);
  return cmocka_run_group_tests(tests, setup, teardown);
}
