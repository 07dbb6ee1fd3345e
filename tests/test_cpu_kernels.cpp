// loom's vectorised CPU kernels (src/ops/activation.cpp; AdamW's: test_adamw.cpp) against fp64 runs
// of the same formulas, with bounds from a rounding-error estimate (stated at each test), and the
// properties the parallel layouts rely on: the same bits for an element whatever its offset in
// the buffer (so a shard equals the whole) and whatever the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "loom/core/rng.h"
#include "loom/ops/activation.h"
#include "loom/ops/precision.h"
#include "test_util.h"

namespace {

using namespace loom;

constexpr double kEps32 = std::numeric_limits<float>::epsilon();  // 2^-23
constexpr double kK0 = 0.79788456080286535588, kK1 = 0.044715;

// Inputs that reach every branch: typical activations, both saturations, the clamp at |x| = 30,
// the fp32 exponent range, zeros and tiny values; an odd count, so the vector loops have tails.
at::Tensor gelu_inputs() {
  auto gen = core::make_generator(7);
  auto x = at::randn({100001}, gen, at::kFloat) * 3.0;
  const auto specials =
      at::tensor({0.0f,   -0.0f, 1e-30f, -1e-30f, 1e-6f,   0.5f,   -0.5f, 2.0f,   -2.0f,
                  5.0f,   -5.0f, 9.0f,   -9.0f,   12.0f,   -12.0f, 29.9f, -29.9f, 30.0f,
                  -30.0f, 31.0f, -31.0f, 100.0f,  -100.0f, 1e30f,  -1e30f});
  return at::cat({x, specials});
}

// |fp32 result - exact| for gelu and its derivative, element by element. Rounding analysis of
// the kernel (each op rounds once, |f| <= 0.5 in the exp polynomial, t = -2 log2(e) u):
//   u carries <= 5 eps relative error, so t <= 6 eps |t|; e = 2^t then <= (4.2 |t| + 2) eps
//   relative (ln 2 * 6 eps |t|, plus polynomial and scaling); s = 1 / (1 + e) moves by
//   s (1 - s) times e's relative error, plus 2 eps s from its own add and divide;
//   y = x s adds eps |y|, the fp32 store another half.
// Where t >= 126 the kernel takes s = 0 (the exact s is below 2^-126, or 2^-125 allowing for t's
// own rounding), which the bound adds: 2^-125 times |x| (y) or 1 + |x du| (the derivative).
struct GeluBounds {
  at::Tensor y, dy;  // per element
};
GeluBounds gelu_bounds(const at::Tensor& x64) {
  const auto u = kK0 * (x64 + kK1 * x64.pow(3));
  const auto t = (-2.0 / std::log(2.0)) * u;
  const auto s = at::sigmoid(2 * u);
  const auto ds = (s * (1 - s) * (4.2 * t.abs() + 2) + 2 * s) * kEps32 + std::ldexp(1.0, -125);
  const auto y = x64 * s;
  const auto xdu = x64 * 2 * kK0 * (1 + 3 * kK1 * x64 * x64);
  const auto d = s + xdu * s * (1 - s);
  GeluBounds b;
  b.y = x64.abs() * ds + 1.5 * kEps32 * y.abs() + 1e-37;
  // d = s + (x du) s (1 - s): s's error enters directly and through s (1 - s) (times |x du|),
  // the products and sum round 5 times more, the fp32 store half an eps.
  b.dy = ds * (1 + xdu.abs()) + kEps32 * (5 * (xdu * s * (1 - s)).abs() + 1.5 * d.abs()) + 1e-37;
  return b;
}

// The exact values: gelu = x sigmoid(2u) and its derivative in fp64. Not at::gelu(x, "tanh") in
// fp64: it computes 1 + tanh(u), which cancels to 0 for x below about -6 (gelu(-9) = -1.3e-28
// comes out as -0), while the sigmoid form keeps every digit.
struct GeluExact {
  at::Tensor y, d;
};
GeluExact gelu_exact(const at::Tensor& x64) {
  const auto u = kK0 * (x64 + kK1 * x64.pow(3));
  const auto s = at::sigmoid(2 * u);
  return {x64 * s, s + x64 * 2 * kK0 * (1 + 3 * kK1 * x64 * x64) * s * (1 - s)};
}

TEST(GeluTanh, ForwardWithinTheRoundingBoundOfFp64) {
  const auto x = gelu_inputs();
  ASSERT_TRUE(ops::gelu_tanh_uses_loom_kernel(x));
  const auto y = ops::gelu_tanh(x).to(at::kDouble);
  const auto x64 = x.to(at::kDouble);
  const auto err = (y - gelu_exact(x64).y).abs();
  const double worst = (err / gelu_bounds(x64).y).max().item<double>();
  const int64_t at_worst = (err / gelu_bounds(x64).y).argmax().item<int64_t>();
  std::printf("gelu forward: max |err| / bound = %.3f (max |err| %.3g; worst at x = %.9g)\n", worst,
              err.max().item<double>(), x64[at_worst].item<double>());
  EXPECT_LE(worst, 1.0);
  EXPECT_TRUE(at::equal(y.masked_select(x > 30), x64.masked_select(x > 30)));
  EXPECT_EQ(y.masked_select(x < -30).abs().max().item<double>(), 0.0);
}

TEST(GeluTanh, BackwardWithinTheRoundingBoundOfFp64) {
  const auto x = gelu_inputs().requires_grad_();
  auto gen = core::make_generator(8);
  const auto g = at::randn(x.sizes(), gen, at::kFloat);
  ops::gelu_tanh(x).backward(g);
  const auto grad = x.grad().to(at::kDouble);
  const auto x64 = x.detach().to(at::kDouble), g64 = g.to(at::kDouble);
  const auto exact = g64 * gelu_exact(x64).d;
  const auto err = (grad - exact).abs();
  // grad = g d: g's magnitude times d's bound, plus the product's rounding.
  const auto bound = g64.abs() * gelu_bounds(x64).dy + kEps32 * exact.abs();
  const double worst = (err / bound).max().item<double>();
  const int64_t at_worst = (err / bound).argmax().item<int64_t>();
  std::printf("gelu backward: max |err| / bound = %.3f (max |err| %.3g; worst at x = %.9g)\n",
              worst, err.max().item<double>(), x64[at_worst].item<double>());
  EXPECT_LE(worst, 1.0);
}

TEST(GeluTanh, Fp64KernelMatchesAtenToFp64Precision) {
  const auto x = gelu_inputs().to(at::kDouble).masked_select(gelu_inputs().abs() < 1e12);
  const auto exact = gelu_exact(x);
  const auto xr = x.clone().requires_grad_();
  ASSERT_TRUE(ops::gelu_tanh_uses_loom_kernel(x));
  const auto y = ops::gelu_tanh(xr);
  y.backward(at::ones_like(y));
  // The fp32 analysis with eps = 2^-52 (and the clamp at 2^-1022): ~1e-13 at |x| = 30.
  const double tol = 64 * std::numeric_limits<double>::epsilon();
  EXPECT_LE(((y.detach() - exact.y).abs() / (x.abs() + 1)).max().item<double>(), tol);
  // d's error carries |x du| (up to ~5 |x|^3 / 30 at the clamp): 40 |x| covers it to |x| = 30.
  EXPECT_LE(((xr.grad() - exact.d).abs() / (40 * x.abs() + 1)).max().item<double>(), tol);
}

TEST(GeluTanh, OtherTensorsFallBackToAtenExactly) {
  auto gen = core::make_generator(9);
  const auto x = at::randn({64, 33}, gen, at::kFloat);
  const auto strided = x.t();  // not contiguous
  EXPECT_FALSE(ops::gelu_tanh_uses_loom_kernel(strided));
  EXPECT_TRUE(at::equal(ops::gelu_tanh(strided), at::gelu(strided, "tanh")));
  const auto bf16 = x.to(at::kBFloat16);
  EXPECT_FALSE(ops::gelu_tanh_uses_loom_kernel(bf16));
  EXPECT_TRUE(at::equal(ops::gelu_tanh(bf16), at::gelu(bf16, "tanh")));
}

TEST(GeluTanh, TwiceDifferentiableThroughAtensFormula) {
  const auto x = at::linspace(-4, 4, 41, at::kDouble).requires_grad_();
  const auto x_ref = x.detach().clone().requires_grad_();
  const auto first = torch::autograd::grad({ops::gelu_tanh(x).sum()}, {x}, {}, true, true)[0];
  const auto first_ref =
      torch::autograd::grad({at::gelu(x_ref, "tanh").sum()}, {x_ref}, {}, true, true)[0];
  const auto second = torch::autograd::grad({first.sum()}, {x})[0];
  const auto second_ref = torch::autograd::grad({first_ref.sum()}, {x_ref})[0];
  EXPECT_TRUE(at::allclose(second, second_ref, 1e-12, 1e-12));
}

// Same bits for an element wherever it sits in the buffer (vector body or scalar tail, start or
// end of a thread's chunk) and whatever the thread count: sharded layouts equal one process.
TEST(GeluTanh, ElementsGetTheSameBitsAtAnyOffsetAndThreadCount) {
  const auto x = gelu_inputs().requires_grad_();
  const auto y = ops::gelu_tanh(x);
  y.backward(at::ones_like(y));
  for (int64_t offset : {1, 3, 7, 13}) {
    const auto part = x.detach().narrow(0, offset, x.size(0) - offset).contiguous();
    EXPECT_TRUE(at::equal(ops::gelu_tanh(part), y.detach().narrow(0, offset, part.size(0))))
        << offset;
  }
  const int threads = at::get_num_threads();
  at::set_num_threads(threads == 1 ? 2 : 1);
  const auto x2 = x.detach().clone().requires_grad_();
  const auto y2 = ops::gelu_tanh(x2);
  y2.backward(at::ones_like(y2));
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(y2, y));
  EXPECT_TRUE(at::equal(x2.grad(), x.grad()));
}

