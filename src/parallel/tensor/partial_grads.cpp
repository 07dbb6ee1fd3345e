#include "loom/parallel/tensor/partial_grads.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "loom/core/error.h"

namespace loom::parallel::tensor {

PartialGradSync::PartialGradSync(const NamedParams& params,
                                 const std::map<std::string, ShardSpec>& specs, TpGroupPtr tp)
    : tp_(std::move(tp)) {
  if (tp_->size() == 1) return;
  Group whole{tp_->comm_ptr(), {}};
  std::map<int64_t, Group> by_replicas;  // replica count -> ranks sharing a piece
  for (const auto& [name, param] : params) {
    auto it = specs.find(name);
    LOOM_CHECK(it != specs.end(), "no tensor-parallel layout for parameter '{}'", name);
    const auto& spec = it->second;
    if (!spec.sharded()) {
      if (spec.grad_partial) whole.params.push_back(param);
      continue;
    }
    const int64_t reps = spec.replicas(tp_->size());
    if (reps > 1) by_replicas[reps].params.push_back(param);
  }
  if (!whole.params.empty()) groups_.push_back(std::move(whole));
  // Every rank knows the same layouts, so every rank splits the same groups in the same order.
  for (auto& [reps, group] : by_replicas) {
    const int color = static_cast<int>(tp_->rank() / reps);
    group.comm = tp_->comm()->split(color, static_cast<int>(tp_->rank()),
                                    fmt::format("{}.replicas{}", tp_->comm()->name(), color));
    groups_.push_back(std::move(group));
  }
}

int64_t PartialGradSync::num_params() const {
  int64_t n = 0;
  for (const auto& g : groups_) n += static_cast<int64_t>(g.params.size());
  return n;
}

void PartialGradSync::sync() {
  torch::NoGradGuard no_grad;
  for (auto& group : groups_) {
    // Coalesced: one flat buffer per dtype would be needed for mixed dtypes; parameters of a
    // model share one.
    std::vector<at::Tensor> grads;
    for (const auto& p : group.params) {
      LOOM_CHECK(p.grad().defined(), "a partial gradient is missing: did backward run?");
      grads.push_back(p.grad().reshape({-1}));
    }
    auto flat = at::cat(grads);
    group.comm->all_reduce(flat, dist::ReduceOp::Sum);
    int64_t offset = 0;
    for (const auto& p : group.params) {
      const int64_t n = p.grad().numel();
      p.mutable_grad().copy_(flat.narrow(0, offset, n).view_as(p.grad()));
      offset += n;
    }
  }
}

}  // namespace loom::parallel::tensor
