#include "loom/ops/flash_attention.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <map>
#include <mutex>

#include "autograd_args.h"
#include "kernel_checks.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/attention.h"
#include "loom/ops/cuda.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "attention/flash_attention.h"
#endif

namespace loom::ops {

namespace {

// Whether this build has the kernel for `device` (asked once per device: it does not change).
std::optional<std::string> kernel_image_missing(int device) {
#ifdef LOOM_WITH_CUDA
  return detail::kernel_image_missing("flash_attention", device,
                                      kernels::flash_attention_device_check);
#else
  (void)device;
  return "this loom was built without CUDA (LOOM_WITH_CUDA=OFF)";
#endif
}

}  // namespace

std::optional<std::string> flash_attention_unsupported(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v, double dropout) {
  if (!built_with_cuda()) return "this loom was built without CUDA (LOOM_WITH_CUDA=OFF)";
  if (!q.is_cuda() || !k.is_cuda() || !v.is_cuda())
    return fmt::format("it takes CUDA tensors; got q on {}, k on {}, v on {}", q.device().str(),
                       k.device().str(), v.device().str());
  if (k.device() != q.device() || v.device() != q.device())
    return fmt::format("q, k and v must be on one device; got {}, {}, {}", q.device().str(),
                       k.device().str(), v.device().str());
  const auto dtype = q.scalar_type();
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || k.scalar_type() != dtype ||
      v.scalar_type() != dtype)
    return fmt::format("it takes bf16 or fp16 q, k and v of one dtype; got {}, {}, {}",
                       c10::toString(q.scalar_type()), c10::toString(k.scalar_type()),
                       c10::toString(v.scalar_type()));
  if (q.dim() != 4 || (q.size(3) != 64 && q.size(3) != 128))
    return fmt::format("head_dim must be 64 or 128; got q of shape {}", q.sizes());
  if (dropout > 0) return fmt::format("it has no attention dropout (asked for {})", dropout);
  if (q.size(0) > 65535 || q.size(1) > 65535)
    return fmt::format("batch {} and query heads {} must be at most 65535 (CUDA grid limit)",
                       q.size(0), q.size(1));
  const int cc = cuda_compute_capability(q.device().index());
  if (cc < 80)
    return fmt::format("it needs compute capability 8.0 or newer (tensor-core mma.sync); {} has {}",
                       q.device().str(), cc < 0 ? "none" : fmt::format("{}.{}", cc / 10, cc % 10));
  return kernel_image_missing(static_cast<int>(q.device().index()));
}

