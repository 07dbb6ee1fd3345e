#pragma once
// Small helpers the benchmarks share.
#include <algorithm>
#include <cstddef>
#include <vector>

namespace loom::bench {

// The median of timings (upper median for an even count).
inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace loom::bench
