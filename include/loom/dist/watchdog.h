#pragma once
// Turns a hang into an error. Every op a communicator issues is tracked here until it completes;
// one that runs longer than its timeout aborts the whole job with a message naming the op, the
// group, the op's sequence number in that group, this rank and the tensor. A collective that
// one rank never issues would otherwise block the others forever.
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "loom/dist/work.h"

namespace loom::dist {

class Watchdog {
 public:
  // What happens on a timeout; the default prints `message` to stderr (and the log) and calls
  // MPI_Abort on the world (std::abort without MPI). It must not return.
  using AbortHandler = std::function<void(const std::string& message)>;

  static Watchdog& instance();

  // Watches `work` until it completes (the watchdog keeps it alive until then).
  void track(const WorkPtr& work);
  void set_abort_handler(AbortHandler handler);
  // Stops the thread (Runtime calls this before MPI_Finalize); tracking starts it again.
  void stop();
  // Ops still being watched.
  size_t in_flight();

  // The message an expired op aborts with.
  static std::string timeout_message(const OpInfo& info, Seconds running);
  // The line printed (once) when a termination signal arrives while `info` has been waiting for
  // `running`: under mpirun or srun that signal is usually the launcher ending the job because
  // a rank died, and this names what the survivors were waiting for.
  static std::string signal_message(const OpInfo& info, Seconds running, int signal);
  // How long an op must have waited when a signal arrives for signal_message to be printed
  // (shorter than Open MPI's 1 s between its SIGTERM and SIGKILL; longer than a healthy op).
  static constexpr Seconds kSignalReportAfter{0.25};

 private:
  Watchdog() = default;
  ~Watchdog();
  void run();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<WorkPtr> works_;
  std::thread thread_;
  bool stopping_ = false;
  bool signal_reported_ = false;
  AbortHandler handler_;
};

}  // namespace loom::dist
