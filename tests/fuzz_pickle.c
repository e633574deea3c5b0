/* libFuzzer target for the snapshot reader (label `replay`): the pickle
 * reader on arbitrary bytes, then, for what parses as a snapshot, the
 * conversion to a trace and a replay of it on the simulated device. Built
 * only with clang (-fsanitize=fuzzer), with AddressSanitizer and UBSan;
 * CTest runs it for a short while from the seeds in tests/fuzz/seeds, and
 * any crash, leak, sanitizer report or timeout fails the test. */
#include <stddef.h>
#include <stdint.h>

#include "internal.h"
#include "export/pickle.h"
#include "export/replay.h"
#include "export/trace.h"

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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  pickle_doc_t *doc = pickle_parse(data, size);
  if (doc) {
    size_t budget = 100000;
    walk(pickle_root(doc), 0, &budget);
    pickle_free(doc);
  }
  trace_t t;
  if (trace_parse_snapshot("fuzz", data, size, &t) != GCA_OK) return 0;
  /* Replays stay small so that one input costs milliseconds. */
  if (t.count <= 4096) {
    replay_options_t o = {.device = -1, .infer_empty_cache = true, .match_segments = true, .timeline = true,
                          .capacity = (uint64_t)64 << 30};
    replay_result_t r;
    if (replay_trace(&t, &o, &r) == GCA_OK) replay_result_free(&r);
  }
  trace_free(&t);
  return 0;
}
