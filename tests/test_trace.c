/* The plain-data pickle reader and the trace readers: small pickles written
 * by Python (pickle.dumps, protocols 2 and 4), every truncation of them,
 * refusal of object-building opcodes, and the sample snapshots
 * (data/snapshots) with their counts. The reader's loop for flat dicts, and
 * the snapshot entries it hands over as they are read, are checked against
 * the general machine alone: the same tree, trace or error on a small
 * snapshot written by Python (data/snapshot_small.pickle), on the samples,
 * and on thousands of seeded mutations of them. With GCALLOC_REAL_TRACES
 * (CTest's test_trace_real_traces, registered where ../shared/traces is),
 * the real-trace group: the same on the real PyTorch snapshots, and the
 * counts SOURCES.txt gives. */
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>
#include <bzlib.h>
#include <lzma.h>
#include <zlib.h>
#include <zstd.h>

#include "helpers.h"
#include "replay/pickle.h"
#include "replay/trace.h"
#include "replay/util.h"

/* The samples' allocations (trace_to_ops). */
#define TRAINING_ALLOCS 3774
#define INFERENCE_ALLOCS 1868
#define CNN_ALLOCS 2762

/* pickle.dumps({'a':1,'b':[2,3.25,True,None,-70000,2**40,'x'],'c':{'n':-1},'t':(1,2)}, protocol=4) */
static const unsigned char dict_p4[] =
    "\x80\x04\x95\x4b\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x01\x61\x94\x4b\x01\x8c\x01\x62\x94\x5d\x94"
    "\x28\x4b\x02\x47\x40\x0a\x00\x00\x00\x00\x00\x00\x88\x4e\x4a\x90\xee\xfe\xff\x8a\x06\x00\x00\x00\x00\x00"
    "\x01\x8c\x01\x78\x94\x65\x8c\x01\x63\x94\x7d\x94\x8c\x01\x6e\x94\x4a\xff\xff\xff\xff\x73\x8c\x01\x74\x94"
    "\x4b\x01\x4b\x02\x86\x94\x75\x2e";
/* pickle.dumps([{'k':'v'}]*3, protocol=2): the memo shares one dict */
static const unsigned char shared_p2[] =
    "\x80\x02\x5d\x71\x00\x28\x7d\x71\x01\x58\x01\x00\x00\x00\x6b\x71\x02\x58\x01\x00\x00\x00\x76\x71\x03\x73"
    "\x68\x01\x68\x01\x65\x2e";

static void test_pickle_values(void **state) {
  (void)state;
  pickle_doc_t *doc = pickle_parse(dict_p4, sizeof dict_p4 - 1, NULL);
  assert_non_null(doc);
  const pv_t *root = pickle_root(doc);
  assert_int_equal(root->kind, PV_DICT);
  assert_int_equal(pv_len(root), 4);
  assert_int_equal(pv_get(root, "a")->u.i, 1);
  const pv_t *b = pv_get(root, "b");
  assert_int_equal(pv_len(b), 7);
  assert_int_equal(pv_at(b, 0)->u.i, 2);
  assert_true(pv_at(b, 1)->kind == PV_FLOAT && pv_at(b, 1)->u.f == 3.25);
  assert_true(pv_at(b, 2)->kind == PV_BOOL && pv_at(b, 2)->u.i == 1);
  assert_int_equal(pv_at(b, 3)->kind, PV_NONE);
  assert_int_equal(pv_at(b, 4)->u.i, -70000);
  assert_int_equal(pv_at(b, 5)->u.i, (int64_t)1 << 40);
  assert_true(pv_str_eq(pv_at(b, 6), "x"));
  assert_int_equal(pv_get(pv_get(root, "c"), "n")->u.i, -1);
  assert_int_equal(pv_len(pv_get(root, "t")), 2);
  assert_null(pv_get(root, "missing"));
  assert_null(pv_at(b, 7));
  pickle_free(doc);

  doc = pickle_parse(shared_p2, sizeof shared_p2 - 1, NULL);
  assert_non_null(doc);
  root = pickle_root(doc);
  assert_int_equal(pv_len(root), 3);
  assert_ptr_equal(pv_at(root, 0)->u.seq, pv_at(root, 2)->u.seq); /* one dict, shared by the memo */
  assert_true(pv_str_eq(pv_get(pv_at(root, 1), "k"), "v"));
  pickle_free(doc);
}

/* Every kind of value stored in the memo and read back through it, ints
 * at and past 60 bits and a string past 1 MiB among them (the bounds of
 * an 8-byte memo cell, tried once and not kept): a
 * list read by the machine, and a dict read by the flat loop, each
 * followed by references to all it stored. */
static size_t put_long1(unsigned char *p, int64_t v) {
  p[0] = 0x8a;
  p[1] = 8;
  for (int i = 0; i < 8; i++) p[2 + i] = (unsigned char)((uint64_t)v >> (8 * i));
  return 10;
}

static void test_pickle_memo_values(void **state) {
  (void)state;
  const int64_t ints[] = {0, -1, ((int64_t)1 << 59) - 1, -((int64_t)1 << 59), (int64_t)1 << 59,
                          -((int64_t)1 << 59) - 1, INT64_MAX, INT64_MIN};
  const size_t nints = sizeof ints / sizeof *ints, long_len = (size_t)2 << 20; /* past a cell's 1 MiB */
  unsigned char *p = malloc(long_len + 4096), *at = p;
  assert_non_null(p);
  /* [ints..., 3.25, True, False, None, 'hi', b'by', the long string, [], {}, references to each] */
  at += sprintf((char *)at, "\x80\x04]\x94(");
  for (size_t i = 0; i < nints; i++) {
    at += put_long1(at, ints[i]);
    *at++ = 0x94;
  }
  static const unsigned char scalars[] = "G\x40\x0a\x00\x00\x00\x00\x00\x00\x94\x88\x94\x89\x94N\x94"
                                         "\x8c\x02hi\x94" "C\x02" "by\x94";
  memcpy(at, scalars, sizeof scalars - 1);
  at += sizeof scalars - 1;
  *at++ = 'X';
  for (int i = 0; i < 4; i++) *at++ = (unsigned char)(long_len >> (8 * i));
  memset(at, 'z', long_len);
  at += long_len;
  at += sprintf((char *)at, "\x94]\x94}\x94");
  const size_t stored = nints + 9; /* values, in slots 1 to 17 (the outer list is slot 0) */
  for (size_t i = 1; i <= stored; i++) at += sprintf((char *)at, "h%c", (char)i);
  /* {'k': int, 'l': long string, 's': 'hi'} read by the flat loop, its
   * values stored, then referenced. */
  at += sprintf((char *)at, "}\x94(\x8c\x01k\x94");
  at += put_long1(at, INT64_MIN + 5);
  *at++ = 0x94;
  at += sprintf((char *)at, "\x8c\x01l\x94h%c\x8c\x01s\x94h%c", (char)(nints + 7), (char)(nints + 5));
  *at++ = 'u';
  at += sprintf((char *)at, "h%ch%ce.", (char)(stored + 3), (char)(stored + 2));
  size_t len = (size_t)(at - p);
  for (int pruned = 0; pruned < 2; pruned++) {
    pickle_options_t o = {.pruned_key = pruned ? "frames" : NULL};
    pickle_doc_t *doc = pickle_parse(p, len, &o);
    if (!doc) fprintf(stderr, "%s\n", gca_last_error());
    assert_non_null(doc);
    const pv_t *root = pickle_root(doc);
    assert_int_equal(pv_len(root), 2 * stored + 3);
    for (size_t i = 0; i < nints; i++) {
      assert_int_equal(pv_at(root, i)->u.i, ints[i]);
      assert_true(pv_at(root, stored + i)->kind == PV_INT && pv_at(root, stored + i)->u.i == ints[i]);
    }
    for (size_t i = 0; i < stored; i++) {
      size_t budget = 100;
      assert_true(pv_equal(pv_at(root, i), pv_at(root, stored + i), 0, &budget));
    }
    const pv_t *f = pv_at(root, stored + nints);
    assert_true(f->kind == PV_FLOAT && f->u.f == 3.25);
    assert_true(pv_at(root, stored + nints + 1)->kind == PV_BOOL && pv_at(root, stored + nints + 1)->u.i == 1);
    assert_true(pv_at(root, stored + nints + 2)->kind == PV_BOOL && pv_at(root, stored + nints + 2)->u.i == 0);
    assert_int_equal(pv_at(root, stored + nints + 3)->kind, PV_NONE);
    assert_true(pv_str_eq(pv_at(root, stored + nints + 4), "hi"));
    const pv_t *bytes = pv_at(root, stored + nints + 5);
    assert_true(bytes->kind == PV_BYTES && bytes->len == 2 && !memcmp(bytes->u.data, "by", 2));
    const pv_t *l = pv_at(root, stored + nints + 6);
    assert_true(l->kind == PV_STR && l->len == long_len && l->u.data[0] == 'z' && l->u.data[long_len - 1] == 'z');
    assert_ptr_equal(pv_at(root, nints + 7)->u.seq, pv_at(root, stored + nints + 7)->u.seq);
    assert_int_equal(pv_at(root, stored + nints + 8)->kind, PV_DICT);
    const pv_t *d = pv_at(root, 2 * stored);
    assert_int_equal(pv_get(d, "k")->u.i, INT64_MIN + 5);
    assert_int_equal(pv_get(d, "l")->len, long_len);
    assert_true(pv_str_eq(pv_get(d, "s"), "hi"));
    assert_int_equal(pv_at(root, 2 * stored + 1)->u.i, INT64_MIN + 5);
    assert_true(pv_at(root, 2 * stored + 2)->kind == PV_STR && pv_at(root, 2 * stored + 2)->len == 1);
    pickle_free(doc);
  }
  free(p);
}

/* v='value'; fr={'k':v}; pickle.dumps({'frames':[fr,fr,{'k':'w'}],'keep':[1,{'frames':[3,fr]},fr],
 * 'after':v}, protocol=4): 'value' is first stored inside the frames and used outside them. */
static const unsigned char pruned_p4[] =
    "\x80\x04\x95\x52\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x06\x66\x72\x61\x6d\x65\x73\x94\x5d\x94"
    "\x28\x7d\x94\x8c\x01\x6b\x94\x8c\x05\x76\x61\x6c\x75\x65\x94\x73\x68\x03\x7d\x94\x68\x04\x8c\x01"
    "\x77\x94\x73\x65\x8c\x04\x6b\x65\x65\x70\x94\x5d\x94\x28\x4b\x01\x7d\x94\x68\x01\x5d\x94\x28\x4b"
    "\x03\x68\x03\x65\x73\x68\x03\x65\x8c\x05\x61\x66\x74\x65\x72\x94\x68\x05\x75\x2e";