#ifdef LOOM_WITH_CUDA
namespace {

// The kernel wants the last dimension contiguous; any other strides are taken as they are.
at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

kernels::AttentionStrides strides_of(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

void check_status(const kernels::Status& status, const char* what) {
  LOOM_CHECK(status.ok(), "fused attention {}: {}", what, status.message);
}

kernels::FlashAttentionParams params_of(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, bool causal, double scale,
                                        const at::Tensor& first_key) {
  kernels::FlashAttentionParams p;
  p.batch = static_cast<int>(q.size(0));
  p.q_heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k.size(1));
  p.q_len = static_cast<int>(q.size(2));
  p.kv_len = static_cast<int>(k.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.first_key = first_key.defined() ? first_key.data_ptr<int32_t>() : nullptr;
  p.dtype = q.scalar_type() == at::kBFloat16 ? kernels::AttentionDtype::kBFloat16
                                             : kernels::AttentionDtype::kFloat16;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_strides = strides_of(q);
  p.k_strides = strides_of(k);
  p.v_strides = strides_of(v);
  return p;
}

struct ForwardResult {
  at::Tensor q, k, v;  // as the kernel read them (last dimension contiguous)
  at::Tensor o, lse;
};

ForwardResult forward_impl(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           bool causal, double scale, const at::Tensor& first_key) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  ForwardResult r{
      last_dim_contiguous(q_in), last_dim_contiguous(k_in), last_dim_contiguous(v_in), {}, {}};
  // [B, T, H, D] storage seen as [B, H, T, D]: the models' next step, transpose(1, 2) and a
  // reshape to [B, T, H * D], is then free instead of a copy.
  r.o = at::empty({r.q.size(0), r.q.size(2), r.q.size(1), r.q.size(3)}, r.q.options())
            .transpose(1, 2);
  r.lse = at::empty({r.q.size(0), r.q.size(1), r.q.size(2)}, r.q.options().dtype(at::kFloat));
  auto p = params_of(r.q, r.k, r.v, causal, scale, first_key);
  p.o = r.o.data_ptr();
  p.o_strides = strides_of(r.o);
  p.lse = r.lse.data_ptr<float>();
  check_status(kernels::flash_attention_forward(p, c10::cuda::getCurrentCUDAStream().stream()),
               "forward");
  return r;
}

// dq, dk, dv of q, k, v given an output o and its logsumexp, which need not be what the kernel's
// forward of these q, k, v wrote: ring attention passes the whole attention's o and lse rows to
// get one block pair's share of the gradients.
// Writes them into dq, dk, dv (q's, k's, v's shapes; any strides with a contiguous last
// dimension: views of one packed gradient, say).
void backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& o, const at::Tensor& lse, const at::Tensor& grad, bool causal,
                   double scale, const at::Tensor& first_key, at::Tensor& dq, at::Tensor& dk,
                   at::Tensor& dv) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto d_o = last_dim_contiguous(grad);
  auto p = params_of(q, k, v, causal, scale, first_key);
  p.o = o.data_ptr();
  p.o_strides = strides_of(o);
  p.lse = lse.data_ptr<float>();
  p.d_o = d_o.data_ptr();
  p.d_o_strides = strides_of(d_o);
  p.dq = dq.data_ptr();
  p.dq_strides = strides_of(dq);
  p.dk = dk.data_ptr();
  p.dk_strides = strides_of(dk);
  p.dv = dv.data_ptr();
  p.dv_strides = strides_of(dv);
  const size_t bytes = kernels::flash_attention_backward_workspace_bytes(p);
  // From torch's caching allocator, on the current stream: reused, not cudaMalloc'd each call.
  auto workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
  check_status(kernels::flash_attention_backward(p, workspace.data_ptr(), bytes,
                                                 c10::cuda::getCurrentCUDAStream().stream()),
               "backward");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const at::Tensor& grad, bool causal, double scale,
    const at::Tensor& first_key) {
  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(k.sizes(), k.options());
  auto dv = at::empty(v.sizes(), v.options());
  backward_into(q, k, v, o, lse, grad, causal, scale, first_key, dq, dk, dv);
  return {dq, dk, dv};
}

// [B, T, 3, H, D] -> its thirds as [B, H, T, D] views.
std::vector<at::Tensor> packed_heads(const at::Tensor& qkv) {
  return qkv.permute({2, 0, 3, 1, 4}).unbind(0);
}

// Saves the packed input (not three views of it), the output and the logsumexp; the backward
// writes the three gradients into one tensor of the input's layout.
struct FlashAttentionPackedFunction : torch::autograd::Function<FlashAttentionPackedFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv,
                            bool causal, double scale, const detail::NoGradTensor& first_key) {
    const auto packed = last_dim_contiguous(qkv);
    const auto heads = packed_heads(packed);
    auto r = forward_impl(heads[0], heads[1], heads[2], causal, scale, first_key.value);
    ctx->save_for_backward({packed, r.o, r.lse});
    ctx->saved_data["first_key"] = first_key.to_ivalue();
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return r.o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto heads = packed_heads(saved[0]);
    auto d_qkv = at::empty(saved[0].sizes(), saved[0].options());
    auto d = packed_heads(d_qkv);
    backward_into(heads[0], heads[1], heads[2], saved[1], saved[2], grads[0],
                  ctx->saved_data["causal"].toBool(), ctx->saved_data["scale"].toDouble(),
                  detail::NoGradTensor::from(ctx->saved_data["first_key"]), d[0], d[1], d[2]);
    return {d_qkv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Saves q, k, v, the output and the logsumexp; the backward recomputes the rest tile by tile.
struct FlashAttentionFunction : torch::autograd::Function<FlashAttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                            const detail::NoGradTensor& first_key) {
    auto r = forward_impl(q, k, v, causal, scale, first_key.value);
    ctx->save_for_backward({r.q, r.k, r.v, r.o, r.lse});
    ctx->saved_data["first_key"] = first_key.to_ivalue();
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return r.o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dq, dk, dv] =
        backward_impl(saved[0], saved[1], saved[2], saved[3], saved[4], grads[0],
                      ctx->saved_data["causal"].toBool(), ctx->saved_data["scale"].toDouble(),
                      detail::NoGradTensor::from(ctx->saved_data["first_key"]));
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  LOOM_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                 q.size(0) == k.size(0) && q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0,
             "fused attention: q {} must be [B, Hq, T, D] and k {}, v {} [B, Hkv, S, D] with Hkv "
             "dividing Hq",
             q.sizes(), k.sizes(), v.sizes());
  if (auto why = flash_attention_unsupported(q, k, v, 0.0))
    fail("fused attention cannot take these inputs: {}", *why);
}

}  // namespace

