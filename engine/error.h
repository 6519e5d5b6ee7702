// Errors are exceptions that name the thing: QUILT_CHECK(cond, "[op] what: ", value, ...).
//
//   QUILT_CHECK(a.dim() == 2, "[matmul] expected a matrix, got shape ", a.shape());
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace quilt {

/// Every error Quilt raises for bad input derives from this.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class T>
void append(std::ostringstream& os, const std::vector<T>& v) {
  os << '(';
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  if (v.size() == 1) os << ',';
  os << ')';
}
template <class T>
void append(std::ostringstream& os, const T& v) { os << v; }

template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (append(os, args), ...);
  return os.str();
}
}  // namespace detail

/// Builds a message from pieces (vectors print as shapes) and throws quilt::Error.
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(detail::concat(args...));
}

}  // namespace quilt

#define QUILT_CHECK(cond, ...)                \
  do {                                        \
    if (!(cond)) ::quilt::fail(__VA_ARGS__);  \
  } while (0)