static void test_pickle_pruned(void **state) {
  (void)state;
  pickle_doc_t *whole = pickle_parse(pruned_p4, sizeof pruned_p4 - 1, NULL);
  pickle_options_t frames = {.pruned_key = "frames"};
  pickle_doc_t *pruned = pickle_parse(pruned_p4, sizeof pruned_p4 - 1, &frames);
  assert_non_null(whole);
  assert_non_null(pruned);
  const pv_t *w = pickle_root(whole), *p = pickle_root(pruned);
  assert_int_equal(pv_len(pv_get(w, "frames")), 3);
  assert_int_equal(pv_len(pv_get(p, "frames")), 0);
  assert_int_equal(pv_get(p, "frames")->kind, PV_LIST);
  /* What is not under the key is kept, memo values stored inside it included. */
  assert_true(pv_str_eq(pv_get(p, "after"), "value"));
  const pv_t *keep = pv_get(p, "keep");
  assert_int_equal(pv_len(keep), 3);
  assert_int_equal(pv_at(keep, 0)->u.i, 1);
  assert_int_equal(pv_len(pv_get(pv_at(keep, 1), "frames")), 0);
  assert_int_equal(pv_len(pv_get(pv_at(pv_get(w, "keep"), 1), "frames")), 2);
  /* A container built inside the pruned one stays empty wherever the memo
   * shares it; unpruned, it has its pair. */
  assert_int_equal(pv_at(keep, 2)->kind, PV_DICT);
  assert_int_equal(pv_len(pv_at(keep, 2)), 0);
  assert_true(pv_str_eq(pv_get(pv_at(pv_get(w, "keep"), 2), "k"), "value"));
  pickle_free(whole);
  pickle_free(pruned);
  /* The skipped runs of memo references still check their indices. */
  unsigned char bad[sizeof pruned_p4];
  memcpy(bad, pruned_p4, sizeof bad);
  bad[42] = 0x60; /* the BINGET at offset 41 now names index 0x60 */
  assert_null(pickle_parse(bad, sizeof bad - 1, &frames));
  assert_contains(gca_last_error(), "memo index 96");
}

/* A pruned list holding a run of a million memo references that does not
 * end in APPENDS (here a None follows it): each reference is pushed, and
 * the run is scanned once, not once from each of its references (which took
 * hours). The general machine reads it: the root is a list, not a dict. */
static void test_pickle_long_reference_run(void **state) {
  (void)state;
  const size_t refs = 1000000;
  static const char head[] = "\x80\x04]\x94(\x8c\x06" "frames]("; /* [ 'frames', [ ... */
  size_t len = sizeof head - 1 + 2 * refs + 4;
  unsigned char *data = malloc(len);
  assert_non_null(data);
  memcpy(data, head, sizeof head - 1);
  for (size_t i = 0; i < refs; i++) memcpy(data + sizeof head - 1 + 2 * i, "h\x00", 2);
  memcpy(data + len - 4, "Nee.", 4);
  pickle_options_t frames = {.pruned_key = "frames"};
  pickle_doc_t *doc = pickle_parse(data, len, &frames);
  assert_non_null(doc);
  assert_int_equal(pv_len(pickle_root(doc)), 2);
  assert_int_equal(pv_len(pv_at(pickle_root(doc), 1)), 0);
  pickle_free(doc);
  free(data);
}

static void test_pickle_truncations_fail_cleanly(void **state) {
  (void)state;
  for (size_t n = 0; n + 1 < sizeof dict_p4 - 1; n++) {
    pickle_doc_t *doc = pickle_parse(dict_p4, n, NULL);
    assert_null(doc);
    assert_int_equal(gca_last_status(), GCA_ERR_INVALID);
    assert_contains(gca_last_error(), "pickle:");
  }
}

static void test_pickle_refuses_objects(void **state) {
  (void)state;
  static const unsigned char evil[] = "\x80\x02\x63os\nsystem\n\x58\x02\x00\x00\x00ls\x85R.";
  assert_null(pickle_parse(evil, sizeof evil - 1, NULL));
  assert_contains(gca_last_error(), "build a Python object");
  static const unsigned char unknown_op[] = "\x80\x02\x01.";
  assert_null(pickle_parse(unknown_op, sizeof unknown_op - 1, NULL));
  assert_contains(gca_last_error(), "unsupported opcode 0x01");
  static const unsigned char bad_memo[] = "\x80\x02h\x05.";
  assert_null(pickle_parse(bad_memo, sizeof bad_memo - 1, NULL));
  assert_contains(gca_last_error(), "memo index 5");
  /* A store past the memo's count leaves a hole below it: a get there is
   * refused, whatever the memory under the memo held before (the memo is
   * not zeroed; the memory it will be given is filled first). */
  static const unsigned char memo_hole[] = "\x80\x02](Nq\x03h\x01" "e.";
  static const unsigned char memo_past_hole[] = "\x80\x02](Nq\x03h\x03" "e.";
  for (int round = 0; round < 2; round++) {
    void *dirty = malloc(64 * sizeof(pv_t));
    assert_non_null(dirty);
    memset(dirty, round ? 0x01 : 0xff, 64 * sizeof(pv_t));
    free(dirty);
    assert_null(pickle_parse(memo_hole, sizeof memo_hole - 1, NULL));
    assert_contains(gca_last_error(), "memo index 1 used before it was stored");
  }
  pickle_doc_t *stored = pickle_parse(memo_past_hole, sizeof memo_past_hole - 1, NULL);
  assert_non_null(stored);
  assert_int_equal(pv_len(pickle_root(stored)), 2);
  assert_int_equal(pv_at(pickle_root(stored), 1)->kind, PV_NONE);
  pickle_free(stored);
  static const unsigned char two_values[] = "\x80\x02K\x01K\x02.";
  assert_null(pickle_parse(two_values, sizeof two_values - 1, NULL));
  /* Found by the fuzzer (tests/fuzz_pickle.c): an empty tuple before
   * anything was pushed, an empty APPENDS, and a trace entry that is a list. */
  static const unsigned char empty_tuple[] = "\x80\x02(t.";
  pickle_doc_t *doc = pickle_parse(empty_tuple, sizeof empty_tuple - 1, NULL);
  assert_non_null(doc);
  assert_int_equal(pickle_root(doc)->kind, PV_LIST);
  assert_int_equal(pv_len(pickle_root(doc)), 0);
  pickle_free(doc);
  static const unsigned char empty_appends[] = "\x80\x02](e.";
  assert_non_null(doc = pickle_parse(empty_appends, sizeof empty_appends - 1, NULL));
  pickle_free(doc);
  /* {'device_traces': [[[1]]]} */
  static const unsigned char list_entry[] =
      "\x80\x02\x7d\x71\x00\x58\x0d\x00\x00\x00\x64\x65\x76\x69\x63\x65\x5f\x74\x72\x61\x63\x65\x73\x71\x01"
      "\x5d\x71\x02\x5d\x71\x03\x5d\x71\x04\x4b\x01\x61\x61\x61\x73\x2e";
  trace_t t;
  assert_int_equal(trace_parse_snapshot("list-entry", list_entry, sizeof list_entry - 1, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "list-entry: device 0 trace entry 0 is not a dict");
  /* A memo index past the stores that can come before it is refused
   * before any memory is sized by it. */
  static const unsigned char far_memo[] = "\x80\x02Nr\xff\xff\xff\x7f.";
  assert_null(pickle_parse(far_memo, sizeof far_memo - 1, NULL));
  assert_contains(gca_last_error(), "larger than the stores that can come before it");
  assert_null(pickle_load("/nonexistent/file.pickle", NULL));
  assert_int_equal(gca_last_status(), GCA_ERR_IO);
}

static void expect_trace(const char *file, size_t events, int devices, size_t allocs, bool starts_empty) {
  trace_t t;
  int rc = trace_load(file, &t);
  if (rc) fprintf(stderr, "%s\n", gca_last_error());
  assert_int_equal(rc, GCA_OK);
  assert_int_equal(t.count, events);
  assert_int_equal(t.device_count, devices);
  trace_ops_t o;
  assert_int_equal(trace_to_ops(&t, &o), GCA_OK);
  assert_int_equal(o.allocs, allocs);
  assert_int_equal(o.slot_count, allocs);
  if (starts_empty) assert_int_equal(o.skipped_frees, 0);
  /* every free refers to an earlier allocation of the same slot */
  char *seen = calloc(o.slot_count + 1, 1);
  for (size_t i = 0; i < o.count; i++) {
    if (o.ops[i].is_free) {
      assert_int_equal(seen[o.ops[i].slot], 1);
      seen[o.ops[i].slot] = 2;
    } else {
      assert_int_equal(seen[o.ops[i].slot], 0);
      seen[o.ops[i].slot] = 1;
    }
  }
  free(seen);
  trace_ops_free(&o);
  trace_free(&t);
}

/* The samples' counts (data/README.md). */
static void test_sample_snapshots(void **state) {
  (void)state;
  expect_trace(GCALLOC_SAMPLES_DIR "/training/memory.pickle", 11128, 1, TRAINING_ALLOCS, true);
  expect_trace(GCALLOC_SAMPLES_DIR "/inference/memory.pickle", 5016, 1, INFERENCE_ALLOCS, true);
  expect_trace(GCALLOC_SAMPLES_DIR "/cnn/memory.pickle", 8091, 1, CNN_ALLOCS, true);
}

/* The real traces' counts, as SOURCES.txt gives them. */
static void test_real_traces(void **state) {
  (void)state;
  expect_trace(real_path("ZidongLiu__DeComFL/memory.pickle"), 23105, 1, 7946, true);
  expect_trace(real_path("cranberrii__ftcourse/memory_snapshot.pickle"), 10307, 1, 3505, false);
  expect_trace(real_path("Constructor-Sun__code_location/memory_snapshot.pickle"), 6445 + 596 + 882, 4,
               3025, true);
  expect_trace(real_path("Lin-Mao__allocatorSim/alexnet_train.log"), 386, 1, 193, true);
}

static void test_bad_text_trace(void **state) {
  (void)state;
  char path[] = "gcalloc-scratch-trace-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  FILE *f = fdopen(fd, "w");
  fputs("0 3 100\n1 0 200\n", f);
  fclose(f);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), ":2:");
  assert_null(t.events);
  /* Each field is digits only, and nothing follows the third but blanks. */
  static const char *const bad_lines[] = {
      "-1 3 100\n", "0 -3 100\n", "0 3 +100\n", "0 3\n", "0 3 100 7\n", "0 3 100x\n", "0 3 0x10\n",
      "0 3 18446744073709551616\n", /* 2^64 */
  };
  for (size_t i = 0; i < sizeof bad_lines / sizeof *bad_lines; i++) {
    f = fopen(path, "w");
    fprintf(f, "0 1 64\n%s", bad_lines[i]);
    fclose(f);
    assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
    assert_contains(gca_last_error(), ":2:");
  }
  /* Tabs, CRLF and the largest size are fine. */
  f = fopen(path, "w");
  fputs("0\t2 18446744073709551615\r\n1 2  512 \n", f);
  fclose(f);
  assert_int_equal(trace_load(path, &t), GCA_OK);
  assert_int_equal(t.count, 4);
  assert_int_equal(t.events[0].size, UINT64_MAX);
  trace_free(&t);
  f = fopen(path, "w");
  static const char not_snapshot[] = "\x80\x02}q\x00."; /* a pickle, but not a snapshot */
  fwrite(not_snapshot, 1, sizeof not_snapshot - 1, f);
  fclose(f);
  assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "device_traces");
  remove(path);
  assert_int_equal(trace_load("/nonexistent/trace.log", &t), GCA_ERR_IO);
  assert_contains(gca_last_error(), "cannot open trace /nonexistent/trace.log: No such file or directory");
  assert_int_equal(trace_load("/tmp", &t), GCA_ERR_IO);
  assert_contains(gca_last_error(), "cannot read trace /tmp: it is a directory");
}

