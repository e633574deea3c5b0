/* What the fuzz targets share: the replay of a trace that loaded, kept small
 * so that one input costs milliseconds. */
#ifndef GCALLOC_FUZZ_COMMON_H
#define GCALLOC_FUZZ_COMMON_H

#include "replay/replay.h"
#include "replay/trace.h"

static inline void fuzz_replay_small(const trace_t *t) {
  if (t->count > 4096) return;
  replay_options_t o = {.device = -1, .infer_empty_cache = true, .match_segments = true, .timeline = true,
                        .capacity = (uint64_t)64 << 30};
  replay_result_t r;
  if (replay_trace(t, &o, &r) == GCA_OK) replay_result_free(&r);
}

#endif
