/* A stand-in for PyTorch's libc10.so with the one entry point gcalloc's
 * drop-in looks up: c10::detail::torchCheckFail(const char *func, const char
 * *file, uint32_t line, const char *msg), under its mangled name. The real
 * one throws c10::Error and never returns. C cannot throw, so this one jumps
 * back to fake_c10_call_malloc, the stand-in for the pluggable allocator's
 * allocate() frame the exception would pass through on its way to Python
 * (and aborts where no call is under way, as an uncaught exception would
 * terminate). The stand-in torch (python/tests/standin) calls the alloc
 * function through fake_c10_call_malloc when its lib/libc10.so is this. */
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define EXPORT __attribute__((visibility("default")))

static _Thread_local sigjmp_buf *catcher;
static _Thread_local char thrown[8192];

EXPORT void _ZN3c106detail14torchCheckFailEPKcS2_jS2_(const char *func, const char *file, uint32_t line,
                                                      const char *msg) {
  (void)func, (void)file, (void)line;
  snprintf(thrown, sizeof thrown, "%s", msg ? msg : "");
  if (!catcher) {
    fprintf(stderr, "fake c10: c10::Error thrown with nothing to catch it: %s\n", thrown);
    abort();
  }
  siglongjmp(*catcher, 1);
}

/* alloc(size, device, stream) as the framework's allocate() calls it: 0 and
 * the pointer in *out when it returned, 1 and the message in msg when it
 * threw. */
EXPORT int fake_c10_call_malloc(void *(*alloc)(size_t, int, void *), size_t size, int device, void *stream,
                                void **out, char *msg, size_t cap) {
  sigjmp_buf here;
  sigjmp_buf *volatile outer = catcher;
  if (sigsetjmp(here, 0)) {
    catcher = outer;
    snprintf(msg, cap, "%s", thrown);
    return 1;
  }
  catcher = &here;
  *out = alloc(size, device, stream);
  catcher = outer;
  return 0;
}
