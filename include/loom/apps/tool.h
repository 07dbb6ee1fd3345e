#pragma once
// What every loom command-line tool does around its body: a loom::Error (bad input) becomes a
// one-line message and exit code 2, any other failure exit code 1; in a job of several ranks the
// failing rank prefixes its rank and aborts the whole job with that code, so the others do not
// wait for it in a collective. It first keeps freed host memory for reuse
// (core::keep_freed_host_memory), which a training loop's per-step allocations need.
#include <functional>
#include <string>

namespace loom::apps {

// Runs `body`; returns 0, or the exit code of its failure (after printing "`name`: error: ...").
int run_tool(const std::string& name, const std::function<void()>& body);

}  // namespace loom::apps
