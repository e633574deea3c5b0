/* Cooperation between processes on one device (coop.c): the rendezvous,
 * release requests to the peers and their answers.
 */
#ifndef GCALLOC_CORE_COOP_H
#define GCALLOC_CORE_COOP_H

#include "core/core.h"

/* ---- cooperation between processes (coop.c) ---- */
typedef struct coop coop_t;
#define COOP_SLOTS 64
/* What one peer asked did. */
typedef enum { COOP_ANSWERED = 1, COOP_GONE, COOP_SILENT, COOP_STALE, COOP_WITHDRAWN } coop_answer_state_t;
typedef struct coop_answer {
  int32_t pid;
  uint8_t state;     /* coop_answer_state_t */
  uint64_t released; /* its answer's bytes */
  uint64_t cached;   /* what it published when asked */
  uint64_t silent_ms; /* COOP_STALE: since it last published */
} coop_answer_t;
/* One round of requests to the peers. */
typedef struct coop_outcome {
  int asked, timeouts;
  int gone; /* peers that left or died while asked (their memory on its way back) */
  size_t received;
  int n;    /* peers[0, n): each peer asked */
  coop_answer_t peers[COOP_SLOTS];
  char note[160]; /* why nobody was asked, where that was not for want of cache */
} coop_outcome_t;
/* Every round of one out-of-memory's requests, per peer, for its message
 * and its counters: a peer's releases summed over the rounds. */
typedef struct coop_tally {
  int rounds;        /* rounds that asked anyone */
  uint64_t timeout_ms;
  int n;
  coop_answer_t peers[COOP_SLOTS];
  char note[160];
} coop_tally_t;
void gca__coop_tally_add(coop_tally_t *t, const coop_outcome_t *got, uint64_t timeout_ms);
/* With the device's lock held, once per out-of-memory that asked: count
 * the request (num_ipc_requests, the published counter) and keep its text
 * for the message. */
void gca__coop_tally_keep(coop_t *c, const coop_tally_t *t);
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
/* With the device's lock held again: count what a round of requests did
 * (num_ipc_rounds and the rest; the history's ipc_request entry) into
 * `tally` (NULL: a request of its own, counted and kept at once). */
void gca__device_peers_answered(device_t *d, size_t need, gca_stream_t stream, const coop_outcome_t *got,
                                coop_tally_t *tally);
/* With the device's lock held: one out-of-memory's requests done (counted
 * once, kept for the message). */
void gca__device_peers_done(device_t *d, const coop_tally_t *tally);
/* With the device's lock held: what the last request got, by peer, for
 * the out-of-memory message. */
const char *gca__coop_last(const coop_t *c);
/* What every other member holds, as last published, into buf ("pid 4242
 * holds 80.00 MiB, 0 B of it cached; ..."; "no other process" when
 * alone), for a message. No lock: a member's figures are atomics. */
void gca__coop_describe_others(const coop_t *c, char *buf, size_t cap);
/* With the device's lock held, after the device's reserved bytes changed
 * (a segment or pages obtained or given back): publish them at once and
 * count the change, so that readers see one consistent view (coop.c). */
void gca__coop_reserved(coop_t *c, int64_t reserved);
/* The device memory in use by no cooperating process (processes without
 * cooperation, the driver), from the device's total and free memory just
 * read and the members' reserved bytes: 0 when negative. */
size_t gca__coop_outside(const coop_t *c, size_t total, size_t free_bytes);
/* The live bytes the peers last published (allocated, paused pools apart),
 * summed over the live slots; without any lock. */
size_t gca__coop_peers_live(const coop_t *c);
/* Add a round's outcome (when `got`), and an avoidable out-of-memory, to
 * the counters the process publishes. */
void gca__coop_count(coop_t *c, const coop_outcome_t *got, bool avoidable);
int gca__coop_peers(coop_t *c, gca_ipc_peer_t *out, size_t cap);

#endif /* GCALLOC_CORE_COOP_H */
