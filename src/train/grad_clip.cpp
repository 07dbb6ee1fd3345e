#include "loom/train/grad_clip.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/dist/communicator.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/precision.h"

namespace loom::train {

namespace {

using ops::squared_norm;

double total_of(const std::vector<at::Tensor>& squares) {
  return squares.empty() ? 0.0 : at::stack(squares).sum().item<double>();
}

void scale_if_above(const std::vector<at::Tensor>& params, double total, double max_norm) {
  if (max_norm <= 0 || total <= max_norm) return;
  const double scale = max_norm / (total + 1e-6);
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().mul_(scale);
}

}  // namespace

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> squares;
  for (const auto& p : params)
    if (p.grad().defined()) squares.push_back(squared_norm(p.grad()));
  if (squares.empty()) return 0.0;
  const double total = std::sqrt(total_of(squares));
  scale_if_above(params, total, max_norm);
  return total;
}

at::Tensor clip_grad_norm_on_device(const std::vector<at::Tensor>& params, double max_norm) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> squares, grads;
  for (const auto& p : params)
    if (p.grad().defined()) {
      squares.push_back(squared_norm(p.grad()));
      grads.push_back(p.grad());
    }
  if (squares.empty()) {
    const auto device = params.empty() ? at::Device(at::kCPU) : params.front().device();
    return at::zeros({}, at::TensorOptions(at::kDouble).device(device));
  }
  auto norm = at::stack(squares).sum().sqrt();
  if (max_norm > 0) {
    // min(1, max / (norm + eps)) computed where the norm is: no branch on its value.
    const auto scale = (max_norm / (norm + 1e-6)).clamp_max(1.0).to(grads.front().scalar_type());
    at::_foreach_mul_(grads, scale);
  }
  return norm;
}

double clip_grad_norm(const models::CausalLM& model, double max_norm) {
  return clip_grad_norm({&model}, max_norm, nullptr);
}

double clip_grad_norm(const std::vector<const models::CausalLM*>& parts, double max_norm,
                      dist::Communicator* pipeline) {
  torch::NoGradGuard no_grad;
  LOOM_CHECK(!parts.empty(), "clip_grad_norm: no model parts");
  const auto& tp_group = parts.front()->tp();
  const int64_t tp = tp_group.size();
  std::vector<at::Tensor> params, sharded, replicated;
  for (const auto* model : parts) {
    const auto tied_copy = model->tied_embedding_copy();
    for (const auto& item : model->named_parameters()) {
      const auto& g = item.value().grad();
      if (!g.defined()) continue;
      params.push_back(item.value());
      if (item.key() == tied_copy) continue;
      const auto& spec = model->shard_spec(item.key());
      auto sq = squared_norm(g);
      if (spec.sharded())
        sharded.push_back(sq / static_cast<double>(spec.replicas(tp)));
      else
        replicated.push_back(sq);
    }
  }
  // Every rank joins the reductions, gradients or not. On the parameters' device, so that NCCL
  // groups can reduce it.
  const auto& first = *parts.front();
  const auto device =
      first.parameters().empty() ? at::Device(at::kCPU) : first.parameters().front().device();
  const auto options = at::TensorOptions(at::kDouble).device(device);
  auto sharded_sq = at::full({1}, total_of(sharded), options);
  if (tp > 1) tp_group.comm()->all_reduce(sharded_sq, dist::ReduceOp::Sum);
  double total_sq = sharded_sq.item<double>() + total_of(replicated);
  if (pipeline && pipeline->size() > 1) {
    auto t = at::full({1}, total_sq, options);
    pipeline->all_reduce(t, dist::ReduceOp::Sum);
    total_sq = t.item<double>();
  }
  const double total = std::sqrt(total_sq);
  scale_if_above(params, total, max_norm);
  return total;
}

}  // namespace loom::train
