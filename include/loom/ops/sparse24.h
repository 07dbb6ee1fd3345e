#pragma once
// 2:4 structured-sparse weights for LibTorch tensors: compression into the form sparse tensor
// cores read, and the product y = x W^T, on CUDA by loom's mma.sp kernel and on the CPU by its
// host reference (kernels/sparse/sparse24.h; docs/sparsity.md, "The 2:4 kernel"). A weight pruned
// with --prune-pattern 2:4 (ops/sparsity.h) is 2:4 along its input features, which is what this
// takes. No autograd here: the product is the forward of a linear layer.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace loom::ops {

struct Sparse24Weight {
  int64_t out_features = 0, in_features = 0;
  at::Tensor values;  // [out, in / 2], the weight's dtype: each 4-wide chunk's two kept elements
  at::Tensor meta;    // [in / 32, out] int32: the metadata words (the kernel layer's layout)

  // The dense weight back, zeros where nothing was kept (on the values' device).
  at::Tensor to_dense() const;
};

// Compresses w [out, in] (bf16 or fp16, CPU or CUDA; in a multiple of 32). loom::Error naming the
// row and columns of the first 4-wide chunk with more than two nonzeros, or the bad shape/dtype.
// verify false skips that check (and, on CUDA, its device-to-host copy) for a caller whose w is
// 2:4 by construction; a chunk with more nonzeros then keeps its first two.
Sparse24Weight sparse24_compress(const at::Tensor& w, bool verify = true);

// Why sparse24_linear cannot take (x, w) on x's device, or nullopt. CUDA also needs out a
// multiple of 16, an sm_80+ device with the kernel in this build and 16-byte aligned rows.
std::optional<std::string> sparse24_unsupported(const at::Tensor& x, const Sparse24Weight& w);

// x [..., in] (the weight's dtype and device) times W^T: [..., out], summed in fp32 and rounded
// once. loom::Error with sparse24_unsupported's reason where it cannot run.
at::Tensor sparse24_linear(const at::Tensor& x, const Sparse24Weight& w);

}  // namespace loom::ops
