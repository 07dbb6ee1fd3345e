#pragma once
#include <cstdint>

namespace loom::train {

// Linear warmup from 0 to max_lr over warmup_steps, then cosine decay to min_lr at total_steps
// (constant min_lr after). Step numbers are 0-based optimizer steps.
struct LrSchedule {
  double max_lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;

  double at(int64_t step) const;
  void validate() const;  // throws loom::Error naming the bad field
};

}  // namespace loom::train
