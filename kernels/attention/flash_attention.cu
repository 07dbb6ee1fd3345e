// Fused attention, FlashAttention-2 style (Dao, 2023), for sm_80 and newer.
//
// Forward (flash_fwd_kernel): one block per (query tile of kFwdBlockM rows, query head, batch);
// each of its 8 warps owns 16 query rows. The block keeps its Q tile in registers (as mma
// fragments) and streams K and V through shared memory kFwdBlockN keys at a time, two stages deep
// (cp.async: the next tile loads while this one is computed). Per tile: S = Q K^T on tensor cores,
// the mask, the online softmax (running max m, running sum l, accumulator rescaled by
// exp(m_old - m_new)), O += P V. At the end O /= l once and lse = scale * m + log(l) is saved.
//
// Backward: (1) flash_bwd_preprocess_kernel: Delta = rowsum(dO * O), lse in base 2, and a zeroed
// fp32 dq accumulator, all in the caller's workspace. (2) flash_bwd_kernel: one block per (key
// tile of kBwdBlockN keys, key/value head, batch); each of its 4 warps owns 16 keys. The block
// keeps K and V in shared memory and visits every query tile of every query head of its group
// (GQA), so dK and dV accumulate in registers over the whole group and are written once, with no
// workspace and no atomics. Per query tile it recomputes S^T = K Q^T and P^T = exp(scale S^T -
// lse), then dV += P^T dO, dP^T = V dO^T, dS^T = P^T * (dP^T - Delta), dK += dS^T Q, and dQ += dS K
// through fp32 atomicAdd into the workspace accumulator (dS goes through shared memory for that
// product, which is partitioned by query rows). (3) flash_bwd_convert_dq_kernel: dq = scale *
// accumulator, converted to the element type, written with dq's strides.
//
// Tensor cores: raw `mma.sync.aligned.m16n8k16` (bf16/fp16 in, fp32 accumulate) fed by `ldmatrix`,
// rather than nvcuda::wmma. wmma fragments have an unspecified element layout, so the per-row
// softmax (and the masks) could not be applied in registers: S would go to shared memory and back
// for every tile. The mma.sync layouts are fixed by the PTX ISA, and the accumulator layout of one
// product is exactly the A-operand layout of the next (P of S = Q K^T feeds P V; dS^T feeds dS^T
// Q), which is what lets S, P, dP and dS live in registers. The instructions' layouts are written
// out beside their wrappers (common/ptx.h); the ones this kernel builds on them are in
// flash_attention_tiles.cuh, next to the only functions that depend on them (load_a,
// load_a_trans, load_b_nk, load_b_kn, the accumulator index helpers); everything else goes
// through those functions. The forward kernel is in flash_attention_forward.cuh, the backward
// ones in flash_attention_backward.cuh; this file checks the arguments and launches them.
//
// Document masks (AttentionProblem::first_key): rows non-decreasing, so the forward starts at
// the key tile of its first row's first key and the backward ends at the last query tile whose
// last row's first key reaches the key tile (a binary search of the row); only the tiles a
// document boundary crosses read first keys element by element.
//
// Masked scores are -inf before the softmax. A row whose keys are all masked (only with kv_len 0)
// keeps m = -inf and l = 0; the update then uses 0 in place of m (no inf - inf), so P = 0, O = 0
// and lse = -inf, and the backward (lse2 = +inf) gives that row P = 0 and no gradient.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "attention/flash_attention.h"
#include "attention/flash_attention_backward.cuh"
#include "attention/flash_attention_forward.cuh"
#include "common/kernel_image.h"

namespace loom::kernels {

namespace {

// The kernels and their argument structs, which this file launches.
using namespace flash;  // NOLINT(google-build-using-namespace)

// ---- Host side ---------------------------------------------------------------------------------

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}
bool strides_aligned(const AttentionStrides& s) {
  return s.batch % 8 == 0 && s.head % 8 == 0 && s.seq % 8 == 0;
}

Status last_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::cuda_error(std::string("flash_attention: launching the ") + what +
                              " kernel failed: " + cudaGetErrorString(e));
  return Status::success();
}

