#include "loom/train/grad_clip.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/dist/communicator.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/precision.h"

namespace loom::train {

namespace {

void scale_if_above(const std::vector<at::Tensor>& params, double total, double max_norm) {
  if (max_norm <= 0 || total <= max_norm) return;
  const double scale = max_norm / (total + 1e-6);
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().mul_(scale);
}

}  // namespace

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0.0;
  const double total = std::sqrt(ops::squared_norms(grads).sum().item<double>());
  scale_if_above(params, total, max_norm);
  return total;
}

GradClip grad_clip_on_device(const std::vector<at::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  const auto device = grads.empty()
                          ? (params.empty() ? at::Device(at::kCPU) : params.front().device())
                          : grads.front().device();
  const auto options = at::TensorOptions(at::kDouble).device(device);
  if (grads.empty()) return {at::zeros({}, options), at::ones({}, options)};
  auto norm = ops::squared_norms(grads).sum().sqrt();
  // min(1, max / (norm + eps)) computed where the norm is: no branch on its value.
  auto factor = max_norm > 0 ? (max_norm / (norm + 1e-6)).clamp_max(1.0) : at::ones({}, options);
  return {norm, factor};
}

at::Tensor clip_grad_norm_on_device(const std::vector<at::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  const auto clip = grad_clip_on_device(params, max_norm);
  if (max_norm > 0) {
    std::vector<at::Tensor> grads;
    for (const auto& p : params)
      if (p.grad().defined()) grads.push_back(p.grad());
    if (!grads.empty()) at::_foreach_mul_(grads, clip.factor.to(grads.front().scalar_type()));
  }
  return clip.norm;
}

double clip_grad_norm(const models::CausalLM& model, double max_norm) {
  return clip_grad_norm({&model}, max_norm, nullptr);
}

double grad_norm_weight(const models::CausalLM& part, const std::string& name) {
  if (part.is_copy(name)) return 0.0;
  const int64_t tp = part.tp().size();
  if (tp == 1) return 1.0;
  const auto& spec = part.shard_spec(name);
  return 1.0 / static_cast<double>(spec.sharded() ? spec.replicas(tp) : tp);
}

at::Tensor local_grad_squares(const std::vector<const models::CausalLM*>& parts) {
  torch::NoGradGuard no_grad;
  LOOM_CHECK(!parts.empty(), "local_grad_squares: no model parts");
  std::vector<at::Tensor> grads;
  std::vector<double> weights;
  for (const auto* part : parts)
    for (const auto& item : part->named_parameters()) {
      const auto& g = item.value().grad();
      if (!g.defined()) continue;
      const double w = grad_norm_weight(*part, item.key());
      if (w == 0) continue;
      grads.push_back(g);
      weights.push_back(w);
    }
  const auto& params = parts.front()->parameters();
  const auto device = params.empty() ? at::Device(at::kCPU) : params.front().device();
  if (grads.empty()) return at::zeros({}, at::TensorOptions(at::kDouble).device(device));
  auto squares = ops::squared_norms(grads);
  if (std::any_of(weights.begin(), weights.end(), [](double w) { return w != 1.0; }))
    squares = squares * at::tensor(weights, at::kDouble).to(squares.device());
  return squares.sum();
}

double clip_grad_norm(const std::vector<const models::CausalLM*>& parts, double max_norm,
                      dist::Communicator* pipeline) {
  torch::NoGradGuard no_grad;
  // Every rank joins the reductions, gradients or not; on the parameters' device, so that NCCL
  // groups can reduce it.
  auto total = local_grad_squares(parts).reshape({1});
  const auto& tp_group = parts.front()->tp();
  if (tp_group.size() > 1) tp_group.comm()->all_reduce(total, dist::ReduceOp::Sum);
  if (pipeline && pipeline->size() > 1) pipeline->all_reduce(total, dist::ReduceOp::Sum);
  const double norm = std::sqrt(total.item<double>());
  std::vector<at::Tensor> params;
  for (const auto* part : parts)
    for (const auto& p : part->parameters()) params.push_back(p);
  scale_if_above(params, norm, max_norm);
  return norm;
}

}  // namespace loom::train