/* ---- the flat-dict loop against the general machine ------------------- */

/* Both readers give the same tree, or both refuse with the same message. */
static void expect_same_parse(const unsigned char *data, size_t len, const char *pruned_key, size_t budget) {
  pickle_options_t machine = {.pruned_key = pruned_key, .machine_only = true}, flat = {.pruned_key = pruned_key};
  pickle_doc_t *slow = pickle_parse(data, len, &machine);
  char slow_error[1024];
  snprintf(slow_error, sizeof slow_error, "%s", slow ? "" : gca_last_error());
  pickle_doc_t *fast = pickle_parse(data, len, &flat);
  if (!slow || !fast) {
    if (fast || slow) fprintf(stderr, "only one reader refused: %s\n", slow ? gca_last_error() : slow_error);
    assert_true(!slow && !fast);
    assert_string_equal(gca_last_error(), slow_error);
    return;
  }
  assert_true(pv_equal(pickle_root(slow), pickle_root(fast), 0, &budget));
  pickle_free(slow);
  pickle_free(fast);
}

/* Writes one memo reference: BINGET below 256, else LONG_BINGET. */
static size_t put_ref(unsigned char *out, uint32_t index) {
  if (index < 256) {
    out[0] = 'h';
    out[1] = (unsigned char)index;
    return 2;
  }
  out[0] = 'j';
  memcpy(out + 1, &index, 4); /* (little-endian host) */
  return 5;
}

/* Runs of memo references seen before (pickle.c, "runs seen before") are
 * recognised by their bytes rather than decoded: the same tree and the
 * same errors as the machine alone, on frames lists built to meet every
 * case: a run repeated (guessed as the one after the run before, or by its
 * first 64 bytes, among runs sharing them), a known run followed by more references (not taken as
 * known: it must end where the run here ends), one sharing only its first
 * 64 bytes, short ones, fresh ones, one at the very end of the file, and
 * a reference not yet stored inside a run otherwise known. */
static void test_pickle_runs_seen_before(void **state) {
  (void)state;
  uint64_t seed = 0x7e9ea7;
  size_t cap = 4 << 20;
  unsigned char *data = malloc(cap);
  assert_non_null(data);
  uint32_t base[6][60];
  size_t base_len[6];
  for (int round = 0; round < 40; round++) {
    size_t n = 0;
    memcpy(data, "\x80\x04]\x94(", 5);
    n = 5;
    uint32_t stored = 1; /* the outer list */
    memcpy(data + n, "\x8c\x06" "frames\x94", 9);
    n += 9;
    uint32_t frames_key = stored++;
    for (int i = 0; i < 400; i++) { /* strings to refer to: indices up to 400 */
      n += (size_t)sprintf((char *)data + n, "\x8c\x03s%02d", i % 100);
      data[n++] = 0x94;
      stored++;
    }
    for (int b = 0; b < 6; b++) {
      base_len[b] = 10 + next_random(&seed) % 50;
      for (size_t k = 0; k < base_len[b]; k++) base[b][k] = 2 + (uint32_t)(next_random(&seed) % (stored - 2));
      /* Runs 3 to 5 share run 2's first 32 references (its first 64 bytes
       * and more), as stacks share their innermost frames: found among the
       * ways of one head, moved to its front, evicted by the fresh runs of
       * that head. */
      for (size_t k = 0; b >= 3 && k < 32 && k < base_len[b] && k < base_len[2]; k++) base[b][k] = base[2][k];
      base[b][base_len[b] - 1] = 256 + (uint32_t)(next_random(&seed) % (stored - 256)); /* a LONG_BINGET last */
    }
    int entries = 150 + (int)(next_random(&seed) % 100);
    bool unstored_at_end = round % 4 == 3, at_file_end = round % 5 == 4;
    for (int e = 0; e < entries; e++) {
      /* {'frames': [run]} */
      data[n++] = '}';
      data[n++] = 0x94;
      stored++;
      data[n++] = '(';
      n += put_ref(data + n, frames_key);
      data[n++] = ']';
      data[n++] = 0x94;
      stored++;
      data[n++] = '(';
      int b = (int)(next_random(&seed) % 6), kind = (int)(next_random(&seed) % 8);
      bool unstored = unstored_at_end && e == entries - 1;
      if (unstored_at_end && e >= entries - 3) { /* b, b, then b but for one reference: guessed as b */
        b = 0;
        kind = 0;
      }
      size_t count = base_len[b];
      for (size_t k = 0; k < count; k++) {
        uint32_t index = base[b][k];
        if (kind == 5 && k >= 32) index = 2 + (uint32_t)(next_random(&seed) % (stored - 2)); /* same head only */
        if (kind == 6) index = 2 + (uint32_t)(next_random(&seed) % (stored - 2));             /* fresh */
        /* A known run but for its last reference, not stored yet and of the
         * same width: the bytes differ only there. */
        if (unstored && k == count - 1) index = stored + 7;
        n += put_ref(data + n, index);
      }
      if (kind == 4) /* a known run with more after it */
        for (int k = 0; k < 5; k++) n += put_ref(data + n, 2 + (uint32_t)(next_random(&seed) % (stored - 2)));
      data[n++] = 'e'; /* APPENDS */
      data[n++] = 'u'; /* SETITEMS */
      assert_true(n + 4096 < cap);
    }
    data[n++] = 'e';
    data[n++] = '.';
    /* The file may also end right after a run: truncated there, both
     * readers must refuse it with the same message. */
    size_t len = at_file_end ? n - 4 : n;
    expect_same_parse(data, len, "frames", 1000000);
  }
  free(data);
}

/* The snapshot's trace, with entries taken as they are read, is the one
 * the machine alone gave (slow, or its error): the same events, final
 * state and settings, or the same error. `split`: where the second reader
 * starts (0: where the reader decides). */
static void expect_trace_like(const unsigned char *data, size_t len, size_t split, int slow_rc,
                              const trace_t *slow, const char *slow_error) {
  trace_t fast;
  int fast_rc = trace_parse_snapshot_split("s", data, len, split, &fast);
  if (fast_rc != slow_rc) fprintf(stderr, "split at %zu: %s / %s\n", split, slow_error, gca_last_error());
  assert_int_equal(fast_rc, slow_rc);
  if (slow_rc) {
    assert_string_equal(gca_last_error(), slow_error);
    return;
  }
  assert_true(trace_equal(&fast, slow));
  trace_free(&fast);
}

/* The same, reading it through the machine here. */
static void expect_same_trace(const unsigned char *data, size_t len, size_t split) {
  trace_t slow;
  int slow_rc = trace_parse_snapshot_slowly("s", data, len, &slow);
  char slow_error[1024];
  snprintf(slow_error, sizeof slow_error, "%s", slow_rc ? gca_last_error() : "");
  expect_trace_like(data, len, split, slow_rc, &slow, slow_error);
  if (!slow_rc) trace_free(&slow);
}


/* A trace read from a pipe (`gcalloc replay <(zcat trace.gz)`, /dev/stdin)
 * is the one read from its file, whatever its format: the first byte that
 * says which reader reads it is read once (it had been lost, and a gcalloc
 * trace read as empty). The pipe is fed by a thread: a snapshot is larger
 * than a pipe holds. */
typedef struct pipe_feed {
  int fd;
  const unsigned char *data;
  size_t len;
} pipe_feed_t;

static void *feed_pipe(void *arg) {
  pipe_feed_t *p = arg;
  for (size_t done = 0; done < p->len;) {
    ssize_t n = write(p->fd, p->data + done, p->len - done);
    if (n <= 0) break;
    done += (size_t)n;
  }
  close(p->fd);
  return NULL;
}

static void expect_same_through_pipe(const char *file) {
  size_t len;
  unsigned char *data = read_whole(file, &len);
  assert_non_null(data);
  trace_t direct, piped;
  assert_int_equal(trace_load(file, &direct), GCA_OK);
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pipe_feed_t feed = {fds[1], data, len};
  pthread_t writer;
  assert_int_equal(pthread_create(&writer, NULL, feed_pipe, &feed), 0);
  char path[64];
  snprintf(path, sizeof path, "/dev/fd/%d", fds[0]);
  int rc = trace_load(path, &piped);
  if (rc) fprintf(stderr, "%s: %s\n", file, gca_last_error());
  pthread_join(writer, NULL);
  close(fds[0]);
  assert_int_equal(rc, GCA_OK);
  assert_true(trace_equal(&direct, &piped));
  assert_int_equal(piped.count, direct.count);
  trace_free(&direct);
  trace_free(&piped);
  free(data);
}

static void write_bytes(const char *path, const unsigned char *bytes, size_t len) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(bytes, 1, len, f), len);
  fclose(f);
}

/* `bytes` are refused, with `message` in the error, from a file. */
static void expect_packed_refused(const unsigned char *bytes, size_t len, const char *message) {
  write_bytes("gcalloc-scratch-trace-packed", bytes, len);
  trace_t t;
  assert_int_equal(trace_load("gcalloc-scratch-trace-packed", &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), message);
  assert_null(t.events);
}