at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool causal, double scale, const at::Tensor& first_key) {
  check_supported(q, k, v);
  return FlashAttentionFunction::apply(
      q, k, v, causal, scale, detail::NoGradTensor{checked_first_keys(first_key, q, causal)});
}

at::Tensor flash_attention_packed(const at::Tensor& qkv, bool causal, double scale,
                                  const at::Tensor& first_key) {
  LOOM_CHECK(
      qkv.dim() == 5 && qkv.size(2) == 3,
      "fused attention: a packed projection must be [batch, seq, 3, heads, head_dim]; got {}",
      qkv.sizes());
  const auto heads = packed_heads(qkv);
  check_supported(heads[0], heads[1], heads[2]);
  return FlashAttentionPackedFunction::apply(
      qkv, causal, scale, detail::NoGradTensor{checked_first_keys(first_key, heads[0], causal)});
}

std::pair<at::Tensor, at::Tensor> flash_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, bool causal,
                                                          double scale,
                                                          const at::Tensor& first_key) {
  check_supported(q, k, v);
  auto r = forward_impl(q, k, v, causal, scale, checked_first_keys(first_key, q, causal));
  return {r.o, r.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const at::Tensor& d_o, bool causal, double scale,
    const at::Tensor& first_key) {
  check_supported(q, k, v);
  LOOM_CHECK(o.sizes() == q.sizes() && d_o.sizes() == q.sizes() &&
                 o.scalar_type() == q.scalar_type() && lse.scalar_type() == at::kFloat &&
                 lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                 lse.size(2) == q.size(2),
             "fused attention backward: o {} and d_o {} must be q's shape {} and dtype, lse {} "
             "[B, Hq, T] fp32",
             o.sizes(), d_o.sizes(), q.sizes(), lse.sizes());
  return backward_impl(last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v),
                       last_dim_contiguous(o), lse.contiguous(), d_o, causal, scale,
                       checked_first_keys(first_key, q, causal));
}

#else  // no CUDA in this build: the reason is all there is

at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool,
                           double, const at::Tensor&) {
  fail("fused attention cannot take these inputs: {}", *flash_attention_unsupported(q, k, v, 0));
}

at::Tensor flash_attention_packed(const at::Tensor& qkv, bool, double, const at::Tensor&) {
  LOOM_CHECK(
      qkv.dim() == 5 && qkv.size(2) == 3,
      "fused attention: a packed projection must be [batch, seq, 3, heads, head_dim]; got {}",
      qkv.sizes());
  const auto heads = qkv.permute({2, 0, 3, 1, 4}).unbind(0);
  fail("fused attention cannot take these inputs: {}",
       *flash_attention_unsupported(heads[0], heads[1], heads[2], 0));
}

std::pair<at::Tensor, at::Tensor> flash_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, bool, double,
                                                          const at::Tensor&) {
  fail("fused attention cannot take these inputs: {}", *flash_attention_unsupported(q, k, v, 0));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, bool, double, const at::Tensor&) {
  fail("fused attention cannot take these inputs: {}", *flash_attention_unsupported(q, k, v, 0));
}

#endif

}  // namespace loom::ops
