// The fused SwiGLU (ops/swiglu.h): its host reference in fp64 against ATen's silu and product
// (value and both gradients, within a bound from the roundings), bf16 under autocast, the choice
// and refusals by name, and on a GPU the kernels against the host reference. Whole models with
// the fused SwiGLU on are in test_norm.cpp (FusedModel) and the tp test (TpLayers).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "loom/core/autocast.h"
#include "loom/ops/cuda.h"
#include "loom/ops/swiglu.h"
#include "test_util.h"

namespace {

namespace ops = loom::ops;
using loom::testing::contains;
using loom::testing::error_of;

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed, double scale) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kDouble) * scale;
}

struct SwigluRun {
  at::Tensor out, grad_gate, grad_up;
};

SwigluRun run(bool fused, const at::Tensor& gate0, const at::Tensor& up0, const at::Tensor& grad) {
  auto gate = gate0.clone().requires_grad_(), up = up0.clone().requires_grad_();
  auto out = fused ? ops::fused_swiglu(gate, up) : ops::math_swiglu(gate, up);
  out.backward(grad);
  return {out.detach(), gate.grad(), up.grad()};
}

// fp64, both sides the same formulas, each at most 8 roundings (and an exp within a few ulp) of
// values bounded by |dh u| (1 + |g|) for grad_gate (s <= 1, |1 + g (1 - s)| <= 1 + |g|), by
// |g u| for the output and |dh g| for grad_up: the two within 2 * 8 * 2^-53 of those bounds,
// times 4 for the exp's ulps. Inputs reach both saturations (|g| up to 40) and zeros.
TEST(FusedSwiglu, HostReferenceEqualsAtenMathInFp64) {
  auto gate = randn({67, 45}, 1, 3.0), up = randn({67, 45}, 2, 1.0), grad = randn({67, 45}, 3, 0.5);
  gate.view({-1}).slice(0, 0, 40, 7).fill_(40.0);
  gate.view({-1}).slice(0, 3, 40, 7).fill_(-40.0);
  gate.view({-1}).slice(0, 5, 40, 7).zero_();
  const SwigluRun fused = run(true, gate, up, grad), math = run(false, gate, up, grad);
  const double eps = 64 * std::numeric_limits<double>::epsilon();
  const auto g = gate.abs(), u = up.abs(), dh = grad.abs();
  const struct {
    const char* name;
    at::Tensor got, want, scale;
  } checks[] = {{"out", fused.out, math.out, g * u},
                {"grad_up", fused.grad_up, math.grad_up, dh * g},
                {"grad_gate", fused.grad_gate, math.grad_gate, dh * u * (1 + g)}};
  for (const auto& c : checks) {
    const double worst = ((c.got - c.want).abs() / (eps * c.scale + 1e-300)).max().item<double>();
    std::printf("swiglu fp64 %s: max |fused - math| / bound = %.3f\n", c.name, worst);
    EXPECT_LE(worst, 1.0) << c.name;
    EXPECT_GT(c.want.abs().max().item<double>(), 0.1) << c.name;  // not a comparison of zeros
  }
  // The fused op is a node of its own in the graph (not the math path under another name).
  auto gt = gate.clone().requires_grad_();
  EXPECT_NE(ops::fused_swiglu(gt, up).grad_fn()->name().find("FusedSwiglu"), std::string::npos);
}

