#include "loom/parallel/tensor/mappings.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "loom/core/error.h"
#include "loom/core/format.h"

namespace loom::parallel::tensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void count(TpGroup& tp, int64_t TpCommStats::*field, const at::Tensor& whole) {
  auto& s = tp.stats();
  s.*field += whole.numel();
  s.ops += 1;
  s.bytes += whole.numel() * static_cast<int64_t>(whole.element_size());
}

int64_t normalize_dim(const at::Tensor& x, int64_t dim) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  LOOM_CHECK(d >= 0 && d < x.dim(),
             "tensor-parallel collective: dim {} is out of range for a "
             "tensor of shape {}",
             dim, x.sizes());
  return d;
}

void check_divisible(const at::Tensor& x, TpGroup& tp, int64_t dim, const char* op) {
  LOOM_CHECK(dim >= 0 && dim < x.dim() && x.size(dim) % tp.size() == 0,
             "{}: dimension {} of a tensor of shape {} must be divisible by tp = {} (with "
             "sequence parallelism the sequence length must be a multiple of tp)",
             op, dim, x.sizes(), tp.size());
}

// The group pointer travels through autograd's saved data as an integer: the group outlives
// every graph built on it (the model holds it).
int64_t pack(TpGroup& tp) {
  return reinterpret_cast<int64_t>(&tp);
}
TpGroup& unpack(AutogradContext* ctx) {
  return *reinterpret_cast<TpGroup*>(ctx->saved_data["tp"].toInt());
}

// Identity | all-reduce.
struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduce_sum(g[0], unpack(ctx)), at::Tensor()};
  }
};

