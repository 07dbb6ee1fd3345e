#pragma once
// Fused attention on the GPU, FlashAttention-2 style (kernels layer: raw pointers and a stream,
// no LibTorch). Plain C++ can include this header: the only CUDA type it names is cudaStream_t,
// declared below exactly as the CUDA runtime declares it.
//
// Forward: o = softmax(scale * q k^T, masked) v, and the logsumexp of each row (lse, fp32, natural
// log) that the backward needs. Backward: dq, dk, dv from d_o, recomputing the scores tile by tile
// from q, k and lse; no [q_len, kv_len] matrix is ever stored.
//
// Supported: bf16 and fp16 inputs (fp32 accumulation), head_dim 64 and 128, causal and not,
// grouped-query attention, any q_len and kv_len, any strides with a contiguous last dimension.
// Needs sm_80 or newer (tensor cores via mma.sync). The host reference of the same algorithm is
// flash_attention_host.h; the tile sizes are in flash_attention_config.h.
#include <cstddef>

#include "attention/flash_attention_config.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

enum class AttentionDtype { kBFloat16, kFloat16 };

// Device pointers; shapes and strides in the AttentionProblem base (see flash_attention_config.h).
// q, k, v, o, d_o, dq, dk, dv all have the element type `dtype`; lse is fp32.
struct FlashAttentionParams : AttentionProblem {
  AttentionDtype dtype = AttentionDtype::kBFloat16;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;          // forward output; a backward input
  float* lse = nullptr;       // [batch, q_heads, q_len] contiguous; forward output, backward input
  const void* d_o = nullptr;  // backward only: gradient of the loss w.r.t. o
  void* dq = nullptr;         // backward outputs (overwritten, not accumulated into)
  void* dk = nullptr;
  void* dv = nullptr;
};

// Whether this build holds the kernels for CUDA device `device` (they are compiled for the
// architectures in CMAKE_CUDA_ARCHITECTURES only: sm_90a code does not run on sm_80 or on
// Blackwell). A kCudaError naming the device otherwise.
Status flash_attention_device_check(int device);

// Writes o and lse. Asynchronous on `stream`; the returned status covers argument checks and the
// launch (not faults while the kernel runs).
Status flash_attention_forward(const FlashAttentionParams& params, cudaStream_t stream);

// Bytes of device workspace flash_attention_backward needs for these shapes (batch, q_heads,
// q_len, head_dim): an fp32 dq accumulator [batch, q_heads, q_len, head_dim], Delta =
// rowsum(d_o * o) and the lse in base 2, each fp32 [batch, q_heads, q_len rounded up to 64].
size_t flash_attention_backward_workspace_bytes(const AttentionProblem& problem);

// Writes dq, dk, dv (o and lse as the forward wrote them). `workspace`: device memory of at least
// flash_attention_backward_workspace_bytes(params) bytes, 16-byte aligned (cudaMalloc and torch's
// allocator give 256); its contents need no initialization and are garbage afterwards.
// Asynchronous on `stream` like the forward.
Status flash_attention_backward(const FlashAttentionParams& params, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream);

}  // namespace loom::kernels