static void test_piped_traces(void **state) {
  (void)state;
  static const char *const files[] = {
      GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle",
      GCALLOC_TEST_DATA_DIR "/../fuzz/text-seeds/gcalloc.trace",
      GCALLOC_TEST_DATA_DIR "/../fuzz/text-seeds/rmm-clock.csv",
      GCALLOC_TEST_DATA_DIR "/../fuzz/text-seeds/allocsim.log",
  };
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) expect_same_through_pipe(files[i]);
  for (size_t i = 0; i < BIG_SNAPSHOTS; i++) expect_same_through_pipe(big_snapshot(i));
  /* A UTF-8 byte order mark before a text trace (a spreadsheet's CSV). */
  static const char *const marked[] = {
      "\xEF\xBB\xBFThread,Time,Action,Pointer,Size,Stream\n1,1.5,allocate,0x1000,256,0x0\n",
      "\357\273\2770 2 3000000\n1 3 5000000\n", /* (octal: a hex escape would take the 0) */
      "\xEF\xBB\xBF# gcalloc trace 1\n1 7 malloc 0 0 0 4096 1000\n",
  };
  for (size_t i = 0; i < sizeof marked / sizeof marked[0]; i++) {
    FILE *f = fopen("gcalloc-scratch-trace-bom.txt", "wb");
    assert_non_null(f);
    fputs(marked[i], f);
    fclose(f);
    trace_t t;
    int rc = trace_load("gcalloc-scratch-trace-bom.txt", &t);
    if (rc) fprintf(stderr, "%s\n", gca_last_error());
    assert_int_equal(rc, GCA_OK);
    assert_true(t.count >= 1);
    assert_int_equal(t.events[0].action, TA_ALLOC);
    trace_free(&t);
    expect_same_through_pipe("gcalloc-scratch-trace-bom.txt");
  }
  remove("gcalloc-scratch-trace-bom.txt");
  /* A compressed trace cut short, or in a compression not read, is named
   * as such, from a file or a pipe. */
  static const struct {
    const char *bytes;
    size_t len;
    const char *message;
  } packed[] = {
      {"\037\213\010\000", 4, "the gzip data is cut short (it ends at byte 4, inside a member)"},
      {"\050\265\057\375\000", 5, "the zstd data is cut short (it ends at byte 5, inside a frame)"},
      {"\3757zXZ\0\0", 7, "the xz data is cut short (it ends at byte 7, inside a stream)"},
      {"BZh91AY", 7, "the bzip2 data is cut short (it ends at byte 7, inside a stream)"},
      {"\004\042\115\030\144", 5, "lz4-compressed: decompress it first (with lz4cat: gcalloc replay <(lz4cat FILE))"},
  };
  for (size_t i = 0; i < sizeof packed / sizeof packed[0]; i++) {
    expect_packed_refused((const unsigned char *)packed[i].bytes, packed[i].len, packed[i].message);
    trace_t t;
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    assert_int_equal(write(fds[1], packed[i].bytes, packed[i].len), (ssize_t)packed[i].len);
    close(fds[1]);
    char path[64];
    snprintf(path, sizeof path, "/dev/fd/%d", fds[0]);
    assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
    assert_contains(gca_last_error(), packed[i].message);
    close(fds[0]);
  }
  remove("gcalloc-scratch-trace-packed");
  /* An empty pipe is named as such. */
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  close(fds[1]);
  char path[64];
  snprintf(path, sizeof path, "/dev/fd/%d", fds[0]);
  trace_t t;
  assert_int_equal(trace_load(path, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), ": empty file");
  close(fds[0]);
}

static bool prepare_nothing(const void *ctx, const pv_t *pairs, size_t count, void *out) {
  (void)ctx;
  (void)pairs;
  (void)count;
  (void)out;
  return true;
}

static bool count_record(void *ctx, const void *prepared, int64_t *id) {
  (void)prepared;
  *id = (*(int64_t *)ctx)++;
  return true;
}

/* Declines the declined_at-th dict it is given (one reader: the small
 * snapshot is read on one thread), which is then read as a dict. Set both
 * before a parse. */
static int prepared_so_far, declined_at;
static bool prepare_all_but_one(const void *ctx, const pv_t *pairs, size_t count, void *out) {
  (void)ctx, (void)pairs, (void)count, (void)out;
  return ++prepared_so_far != declined_at;
}

/* A pickle that is read with records on, a record put somewhere other
 * than the list it was made for, and read again without: the tree holds
 * dicts and no record. */
static void expect_escaped(const unsigned char *data, size_t len, const pickle_options_t *o, const char *list_key,
                           size_t dict_at) {
  pickle_doc_t *doc = pickle_parse(data, len, o);
  assert_non_null(doc);
  const pv_t *root = pickle_root(doc), *list = root->kind == PV_DICT ? pv_get(root, list_key) : root;
  assert_non_null(list);
  assert_int_equal(list->kind, PV_LIST);
  int64_t first;
  assert_int_equal(pv_records(list, &first), 0);
  assert_int_equal(pv_at(list, dict_at)->kind, PV_DICT);
  pickle_free(doc);
}

/* The final segments' blocks are records of their own kind (1), in the
 * list under the block key, numbered apart from the entries. */
