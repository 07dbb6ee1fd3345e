#include "loom/train/checkpoint_writer.h"

#include <spdlog/spdlog.h>

#include <exception>

#include "loom/core/error.h"

namespace loom::train {

void CheckpointWriter::finish_quietly() noexcept {
  if (!pending()) return;
  if (const auto failure = wait()) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      spdlog::error("{} failed: {}", what_, e.what());
    } catch (...) {
      spdlog::error("{} failed", what_);
    }
  }
}

void CheckpointWriter::start(std::function<void()> write, std::string what) {
  LOOM_CHECK(!pending(), "{} started while {} is still being written", what, what_);
  what_ = std::move(what);
  failure_ = nullptr;
  thread_ = std::thread([this, write = std::move(write)] {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      write();
    } catch (...) {
      failure_ = std::current_exception();
    }
    running_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
}

std::exception_ptr CheckpointWriter::wait() {
  if (!pending()) return nullptr;
  thread_.join();  // orders the thread's writes of failure_ and running_seconds_ before ours
  total_seconds_ += running_seconds_;
  auto failure = failure_;
  failure_ = nullptr;
  return failure;
}

}  // namespace loom::train
