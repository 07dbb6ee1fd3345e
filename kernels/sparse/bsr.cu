// Block-sparse x dense product on tensor cores (bsr.h), for sm_80 and newer.
//
// bsr_matmul_kernel<E, B>: y = x W^T computed as D = W x^T per kept tile, so that the tile is the
// MMA's A operand and x, row-major, the "col" B operand. One block per tile row of W (B output
// features) and kTokens tokens (128 for B = 32, 64 for B = 64), 4 warps splitting the tokens;
// each warp holds all B rows (B / 16 m16 tiles) of its tokens' accumulators. The block walks its
// tile row's kept tiles: per tile it copies the tile and the x columns it multiplies (cp.async,
// two stages deep: the next tile loads while this one is computed) into shared memory and issues
// B / 16 k-steps of mma.sync m16n8k16 per (m16, n8) pair. Dropped tiles cost nothing. At the end
// the fp32 accumulators are rounded to the element type, transposed through shared memory and
// written as whole 16-byte rows of y (zeros for a tile row with no kept tile).
//
// Shared-memory rows are padded by 8 elements (B = 32: 80 bytes, B = 64: 144 bytes), so the 8 row
// addresses of each ldmatrix phase fall in distinct 16-byte bank groups.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/element_bits.h"
#include "common/kernel_image.h"
#include "common/ptx.h"
#include "sparse/bsr.h"

