#include "loom/parallel/tensor/cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/precision.h"

namespace loom::parallel::tensor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void count_loss_op(TpGroup& tp, const at::Tensor& t) {
  auto& s = tp.stats();
  s.loss_elements += t.numel();
  s.ops += 1;
  s.bytes += t.numel() * static_cast<int64_t>(t.element_size());
}

// What the math loss and the per-token losses share. For rows of logits2d ([N, V_local], this
// rank's columns of the padded vocabulary): the unpadded columns in the accumulation dtype, the
// local row maximum, and the local sums — of exp(x - row max), and of the target's logit less the
// maximum (one rank holds it) — which the group then reduces (max, then sum).
struct Columns {
  at::Tensor x;  // [N, valid]
  int64_t start = 0, valid = 0;
};

Columns columns_of(const at::Tensor& logits2d, int64_t vocab, const TpGroup& tp) {
  Columns c;
  c.start = tp.rank() * logits2d.size(1);
  c.valid = std::clamp<int64_t>(vocab - c.start, 0, logits2d.size(1));  // unpadded columns
  c.x = ops::to_accumulation_dtype(logits2d.narrow(1, 0, c.valid));
  return c;
}

// This rank's row maximum (-inf on a rank holding only padding).
at::Tensor local_row_max(const Columns& c) {
  return c.valid > 0
             ? std::get<0>(c.x.max(1)).contiguous()
             : at::full({c.x.size(0)}, -std::numeric_limits<float>::infinity(), c.x.options());
}

struct LocalSums {
  at::Tensor exp;  // [N, valid] exp(x - row max)
  at::Tensor local_target, in_range;
};

// Writes this rank's two sums into sums [2, N] (given the group's row maximum).
LocalSums local_sums(const Columns& c, const at::Tensor& targets, const at::Tensor& row_max,
                     at::Tensor sums) {
  LocalSums l;
  l.exp = (c.x - row_max.unsqueeze(1)).exp_();
  l.in_range = (targets >= c.start).logical_and(targets < c.start + c.valid);
  l.local_target = (targets - c.start).masked_fill(l.in_range.logical_not(), 0);
  sums[0].copy_(l.exp.sum(1));
  sums[1].copy_(c.valid > 0 ? (c.x.gather(1, l.local_target.unsqueeze(1)).squeeze(1) - row_max)
                                  .masked_fill(l.in_range.logical_not(), 0.0)
                            : at::zeros({c.x.size(0)}, c.x.options()));
  return l;
}

void reduce_over_group(TpGroup& tp, at::Tensor& t, dist::ReduceOp op) {
  if (tp.size() == 1) return;
  count_loss_op(tp, t);
  tp.comm()->all_reduce(t, op);
}

struct RowTerms {
  at::Tensor exp;             // [N, valid] exp(x - row max), this rank's unpadded columns
  at::Tensor row_max;         // [N]
  at::Tensor sum_exp;         // [N]
  at::Tensor target_shifted;  // [N] target logit - row max
  at::Tensor local_target, in_range;
};

