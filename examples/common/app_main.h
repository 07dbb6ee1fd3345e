#pragma once
// What every loom command-line tool does around its body: parse flags with CLI11, turn a
// loom::Error (bad input) into a one-line message and exit code 2, and any other failure into
// exit code 1; in a job of several ranks, the failing rank prefixes its rank and aborts the whole
// job with that code, so the others do not wait for it in a collective. Header-only; tools use
// loom's public headers only.
#include <c10/util/Exception.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <functional>

#include "loom/core/error.h"
#include "loom/dist/process_info.h"
#include "loom/dist/runtime.h"

namespace loom::apps {

inline int run_app(CLI::App& app, int argc, char** argv, const std::function<void()>& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const auto fail = [&](const char* message, int code) {
    const auto& p = loom::dist::process_info();
    if (p.world_size > 1)
      std::fprintf(stderr, "%s: rank %d: error: %s\n", app.get_name().c_str(), p.world_rank,
                   message);
    else
      std::fprintf(stderr, "%s: error: %s\n", app.get_name().c_str(), message);
    std::fflush(stderr);
    loom::dist::abort_job_if_multi_rank(code);
    return code;
  };
  try {
    body();
    return 0;
  } catch (const loom::Error& e) {
    return fail(e.what(), 2);
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace(), 1);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}

}  // namespace loom::apps
