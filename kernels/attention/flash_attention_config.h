#pragma once
// What the fused attention kernel (flash_attention.cu) and its host reference
// (flash_attention_host.cpp) share: the problem description, the tile sizes, the tile ranges each
// block visits and the argument checks. Plain C++ (no CUDA, no LibTorch): the host reference and
// the CPU tests include it without the CUDA toolkit. Functions the kernel calls too are marked
// LOOM_HOST_DEVICE, so both sides run literally the same tile arithmetic.
#include <cmath>
#include <cstdint>
#include <string>

#include "common/status.h"

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__
#else
#define LOOM_HOST_DEVICE
#endif

namespace loom::kernels {

// Strides of a [batch, heads, seq, head_dim] tensor, in elements. The last dimension (head_dim)
// is contiguous (stride 1).
struct AttentionStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t seq = 0;
};

// Shapes and layouts of one attention call:
//   q, o, d_o, dq: [batch, q_heads, q_len, head_dim]
//   k, v, dk, dv:  [batch, kv_heads, kv_len, head_dim]
//   lse:           [batch, q_heads, q_len], fp32, contiguous (natural-log logsumexp of each row
//                  of scale * q k^T after masking)
// Grouped-query attention: kv_heads divides q_heads and query head h reads key/value head
// h / (q_heads / kv_heads). Causal: query i attends to keys j <= i, which needs q_len == kv_len.
// A row with no key to attend to (only when kv_len == 0) yields o = 0 and lse = -infinity, and
// contributes nothing to any gradient.
struct AttentionProblem {
  int batch = 0;
  int q_heads = 0;
  int kv_heads = 0;
  int q_len = 0;
  int kv_len = 0;
  int head_dim = 0;
  float scale = 0.f;  // multiplies q k^T; callers usually pass 1/sqrt(head_dim)
  bool causal = false;
  // Document mask (optional, causal only): first_key[b * q_len + i] is the first key query i of
  // batch b may attend, so it attends keys [first_key[..i], i]. Non-decreasing along each row
  // with 0 <= first_key[i] <= i (documents lie one after another in a window), which is what
  // lets whole tiles be skipped; ops::document_first_keys makes such rows. int32, contiguous
  // [batch, q_len]; a device pointer for the kernel, a host one for the reference. Null: none.
  const int32_t* first_key = nullptr;
  AttentionStrides q_strides, k_strides, v_strides, o_strides;
  AttentionStrides d_o_strides, dq_strides, dk_strides, dv_strides;  // backward only
};

// Contiguous [batch, heads, seq, head_dim] strides.
inline AttentionStrides contiguous_attention_strides(int heads, int seq, int head_dim) {
  const int64_t s = head_dim;
  const int64_t h = s * seq;
  return {h * heads, h, s};
}

// ---- Tiles -------------------------------------------------------------------------------------
// Forward: a block owns kFwdBlockM query rows (one warp per 16 rows) and streams the keys and
// values through shared memory kFwdBlockN at a time.
inline constexpr int kFwdBlockM = 128;
inline constexpr int kFwdBlockN = 64;
// Backward: a block owns kBwdBlockN keys (one warp per 16 keys) of one key/value head, and streams
// the queries of every query head of its group, bwd_block_m(head_dim) rows at a time.
inline constexpr int kBwdBlockN = 64;
LOOM_HOST_DEVICE constexpr int bwd_block_m(int head_dim) {
  return head_dim <= 64 ? 64 : 32;
}
// Head dims the CUDA kernel is compiled for (the host reference takes any positive head_dim).
inline constexpr int kKernelHeadDims[] = {64, 128};

LOOM_HOST_DEVICE constexpr int attention_ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

// Forward: how many key tiles (each kFwdBlockN keys, from key 0) the query tile m_block visits.
// Causal: the tiles holding keys up to the tile's last query row; later tiles are all masked.
LOOM_HOST_DEVICE constexpr int fwd_num_kv_tiles(int m_block, int q_len, int kv_len, bool causal) {
  int n = attention_ceil_div(kv_len, kFwdBlockN);
  if (causal) {
    const int rows_end = (m_block + 1) * kFwdBlockM < q_len ? (m_block + 1) * kFwdBlockM : q_len;
    const int n_causal = attention_ceil_div(rows_end, kFwdBlockN);
    n = n_causal < n ? n_causal : n;
  }
  return n;
}

// Forward: whether tile (m_block, n_block) needs an element-wise mask: it runs past kv_len, or
// (causal) some key in it lies after some query row of the block. Other tiles skip the mask.
LOOM_HOST_DEVICE constexpr bool fwd_tile_needs_mask(int m_block, int n_block, int kv_len,
                                                    bool causal) {
  const int n0 = n_block * kFwdBlockN;
  return n0 + kFwdBlockN > kv_len || (causal && n0 + kFwdBlockN - 1 > m_block * kFwdBlockM);
}

// Backward: the first query tile (of block_m rows) key tile n_block meets. Causal: queries before
// the tile's first key see none of its keys.
LOOM_HOST_DEVICE constexpr int bwd_first_q_tile(int n_block, int block_m, bool causal) {
  return causal ? n_block * kBwdBlockN / block_m : 0;
}

