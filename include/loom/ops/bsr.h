#pragma once
// Block-sparse (BSR) weights for LibTorch tensors and their product y = x W^T from the kept tiles
// only: on CUDA by loom's tensor-core kernel, on the CPU by its host reference
// (kernels/sparse/bsr.h; docs/sparsity.md). A weight pruned with --prune-pattern block:B, B 32 or
// 64, is what this takes. No autograd here (ops/sparse_linear.h builds the layer's product).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace loom::ops {

struct BsrWeight {
  int64_t out_features = 0, in_features = 0, block = 0;
  at::Tensor row_start;  // [out / B + 1] int32
  at::Tensor tile_col;   // [kept] int32, increasing within a tile row
  at::Tensor values;     // [kept, B, B], the weight's dtype
};

// The tiles of w [out, in] (bf16 or fp16, CPU or CUDA) that hold a nonzero. loom::Error naming
// the shape, dtype or block when the kernel cannot take them (block 32 or 64 dividing both).
BsrWeight bsr_compress(const at::Tensor& w, int64_t block);

// Why bsr_linear cannot take (x, w) on x's device, or nullopt (CUDA: sm_80+).
std::optional<std::string> bsr_unsupported(const at::Tensor& x, const BsrWeight& w);

// x [..., in] (the weight's dtype and device) times W^T: [..., out], fp32 sums rounded once.
at::Tensor bsr_linear(const at::Tensor& x, const BsrWeight& w);

}  // namespace loom::ops