template <typename Kernel>
Status allow_smem(Kernel kernel, size_t bytes, const char* what) {
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (e != cudaSuccess)
    return Status::cuda_error(
        std::string("flash_attention: the ") + what + " kernel needs " + std::to_string(bytes) +
        " bytes of shared memory per block, which the device refused: " + cudaGetErrorString(e));
  return Status::success();
}

// Checks shared by forward and backward; `need` names the pointers the call reads or writes.
Status check_params(const FlashAttentionParams& p,
                    std::initializer_list<std::pair<const void*, const char*>> need) {
  Status s = check_attention_problem(p, /*for_kernel=*/true);
  if (!s.ok()) return s;
  if (p.dtype != AttentionDtype::kBFloat16 && p.dtype != AttentionDtype::kFloat16)
    return Status::invalid_argument("flash_attention: dtype " + std::to_string(int(p.dtype)) +
                                    " is not supported (supported: bf16, fp16)");
  if (p.batch > 65535 || p.q_heads > 65535)
    return Status::invalid_argument("flash_attention: batch (" + std::to_string(p.batch) +
                                    ") and q_heads (" + std::to_string(p.q_heads) +
                                    ") must be <= 65535 (CUDA grid limit)");
  for (const auto& [ptr, name] : need)
    if (ptr == nullptr)
      return Status::invalid_argument(std::string("flash_attention: pointer ") + name + " is null");
  return Status::success();
}

int64_t padded_len(int q_len) {
  return (int64_t(q_len) + kBwdLenPad - 1) / kBwdLenPad * kBwdLenPad;
}
size_t align256(size_t n) {
  return (n + 255) / 256 * 256;
}
struct WorkspaceLayout {
  size_t dq_accum = 0, delta = 0, lse2 = 0, total = 0;  // byte offsets
};
WorkspaceLayout workspace_layout(const AttentionProblem& p) {
  const size_t bh = size_t(p.batch) * size_t(p.q_heads);
  WorkspaceLayout w;
  w.dq_accum = 0;
  w.delta = align256(bh * size_t(p.q_len) * size_t(p.head_dim) * sizeof(float));
  w.lse2 = w.delta + align256(bh * size_t(padded_len(p.q_len)) * sizeof(float));
  w.total = w.lse2 + align256(bh * size_t(padded_len(p.q_len)) * sizeof(float));
  return w;
}

template <typename E, int kHeadDim, bool kDocMask>
Status run_forward(const FlashAttentionParams& p, cudaStream_t stream) {
  FwdArgs<E> a{};
  a.q = static_cast<const E*>(p.q);
  a.k = static_cast<const E*>(p.k);
  a.v = static_cast<const E*>(p.v);
  a.o = static_cast<E*>(p.o);
  a.lse = p.lse;
  a.first_key = p.first_key;
  a.qs = p.q_strides;
  a.ks = p.k_strides;
  a.vs = p.v_strides;
  a.os = p.o_strides;
  a.q_heads = p.q_heads;
  a.group = p.q_heads / p.kv_heads;
  a.q_len = p.q_len;
  a.kv_len = p.kv_len;
  a.scale = p.scale;
  a.scale_log2 = p.scale * kLog2e;
  a.causal = p.causal;
  a.vec = aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.o) &&
          strides_aligned(p.q_strides) && strides_aligned(p.k_strides) &&
          strides_aligned(p.v_strides) && strides_aligned(p.o_strides);
  constexpr size_t smem = FwdSmem<kHeadDim>::kBytes;
  auto kernel = flash_fwd_kernel<E, kHeadDim, kDocMask>;
  Status s = allow_smem(kernel, smem, "forward");
  if (!s.ok()) return s;
  const dim3 grid(attention_ceil_div(p.q_len, kFwdBlockM), p.q_heads, p.batch);
  kernel<<<grid, kFwdThreads, smem, stream>>>(a);
  return last_launch("forward");
}

