#include "loom/train/grad_clip.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cmath>

#include "loom/models/causal_lm.h"

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
  std::vector<at::Tensor> norms;
  for (const auto& p : params)
    if (p.grad().defined()) norms.push_back(p.grad().to(at::kFloat).norm());
  if (norms.empty()) return 0.0;
  const double total = at::stack(norms).norm().item<double>();
  scale_if_above(params, total, max_norm);
  return total;
}

double clip_grad_norm(const models::CausalLM& model, double max_norm) {
  torch::NoGradGuard no_grad;
  const int64_t tp = model.tp().size();
  std::vector<at::Tensor> params, sharded, replicated;
  for (const auto& item : model.named_parameters()) {
    const auto& g = item.value().grad();
    if (!g.defined()) continue;
    params.push_back(item.value());
    const auto& spec = model.shard_spec(item.key());
    auto sq = g.to(at::kFloat).pow(2).sum().to(at::kDouble);
    if (spec.sharded())
      sharded.push_back(sq / static_cast<double>(spec.replicas(tp)));
    else
      replicated.push_back(sq);
  }
  if (params.empty()) return 0.0;
  auto sum = [](const std::vector<at::Tensor>& v) {
    return v.empty() ? at::zeros({}, at::kDouble) : at::stack(v).sum().cpu();
  };
  auto sharded_sq = sum(sharded).reshape({1}).contiguous();
  if (tp > 1) model.tp().comm()->all_reduce(sharded_sq, dist::ReduceOp::Sum);
  const double total = std::sqrt(sharded_sq.item<double>() + sum(replicated).item<double>());
  scale_if_above(params, total, max_norm);
  return total;
}

}  // namespace loom::train