// Backward: whether tile (m_block of block_m rows, n_block) needs an element-wise mask.
LOOM_HOST_DEVICE constexpr bool bwd_tile_needs_mask(int m_block, int block_m, int n_block,
                                                    int kv_len, bool causal) {
  const int n0 = n_block * kBwdBlockN;
  return n0 + kBwdBlockN > kv_len || (causal && n0 + kBwdBlockN - 1 > m_block * block_m);
}

// Document mask (AttentionProblem::first_key; `fk` is batch b's row of it, or null). Rows are
// non-decreasing, so a tile's first query has its smallest first key and its last the largest.
//
// Forward: the first key tile query tile m_block visits: the one holding its first row's first
// key (earlier tiles are masked for every row of it).
LOOM_HOST_DEVICE inline int fwd_first_kv_tile(const int32_t* fk, int m_block) {
  // Clamped at 0: a negative first key (first keys on the device are not checked) must not send
  // the loads before the keys.
  return fk == nullptr || fk[m_block * kFwdBlockM] < 0 ? 0 : fk[m_block * kFwdBlockM] / kFwdBlockN;
}
// Whether some key of tile n_block lies before the first key of some row of query tile
// m_block (its last row's): the tile needs the element-wise document mask.
LOOM_HOST_DEVICE inline bool fwd_tile_needs_doc_mask(const int32_t* fk, int m_block, int n_block,
                                                     int q_len) {
  if (fk == nullptr) return false;
  const int last = ((m_block + 1) * kFwdBlockM < q_len ? (m_block + 1) * kFwdBlockM : q_len) - 1;
  return fk[last] > n_block * kFwdBlockN;
}
// Backward: one past the last query tile (of block_m rows) that key tile n_block meets: queries
// whose first key lies after the tile's last key see none of it, and (rows non-decreasing) nor
// does any query after them. A binary search over the row: log2(q_len) reads.
LOOM_HOST_DEVICE inline int bwd_end_q_tile(const int32_t* fk, int q_len, int n_block, int block_m) {
  if (fk == nullptr) return attention_ceil_div(q_len, block_m);
  const int last_key = n_block * kBwdBlockN + kBwdBlockN - 1;
  int lo = 0, hi = q_len;  // the queries with fk <= last_key are [0, lo)
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (fk[mid] <= last_key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return attention_ceil_div(lo, block_m);
}
// Backward: whether tile (m_block of block_m rows, n_block) needs the element-wise document mask.
LOOM_HOST_DEVICE inline bool bwd_tile_needs_doc_mask(const int32_t* fk, int m_block, int block_m,
                                                     int n_block, int q_len) {
  if (fk == nullptr) return false;
  const int last = ((m_block + 1) * block_m < q_len ? (m_block + 1) * block_m : q_len) - 1;
  return fk[last] > n_block * kBwdBlockN;
}

// ---- Checks ------------------------------------------------------------------------------------
// Checks the shapes, head_dim and scale of `p`. for_kernel: also the limits of the CUDA kernel
// (head_dim 64 or 128). Strides and pointers are checked by each entry point.
inline Status check_attention_problem(const AttentionProblem& p, bool for_kernel) {
  auto bad = [](const std::string& m) { return Status::invalid_argument("flash_attention: " + m); };
  auto str = [](auto v) { return std::to_string(v); };
  if (p.batch < 0 || p.q_len < 0 || p.kv_len < 0)
    return bad("batch (" + str(p.batch) + "), q_len (" + str(p.q_len) + ") and kv_len (" +
               str(p.kv_len) + ") must be >= 0");
  if (p.q_heads < 1 || p.kv_heads < 1)
    return bad("q_heads (" + str(p.q_heads) + ") and kv_heads (" + str(p.kv_heads) +
               ") must be >= 1");
  if (p.q_heads % p.kv_heads != 0)
    return bad("q_heads " + str(p.q_heads) + " is not a multiple of kv_heads " + str(p.kv_heads) +
               " (grouped-query attention needs kv_heads to divide q_heads)");
  if (for_kernel) {
    bool supported = false;
    for (int d : kKernelHeadDims) supported = supported || p.head_dim == d;
    if (!supported)
      return bad("head_dim " + str(p.head_dim) +
                 " is not supported by the CUDA kernel (supported: 64, 128)");
  } else if (p.head_dim < 1) {
    return bad("head_dim " + str(p.head_dim) + " must be >= 1");
  }
  if (!(p.scale > 0.f) || !std::isfinite(p.scale))
    return bad("scale " + str(p.scale) + " must be finite and > 0");
  if (p.first_key != nullptr && !p.causal)
    return bad("a document mask (first_key) needs causal attention");
  if (p.causal && p.q_len != p.kv_len)
    return bad("causal attention needs q_len == kv_len; got q_len " + str(p.q_len) +
               " and kv_len " + str(p.kv_len));
  return Status::success();
}

}  // namespace loom::kernels
