/* The observability writers (src/observe): trace-file recording, snapshots
 * and their symbol names. The front ends call these; the core reaches trace
 * recording only through the hooks core.h declares (call_recorder).
 */
#ifndef GCALLOC_OBSERVE_H
#define GCALLOC_OBSERVE_H

#include "core/core.h"

/* export/record.c: the trace file (GCALLOC_TRACE_FILE). record_init opens
 * it at the first gca_open and returns a new allocator id. */
bool gca__trace_file_active(void);
int gca__record_init(void);
/* A traced call holds the file's lock (and a log hold) across the call and
 * its line. It is given up around what may block or call the user (OOM
 * callbacks, waits for memory): record_suspend returns how deep this
 * thread held it, record_resume takes it back as deep. Re-entry on the
 * same thread is counted, never a second lock. */
void gca__record_lock_calls(void);
void gca__record_unlock_calls(void);
int gca__record_suspend(void);
void gca__record_resume(int depth);
void gca__record_line(const char *call, const char *fmt, ...) GCA_PRINTF(2, 3);
/* A free that leaves its block pending (events on the streams it was used
 * on) is written so (record_free_left_pending, on the freeing thread, read
 * back by the traced free), and its completion is written when it comes
 * (record_free_completed, under the device lock, from any thread: the line
 * goes out before the next line written, record_lock held or not). */
void gca__record_note_free_pending(void);
bool gca__record_free_left_pending(void);
void gca__record_free_completed(int allocator, uintptr_t ptr);

/* snapshot.c: the configuration a snapshot was taken under. */
const config_t *gca__snapshot_config(const gca_snapshot_t *s);

/* Symbol names in snapshots (snapshot.c): the C++ runtime's
 * __cxa_demangle if the process has it loaded, else NULL; and a copy of
 * `name` in the arena, demangled when it is a C++ name and `demangle` is
 * given (as it was otherwise). NULL when the arena refuses. */
typedef char *(*demangle_fn)(const char *mangled, char *out, size_t *length, int *status);
demangle_fn gca__find_demangler(void);
const char *gca__readable_name(arena_t *ar, demangle_fn demangle, const char *name);

#endif /* GCALLOC_OBSERVE_H */
