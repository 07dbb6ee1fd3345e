#include "loom/dist/work.h"

#include <fmt/format.h>

#include <thread>

#include "loom/core/error.h"

namespace loom::dist {

void Work::wait(std::optional<Seconds> timeout) {
  std::optional<Clock::time_point> deadline;
  if (timeout) deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(*timeout);
  if (!wait_until(deadline))
    fail("{} did not complete within the {:.3g} s given to wait(); it is still running",
         info_.describe(), timeout->count());
  if (auto e = error()) std::rethrow_exception(e);
}

std::optional<std::string> Work::failure() const {
  const auto e = error();
  if (!e) return std::nullopt;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return std::string(ex.what());
  } catch (...) {
    return std::string("unknown error");
  }
}

std::optional<Clock::time_point> Work::started_at() const {
  const int64_t ns = started_ns_.load(std::memory_order_acquire);
  if (ns < 0) return std::nullopt;
  return Clock::time_point(
      std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(ns)));
}

void Work::mark_started() {
  const auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch());
  started_ns_.store(ns.count(), std::memory_order_release);
}

void HostWork::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

bool HostWork::wait_until(std::optional<Clock::time_point> deadline) {
  // Most ops a caller waits for are about to finish: a short polite spin saves the sleep and
  // wake-up (several microseconds) before blocking.
  const auto spin_until = Clock::now() + std::chrono::microseconds(50);
  while (!done_.load(std::memory_order_acquire) && Clock::now() < spin_until)
    std::this_thread::yield();
  if (done_.load(std::memory_order_acquire)) return true;
  std::unique_lock<std::mutex> lock(mutex_);
  if (!deadline) {
    cv_.wait(lock, [&] { return done_.load(std::memory_order_acquire); });
    return true;
  }
  return cv_.wait_until(lock, *deadline, [&] { return done_.load(std::memory_order_acquire); });
}

std::exception_ptr HostWork::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

}  // namespace loom::dist