RowTerms row_terms(const at::Tensor& logits2d, const at::Tensor& targets, int64_t vocab,
                   TpGroup& tp) {
  const auto c = columns_of(logits2d, vocab, tp);
  RowTerms t;
  t.row_max = local_row_max(c);
  reduce_over_group(tp, t.row_max, dist::ReduceOp::Max);
  // The sum of exponentials and the target's shifted logit, summed across the group in one op.
  auto sums = at::empty({2, logits2d.size(0)}, c.x.options());
  auto l = local_sums(c, targets, t.row_max, sums);
  reduce_over_group(tp, sums, dist::ReduceOp::Sum);
  t.exp = std::move(l.exp);
  t.local_target = std::move(l.local_target);
  t.in_range = std::move(l.in_range);
  t.sum_exp = sums[0];
  t.target_shifted = sums[1];
  return t;
}

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  // logits2d: [N, V_local] any float dtype; targets: [N] int64.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits2d,
                            const at::Tensor& targets, int64_t vocab, int64_t tp_ptr,
                            double z_loss) {
    auto& tp = *reinterpret_cast<TpGroup*>(tp_ptr);
    const int64_t v_local = logits2d.size(1);
    auto terms = row_terms(logits2d, targets, vocab, tp);
    const auto& row_max = terms.row_max;
    auto& exp = terms.exp;
    const auto& local_target = terms.local_target;
    const auto& in_range = terms.in_range;
    const auto& sum_exp = terms.sum_exp;
    auto loss = (sum_exp.log() - terms.target_shifted).mean();
    // z-loss: z * mean(lse^2), lse = max + log(sum of exponentials).
    const auto lse = row_max + sum_exp.log();
    if (z_loss != 0) loss = loss + z_loss * lse.square().mean();

    // Saved for backward: this rank's softmax shard and where the targets fall in it.
    auto softmax = exp.div_(sum_exp.unsqueeze(1));
    ctx->save_for_backward({softmax, local_target, in_range, lse});
    ctx->saved_data["z_loss"] = z_loss;
    ctx->saved_data["v_local"] = v_local;
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits2d.scalar_type());
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto& softmax = saved[0];
    const auto& local_target = saved[1];
    const auto& in_range = saved[2];
    const int64_t n = softmax.size(0), valid = softmax.size(1);
    const int64_t v_local = ctx->saved_data["v_local"].toInt();
    // d(mean loss)/d logit = (softmax (1 + 2 z lse) - onehot(target)) / N, on this rank's
    // columns.
    const double z_loss = ctx->saved_data["z_loss"].toDouble();
    auto grad = z_loss != 0 ? softmax * (1 + 2 * z_loss * saved[3]).unsqueeze(1) : softmax.clone();
    if (valid > 0)
      grad.scatter_add_(1, local_target.unsqueeze(1),
                        -in_range.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_(grad_out[0] / static_cast<double>(n));
    if (valid < v_local) grad = at::cat({grad, at::zeros({n, v_local - valid}, grad.options())}, 1);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// This rank's columns of a vocabulary shard of v_local columns, and the group's reductions.
template <typename Options>
void set_shard(Options& o, int64_t v_local, int64_t vocab, TpGroup& tp) {
  o.col_offset = tp.rank() * v_local;
  o.valid = std::clamp<int64_t>(vocab - o.col_offset, 0, v_local);
  if (tp.size() > 1) {
    o.reduce.max = [&tp](at::Tensor& t) { reduce_over_group(tp, t, dist::ReduceOp::Max); };
    o.reduce.sum = [&tp](at::Tensor& t) { reduce_over_group(tp, t, dist::ReduceOp::Sum); };
  }
}

// The fused kernels on this rank's columns, the group's max and sum between their passes.
at::Tensor fused_vocab_parallel(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab,
                                TpGroup& tp, const VocabLossOptions& options) {
  ops::FusedCrossEntropyOptions o;
  set_shard(o, logits.size(-1), vocab, tp);
  o.z_loss = options.z_loss;
  o.overwrite_logits = options.overwrite_logits;
  return ops::fused_cross_entropy(logits, targets, o);
}

void check_logits(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab,
                  const TpGroup& tp) {
  LOOM_CHECK(logits.dim() >= 1 && targets.sizes() == logits.sizes().slice(0, logits.dim() - 1),
             "cross-entropy: logits {} and targets {} do not match ([..., V] and [...])",
             logits.sizes(), targets.sizes());
  LOOM_CHECK(logits.size(-1) * tp.size() >= vocab,
             "cross-entropy: {} columns on each of {} ranks cannot hold a vocabulary of {}",
             logits.size(-1), tp.size(), vocab);
}

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab, TpGroup& tp,
                                        const VocabLossOptions& options) {
  check_logits(logits, targets, vocab, tp);
  LOOM_CHECK(std::isfinite(options.z_loss) && options.z_loss >= 0,
             "cross-entropy: z-loss {} must be a finite value >= 0", options.z_loss);
  if (ops::uses_fused_loss(options.backend, logits))
    return fused_vocab_parallel(logits, targets, vocab, tp, options);
  auto logits2d = logits.reshape({-1, logits.size(-1)});
  return VocabParallelCrossEntropy::apply(logits2d, targets.reshape({-1}), vocab,
                                          reinterpret_cast<int64_t>(&tp), options.z_loss);
}

at::Tensor vocab_parallel_linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                               const at::Tensor& targets, int64_t vocab,
                                               TpGroup& tp, const VocabLinearLossOptions& options) {
  LOOM_CHECK(weight.dim() == 2 && weight.size(0) * tp.size() >= vocab,
             "cross-entropy: a head of {} rows on each of {} ranks cannot hold a vocabulary of {}",
             weight.dim() == 2 ? weight.size(0) : -1, tp.size(), vocab);
  ops::LinearCrossEntropyOptions o;
  set_shard(o, weight.size(0), vocab, tp);
  o.chunk_rows = options.chunk_rows;
  o.z_loss = options.z_loss;
  o.row_losses = options.row_losses;
  const auto loss = ops::linear_cross_entropy(hidden, weight, targets, o);
  if (options.row_losses != nullptr)
    *options.row_losses = options.row_losses->view(targets.sizes());
  return loss;
}

at::Tensor vocab_parallel_token_losses(const at::Tensor& logits, const at::Tensor& targets,
                                       int64_t vocab, TpGroup& tp) {
  check_logits(logits, targets, vocab, tp);
  at::NoGradGuard no_grad;
  const auto logits2d = logits.detach().reshape({-1, logits.size(-1)});
  const auto flat_targets = targets.reshape({-1});
  const int64_t n = logits2d.size(0);
  // Rows at a time: the exponentials of at most ~2^24 elements exist at once. Two passes (the
  // row maxima, then the sums), each reduced over the group once for all rows.
  const int64_t chunk =
      std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, logits2d.size(1)));
  const auto rows_of = [&](int64_t first) {
    return columns_of(logits2d.narrow(0, first, std::min(chunk, n - first)), vocab, tp);
  };
  auto row_max =
      at::empty({n}, logits2d.options().dtype(ops::accumulation_dtype(logits.scalar_type())));
  for (int64_t first = 0; first < n; first += chunk) {
    const auto c = rows_of(first);
    row_max.narrow(0, first, c.x.size(0)).copy_(local_row_max(c));
  }
  reduce_over_group(tp, row_max, dist::ReduceOp::Max);
  auto sums = at::empty({2, n}, row_max.options());
  for (int64_t first = 0; first < n; first += chunk) {
    const auto c = rows_of(first);
    const int64_t rows = c.x.size(0);
    local_sums(c, flat_targets.narrow(0, first, rows), row_max.narrow(0, first, rows),
               sums.narrow(1, first, rows));
  }
  reduce_over_group(tp, sums, dist::ReduceOp::Sum);
  const auto out = sums[0].log() - sums[1];
  return out.view(targets.sizes());
}

}  // namespace loom::parallel::tensor
