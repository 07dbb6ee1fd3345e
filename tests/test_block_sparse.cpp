// The block-sparse linear product on the CPU (ops/block_sparse.h): forward, input gradient and
// weight gradient equal the dense masked product's, in fp64, fp32 and bf16, and bad shapes are
// named.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "loom/ops/block_sparse.h"
#include "loom/ops/sparsity.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
namespace ops = loom::ops;

// --- The block-sparse product on the CPU -----------------------------------------------------

namespace {

// A random tile mask keeping `keep` of the tiles (at least one dropped tile row and column when
// keep < 1, so the empty-panel paths run).
at::Tensor random_tiles(int64_t rows, int64_t cols, double keep, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto mask = at::rand({rows, cols}, gen) < keep;
  if (keep < 1) {
    mask[0].fill_(false);
    mask.select(1, cols - 1).fill_(false);
  }
  return mask;
}

}  // namespace

// The product, the input gradient and the weight gradient equal the dense masked product's. In
// fp64 to 1e-12 relative (the same sums in another order); in fp32 within the rounding bound of
// a K-term dot product, 2 K u sum |x| |w| per element (u = 2^-24), computed from the data.
TEST(BlockSparseLinear, EqualsTheDenseMaskedProductForwardAndBackward) {
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    for (const int64_t block : {4, 16}) {
      SCOPED_TRACE(fmt::format("{} block {}", c10::toString(dtype), block));
      const int64_t out = 8 * block, in = 6 * block;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
      const auto tiles = random_tiles(out / block, in / block, 0.4, 3);
      const auto mask = ops::expand_block_mask(tiles, block).to(dtype);
      const auto w0 = at::randn({out, in}, gen).to(dtype);
      const auto x0 = at::randn({3, 5, in}, gen).to(dtype);
      const auto dy = at::randn({3, 5, out}, gen).to(dtype);
      auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
      const auto y = ops::block_sparse_linear(x, w, tiles, block);
      y.backward(dy);
      auto xr = x0.clone().requires_grad_(), wr = w0.clone().requires_grad_();
      const auto yr = at::linear(xr, wr * mask);
      yr.backward(dy);
      ASSERT_EQ(y.sizes(), yr.sizes());
      const auto check = [&](const at::Tensor& got, const at::Tensor& want,
                             const at::Tensor& bound64, const char* what) {
        if (dtype == at::kDouble) {
          EXPECT_LE(((got - want).abs().max() / want.abs().max()).item<double>(), 1e-12) << what;
        } else {
          EXPECT_TRUE(at::all((got - want).abs().to(at::kDouble) <= bound64).item<bool>()) << what;
        }
      };
      const double u = 1.0 / (1 << 24);
      const auto ax = x0.abs().to(at::kDouble), aw = (w0 * mask).abs().to(at::kDouble);
      const auto ady = dy.abs().to(at::kDouble);
      check(y, yr, 2 * in * u * at::linear(ax, aw) + 1e-30, "y");
      check(x.grad(), xr.grad(), 2 * out * u * at::matmul(ady, aw) + 1e-30, "dx");
      const auto n = static_cast<double>(x0.numel() / in);
      check(w.grad(), wr.grad(),
            2 * n * u * at::matmul(ady.reshape({-1, out}).t(), ax.reshape({-1, in})) + 1e-30, "dw");
      // No gradient reaches a dropped tile.
      EXPECT_EQ((w.grad() * (1 - mask)).abs().max().item<double>(), 0.0);
    }
  }
  // bf16 (the CPU path under --precision bf16 autocast, where the BLAS may be oneDNN's): each
  // result within one bf16 rounding of the exact product of the same bf16 inputs, 2^-8 |exact|,
  // plus an fp32 accumulation's 2 K u sum |a| |b|.
  {
    const int64_t block = 32, out = 4 * block, in = 3 * block;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    const auto tiles16 = random_tiles(out / block, in / block, 0.6, 9);
    const auto mask = ops::expand_block_mask(tiles16, block).to(at::kDouble);
    const auto w0 = at::randn({out, in}, gen).to(at::kBFloat16);
    const auto x0 = at::randn({7, in}, gen).to(at::kBFloat16);
    const auto dy = at::randn({7, out}, gen).to(at::kBFloat16);
    auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    const auto y = ops::block_sparse_linear(x, w, tiles16, block);
    y.backward(dy);
    const auto x64 = x0.to(at::kDouble), w64 = w0.to(at::kDouble) * mask, dy64 = dy.to(at::kDouble);
    const double u = 1.0 / (1 << 24), u16 = 1.0 / (1 << 8);
    const auto within = [&](const at::Tensor& got, const at::Tensor& exact, const at::Tensor& abs,
                            int64_t k, const char* what) {
      const auto bound = u16 * exact.abs() + 2.0 * static_cast<double>(k) * u * abs + 1e-30;
      EXPECT_TRUE(at::all((got.to(at::kDouble) - exact).abs() <= bound).item<bool>()) << what;
    };
    within(y, at::linear(x64, w64), at::linear(x64.abs(), w64.abs()), in, "bf16 y");
    within(x.grad(), dy64.mm(w64), dy64.abs().mm(w64.abs()), out, "bf16 dx");
    within(w.grad(), dy64.t().mm(x64) * mask, dy64.abs().t().mm(x64.abs()), 7, "bf16 dw");
  }
  // The compressed weight holds exactly the kept tiles.
  const auto tiles = random_tiles(4, 5, 0.5, 7);
  const auto w = at::randn({16, 20}, at::kDouble);
  const auto bsw = ops::BlockSparseWeight::compress(w, tiles, 4);
  EXPECT_EQ(bsw.kept_tiles(), tiles.sum().item<int64_t>());
  EXPECT_TRUE(at::equal(bsw.to_dense(), w * ops::expand_block_mask(tiles, 4).to(at::kDouble)));
  // Nothing kept: zeros, and zero gradients.
  auto x = at::randn({2, 20}, at::kDouble).requires_grad_();
  const auto none = ops::block_sparse_linear(x, w, at::zeros({4, 5}, at::kBool), 4);
  EXPECT_EQ(none.abs().max().item<double>(), 0.0);
  EXPECT_TRUE(contains(error_of([&] { ops::block_sparse_linear(x, w, tiles, 3); }),
                       "3 x 3 tiles do not tile a weight of shape [16, 20]"));
  EXPECT_TRUE(
      contains(error_of([&] {
                 ops::block_sparse_linear(x, w, at::ones({5, 4}, at::kBool), 4);
               }),
               "the tile mask is [5, 4], and a [16, 20] weight in 4 x 4 tiles needs [4, 5]"));
  EXPECT_TRUE(contains(error_of([&] {
                         ops::block_sparse_linear(at::randn({2, 16}, at::kDouble), w, tiles, 4);
                       }),
                       "input [2, 16] does not end in the weight's 20 input features"));
}
