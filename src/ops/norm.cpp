#include "loom/ops/norm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <algorithm>

#include "kernel_checks.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/cuda.h"
#include "loom/ops/precision.h"
#include "norm/add_norm.h"

#ifdef LOOM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

kernels::NormKind kernel_kind(NormKind kind) {
  return kind == NormKind::kLayerNorm ? kernels::NormKind::kLayerNorm : kernels::NormKind::kRmsNorm;
}

bool is_16_bit(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16;
}

// Why the fused op cannot take these inputs on their device ("" when it can).
std::string unsupported(const at::Tensor& residual, const at::Tensor& branch, const NormParams& p) {
  const auto acc = residual.scalar_type();
  if (!residual.is_cpu() && !residual.is_cuda())
    return fmt::format("CPU and CUDA tensors only; got {}", residual.device().str());
  if (residual.is_cuda() && !built_with_cuda())
    return fmt::format("{}: this loom was built without CUDA", residual.device().str());
  if (acc != at::kFloat && !(acc == at::kDouble && residual.is_cpu()))
    return fmt::format("the residual stream must be fp32 (or fp64 on the CPU); got {}",
                       c10::toString(acc));
  if (!p.weight.defined() || p.weight.scalar_type() != acc ||
      (p.bias.defined() && p.bias.scalar_type() != acc))
    return fmt::format("the norm's parameters must be in the residual's dtype ({})",
                       c10::toString(acc));
  const auto io = normed_dtype(residual, branch);
  if (io != acc && !(acc == at::kFloat && is_16_bit(io)))
    return fmt::format("a {} branch or output with a {} residual", c10::toString(io),
                       c10::toString(acc));
  return "";
}

// Slices of rows for the weight partials: on a GPU enough CUDA blocks to fill it (about 4 per
// SM) with at least 32 rows a slice; on the CPU one per 256 rows, at most 64.
int64_t weight_slices(const at::Tensor& t, int64_t rows, int64_t width) {
  if (rows == 0) return 1;
#ifdef LOOM_WITH_CUDA
  if (t.is_cuda()) {
    const int64_t sms = at::cuda::getDeviceProperties(t.get_device())->multiProcessorCount;
    const int64_t column_blocks = (width + kernels::kAddNormThreads - 1) / kernels::kAddNormThreads;
    const int64_t want = std::max<int64_t>(1, 4 * sms / column_blocks);
    return std::clamp<int64_t>(std::min(want, (rows + 31) / 32), 1, rows);
  }
#endif
  (void)t;
  (void)width;
  return std::clamp<int64_t>((rows + 255) / 256, 1, 64);
}

// Rows per parallel task on the CPU: about 16k elements each.
int64_t cpu_grain(int64_t width) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width));
}

void check_status(const kernels::Status& s) {
  LOOM_CHECK(s.ok(), "fused add + norm: {}", s.message);
}

#ifdef LOOM_WITH_CUDA
cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}
#endif

// Runs `host(Acc())` on the CPU (float or double, as the residual) or `device()` on CUDA.
template <typename Host, typename Device>
void dispatch(const at::Tensor& residual, Host&& host, Device&& device) {
  if (residual.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(residual.device());
    device();
#else
    (void)device;
    fail("fused add + norm on {}: this loom was built without CUDA", residual.device().str());
#endif
  } else if (residual.scalar_type() == at::kDouble) {
    host(0.0);
  } else {
    host(0.0f);
  }
}

// An absent input as autograd functions take it (they need every tensor argument defined): an
// empty tensor, with a flag saying it is absent.
at::Tensor or_empty(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t : at::empty({0}, like.options());
}

