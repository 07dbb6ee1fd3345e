#include "loom/dist/watchdog.h"

#include <fmt/format.h>
#include <mpi.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include <cstdio>
#include <cstdlib>
#include "loom/core/preemption.h"

namespace loom::dist {

namespace {

[[noreturn]] void default_abort(const std::string& message) {
  spdlog::critical("{}", message);
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 3);
  std::abort();
}

}  // namespace

Watchdog& Watchdog::instance() {
  static Watchdog w;
  return w;
}

Watchdog::~Watchdog() {
  stop();
}

std::string Watchdog::timeout_message(const OpInfo& info, Seconds running) {
  return fmt::format(
      "loom watchdog: {} has not completed after {:.1f} s (timeout {:.1f} s, set with "
      "--comm-timeout); aborting the job. A rank of the group probably skipped this "
      "collective, issued a different one, or died; LOOM_DIST_DEBUG=1 checks every collective "
      "across the group",
      info.describe(), running.count(), info.timeout.count());
}

std::string Watchdog::signal_message(const OpInfo& info, Seconds running, int signal) {
  return fmt::format(
      "loom watchdog: {} arrived while {} had waited {:.1f} s for its group: if the launcher is "
      "ending the job, a rank of that group has probably died (the launcher's message names it)",
      core::signal_name(signal), info.describe(), running.count());
}

void Watchdog::track(const WorkPtr& work) {
  if (work->is_completed()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  works_.push_back(work);
  if (!thread_.joinable()) {
    stopping_ = false;
    thread_ = std::thread([this] { run(); });
  }
}

void Watchdog::set_abort_handler(AbortHandler handler) {
  std::lock_guard<std::mutex> lock(mutex_);
  handler_ = std::move(handler);
}

size_t Watchdog::in_flight() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<size_t>(std::count_if(works_.begin(), works_.end(),
                                           [](const WorkPtr& w) { return !w->is_completed(); }));
}

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  works_.clear();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    // Poll often enough that a short timeout (tests use one second) fires promptly.
    cv_.wait_for(lock, std::chrono::milliseconds(50), [&] { return stopping_; });
    if (stopping_) break;
    const auto now = Clock::now();
    for (const auto& w : works_) {
      if (!w->is_completed() || !w->has_fatal_error()) continue;
      const auto message = fmt::format(
          "loom watchdog: {} failed and left its communicator unusable: {}; aborting the job",
          w->info().describe(), w->failure().value_or("?"));
      auto handler = handler_;
      lock.unlock();
      w->abort_communicator();
      if (handler) handler(message);
      default_abort(message);
    }
    std::erase_if(works_, [](const WorkPtr& w) { return w->is_completed(); });
    // Only a line: a preemption signal may arrive during a slow but healthy op.
    if (const int signal = core::preemption_signal_pending(); signal != 0 && !signal_reported_) {
      for (const auto& w : works_) {
        const auto started = w->started_at();
        if (!started || now - *started < kSignalReportAfter) continue;
        const auto message = signal_message(w->info(), now - *started, signal);
        std::fprintf(stderr, "%s\n", message.c_str());
        std::fflush(stderr);
        signal_reported_ = true;
        break;
      }
    }
    for (const auto& w : works_) {
      const auto started = w->started_at();
      if (!started) continue;
      const Seconds running = now - *started;
      if (running <= w->info().timeout) continue;
      const auto message = timeout_message(w->info(), running);
      auto handler = handler_;
      lock.unlock();
      w->abort_communicator();
      if (handler) handler(message);
      default_abort(message);
    }
  }
}

}  // namespace loom::dist
