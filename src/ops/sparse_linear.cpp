#include "loom/ops/sparse_linear.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/block_sparse.h"
#include "loom/ops/bsr.h"
#include "loom/ops/sparse24.h"
#include "loom/ops/sparsity.h"

namespace loom::ops {

namespace {

// The dtype a linear layer computes in on x's device: autocast's where it is on (which leaves
// fp64 alone), else x's.
at::ScalarType compute_dtype(const at::Tensor& x) {
  const auto device = x.device().type();
  if (at::autocast::is_autocast_enabled(device) && at::isFloatingType(x.scalar_type()) &&
      x.scalar_type() != at::kDouble)
    return at::autocast::get_autocast_dtype(device);
  return x.scalar_type();
}

// Tiles of `block` x `block` that hold a nonzero: bool [out / B, in / B].
at::Tensor kept_tiles(const at::Tensor& weight, int64_t block) {
  const int64_t out = weight.size(0), in = weight.size(1);
  return weight.detach().ne(0).reshape({out / block, block, in / block, block}).any(3).any(1);
}

// The operands in the compute dtype, saved for backward with the dtypes the gradients go back to.
std::pair<at::Tensor, at::Tensor> save_operands(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& weight,
                                                at::ScalarType dtype) {
  auto xc = x.to(dtype), wc = weight.to(dtype);
  ctx->save_for_backward({xc, wc});
  ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
  ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
  return {xc, wc};
}

at::ScalarType saved_dtype(torch::autograd::AutogradContext* ctx, const char* name) {
  return static_cast<at::ScalarType>(ctx->saved_data[name].toInt());
}

// The weight gradient dy^T x over every token.
at::Tensor weight_grad(const at::Tensor& gy, const at::Tensor& xc) {
  return at::matmul(gy.reshape({-1, gy.size(-1)}).t(), xc.reshape({-1, xc.size(-1)}));
}

// Forward on the 2:4 kernel; backward by dense products in the compute dtype.
struct TwoFourLinear : torch::autograd::Function<TwoFourLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, at::ScalarType dtype, bool transposable) {
    const auto [xc, wc] = save_operands(ctx, x, weight, dtype);
    ctx->saved_data["transposable"] = transposable;
    // The prune strategy's masks are 2:4 (checked when it sets the format): no readback.
    return sparse24_linear(xc, sparse24_compress(wc, /*verify=*/false));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xc = saved[0];
    const auto& wc = saved[1];
    const auto gy = grads[0].to(wc.scalar_type());
    // dy W = dy (W^T)^T: the kernel on W^T when that is 2:4 too and its shape fits the kernel.
    const bool sparse_dx =
        ctx->saved_data["transposable"].toBool() && wc.size(1) % 16 == 0 && wc.size(0) % 32 == 0;
    const auto gx =
        (sparse_dx ? sparse24_linear(gy.contiguous(), sparse24_compress(wc.t().contiguous(), false))
                   : at::matmul(gy, wc))
            .to(saved_dtype(ctx, "x_dtype"));
    const auto gw = weight_grad(gy, xc).to(saved_dtype(ctx, "w_dtype"));
    return {gx, gw, at::Tensor(), at::Tensor()};
  }
};

