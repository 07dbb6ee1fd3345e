#include "loom/apps/tool.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <exception>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/dist/process_info.h"
#include "loom/dist/runtime.h"

namespace loom::apps {

int run_tool(const std::string& name, const std::function<void()>& body) {
  const auto fail = [&](const char* message, int code) {
    const auto& p = dist::process_info();
    if (p.world_size > 1)
      std::fprintf(stderr, "%s: rank %d: error: %s\n", name.c_str(), p.world_rank, message);
    else
      std::fprintf(stderr, "%s: error: %s\n", name.c_str(), message);
    std::fflush(stderr);
    dist::abort_job_if_multi_rank(code);
    return code;
  };
  core::keep_freed_host_memory();
  try {
    body();
    return 0;
  } catch (const Error& e) {
    return fail(e.what(), 2);
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace(), 1);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}

}  // namespace loom::apps