struct FusedAddNorm : torch::autograd::Function<FusedAddNorm> {
  // residual2d, branch2d: [rows, width] contiguous; branch2d and bias empty when absent.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& residual2d,
                               const at::Tensor& branch_or_empty, const at::Tensor& weight,
                               const at::Tensor& bias_or_empty, bool has_branch, bool has_bias,
                               int64_t kind, double eps) {
    // Undefined gradients stay undefined (an unused sum or normed output costs nothing).
    ctx->set_materialize_grads(false);
    const auto branch2d = has_branch ? branch_or_empty : at::Tensor();
    const auto bias = has_bias ? bias_or_empty : at::Tensor();
    const auto io = normed_dtype(residual2d, branch2d);
    const kernels::NormRows rows{kernel_kind(NormKind(kind)),
                                 detail::element_dtype(io, "fused add + norm: tensors"),
                                 residual2d.size(0), residual2d.size(1)};
    auto sum = has_branch ? at::empty_like(residual2d) : at::Tensor();
    auto normed = at::empty(residual2d.sizes(), residual2d.options().dtype(io));
    auto stats = at::empty({2, rows.rows}, residual2d.options());  // mean, rstd
    const auto weight_c = weight.contiguous();
    const auto bias_c = bias.defined() ? bias.contiguous() : at::Tensor();
    const auto args = [&](auto zero) {
      using Acc = decltype(zero);
      return kernels::AddNormForwardArgs<Acc>{
          residual2d.const_data_ptr<Acc>(),
          has_branch ? branch2d.const_data_ptr() : nullptr,
          weight_c.const_data_ptr<Acc>(),
          bias_c.defined() ? bias_c.const_data_ptr<Acc>() : nullptr,
          Acc(eps),
          has_branch ? sum.data_ptr<Acc>() : nullptr,
          normed.data_ptr(),
          stats.data_ptr<Acc>(),
          stats.data_ptr<Acc>() + rows.rows};
    };
    dispatch(
        residual2d,
        [&](auto zero) {
          const auto a = args(zero);
          at::parallel_for(0, rows.rows, cpu_grain(rows.width), [&](int64_t begin, int64_t end) {
            check_status(kernels::add_norm_forward_host(rows, a, begin, end));
          });
        },
        [&] {
#ifdef LOOM_WITH_CUDA
          check_status(
              kernels::add_norm_forward_apply(rows, args(0.0f), current_stream(residual2d)));
#endif
        });
    ctx->save_for_backward({has_branch ? sum : residual2d, weight_c, stats});
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["has_branch"] = has_branch;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["io"] = static_cast<int64_t>(io);
    if (has_branch) return {sum, normed};
    return {normed};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& in = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& stats = saved[2];
    const bool has_branch = ctx->saved_data["has_branch"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto io = static_cast<at::ScalarType>(ctx->saved_data["io"].toInt());
    const at::Tensor grad_sum = has_branch ? grads[0] : at::Tensor();
    const at::Tensor grad_normed_in = has_branch ? grads[1] : grads[0];
    const kernels::NormRows rows{kernel_kind(NormKind(ctx->saved_data["kind"].toInt())),
                                 detail::element_dtype(io, "fused add + norm: tensors"), in.size(0),
                                 in.size(1)};
    at::Tensor grad_input, grad_branch, grad_weight, grad_bias;
    if (!grad_normed_in.defined()) {
      // Only the sum was used: its gradient passes to the residual and the branch.
      grad_input = grad_sum;
      if (has_branch && grad_sum.defined() && ctx->needs_input_grad(1))
        grad_branch = grad_sum.to(io);
      return {grad_input,   grad_branch,  at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const auto grad_normed = grad_normed_in.to(io).contiguous();
    const auto grad_sum_c =
        grad_sum.defined() ? grad_sum.to(in.scalar_type()).contiguous() : at::Tensor();
    grad_input = at::empty_like(in);
    // The branch's gradient: the residual's itself when they share the dtype, else rounded.
    const bool branch_grad = has_branch && ctx->needs_input_grad(1);
    const bool round_branch = branch_grad && io != in.scalar_type();
    if (round_branch) grad_branch = at::empty(in.sizes(), in.options().dtype(io));
    const int64_t slices = weight_slices(in, rows.rows, rows.width);
    const bool weight_grads = ctx->needs_input_grad(2) || ctx->needs_input_grad(3);
    auto partials = weight_grads ? at::empty({has_bias ? 2 : 1, slices, rows.width}, in.options())
                                 : at::Tensor();
    const auto args = [&](auto zero) {
      using Acc = decltype(zero);
      const Acc* s = stats.const_data_ptr<Acc>();
      const kernels::AddNormBackwardArgs<Acc> b{
          in.const_data_ptr<Acc>(),
          weight.const_data_ptr<Acc>(),
          s,
          s + rows.rows,
          grad_normed.const_data_ptr(),
          grad_sum_c.defined() ? grad_sum_c.const_data_ptr<Acc>() : nullptr,
          grad_input.data_ptr<Acc>(),
          round_branch ? grad_branch.data_ptr() : nullptr};
      Acc* p = weight_grads ? partials.data_ptr<Acc>() : nullptr;
      const kernels::NormWeightGradArgs<Acc> w{in.const_data_ptr<Acc>(),
                                               s,
                                               s + rows.rows,
                                               grad_normed.const_data_ptr(),
                                               slices,
                                               p,
                                               has_bias && p ? p + slices * rows.width : nullptr};
      return std::make_pair(b, w);
    };
    dispatch(
        in,
        [&](auto zero) {
          const auto [b, w] = args(zero);
          at::parallel_for(0, rows.rows, cpu_grain(rows.width), [&](int64_t begin, int64_t end) {
            check_status(kernels::add_norm_backward_host(rows, b, begin, end));
          });
          if (weight_grads)
            at::parallel_for(0, slices, 1, [&](int64_t begin, int64_t end) {
              check_status(kernels::norm_weight_grad_host(rows, w, begin, end));
            });
        },
        [&] {
#ifdef LOOM_WITH_CUDA
          const auto [b, w] = args(0.0f);
          const auto stream = current_stream(in);
          check_status(kernels::add_norm_backward_apply(rows, b, stream));
          if (weight_grads) check_status(kernels::norm_weight_grad_apply(rows, w, stream));
#endif
        });
    if (branch_grad && !round_branch) grad_branch = grad_input;
    if (weight_grads) {
      grad_weight = partials[0].sum(0);
      if (has_bias) grad_bias = partials[1].sum(0);
    }
    return {grad_input,   grad_branch,  grad_weight,  grad_bias,
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_shapes(const at::Tensor& residual, const at::Tensor& branch, const NormParams& p) {
  LOOM_CHECK(residual.dim() >= 1 && residual.size(-1) >= 1,
             "add + norm: the residual {} needs a last dimension of at least 1", residual.sizes());
  const int64_t width = residual.size(-1);
  LOOM_CHECK(!branch.defined() || branch.sizes() == residual.sizes(),
             "add + norm: branch {} and residual {} differ in shape", branch.sizes(),
             residual.sizes());
  LOOM_CHECK(!branch.defined() || branch.device() == residual.device(),
             "add + norm: branch on {}, residual on {}", branch.device().str(),
             residual.device().str());
  LOOM_CHECK(p.weight.defined() && p.weight.dim() == 1 && p.weight.size(0) == width,
             "add + norm: weight {} must be [{}] (the residual's last dimension)",
             p.weight.defined() ? p.weight.sizes() : at::IntArrayRef{}, width);
  LOOM_CHECK(!p.bias.defined() || (p.bias.dim() == 1 && p.bias.size(0) == width),
             "add + norm: bias {} must be [{}]",
             p.bias.defined() ? p.bias.sizes() : at::IntArrayRef{}, width);
  LOOM_CHECK(!p.bias.defined() || p.kind == NormKind::kLayerNorm,
             "add + norm: RMSNorm takes no bias");
  LOOM_CHECK(std::isfinite(p.eps) && p.eps >= 0, "add + norm: eps {} must be finite and >= 0",
             p.eps);
}

}  // namespace

NormBackend parse_norm_backend(const std::string& name) {
  return parse_fused_choice(name, "norm backend");
}

at::ScalarType normed_dtype(const at::Tensor& residual, const at::Tensor& branch) {
  if (branch.defined()) return branch.scalar_type();
  const auto device = residual.device().type();
  if (residual.scalar_type() == at::kFloat && at::autocast::is_autocast_enabled(device))
    return at::autocast::get_autocast_dtype(device);
  return residual.scalar_type();
}

bool uses_fused_norm(NormBackend backend, const at::Tensor& residual, const at::Tensor& branch,
                     const NormParams& params) {
  switch (backend) {
    case NormBackend::kMath:
      return false;
    case NormBackend::kAuto:
      return residual.is_cuda() && unsupported(residual, branch, params).empty();
    case NormBackend::kFused:
      break;
  }
  const auto why = unsupported(residual, branch, params);
  LOOM_CHECK(why.empty(), "--norm fused: {} (use --norm math or auto)", why);
  return true;
}

AddNormResult fused_add_norm(const at::Tensor& residual, const at::Tensor& branch,
                             const NormParams& params) {
  check_shapes(residual, branch, params);
  const auto why = unsupported(residual, branch, params);
  LOOM_CHECK(why.empty(), "fused add + norm: {}", why);
  const int64_t width = residual.size(-1);
  const auto residual2d = residual.reshape({-1, width}).contiguous();
  const auto branch2d = branch.defined() ? branch.reshape({-1, width}).contiguous() : at::Tensor();
  const auto outputs =
      FusedAddNorm::apply(residual2d, or_empty(branch2d, residual2d), params.weight,
                          or_empty(params.bias, params.weight), branch2d.defined(),
                          params.bias.defined(), static_cast<int64_t>(params.kind), params.eps);
  if (branch.defined())
    return {outputs[0].view(residual.sizes()), outputs[1].view(residual.sizes())};
  return {residual, outputs[0].view(residual.sizes())};
}

AddNormResult math_add_norm(const at::Tensor& residual, const at::Tensor& branch,
                            const NormParams& params) {
  check_shapes(residual, branch, params);
  const auto sum = branch.defined() ? residual + branch : residual;
  if (params.kind == NormKind::kLayerNorm)
    return {sum, at::layer_norm(sum, {sum.size(-1)}, params.weight, params.bias, params.eps)};
  // Llama's RMSNorm (and Hugging Face's): normalise in the accumulation dtype, scale after
  // rounding back to the input's.
  auto x = to_accumulation_dtype(sum);
  x = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + params.eps);
  return {sum, params.weight * x.to(sum.scalar_type())};
}

AddNormResult add_norm(NormBackend backend, const at::Tensor& residual, const at::Tensor& branch,
                       const NormParams& params) {
  return uses_fused_norm(backend, residual, branch, params)
             ? fused_add_norm(residual, branch, params)
             : math_add_norm(residual, branch, params);
}

}  // namespace loom::ops
