#include "loom/core/preemption.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <csignal>
#include <string_view>

#include "loom/core/error.h"
#include "loom/core/format.h"

namespace loom::core {

namespace {

// The one piece of state a signal handler may touch. Written only by the handler (first signal
// wins) and by the watch's constructor; read by the training loop and the watchdog's thread,
// hence atomics (lock-free, so safe in a handler).
std::atomic<int> g_received{0};
std::atomic<bool> g_watch_alive{false};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void record_signal(int signal) {
  int none = 0;
  g_received.compare_exchange_strong(none, signal);
}

struct NamedSignal {
  std::string_view name;
  int number;
};
constexpr NamedSignal kSignals[] = {{"TERM", SIGTERM}, {"USR1", SIGUSR1}, {"USR2", SIGUSR2},
                                    {"INT", SIGINT},   {"HUP", SIGHUP},   {"QUIT", SIGQUIT}};

std::string valid_names() {
  std::string out;
  for (const auto& s : kSignals) out += std::string(out.empty() ? "" : ", ") + std::string(s.name);
  return out + " (comma-separated), or none";
}

}  // namespace

std::vector<int> parse_preemption_signals(const std::string& spec) {
  std::string upper = spec;
  std::transform(upper.begin(), upper.end(), upper.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  std::vector<int> out;
  if (upper.empty() || upper == "NONE") return out;
  size_t start = 0;
  while (start <= upper.size()) {
    const size_t end = std::min(upper.find(',', start), upper.size());
    std::string_view name(upper.data() + start, end - start);
    while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
    while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
    if (name.starts_with("SIG")) name.remove_prefix(3);
    const auto* found = std::find_if(std::begin(kSignals), std::end(kSignals),
                                     [&](const NamedSignal& s) { return s.name == name; });
    LOOM_CHECK(found != std::end(kSignals),
               "preemption signal '{}' in '{}' is not known; valid: {}",
               spec.substr(start, end - start), spec, valid_names());
    if (std::find(out.begin(), out.end(), found->number) == out.end()) out.push_back(found->number);
    start = end + 1;
  }
  return out;
}

std::string signal_name(int signal) {
  for (const auto& s : kSignals)
    if (s.number == signal) return "SIG" + std::string(s.name);
  return fmt::format("signal {}", signal);
}

PreemptionWatch::PreemptionWatch(std::vector<int> signals) : signals_(std::move(signals)) {
  LOOM_CHECK(!g_watch_alive, "a preemption watch is already installed in this process");
  g_watch_alive = true;
  g_received = 0;
  for (int s : signals_) {
    auto* old = new struct sigaction;
    struct sigaction action {};
    action.sa_handler = record_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;  // system calls the signal interrupts carry on
    sigaction(s, &action, old);
    previous_.push_back(old);
  }
}

PreemptionWatch::~PreemptionWatch() {
  for (size_t i = 0; i < signals_.size(); ++i) {
    auto* old = static_cast<struct sigaction*>(previous_[i]);
    sigaction(signals_[i], old, nullptr);
    delete old;
  }
  g_watch_alive = false;
}

int preemption_signal_pending() {
  return g_watch_alive ? g_received.load() : 0;
}

int PreemptionWatch::received() const {
  return g_received;
}

}  // namespace loom::core
