#pragma once
// Orthonormal columns for PowerSGD (parallel/data/powersgd_hook.h, ops/orthogonalize.h): each of
// a batch of row-major matrices P (rows x rank, rank <= kMaxOrthoRank) is replaced by an
// orthonormal basis of its column span, by modified Gram-Schmidt. For column i = 0, 1, ...:
//   d_j    = sum over rows k of P[k][i] P[k][j], for j = i .. rank - 1 (d_i: the squared norm),
//            each added up in a fixed order: "thread" t (0..255) accumulates the rows
//            t, t + 256, ... in turn as fma(P[k][i], P[k][j], sum); the 32 sums of each group
//            of 32 threads (a warp) are combined by a butterfly (at step o = 16, 8, 4, 2, 1 each
//            lane adds the sum of lane l xor o to its own); the 8 warps' sums are added in warp
//            order, starting from warp 0's;
//   if d_i == 0 the column is left as it is (zero) and nothing is projected out of the others;
//   else  P[k][j] = fma(-(d_j / d_i), P[k][i], P[k][j]) for j > i (the part along column i
//         removed), then P[k][i] = P[k][i] / sqrt(d_i).
// Each operation is one fp32 rounding, in this order, on the host and in the kernel, so both
// give the same values. A NaN or an infinity spreads to the columns after it (d_i is not 0), so
// a non-finite gradient stays visible in what PowerSGD sends. Columns whose norm underflows to 0
// (every value below about 1e-23) are left unnormalized: PowerSGD's error feedback keeps what
// they do not carry.
#include <cstdint>

#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

constexpr int kMaxOrthoRank = 32;
constexpr int kOrthoThreads = 256;  // the summation order above assumes 256 threads (8 warps)

// rank in [1, kMaxOrthoRank], matrices >= 0.
Status orthogonalize_check(int64_t rank, int64_t matrices);

// The reference, matrices [begin, end): matrix m starts at data + offsets[m] and has rows[m]
// rows of `rank` values.
void orthogonalize_host(float* data, const int64_t* offsets, const int64_t* rows, int64_t rank,
                        int64_t begin, int64_t end);

// The kernel: one CUDA block of kOrthoThreads per matrix (a grid-stride loop over the matrices;
// max_blocks > 0 caps the grid, which tests use), thread t owning rows t, t + 256, ... of it.
// data, offsets and rows are device pointers.
Status orthogonalize_apply(float* data, const int64_t* offsets, const int64_t* rows, int64_t rank,
                           int64_t matrices, cudaStream_t stream, int64_t max_blocks = 0);

}  // namespace loom::kernels
