#include <mutex>

#include "builtin.h"
#include "loom/train/builtin_strategies.h"

namespace loom::train {

void register_builtin_strategies() {
  static std::once_flag once;
  std::call_once(once, [] {
    strategies::register_pipeline();
    strategies::register_tensor_parallel();
    strategies::register_context_parallel();
    strategies::register_memory_strategies();
    strategies::register_data_parallel();
    strategies::register_zero();
    strategies::register_prune();
    strategies::register_profile();
  });
}

}  // namespace loom::train
