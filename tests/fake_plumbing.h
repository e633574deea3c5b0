/* What the driver stand-ins (fake_cuda.c, fake_acl.c) share: one lock for
 * all their state, a count of the calls of each entry point, and injected
 * failures (an entry point fails with a code after `skip` more calls,
 * `times` times). Each stand-in exports its own fake*_fail and
 * fake*_calls on top of these, and opens every entry point with
 * ENTER(name) and leaves it with LEAVE(code). */
#ifndef GCALLOC_FAKE_PLUMBING_H
#define GCALLOC_FAKE_PLUMBING_H

#include <pthread.h>
#include <stdio.h>
#include <string.h>

typedef struct injection {
  char entry[64];
  unsigned skip, times;
  int code;
} injection_t;

typedef struct call_count {
  char entry[64];
  unsigned long calls;
} call_count_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static injection_t injections[32];
static call_count_t counts[128];

static void plumbing_reset(void) {
  memset(injections, 0, sizeof injections);
  memset(counts, 0, sizeof counts);
}

static void plumbing_fail(const char *entry, unsigned skip, unsigned times, int code) {
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < sizeof injections / sizeof injections[0]; i++)
    if (!injections[i].times) {
      snprintf(injections[i].entry, sizeof injections[i].entry, "%s", entry);
      injections[i].skip = skip;
      injections[i].times = times;
      injections[i].code = code;
      break;
    }
  pthread_mutex_unlock(&lock);
}

static unsigned long plumbing_calls(const char *entry) {
  unsigned long n = 0;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
    if (!strcmp(counts[i].entry, entry)) n = counts[i].calls;
  pthread_mutex_unlock(&lock);
  return n;
}

/* Count the call; an injected failure's code, or 0. With the lock held. */
static int plumbing_enter(const char *entry) {
  size_t i;
  for (i = 0; i < sizeof counts / sizeof counts[0] && counts[i].entry[0]; i++)
    if (!strcmp(counts[i].entry, entry)) break;
  if (i < sizeof counts / sizeof counts[0]) {
    if (!counts[i].entry[0]) snprintf(counts[i].entry, sizeof counts[i].entry, "%s", entry);
    counts[i].calls++;
  }
  for (size_t k = 0; k < sizeof injections / sizeof injections[0]; k++) {
    injection_t *in = &injections[k];
    if (!in->times || strcmp(in->entry, entry)) continue;
    if (in->skip) {
      in->skip--;
      continue;
    }
    in->times--;
    return in->code;
  }
  return 0;
}

#define ENTER(name)                    \
  pthread_mutex_lock(&lock);           \
  int rc_ = plumbing_enter(name);      \
  if (rc_) {                           \
    pthread_mutex_unlock(&lock);       \
    return rc_;                        \
  }
#define LEAVE(code)              \
  do {                           \
    pthread_mutex_unlock(&lock); \
    return (code);               \
  } while (0)

#endif /* GCALLOC_FAKE_PLUMBING_H */
