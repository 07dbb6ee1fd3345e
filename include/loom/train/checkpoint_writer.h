#pragma once
// The write of a checkpoint on a background thread (--async-save): rank 0's part of a save (the
// files, their checksums, the rename and `latest`) runs while training goes on, from copies of
// the tensors taken when the save began. One write at a time: the next save, the end of fit()
// and the destructor wait for the one in flight.
#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>

namespace loom::train {

class CheckpointWriter {
 public:
  CheckpointWriter() = default;
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  // Waits for a write in flight (finish_quietly).
  ~CheckpointWriter() { finish_quietly(); }

  // Starts `write` on a thread of its own; `what` names it in messages. A write still in flight
  // is an error (the caller waits first).
  void start(std::function<void()> write, std::string what);
  bool pending() const { return thread_.joinable(); }

  // Waits for the write in flight (returns at once when there is none): what it threw (null when
  // it succeeded or none was pending).
  std::exception_ptr wait();
  // The same where nobody can be told: a failure is logged as an error.
  void finish_quietly() noexcept;
  // Seconds the finished writes took on their thread, all of them together.
  double total_seconds() const { return total_seconds_; }

 private:
  std::thread thread_;
  std::exception_ptr failure_;
  std::string what_;
  double total_seconds_ = 0, running_seconds_ = 0;
};

}  // namespace loom::train
