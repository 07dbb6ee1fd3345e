#pragma once
// The product of a linear layer whose weight has been pruned (docs/sparsity.md, "Sparse
// products"): where the weight's mask shape has a kernel on the input's device, that kernel;
// elsewhere the dense product of the weight with its zeros (the masked dense product), which is
// what an unpruned layer computes. The layers of parallel/tensor call it with the format the
// prune strategy set on them, and log the path taken.
//   2:4 (--prune-pattern 2:4) on CUDA in bf16/fp16 (the tensor's dtype or autocast's): the
//     forward by loom's mma.sp kernel (ops/sparse24.h) on the weight compressed for that call,
//     the backward by dense products (a 2:4 W is not 2:4 along the other dimension), except the
//     input gradient dy W = dy (W^T)^T of a transposable 2:4 W (2:4t), which takes the kernel on
//     W^T;
//   block:B, once at least 70% of the tiles are dropped (below that the dense product is faster
//     on the CPU: docs/benchmarks.md): on the CPU with B >= 32 ops::block_sparse_linear, forward
//     and backward from the kept tiles alone, in the compute dtype; on CUDA with B 32 or 64 in
//     bf16/fp16, loom's block-sparse tensor-core kernel (ops/bsr.h) for the forward and, on W^T's
//     tiles, the input gradient, and a dense product masked to the kept tiles for the weight
//     gradient.
// Every path gives the same values up to the order of the sums, and the same gradients where the
// weight is nonzero; a pruned weight's own gradient is not used (the prune strategy zeroes it).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace loom::ops {

struct SparseLinearFormat {
  enum class Kind { kDense, kTwoFour, kBlock };
  Kind kind = Kind::kDense;
  int64_t block = 0;          // kBlock: the tile side
  bool transposable = false;  // kTwoFour: W^T is 2:4 too (the input gradient takes the kernel)
  // kBlock: the fraction of tiles the weight drops, when the caller knows it (-1: measured from
  // the weight at each call, a device sync on CUDA).
  double tile_sparsity = -1;
};

enum class SparseLinearPath { kDense, kMaskedDense, kTwoFourCuda, kBlockCpu, kBlockCuda };

struct SparseLinearChoice {
  SparseLinearPath path = SparseLinearPath::kDense;
  std::string reason;  // kMaskedDense: why no kernel applies; else empty
};

// The fraction of dropped tiles from which the block-sparse products are used (where the CPU
// product starts to pay; the GPU's own threshold is not measured yet), and the smallest tile the
// CPU product is measured to pay with (docs/benchmarks.md: 32 and 64).
constexpr double kBlockSparseMinTileSparsity = 0.7;
constexpr int64_t kBlockSparseMinCpuBlock = 32;

// Which product y = x weight^T takes for this input, weight and format.
SparseLinearChoice choose_sparse_linear(const at::Tensor& x, const at::Tensor& weight,
                                        const SparseLinearFormat& format);

// y = x weight^T by the chosen path (no bias): differentiable in x and weight.
at::Tensor sparse_linear(const at::Tensor& x, const at::Tensor& weight,
                         const SparseLinearFormat& format, const SparseLinearChoice& choice);

// "2:4 sparse tensor cores (loom's mma.sp kernel)", "masked dense product: <reason>", ...
std::string describe(const SparseLinearChoice& choice);

}  // namespace loom::ops
