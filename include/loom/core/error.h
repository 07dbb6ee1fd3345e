#pragma once
// One exception type for everything a user can get wrong (configuration, data, files):
// the message names the field or file, the value, and what would be valid.
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace loom

// LOOM_CHECK(cond, "fmt {}", args...): throws loom::Error with the formatted message.
#define LOOM_CHECK(cond, ...)    \
  do {                           \
    if (!(cond)) {               \
      ::loom::fail(__VA_ARGS__); \
    }                            \
  } while (0)
