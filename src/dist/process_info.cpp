#include "loom/dist/process_info.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

namespace loom::dist {

namespace {
std::mutex g_mutex;
ProcessInfo g_info;
std::atomic<double> g_timeout_s{300.0};
}  // namespace

ProcessInfo process_info() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_info;
}

void set_process_info(ProcessInfo info) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_info = std::move(info);
}

Seconds default_timeout() {
  return Seconds(g_timeout_s.load());
}
void set_default_timeout(Seconds timeout) {
  g_timeout_s.store(timeout.count());
}

bool debug_from_env() {
  const char* v = std::getenv("LOOM_DIST_DEBUG");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

}  // namespace loom::dist
