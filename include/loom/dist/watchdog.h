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

 private:
  Watchdog() = default;
  ~Watchdog();
  void run();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<WorkPtr> works_;
  std::thread thread_;
  bool stopping_ = false;
  AbortHandler handler_;
};

}  // namespace loom::dist