static void test_blocks_as_records(void **state) {
  (void)state;
  size_t len;
  unsigned char *small = read_whole(GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle", &len);
  assert_non_null(small);
  /* Blocks alone first: the two kinds share record_ctx, and count_record
   * would number them together. */
  int64_t blocks = 0;
  pickle_options_t o = {.pruned_key = "frames", .prepare = prepare_nothing, .take = count_record,
                        .record_ctx = &blocks, .block_key = "blocks", .block_prepare = prepare_nothing,
                        .block_take = count_record};
  pickle_doc_t *doc = pickle_parse(small, len, &o);
  assert_non_null(doc);
  assert_int_equal(blocks, 12); /* three segments of four */
  const pv_t *segments = pv_get(pickle_root(doc), "segments");
  int64_t first = -1;
  for (size_t i = 0; i < 3; i++) {
    const pv_t *list = pv_get(pv_at(segments, i), "blocks");
    assert_int_equal(pv_records(list, &first), 4);
    assert_int_equal(first, 4 * (int64_t)i);
    pv_t held;
    const pv_t *b = pv_item(list, 3, &held);
    assert_true(b->kind == PV_RECORD && b->len == 1 && b->u.i == first + 3);
  }
  /* The entries are dicts (no records key), and the segments too. */
  assert_int_equal(pv_at(pv_at(pv_get(pickle_root(doc), "device_traces"), 0), 0)->kind, PV_DICT);
  assert_int_equal(pv_at(segments, 0)->kind, PV_DICT);
  pickle_free(doc);
  /* A block declined is a dict in its list, between records of kind 1. */
  blocks = 0;
  prepared_so_far = 0;
  declined_at = 2;
  o.block_prepare = prepare_all_but_one;
  doc = pickle_parse(small, len, &o);
  assert_non_null(doc);
  assert_int_equal(blocks, 11);
  const pv_t *list = pv_get(pv_at(pv_get(pickle_root(doc), "segments"), 0), "blocks");
  assert_int_equal(pv_records(list, &first), 0);
  assert_int_equal(pv_len(list), 4);
  assert_true(pv_at(list, 0)->kind == PV_RECORD && pv_at(list, 0)->len == 1 && pv_at(list, 0)->u.i == 0);
  assert_int_equal(pv_at(list, 1)->kind, PV_DICT);
  assert_true(pv_at(list, 2)->kind == PV_RECORD && pv_at(list, 2)->len == 1 && pv_at(list, 2)->u.i == 1);
  pickle_free(doc);
  free(small);

  /* A block's record appended to a list that is not the block key's, and
   * an entry's appended to the block key's list: each escapes, and the
   * file is read again as dicts. */
  o.block_prepare = prepare_nothing;
  o.records_key = "device_traces";
  static const unsigned char block_elsewhere[] = "\x80\x04](\x8c\x06" "blocks]}(\x8c\x04" "sizeK\x05ue.";
  expect_escaped(block_elsewhere, sizeof block_elsewhere - 1, &o, NULL, 2);
  static const unsigned char entry_in_blocks[] = "\x80\x04}(\x8c\x06" "blocks](\x8c\x0d" "device_traces]]}(\x8c\x06"
                                                 "action\x8c\x05" "allocueu.";
  expect_escaped(entry_in_blocks, sizeof entry_in_blocks - 1, &o, "blocks", 3);

  /* In a trace: a block with what it needs is a record, one without is
   * read as a dict and named, as before. */
  static const unsigned char no_state[] =
      "\x80\x04}(\x8c\x08" "segments](}(\x8c\x07" "addressK\x10\x8c\x0a" "total_sizeK\x40\x8c\x06" "blocks]("
      "}(\x8c\x07" "addressK\x10\x8c\x04" "sizeK\x20\x8c\x05" "state\x8c\x10" "active_allocatedu"
      "}(\x8c\x07" "addressK\x30\x8c\x04" "sizeK\x20u"
      "eue\x8c\x0d" "device_traces](]eu.";
  trace_t t;
  assert_int_equal(trace_parse_snapshot("s", no_state, sizeof no_state - 1, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "segment 0 block 1 lacks a valid address, size or state");
  assert_int_equal(trace_parse_snapshot_slowly("s", no_state, sizeof no_state - 1, &t), GCA_ERR_INVALID);
  assert_contains(gca_last_error(), "segment 0 block 1 lacks a valid address, size or state");
  expect_same_trace(no_state, sizeof no_state - 1, 0);
}

static void test_flat_reader_same_as_machine(void **state) {
  (void)state;
  size_t len;
  unsigned char *small = read_whole(GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle", &len);
  assert_non_null(small);
  expect_same_parse(small, len, NULL, SIZE_MAX);
  expect_same_parse(small, len, "frames", SIZE_MAX);
  expect_same_trace(small, len, 0);
  trace_t t;
  assert_int_equal(trace_parse_snapshot("small", small, len, &t), GCA_OK);
  assert_int_equal(t.count, 61);
  assert_int_equal(t.device_count, 2);
  assert_int_equal(t.events[30].action, TA_OOM);
  assert_int_equal(t.events[30].addr, 12345); /* device_free */
  assert_int_equal(t.events[60].device, 1);
  assert_string_equal(t.settings, "max_split_size_mb:64");
  trace_free(&t);
  /* Every entry goes to the record reader as it is read, those whose
   * frames list is empty (4) or has one frame (3, APPEND) included, and
   * device 1's only entry (APPEND into its list). */
  int64_t records = 0;
  pickle_options_t o = {.pruned_key = "frames", .records_key = "device_traces", .prepare = prepare_nothing, .take = count_record,
                        .record_ctx = &records};
  pickle_doc_t *doc = pickle_parse(small, len, &o);
  assert_non_null(doc);
  assert_int_equal(records, 61);
  const pv_t *traces = pv_get(pickle_root(doc), "device_traces");
  /* Each device's list holds records alone, in order: a range, no items. */
  int64_t first = -1;
  assert_int_equal(pv_records(pv_at(traces, 0), &first), 60);
  assert_int_equal(first, 0);
  assert_int_equal(pv_records(pv_at(traces, 1), &first), 1);
  assert_int_equal(first, 60);
  assert_null(pv_at(pv_at(traces, 0), 0));
  pv_t held;
  assert_true(pv_item(pv_at(traces, 0), 59, &held)->kind == PV_RECORD && held.u.i == 59);
  assert_null(pv_item(pv_at(traces, 0), 60, &held));
  pickle_free(doc);
  /* An entry declined is a dict in its list, which then holds items: the
   * records before it, the dict, the records after. */
  records = 0;
  prepared_so_far = 0;
  declined_at = 6;
  o.prepare = prepare_all_but_one;
  doc = pickle_parse(small, len, &o);
  assert_non_null(doc);
  assert_int_equal(records, 60);
  const pv_t *list = pv_at(pv_get(pickle_root(doc), "device_traces"), 0);
  assert_int_equal(pv_records(list, &first), 0);
  assert_int_equal(pv_len(list), 60);
  assert_true(pv_at(list, 4)->kind == PV_RECORD && pv_at(list, 4)->u.i == 4);
  assert_int_equal(pv_at(list, 5)->kind, PV_DICT);
  assert_true(pv_at(list, 6)->kind == PV_RECORD && pv_at(list, 6)->u.i == 5);
  assert_true(pv_at(list, 59)->kind == PV_RECORD && pv_at(list, 59)->u.i == 58);
  pickle_free(doc);
  free(small);
  for (size_t i = 0; i < BIG_SNAPSHOTS; i++) {
    unsigned char *data = read_whole(big_snapshot(i), &len);
    assert_non_null(data);
    expect_same_parse(data, len, NULL, SIZE_MAX);
    expect_same_parse(data, len, "frames", SIZE_MAX);
    expect_same_trace(data, len, 0);
    free(data);
  }
}

/* A dict written alone in a pruned list (one frame: EMPTY_LIST, the dict,
 * APPEND) and referenced again from outside it: both readers keep it
 * whole (the machine cannot tell at its push that APPEND will put it in
 * the pruned list). Made by Python's pickle (protocol 4) of
 * {"device_traces": [[{... "frames": [f]}, {... "frames": [], "other": f}]]}. */
static void test_flat_reader_dict_alone_in_pruned_list(void **state) {
  (void)state;
  static const unsigned char data[] = {
      0x80, 0x04, 0x95, 0x96, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x7d, 0x94, 0x8c, 0x0d, 0x64,
      0x65, 0x76, 0x69, 0x63, 0x65, 0x5f, 0x74, 0x72, 0x61, 0x63, 0x65, 0x73, 0x94, 0x5d, 0x94, 0x5d,
      0x94, 0x28, 0x7d, 0x94, 0x28, 0x8c, 0x06, 0x61, 0x63, 0x74, 0x69, 0x6f, 0x6e, 0x94, 0x8c, 0x05,
      0x61, 0x6c, 0x6c, 0x6f, 0x63, 0x94, 0x8c, 0x04, 0x61, 0x64, 0x64, 0x72, 0x94, 0x4b, 0x01, 0x8c,
      0x04, 0x73, 0x69, 0x7a, 0x65, 0x94, 0x4b, 0x02, 0x8c, 0x06, 0x66, 0x72, 0x61, 0x6d, 0x65, 0x73,
      0x94, 0x5d, 0x94, 0x7d, 0x94, 0x28, 0x8c, 0x04, 0x6e, 0x61, 0x6d, 0x65, 0x94, 0x8c, 0x01, 0x78,
      0x94, 0x8c, 0x08, 0x66, 0x69, 0x6c, 0x65, 0x6e, 0x61, 0x6d, 0x65, 0x94, 0x8c, 0x04, 0x79, 0x2e,
      0x70, 0x79, 0x94, 0x8c, 0x04, 0x6c, 0x69, 0x6e, 0x65, 0x94, 0x4b, 0x01, 0x75, 0x61, 0x75, 0x7d,
      0x94, 0x28, 0x68, 0x05, 0x68, 0x06, 0x68, 0x07, 0x4b, 0x03, 0x68, 0x08, 0x4b, 0x04, 0x68, 0x09,
      0x5d, 0x94, 0x8c, 0x05, 0x6f, 0x74, 0x68, 0x65, 0x72, 0x94, 0x68, 0x0b, 0x75, 0x65, 0x61, 0x73,
      0x2e,
  };
  expect_same_parse(data, sizeof data, "frames", SIZE_MAX);
  pickle_options_t o = {.pruned_key = "frames"};
  pickle_doc_t *doc = pickle_parse(data, sizeof data, &o);
  assert_non_null(doc);
  const pv_t *second = pv_at(pv_at(pv_get(pickle_root(doc), "device_traces"), 0), 1);
  assert_true(pv_str_eq(pv_get(pv_get(second, "other"), "filename"), "y.py"));
  assert_int_equal(pv_len(pv_get(pv_at(pv_at(pv_get(pickle_root(doc), "device_traces"), 0), 0), "frames")), 0);
  pickle_free(doc);
}

/* Seeded mutations: a byte set to a random value or to an opcode, a byte
 * deleted (a memo store dropped shifts the numbering after it), some
 * truncations. Whatever the input, both readers agree. */
static void mutate(unsigned char *data, size_t *len, uint64_t *seed) {
  static const unsigned char opcodes[] = {'h', 'j', 0x94, 'q', 'r', '(', ')', '}', ']', 'u', 'e', 's', 'a',
                                          'K', 'M', 'J', 0x8a, 0x8c, 'X', 'N', 0x88, 0x95, 't', '.', 0x86};
  int edits = 1 + (int)(next_random(seed) % 3);
  for (int k = 0; k < edits && *len > 1; k++) {
    size_t at = (size_t)(next_random(seed) % *len);
    uint64_t r = next_random(seed);
    if (r % 3 == 0) {
      memmove(data + at, data + at + 1, *len - at - 1);
      --*len;
    } else {
      data[at] = r & 8 ? (unsigned char)(r >> 8) : opcodes[(r >> 8) % sizeof opcodes];
    }
  }
  if (next_random(seed) % 8 == 0) *len = 1 + (size_t)(next_random(seed) % *len);
}

static void test_flat_reader_mutations(void **state) {
  (void)state;
  uint64_t seed = 0x5eed0f1a7;
  size_t len;
  unsigned char *small = read_whole(GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle", &len);
  assert_non_null(small);
  unsigned char *copy = malloc(len);
  /* Each container's memo store dropped in turn: the numbering after it
   * shifts, and the dict that is not stored must not take a slot. */
  for (size_t at = 0; at + 1 < len; at++) {
    if ((small[at] != '}' && small[at] != ']') || small[at + 1] != 0x94) continue;
    memcpy(copy, small, at + 1);
    memcpy(copy + at + 1, small + at + 2, len - at - 2);
    expect_same_parse(copy, len - 1, at % 2 ? "frames" : NULL, 100000);
    expect_same_trace(copy, len - 1, 0);
    expect_same_trace(copy, len - 1, at);
  }
  for (int i = 0; i < 4000; i++) {
    size_t n = len;
    memcpy(copy, small, len);
    mutate(copy, &n, &seed);
    expect_same_parse(copy, n, i % 2 ? "frames" : NULL, 100000);
    expect_same_trace(copy, n, i % 2 ? 1 + next_random(&seed) % n : 0);
  }
  free(copy);
  free(small);
  unsigned char *data = read_whole(big_snapshot(0), &len);
  assert_non_null(data);
  copy = malloc(len);
  for (int i = 0; i < 12; i++) {
    size_t n = len;
    memcpy(copy, data, len);
    mutate(copy, &n, &seed);
    expect_same_parse(copy, n, "frames", 100000);
    expect_same_trace(copy, n, 0);
    expect_same_trace(copy, n, 1 + next_random(&seed) % n);
  }
  free(copy);
  free(data);
}

/* Records as digests of what `prepare` was given: every value's kind and
 * scalar, a string's bytes, a container's pruned flag and count. */
typedef struct digests {
  uint64_t *items;
  size_t count, cap;
} digests_t;

static uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ull; }

static bool prepare_digest(const void *ctx, const pv_t *pairs, size_t count, void *out) {
  (void)ctx;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < count; i++) {
    const pv_t *v = &pairs[i];
    h = mix(h, v->kind);
    if (v->kind == PV_STR || v->kind == PV_BYTES)
      for (uint32_t k = 0; k < v->len; k++) h = mix(h, (unsigned char)v->u.data[k]);
    else if (v->kind == PV_LIST || v->kind == PV_DICT)
      h = mix(mix(h, v->u.seq->pruned), v->u.seq->count);
    else if (v->kind != PV_NONE)
      h = mix(h, (uint64_t)v->u.i);
  }
  memcpy(out, &h, sizeof h);
  return true;
}

static bool take_digest(void *ctx, const void *prepared, int64_t *id) {
  digests_t *d = ctx;
  if (d->count == d->cap) {
    d->cap = d->cap ? 2 * d->cap : 64;
    d->items = realloc(d->items, d->cap * sizeof *d->items);
    assert_non_null(d->items);
  }
  memcpy(&d->items[d->count], prepared, sizeof *d->items);
  *id = (int64_t)d->count++;
  return true;
}

/* The records the two trees hold (the same shape, already compared) have
 * the same digests, in order. */
static void expect_same_digests(const pickle_doc_t *a, const digests_t *da, const pickle_doc_t *b,
                                const digests_t *db) {
  const pv_t *ta = pv_get(pickle_root(a), "device_traces"), *tb = pv_get(pickle_root(b), "device_traces");
  for (size_t i = 0; i < pv_len(ta); i++)
    for (size_t k = 0; k < pv_len(pv_at(ta, i)); k++) {
      pv_t xs, ys;
      const pv_t *x = pv_item(pv_at(ta, i), k, &xs), *y = pv_item(pv_at(tb, i), k, &ys);
      if (x->kind != PV_RECORD) continue;
      assert_true((uint64_t)x->u.i < da->count && (uint64_t)y->u.i < db->count);
      assert_true(da->items[x->u.i] == db->items[y->u.i]);
    }
}

/* What one reader makes of a file, to compare the second reader with: the
 * trace (through the general machine alone) or its error, and the tree
 * with records (and their digests) or its error. */
typedef struct reference {
  trace_t trace;
  int trace_rc;
  char trace_error[1024];
  pickle_doc_t *doc;
  digests_t digests;
  char doc_error[1024];
} reference_t;

static const pickle_options_t digest_options = {.pruned_key = "frames", .records_key = "device_traces",
                                                .prepare = prepare_digest, .take = take_digest,
                                                .record_size = sizeof(uint64_t)};

static void reference_read(reference_t *r, const unsigned char *data, size_t len) {
  memset(r, 0, sizeof *r);
  r->trace_rc = trace_parse_snapshot_slowly("s", data, len, &r->trace);
  snprintf(r->trace_error, sizeof r->trace_error, "%s", r->trace_rc ? gca_last_error() : "");
  pickle_options_t o = digest_options;
  o.record_ctx = &r->digests;
  o.split = PICKLE_ONE_READER;
  r->doc = pickle_parse(data, len, &o);
  snprintf(r->doc_error, sizeof r->doc_error, "%s", r->doc ? "" : gca_last_error());
}

static void reference_free(reference_t *r) {
  if (!r->trace_rc) trace_free(&r->trace);
  pickle_free(r->doc);
  free(r->digests.items);
}

/* With the second reader started at `split`: the reference's trace, or
 * the same error; with records, the same tree (records where records are)
 * and the same records, each as `prepare` was given it. Returns how many
 * records the first reader took from the second. */
static size_t expect_as_reference(const reference_t *r, const unsigned char *data, size_t len, size_t split) {
  expect_trace_like(data, len, split, r->trace_rc, &r->trace, r->trace_error);
  digests_t two = {0};
  pickle_options_t o = digest_options;
  o.record_ctx = &two;
  o.split = split;
  pickle_doc_t *b = pickle_parse(data, len, &o);
  size_t taken = pickle_split_taken(b);
  assert_true(!r->doc == !b);
  if (b) {
    size_t budget = 100000;
    assert_true(pv_equal(pickle_root(r->doc), pickle_root(b), 0, &budget));
    expect_same_digests(r->doc, &r->digests, b, &two);
  } else {
    assert_string_equal(gca_last_error(), r->doc_error);
  }
  pickle_free(b);
  free(two.items);
  return taken;
}

/* The second reader (pickle.c, "Reading on two cores"): wherever it
 * starts, at an opcode or inside a string, a frames list or an argument,
 * the trace is the one reader's; and where the file lets it, it reads
 * entries for the first, which takes them. */
static void test_second_reader(void **state) {
  (void)state;
  size_t len;
  reference_t ref;
  bool counts[62] = {false};
  unsigned char *small = read_whole(GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle", &len);
  assert_non_null(small);
  reference_read(&ref, small, len);
  assert_int_equal(ref.trace.count, 61);
  for (size_t at = 1; at < len; at++) counts[expect_as_reference(&ref, small, len, at)] = true;
  /* Started at the k-th entry's '}' (or walking to it from inside the
   * entry before), it reads that one and every one after it, which the
   * first reader all takes: each count from 61 down to 1 is seen. */
  for (size_t n = 1; n <= 61; n++) assert_true(counts[n]);
  reference_free(&ref);
  free(small);
  /* Entries that share objects as a hostile file could, from every offset.
   * A reference the second reader takes for a pruned list (a
   * free_completed entry's frames) is a string, a frame, the entry itself,
   * or another entry (the file is then read again without records). */
  static const char *const odd[] = {GCALLOC_TEST_DATA_DIR "/snapshot_shared.pickle",
                                    GCALLOC_TEST_DATA_DIR "/snapshot_escape.pickle"};
  for (size_t i = 0; i < 2; i++) {
    unsigned char *data = read_whole(odd[i], &len);
    assert_non_null(data);
    reference_read(&ref, data, len);
    size_t most = 0;
    for (size_t at = 1; at < len; at++) {
      size_t taken = expect_as_reference(&ref, data, len, at);
      most = taken > most ? taken : most;
    }
    /* In the shared file, the second reader reads the 93 entries before
     * the odd ones for the first, and some of those (the first where a
     * check does not hold ends it); the other is read again without
     * records, so none are taken. */
    if (i == 0) assert_true(most >= 93);
    else assert_int_equal(most, 0);
    reference_free(&ref);
    free(data);
  }
  for (size_t i = 0; i < BIG_SNAPSHOTS; i++) {
    unsigned char *data = read_whole(big_snapshot(i), &len);
    assert_non_null(data);
    reference_read(&ref, data, len);
    expect_as_reference(&ref, data, len, 0);
    for (size_t k = 1; k < 16; k++) expect_as_reference(&ref, data, len, len / 16 * k + k);
    /* From the first protocol-4 frame past the middle (where it starts by
     * itself with two processors), it reads thousands of entries for the
     * first. */
    size_t at = 2;
    while (at < len / 2) {
      assert_int_equal(data[at], 0x95);
      uint64_t frame = 0;
      for (int b = 0; b < 8; b++) frame |= (uint64_t)data[at + 1 + (size_t)b] << (8 * b);
      at += 9 + (size_t)frame;
    }
    assert_true(expect_as_reference(&ref, data, len, at) > 1000);
    reference_free(&ref);
    free(data);
  }
}

/* Big arrays (util.c): zero-filled when made and when grown (big_regrow:
 * not zeroed), contents kept across the 256 KiB line between calloc and a mapping of their own,
 * within one mapping and to a bigger one; mappings on 2 MiB boundaries
 * (where they are mappings); a freed mapping handed out again zeroed. */
static void test_big_arrays(void **state) {
  (void)state;
  /* Mappings are aligned to 2 MiB only for huge pages, which a process
   * asks for from its second trace read on (util.c): this one's may not
   * have come to that yet. */
  gca__big_prefer_huge_pages();
  static const size_t sizes[] = {100, 200, 100 << 10, 300 << 10, 1 << 20, 5 << 20};
  size_t bytes = sizes[0];
  unsigned char *a = gca__big_zalloc(bytes);
  assert_non_null(a);
  for (size_t i = 0; i < bytes; i++) assert_int_equal(a[i], 0);
  memset(a, 0xab, bytes);
  for (size_t k = 1; k < sizeof sizes / sizeof *sizes; k++) {
    unsigned char *grown = gca__big_rezalloc(a, bytes, sizes[k]);
    assert_non_null(grown);
    for (size_t i = 0; i < bytes; i++) assert_int_equal(grown[i], 0xab);
    for (size_t i = bytes; i < sizes[k]; i++) assert_int_equal(grown[i], 0);
#if GCA_BIG_MAPPED
    if (sizes[k] >= (256 << 10)) assert_int_equal((uintptr_t)grown % (2 << 20), 0);
#endif
    a = grown;
    bytes = sizes[k];
    memset(a, 0xab, bytes);
  }
  assert_true(gca__big_rezalloc(a, bytes, bytes / 2) == a); /* never shrinks */
  gca__big_free(a, bytes);
  /* big_regrow: the same growth, contents kept, the new part not promised
   * zero (the memo and the events' array write it before reading it). */
  bytes = sizes[0];
  a = gca__big_alloc(bytes);
  assert_non_null(a);
  memset(a, 0xcd, bytes);
  for (size_t k = 1; k < sizeof sizes / sizeof *sizes; k++) {
    unsigned char *grown = gca__big_regrow(a, bytes, sizes[k]);
    assert_non_null(grown);
    for (size_t i = 0; i < bytes; i++) assert_int_equal(grown[i], 0xcd);
    a = grown;
    bytes = sizes[k];
    memset(a, 0xcd, bytes);
  }
  assert_true(gca__big_regrow(a, bytes, bytes / 2) == a);
  gca__big_free(a, bytes);
  gca__big_free(NULL, 0);
  /* A freed mapping may be kept and handed out again: still zero, also in
   * the part a later growth within it adds (the old contents were 0xab). */
  for (int round = 0; round < 3; round++) {
    unsigned char *b = gca__big_zalloc(300 << 10);
    assert_non_null(b);
    for (size_t i = 0; i < (300 << 10); i++) assert_int_equal(b[i], 0);
    unsigned char *c = gca__big_rezalloc(b, 300 << 10, 1 << 20);
    assert_non_null(c);
    for (size_t i = 0; i < (1 << 20); i++) assert_int_equal(c[i], 0);
    memset(c, 0xab, 1 << 20);
    gca__big_free(c, 1 << 20);
  }
}

/* A snapshot of 40,000 entries, more than the entries' first array holds:
 * it grows (past one 2 MiB mapping), and the trace is the machine's. */
static void test_many_entries(void **state) {
  (void)state;
  const size_t entries = 40000;
  static const char head[] = "\x80\x04}(\x8c\x0d" "device_traces](]("; /* {'device_traces': [[ */
  static const char entry[] = "}(\x8c\x06" "action\x8c\x05" "alloc\x8c\x04" "addrJ\x00\x00\x00\x00\x8c\x04"
                              "sizeK\x01u";
  size_t len = sizeof head - 1 + entries * (sizeof entry - 1) + 4;
  unsigned char *data = malloc(len), *at = data;
  assert_non_null(data);
  memcpy(at, head, sizeof head - 1);
  at += sizeof head - 1;
  for (size_t i = 0; i < entries; i++) {
    memcpy(at, entry, sizeof entry - 1);
    uint32_t addr = (uint32_t)(i * 512);
    for (int b = 0; b < 4; b++) at[24 + b] = (unsigned char)(addr >> (8 * b)); /* BININT: little-endian */
    at += sizeof entry - 1;
  }
  memcpy(at, "eeu.", 4);
  trace_t t;
  assert_int_equal(trace_parse_snapshot("many", data, len, &t), GCA_OK);
  assert_int_equal(t.count, entries);
  assert_int_equal(t.events[entries - 1].addr, (entries - 1) * 512);
  assert_int_equal(t.events[entries - 1].action, TA_ALLOC);
  trace_t slow;
  assert_int_equal(trace_parse_snapshot_slowly("many", data, len, &slow), GCA_OK);
  assert_true(trace_equal(&t, &slow));
  trace_free(&t);
  trace_free(&slow);
  free(data);
}

/* ---- compressed traces --------------------------------------------------- */

typedef struct packed {
  unsigned char *bytes;
  size_t len;
  /* Where the data may be cut and still be whole streams (members,
   * frames), less of them: from gap_from[i] to gap_to[i]. */
  size_t gap_from[2], gap_to[2];
  int gaps;
} packed_t;

static void add_gap(packed_t *p, size_t from, size_t to) {
  p->gap_from[p->gaps] = from;
  p->gap_to[p->gaps++] = to;
}

/* `at`, or, where cutting there would leave whole streams, the first byte
 * past that gap: the data cut there is cut short. */
static size_t cut_inside(const packed_t *p, size_t at) {
  for (int i = 0; i < p->gaps; i++)
    if (at >= p->gap_from[i] && at <= p->gap_to[i]) at = p->gap_to[i] + 1;
  return at;
}

/* `data` as `members` gzip members, one after another (zcat's reading). */
static packed_t gzip_of(const unsigned char *data, size_t len, int members) {
  size_t cap = len + 1024 * (size_t)members;
  packed_t p = {.bytes = malloc(cap)};
  assert_non_null(p.bytes);
  size_t from = 0;
  for (int m = 0; m < members; m++) {
    if (m) add_gap(&p, p.len, p.len);
    size_t to = m + 1 == members ? len : len / (size_t)members * (size_t)(m + 1);
    z_stream z;
    memset(&z, 0, sizeof z);
    assert_int_equal(deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
    z.next_in = (Bytef *)(uintptr_t)(data + from);
    z.avail_in = (uInt)(to - from);
    z.next_out = p.bytes + p.len;
    z.avail_out = (uInt)(cap - p.len);
    assert_int_equal(deflate(&z, Z_FINISH), Z_STREAM_END);
    p.len += z.total_out;
    deflateEnd(&z);
    from = to;
  }
  return p;
}

/* `data` as zstd, in two frames with a skippable frame between them. */
static packed_t zstd_of(const unsigned char *data, size_t len) {
  size_t half = len / 2, bound = ZSTD_compressBound(half) + ZSTD_compressBound(len - half) + 16;
  packed_t p = {.bytes = malloc(bound)};
  assert_non_null(p.bytes);
  size_t n = ZSTD_compress(p.bytes, bound, data, half, 3);
  assert_false(ZSTD_isError(n));
  p.len = n;
  static const unsigned char skippable[] = {0x50, 0x2a, 0x4d, 0x18, 4, 0, 0, 0, 'g', 'c', 'a', '!'};
  memcpy(p.bytes + p.len, skippable, sizeof skippable);
  add_gap(&p, p.len, p.len + sizeof skippable);
  p.len += sizeof skippable;
  n = ZSTD_compress(p.bytes + p.len, bound - p.len, data + half, len - half, 3);
  assert_false(ZSTD_isError(n));
  p.len += n;
  return p;
}

/* `data` as xz, in two streams (CRC-32 and CRC-64 checks) with four bytes
 * of stream padding between them (xzcat's reading). */
static packed_t xz_of(const unsigned char *data, size_t len) {
  size_t half = len / 2, cap = lzma_stream_buffer_bound(half) + lzma_stream_buffer_bound(len - half) + 4;
  packed_t p = {.bytes = malloc(cap)};
  assert_non_null(p.bytes);
  assert_int_equal(lzma_easy_buffer_encode(6, LZMA_CHECK_CRC32, NULL, data, half, p.bytes, &p.len, cap), LZMA_OK);
  memset(p.bytes + p.len, 0, 4);
  add_gap(&p, p.len, p.len + 4);
  p.len += 4;
  assert_int_equal(lzma_easy_buffer_encode(1, LZMA_CHECK_CRC64, NULL, data + half, len - half, p.bytes, &p.len, cap),
                   LZMA_OK);
  return p;
}

/* `data` as bzip2, in two streams (bzcat's reading). */
static packed_t bzip2_of(const unsigned char *data, size_t len) {
  size_t half = len / 2, cap = len + len / 50 + 2048;
  packed_t p = {.bytes = malloc(cap)};
  assert_non_null(p.bytes);
  unsigned n = (unsigned)cap;
  assert_int_equal(BZ2_bzBuffToBuffCompress((char *)p.bytes, &n, (char *)(uintptr_t)data, (unsigned)half, 9, 0, 0),
                   BZ_OK);
  p.len = n;
  add_gap(&p, p.len, p.len);
  n = (unsigned)(cap - p.len);
  assert_int_equal(BZ2_bzBuffToBuffCompress((char *)p.bytes + p.len, &n, (char *)(uintptr_t)(data + half),
                                            (unsigned)(len - half), 1, 0, 0),
                   BZ_OK);
  p.len += n;
  return p;
}

/* Past a variable-length integer of xz's (seven bits a byte, low first). */
static size_t skip_xz_number(const unsigned char *at, size_t i) {
  while (at[i] & 0x80) i++;
  return i + 1;
}

/* An xz stream of `text` whose block header asks for a dictionary of
 * 4 GiB (its CRC-32 made right again): its decoder would need more memory
 * than gcalloc lets it have. */
static packed_t xz_with_big_dictionary(const char *text) {
  packed_t p = {.bytes = malloc(4096)};
  assert_non_null(p.bytes);
  assert_int_equal(lzma_easy_buffer_encode(0, LZMA_CHECK_CRC32, NULL, (const uint8_t *)text, strlen(text), p.bytes,
                                           &p.len, 4096),
                   LZMA_OK);
  unsigned char *header = p.bytes + LZMA_STREAM_HEADER_SIZE;
  size_t header_size = ((size_t)header[0] + 1) * 4, i = 2;
  assert_int_equal(header[1] & 0x03, 0); /* one filter */
  if (header[1] & 0x40) i = skip_xz_number(header, i); /* its compressed size */
  if (header[1] & 0x80) i = skip_xz_number(header, i); /* its uncompressed size */
  assert_int_equal(header[i], LZMA_FILTER_LZMA2);
  assert_int_equal(header[i + 1], 1); /* one byte of properties: the dictionary's size */
  header[i + 2] = 40;                 /* 4 GiB - 1 */
  uint32_t check = (uint32_t)crc32(0, header, (uInt)(header_size - 4));
  for (int b = 0; b < 4; b++) header[header_size - 4 + (size_t)b] = (unsigned char)(check >> (8 * b));
  return p;
}

/* Every reader's trace, gzip'd (in one member and in three), zstd'd, xz'd
 * and bzip2'd, reads as the plain file does, from a file and through a
 * pipe; what is cut short, corrupt, followed by other bytes, compressed
 * twice, or decompresses to far more than a trace could is refused, and
 * says so. */
static void test_compressed_traces(void **state) {
  (void)state;
  const char *files[] = {
      GCALLOC_TEST_DATA_DIR "/snapshot_small.pickle",
      GCALLOC_TEST_DATA_DIR "/../fuzz/text-seeds/gcalloc.trace",
      GCALLOC_TEST_DATA_DIR "/../fuzz/text-seeds/rmm-clock.csv",
      GCALLOC_TEST_DATA_DIR "/../fuzz/text-seeds/allocsim.log",
      big_snapshot(1),
  };
  size_t file_count = sizeof files / sizeof files[0];
  for (size_t i = 0; i < file_count; i++) {
    size_t len;
    unsigned char *data = read_whole(files[i], &len);
    assert_non_null(data);
    trace_t plain;
    assert_int_equal(trace_load(files[i], &plain), GCA_OK);
    packed_t packs[] = {gzip_of(data, len, 1), gzip_of(data, len, 3), zstd_of(data, len), xz_of(data, len),
                        bzip2_of(data, len)};
    static const char *const names[] = {"gzip", "gzip", "zstd", "xz", "bzip2"};
    for (size_t k = 0; k < sizeof packs / sizeof packs[0]; k++) {
      write_bytes("gcalloc-scratch-trace-packed", packs[k].bytes, packs[k].len);
      trace_t t;
      int rc = trace_load("gcalloc-scratch-trace-packed", &t);
      if (rc) fprintf(stderr, "%s, packing %zu: %s\n", files[i], k, gca_last_error());
      assert_int_equal(rc, GCA_OK);
      assert_true(trace_equal(&plain, &t));
      trace_free(&t);
      expect_same_through_pipe("gcalloc-scratch-trace-packed");
      /* Cut short anywhere, a gzip member's 8-byte trailer and an xz
       * stream's index and footer included. */
      char cut[64];
      snprintf(cut, sizeof cut, "the %s data is cut short", names[k]);
      size_t cuts[] = {packs[k].len - 1, packs[k].len - 5, packs[k].len / 2, 12};
      for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++)
        expect_packed_refused(packs[k].bytes, cut_inside(&packs[k], cuts[c]), cut);
      free(packs[k].bytes);
    }
    trace_free(&plain);
    free(data);
  }

  /* Corrupt: the deflate data, or its check. */
  static const char text[] = "0 2 3000000\n1 3 5000000\n2 4 1000\n3 5 7000\n4 6 123456\n";
  packed_t gz = gzip_of((const unsigned char *)text, sizeof text - 1, 1);
  unsigned char *bad = malloc(gz.len + 16);
  assert_non_null(bad);
  memcpy(bad, gz.bytes, gz.len);
  bad[gz.len - 6] ^= 0x40; /* its CRC-32 */
  expect_packed_refused(bad, gz.len, "gzip data corrupt near byte");
  memcpy(bad, gz.bytes, gz.len);
  bad[10] |= 0x06; /* a deflate block of the type that does not exist */
  expect_packed_refused(bad, gz.len, "gzip data corrupt near byte");
  /* Other bytes after the last member. */
  memcpy(bad, gz.bytes, gz.len);
  memcpy(bad + gz.len, "trailing", 8);
  expect_packed_refused(bad, gz.len + 8, "8 bytes after the gzip data, from byte");
  free(bad);
  /* Compressed twice. */
  packed_t twice = gzip_of(gz.bytes, gz.len, 1);
  expect_packed_refused(twice.bytes, twice.len, "gzip-compressed data inside the gzip data: decompress it first");
  free(twice.bytes);
  free(gz.bytes);
  /* zstd: its checksum, and a frame header with its reserved bit set. */
  ZSTD_CCtx *cc = ZSTD_createCCtx();
  assert_non_null(cc);
  assert_false(ZSTD_isError(ZSTD_CCtx_setParameter(cc, ZSTD_c_checksumFlag, 1)));
  unsigned char frame[256];
  size_t n = ZSTD_compress2(cc, frame, sizeof frame, text, sizeof text - 1);
  assert_false(ZSTD_isError(n));
  frame[n - 1] ^= 0x01;
  expect_packed_refused(frame, n, "zstd data corrupt between bytes 0 and");
  frame[n - 1] ^= 0x01;
  frame[4] |= 0x08;
  expect_packed_refused(frame, n, "zstd data corrupt between bytes 0 and");
  /* xz: a flipped bit in its data, other bytes after it, padding that is
   * not four bytes at a time, and a dictionary too big to be given. */
  packed_t xz = xz_of((const unsigned char *)text, sizeof text - 1);
  bad = malloc(xz.len + 16);
  assert_non_null(bad);
  memcpy(bad, xz.bytes, xz.len);
  bad[LZMA_STREAM_HEADER_SIZE + 16] ^= 0x10;
  expect_packed_refused(bad, xz.len, "xz data corrupt near byte");
  memcpy(bad, xz.bytes, xz.len);
  memcpy(bad + xz.len, "trailing", 8);
  expect_packed_refused(bad, xz.len + 8, "8 bytes after the xz data, from byte");
  memset(bad + xz.len, 0, 3);
  expect_packed_refused(bad, xz.len + 3, "padding of 3 bytes, not a multiple of four");
  free(bad);
  free(xz.bytes);
  packed_t big = xz_with_big_dictionary(text);
  expect_packed_refused(big.bytes, big.len, "the xz stream at byte 0 needs 4096 MiB to decompress, more than the "
                                            "1024 MiB gcalloc allows");
  big.bytes[LZMA_STREAM_HEADER_SIZE + 3] ^= 0x01; /* and with its header's check wrong: corrupt, not too big */
  expect_packed_refused(big.bytes, big.len, "xz data corrupt near byte");
  free(big.bytes);
  /* bzip2: a flipped bit in its block, and other bytes after it. */
  packed_t bz = bzip2_of((const unsigned char *)text, sizeof text - 1);
  bad = malloc(bz.len + 16);
  assert_non_null(bad);
  memcpy(bad, bz.bytes, bz.len);
  bad[20] ^= 0x10;
  expect_packed_refused(bad, bz.len, "bzip2 data corrupt in the block read up to byte");
  memcpy(bad, bz.bytes, bz.len);
  memcpy(bad + bz.len, "trailing", 8);
  expect_packed_refused(bad, bz.len + 8, "8 bytes after the bzip2 data, from byte");
  free(bad);
  free(bz.bytes);
  /* 256 MiB of comment lines in a few kilobytes (text that passes the
   * first-bytes look): refused at 4,096 bytes per byte and 64 MiB more,
   * before the host's memory is spent on it. */
  ZSTD_CCtx_reset(cc, ZSTD_reset_session_and_parameters);
  size_t zeros_len = (size_t)1 << 20, cap = (size_t)64 << 10;
  unsigned char *zeros = calloc(1, zeros_len), *bomb = malloc(cap);
  assert_non_null(zeros);
  for (size_t i = 0; i + 1 < zeros_len; i += 2) memcpy(zeros + i, "#\n", 2);
  assert_non_null(bomb);
  ZSTD_outBuffer out = {bomb, cap, 0};
  for (int i = 0; i < 256; i++) {
    ZSTD_inBuffer in = {zeros, zeros_len, 0};
    while (in.pos < in.size) assert_false(ZSTD_isError(ZSTD_compressStream2(cc, &out, &in, ZSTD_e_continue)));
  }
  ZSTD_inBuffer none = {zeros, 0, 0};
  size_t left;
  do {
    left = ZSTD_compressStream2(cc, &out, &none, ZSTD_e_end);
    assert_false(ZSTD_isError(left));
  } while (left);
  assert_true(out.pos * 4096 + ((size_t)64 << 20) < ((size_t)256 << 20)); /* (else the test proves nothing) */
  expect_packed_refused(bomb, out.pos, "that decompresses to more than");
  assert_contains(gca_last_error(), "is refused as malformed");
  free(zeros);
  free(bomb);
  ZSTD_freeCCtx(cc);
  remove("gcalloc-scratch-trace-packed");
}

/* What trace_load_progress told: its calls, their stage, and whether each
 * went on from the one before. */
typedef struct progress_seen {
  size_t reading, decompressing;
  uint64_t last, total, packed_read, packed;
  bool forward; /* each reading's done past the last, and below the total; each decompressing's not behind */
} progress_seen_t;

static void see_progress(void *ctx, const char *stage, uint64_t done, uint64_t total) {
  progress_seen_t *p = ctx;
  if (!strcmp(stage, "decompressing")) {
    if (p->reading || (p->decompressing && (done < p->packed_read || total != p->packed)) || done > total)
      p->forward = false;
    p->decompressing++;
    p->packed_read = done;
    p->packed = total;
    return;
  }
  assert_string_equal(stage, "reading");
  if (p->reading && (done <= p->last || total != p->total)) p->forward = false;
  if (done >= total) p->forward = false;
  p->reading++;
  p->last = done;
  p->total = total;
}

/* trace_load_progress: the same trace as trace_load, and progress that
 * goes forward to the file's size: a text trace every 65,536 lines, a
 * snapshot about every 1/128 of it and 1 MiB at least; a compressed trace
 * as it is decompressed (at least `steps` times: a step writes 8 MiB at
 * most), to the whole input, then as its text is read. */
static void expect_progress(const char *path, size_t readings, size_t steps) {
  trace_t plain, told;
  assert_int_equal(trace_load(path, &plain), GCA_OK);
  progress_seen_t seen = {.forward = true};
  assert_int_equal(trace_load_progress(path, &told, see_progress, &seen), GCA_OK);
  assert_true(trace_equal(&plain, &told));
  if (seen.reading != readings) fprintf(stderr, "%s: %zu readings told, not %zu\n", path, seen.reading, readings);
  assert_int_equal(seen.reading, readings);
  assert_true(seen.forward);
  if (seen.decompressing < steps || (!steps && seen.decompressing))
    fprintf(stderr, "%s: decompressing told %zu times, not %zu\n", path, seen.decompressing, steps);
  assert_true(steps ? seen.decompressing >= steps : seen.decompressing == 0);
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  if (steps) {
    assert_int_equal(seen.packed, (uint64_t)st.st_size);
    assert_int_equal(seen.packed_read, (uint64_t)st.st_size);
  } else {
    assert_int_equal(seen.total, (uint64_t)st.st_size);
  }
  trace_free(&plain);
  trace_free(&told);
}

static void test_load_progress(void **state) {
  (void)state;
  /* 200,000 lines of each text format: told at lines 65,536, 131,072 and
   * 196,608 (the gcalloc trace's lines counted from its header). */
  const size_t lines = 200000;
  FILE *f = fopen("gcalloc-scratch-progress.log", "w");
  assert_non_null(f);
  for (size_t k = 0; k < lines; k++) fprintf(f, "%zu %zu 512\n", 2 * k, 2 * k + 1);
  fclose(f);
  expect_progress("gcalloc-scratch-progress.log", 3, 0);
  f = fopen("gcalloc-scratch-progress.csv", "w");
  assert_non_null(f);
  fprintf(f, "Thread,Time,Action,Pointer,Size,Stream\n");
  for (size_t k = 0; k + 1 < lines; k += 2)
    fprintf(f, "1,00:00:%02zu.%06zu,allocate,0x7f0000000000,512,0x0\n1,00:00:%02zu.%06zu,free,0x7f0000000000,512,0x0\n",
            k / 1000000 % 60, k % 1000000, k / 1000000 % 60, k % 1000000 + 1);
  fclose(f);
  expect_progress("gcalloc-scratch-progress.csv", 3, 0);
  f = fopen("gcalloc-scratch-progress.trace", "w");
  assert_non_null(f);
  fprintf(f, "# gcalloc trace 1\n1 7 open 0 sim -\n");
  for (size_t k = 0; k + 3 < lines; k += 2)
    fprintf(f, "%zu 7 malloc 0 0 0 512 200000000000\n%zu 7 free 0 200000000000 0\n", k + 2, k + 3);
  fclose(f);
  expect_progress("gcalloc-scratch-progress.trace", 3, 0);
  /* Compressed, decompressing then reading what it holds: the log (2.6 MB)
   * in one step, the RMM log (10.4 MB) in two, each way the replay reads. */
  const char *plain[] = {"gcalloc-scratch-progress.log", "gcalloc-scratch-progress.csv"};
  for (int i = 0; i < 2; i++) {
    size_t len;
    unsigned char *data = read_whole(plain[i], &len);
    assert_non_null(data);
    packed_t packs[] = {gzip_of(data, len, 1), gzip_of(data, len, 3), zstd_of(data, len), xz_of(data, len),
                        bzip2_of(data, len)};
    for (size_t k = 0; k < sizeof packs / sizeof packs[0]; k++) {
      write_bytes("gcalloc-scratch-progress.packed", packs[k].bytes, packs[k].len);
      expect_progress("gcalloc-scratch-progress.packed", 3, (size_t)i + 1);
      free(packs[k].bytes);
    }
    free(data);
  }
  /* A snapshot of 2.6 MB (a real one): at its first dict, then past 1 MiB and 2 MiB. */
  if (real_traces_dir()) expect_progress(real_path("cranberrii__ftcourse/memory_snapshot.pickle"), 3, 0);
  remove("gcalloc-scratch-progress.log");
  remove("gcalloc-scratch-progress.csv");
  remove("gcalloc-scratch-progress.trace");
  remove("gcalloc-scratch-progress.packed");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pickle_values),     cmocka_unit_test(test_pickle_pruned), cmocka_unit_test(test_pickle_truncations_fail_cleanly),
      cmocka_unit_test(test_pickle_refuses_objects), cmocka_unit_test(test_pickle_long_reference_run),
      cmocka_unit_test(test_pickle_runs_seen_before), cmocka_unit_test(test_pickle_memo_values),
      cmocka_unit_test(test_sample_snapshots), cmocka_unit_test(test_piped_traces),
      cmocka_unit_test(test_compressed_traces),
      cmocka_unit_test(test_bad_text_trace), cmocka_unit_test(test_flat_reader_same_as_machine),
      cmocka_unit_test(test_blocks_as_records),
      cmocka_unit_test(test_flat_reader_dict_alone_in_pruned_list), cmocka_unit_test(test_flat_reader_mutations), cmocka_unit_test(test_second_reader),
      cmocka_unit_test(test_big_arrays),        cmocka_unit_test(test_load_progress),
      cmocka_unit_test(test_many_entries),
  };
  /* CTest runs the second reader's test apart too, under the label the
   * ThreadSanitizer build runs (tests/CMakeLists.txt). */
  if (getenv("GCALLOC_TEST_ONLY")) cmocka_set_test_filter(getenv("GCALLOC_TEST_ONLY"));
  if (getenv("GCALLOC_TEST_SKIP")) cmocka_set_skip_filter(getenv("GCALLOC_TEST_SKIP"));
  /* The real-trace group: the same checks on the real snapshots, and their counts. */
  const struct CMUnitTest real[] = {
      cmocka_unit_test(test_real_traces),          cmocka_unit_test(test_piped_traces),
      cmocka_unit_test(test_compressed_traces),    cmocka_unit_test(test_flat_reader_same_as_machine),
      cmocka_unit_test(test_flat_reader_mutations), cmocka_unit_test(test_second_reader),
      cmocka_unit_test(test_load_progress),
  };
  if (real_traces_dir()) return cmocka_run_group_tests_name("real traces", real, NULL, NULL);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
