/* Helpers the Python package's tests and bench/python_frames.py load with
 * ctypes: allocations from a thread C made (it has no Python thread state,
 * so its stacks have no Python frames), and a loop of allocations run in C
 * (what recording costs per allocation, without ctypes' own cost). */
#include <pthread.h>
#include <time.h>

#include "gcalloc.h"

int gcalloc_test_alloc_in_c_thread(gca_allocator_t *a, size_t size);
double gcalloc_test_pairs_ns(gca_allocator_t *a, size_t size, long n);

typedef struct job {
  gca_allocator_t *a;
  size_t size;
  int rc;
} job_t;

static void *alloc_and_free(void *arg) {
  job_t *j = arg;
  void *p = gca_malloc(j->a, j->size, 0, 0);
  j->rc = p ? gca_free(j->a, p) : gca_last_status();
  return NULL;
}

/* One allocation and its free on a new C thread; gca_status. */
int gcalloc_test_alloc_in_c_thread(gca_allocator_t *a, size_t size) {
  job_t j = {a, size, -1};
  pthread_t t;
  if (pthread_create(&t, NULL, alloc_and_free, &j)) return -1;
  pthread_join(t, NULL);
  return j.rc;
}

/* n malloc+free pairs of `size` on this thread: ns per pair, or -1 when one failed. */
double gcalloc_test_pairs_ns(gca_allocator_t *a, size_t size, long n) {
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < n; i++) {
    void *p = gca_malloc(a, size, 0, 0);
    if (!p || gca_free(a, p) != GCA_OK) return -1;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)n;
}
