#include "loom/core/logging.h"

#include "loom/core/error.h"

namespace loom::core {

void setup_logging(const std::string& level) {
  const auto parsed = spdlog::level::from_str(level);
  // from_str maps unknown names to "off"; only accept "off" when it was asked for.
  LOOM_CHECK(parsed != spdlog::level::off || level == "off",
             "log level '{}' is not valid: use trace, debug, info, warn, error or off", level);
  spdlog::set_level(parsed);
  spdlog::set_pattern("[%H:%M:%S] [%^%l%$] %v");
}

}  // namespace loom::core
