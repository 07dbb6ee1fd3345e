#include "loom/ops/attention.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cmath>

#include "cpu_vectorize.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/attention_choice.h"
#include "loom/ops/cpu_attention.h"
#include "loom/ops/flash_attention.h"
#include "loom/ops/precision.h"

namespace loom::ops {

namespace {

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  LOOM_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
             "attention: q, k, v must be [batch, heads, seq, head_dim]; got {}, {}, {}", q.sizes(),
             k.sizes(), v.sizes());
  LOOM_CHECK(k.sizes() == v.sizes(), "attention: k {} and v {} must have the same shape", k.sizes(),
             v.sizes());
  LOOM_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3),
             "attention: q {} and k {} differ in batch or head_dim", q.sizes(), k.sizes());
  LOOM_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
             "attention: {} query heads are not a multiple of {} key/value heads", q.size(1),
             k.size(1));
  LOOM_CHECK(!causal || q.size(2) == k.size(2),
             "attention: causal attention needs as many keys as queries; got {} and {}", q.size(2),
             k.size(2));
}

// Whether loom's CPU kernel may take attention on `device` with these options (its own checks of
// the tensors aside): backend auto, no dropout mask, a CPU device, CPU kernels on.
bool cpu_kernel_allowed(const at::Device& device, const AttentionOptions& options) {
  return options.backend == AttentionBackend::kAuto && !options.dropout_mask.defined() &&
         device.is_cpu() && cpu::kernels_enabled();
}

}  // namespace

std::string to_string(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kAuto:
      return "auto";
    case AttentionBackend::kFused:
      return "fused";
    case AttentionBackend::kSdpa:
      return "sdpa";
    case AttentionBackend::kMath:
      return "math";
  }
  return "?";
}

constexpr AttentionBackend kAllBackends[] = {AttentionBackend::kAuto, AttentionBackend::kFused,
                                             AttentionBackend::kSdpa, AttentionBackend::kMath};

std::vector<std::string> attention_backend_names() {
  std::vector<std::string> names;
  for (auto b : kAllBackends) names.push_back(to_string(b));
  return names;
}

AttentionBackend parse_attention_backend(const std::string& name) {
  for (auto b : kAllBackends)
    if (to_string(b) == name) return b;
  fail("attention backend '{}' is not known; valid: {}", name,
       fmt::join(attention_backend_names(), ", "));
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options) {
  check_shapes(q, k, v, options.causal);
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  switch (options.backend) {
    case AttentionBackend::kMath:
      return attention_reference(q, k, v, options);
    case AttentionBackend::kFused: {
      LOOM_CHECK(!options.dropout_mask.defined() && options.dropout == 0,
                 "attention backend 'fused' has no attention dropout (asked for {}); use 'auto'",
                 options.dropout);
      return flash_attention(q, k, v, options.causal, scale);
    }
    case AttentionBackend::kAuto: {
      // Loom's kernel where it takes the inputs, unless a chooser measured SDPA faster here.
      const auto loom_kernel_wins = [&] {
        return !options.chooser ||
               options.chooser->choose(q, k, v, options.causal, scale) == AttentionBackend::kFused;
      };
      if (!options.dropout_mask.defined() && q.is_cuda() &&
          !flash_attention_unsupported(q, k, v, options.dropout) && loom_kernel_wins())
        return flash_attention(q, k, v, options.causal, scale);
      if (cpu_kernel_allowed(q.device(), options) &&
          !cpu_attention_unsupported(q, k, v, options.dropout) && loom_kernel_wins())
        return cpu_attention(q, k, v, options.causal, scale);
      break;
    }
    case AttentionBackend::kSdpa:
      break;
  }
  if (options.dropout_mask.defined()) return attention_reference(q, k, v, options);
  // PyTorch's fused kernels (flash-attention style on CPU; FlashAttention-2, memory-efficient
  // or cuDNN on CUDA, its choice), each with its own backward. Grouped-query attention is
  // handled natively by enable_gqa.
  const bool gqa = q.size(1) != k.size(1);
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/std::nullopt, options.dropout,
                                          options.causal, scale, gqa);
}

bool attention_packed_takes_bias(const at::Tensor& input, int64_t head_dim,
                                 const AttentionOptions& options) {
  return !options.chooser && cpu_kernel_allowed(input.device(), options) && options.dropout == 0 &&
         input.scalar_type() == at::kFloat && !at::autocast::is_autocast_enabled(at::kCPU) &&
         head_dim > 0 && head_dim % 16 == 0;
}

at::Tensor attention_packed(const at::Tensor& qkv, const AttentionOptions& options,
                            const at::Tensor& bias) {
  LOOM_CHECK(qkv.dim() == 5 && qkv.size(2) == 3,
             "attention: a packed projection must be [batch, seq, 3, heads, head_dim]; got {}",
             qkv.sizes());
  LOOM_CHECK(!bias.defined() || bias.numel() == 3 * qkv.size(3) * qkv.size(4),
             "attention: the packed projection's bias has {} values; [3 * heads * head_dim] = {} "
             "expected",
             bias.defined() ? bias.numel() : 0, 3 * qkv.size(3) * qkv.size(4));
  // (With a chooser the heads go through attention(), which asks it.)
  if (!options.chooser && cpu_kernel_allowed(qkv.device(), options) &&
      !cpu_attention_packed_unsupported(qkv, options.dropout, bias))
    return cpu_attention_packed(
        qkv, options.causal,
        options.scale.value_or(1.0 / std::sqrt(static_cast<double>(qkv.size(4)))), bias);
  const auto biased =
      bias.defined() ? qkv + bias.view({3, qkv.size(3), qkv.size(4)}).to(qkv.scalar_type()) : qkv;
  // unbind, not [0..2]: the backward of three selects zero-fills and adds three full-size
  // buffers, unbind's stacks the three gradients once.
  const auto heads = biased.permute({2, 0, 3, 1, 4}).unbind(0);
  return attention(heads[0], heads[1], heads[2], options);
}

at::Tensor attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionOptions& options) {
  check_shapes(q, k, v, options.causal);
  const int64_t group = q.size(1) / k.size(1);
  auto kk = group > 1 ? k.repeat_interleave(group, 1) : k;
  auto vv = group > 1 ? v.repeat_interleave(group, 1) : v;
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  // Scores, softmax and the weighted sum in fp32 (fp64 inputs stay fp64).
  const auto dtype = accumulation_dtype(q.scalar_type());
  auto scores = at::matmul(q.to(dtype), kk.to(dtype).transpose(-2, -1)) * scale;
  if (options.causal) {
    const int64_t t = q.size(2);
    auto mask = at::ones({t, t}, q.options().dtype(at::kBool)).triu(1);  // key j > query i
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  auto probs = at::softmax(scores, -1);
  if (options.dropout_mask.defined()) {
    LOOM_CHECK(options.dropout_mask.sizes() == probs.sizes(),
               "attention: dropout mask {} does not match the attention probabilities {}",
               options.dropout_mask.sizes(), probs.sizes());
    probs = probs * options.dropout_mask;
  } else if (options.dropout > 0) {
    probs = at::dropout(probs, options.dropout, /*train=*/true);
  }
  return at::matmul(probs, vv.to(dtype)).to(q.scalar_type());
}

}  // namespace loom::ops
