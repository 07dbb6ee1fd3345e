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
  // A document mask (causal attention only; undefined: none): first_key [B, T] int32 on q's
  // device, the first key each query may attend, so query i of batch row b attends keys
  // [first_key[b, i], i]. Rows non-decreasing with 0 <= first_key[b, i] <= i (documents follow
  // one another in a window): what document_first_keys makes. Every backend takes it; with kAuto
  // it goes to loom's kernel wherever that takes the inputs, without asking the chooser (which
  // times unmasked attention), else to SDPA with a boolean mask.
  at::Tensor first_key;
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

// The first keys of a document mask (AttentionOptions::first_key) for token ids [B, T]: a
// document begins at every position holding `start_token` (the tokenizer's document-start token,
// which loom-prepare writes before each document) and at position 0, and each query attends
// from its document's beginning. int32 [B, T] on the tokens' device, computed there (no host
// synchronisation). Position 0 of a window may be the middle of a document: its earlier part is
// in the window before, which this one does not see.
at::Tensor document_first_keys(const at::Tensor& tokens, int64_t start_token);

// first_key as the kernels take it (contiguous int32; undefined stays undefined), checked against
// q [B, H, T, D]: shape [B, T], int32, q's device, causal attention; for CPU tensors also the
// values (0 <= first_key[b, i] <= i, non-decreasing along each row). loom::Error naming what
// is wrong. CUDA values are not read (that would wait for the device): document_first_keys
// makes valid ones.
at::Tensor checked_first_keys(const at::Tensor& first_key, const at::Tensor& q, bool causal);

// The plain math (scores = q k^T * scale, causal and document masks, softmax in fp32, times v),
// kept as the reference the fast paths are tested against.
at::Tensor attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionOptions& options = {});

}  // namespace loom::ops