// Forward and input gradient on the block-sparse kernel (W's tiles, then W^T's); the weight
// gradient dense, masked to the kept tiles (a dropped tile gets none, as on the CPU path).
struct BlockCudaLinear : torch::autograd::Function<BlockCudaLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, at::ScalarType dtype, int64_t block) {
    const auto [xc, wc] = save_operands(ctx, x, weight, dtype);
    ctx->saved_data["block"] = block;
    // The kept tiles of the weight itself (a tile rounded to zero in the compute dtype still gets
    // its gradient).
    ctx->saved_data["tiles"] = kept_tiles(weight, block);
    return bsr_linear(xc, bsr_compress(wc, block));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xc = saved[0];
    const auto& wc = saved[1];
    const int64_t block = ctx->saved_data["block"].toInt();
    const auto gy = grads[0].to(wc.scalar_type()).contiguous();
    const auto gx =
        bsr_linear(gy, bsr_compress(wc.t().contiguous(), block)).to(saved_dtype(ctx, "x_dtype"));
    const auto mask = expand_block_mask(ctx->saved_data["tiles"].toTensor(), block);
    const auto gw = (weight_grad(gy, xc) * mask).to(saved_dtype(ctx, "w_dtype"));
    return {gx, gw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

SparseLinearChoice choose_sparse_linear(const at::Tensor& x, const at::Tensor& weight,
                                        const SparseLinearFormat& format) {
  using Kind = SparseLinearFormat::Kind;
  auto dense = [](std::string why) {
    return SparseLinearChoice{SparseLinearPath::kMaskedDense, std::move(why)};
  };
  switch (format.kind) {
    case Kind::kDense:
      return {};
    case Kind::kTwoFour: {
      if (!x.is_cuda())
        return dense(
            fmt::format("the 2:4 kernel runs on CUDA; the input is on {}", x.device().str()));
      const auto dtype = compute_dtype(x);
      if (dtype != at::kBFloat16 && dtype != at::kHalf)
        return dense(fmt::format("the 2:4 kernel takes bf16 or fp16; this layer computes in {}",
                                 c10::toString(dtype)));
      // What the kernel asks of the shapes and the device, on a stand-in of the compressed weight.
      Sparse24Weight shape;
      shape.out_features = weight.size(0);
      shape.in_features = weight.size(1);
      shape.values = at::empty({0}, x.options().dtype(dtype));
      if (auto why =
              sparse24_unsupported(at::empty({0, weight.size(1)}, shape.values.options()), shape))
        return dense(*why);
      return {SparseLinearPath::kTwoFourCuda, ""};
    }
    case Kind::kBlock: {
      if (x.is_cuda()) {
        const auto dtype = compute_dtype(x);
        if (format.block != 32 && format.block != 64)
          return dense(
              fmt::format("the block-sparse CUDA kernel takes 32 x 32 or 64 x 64 tiles, "
                          "not {} x {}",
                          format.block, format.block));
        if (dtype != at::kBFloat16 && dtype != at::kHalf)
          return dense(
              fmt::format("the block-sparse CUDA kernel takes bf16 or fp16; this layer "
                          "computes in {}",
                          c10::toString(dtype)));
        BsrWeight shape{weight.size(0), weight.size(1), format.block, {}, {}, {}};
        shape.values = at::empty({0}, x.options().dtype(dtype));
        shape.row_start = shape.tile_col = at::empty({0}, x.options().dtype(at::kInt));
        if (auto why =
                bsr_unsupported(at::empty({0, weight.size(1)}, shape.values.options()), shape))
          return dense(*why);
      } else if (!x.is_cpu()) {
        return dense(fmt::format("no block-sparse kernel on {}", x.device().str()));
      } else if (format.block < kBlockSparseMinCpuBlock) {
        return dense(fmt::format("{} x {} tiles: the block-sparse CPU product is measured to pay "
                                 "from {} x {} tiles",
                                 format.block, format.block, kBlockSparseMinCpuBlock,
                                 kBlockSparseMinCpuBlock));
      }
      // The setter's figure where it gave one (no device sync per call), else measured here.
      const double dropped =
          format.tile_sparsity >= 0
              ? format.tile_sparsity
              : 1.0 - kept_tiles(weight, format.block).to(at::kDouble).mean().item<double>();
      if (dropped < kBlockSparseMinTileSparsity)
        return dense(fmt::format("{:.0f}% of the {}x{} tiles are dropped, below the {:.0f}% from "
                                 "which the block-sparse product is used",
                                 100 * dropped, format.block, format.block,
                                 100 * kBlockSparseMinTileSparsity));
      return {x.is_cuda() ? SparseLinearPath::kBlockCuda : SparseLinearPath::kBlockCpu, ""};
    }
  }
  return {};
}

at::Tensor sparse_linear(const at::Tensor& x, const at::Tensor& weight,
                         const SparseLinearFormat& format, const SparseLinearChoice& choice) {
  switch (choice.path) {
    case SparseLinearPath::kDense:
    case SparseLinearPath::kMaskedDense:
      return at::linear(x, weight);
    case SparseLinearPath::kTwoFourCuda:
      return TwoFourLinear::apply(x, weight, compute_dtype(x), format.transposable);
    case SparseLinearPath::kBlockCpu: {
      // In the compute dtype, as at::linear under autocast (the casts carry the gradients back).
      const auto dtype = compute_dtype(x);
      return block_sparse_linear(x.to(dtype), weight.to(dtype), kept_tiles(weight, format.block),
                                 format.block);
    }
    case SparseLinearPath::kBlockCuda:
      return BlockCudaLinear::apply(x, weight, compute_dtype(x), format.block);
  }
  return at::linear(x, weight);
}

std::string describe(const SparseLinearChoice& choice) {
  switch (choice.path) {
    case SparseLinearPath::kDense:
      return "dense product";
    case SparseLinearPath::kMaskedDense:
      return "masked dense product (" + choice.reason + ")";
    case SparseLinearPath::kTwoFourCuda:
      return "2:4 sparse tensor cores (loom's mma.sp kernel)";
    case SparseLinearPath::kBlockCpu:
      return "block-sparse CPU product (kept tiles only, forward and backward)";
    case SparseLinearPath::kBlockCuda:
      return "block-sparse tensor cores (loom's BSR kernel: forward and input gradient)";
  }
  return "?";
}

}  // namespace loom::ops
