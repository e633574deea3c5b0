/* libFuzzer target for the snapshot reader (label `replay`): the pickle
 * reader on arbitrary bytes, then, for what parses as a snapshot, the
 * conversion to a trace (also with its call stacks, which must give the
 * same trace) and a replay of it on the simulated device. The
 * reader's fast paths (the loop for flat dicts, snapshot entries taken as
 * they are read, and for one input in 16 the second reader) are
 * checked against its general machine alone on every input: the same tree
 * and trace, or the same error, else abort; so is the guard on piped
 * input (pickle_scan), which must never refuse what the reader reads. Built
 * only with clang (-fsanitize=fuzzer), with AddressSanitizer and UBSan;
 * CTest runs it for a short while from the seeds in tests/fuzz/seeds, and
 * any crash, leak, sanitizer report, mismatch or timeout fails the test. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "replay/pickle.h"
#include "replay/replay.h"
#include "replay/trace.h"
#include "fuzz_common.h"

/* Walk the values reachable from v, as a reader of the tree would, up to a
 * budget: the memo makes the tree a DAG whose paths can be exponential. */
static void walk(const pv_t *v, int depth, size_t *budget) {
  if (!v || depth > 64 || !*budget) return;
  --*budget;
  for (size_t i = 0; i < pv_len(v); i++) {
    if (v->kind == PV_DICT) {
      walk(pv_key_at(v, i), depth + 1, budget);
      walk(pv_value_at(v, i), depth + 1, budget);
    } else {
      walk(pv_at(v, i), depth + 1, budget);
    }
  }
}

static void mismatch(const char *what, const char *slow_error) {
  fprintf(stderr, "fast path and machine disagree on %s: machine \"%s\", fast \"%s\"\n", what, slow_error,
          gca_last_error());
  abort();
}

/* The guard on piped input (pickle_scan) never refuses what the reader
 * reads, and gives the same outcome fed in pieces as fed whole. */
static void check_scan(const uint8_t *data, size_t size, bool parsed) {
  pickle_scan_t whole = {0}, pieces = {0};
  bool whole_ok = pickle_scan(&whole, data, size);
  char whole_error[1024];
  snprintf(whole_error, sizeof whole_error, "%s", whole_ok ? "" : gca_last_error());
  bool pieces_ok = true;
  for (size_t end = 0; pieces_ok && end < size;) {
    end += 1 + data[end] % 13;
    if (end > size) end = size;
    pieces_ok = pickle_scan(&pieces, data, end);
  }
  if (whole_ok != pieces_ok || (!whole_ok && strcmp(whole_error, gca_last_error())) ||
      (whole_ok && (whole.at != pieces.at || whole.stopped != pieces.stopped))) {
    fprintf(stderr, "pickle_scan whole and in pieces disagree: \"%s\" and \"%s\"\n", whole_error,
            pieces_ok ? "" : gca_last_error());
    abort();
  }
  if (!whole_ok && parsed) {
    fprintf(stderr, "pickle_scan refused what the reader reads: %s\n", whole_error);
    abort();
  }
}

/* The flat-dict loop against the machine alone, with and without pruning;
 * whether it parsed. */
static bool check_parse(const uint8_t *data, size_t size, const char *pruned_key) {
  pickle_options_t machine = {.pruned_key = pruned_key, .machine_only = true}, fast = {.pruned_key = pruned_key};
  pickle_doc_t *slow_doc = pickle_parse(data, size, &machine);
  char slow_error[1024];
  snprintf(slow_error, sizeof slow_error, "%s", slow_doc ? "" : gca_last_error());
  pickle_doc_t *doc = pickle_parse(data, size, &fast);
  size_t budget = 100000;
  if (!doc != !slow_doc || (!doc && strcmp(slow_error, gca_last_error())) ||
      (doc && !pv_equal(pickle_root(slow_doc), pickle_root(doc), 0, &budget)))
    mismatch("a tree", slow_error);
  if (doc) {
    budget = 100000;
    walk(pickle_root(doc), 0, &budget);
  }
  bool parsed = doc != NULL;
  pickle_free(doc);
  pickle_free(slow_doc);
  return parsed;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_scan(data, size, check_parse(data, size, NULL));
  check_parse(data, size, "frames");
  trace_t t, slow;
  int slow_rc = trace_parse_snapshot_slowly("fuzz", data, size, &slow);
  char slow_error[1024];
  snprintf(slow_error, sizeof slow_error, "%s", slow_rc ? gca_last_error() : "");
  int rc = trace_parse_snapshot("fuzz", data, size, &t);
  if (rc != slow_rc || (rc && strcmp(slow_error, gca_last_error())) || (!rc && !trace_equal(&t, &slow)))
    mismatch("a trace", slow_error);
  /* The second reader (pickle.c, "Reading on two cores") started at an
   * offset the input picks, for one input in 16 (it is a thread). */
  if (size > 1 && data[size / 2] % 16 == 0) {
    trace_t split;
    size_t at = 1 + ((size_t)data[0] * 131 + size) % (size - 1);
    int split_rc = trace_parse_snapshot_split("fuzz", data, size, at, &split);
    if (split_rc != slow_rc || (split_rc && strcmp(slow_error, gca_last_error())) ||
        (!split_rc && !trace_equal(&split, &slow)))
      mismatch("a trace read on two threads", slow_error);
    if (!split_rc) trace_free(&split);
  }
  /* With call stacks (frames not pruned, one reader): the same trace
   * where the plain reading gave one, and stacks only where they belong. */
  trace_t with;
  int with_rc = trace_parse_snapshot_stacks("fuzz", data, size, &with);
  if (!slow_rc && (with_rc || !trace_equal(&with, &slow))) mismatch("a trace read with its stacks", slow_error);
  for (size_t i = 0; !with_rc && with.event_stacks && i < with.count; i++) {
    uint32_t s = with.event_stacks[i];
    if (s >= with.stack_count || (s && (with.events[i].action != TA_ALLOC || !with.stacks[s] ||
                                        !strlen(with.stacks[s]))))
      mismatch("a stack", "");
  }
  if (!with_rc) trace_free(&with);
  if (!slow_rc) trace_free(&slow);
  if (rc != GCA_OK) return 0;
  fuzz_replay_small(&t);
  trace_free(&t);
  return 0;
}
