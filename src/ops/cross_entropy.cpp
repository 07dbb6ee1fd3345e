#include "loom/ops/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <algorithm>
#include <limits>

#include "cross_entropy_passes.h"
#include "kernel_checks.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/cuda.h"
#include "loom/ops/precision.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per parallel task on the CPU: about 32k logits each.
int64_t cpu_grain(int64_t columns) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, columns));
}

template <typename Acc>
void stats_on_cpu(const kernels::CrossEntropyRows& r, at::Tensor& stats) {
  Acc* p = stats.data_ptr<Acc>();
  const kernels::CrossEntropyStats<Acc> out{p, p + r.rows, p + 2 * r.rows, p + 3 * r.rows};
  at::parallel_for(0, r.rows, cpu_grain(r.ld), [&](int64_t begin, int64_t end) {
    const auto status = kernels::cross_entropy_stats_host(r, out, begin, end);
    LOOM_CHECK(status.ok(), "fused cross-entropy: {}", status.message);
  });
}

}  // namespace

namespace detail {

bool kernel_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

kernels::CrossEntropyRows describe_rows(const at::Tensor& logits2d, const at::Tensor& targets,
                                        int64_t col_offset, int64_t valid, int64_t ignore_index) {
  kernels::CrossEntropyRows r;
  r.dtype = detail::element_dtype(logits2d.scalar_type(), "fused cross-entropy: logits");
  r.logits = logits2d.const_data_ptr();
  r.rows = logits2d.size(0);
  r.ld = logits2d.size(1);
  r.valid = valid;
  r.col_offset = col_offset;
  r.targets = targets.const_data_ptr<int64_t>();
  r.ignore_index = ignore_index;
  const auto status = kernels::cross_entropy_check(r);
  LOOM_CHECK(status.ok(), "fused cross-entropy: {}", status.message);
  return r;
}

at::Tensor row_stats(const kernels::CrossEntropyRows& r, const at::Tensor& logits2d) {
  auto stats =
      at::empty({4, r.rows}, logits2d.options().dtype(accumulation_dtype(logits2d.scalar_type())));
  if (logits2d.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(logits2d.device());
    float* p = stats.data_ptr<float>();
    const auto status =
        kernels::cross_entropy_stats_apply(r, {p, p + r.rows, p + 2 * r.rows, p + 3 * r.rows},
                                           c10::cuda::getCurrentCUDAStream().stream());
    LOOM_CHECK(status.ok(), "fused cross-entropy kernel: {}", status.message);
#else
    fail("fused cross-entropy on {}: this loom was built without CUDA", logits2d.device().str());
#endif
  } else if (stats.scalar_type() == at::kDouble) {
    stats_on_cpu<double>(r, stats);
  } else {
    stats_on_cpu<float>(r, stats);
  }
  return stats;
}

void row_grads(const kernels::CrossEntropyRows& r, const at::Tensor& lse, const at::Tensor& scale,
               double z_loss, at::Tensor& grad) {
  if (grad.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(grad.device());
    const kernels::CrossEntropyGradArgs<float> args{
        lse.const_data_ptr<float>(), scale.const_data_ptr<float>(), float(z_loss), grad.data_ptr()};
    const auto status =
        kernels::cross_entropy_grad_apply(r, args, c10::cuda::getCurrentCUDAStream().stream());
    LOOM_CHECK(status.ok(), "fused cross-entropy kernel: {}", status.message);
#else
    fail("fused cross-entropy on {}: this loom was built without CUDA", grad.device().str());
#endif
    return;
  }
  const auto run = [&](auto zero) {
    using Acc = decltype(zero);
    const kernels::CrossEntropyGradArgs<Acc> args{
        lse.const_data_ptr<Acc>(), scale.const_data_ptr<Acc>(), Acc(z_loss), grad.data_ptr()};
    at::parallel_for(0, r.rows, cpu_grain(r.ld), [&](int64_t begin, int64_t end) {
      const auto status = kernels::cross_entropy_grad_host(r, args, begin, end);
      LOOM_CHECK(status.ok(), "fused cross-entropy: {}", status.message);
    });
  };
  if (lse.scalar_type() == at::kDouble)
    run(0.0);
  else
    run(0.0f);
}

RowLosses row_losses(const at::Tensor& stats, const at::Tensor& targets,
                     const RowReductions& reduce, int64_t ignore_index, double z_loss) {
  at::Tensor row_max = stats[0], row_sum = stats[1], target_logit = stats[2], found = stats[3];
  if (reduce.max) {
    // Each shard's sum rescaled to the row's max over every shard, then one sum of the
    // rescaled sums, target logits and found flags (an empty shard's sum stays 0).
    auto global_max = row_max.clone();
    reduce.max(global_max);
    auto packed = at::stack(
        {at::where(row_sum == 0, at::zeros_like(row_sum), row_sum * (row_max - global_max).exp()),
         target_logit, found});
    reduce.sum(packed);
    row_max = global_max;
    row_sum = packed[0];
    target_logit = packed[1];
    found = packed[2];
  }
  RowLosses out;
  out.lse = (row_max + row_sum.log()).contiguous();
  out.counted = targets != ignore_index;
  // No shard holds the target: an id outside the vocabulary (the CPU path checks ids before;
  // on a GPU this keeps the error visible as a NaN loss instead of a wrong number).
  auto ce = at::where(found > 0, out.lse - target_logit, std::numeric_limits<double>::quiet_NaN());
  out.cross_entropy = at::where(out.counted, ce, 0.0);
  out.per_row = z_loss != 0
                    ? at::where(out.counted, out.cross_entropy + z_loss * out.lse.square(), 0.0)
                    : out.cross_entropy;
  return out;
}

}  // namespace detail

