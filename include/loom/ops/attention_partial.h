#pragma once
// Attention of one block of queries against one block of keys and values, as partial results
// that a caller merges with others: the block's output normalised within the block, and each
// query's log-sum-exp over the block's scores. Ring attention (parallel/context/ring_attention.h)
// calls these once per pair of blocks it holds, so the ring's logic is written once whatever
// computes a block: loom's fused kernel (ops/flash_attention.h) where it takes the inputs (CUDA,
// bf16/fp16, head_dim 64 or 128), else the plain math in the accumulation dtype (fp32, fp64 for
// fp64 inputs). Both return their partial results in the accumulation dtype.
#include <ATen/core/Tensor.h>

namespace loom::ops {

// Which of a block pair's scores count. kCausal: the diagonal block of a causal attention
// (equal lengths, query i sees keys 0..i of the block); kFull: every key (a block wholly before
// the queries).
enum class BlockMask { kFull, kCausal };

// Partial results for queries [B, Hq, Tq, D]: out [B, Hq, Tq, D] and lse [B, Hq, Tq], both in
// the accumulation dtype. An empty accumulator has out 0 and lse -inf.
struct PartialAttention {
  at::Tensor out;
  at::Tensor lse;
};

// q [B, Hq, Tq, D]; k, v [B, Hkv, Tk, D] with Hkv dividing Hq (query head h reads key/value
// head h / (Hq / Hkv)); scores are q k^T * scale. Throws loom::Error naming the shapes when they
// do not fit together.
PartialAttention attention_partial_forward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, BlockMask mask, double scale);

// An empty accumulator for queries q.
PartialAttention empty_partial_attention(const at::Tensor& q);

// Merges `part` into `acc` (the online-softmax rescaling: both outputs weighted by their share
// of the combined normaliser). acc's tensors are replaced, not written in place.
void merge_partial_attention(PartialAttention& acc, const PartialAttention& part);

// The gradients of one block pair's share of the whole attention, in the accumulation dtype:
// `out` [B, Hq, Tq, D] and `lse` [B, Hq, Tq] are the whole attention's output and log-sum-exp
// for these queries (FlashAttention-2's backward, one block pair at a time).
struct PartialAttentionGrads {
  at::Tensor dq, dk, dv;
};
PartialAttentionGrads attention_partial_backward(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const at::Tensor& out,
                                                 const at::Tensor& lse, const at::Tensor& dout,
                                                 BlockMask mask, double scale);

}  // namespace loom::ops
