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

// What the math loss and the per-token losses share, for rows of logits2d ([N, V_local], this
// rank's columns of the padded vocabulary) and targets [N]: the row maximum and the sum of
// exponentials across the group, the target's logit less the maximum (summed across the group:
// one rank holds it), and this rank's exponentials.
struct RowTerms {
  at::Tensor exp;             // [N, valid] exp(x - row max), this rank's unpadded columns
  at::Tensor row_max;         // [N]
  at::Tensor sum_exp;         // [N]
  at::Tensor target_shifted;  // [N] target logit - row max
  at::Tensor local_target, in_range;
  int64_t valid = 0;
};

RowTerms row_terms(const at::Tensor& logits2d, const at::Tensor& targets, int64_t vocab,
                   TpGroup& tp) {
  const int64_t n = logits2d.size(0), v_local = logits2d.size(1);
  const int64_t start = tp.rank() * v_local;
  RowTerms t;
  t.valid = std::clamp<int64_t>(vocab - start, 0, v_local);  // unpadded columns
  auto x = ops::to_accumulation_dtype(logits2d.narrow(1, 0, t.valid));

  // Row maximum across the group (a rank holding only padding contributes -inf).
  t.row_max = t.valid > 0 ? std::get<0>(x.max(1)).contiguous()
                          : at::full({n}, -std::numeric_limits<float>::infinity(), x.options());
  if (tp.size() > 1) {
    count_loss_op(tp, t.row_max);
    tp.comm()->all_reduce(t.row_max, dist::ReduceOp::Max);
  }
  t.exp = (x - t.row_max.unsqueeze(1)).exp_();

  // Sum of exponentials and the target's shifted logit, summed across the group in one op.
  t.in_range = (targets >= start).logical_and(targets < start + t.valid);
  t.local_target = (targets - start).masked_fill(t.in_range.logical_not(), 0);
  auto sums = at::empty({2, n}, x.options());
  sums[0].copy_(t.exp.sum(1));
  sums[1].copy_(t.valid > 0 ? (x.gather(1, t.local_target.unsqueeze(1)).squeeze(1) - t.row_max)
                                  .masked_fill(t.in_range.logical_not(), 0.0)
                            : at::zeros({n}, x.options()));
  if (tp.size() > 1) {
    count_loss_op(tp, sums);
    tp.comm()->all_reduce(sums, dist::ReduceOp::Sum);
  }
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

// The fused kernels on this rank's columns, the group's max and sum between their passes.
at::Tensor fused_vocab_parallel(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab,
                                TpGroup& tp, const VocabLossOptions& options) {
  const int64_t v_local = logits.size(-1);
  ops::FusedCrossEntropyOptions o;
  o.col_offset = tp.rank() * v_local;
  o.valid = std::clamp<int64_t>(vocab - o.col_offset, 0, v_local);
  o.z_loss = options.z_loss;
  o.overwrite_logits = options.overwrite_logits;
  if (tp.size() > 1) {
    o.reduce.max = [&tp](at::Tensor& t) {
      count_loss_op(tp, t);
      tp.comm()->all_reduce(t, dist::ReduceOp::Max);
    };
    o.reduce.sum = [&tp](at::Tensor& t) {
      count_loss_op(tp, t);
      tp.comm()->all_reduce(t, dist::ReduceOp::Sum);
    };
  }
  return ops::fused_cross_entropy(logits, targets, o);
}

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab, TpGroup& tp,
                                        const VocabLossOptions& options) {
  LOOM_CHECK(logits.dim() >= 1 && targets.sizes() == logits.sizes().slice(0, logits.dim() - 1),
             "cross-entropy: logits {} and targets {} do not match ([..., V] and [...])",
             logits.sizes(), targets.sizes());
  LOOM_CHECK(logits.size(-1) * tp.size() >= vocab,
             "cross-entropy: {} columns on each of {} ranks cannot hold a vocabulary of {}",
             logits.size(-1), tp.size(), vocab);
  LOOM_CHECK(std::isfinite(options.z_loss) && options.z_loss >= 0,
             "cross-entropy: z-loss {} must be a finite value >= 0", options.z_loss);
  if (ops::uses_fused_loss(options.backend, logits))
    return fused_vocab_parallel(logits, targets, vocab, tp, options);
  auto logits2d = logits.reshape({-1, logits.size(-1)});
  return VocabParallelCrossEntropy::apply(logits2d, targets.reshape({-1}), vocab,
                                          reinterpret_cast<int64_t>(&tp), options.z_loss);
}

at::Tensor vocab_parallel_token_losses(const at::Tensor& logits, const at::Tensor& targets,
                                       int64_t vocab, TpGroup& tp) {
  LOOM_CHECK(logits.dim() >= 1 && targets.sizes() == logits.sizes().slice(0, logits.dim() - 1),
             "cross-entropy: logits {} and targets {} do not match ([..., V] and [...])",
             logits.sizes(), targets.sizes());
  LOOM_CHECK(logits.size(-1) * tp.size() >= vocab,
             "cross-entropy: {} columns on each of {} ranks cannot hold a vocabulary of {}",
             logits.size(-1), tp.size(), vocab);
  at::NoGradGuard no_grad;
  const auto logits2d = logits.detach().reshape({-1, logits.size(-1)});
  const auto flat_targets = targets.reshape({-1});
  const int64_t n = logits2d.size(0);
  // Rows at a time: the exponentials of at most ~2^24 elements exist at once.
  const int64_t chunk =
      std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, logits2d.size(1)));
  auto out =
      at::empty({n}, logits2d.options().dtype(ops::accumulation_dtype(logits.scalar_type())));
  for (int64_t first = 0; first < n; first += chunk) {
    const int64_t rows = std::min(chunk, n - first);
    const auto t =
        row_terms(logits2d.narrow(0, first, rows), flat_targets.narrow(0, first, rows), vocab, tp);
    out.narrow(0, first, rows).copy_(t.sum_exp.log() - t.target_shifted);
  }
  return out.view(targets.sizes());
}

}  // namespace loom::parallel::tensor