// bf16 inputs (what the projections give under bf16 autocast): the fused op keeps bf16 (one
// rounding of an fp32 result) and its gradients come back in bf16, within a bf16 rounding or two
// of fp64.
TEST(FusedSwiglu, Bf16InputsGiveBf16OutputsNearFp64) {
  const auto gate = randn({33, 64}, 4, 2.0).to(at::kBFloat16);
  const auto up = randn({33, 64}, 5, 1.0).to(at::kBFloat16);
  const auto grad = randn({33, 64}, 6, 1.0).to(at::kBFloat16);
  const SwigluRun fused = run(true, gate, up, grad);
  const SwigluRun exact =
      run(false, gate.to(at::kDouble), up.to(at::kDouble), grad.to(at::kDouble));
  EXPECT_EQ(fused.out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(fused.grad_gate.scalar_type(), at::kBFloat16);
  // fp32 arithmetic (within 40 u of the scale, u = 2^-24) and one bf16 rounding (2^-8 of the
  // value): 2^-7 of the scale covers both.
  const auto g = gate.to(at::kDouble).abs(), u = up.to(at::kDouble).abs();
  const auto dh = grad.to(at::kDouble).abs();
  const at::Tensor got[] = {fused.out, fused.grad_up, fused.grad_gate};
  const at::Tensor want[] = {exact.out, exact.grad_up, exact.grad_gate};
  const at::Tensor scale[] = {g * u, dh * g, dh * u * (1 + g)};
  for (int i = 0; i < 3; ++i)
    EXPECT_LE(((got[i].to(at::kDouble) - want[i]).abs() / (0x1p-7 * scale[i] + 1e-30))
                  .max()
                  .item<double>(),
              1.0)
        << i;
}

TEST(FusedSwiglu, TheBackendChoosesAndRefusalsNameTheProblem) {
  const auto a = at::ones({4, 8}), b = at::ones({4, 8});
  EXPECT_FALSE(ops::uses_fused_swiglu(ops::ActivationBackend::kAuto, a, b));  // the CPU: math
  EXPECT_FALSE(ops::uses_fused_swiglu(ops::ActivationBackend::kMath, a, b));
  EXPECT_TRUE(ops::uses_fused_swiglu(ops::ActivationBackend::kFused, a, b));
  auto msg = error_of(
      [&] { ops::uses_fused_swiglu(ops::ActivationBackend::kFused, a, b.to(at::kDouble)); });
  EXPECT_TRUE(contains(msg, "--swiglu fused: gate and up must share a dtype")) << msg;
  msg = error_of([&] { ops::fused_swiglu(a, at::ones({4, 9})); });
  EXPECT_TRUE(contains(msg, "must have one shape")) << msg;
  msg = error_of([&] { ops::fused_swiglu(a.to(at::kInt), b.to(at::kInt)); });
  EXPECT_TRUE(contains(msg, "fp32, fp16 or bf16 (fp64 on the CPU) only")) << msg;
  EXPECT_EQ(ops::parse_activation_backend("fused"), ops::ActivationBackend::kFused);
  msg = error_of([] { ops::parse_activation_backend("geglu"); });
  EXPECT_TRUE(contains(msg, "geglu")) << msg;
  // Empty inputs pass through.
  EXPECT_EQ(ops::fused_swiglu(at::ones({0, 8}), at::ones({0, 8})).numel(), 0);
  // Non-contiguous inputs (a transposed view) are taken as their contiguous copies.
  const auto gate = randn({8, 5}, 7, 1.0), up = randn({8, 5}, 8, 1.0);
  EXPECT_TRUE(at::allclose(ops::fused_swiglu(gate.t(), up.t()), ops::math_swiglu(gate.t(), up.t()),
                           1e-14, 1e-14));
}

// On a GPU the kernels compute the host reference's formulas in the same order; only expf
// differs (within 2 ulp on the device, against the host's): the fp32 results within a few fp32
// ulps, so a bf16 or fp16 output within one rounding step of the host's.
TEST(FusedSwigluGpu, KernelsMatchTheHostReference) {
  if (!ops::built_with_cuda()) GTEST_SKIP() << "built without LOOM_WITH_CUDA";
  if (ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  for (const auto io : {at::kBFloat16, at::kHalf, at::kFloat})
    for (const int64_t n : {int64_t{4096 * 8}, int64_t{1003}}) {
      const auto gate = randn({n}, 11, 3.0).to(io), up = randn({n}, 12, 1.0).to(io);
      const auto grad = randn({n}, 13, 1.0).to(io);
      const SwigluRun cpu = run(true, gate, up, grad);
      const SwigluRun gpu = run(true, gate.cuda(), up.cuda(), grad.cuda());
      const double step = io == at::kBFloat16 ? 0x1p-7 : io == at::kHalf ? 0x1p-10 : 0x1p-20;
      const at::Tensor a[] = {cpu.out, cpu.grad_gate, cpu.grad_up};
      const at::Tensor b[] = {gpu.out, gpu.grad_gate, gpu.grad_up};
      for (int i = 0; i < 3; ++i) {
        const auto x = a[i].to(at::kDouble), y = b[i].cpu().to(at::kDouble);
        const double worst =
            ((x - y).abs() / (step * at::maximum(x.abs(), y.abs()) + 1e-30)).max().item<double>();
        EXPECT_LE(worst, 1.0) << c10::toString(io) << " n " << n << " output " << i;
      }
    }
}

}  // namespace
