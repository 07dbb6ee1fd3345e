#pragma once
// loom's attention for CPU tensors (AttentionBackend::kGemm; what kAuto picks on the CPU without
// dropout). On a CPU the products q k^T and p v run several times faster as large matrix
// multiplications (MKL/oneDNN GEMMs over whole heads) than inside a tiled flash-attention loop,
// so this computes them that way, one chunk of heads at a time (a chunk's T x S scores stay below
// kScoreChunkBytes), with the scaling, causal mask and softmax in one vectorised pass over each
// row. Like FlashAttention it saves only the output and each row's log-sum-exp: backward
// recomputes the probabilities from q and k (one more GEMM) instead of keeping T x S per head.
//
// Grouped-query attention runs without copying k and v per query head: the query heads that
// share a key/value head are stacked as extra rows of one GEMM.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace loom::ops {

// Bytes of scores (and their gradient, in backward) one chunk of heads may hold at once.
inline constexpr int64_t kScoreChunkBytes = int64_t{32} << 20;

// True when cpu_attention can take these inputs: CPU, fp32 or fp64, q k v of one dtype.
bool cpu_attention_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// q: [B, Hq, T, D]; k, v: [B, Hkv, S, D] (shapes as ops::attention checks them; causal: S == T).
// Returns [B, Hq, T, D]; differentiable once (a second derivative throws loom::Error).
at::Tensor cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         bool causal, double scale);

}  // namespace loom::ops
