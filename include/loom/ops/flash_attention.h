#pragma once
// loom's fused attention kernel (kernels/attention/, FlashAttention-2 style) as a LibTorch op:
// a custom autograd function whose forward saves q, k, v, the output and the logsumexp of each
// row (no attention matrix), and whose backward recomputes the scores tile by tile.
// ops::attention calls it for CUDA tensors (backend kAuto or kFused).
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace loom::ops {

// Why the fused kernel cannot compute attention of these inputs, or nullopt when it can:
// CUDA tensors of one device, bf16 or fp16 alike, head_dim 64 or 128, kv heads dividing q
// heads, batch and heads up to 65535, no dropout, a loom built with CUDA and a device of
// compute capability 8.0 or newer that this build has the kernel for (CMAKE_CUDA_ARCHITECTURES).
std::optional<std::string> flash_attention_unsupported(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v, double dropout);

// q: [B, Hq, T, D]; k, v: [B, Hkv, S, D] (any strides with a contiguous last dimension; others
// are copied). Returns [B, Hq, T, D] in q's dtype (a transposed view of [B, T, Hq, D] storage,
// which is what the models reshape it to next); differentiable in q, k and v. Throws
// loom::Error with flash_attention_unsupported's reason when the kernel cannot take them.
// `first_key` (optional, causal only): a document mask, as AttentionOptions::first_key
// (ops/attention.h); tiles wholly outside a query's document are skipped.
at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool causal, double scale, const at::Tensor& first_key = {});

// The same for one projection's packed output qkv [B, T, 3, H, D] (q, k, v its three thirds, as
// GPT-2's c_attn writes them): the kernel reads the thirds in place and its backward writes dq,
// dk and dv into one gradient of qkv's layout, so that no stack of three gradients follows.
// Differentiable in qkv; the same refusals as flash_attention.
at::Tensor flash_attention_packed(const at::Tensor& qkv, bool causal, double scale,
                                  const at::Tensor& first_key = {});

// The forward alone, for tests and benchmarks: the output and the logsumexp [B, Hq, T] (fp32,
// natural log) the backward uses.
std::pair<at::Tensor, at::Tensor> flash_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, bool causal,
                                                          double scale,
                                                          const at::Tensor& first_key = {});

// The backward alone: dq, dk, dv (q's dtype) given o [B, Hq, T, D] (q's dtype), its logsumexp
// lse [B, Hq, T] (fp32) and d_o. o and lse need not be what the forward of these q, k, v
// wrote: given the whole attention's rows, the result is this key/value block's share of the
// whole gradients (ring attention, ops/attention_partial.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const at::Tensor& d_o, bool causal, double scale,
    const at::Tensor& first_key = {});

}  // namespace loom::ops
