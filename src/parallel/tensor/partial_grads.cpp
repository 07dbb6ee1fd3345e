#include "loom/parallel/tensor/partial_grads.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "loom/core/error.h"
#include "loom/dist/coalesced.h"

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
      if (spec.grad_partial) {
        whole.names.push_back(name);
        whole.params.push_back(param);
      }
      continue;
    }
    const int64_t reps = spec.replicas(tp_->size());
    if (reps > 1) {
      by_replicas[reps].names.push_back(name);
      by_replicas[reps].params.push_back(param);
    }
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

void PartialGradSync::sum_in_place(Group& group, const std::vector<at::Tensor>& parts) {
  // One flat buffer: parameters of a model share one dtype. Empty pieces are alike on every
  // rank (the pieces were compared), so an empty sum is skipped everywhere.
  dist::all_reduce_coalesced(*group.comm, parts, dist::ReduceOp::Sum);
}

void PartialGradSync::sync() {
  torch::NoGradGuard no_grad;
  for (auto& group : groups_) {
    std::vector<at::Tensor> grads;
    for (const auto& p : group.params) {
      LOOM_CHECK(p.grad().defined(), "a partial gradient is missing: did backward run?");
      grads.push_back(p.mutable_grad());
    }
    sum_in_place(group, grads);
  }
}

void PartialGradSync::sync(const GradPieceFn& piece) {
  torch::NoGradGuard no_grad;
  for (auto& group : groups_) {
    std::vector<at::Tensor> parts;
    std::vector<int64_t> where;  // offset and length per parameter
    for (const auto& name : group.names) {
      auto p = piece(name);
      LOOM_CHECK(p.values.defined() && p.values.dim() == 1,
                 "PartialGradSync: the gradient piece of '{}' must be a 1-D tensor", name);
      where.push_back(p.offset);
      where.push_back(p.values.numel());
      parts.push_back(p.values);
    }
    if (!group.pieces_checked) {
      // Summing pieces that cover different elements would silently mix parameters: compare
      // every rank's offsets and lengths with the group's largest and smallest.
      // [where; -where] in one all-reduce (max), on the pieces' device (an NCCL group reduces
      // device tensors only).
      auto mine = at::tensor(where);
      auto both = at::cat({mine, -mine}).to(parts.front().device());
      group.comm->all_reduce(both, dist::ReduceOp::Max);
      both = both.cpu();
      const auto n = static_cast<int64_t>(where.size());
      const auto hi = both.narrow(0, 0, n), lo = both.narrow(0, n, n);
      const auto h = hi.accessor<int64_t, 1>();
      const auto l = lo.accessor<int64_t, 1>();
      for (size_t i = 0; i < group.names.size(); ++i) {
        const auto k = static_cast<int64_t>(2 * i);
        LOOM_CHECK(h[k] == -l[k] && h[k + 1] == -l[k + 1],
                   "the tensor-parallel ranks hold different pieces of the gradient of '{}' "
                   "(offsets {}..{}, lengths {}..{}): their gradient shards are laid out "
                   "differently, so its partial sums cannot be added",
                   group.names[i], -l[k], h[k], -l[k + 1], h[k + 1]);
      }
      group.pieces_checked = true;
    }
    sum_in_place(group, parts);
  }
}

}  // namespace loom::parallel::tensor
