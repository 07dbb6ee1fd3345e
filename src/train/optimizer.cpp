#include "loom/train/optimizer.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/precision.h"

namespace loom::train {

bool default_decays(const std::string& name, const at::Tensor& param) {
  if (param.dim() < 2) return false;  // biases, norm weights
  for (const char* embedding : {"wte.", "wpe.", "embed_tokens."})
    if (name.find(embedding) != std::string::npos) return false;
  return true;
}

AdamW::AdamW(const core::NamedTensors& named_params, AdamWOptions options,
             std::function<bool(const std::string&, const at::Tensor&)> decays)
    : options_(options) {
  ops::check_adamw_options(options);
  for (const auto& [name, param] : named_params) {
    Slot s;
    s.name = name;
    s.param = param;
    const auto state_dtype = ops::accumulation_dtype(param.scalar_type());
    if (param.scalar_type() != state_dtype) s.master = param.detach().to(state_dtype).clone();
    s.exp_avg = at::zeros(param.sizes(), param.options().dtype(state_dtype));
    s.exp_avg_sq = at::zeros(param.sizes(), param.options().dtype(state_dtype));
    s.decay = decays(name, param);
    slots_.push_back(std::move(s));
  }
}

int64_t AdamW::num_decayed() const {
  return std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.decay; });
}
int64_t AdamW::num_not_decayed() const {
  return static_cast<int64_t>(slots_.size()) - num_decayed();
}

void AdamW::step(double lr, const at::Tensor& grad_scale) {
  torch::NoGradGuard no_grad;
  ++steps_;
  // One call for the whole list: on a GPU a few multi-tensor kernels, not eight per tensor.
  ops::AdamWTensors list;
  list.grad_scale = grad_scale;
  list.backend = backend_;
  std::vector<at::Tensor> narrow_params, masters;
  for (auto& s : slots_) {
    const auto& grad_any = s.param.grad();
    if (!grad_any.defined()) continue;
    list.weights.push_back(s.master.defined() ? s.master : s.param);
    list.grads.push_back(grad_any.to(s.exp_avg.scalar_type()));
    list.exp_avgs.push_back(s.exp_avg);
    list.exp_avg_sqs.push_back(s.exp_avg_sq);
    list.decay.push_back(s.decay);
    if (s.master.defined()) {
      narrow_params.push_back(s.param);
      masters.push_back(s.master);
    }
  }
  ops::adamw_update_(list, lr, steps_, options_);
  // The rounded values back into the narrow parameters, one multi-tensor copy.
  if (!narrow_params.empty()) at::_foreach_copy_(narrow_params, masters);
}

void AdamW::zero_grad() {
  for (auto& s : slots_) {
    auto& g = s.param.mutable_grad();
    if (g.defined()) g = at::Tensor();
  }
}

core::NamedTensors AdamW::state() const {
  core::NamedTensors out;
  out.emplace_back("step", at::tensor(steps_, at::kLong));
  for (const auto& s : slots_) {
    out.emplace_back(s.name + ".exp_avg", s.exp_avg);
    out.emplace_back(s.name + ".exp_avg_sq", s.exp_avg_sq);
    if (s.master.defined()) out.emplace_back(s.name + ".master", s.master);
  }
  return out;
}

void AdamW::load_state(const std::map<std::string, at::Tensor>& state) {
  torch::NoGradGuard no_grad;
  auto get = [&](const std::string& key, const at::Tensor& like) {
    auto it = state.find(key);
    LOOM_CHECK(it != state.end(), "optimizer state has no entry '{}'", key);
    LOOM_CHECK(it->second.sizes() == like.sizes(),
               "optimizer state '{}' has shape {}, the parameter needs {}", key, it->second.sizes(),
               like.sizes());
    like.copy_(it->second);
  };
  auto it = state.find("step");
  LOOM_CHECK(it != state.end(), "optimizer state has no entry 'step'");
  steps_ = it->second.item<int64_t>();
  for (auto& s : slots_) {
    get(s.name + ".exp_avg", s.exp_avg);
    get(s.name + ".exp_avg_sq", s.exp_avg_sq);
    if (s.master.defined()) get(s.name + ".master", s.master);
  }
}

}  // namespace loom::train
