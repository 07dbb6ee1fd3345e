#pragma once
// Facts about this process that every communicator reports in its messages, and the defaults
// new communicators start with. Runtime fills them in at start-up; without a Runtime the process
// is rank 0 of 1.
#include <string>

#include "loom/dist/work.h"

namespace loom::dist {

struct ProcessInfo {
  int world_rank = 0;
  int world_size = 1;
  int local_rank = 0;  // among the ranks on this node
  int local_size = 1;
  std::string host = "localhost";
};

ProcessInfo process_info();  // a copy: Runtime may set it from another thread
void set_process_info(ProcessInfo info);

// The watchdog limit new communicators start with (300 s unless set).
Seconds default_timeout();
void set_default_timeout(Seconds timeout);

// LOOM_DIST_DEBUG=1 (or any value but 0/empty) turns on the per-collective consistency check.
bool debug_from_env();

}  // namespace loom::dist