// All-reduce | identity.
struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t tp) {
    return all_reduce_sum(x, *reinterpret_cast<TpGroup*>(tp));
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

// A collective along a dimension forward and its dual backward (both plain functions below).
using DimOp = at::Tensor (*)(const at::Tensor&, TpGroup&, int64_t);

template <DimOp Forward, DimOp Backward>
struct DimMapping : torch::autograd::Function<DimMapping<Forward, Backward>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp, int64_t dim) {
    ctx->saved_data["tp"] = tp;
    ctx->saved_data["dim"] = dim;
    return Forward(x, *reinterpret_cast<TpGroup*>(tp), dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {Backward(g[0], unpack(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

using GatherFromRegion = DimMapping<all_gather_along, chunk_along>;
using GatherFromSequence = DimMapping<all_gather_along, reduce_scatter_along>;
using ReduceScatterToSequence = DimMapping<reduce_scatter_along, all_gather_along>;
using ScatterToSequence = DimMapping<chunk_along, all_gather_along>;

}  // namespace

at::Tensor all_reduce_sum(const at::Tensor& x, TpGroup& tp) {
  // A fresh buffer: the collective writes in place, and x may be saved by autograd.
  auto out = x.contiguous().clone();
  if (tp.size() == 1) return out;
  count(tp, &TpCommStats::all_reduce_elements, out);
  tp.comm()->all_reduce(out, dist::ReduceOp::Sum);
  return out;
}

at::Tensor all_gather_along(const at::Tensor& x, TpGroup& tp, int64_t dim) {
  dim = normalize_dim(x, dim);
  if (tp.size() == 1) return x.contiguous().clone();
  const auto in = x.contiguous();
  // Rank-major buffer [tp, *x.shape], then the rank axis folded into `dim`.
  std::vector<int64_t> stacked{tp.size()};
  for (auto s : in.sizes()) stacked.push_back(s);
  auto buffer = at::empty(stacked, in.options());
  tp.comm()->all_gather(buffer, in);
  count(tp, &TpCommStats::all_gather_elements, buffer);
  auto shape = in.sizes().vec();
  shape[static_cast<size_t>(dim)] *= tp.size();
  return buffer.movedim(0, dim).reshape(shape);
}

at::Tensor reduce_scatter_along(const at::Tensor& x, TpGroup& tp, int64_t dim) {
  dim = normalize_dim(x, dim);
  if (tp.size() == 1) return x.contiguous().clone();
  check_divisible(x, tp, dim, "reduce-scatter");
  // Rank-major: the chunk rank r receives becomes the r-th contiguous block.
  auto split = x.sizes().vec();
  split[static_cast<size_t>(dim)] /= tp.size();
  split.insert(split.begin() + dim, tp.size());
  const auto in = x.reshape(split).movedim(dim, 0).contiguous();
  auto out_shape = x.sizes().vec();
  out_shape[static_cast<size_t>(dim)] /= tp.size();
  auto out = at::empty(out_shape, x.options());
  count(tp, &TpCommStats::reduce_scatter_elements, in);
  tp.comm()->reduce_scatter(out, in, dist::ReduceOp::Sum);
  return out;
}

at::Tensor chunk_along(const at::Tensor& x, TpGroup& tp, int64_t dim) {
  dim = normalize_dim(x, dim);
  if (tp.size() == 1) return x.contiguous();
  check_divisible(x, tp, dim, "split");
  const int64_t n = x.size(dim) / tp.size();
  return x.narrow(dim, tp.rank() * n, n).contiguous();
}

at::Tensor copy_to_tp_region(const at::Tensor& x, TpGroup& tp) {
  return tp.size() == 1 ? x : CopyToRegion::apply(x, pack(tp));
}
at::Tensor reduce_from_tp_region(const at::Tensor& x, TpGroup& tp) {
  return tp.size() == 1 ? x : ReduceFromRegion::apply(x, pack(tp));
}
at::Tensor gather_from_tp_region(const at::Tensor& x, TpGroup& tp, int64_t dim) {
  return tp.size() == 1 ? x : GatherFromRegion::apply(x, pack(tp), normalize_dim(x, dim));
}
at::Tensor gather_from_sequence_region(const at::Tensor& x, TpGroup& tp, int64_t dim) {
  return tp.size() == 1 ? x : GatherFromSequence::apply(x, pack(tp), normalize_dim(x, dim));
}
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x, TpGroup& tp, int64_t dim) {
  return tp.size() == 1 ? x : ReduceScatterToSequence::apply(x, pack(tp), normalize_dim(x, dim));
}
at::Tensor scatter_to_sequence_region(const at::Tensor& x, TpGroup& tp, int64_t dim) {
  return tp.size() == 1 ? x : ScatterToSequence::apply(x, pack(tp), normalize_dim(x, dim));
}

at::Tensor enter_tp_region(const at::Tensor& x, TpGroup& tp, int64_t seq_dim) {
  return tp.sequence_parallel() ? gather_from_sequence_region(x, tp, seq_dim)
                                : copy_to_tp_region(x, tp);
}
at::Tensor exit_tp_region(const at::Tensor& x, TpGroup& tp, int64_t seq_dim) {
  return tp.sequence_parallel() ? reduce_scatter_to_sequence_region(x, tp, seq_dim)
                                : reduce_from_tp_region(x, tp);
}

at::Tensor enter_feature_blocks(const at::Tensor& x, TpGroup& tp, int64_t seq_dim) {
  if (tp.size() == 1) return x;
  const int64_t features = x.size(-1) / tp.size();
  if (!tp.sequence_parallel()) return scatter_to_sequence_region(x, tp, -1);
  // The narrow's backward puts this rank's gradient into zeros elsewhere: partial sums that the
  // gather's reduce-scatter adds up.
  return gather_from_sequence_region(x, tp, seq_dim).narrow(-1, tp.rank() * features, features);
}

at::Tensor exit_feature_blocks(const at::Tensor& y, TpGroup& tp, int64_t seq_dim) {
  if (tp.size() == 1) return y;
  auto whole = gather_from_tp_region(y, tp, -1);
  return tp.sequence_parallel() ? scatter_to_sequence_region(whole, tp, seq_dim) : whole;
}

}  // namespace loom::parallel::tensor
