/* The replay toolkit's view of the allocator (inspect.h): each call finds
 * the device, checks its arguments, and reads or sets what the toolkit
 * needs, so that replay/, tools/ and bench/ never touch a core structure.
 */
#include "core/core.h"
#include "core/expandable.h"

int gca__inspect_books(gca_allocator_t *a, int device, gca__books_t *out) {
  device_t *d = gca__device_of(a, device, "gca__inspect_books");
  if (!d) return gca_last_status();
  out->reserved = family_current(&d->stats, FAM_RESERVED_BYTES);
  out->allocated = family_current(&d->stats, FAM_ALLOCATED_BYTES);
  out->requested = family_current(&d->stats, FAM_REQUESTED_BYTES);
  out->pages_mapped = d->vm.pages_mapped;
  out->pages_unmapped = d->vm.pages_unmapped;
  return GCA_OK;
}

int gca__inspect_settings(gca_allocator_t *a, gca__settings_t *out) {
  if (!a) return gca__set_error(GCA_ERR_INVALID, "gca__inspect_settings: allocator is NULL");
  out->max_split_size = a->config.max_split_size;
  out->expandable_segments = a->config.expandable_segments;
  return GCA_OK;
}

int gca__inspect_observe_segments(gca_allocator_t *a, int device, gca__segment_observer_fn fn, void *ctx) {
  device_t *d = gca__device_of(a, device, "gca__inspect_observe_segments");
  if (!d) return gca_last_status();
  d->obs.segment_fn = fn;
  d->obs.segment_ctx = fn ? ctx : NULL;
  d->obs.segment_call = fn ? gca__segment_observer_call : NULL;
  return GCA_OK;
}

const struct backend *gca__inspect_backend(const gca_allocator_t *a) { return a ? &a->backend : NULL; }

int gca__inspect_census(gca_allocator_t *a, int device, bool maps, page_census_t *out) {
  device_t *d = gca__device_of(a, device, "gca__inspect_census");
  if (!d) return gca_last_status();
  return gca__expandable_census(d, maps, out);
}

int gca__inspect_census_counts(gca_allocator_t *a, int device, page_census_t *out) {
  device_t *d = gca__device_of(a, device, "gca__inspect_census_counts");
  if (!d) return gca_last_status();
  gca__expandable_census_counts(d, out);
  return GCA_OK;
}
