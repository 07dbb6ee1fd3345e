#include "loom/ops/fused_choice.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "loom/core/error.h"

namespace loom::ops {

std::string to_string(FusedChoice choice) {
  switch (choice) {
    case FusedChoice::kAuto:
      return "auto";
    case FusedChoice::kFused:
      return "fused";
    case FusedChoice::kMath:
      return "math";
  }
  return "unknown";
}

std::vector<std::string> fused_choice_names() {
  return {"auto", "fused", "math"};
}

FusedChoice parse_fused_choice(const std::string& name, const std::string& what) {
  for (const auto choice : {FusedChoice::kAuto, FusedChoice::kFused, FusedChoice::kMath})
    if (to_string(choice) == name) return choice;
  fail("{} '{}' is not valid: {}", what, name, fmt::join(fused_choice_names(), ", "));
}

}  // namespace loom::ops
