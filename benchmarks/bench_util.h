#pragma once
// Small helpers the benchmarks share.
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace loom::bench {

// The median of timings (upper median for an even count).
inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Seconds per call of fn, over enough calls to fill min_ms after two warm-up calls (with `cuda`,
// the device synchronized around the timed stretch, and every fourth call to read the clock).
inline double seconds_per_call(const std::function<void()>& fn, double min_ms, bool cuda) {
  using Clock = std::chrono::steady_clock;
  auto synchronize = [cuda] {
    if (cuda) torch::cuda::synchronize();
  };
  fn();
  fn();
  synchronize();
  int64_t calls = 0;
  const auto start = Clock::now();
  double elapsed_ms = 0;
  while (elapsed_ms < min_ms || calls < 3) {
    fn();
    ++calls;
    if (calls % 4 == 0 || elapsed_ms == 0) {
      synchronize();
      elapsed_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    }
  }
  synchronize();
  elapsed_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return elapsed_ms / 1e3 / static_cast<double>(calls);
}

}  // namespace loom::bench
