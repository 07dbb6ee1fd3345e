#pragma once
// The single entry point for attention in loom. Every model calls this, so a fused kernel can
// replace the implementation for CUDA tensors without touching model code.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace loom::ops {

// Which implementation computes attention.
enum class AttentionBackend {
  kAuto,   // the fused kernel where it applies (flash_attention_unsupported); for CPU tensors
           // loom's CPU kernel (cpu_attention.h) where it applies; else kSdpa
  kFused,  // loom's FlashAttention-2 kernel (ops/flash_attention.h); other inputs: an error
  kSdpa,   // at::scaled_dot_product_attention (PyTorch's fused kernels)
  kMath,   // attention_reference: the plain math, T x T scores and all
};
// "auto", "fused", "sdpa", "math".
std::string to_string(AttentionBackend backend);
// Throws loom::Error naming the value and the valid names.
AttentionBackend parse_attention_backend(const std::string& name);
std::vector<std::string> attention_backend_names();

class AttentionChooser;  // attention_choice.h

struct AttentionOptions {
  bool causal = true;
  std::optional<double> scale;  // default 1/sqrt(head_dim)
  double dropout = 0.0;         // applied as given: callers pass 0 outside training
  // When defined, the dropout to apply: a keep-mask [B, Hq, T, S] already scaled by
  // 1 / (1 - dropout), multiplied into the attention probabilities. Tensor-parallel models pass
  // one drawn for all heads and sliced, so dropout does not depend on tp. Runs the math path.
  at::Tensor dropout_mask;
  AttentionBackend backend = AttentionBackend::kAuto;
  // With kAuto, where loom's kernel (CUDA's fused one, the CPU's) and SDPA both take the inputs:
  // the one this chooser measured faster for their shape (null: loom's kernel).
  AttentionChooser* chooser = nullptr;
};

// q: [B, Hq, T, D]; k, v: [B, Hkv, S, D] with Hkv dividing Hq (grouped-query attention:
// query head h reads key/value head h / (Hq / Hkv)). Causal attention needs S == T.
// Returns [B, Hq, T, D].
// Throws loom::Error naming the shapes when they do not fit together, and (backend kFused)
// saying why the fused kernel cannot take the inputs.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options = {});

// Attention of a packed projection output qkv [B, T, 3, H, D] (q, k, v heads as one linear layer
// writes them). Returns [B, H, T, D]. For CPU inputs loom's kernel takes (backend kAuto, no
// dropout), its gradient reaches qkv without being stacked and copied; otherwise the heads are
// taken apart and passed to attention(). `bias` (optional, [3 H D], differentiable): the
// projection's bias when its GEMM left it out (attention_packed_takes_bias), added to qkv first
// (by the kernel as it reads q, k, v, where it runs).
at::Tensor attention_packed(const at::Tensor& qkv, const AttentionOptions& options = {},
                            const at::Tensor& bias = {});

// Whether attention_packed runs loom's CPU kernel on the projection of `input`, decided before
// the projection's GEMM so that the GEMM can leave its bias to the kernel: an fp32 CPU input
// without autocast, head_dim a multiple of 16, backend kAuto, no dropout, CPU kernels on.
bool attention_packed_takes_bias(const at::Tensor& input, int64_t head_dim,
                                 const AttentionOptions& options);

// The plain math (scores = q k^T * scale, causal mask, softmax in fp32, times v), kept as the
// reference the fast paths are tested against.
at::Tensor attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionOptions& options = {});

}  // namespace loom::ops
