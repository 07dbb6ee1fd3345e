#pragma once
// Flags parsed with CLI11 (a parse error prints CLI11's message and exits with its code), then
// the body run as every loom tool runs it (loom/apps/tool.h: exit codes, multi-rank abort).
// Header-only; a program including it links CLI11 (loom.h does not include it).
#include <CLI/CLI.hpp>
#include <functional>

#include "loom/apps/tool.h"

namespace loom::apps {

inline int run_app(CLI::App& app, int argc, char** argv, const std::function<void()>& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return run_tool(app.get_name(), body);
}

}  // namespace loom::apps
