#pragma once
// A handle on one communication operation that may still be running. Every collective and
// point-to-point op of a Communicator returns one; the blocking forms just wait on it.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "loom/dist/op.h"

namespace loom::dist {

using Clock = std::chrono::steady_clock;

class Work {
 public:
  explicit Work(OpInfo info) : info_(std::move(info)) {}
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Blocks until the operation completes, then throws loom::Error if it failed. With a timeout,
  // throws loom::Error naming the operation if it is still running by then (it keeps running).
  // CUDA work: waits by making the caller's current stream wait for it, not the host.
  void wait(std::optional<Seconds> timeout = std::nullopt);
  // Waits until done or `deadline` passes, without throwing; returns whether it is done (how a
  // wrapping backend's work waits on the op it wraps).
  bool wait_done(std::optional<Clock::time_point> deadline) { return wait_until(deadline); }
  // True once the operation has finished (successfully or not). Never blocks.
  bool is_completed() { return test(); }

  // The message of the failure the op ended with; nullopt while running or after success.
  std::optional<std::string> failure() const;
  // A failure that leaves the communicator unusable (NCCL's asynchronous errors): the watchdog
  // aborts the job on it even if nobody waits for this op.
  virtual bool has_fatal_error() const { return false; }
  // Tears down the communicator the op runs on so that nothing stays blocked in it (NCCL's
  // ncclCommAbort); the watchdog calls it on a timeout or a fatal error, before ending the job.
  // Host backends need nothing: MPI_Abort ends their ops.
  virtual void abort_communicator() {}

  const OpInfo& info() const { return info_; }
  // When the operation began to execute (queued work has not); the watchdog counts from here.
  std::optional<Clock::time_point> started_at() const;
  void mark_started();

 protected:
  // Waits until done or the deadline passes; returns whether it is done.
  virtual bool wait_until(std::optional<Clock::time_point> deadline) = 0;
  virtual bool test() = 0;
  // The failure the operation ended with, if any (read after completion).
  virtual std::exception_ptr error() const = 0;

 private:
  OpInfo info_;
  std::atomic<int64_t> started_ns_{-1};
};

using WorkPtr = std::shared_ptr<Work>;

// Work completed by another thread (a backend's communication thread), or already done.
class HostWork : public Work {
 public:
  using Work::Work;
  // Marks the work finished; `error` null on success. Wakes every waiter.
  void complete(std::exception_ptr error = nullptr);

 protected:
  bool wait_until(std::optional<Clock::time_point> deadline) override;
  bool test() override { return done_.load(std::memory_order_acquire); }
  std::exception_ptr error() const override;

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

}  // namespace loom::dist
