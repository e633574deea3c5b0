/* The allocator's insides as the replay toolkit sees them: the one header of
 * the library's internals that replay/, tools/ and bench/ include (with the
 * base utilities and the simulator's driver API); everything else they reach
 * through gcalloc.h. Each function takes the allocator and a device index,
 * never a core structure, so the core can change its layout without the
 * toolkit seeing it. The toolkit replays on one thread: these read the books
 * as they are, without the device's lock, and must not race an allocation.
 */
#ifndef GCALLOC_INSPECT_H
#define GCALLOC_INSPECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gcalloc.h"

/* PyTorch's constants (CUDACachingAllocator.cpp): the sizing rules the
 * core applies and the replay plans with. */
#define KIB ((size_t)1024)
#define MIB ((size_t)1024 * 1024)
#define MIN_BLOCK_SIZE ((size_t)512)     /* kMinBlockSize: every size is a multiple */
#define SMALL_SIZE MIB                   /* kSmallSize: largest small-pool request */
#define SMALL_BUFFER (2 * MIB)           /* kSmallBuffer: small-pool segment */
#define MIN_LARGE_ALLOC (10 * MIB)       /* kMinLargeAlloc: below it, a LARGE_BUFFER segment */
#define LARGE_BUFFER (20 * MIB)          /* kLargeBuffer: segment for mid-size requests */
#define ROUND_LARGE (2 * MIB)            /* kRoundLarge: big segments round up to this */
#define ROUNDUP_INTERVALS 16             /* roundup_power2_divisions intervals, 1 MiB .. 64 GiB */

/* A device's books at one moment: the current bytes of both default pools
 * and the private ones, and the expandable pages mapped and unmapped so far. */
typedef struct gca__books {
  int64_t reserved, allocated, requested;
  uint64_t pages_mapped, pages_unmapped;
} gca__books_t;
int gca__inspect_books(gca_allocator_t *a, int device, gca__books_t *out);

/* The settings the replay's plan depends on. */
typedef struct gca__settings {
  size_t max_split_size;     /* SIZE_MAX when unlimited */
  bool expandable_segments;
} gca__settings_t;
int gca__inspect_settings(gca_allocator_t *a, gca__settings_t *out);

/* Tell fn of every segment the device gives (alloc true) or takes back,
 * from now on; fn NULL stops it. fn is called under the device's lock, in
 * the middle of the change: every gcalloc call made from it fails at once
 * with GCA_ERR_INVALID (core.h, callback frames). */
typedef void (*gca__segment_observer_fn)(void *ctx, bool alloc, size_t size);
int gca__inspect_observe_segments(gca_allocator_t *a, int device, gca__segment_observer_fn fn, void *ctx);

/* The backend the allocator drives: the simulator's driver API
 * (backends/sim_driver.h) takes it. */
const struct backend *gca__inspect_backend(const gca_allocator_t *a);

/* The pages of a device's expandable segments at one moment: what is
 * mapped, and what is not below each range's highest mapped page (the
 * holes; the reservation above it is address space only). */
enum { PAGE_RUN_UNMAPPED = 3 }; /* a page_run_t state beside GCA_BLOCK_* */
typedef struct page_run {
  uint64_t size;
  uint8_t state;             /* GCA_BLOCK_* of a mapped block, or PAGE_RUN_UNMAPPED */
} page_run_t;
typedef struct page_range {
  uintptr_t addr;
  uint64_t reserved;         /* the address range */
  uint64_t extent;           /* up to the end of its highest mapped page */
  uint64_t page_size;
  int pool;                  /* GCA_POOL_SMALL or GCA_POOL_LARGE */
  gca_stream_t stream;
  uint64_t mapped_pages, free_pages, unmapped_pages;
  page_run_t *runs;          /* the blocks of [addr, addr + extent) in address order */
  size_t run_count;
} page_range_t;
typedef struct page_census {
  size_t ranges;
  uint64_t reserved_bytes;   /* address space of the ranges */
  uint64_t mapped_pages, mapped_bytes;
  uint64_t free_pages, free_bytes;         /* mapped pages inside free blocks: what empty_cache unmaps */
  uint64_t unmapped_pages, unmapped_bytes; /* holes below each range's highest mapped page */
  page_range_t *maps;        /* with maps: `ranges` of them */
} page_census_t;
/* Count (and with `maps`, draw) the pages; GCA_ERR_NOMEM if the maps cannot
 * be had. Free with gca__page_census_free. */
int gca__inspect_census(gca_allocator_t *a, int device, bool maps, page_census_t *out);
/* The same counts without maps, from what the device keeps up to date
 * (each range's mapped bytes and top, the free indexes): cheap enough to
 * take at every new peak of a replay. Nothing to free. */
int gca__inspect_census_counts(gca_allocator_t *a, int device, page_census_t *out);
void gca__page_census_free(page_census_t *c);

#endif /* GCALLOC_INSPECT_H */