namespace {

using detail::kernel_dtype;

struct FusedCrossEntropy : torch::autograd::Function<FusedCrossEntropy> {
  // logits2d: [N, V_local] contiguous; targets: [N] int64 contiguous, on the logits' device.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits2d,
                            const at::Tensor& targets, const FusedCrossEntropyOptions& o) {
    const int64_t valid = o.valid < 0 ? logits2d.size(1) : o.valid;
    const auto rows = detail::describe_rows(logits2d, targets, o.col_offset, valid, o.ignore_index);
    const auto stats = detail::row_stats(rows, logits2d);
    const auto losses = detail::row_losses(stats, targets, o.reduce, o.ignore_index, o.z_loss);
    const auto& lse = losses.lse;
    const auto count = losses.counted.sum().to(lse.scalar_type());
    ctx->save_for_backward({logits2d, targets, lse, count});
    ctx->saved_data["col_offset"] = o.col_offset;
    ctx->saved_data["valid"] = valid;
    ctx->saved_data["ignore_index"] = o.ignore_index;
    ctx->saved_data["z_loss"] = o.z_loss;
    ctx->saved_data["overwrite"] = o.overwrite_logits;
    ctx->saved_data["consumed"] = false;
    return losses.per_row.sum() / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const bool overwrite = ctx->saved_data["overwrite"].toBool();
    LOOM_CHECK(!ctx->saved_data["consumed"].toBool(),
               "fused cross-entropy: backward already ran and wrote the gradient over the logits "
               "(overwrite_logits); a second backward through this loss (a retained graph) "
               "cannot read them again");
    const auto saved = ctx->get_saved_variables();
    at::Tensor logits2d = saved[0];
    const auto& targets = saved[1];
    const auto& lse = saved[2];
    const auto& count = saved[3];
    const auto rows = detail::describe_rows(
        logits2d, targets, ctx->saved_data["col_offset"].toInt(), ctx->saved_data["valid"].toInt(),
        ctx->saved_data["ignore_index"].toInt());
    const auto scale = (grad_out[0].to(lse.scalar_type()) / count).contiguous();
    // detach(): the gradient handed to autograd shares the logits' memory (and version
    // counter), not their autograd history.
    at::Tensor grad = overwrite ? logits2d.detach() : at::empty_like(logits2d);
    detail::row_grads(rows, lse, scale, ctx->saved_data["z_loss"].toDouble(), grad);
    if (overwrite) {
      // Anything else that saved these logits now sees them changed, as after an in-place op.
      logits2d.unsafeGetTensorImpl()->bump_version();
      ctx->saved_data["consumed"] = true;
    }
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

LossBackend parse_loss_backend(const std::string& name) {
  return parse_fused_choice(name, "loss backend");
}

bool uses_fused_loss(LossBackend backend, const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  switch (backend) {
    case LossBackend::kMath:
      return false;
    case LossBackend::kAuto:
      return logits.is_cuda() && built_with_cuda() && kernel_dtype(dtype);
    case LossBackend::kFused:
      break;
  }
  if (logits.is_cuda()) {
    LOOM_CHECK(built_with_cuda(), "--loss fused on {}: this loom was built without CUDA",
               logits.device().str());
    LOOM_CHECK(kernel_dtype(dtype),
               "--loss fused on CUDA takes fp32, fp16 or bf16 logits; got {} (use --loss math "
               "or auto)",
               c10::toString(dtype));
    return true;
  }
  LOOM_CHECK(logits.is_cpu(), "--loss fused: CPU and CUDA tensors only; got {}",
             logits.device().str());
  LOOM_CHECK(kernel_dtype(dtype) || dtype == at::kDouble,
             "--loss fused takes fp32, fp64, fp16 or bf16 logits; got {}", c10::toString(dtype));
  return true;
}

at::Tensor fused_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                               const FusedCrossEntropyOptions& options) {
  LOOM_CHECK(logits.dim() >= 1 && targets.sizes() == logits.sizes().slice(0, logits.dim() - 1),
             "fused cross-entropy: logits {} and targets {} do not match ([..., V] and [...])",
             logits.sizes(), targets.sizes());
  LOOM_CHECK(targets.scalar_type() == at::kLong && targets.device() == logits.device(),
             "fused cross-entropy: targets must be int64 on the logits' device ({}); got {} on {}",
             logits.device().str(), c10::toString(targets.scalar_type()), targets.device().str());
  LOOM_CHECK(options.valid <= logits.size(-1),
             "fused cross-entropy: valid {} columns exceed the logits' {}", options.valid,
             logits.size(-1));
  LOOM_CHECK(static_cast<bool>(options.reduce.max) == static_cast<bool>(options.reduce.sum),
             "fused cross-entropy: the row reductions come as a pair (max and sum)");
  LOOM_CHECK(std::isfinite(options.z_loss) && options.z_loss >= 0,
             "fused cross-entropy: z_loss {} must be a finite value >= 0", options.z_loss);
  LOOM_CHECK(logits.is_cpu() || (logits.is_cuda() && kernel_dtype(logits.scalar_type())),
             "fused cross-entropy: takes CPU logits (fp32, fp64, fp16, bf16) or CUDA logits "
             "(fp32, fp16, bf16); got {} on {}",
             c10::toString(logits.scalar_type()), logits.device().str());
  const auto logits2d = logits.reshape({-1, logits.size(-1)}).contiguous();
  return FusedCrossEntropy::apply(logits2d, targets.reshape({-1}).contiguous(), options);
}

}  // namespace loom::ops
