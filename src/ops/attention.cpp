#include "loom/ops/attention.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cmath>
#include <limits>

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

// The keys each query may attend under a document mask, causal folded in: bool [B, 1, T, T].
at::Tensor allowed_keys(const at::Tensor& first_key, int64_t t) {
  const auto keys = at::arange(t, first_key.options().dtype(at::kLong));
  const auto first = first_key.to(at::kLong).unsqueeze(-1);  // [B, T, 1]
  return ((keys.view({1, 1, t}) >= first) & (keys.view({1, 1, t}) <= keys.view({1, t, 1})))
      .unsqueeze(1);
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

at::Tensor document_first_keys(const at::Tensor& tokens, int64_t start_token) {
  LOOM_CHECK(tokens.dim() == 2 && !at::isFloatingType(tokens.scalar_type()),
             "document_first_keys: tokens must be integer ids [batch, seq]; got {} {}",
             c10::toString(tokens.scalar_type()), tokens.sizes());
  LOOM_CHECK(tokens.size(1) <= std::numeric_limits<int32_t>::max(),
             "document_first_keys: {} positions do not fit int32 first keys", tokens.size(1));
  // Each position's own index where a document starts there, else 0; the running maximum along
  // the sequence is then the start of the document each position is in.
  const auto positions = at::arange(tokens.size(1), tokens.options().dtype(at::kLong));
  const auto starts = at::where(tokens == start_token, positions, at::zeros_like(positions));
  return std::get<0>(at::cummax(starts, 1)).to(at::kInt).contiguous();
}

at::Tensor checked_first_keys(const at::Tensor& first_key, const at::Tensor& q, bool causal) {
  if (!first_key.defined()) return first_key;
  LOOM_CHECK(causal, "attention: a document mask (first_key) needs causal attention");
  LOOM_CHECK(first_key.dim() == 2 && first_key.size(0) == q.size(0) &&
                 first_key.size(1) == q.size(2) && first_key.scalar_type() == at::kInt,
             "attention: a document mask's first keys must be int32 [batch, seq] = [{}, {}]; got "
             "{} {}",
             q.size(0), q.size(2), c10::toString(first_key.scalar_type()), first_key.sizes());
  LOOM_CHECK(first_key.device() == q.device(),
             "attention: the document mask is on {}, the queries on {}", first_key.device().str(),
             q.device().str());
  auto fk = first_key.contiguous();
  if (fk.device().is_cpu()) {
    const int32_t* data = fk.data_ptr<int32_t>();
    const int64_t t = fk.size(1);
    for (int64_t b = 0; b < fk.size(0); ++b)
      for (int64_t i = 0; i < t; ++i) {
        const int32_t x = data[b * t + i];
        LOOM_CHECK(x >= 0 && x <= i && (i == 0 || x >= data[b * t + i - 1]),
                   "attention: document mask first_key[{}, {}] = {} is invalid: each must lie in "
                   "[0, {}]{} — documents follow one another",
                   b, i, x, i,
                   i == 0 ? std::string()
                          : fmt::format(" and not below the one before ({})", data[b * t + i - 1]));
      }
  }
  return fk;
}

namespace {

// Whether attention() with backend kAuto runs loom's CUDA kernel on these inputs: it takes them,
// and no chooser measured SDPA faster here (its timings are of unmasked attention: a document
// mask goes to loom's kernel).
bool auto_picks_cuda_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionOptions& options, const at::Tensor& first_key,
                            double scale) {
  return !options.dropout_mask.defined() && q.is_cuda() &&
         !flash_attention_unsupported(q, k, v, options.dropout) &&
         (!options.chooser || first_key.defined() ||
          options.chooser->choose(q, k, v, options.causal, scale) == AttentionBackend::kFused);
}

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options) {
  check_shapes(q, k, v, options.causal);
  const auto first_key = checked_first_keys(options.first_key, q, options.causal);
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  switch (options.backend) {
    case AttentionBackend::kMath:
      return attention_reference(q, k, v, options);
    case AttentionBackend::kFused: {
      LOOM_CHECK(!options.dropout_mask.defined() && options.dropout == 0,
                 "attention backend 'fused' has no attention dropout (asked for {}); use 'auto'",
                 options.dropout);
      return flash_attention(q, k, v, options.causal, scale, first_key);
    }
    case AttentionBackend::kAuto: {
      // Loom's kernel where it takes the inputs, unless a chooser measured SDPA faster here
      // (its timings are of unmasked attention: a document mask goes to loom's kernel).
      const auto loom_kernel_wins = [&] {
        return !options.chooser || first_key.defined() ||
               options.chooser->choose(q, k, v, options.causal, scale) == AttentionBackend::kFused;
      };
      if (auto_picks_cuda_kernel(q, k, v, options, first_key, scale))
        return flash_attention(q, k, v, options.causal, scale, first_key);
      if (cpu_kernel_allowed(q.device(), options) &&
          !cpu_attention_unsupported(q, k, v, options.dropout) && loom_kernel_wins())
        return cpu_attention(q, k, v, options.causal, scale, first_key);
      break;
    }
    case AttentionBackend::kSdpa:
      break;
  }
  if (options.dropout_mask.defined()) return attention_reference(q, k, v, options);
  // PyTorch's fused kernels (flash-attention style on CPU; FlashAttention-2, memory-efficient
  // or cuDNN on CUDA, its choice), each with its own backward. Grouped-query attention is
  // handled natively by enable_gqa. A document mask goes in as a boolean [B, 1, T, T] mask
  // (causal folded in), which rules out the flash kernels: SDPA picks another.
  const bool gqa = q.size(1) != k.size(1);
  if (first_key.defined())
    return at::scaled_dot_product_attention(q, k, v, allowed_keys(first_key, q.size(2)),
                                            options.dropout, /*is_causal=*/false, scale, gqa);
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
        options.scale.value_or(1.0 / std::sqrt(static_cast<double>(qkv.size(4)))), bias,
        options.first_key);
  const auto biased =
      bias.defined() ? qkv + bias.view({3, qkv.size(3), qkv.size(4)}).to(qkv.scalar_type()) : qkv;
  // unbind, not [0..2]: the backward of three selects zero-fills and adds three full-size
  // buffers, unbind's stacks the three gradients once.
  const auto heads = biased.permute({2, 0, 3, 1, 4}).unbind(0);
  // Loom's CUDA kernel reads the thirds in place and writes their gradients into one packed
  // tensor: not even the stack.
  if (biased.is_cuda()) {
    const auto first_key = checked_first_keys(options.first_key, heads[0], options.causal);
    const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(qkv.size(4))));
    const bool fused = options.backend == AttentionBackend::kFused && options.dropout == 0 &&
                       !options.dropout_mask.defined();
    if (fused || (options.backend == AttentionBackend::kAuto &&
                  auto_picks_cuda_kernel(heads[0], heads[1], heads[2], options, first_key, scale)))
      return flash_attention_packed(biased, options.causal, scale, first_key);
  }
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
  const auto first_key = checked_first_keys(options.first_key, q, options.causal);
  if (first_key.defined()) {
    scores = scores.masked_fill(allowed_keys(first_key, q.size(2)).logical_not(),
                                -std::numeric_limits<float>::infinity());
  } else if (options.causal) {
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
