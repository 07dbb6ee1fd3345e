#pragma once
// "This parameter's gradient is complete for this backward": callbacks run after a parameter's
// AccumulateGrad node (LibTorch's post-accumulate-grad hook), which is where data parallelism and
// ZeRO start reducing a bucket during backward. Owns its hooks and removes them when destroyed.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace loom::parallel {

class GradReadyHooks {
 public:
  GradReadyHooks() = default;
  ~GradReadyHooks();
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;

  // Calls `fn` each time backward has accumulated `param`'s gradient. `name` is for the error
  // when the parameter has no gradient accumulator (not a leaf that requires grad).
  void add(const at::Tensor& param, const std::string& name, std::function<void()> fn);

 private:
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
};

}  // namespace loom::parallel
