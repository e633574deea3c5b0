/* Cooperation between processes on one device (coop.c): the rendezvous,
 * release requests to the peers and their answers.
 */
#ifndef GCALLOC_CORE_COOP_H
#define GCALLOC_CORE_COOP_H

#include "core/core.h"

/* ---- cooperation between processes (coop.c) ---- */
typedef struct coop coop_t;
typedef struct coop_outcome {
  int asked, timeouts;
  int gone; /* peers that left or died while asked (their memory on its way back) */
  size_t received;
  char said[512];    /* what each peer asked did, for the out-of-memory message */
} coop_outcome_t;
/* Join the device's rendezvous (its identity names it); a thread answers
 * peers' requests until gca__coop_leave. */
int gca__coop_join(device_t *d, const char *identity, coop_t **out);
void gca__coop_leave(coop_t *c);
/* Unmap the rendezvous and free this process's handle, leaving the slot
 * and the region as they are (a child of fork: the slot is its parent's,
 * and so is the answering thread). */
void gca__coop_forget(coop_t *c);
/* In a child of fork, at once: close the child's copy of the region's file,
 * so that the parent's lock byte goes with the parent (gca__slot_alive). */
void gca__coop_after_fork_child(coop_t *c);
/* Ask the peers that cache most to release, for `need` bytes, and wait up
 * to `timeout_ms` (ipc_release_timeout_ms, read by the caller under the
 * device's lock), or until `deadline_ns` (CLOCK_MONOTONIC) when that is
 * sooner (0: no such limit); returns the bytes released. Without the
 * device lock, so from several threads of the process at once: all it
 * writes is `out` and the shared region. */
size_t gca__coop_ask(coop_t *c, size_t need, uint64_t deadline_ns, uint64_t timeout_ms, coop_outcome_t *out);
/* With the device's lock held again: count what a request to the peers did
 * (num_ipc_requests and the rest; the history's ipc_request entry), and
 * keep what it said for the message. */
void gca__device_peers_answered(device_t *d, size_t need, gca_stream_t stream, const coop_outcome_t *got);
/* With the device's lock held: keep what a request said; and what the
 * last request kept got, by peer, for the out-of-memory message. */
void gca__coop_keep_said(coop_t *c, const coop_outcome_t *got);
const char *gca__coop_last(const coop_t *c);
/* The live bytes the peers last published (allocated, paused pools apart),
 * summed over the live slots; without any lock. */
size_t gca__coop_peers_live(const coop_t *c);
/* Add a request's outcome (when `got`), and an avoidable out-of-memory, to
 * the counters the process publishes. */
void gca__coop_count(coop_t *c, const coop_outcome_t *got, bool avoidable);
int gca__coop_peers(coop_t *c, gca_ipc_peer_t *out, size_t cap);

#endif /* GCALLOC_CORE_COOP_H */
