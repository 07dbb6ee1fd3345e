#include "loom/ops/linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "cross_entropy_passes.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/precision.h"

namespace loom::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  // hidden2d: [N, d]; weight: [V_local, d]; targets: [N] int64 contiguous. grads: which of
  // hidden and weight get a gradient (1, 2: bits), computed here in forward.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden2d,
                            const at::Tensor& weight, const at::Tensor& targets,
                            const LinearCrossEntropyOptions& o, int64_t grads,
                            at::ScalarType dtype) {
    const auto h = hidden2d.to(dtype).contiguous();
    const auto w = weight.to(dtype).contiguous();
    const int64_t n = h.size(0), v = w.size(0);
    const int64_t valid = o.valid < 0 ? v : o.valid;
    const auto acc = accumulation_dtype(dtype);
    auto per_row = at::empty({n}, h.options().dtype(acc));
    if (o.row_losses != nullptr) *o.row_losses = at::empty({n}, per_row.options());
    const auto count = (targets != o.ignore_index).sum().to(acc);
    // d mean / d row loss, read by the grad pass from device memory (no host sync).
    const auto scale = count.reciprocal().reshape({1});
    const bool grad_hidden = (grads & 1) != 0, grad_weight = (grads & 2) != 0;
    at::Tensor d_hidden = grad_hidden ? at::empty_like(h) : at::Tensor();
    at::Tensor d_weight =
        grad_weight
            ? at::zeros(w.sizes(), w.options().dtype(accumulation_dtype(weight.scalar_type())))
            : at::Tensor();
    for (int64_t first = 0; first < n; first += o.chunk_rows) {
      const int64_t rows = std::min(o.chunk_rows, n - first);
      const auto h_chunk = h.narrow(0, first, rows);
      const auto t_chunk = targets.narrow(0, first, rows);
      auto logits = at::mm(h_chunk, w.t());
      const auto described =
          detail::describe_rows(logits, t_chunk, o.col_offset, valid, o.ignore_index);
      const auto losses = detail::row_losses(detail::row_stats(described, logits), t_chunk,
                                             o.reduce, o.ignore_index, o.z_loss);
      per_row.narrow(0, first, rows).copy_(losses.per_row);
      if (o.row_losses != nullptr) o.row_losses->narrow(0, first, rows).copy_(losses.cross_entropy);
      if (!grad_hidden && !grad_weight) continue;
      // The logits' gradient over the logits, then the chunk's share of both products.
      detail::row_grads(described, losses.lse, scale, o.z_loss, logits);
      if (grad_hidden) {
        auto out = d_hidden.narrow(0, first, rows);
        at::mm_out(out, logits, w);
      }
      if (grad_weight) {
        if (d_weight.scalar_type() == dtype)
          d_weight.addmm_(logits.t(), h_chunk);
        else
          d_weight.add_(at::mm(logits.t(), h_chunk));
      }
    }
    ctx->save_for_backward({d_hidden, d_weight});
    ctx->saved_data["hidden_dtype"] = static_cast<int64_t>(hidden2d.scalar_type());
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return per_row.sum() / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    // The gradients were made in the forward: they have no graph to differentiate again.
    LOOM_CHECK(!at::GradMode::is_enabled(),
               "linear cross-entropy: a backward that builds a graph (create_graph, double "
               "backward) is not supported: the gradients are computed in the forward");
    const auto saved = ctx->get_saved_variables();
    const auto& g = grad_out[0];
    // The upstream gradient applied in the accumulation dtype (1 / micro-batches, say, is not a
    // bf16 value).
    const auto scaled = [&](const at::Tensor& grad, const char* dtype) {
      if (!grad.defined()) return at::Tensor();
      const auto type = static_cast<at::ScalarType>(ctx->saved_data[dtype].toInt());
      const auto acc = accumulation_dtype(grad.scalar_type());
      return (grad.to(acc) * g.to(acc)).to(type);
    };
    return {scaled(saved[0], "hidden_dtype"),
            scaled(saved[1], "weight_dtype"),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

int64_t parse_chunk_rows(const std::string& value) {
  if (value == "auto") return kAutoChunkRows;
  if (value == "off" || value == "0") return 0;
  int64_t rows = 0;
  const auto* end = value.data() + value.size();
  const auto [at, error] = std::from_chars(value.data(), end, rows);
  LOOM_CHECK(error == std::errc() && at == end && rows > 0,
             "--loss-chunk-rows '{}' is not valid: auto, off (whole logits) or a number of rows "
             "> 0",
             value);
  return rows;
}

at::ScalarType linear_cross_entropy_dtype(const at::Tensor& hidden, const at::Tensor& weight) {
  const auto promoted = at::promote_types(hidden.scalar_type(), weight.scalar_type());
  const auto device = hidden.device().type();
  if (promoted != at::kDouble && at::autocast::is_autocast_available(device) &&
      at::autocast::is_autocast_enabled(device))
    return at::autocast::get_autocast_dtype(device);
  return promoted;
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& targets,
                                const LinearCrossEntropyOptions& options) {
  LOOM_CHECK(weight.dim() == 2 && hidden.dim() >= 1 && hidden.size(-1) == weight.size(1),
             "linear cross-entropy: hidden {} and weight {} do not fit ([..., d] and [V, d])",
             hidden.sizes(), weight.sizes());
  LOOM_CHECK(targets.sizes() == hidden.sizes().slice(0, hidden.dim() - 1),
             "linear cross-entropy: targets {} must be hidden's {} without its last dimension",
             targets.sizes(), hidden.sizes());
  LOOM_CHECK(targets.scalar_type() == at::kLong && targets.device() == hidden.device() &&
                 weight.device() == hidden.device(),
             "linear cross-entropy: targets (int64) and weight must be on hidden's device ({}); "
             "got {} targets on {}, weight on {}",
             hidden.device().str(), c10::toString(targets.scalar_type()), targets.device().str(),
             weight.device().str());
  LOOM_CHECK(options.chunk_rows > 0, "linear cross-entropy: chunk_rows {} must be > 0",
             options.chunk_rows);
  LOOM_CHECK(options.valid <= weight.size(0),
             "linear cross-entropy: valid {} columns exceed the weight's {} rows", options.valid,
             weight.size(0));
  LOOM_CHECK(static_cast<bool>(options.reduce.max) == static_cast<bool>(options.reduce.sum),
             "linear cross-entropy: the row reductions come as a pair (max and sum)");
  LOOM_CHECK(std::isfinite(options.z_loss) && options.z_loss >= 0,
             "linear cross-entropy: z_loss {} must be a finite value >= 0", options.z_loss);
  const auto dtype = linear_cross_entropy_dtype(hidden, weight);
  LOOM_CHECK(hidden.is_cpu() || (hidden.is_cuda() && detail::kernel_dtype(dtype)),
             "linear cross-entropy: runs on CPU tensors (fp32, fp64, fp16, bf16 products) or "
             "CUDA tensors (fp32, fp16, bf16); got {} products on {}",
             c10::toString(dtype), hidden.device().str());
  const bool grad = at::GradMode::is_enabled();
  const int64_t grads =
      (grad && hidden.requires_grad() ? 1 : 0) | (grad && weight.requires_grad() ? 2 : 0);
  return LinearCrossEntropy::apply(hidden.reshape({-1, hidden.size(-1)}), weight,
                                   targets.reshape({-1}).contiguous(), options, grads, dtype);
}

}  // namespace loom::ops