// gelu(h + b): against the fp64 formulas at the fp32-rounded h + b (one correctly rounded add, as
// ATen's), with the bounds above; the bias gradient (ATen's fp32 column sum of the input's
// gradient) within the sum of its terms' bounds plus the sum's own rounding (rows x eps each).
TEST(BiasGeluTanh, ForwardAndBothGradientsWithinTheRoundingBoundOfFp64) {
  auto gen = core::make_generator(21);
  const int64_t rows = 517, features = 300;  // odd sizes: tails in rows and columns
  const auto h = (at::randn({rows, features}, gen, at::kFloat) * 3).requires_grad_();
  const auto b = at::randn({features}, gen, at::kFloat).requires_grad_();
  const auto g = at::randn({rows, features}, gen, at::kFloat);
  const auto y = ops::bias_gelu_tanh(h, b);
  y.backward(g);
  const auto pre64 = (h.detach() + b.detach()).to(at::kDouble);
  const auto exact = gelu_exact(pre64);
  const auto bounds = gelu_bounds(pre64);
  const auto g64 = g.to(at::kDouble);
  const double y_used =
      ((y.detach().to(at::kDouble) - exact.y).abs() / bounds.y).max().item<double>();
  const auto dh_exact = g64 * exact.d;
  const auto dh_bound = g64.abs() * bounds.dy + kEps32 * dh_exact.abs();
  const double dh_used =
      ((h.grad().to(at::kDouble) - dh_exact).abs() / dh_bound).max().item<double>();
  const auto db_bound = dh_bound.sum(0) + rows * kEps32 * dh_exact.abs().sum(0);
  const double db_used =
      ((b.grad().to(at::kDouble) - dh_exact.sum(0)).abs() / db_bound).max().item<double>();
  std::printf("bias_gelu: bound used: y %.3f, dh %.3f, db %.3f\n", y_used, dh_used, db_used);
  EXPECT_LE(y_used, 1.0);
  EXPECT_LE(dh_used, 1.0);
  EXPECT_LE(db_used, 1.0);
}

