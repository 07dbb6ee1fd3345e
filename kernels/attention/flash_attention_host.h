#pragma once
// Host reference of the fused attention kernel (flash_attention.cu): the same tiled algorithm in
// plain C++ and fp32, on raw pointers with the same shapes and strides (AttentionProblem). It
// builds without CUDA. CPU tests check it against the naive math; GPU tests check the kernel
// against it.
//
// Same algorithm means: the same tiles (flash_attention_config.h), the same tile ranges (causal
// tiles skipped by the same functions), the same online softmax per query row and key tile
// (running max m, running sum l, accumulator rescaled by exp(m_old - m_new), O /= l once at the
// end, lse = m + log(l)), and in the backward the same loop nest: per key tile, every query head of
// its group and every query tile from the first one that sees the key tile, recomputing
// P = exp(scale S - lse), then dV += P^T dO, dP = dO V^T, dS = P * (dP - Delta), dQ += dS K,
// dK += dS^T Q, with Delta = rowsum(dO * O) computed first and `scale` applied to dQ and dK once at
// the end. What differs from the kernel: everything stays fp32 (the kernel rounds P and dS to
// bf16/fp16 for its tensor-core products), and the kernel works in base 2 (exp2 with log2(e)
// folded into the scale), which is the same math.
//
// Rows with no key to attend to (kv_len == 0) give o = 0 and lse = -infinity, and zero gradients.
#include "attention/flash_attention_config.h"

namespace loom::kernels {

// Host (CPU) pointers, fp32; layouts as in AttentionProblem.
struct FlashAttentionHostParams : AttentionProblem {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* o = nullptr;          // forward output; a backward input
  float* lse = nullptr;        // [batch, q_heads, q_len] contiguous; forward output, backward input
  const float* d_o = nullptr;  // backward only
  float* dq = nullptr;         // backward outputs (overwritten)
  float* dk = nullptr;
  float* dv = nullptr;
};

// What the host reference did, for tests: how many (query tile, key tile) pairs it computed, over
// all batches and heads. A kernel block does the same number of tile products.
struct FlashAttentionHostStats {
  int64_t tiles = 0;
};

// Writes o and lse. Any head_dim >= 1 (the kernel: 64 or 128).
Status flash_attention_forward_host(const FlashAttentionHostParams& params,
                                    FlashAttentionHostStats* stats = nullptr);

// Writes dq, dk, dv from d_o, o and lse (as the forward wrote them).
Status flash_attention_backward_host(const FlashAttentionHostParams& params,
                                     FlashAttentionHostStats* stats = nullptr);

}  // namespace loom::kernels
