/* The replay toolkit's own utilities: big arrays for what a trace reader
 * fills at once, and reading a whole stream. The library never needs them,
 * so they live here, beside their only users.
 */
#ifndef GCALLOC_REPLAY_UTIL_H
#define GCALLOC_REPLAY_UTIL_H

#include <stddef.h>
#include <stdio.h>

/* The mapping step of a big array (a 2 MiB huge page): an arena of big
 * chunks rounds each chunk up to it. */
#define BIG_PAGE ((size_t)2 << 20)

/* Arrays of megabytes filled at once (the pickle reader's memo, a
 * snapshot's events): zero-filled, and from 256 KiB on mapped on their own
 * (4 KiB pages: util.c, big_map, says why not huge ones), so that freeing
 * one gives its memory back at once and a freed one can be kept whole for
 * the next (a process that reads trace after trace then faults nothing in
 * again). `bytes` must be what the array was allocated or last grown to.
 * big_rezalloc zero-fills the new part; on failure it returns NULL and
 * leaves the array as it was. A few freed mappings are kept for reuse, as
 * malloc keeps freed memory. */
void *gca__big_zalloc(size_t bytes);
/* The same, not zero-filled (a kept mapping is handed out as it was). */
void *gca__big_alloc(size_t bytes);
void *gca__big_rezalloc(void *array, size_t old_bytes, size_t new_bytes);
/* big_rezalloc without the zero fill, for an array written before it is
 * read (the new part is garbage where a kept mapping is reused). */
void *gca__big_regrow(void *array, size_t old_bytes, size_t new_bytes);
void gca__big_free(void *array, size_t bytes);
/* For a process that reads trace after trace (trace_load calls it from
 * the second on: the benchmark's runs in one process, a script's loop):
 * big arrays mapped from then on ask for transparent huge pages, and the
 * kept mappings, on 4 KiB pages, are given back. The new ones are kept and
 * reused in turn, so the kernel's cost of backing a huge page (high on a
 * VM after idle: big_map in util.c) is paid once, and every later read runs
 * on fewer TLB entries: on 4 KiB pages, reads in one process were 4-6%
 * slower. */
void gca__big_prefer_huge_pages(void);

/* All of what is left to read from f (a pipe, say, which cannot be mapped or
 * read twice), malloc'd with a NUL after it (*len excludes it); NULL with
 * the error set, naming `name`, when it cannot be read or held. */
unsigned char *gca__read_stream(FILE *f, const char *name, size_t *len);

#endif /* GCALLOC_REPLAY_UTIL_H */