TEST(BiasGeluTanh, ThreadCountsGiveTheSameBitsAndOtherInputsFallBack) {
  auto gen = core::make_generator(22);
  auto run = [&](const at::Tensor& h0, const at::Tensor& b0) {
    const auto h = h0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    ops::bias_gelu_tanh(h, b).backward(at::ones_like(h0));
    return std::pair{h.grad(), b.grad()};
  };
  const auto h = at::randn({64, 8, 257}, gen, at::kFloat), b = at::randn({257}, gen, at::kFloat);
  const auto a = run(h, b);
  const int threads = at::get_num_threads();
  at::set_num_threads(threads == 1 ? 2 : 1);
  const auto c = run(h, b);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(a.first, c.first));
  EXPECT_TRUE(at::equal(a.second, c.second));
  // bf16 (autocast's dtype): ATen's formula, the bias cast to bf16 as at::linear would.
  const auto hb = h.to(at::kBFloat16);
  const auto yb = ops::bias_gelu_tanh(hb, b);
  EXPECT_EQ(yb.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(yb, at::gelu(hb + b.to(at::kBFloat16), "tanh")));
  try {
    ops::bias_gelu_tanh(h, at::randn({256}));
    ADD_FAILURE() << "a bias of the wrong size was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("last dimension"), std::string::npos) << e.what();
  }
}

