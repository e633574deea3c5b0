/* A stand-in for PyTorch's c10/util/Exception.h (shipped in a wheel's
 * torch/include), with the shapes the code compiled against it meets:
 * c10::SourceLocation (c10/util/StringUtil.h in PyTorch), c10::Error, a
 * std::exception whose PyTorch-style constructor is defined in libc10 (not
 * inline, so code built against this header links to libc10 and needs its
 * std::string ABI: _GLIBCXX_USE_CXX11_ABI as torch._C reports it), and
 * c10::OutOfMemoryError, which inherits that constructor. The stand-in
 * libc10 is tests/fake_c10.cpp. */
#ifndef C10_UTIL_EXCEPTION_H_
#define C10_UTIL_EXCEPTION_H_

#include <cstdint>
#include <exception>
#include <string>

#define C10_API __attribute__((visibility("default")))

namespace c10 {

struct C10_API SourceLocation {
  const char *function;
  const char *file;
  uint32_t line;
};

class C10_API Error : public std::exception {
  std::string msg_;
  std::string what_;

 public:
  Error(SourceLocation source_location, std::string msg); /* (in libc10) */
  const std::string &msg() const { return msg_; }
  const char *what() const noexcept override { return what_.c_str(); }
};

class C10_API OutOfMemoryError : public Error {
  using Error::Error;
};

namespace detail {
[[noreturn]] C10_API void torchCheckFail(const char *func, const char *file, uint32_t line, const char *msg);
}  // namespace detail

}  // namespace c10

#endif
