#pragma once
// What every loom command-line tool does around its body: parse flags with CLI11, turn a
// loom::Error (bad input) into a one-line message and exit code 2, and any other failure into
// exit code 1. Header-only; tools use loom's public headers only.
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <functional>

#include "loom/core/error.h"

namespace loom::apps {

inline int run_app(CLI::App& app, int argc, char** argv, const std::function<void()>& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    body();
    return 0;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", app.get_name().c_str(), e.what());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", app.get_name().c_str(), e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", app.get_name().c_str(), e.what());
    return 1;
  }
}

}  // namespace loom::apps
