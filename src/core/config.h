/* The allocator's settings (config.c) and PyTorch's sizing rules
 * (size.c): what a configuration string sets, and how a request's size
 * becomes a block's and a segment's.
 */
#ifndef GCALLOC_CORE_CONFIG_H
#define GCALLOC_CORE_CONFIG_H

#include "base/base.h"
#include "core/inspect.h"

typedef struct config {
  size_t max_split_size;          /* SIZE_MAX: unlimited (no oversize rules) */
  size_t max_non_split_rounding;  /* bytes an oversize block may exceed the request by */
  size_t roundup_divisions[ROUNDUP_INTERVALS];
  double gc_threshold;            /* 0: off */
  double memory_fraction;         /* of each device's total the process may reserve */
  bool memory_fraction_set;       /* the key was given (enforced, and GC may run) */
  uint64_t oom_retry_timeout_ms;  /* 0: an allocation that cannot be served fails at once */
  uint32_t oom_handler_retries;   /* rounds of OOM handlers asking for another try */
  size_t pinned_num_register_threads;
  bool expandable_segments;
  /* expandable_segments was given. Where it was not, it follows
   * ipc_cooperation: a cooperating process's free pages inside segments in
   * use can go back to a peer only from expandable segments (docs/sharing.md). */
  bool expandable_segments_set;
  /* gcalloc's own, with expandable segments: before mapping new memory,
   * move whole free pages of the same pool and stream into place. */
  bool stitching;
  bool release_lock_on_malloc;
  bool pinned_use_host_register;
  bool pinned_use_background_threads;
  size_t pinned_reserve_segment_mb; /* 0: none; the pinned allocator pins it at the first miss that finds it set */
  bool backend_async;             /* backend:cudaMallocAsync */
  /* A miss may take a whole segment cached for another stream, up to this
   * many times the size of the segment the device would be asked for:
   * 0 off, HUGE_VAL any size. */
  double cross_stream_reuse;
  bool any_divisions;             /* some roundup_divisions[i] > 1, or page_rounding: rounding takes the slow path */
  /* Cooperating with expandable segments: a request above SMALL_SIZE is
   * rounded to whole 2 MiB pages, as an ordinary segment's block is, so
   * that no page holds parts of two blocks: a free block's pages can all go
   * back to a peer, and "the live memory fits" means the pages fit. */
  bool page_rounding;
  /* pad_32_bytes (gcalloc's own, for torch_npu's sizing): PAD_AUTO asks
   * the backend (backend_ops_t.size_pad), PAD_ON and PAD_OFF decide. */
  int pad_32_mode;
  size_t size_pad;                /* bytes added before rounding, resolved per device */
  /* torch_npu's base_addr_aligned_kb: -1 the backend's default
   * (backend_ops_t.base_align), else KiB; base_align its bytes, resolved
   * per device (0: no alignment). */
  int base_addr_aligned_kb;
  size_t base_align;
  /* throw_on_cudamalloc_oom / throw_on_npumalloc_oom: a request the
   * fraction would refuse fails at once, the cache left alone. */
  bool throw_on_malloc_oom;
  /* gcalloc's own: cooperation between processes on a device (coop.c). */
  bool ipc_cooperation;
  bool ipc_group_access;
  uint64_t ipc_release_timeout_ms;
} config_t;

enum { PAD_AUTO = 0, PAD_ON = 1, PAD_OFF = 2 };

void gca__config_defaults(config_t *cfg);

/* Apply `text` on top of *cfg. `origin` names where the text came from (an
 * environment variable, or NULL for code) and is quoted in messages. On error
 * *cfg is untouched, the error is set and GCA_ERR_CONFIG returned. Warnings
 * (unknown keys, features not built) go to the log. */
int gca__config_apply(config_t *cfg, const char *text, const char *origin);

/* Render *cfg as a configuration string; returns the full length. */
size_t gca__config_format(const config_t *cfg, char *buf, size_t cap);

/* Sizing rules (size.c). */

/* PyTorch's round_size (torch_npu's, with cfg->size_pad added first); 0
 * when `size` is too large to round. */
size_t gca__round_size(const config_t *cfg, size_t size);
/* Round up to the next of `divisions` equal steps between the surrounding
 * powers of two (PyTorch's roundup_power2_next_division); 0 on overflow. */
size_t gca__round_to_division(size_t size, size_t divisions);
/* The roundup_power2_divisions interval of `size`: floor(log2 size) - 20, clamped to 0..15. */
int gca__roundup_interval(size_t size);
/* PyTorch's get_allocation_size; 0 when it would overflow. */
size_t gca__segment_size_for(size_t rounded);

#endif /* GCALLOC_CORE_CONFIG_H */
