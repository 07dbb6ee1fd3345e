// 2:4 sparse x dense product on sparse tensor cores (sparse24.h), for sm_80 and newer, and the
// compression that feeds it.
//
// sparse24_matmul_kernel: y = x W^T computed as its transpose D = W x^T, so that the sparse
// operand is the MMA's A (W: rows x cols, 2:4 along cols) and x, row-major, is exactly the "col"
// B operand. One block per 128 rows of W by 128 tokens; its 8 warps form a 4 x 2 grid of 32 x 64
// tiles (2 x 8 MMAs of m16n8k32 per k-step). Per 32-column k-step the block copies (cp.async, two
// stages deep: the next step loads while this one is computed) the step's compressed W values
// (16 per row), its metadata (one word per row) and x's 32 columns into shared memory, loads the
// fragments with ldmatrix, and issues mma.sp. At the end the fp32 accumulators are rounded to the
// element type, transposed through shared memory and written as whole 16-byte rows of y.
//
// Shared-memory rows are padded by 8 elements (W: 24 elements = 48 bytes, x: 40 = 80 bytes), so
// the 8 row addresses of each ldmatrix phase fall in distinct 16-byte bank groups.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "common/element_bits.h"
#include "common/kernel_image.h"
#include "common/ptx.h"
#include "sparse/sparse24.h"
#include "sparse/sparse24_chunk.h"

