#include "loom/train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "loom/core/error.h"

namespace loom::train {

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return max_lr * static_cast<double>(step + 1) / warmup_steps;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / decay_steps);
  return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

void LrSchedule::validate() const {
  LOOM_CHECK(max_lr > 0, "learning rate {} must be positive", max_lr);
  LOOM_CHECK(min_lr >= 0 && min_lr <= max_lr, "min lr {} must be in [0, lr = {}]", min_lr, max_lr);
  LOOM_CHECK(warmup_steps >= 0, "warmup steps {} must be >= 0", warmup_steps);
  LOOM_CHECK(total_steps > 0, "total steps {} must be positive", total_steps);
}

}  // namespace loom::train