template <typename E, int kHeadDim>
Status run_backward(const FlashAttentionParams& p, char* workspace, cudaStream_t stream) {
  const WorkspaceLayout w = workspace_layout(p);
  float* dq_accum = reinterpret_cast<float*>(workspace + w.dq_accum);
  float* delta = reinterpret_cast<float*>(workspace + w.delta);
  float* lse2 = reinterpret_cast<float*>(workspace + w.lse2);
  const int64_t bh = int64_t(p.batch) * p.q_heads;
  const int q_len_padded = int(padded_len(p.q_len));

  PreArgs<E> pre{};
  pre.o = static_cast<const E*>(p.o);
  pre.d_o = static_cast<const E*>(p.d_o);
  pre.lse = p.lse;
  pre.os = p.o_strides;
  pre.dos = p.d_o_strides;
  pre.delta = delta;
  pre.lse2 = lse2;
  pre.dq_accum = dq_accum;
  pre.q_heads = p.q_heads;
  pre.q_len = p.q_len;
  pre.q_len_padded = q_len_padded;
  pre.head_dim = kHeadDim;
  pre.rows = bh * q_len_padded;
  if (pre.rows > 0) {
    const int64_t blocks = (pre.rows + kPreRowsPerBlock - 1) / kPreRowsPerBlock;
    flash_bwd_preprocess_kernel<E><<<unsigned(blocks), kPreRowsPerBlock * 32, 0, stream>>>(pre);
    Status s = last_launch("backward preprocess");
    if (!s.ok()) return s;
  }

  if (p.kv_len > 0) {
    BwdArgs<E> a{};
    a.q = static_cast<const E*>(p.q);
    a.k = static_cast<const E*>(p.k);
    a.v = static_cast<const E*>(p.v);
    a.d_o = static_cast<const E*>(p.d_o);
    a.dk = static_cast<E*>(p.dk);
    a.dv = static_cast<E*>(p.dv);
    a.dq_accum = dq_accum;
    a.lse2 = lse2;
    a.delta = delta;
    a.first_key = p.first_key;
    a.qs = p.q_strides;
    a.ks = p.k_strides;
    a.vs = p.v_strides;
    a.dos = p.d_o_strides;
    a.dks = p.dk_strides;
    a.dvs = p.dv_strides;
    a.q_heads = p.q_heads;
    a.group = p.q_heads / p.kv_heads;
    a.q_len = p.q_len;
    a.kv_len = p.kv_len;
    a.q_len_padded = q_len_padded;
    a.scale = p.scale;
    a.scale_log2 = p.scale * kLog2e;
    a.causal = p.causal;
    a.vec = aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.d_o) &&
            aligned16(p.dk) && aligned16(p.dv) && strides_aligned(p.q_strides) &&
            strides_aligned(p.k_strides) && strides_aligned(p.v_strides) &&
            strides_aligned(p.d_o_strides) && strides_aligned(p.dk_strides) &&
            strides_aligned(p.dv_strides);
    constexpr size_t smem = BwdSmem<kHeadDim>::kBytes;
    auto kernel = flash_bwd_kernel<E, kHeadDim>;
    Status s = allow_smem(kernel, smem, "backward");
    if (!s.ok()) return s;
    const dim3 grid(attention_ceil_div(p.kv_len, kBwdBlockN), p.kv_heads, p.batch);
    kernel<<<grid, kBwdThreads, smem, stream>>>(a);
    s = last_launch("backward");
    if (!s.ok()) return s;
  }

  ConvertArgs<E> c{};
  c.dq_accum = dq_accum;
  c.dq = static_cast<E*>(p.dq);
  c.dqs = p.dq_strides;
  c.q_heads = p.q_heads;
  c.q_len = p.q_len;
  c.head_dim = kHeadDim;
  c.scale = p.scale;
  c.rows = bh * p.q_len;
  if (c.rows > 0) {
    const int64_t blocks = (c.rows + kPreRowsPerBlock - 1) / kPreRowsPerBlock;
    flash_bwd_convert_dq_kernel<E><<<unsigned(blocks), kPreRowsPerBlock * 32, 0, stream>>>(c);
    return last_launch("backward dq conversion");
  }
  return Status::success();
}

