#pragma once
// fmt support for the LibTorch types that error messages print (shapes), and byte counts for
// people to read.
#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <cstdint>
#include <string>

template <>
struct fmt::formatter<c10::ArrayRef<int64_t>> : fmt::ostream_formatter {};

namespace loom::core {

// "512 B", "4.0 KiB", "130.2 MiB", "1.5 GiB" (binary units; negative counts keep their sign).
inline std::string format_bytes(int64_t bytes) {
  const char* sign = bytes < 0 ? "-" : "";
  const double magnitude = bytes < 0 ? -static_cast<double>(bytes) : static_cast<double>(bytes);
  if (magnitude < 1024.0) return fmt::format("{}{} B", sign, magnitude);
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB"};
  double scaled = magnitude / 1024.0;
  int unit = 0;
  while (scaled >= 1024.0 && unit < 2) {
    scaled /= 1024.0;
    ++unit;
  }
  return fmt::format("{}{:.1f} {}", sign, scaled, kUnits[unit]);
}

}  // namespace loom::core