namespace loom::kernels {

namespace {

constexpr int kBlockRows = 128;    // rows of W (output features) per block
constexpr int kBlockTokens = 128;  // tokens per block
constexpr int kWarpRows = 32;      // per warp: 2 m16 tiles
constexpr int kWarpTokens = 64;    // per warp: 8 n8 tiles
constexpr int kWarpsM = kBlockRows / kWarpRows;
constexpr int kThreads = kWarpsM * (kBlockTokens / kWarpTokens) * 32;
constexpr int kValueStride = kSparse24Step / 2 + 8;  // elements per shared row of W values
constexpr int kXStride = kSparse24Step + 8;          // elements per shared row of x
constexpr int kYStride = kBlockRows + 8;             // elements per shared row of y
constexpr int kStageValueBytes = kBlockRows * kValueStride * 2;
constexpr int kStageXBytes = kBlockTokens * kXStride * 2;
constexpr int kStageMetaBytes = kBlockRows * 4;
constexpr int kStageBytes = kStageValueBytes + kStageXBytes + kStageMetaBytes;
constexpr int kSharedBytes =
    2 * kStageBytes > kBlockTokens* kYStride * 2 ? 2 * kStageBytes : kBlockTokens* kYStride * 2;
static_assert(kThreads == 256 && kStageBytes % 16 == 0 && kSharedBytes <= 48 * 1024);

constexpr int kCompressThreads = 256;

struct MatmulArgs {
  const uint16_t* x;       // [tokens, cols]
  const uint16_t* values;  // [rows, cols / 2]
  const uint32_t* meta;    // [cols / 32, rows]
  uint16_t* y;             // [tokens, rows]
  int64_t tokens, rows, cols;
};

// Copies k-step `step` of the block's W values, metadata and x into shared-memory stage `stage`.
__device__ __forceinline__ void load_step(const MatmulArgs& a, unsigned char* stage, int64_t row0,
                                          int64_t token0, int64_t step) {
  auto* values = reinterpret_cast<uint16_t*>(stage);
  auto* xs = reinterpret_cast<uint16_t*>(stage + kStageValueBytes);
  auto* meta = reinterpret_cast<uint32_t*>(stage + kStageValueBytes + kStageXBytes);
  const int tid = threadIdx.x;
  {  // W values: 128 rows x 2 copies of 8 elements
    const int row = tid / 2, part = tid % 2;
    const bool in = row0 + row < a.rows;
    const uint16_t* src =
        in ? a.values + (row0 + row) * (a.cols / 2) + step * (kSparse24Step / 2) + part * 8
           : a.values;
    cp_async_16(values + row * kValueStride + part * 8, src, in);
  }
#pragma unroll
  for (int q = 0; q < 2; ++q) {  // x: 128 tokens x 4 copies of 8 elements
    const int i = tid + q * kThreads, token = i / 4, part = i % 4;
    const bool in = token0 + token < a.tokens;
    const uint16_t* src =
        in ? a.x + (token0 + token) * a.cols + step * kSparse24Step + part * 8 : a.x;
    cp_async_16(xs + token * kXStride + part * 8, src, in);
  }
  if (tid < kBlockRows / 4) {  // metadata: 128 words, 4 per copy (rows is a multiple of 16)
    const bool in = row0 + 4 * tid < a.rows;
    const uint32_t* src = in ? a.meta + step * a.rows + row0 + 4 * tid : a.meta;
    cp_async_16(meta + 4 * tid, src, in);
  }
}

template <typename E>
__global__ void __launch_bounds__(kThreads) sparse24_matmul_kernel(const MatmulArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_m = warp % kWarpsM, warp_n = warp / kWarpsM;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = int64_t(blockIdx.y) * kBlockRows;
  const int64_t token0 = int64_t(blockIdx.x) * kBlockTokens;
  const int64_t steps = a.cols / kSparse24Step;

  float acc[2][8][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mi][ni][i] = 0.f;
  // Which of the warp's two m16 tiles hold rows of W (rows is a multiple of 16): the same for
  // all lanes, so the warp-wide instructions below are skipped by the whole warp or by none.
  bool tile_in[2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) tile_in[mi] = row0 + warp_m * kWarpRows + mi * 16 < a.rows;

  if (steps > 0) load_step(a, smem_raw, row0, token0, 0);
  cp_async_commit();
  for (int64_t step = 0; step < steps; ++step) {
    if (step + 1 < steps)
      load_step(a, smem_raw + ((step + 1) % 2) * kStageBytes, row0, token0, step + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const unsigned char* stage = smem_raw + (step % 2) * kStageBytes;
    const auto* values = reinterpret_cast<const uint16_t*>(stage);
    const auto* xs = reinterpret_cast<const uint16_t*>(stage + kStageValueBytes);
    const auto* meta = reinterpret_cast<const uint32_t*>(stage + kStageValueBytes + kStageXBytes);

    uint32_t frag_a[2][4], frag_e[2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      if (!tile_in[mi]) continue;
      const int r = warp_m * kWarpRows + mi * 16;
      // Matrices 0..3 of the x4 load: rows 0-7 / 8-15 of columns 0-7, then of columns 8-15.
      ldmatrix_x4(frag_a[mi],
                  values + (r + lane % 8 + 8 * (lane / 8 % 2)) * kValueStride + 8 * (lane / 16));
      const uint32_t upper = meta[r + g + 8], lower = meta[r + g];
      frag_e[mi] =
          t == 0 ? (lower & 0xffffu) | (upper << 16) : (lower >> 16) | (upper & 0xffff0000u);
    }
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
      uint32_t frag_b[4];  // matrix j: 8 tokens x columns 8j .. 8j + 7
      ldmatrix_x4(frag_b,
                  xs + (warp_n * kWarpTokens + ni * 8 + lane % 8) * kXStride + 8 * (lane / 8));
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        if (tile_in[mi]) mma_sp_16832<E>(acc[mi][ni], frag_a[mi], frag_b, frag_e[mi]);
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // D[row][token] -> y[token][row] through shared memory, in the element type.
  auto* ys = reinterpret_cast<uint16_t*>(smem_raw);
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = warp_m * kWarpRows + mi * 16 + g + 8 * (i / 2);
        const int token = warp_n * kWarpTokens + ni * 8 + 2 * t + i % 2;
        ys[token * kYStride + row] = round_to(acc[mi][ni][i], static_cast<E*>(nullptr));
      }
  __syncthreads();
  for (int i = threadIdx.x; i < kBlockTokens * (kBlockRows / 8); i += kThreads) {
    const int token = i / (kBlockRows / 8), part = i % (kBlockRows / 8);
    if (token0 + token >= a.tokens || row0 + part * 8 >= a.rows) continue;
    *reinterpret_cast<uint4*>(a.y + (token0 + token) * a.rows + row0 + part * 8) =
        *reinterpret_cast<const uint4*>(ys + token * kYStride + part * 8);
  }
}

struct CompressArgs {
  const uint16_t* dense;  // [rows, cols]
  uint16_t* values;       // [rows, cols / 2]
  uint32_t* meta;         // [cols / 32, rows]
  long long* first_violation;
  int64_t rows, cols;
};

// One thread per (row, k-step): 32 dense elements in, 16 values and one metadata word out.
__global__ void __launch_bounds__(kCompressThreads) sparse24_compress_kernel(const CompressArgs a) {
  const int64_t steps = a.cols / kSparse24Step;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.rows * steps) return;
  const int64_t row = i / steps, step = i % steps;
  const int64_t col0 = step * kSparse24Step;
  uint4 in[4];
  const auto* src = reinterpret_cast<const uint4*>(a.dense + row * a.cols + col0);
#pragma unroll
  for (int q = 0; q < 4; ++q) in[q] = src[q];
  const auto* e = reinterpret_cast<const uint16_t*>(in);
  uint4 out[2];
  auto* kept = reinterpret_cast<uint16_t*>(out);
  uint32_t word = 0;
  long long violation = -1;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const Sparse24Chunk chunk =
        sparse24_compress_chunk({e[4 * j], e[4 * j + 1], e[4 * j + 2], e[4 * j + 3]});
    word |= chunk.nibble << (4 * j);
    kept[2 * j] = chunk.kept[0];
    kept[2 * j + 1] = chunk.kept[1];
    if (chunk.over && violation < 0) violation = row * a.cols + col0 + 4 * j;
  }
  auto* dst = reinterpret_cast<uint4*>(a.values + row * (a.cols / 2) + col0 / 2);
  dst[0] = out[0];
  dst[1] = out[1];
  a.meta[step * a.rows + row] = word;
  if (violation >= 0) atomicMin(a.first_violation, violation);
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

Status launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::cuda_error(std::string(what) + " launch: " + cudaGetErrorString(e));
  return Status::success();
}

}  // namespace