template <bool kDocMask>
Status forward_for_mask(const FlashAttentionParams& p, cudaStream_t stream) {
  const bool bf16 = p.dtype == AttentionDtype::kBFloat16;
  if (p.head_dim == 64)
    return bf16 ? run_forward<__nv_bfloat16, 64, kDocMask>(p, stream)
                : run_forward<__half, 64, kDocMask>(p, stream);
  return bf16 ? run_forward<__nv_bfloat16, 128, kDocMask>(p, stream)
              : run_forward<__half, 128, kDocMask>(p, stream);
}

Status forward_for_dtype(const FlashAttentionParams& p, cudaStream_t stream) {
  return p.first_key != nullptr ? forward_for_mask<true>(p, stream)
                                : forward_for_mask<false>(p, stream);
}

Status backward_for_dtype(const FlashAttentionParams& p, char* ws, cudaStream_t stream) {
  const bool bf16 = p.dtype == AttentionDtype::kBFloat16;
  if (p.head_dim == 64)
    return bf16 ? run_backward<__nv_bfloat16, 64>(p, ws, stream)
                : run_backward<__half, 64>(p, ws, stream);
  return bf16 ? run_backward<__nv_bfloat16, 128>(p, ws, stream)
              : run_backward<__half, 128>(p, ws, stream);
}

}  // namespace

Status flash_attention_forward(const FlashAttentionParams& p, cudaStream_t stream) {
  Status s = check_params(p, {});
  if (!s.ok()) return s;
  if (p.batch == 0 || p.q_len == 0) return Status::success();
  s = check_params(p, {{p.q, "q"}, {p.o, "o"}, {p.lse, "lse"}});
  if (!s.ok()) return s;
  if (p.kv_len > 0) {
    s = check_params(p, {{p.k, "k"}, {p.v, "v"}});
    if (!s.ok()) return s;
  }
  return forward_for_dtype(p, stream);  // head_dim is 64 or 128 (checked)
}

Status flash_attention_device_check(int device) {
  return kernel_image_check(flash_fwd_kernel<__nv_bfloat16, 64, false>, device, "flash_attention");
}

size_t flash_attention_backward_workspace_bytes(const AttentionProblem& problem) {
  if (problem.batch <= 0 || problem.q_heads <= 0 || problem.q_len <= 0 || problem.head_dim <= 0)
    return 0;
  return workspace_layout(problem).total;
}

Status flash_attention_backward(const FlashAttentionParams& p, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  Status s = check_params(p, {});
  if (!s.ok()) return s;
  if (p.batch == 0 || (p.q_len == 0 && p.kv_len == 0)) return Status::success();
  if (p.q_len > 0) {
    s = check_params(p, {{p.q, "q"}, {p.o, "o"}, {p.lse, "lse"}, {p.d_o, "d_o"}, {p.dq, "dq"}});
    if (!s.ok()) return s;
  }
  if (p.kv_len > 0) {
    s = check_params(p, {{p.k, "k"}, {p.v, "v"}, {p.dk, "dk"}, {p.dv, "dv"}});
    if (!s.ok()) return s;
  }
  const size_t need = flash_attention_backward_workspace_bytes(p);
  if (workspace_bytes < need || (need > 0 && workspace == nullptr))
    return Status::invalid_argument(
        "flash_attention: the backward needs " + std::to_string(need) +
        " bytes of workspace (flash_attention_backward_workspace_bytes); got " +
        std::to_string(workspace == nullptr ? 0 : workspace_bytes));
  if (!aligned16(workspace))
    return Status::invalid_argument("flash_attention: workspace must be 16-byte aligned");
  return backward_for_dtype(p, static_cast<char*>(workspace), stream);
}

}  // namespace loom::kernels