namespace loom::kernels {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

template <int B>
struct BsrTile {
  static constexpr int kTokens = B == 32 ? 128 : 64;  // tokens per block
  static constexpr int kWarpTokens = kTokens / kWarps;
  static constexpr int kM = B / 16;           // m16 tiles per warp (all B rows)
  static constexpr int kN = kWarpTokens / 8;  // n8 tiles per warp
  static constexpr int kStride = B + 8;       // elements per shared row
  static constexpr int kTileBytes = B * kStride * 2;
  static constexpr int kStageBytes = kTileBytes + kTokens * kStride * 2;
  static constexpr int kSharedBytes = 2 * kStageBytes;
  static_assert(kN % 2 == 0 && kSharedBytes <= 48 * 1024 && kStageBytes % 16 == 0);
};

struct BsrArgs {
  const uint16_t* x;  // [tokens, cols]
  const int32_t* row_start;
  const int32_t* tile_col;
  const uint16_t* values;  // [kept, B, B]
  uint16_t* y;             // [tokens, rows]
  int64_t tokens, rows, cols;
};

// Copies kept tile `k` and the x columns it multiplies into shared-memory stage `stage`.
template <int B>
__device__ __forceinline__ void load_tile(const BsrArgs& a, unsigned char* stage, int64_t token0,
                                          int32_t k) {
  using T = BsrTile<B>;
  auto* tile = reinterpret_cast<uint16_t*>(stage);
  auto* xs = reinterpret_cast<uint16_t*>(stage + T::kTileBytes);
  const uint16_t* values = a.values + int64_t(k) * B * B;
  for (int i = threadIdx.x; i < B * B / 8; i += kThreads) {
    const int row = i / (B / 8), part = i % (B / 8);
    cp_async_16(tile + row * T::kStride + part * 8, values + row * B + part * 8, true);
  }
  const int64_t col0 = int64_t(a.tile_col[k]) * B;
  for (int i = threadIdx.x; i < T::kTokens * (B / 8); i += kThreads) {
    const int token = i / (B / 8), part = i % (B / 8);
    const bool in = token0 + token < a.tokens;
    const uint16_t* src = in ? a.x + (token0 + token) * a.cols + col0 + part * 8 : a.x;
    cp_async_16(xs + token * T::kStride + part * 8, src, in);
  }
}

template <typename E, int B>
__global__ void __launch_bounds__(kThreads) bsr_matmul_kernel(const BsrArgs a) {
  using T = BsrTile<B>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t tile_row = blockIdx.y;
  const int64_t token0 = int64_t(blockIdx.x) * T::kTokens;
  const int32_t first = a.row_start[tile_row], last = a.row_start[tile_row + 1];

  float acc[T::kM][T::kN][4];
#pragma unroll
  for (int mi = 0; mi < T::kM; ++mi)
#pragma unroll
    for (int ni = 0; ni < T::kN; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.f;

  if (first < last) load_tile<B>(a, smem_raw, token0, first);
  cp_async_commit();
  for (int32_t k = first; k < last; ++k) {
    const int32_t n = k - first;
    if (k + 1 < last) load_tile<B>(a, smem_raw + ((n + 1) % 2) * T::kStageBytes, token0, k + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const unsigned char* stage = smem_raw + (n % 2) * T::kStageBytes;
    const auto* tile = reinterpret_cast<const uint16_t*>(stage);
    const auto* xs = reinterpret_cast<const uint16_t*>(stage + T::kTileBytes);
#pragma unroll
    for (int kk = 0; kk < B / 16; ++kk) {
      uint32_t frag_a[T::kM][4];
#pragma unroll
      for (int mi = 0; mi < T::kM; ++mi)  // matrices: rows 0-7 / 8-15 of columns 0-7, then 8-15
        ldmatrix_x4(frag_a[mi], tile + (mi * 16 + lane % 8 + 8 * (lane / 8 % 2)) * T::kStride +
                                    kk * 16 + 8 * (lane / 16));
#pragma unroll
      for (int np = 0; np < T::kN / 2; ++np) {
        // Two n8 tiles: matrices (tokens 0-7, columns 0-7), (0-7, 8-15), (8-15, 0-7), (8-15,
        // 8-15), i.e. b0, b1 of the first tile, then of the second.
        uint32_t frag_b[4];
        ldmatrix_x4(
            frag_b,
            xs + (warp * T::kWarpTokens + np * 16 + lane % 8 + 8 * (lane / 16)) * T::kStride +
                kk * 16 + 8 * (lane / 8 % 2));
#pragma unroll
        for (int mi = 0; mi < T::kM; ++mi) {
          mma_16816<E>(acc[mi][2 * np], frag_a[mi], frag_b[0], frag_b[1]);
          mma_16816<E>(acc[mi][2 * np + 1], frag_a[mi], frag_b[2], frag_b[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();  // the last group is empty; the loop's last barrier freed the stages

  // D[row][token] -> y[token][row] through shared memory, in the element type.
  auto* ys = reinterpret_cast<uint16_t*>(smem_raw);
#pragma unroll
  for (int mi = 0; mi < T::kM; ++mi)
#pragma unroll
    for (int ni = 0; ni < T::kN; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = mi * 16 + g + 8 * (i / 2);
        const int token = warp * T::kWarpTokens + ni * 8 + 2 * t + i % 2;
        ys[token * T::kStride + row] = round_to(acc[mi][ni][i], static_cast<E*>(nullptr));
      }
  __syncthreads();
  for (int i = threadIdx.x; i < T::kTokens * (B / 8); i += kThreads) {
    const int token = i / (B / 8), part = i % (B / 8);
    if (token0 + token >= a.tokens) continue;
    *reinterpret_cast<uint4*>(a.y + (token0 + token) * a.rows + tile_row * B + part * 8) =
        *reinterpret_cast<const uint4*>(ys + token * T::kStride + part * 8);
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename E, int B>
Status launch(const BsrArgs& a, cudaStream_t stream) {
  using T = BsrTile<B>;
  const int64_t token_blocks = (a.tokens + T::kTokens - 1) / T::kTokens;
  const int64_t tile_rows = a.rows / B;
  if (token_blocks > 0x7fffffff || tile_rows > 65535)
    return Status::invalid_argument("bsr_matmul: " + std::to_string(a.tokens) + " tokens x " +
                                    std::to_string(a.rows) +
                                    " rows is more than one launch covers");
  const dim3 grid{unsigned(token_blocks), unsigned(tile_rows), 1u};
  bsr_matmul_kernel<E, B><<<grid, kThreads, T::kSharedBytes, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::cuda_error(std::string("bsr_matmul launch: ") + cudaGetErrorString(e));
  return Status::success();
}

}  // namespace

Status bsr_matmul(BsrDtype dtype, const void* x, int64_t tokens, const int32_t* row_start,
                  const int32_t* tile_col, const void* values, const BsrShape& shape, void* y,
                  cudaStream_t stream) {
  if (Status s = bsr_check(shape, tokens); !s.ok()) return s;
  if (tokens == 0 || shape.rows == 0) return Status::success();
  if (!aligned16(x) || !aligned16(values) || !aligned16(y) || row_start == nullptr)
    return Status::invalid_argument(
        "bsr_matmul: x, values and y must be 16-byte aligned and "
        "row_start set");
  const BsrArgs a{
      static_cast<const uint16_t*>(x), row_start, tile_col,   static_cast<const uint16_t*>(values),
      static_cast<uint16_t*>(y),       tokens,    shape.rows, shape.cols};
  const bool bf16 = dtype == BsrDtype::kBFloat16;
  if (shape.block == 32)
    return bf16 ? launch<__nv_bfloat16, 32>(a, stream) : launch<__half, 32>(a, stream);
  return bf16 ? launch<__nv_bfloat16, 64>(a, stream) : launch<__half, 64>(a, stream);
}

Status bsr_device_check(int device) {
  return kernel_image_check(bsr_matmul_kernel<__nv_bfloat16, 32>, device, "bsr");
}

}  // namespace loom::kernels
