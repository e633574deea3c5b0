/* A stand-in for PyTorch's libc10.so, in C++ as the real one is, with what
 * gcalloc's drop-in meets in it: c10::Error's constructor (defined here, as
 * libc10 defines it, so code built against tests/fake_torch_include links
 * here), and c10::detail::torchCheckFail, which throws c10::Error. The
 * stand-in torch (python/tests/standin) calls the alloc function through
 * fake_c10_call_malloc, the pluggable allocator's allocate() frame in
 * miniature: what it throws passes through gcalloc's C frames and is caught
 * here as PyTorch's Python bindings catch it (HANDLE_TH_ERRORS:
 * c10::OutOfMemoryError becomes torch.OutOfMemoryError, any other
 * c10::Error RuntimeError). Anything else thrown terminates, as it would
 * there. */
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdio>

namespace c10 {

Error::Error(SourceLocation source_location, std::string msg) : msg_(std::move(msg)) {
  what_ = msg_ + " (raised in " + (source_location.function ? source_location.function : "?") + " at " +
          (source_location.file ? source_location.file : "?") + ":" + std::to_string(source_location.line) + ")";
}

namespace detail {
void torchCheckFail(const char *func, const char *file, uint32_t line, const char *msg) {
  throw Error(SourceLocation{func, file, line}, msg ? msg : "");
}
}  // namespace detail

}  // namespace c10

/* alloc(size, device, stream) as the framework's allocate() calls it: 0
 * and the pointer in *out when it returned; 1 (c10::Error) or 2
 * (c10::OutOfMemoryError) and the message in msg when it threw. */
extern "C" C10_API int fake_c10_call_malloc(void *(*alloc)(size_t, int, void *), size_t size, int device,
                                            void *stream, void **out, char *msg, size_t cap) {
  try {
    *out = alloc(size, device, stream);
    return 0;
  } catch (const c10::OutOfMemoryError &e) {
    snprintf(msg, cap, "%s", e.msg().c_str());
    return 2;
  } catch (const c10::Error &e) {
    snprintf(msg, cap, "%s", e.msg().c_str());
    return 1;
  }
}
