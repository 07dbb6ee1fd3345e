#pragma once
// Human-readable log lines go through spdlog's default logger; this sets its format and level.
#include <spdlog/spdlog.h>

#include <string>

namespace loom::core {

// level: trace|debug|info|warn|error|off. Throws loom::Error for anything else.
void setup_logging(const std::string& level = "info");

}  // namespace loom::core
