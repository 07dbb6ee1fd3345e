#include "loom/parallel/grad_ready_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "loom/core/error.h"

namespace loom::parallel {

namespace {

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

void GradReadyHooks::add(const at::Tensor& param, const std::string& name,
                         std::function<void()> fn) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  LOOM_CHECK(acc != nullptr,
             "parameter '{}' has no gradient accumulator (not a leaf that "
             "requires a gradient)",
             name);
  const auto key = acc->add_post_hook(std::make_unique<GradReadyHook>(std::move(fn)));
  hooks_.emplace_back(std::move(acc), key);
}

GradReadyHooks::~GradReadyHooks() {
  for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
}

}  // namespace loom::parallel
