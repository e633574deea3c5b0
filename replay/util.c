/* The replay toolkit's utilities (util.h): big arrays, mapped on their own
 * and kept for reuse, and reading a whole stream.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>

#include "base/base.h"
#include "util.h"

#define BIG_MIN ((size_t)256 << 10)

#if GCA_BIG_MAPPED
static size_t big_size(size_t bytes) { return (bytes + BIG_PAGE - 1) / BIG_PAGE * BIG_PAGE; }

/* A big array's own mapping, on the kernel's ordinary 4 KiB pages: no
 * MADV_HUGEPAGE for a process's first trace. A huge page is faster only
 * where the kernel has one ready: on a virtual machine that hands free
 * memory back to its host (virtio-balloon free page reporting reports free
 * 2 MiB blocks after a few seconds), a huge page taken after the process
 * was idle is backed by the host again first, milliseconds each instead of
 * a fraction of one, and a first read after idle time then costs several
 * times more than 4 KiB pages' extra faults save (docs/benchmarks.md).
 * Sized in 2 MiB steps still, so that a kept mapping fits the next array
 * of about the same size. */
static atomic_bool big_huge;

static void *big_map(size_t bytes) {
  size_t size = big_size(bytes);
  if (size < bytes) return NULL;
  if (atomic_load_explicit(&big_huge, memory_order_relaxed)) return gca__huge_map(size);
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

/* The last mappings freed, kept for the next big array of the same size,
 * as malloc keeps freed memory: a process that reads trace after trace (the
 * benchmark, a tuning loop) then zeroes what it uses instead of having the
 * kernel zero fresh pages, twice as slow, every time. At most BIG_KEPT of
 * them, none over BIG_KEEP_MAX bytes. */
#define BIG_KEPT 6
#define BIG_KEEP_MAX ((size_t)16 << 20)
static pthread_mutex_t big_kept_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  void *start;
  size_t size;
} big_kept[BIG_KEPT];

static void *big_take_kept(size_t size) {
  void *p = NULL;
  pthread_mutex_lock(&big_kept_lock);
  for (int i = 0; i < BIG_KEPT && !p; i++)
    if (big_kept[i].start && big_kept[i].size == size) {
      p = big_kept[i].start;
      big_kept[i].start = NULL;
    }
  pthread_mutex_unlock(&big_kept_lock);
  return p;
}

static bool big_keep(void *start, size_t size) {
  bool kept = false;
  if (size > BIG_KEEP_MAX) return false;
  pthread_mutex_lock(&big_kept_lock);
  for (int i = 0; i < BIG_KEPT && !kept; i++)
    if (!big_kept[i].start) {
      big_kept[i].start = start;
      big_kept[i].size = size;
      kept = true;
    }
  pthread_mutex_unlock(&big_kept_lock);
  return kept;
}

/* A mapping of at least `bytes`: a kept one (*dirty: as its last user left
 * it), else a new one (zero). */
static void *big_get(size_t bytes, bool *dirty) {
  void *kept = big_take_kept(big_size(bytes));
  *dirty = kept != NULL;
  return kept ? kept : big_map(bytes);
}
#endif

void gca__big_prefer_huge_pages(void) {
#if GCA_BIG_MAPPED
  if (atomic_exchange_explicit(&big_huge, true, memory_order_relaxed)) return;
  /* The kept mappings are on 4 KiB pages: given back, so that the next
   * arrays are mapped anew, on huge pages, and those are kept instead. */
  pthread_mutex_lock(&big_kept_lock);
  for (int i = 0; i < BIG_KEPT; i++)
    if (big_kept[i].start) {
      munmap(big_kept[i].start, big_kept[i].size);
      big_kept[i].start = NULL;
    }
  pthread_mutex_unlock(&big_kept_lock);
#endif
}

void *gca__big_alloc(size_t bytes) {
#if GCA_BIG_MAPPED
  bool dirty;
  if (bytes >= BIG_MIN) return big_get(bytes, &dirty);
#endif
  return malloc(bytes ? bytes : 1);
}

void *gca__big_zalloc(size_t bytes) {
#if GCA_BIG_MAPPED
  bool dirty;
  if (bytes >= BIG_MIN) {
    void *p = big_get(bytes, &dirty);
    if (p && dirty) memset(p, 0, bytes); /* (past bytes, big_rezalloc zeroes what it adds) */
    return p;
  }
#endif
  return calloc(1, bytes ? bytes : 1);
}

void gca__big_free(void *array, size_t bytes) {
  if (!array) return;
#if GCA_BIG_MAPPED
  if (bytes >= BIG_MIN) {
    if (!big_keep(array, big_size(bytes))) munmap(array, big_size(bytes));
    return;
  }
#endif
  (void)bytes;
  free(array);
}

/* Grows a big array, the new part zero-filled when `zero`. */
static void *big_grow(void *array, size_t old_bytes, size_t new_bytes, bool zero) {
  if (new_bytes <= old_bytes) return array;
  if (!GCA_BIG_MAPPED || new_bytes < BIG_MIN) {
    char *grown = realloc(array, new_bytes);
    if (grown && zero) memset(grown + old_bytes, 0, new_bytes - old_bytes);
    return grown;
  }
#if GCA_BIG_MAPPED
  if (old_bytes >= BIG_MIN && big_size(new_bytes) == big_size(old_bytes)) {
    if (zero) memset((char *)array + old_bytes, 0, new_bytes - old_bytes); /* (a kept mapping is not zero there) */
    return array;
  }
#endif
  void *grown = zero ? gca__big_zalloc(new_bytes) : gca__big_alloc(new_bytes);
  if (!grown) return NULL;
  if (old_bytes) memcpy(grown, array, old_bytes);
  gca__big_free(array, old_bytes);
  return grown;
}

void *gca__big_rezalloc(void *array, size_t old_bytes, size_t new_bytes) {
  return big_grow(array, old_bytes, new_bytes, true);
}

void *gca__big_regrow(void *array, size_t old_bytes, size_t new_bytes) {
  return big_grow(array, old_bytes, new_bytes, false);
}

unsigned char *gca__read_stream(FILE *f, const char *name, size_t *len) {
  size_t cap = (size_t)64 << 10, used = 0;
  unsigned char *buf = malloc(cap);
  while (buf) {
    used += fread(buf + used, 1, cap - used, f);
    if (used < cap) break; /* the end, or an error (below) */
    unsigned char *bigger = cap <= SIZE_MAX / 2 ? realloc(buf, cap * 2) : NULL;
    if (!bigger) {
      free(buf);
      gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", name);
      return NULL;
    }
    buf = bigger;
    cap *= 2;
  }
  if (!buf) {
    gca__set_error(GCA_ERR_NOMEM, "out of host memory reading %s", name);
    return NULL;
  }
  if (ferror(f)) {
    free(buf);
    gca__set_error(GCA_ERR_IO, "cannot read %s", name);
    return NULL;
  }
  buf[used] = '\0'; /* (used < cap) */
  *len = used;
  return buf;
}
