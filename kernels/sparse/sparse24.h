#pragma once
// 2:4 structured-sparse weights and their product with dense activations (kernels layer: raw
// pointers and a stream, no LibTorch).
//
// A weight W [rows, cols] (row-major, bf16 or fp16, cols = the input features) is 2:4 sparse when
// every chunk of four consecutive elements of a row, W[r][4c .. 4c+3], has at most two nonzeros.
// Its compressed form, the one sparse tensor cores read (PTX ISA, "Sparse matrix storage"):
//   values [rows, cols / 2]: each chunk's two kept elements, the lower column first;
//   meta   [cols / 32, rows] uint32 (k-step major): word (s, r) describes columns 32 s .. 32 s + 31
//          of row r, chunk j of them (columns 32 s + 4 j ..) in bits 4 j .. 4 j + 3: the lower
//          2 bits the column of the first kept element within the chunk, the upper 2 bits that of
//          the second, first < second (the six values mma.sp::ordered_metadata accepts). A chunk
//          with fewer than two nonzeros keeps zeros at the lowest free columns.
// The k-step-major order lets the kernel fetch a tile's metadata with 16-byte copies.
//
// The product (sparse24_matmul): y [tokens, rows] = x [tokens, cols] W^T, x row-major, the sums in
// fp32 and y rounded once to the element type: the forward product of a linear layer with weight
// W, and (with W^T compressed, when the mask is transposable) the input-gradient product.
//
// Host references (sparse24_*_host) beside the CUDA kernels (sparse24.cu, LOOM_WITH_CUDA); the
// kernel-emulation test runs the kernels' source on the CPU against them
// (tests/kernel_emulation/sparse24_emulated.cpp). The product's reference sums in the order the
// kernel's tensor cores do in the emulation: per 32-wide k-step the products in double (exact for
// 16-bit inputs) added to the fp32 running sum and rounded once, so the two agree bit for bit
// there; on a GPU, the hardware's own order within a step leaves a difference bounded in
// docs/sparsity.md. Plain C++ can include this header.
#include <cstdint>

#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

enum class Sparse24Dtype { kBFloat16, kFloat16 };

// Columns per metadata word, and the multiple `cols` must be of.
constexpr int64_t kSparse24Step = 32;

struct Sparse24Shape {
  int64_t rows = 0;  // output features
  int64_t cols = 0;  // input features: a multiple of kSparse24Step
};

// Sizes of the compressed form, in elements (values) and in 32-bit words (meta).
inline int64_t sparse24_values_size(const Sparse24Shape& s) {
  return s.rows * (s.cols / 2);
}
inline int64_t sparse24_meta_size(const Sparse24Shape& s) {
  return (s.cols / kSparse24Step) * s.rows;
}

// The checks every entry point makes: rows >= 0, cols a non-negative multiple of 32, and (the
// product) rows a multiple of 16 and tokens >= 0; the message names the value and what is valid.
Status sparse24_check(const Sparse24Shape& shape);
Status sparse24_matmul_check(const Sparse24Shape& shape, int64_t tokens);

// Compresses `dense` (16-bit elements, bf16 or fp16: a zero is +0 or -0 in both). Returns the
// row-major flat index of the first element of the first chunk (in row-major order) that has more
// than two nonzeros, or -1 when W is 2:4 sparse; values and meta are written either way (such a
// chunk keeps its two lowest nonzeros).
int64_t sparse24_compress_host(const uint16_t* dense, const Sparse24Shape& shape, uint16_t* values,
                               uint32_t* meta);

// The inverse: dense [rows, cols] with zeros where nothing was kept. Returns -1, or the flat
// index of the first metadata word that is not a valid ordered pair (then dense is incomplete).
int64_t sparse24_decompress_host(const uint16_t* values, const uint32_t* meta,
                                 const Sparse24Shape& shape, uint16_t* dense);

// y = x W^T on the host, in the kernel's summation order (above); y in the element type.
void sparse24_matmul_host(Sparse24Dtype dtype, const uint16_t* x, int64_t tokens,
                          const uint16_t* values, const uint32_t* meta, const Sparse24Shape& shape,
                          uint16_t* y);

// The same on the GPU: device pointers, asynchronous on `stream`.
//   compress: `first_violation` points at one device int64 that the caller sets to rows * cols
//   (or any larger value: "none"); the kernel lowers it (atomicMin) to the first violating
//   chunk's index, so it stays at the caller's value when W is 2:4. 16-byte aligned pointers.
//   matmul: x, values, meta and y 16-byte aligned (x rows then are, cols being a multiple of 32);
//   rows a multiple of 16, any tokens.
Status sparse24_compress(const void* dense, const Sparse24Shape& shape, void* values,
                         uint32_t* meta, int64_t* first_violation, cudaStream_t stream);
Status sparse24_matmul(Sparse24Dtype dtype, const void* x, int64_t tokens, const void* values,
                       const uint32_t* meta, const Sparse24Shape& shape, void* y,
                       cudaStream_t stream);

// Whether this build has the kernels for CUDA device `device` (no launch).
Status sparse24_device_check(int device);

}  // namespace loom::kernels