Status sparse24_compress(const void* dense, const Sparse24Shape& shape, void* values,
                         uint32_t* meta, int64_t* first_violation, cudaStream_t stream) {
  if (Status s = sparse24_check(shape); !s.ok()) return s;
  const int64_t work = shape.rows * (shape.cols / kSparse24Step);
  if (work == 0) return Status::success();
  if (!aligned16(dense) || !aligned16(values) || !aligned16(meta) || first_violation == nullptr)
    return Status::invalid_argument(
        "sparse24_compress: dense, values and meta must be 16-byte aligned and first_violation "
        "set");
  const int64_t blocks = (work + kCompressThreads - 1) / kCompressThreads;
  if (blocks > 0x7fffffff)
    return Status::invalid_argument("sparse24_compress: " + std::to_string(work) +
                                    " (row, k-step) pairs is more than one launch covers");
  static_assert(sizeof(long long) == sizeof(int64_t));
  CompressArgs a{static_cast<const uint16_t*>(dense),
                 static_cast<uint16_t*>(values),
                 meta,
                 reinterpret_cast<long long*>(first_violation),
                 shape.rows,
                 shape.cols};
  sparse24_compress_kernel<<<unsigned(blocks), kCompressThreads, 0, stream>>>(a);
  return launched("sparse24_compress");
}

Status sparse24_matmul(Sparse24Dtype dtype, const void* x, int64_t tokens, const void* values,
                       const uint32_t* meta, const Sparse24Shape& shape, void* y,
                       cudaStream_t stream) {
  if (Status s = sparse24_matmul_check(shape, tokens); !s.ok()) return s;
  if (tokens == 0 || shape.rows == 0) return Status::success();
  if (!aligned16(x) || !aligned16(values) || !aligned16(meta) || !aligned16(y))
    return Status::invalid_argument(
        "sparse24_matmul: x, values, meta and y must be 16-byte "
        "aligned");
  const int64_t token_blocks = (tokens + kBlockTokens - 1) / kBlockTokens;
  const int64_t row_blocks = (shape.rows + kBlockRows - 1) / kBlockRows;
  if (token_blocks > 0x7fffffff || row_blocks > 65535)
    return Status::invalid_argument("sparse24_matmul: " + std::to_string(tokens) + " tokens x " +
                                    std::to_string(shape.rows) +
                                    " rows is more than one launch covers (rows <= 8388480)");
  MatmulArgs a{static_cast<const uint16_t*>(x),
               static_cast<const uint16_t*>(values),
               meta,
               static_cast<uint16_t*>(y),
               tokens,
               shape.rows,
               shape.cols};
  const dim3 grid{unsigned(token_blocks), unsigned(row_blocks), 1u};
  if (dtype == Sparse24Dtype::kBFloat16)
    sparse24_matmul_kernel<__nv_bfloat16><<<grid, kThreads, kSharedBytes, stream>>>(a);
  else
    sparse24_matmul_kernel<__half><<<grid, kThreads, kSharedBytes, stream>>>(a);
  return launched("sparse24_matmul");
}

Status sparse24_device_check(int device) {
  return kernel_image_check(sparse24_matmul_kernel<__nv_bfloat16>, device, "sparse24");
}

}  // namespace loom::kernels