TEST(BiasGeluTanh, TwiceDifferentiableInBothInputsAndEmptyFeaturesFallBack) {
  auto gen = core::make_generator(23);
  const auto h0 = at::randn({5, 7}, gen, at::kDouble), b0 = at::randn({7}, gen, at::kDouble);
  auto second = [&](bool loom_op) {
    const auto h = h0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    const auto y = loom_op ? ops::bias_gelu_tanh(h, b) : at::gelu(h + b, "tanh");
    const auto first = torch::autograd::grad({y.pow(2).sum()}, {h, b}, {}, true, true);
    return torch::autograd::grad({first[0].sum() + first[1].pow(2).sum()}, {h, b});
  };
  const auto mine = second(true), ref = second(false);
  EXPECT_TRUE(at::allclose(mine[0], ref[0], 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(mine[1], ref[1], 1e-12, 1e-12));
  const auto empty = ops::bias_gelu_tanh(at::zeros({4, 0}), at::zeros({0}));
  EXPECT_EQ(empty.sizes(), (std::vector<int64_t>{4, 0}));
}

// at::parallel_for is inline OpenMP code: loom's kernel sources must be built with OpenMP or
// every kernel runs on one thread (what the first version of these kernels did).
TEST(CpuKernels, UseEveryIntraOpThread) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const int used = ops::cpu_kernel_threads(64);
  at::set_num_threads(threads);
  EXPECT_EQ(used, 2);
}

// squared_norms: each tensor's sum of squares, in order, as float64. The per-tensor form is
// squared_norm's exactly; the multi-tensor form (taken on a GPU) squares ATen's norm: against the
// fp64 sum, a recursive fp32 sum of n squares is within n eps, and the norm's square root and
// squaring add 3 eps, so 2 (n + 3) eps relative bounds it whatever order the sum takes.
TEST(SquaredNorms, EachTensorsSumOfSquaresInOrder) {
  auto gen = core::make_generator(7);
  const std::vector<at::Tensor> tensors = {at::randn({1000}, gen, at::kFloat),
                                           at::randn({3, 17}, gen, at::kFloat).mul(100),
                                           at::randn({64, 64}, gen, at::kFloat).t(),
                                           at::randn({5}, gen, at::kDouble),
                                           at::zeros({0}, at::kFloat),
                                           at::randn({10}, gen, at::kFloat).to(at::kBFloat16)};
  const auto single = ops::squared_norms(tensors, false);
  const auto multi = ops::squared_norms(tensors, true);
  ASSERT_EQ(single.numel(), 6);
  ASSERT_EQ(multi.numel(), 6);
  EXPECT_EQ(single.scalar_type(), at::kDouble);
  EXPECT_EQ(multi.scalar_type(), at::kDouble);
  for (size_t i = 0; i < tensors.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(single[i].item<double>(), ops::squared_norm(tensors[i]).item<double>());
    const double exact = tensors[i].to(at::kDouble).pow(2).sum().item<double>();
    const double n = static_cast<double>(tensors[i].numel());
    const double eps = tensors[i].scalar_type() == at::kDouble ? 0x1p-53 : 0x1p-24;
    EXPECT_LE(std::abs(multi[i].item<double>() - exact), 2 * (n + 3) * eps * exact);
  }
  EXPECT_EQ(ops::squared_norms({}).numel(), 0);
  EXPECT_TRUE(at::equal(ops::squared_norms(tensors), single));  // CPU tensors: per tensor
}

}  // namespace
