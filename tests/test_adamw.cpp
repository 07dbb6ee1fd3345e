// AdamW's update (src/ops/adamw.cpp): loom's vectorised CPU pass and the ATen-op path against
// fp64 runs of the same formulas (bounds from a rounding-error estimate, stated at each test),
// the list form with the gradient factor inside, PyTorch's fused kernel (--adamw fused) against
// the math path, and the properties the parallel layouts rely on: the same bits for an element
// whatever its offset in the buffer and whatever the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>

#include "loom/core/rng.h"
#include "loom/ops/adamw.h"
#include "test_util.h"

namespace {

using namespace loom;

constexpr double kEps32 = std::numeric_limits<float>::epsilon();  // 2^-23

struct AdamState {
  at::Tensor w, g, m, v;
};

AdamState adam_state(int64_t n, uint64_t seed) {
  auto gen = core::make_generator(seed);
  AdamState s;
  s.w = at::randn({n}, gen, at::kFloat);
  s.g = at::randn({n}, gen, at::kFloat) * at::rand({n}, gen, at::kFloat).pow(4);
  s.m = at::randn({n}, gen, at::kFloat) * 0.1;
  s.v = at::rand({n}, gen, at::kFloat) * 0.01;
  s.v.narrow(0, 0, 5).zero_();  // the eps-dominated denominator
  s.g.narrow(0, 0, 3).zero_();
  return s;
}

// One step of adamw_update_ in fp32 against the same formulas in fp64 from the same state.
// Rounding: m = m0 + (1 - b1)(g - m0) <= 3 eps (|m0| + |g|); v (all terms >= 0) <= 3 eps v;
// sqrt(v / bias2) + eps <= 4 eps relative; the ratio m / denom adds 1 eps and the step size 1
// more; the weight's add rounds once: |dw| <= lr/bias1 * 3 eps (|m0| + |g|) / denom
// + eps (6 |step| + |w1|).
TEST(AdamWKernel, OneStepWithinTheRoundingBoundOfFp64) {
  const ops::AdamWOptions o{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0};
  const double lr = 3e-3;
  for (int64_t step : {1, 2, 10, 1000}) {
    auto s = adam_state(40009, static_cast<uint64_t>(step));
    const auto w64 = s.w.to(at::kDouble), g64 = s.g.to(at::kDouble);
    const auto m64 = s.m.to(at::kDouble), v64 = s.v.to(at::kDouble);
    const auto m0 = m64.abs(), g0 = g64.abs();
    ops::adamw_update_(s.w, s.g, s.m, s.v, lr, step, o);
    const double bias1 = 1 - std::pow(o.beta1, step), bias2 = 1 - std::pow(o.beta2, step);
    const auto m1 = m64 + (1 - o.beta1) * (g64 - m64);
    const auto v1 = o.beta2 * v64 + (1 - o.beta2) * g64 * g64;
    const auto denom = (v1 / bias2).sqrt() + o.eps;
    const auto update = -lr / bias1 * m1 / denom;
    const auto w1 = w64 + update;
    const auto bound =
        lr / bias1 * 3 * kEps32 * (m0 + g0) / denom + kEps32 * (6 * update.abs() + w1.abs());
    const double worst = ((s.w.to(at::kDouble) - w1).abs() / bound).max().item<double>();
    std::printf("adamw step %lld: max |err| / bound = %.3f\n", static_cast<long long>(step), worst);
    EXPECT_LE(worst, 1.0) << "step " << step;
    EXPECT_LE(
        ((s.m.to(at::kDouble) - m1).abs() / (3 * kEps32 * (m0 + g0) + 1e-45)).max().item<double>(),
        1.0);
    EXPECT_LE(((s.v.to(at::kDouble) - v1).abs() / (3 * kEps32 * v1 + 1e-45)).max().item<double>(),
              1.0);
  }
}

// Strided tensors (and CUDA ones) take the ATen-op path. Both paths over 5 steps, each against
// the fp64 run of the formulas: per step and element each may drift by eps |w| (the weight's
// add) plus 16 eps |update| (the one-step analysis above, with the moments' carried error).
TEST(AdamWKernel, BothPathsTrackFp64OverSeveralSteps) {
  const ops::AdamWOptions o{.beta1 = 0.8, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0};
  auto fused = adam_state(4096, 3), aten = adam_state(4096, 3);
  auto ref = adam_state(4096, 3);
  for (auto* t : {&ref.w, &ref.g, &ref.m, &ref.v}) *t = t->to(at::kDouble);
  auto as_strided = [](const at::Tensor& t) { return t.view({64, 64}).t(); };
  ASSERT_FALSE(as_strided(aten.w).is_contiguous());
  auto bound = at::zeros_like(ref.w);
  const double lr = 1e-2;
  for (int step = 1; step <= 5; ++step) {
    ops::adamw_update_(fused.w, fused.g, fused.m, fused.v, lr, step, o);
    ops::adamw_update_(as_strided(aten.w), as_strided(aten.g), as_strided(aten.m),
                       as_strided(aten.v), lr, step, o);
    const auto before = ref.w.clone();
    ref.m.lerp_(ref.g, 1 - o.beta1);
    ref.v.mul_(o.beta2).addcmul_(ref.g, ref.g, 1 - o.beta2);
    const double bias1 = 1 - std::pow(o.beta1, step), bias2 = 1 - std::pow(o.beta2, step);
    ref.w.add_(-lr / bias1 * ref.m / ((ref.v / bias2).sqrt() + o.eps));
    bound += kEps32 * (ref.w.abs() + 16 * (ref.w - before).abs());
  }
  for (const auto* path : {&fused, &aten}) {
    const double worst = ((path->w.to(at::kDouble) - ref.w).abs() / bound).max().item<double>();
    std::printf("adamw %s path, 5 steps: max |err| / bound = %.3f\n",
                path == &fused ? "fused" : "aten", worst);
    EXPECT_LE(worst, 1.0);
  }
}

// The list form equals adamw_update_ one tensor at a time, bit for bit on the CPU: contiguous
// tensors through the fused pass, strided ones (the path CUDA tensors take) through the
// multi-tensor ops grouped by dtype, each with its own decay flag, over steps before and after
// the variance freezes. A flag applied to the wrong tensor, a group mixing dtypes or a skipped
// step shows as a difference.
TEST(AdamWKernel, ManyTensorsAtOnceEqualOneAtATime) {
  const ops::AdamWOptions o{
      .beta1 = 0.8, .beta2 = 0.9, .eps = 1e-8, .weight_decay = 0.1, .freeze_variance_after = 2};
  struct Kind {
    at::ScalarType dtype;
    bool strided, decay;
  };
  const std::vector<Kind> kinds = {{at::kFloat, false, true},   {at::kFloat, true, true},
                                   {at::kFloat, true, false},   {at::kDouble, true, true},
                                   {at::kDouble, false, false}, {at::kFloat, false, false},
                                   {at::kDouble, true, false}};
  std::vector<AdamState> listed, single;
  for (size_t i = 0; i < kinds.size(); ++i) {
    auto s = adam_state(4096, 100 + i);
    for (auto* t : {&s.w, &s.g, &s.m, &s.v}) *t = t->to(kinds[i].dtype);
    listed.push_back(s);
    single.push_back({s.w.clone(), s.g.clone(), s.m.clone(), s.v.clone()});
  }
  const auto view = [](const at::Tensor& t, bool strided) {
    return strided ? t.view({64, 64}).t() : t;
  };
  for (int step = 1; step <= 4; ++step) {
    ops::AdamWTensors list;
    for (size_t i = 0; i < kinds.size(); ++i) {
      const bool strided = kinds[i].strided;
      list.weights.push_back(view(listed[i].w, strided));
      list.grads.push_back(view(listed[i].g, strided));
      list.exp_avgs.push_back(view(listed[i].m, strided));
      list.exp_avg_sqs.push_back(view(listed[i].v, strided));
      list.decay.push_back(kinds[i].decay);
      ops::adamw_update_(view(single[i].w, strided), view(single[i].g, strided),
                         view(single[i].m, strided), view(single[i].v, strided), 1e-2, step, o,
                         kinds[i].decay);
    }
    ops::adamw_update_(list, 1e-2, step, o);
  }
  for (size_t i = 0; i < kinds.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_TRUE(at::equal(listed[i].w, single[i].w));
    EXPECT_TRUE(at::equal(listed[i].m, single[i].m));
    EXPECT_TRUE(at::equal(listed[i].v, single[i].v));
    EXPECT_FALSE(at::equal(listed[i].w, adam_state(4096, 100 + i).w.to(kinds[i].dtype)));
  }
  ops::AdamWTensors bad;
  bad.weights = {at::zeros({2})};
  const auto msg = loom::testing::error_of([&] { ops::adamw_update_(bad, 1e-2, 1, o); });
  EXPECT_TRUE(loom::testing::contains(msg, "1 weights but 0 gradients")) << msg;
}

// freeze_variance_after = F (1-bit Adam's frozen variance): after step F the second moment keeps
// its step-F bits on both paths, the bias correction stays at F's, and the weights track the fp64
// run of those formulas within the bound of the test above. A variance still updated (or a bias
// correction still moving) would miss it by orders of magnitude: beta2 = 0.9 and gradients that
// grow tenfold after the freeze.
TEST(AdamWKernel, FrozenVarianceKeepsTheSecondMomentOfStepF) {
  const ops::AdamWOptions o{
      .beta1 = 0.8, .beta2 = 0.9, .eps = 1e-8, .weight_decay = 0, .freeze_variance_after = 3};
  auto fused = adam_state(4096, 8), aten = adam_state(4096, 8), ref = adam_state(4096, 8);
  for (auto* t : {&ref.w, &ref.g, &ref.m, &ref.v}) *t = t->to(at::kDouble);
  auto as_strided = [](const at::Tensor& t) { return t.view({64, 64}).t(); };
  auto bound = at::zeros_like(ref.w);
  at::Tensor fused_v_at_freeze, aten_v_at_freeze;  // the paths round v differently
  const double lr = 1e-2;
  for (int step = 1; step <= 8; ++step) {
    if (step == 4) {
      for (auto* s : {&fused, &aten}) s->g.mul_(10);
      ref.g.mul_(10);
    }
    ops::adamw_update_(fused.w, fused.g, fused.m, fused.v, lr, step, o);
    ops::adamw_update_(as_strided(aten.w), as_strided(aten.g), as_strided(aten.m),
                       as_strided(aten.v), lr, step, o);
    if (step == 3) {
      fused_v_at_freeze = fused.v.clone();
      aten_v_at_freeze = aten.v.clone();
    }
    const auto before = ref.w.clone();
    ref.m.lerp_(ref.g, 1 - o.beta1);
    if (step <= 3) ref.v.mul_(o.beta2).addcmul_(ref.g, ref.g, 1 - o.beta2);
    const double bias1 = 1 - std::pow(o.beta1, step);
    const double bias2 = 1 - std::pow(o.beta2, std::min(step, 3));
    ref.w.add_(-lr / bias1 * ref.m / ((ref.v / bias2).sqrt() + o.eps));
    bound += kEps32 * (ref.w.abs() + 16 * (ref.w - before).abs());
  }
  EXPECT_TRUE(at::equal(fused.v, fused_v_at_freeze));
  EXPECT_TRUE(at::equal(aten.v, aten_v_at_freeze));
  for (const auto* path : {&fused, &aten}) {
    const double worst = ((path->w.to(at::kDouble) - ref.w).abs() / bound).max().item<double>();
    std::printf("adamw frozen variance, %s path, 8 steps: max |err| / bound = %.3f\n",
                path == &fused ? "fused" : "aten", worst);
    EXPECT_LE(worst, 1.0);
  }
  EXPECT_TRUE(loom::testing::contains(
      loom::testing::error_of([] { ops::check_adamw_options({.freeze_variance_after = -2}); }),
      "freeze_variance_after = -2 must be >= 0"));
}

// ZeRO updates each rank's slice of a flat buffer: every element must come out as in the
// whole-buffer update, whatever the slice boundaries and thread count.
TEST(AdamWKernel, SlicesAndThreadCountsGiveTheSameBits) {
  const ops::AdamWOptions o{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0};
  auto whole = adam_state(50021, 5);
  auto pieces = adam_state(50021, 5);
  ops::adamw_update_(whole.w, whole.g, whole.m, whole.v, 1e-3, 7, o);
  const int threads = at::get_num_threads();
  at::set_num_threads(threads == 1 ? 2 : 1);
  for (int64_t begin = 0; begin < 50021;) {
    const int64_t n = std::min<int64_t>(50021 - begin, 4099 + begin % 13);
    ops::adamw_update_(pieces.w.narrow(0, begin, n), pieces.g.narrow(0, begin, n),
                       pieces.m.narrow(0, begin, n), pieces.v.narrow(0, begin, n), 1e-3, 7, o);
    begin += n;
  }
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(whole.w, pieces.w));
  EXPECT_TRUE(at::equal(whole.m, pieces.m));
  EXPECT_TRUE(at::equal(whole.v, pieces.v));
}

// Weight decay inside the pass equals adamw_decay_ before it, bit for bit (ZeRO decays its flat
// shards' decayed segments separately, the replicated optimizer fuses): both paths train alike.
TEST(AdamWKernel, FusedDecayEqualsTheSeparatePass) {
  const ops::AdamWOptions o{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  auto fused = adam_state(30011, 6), separate = adam_state(30011, 6);
  for (int step = 1; step <= 3; ++step) {
    ops::adamw_update_(fused.w, fused.g, fused.m, fused.v, 3e-3, step, o, /*decay=*/true);
    ops::adamw_decay_(separate.w, 3e-3, o);
    ops::adamw_update_(separate.w, separate.g, separate.m, separate.v, 3e-3, step, o);
  }
  EXPECT_TRUE(at::equal(fused.w, separate.w));
  EXPECT_TRUE(at::equal(fused.m, separate.m));
}

// loom's AdamW against PyTorch's own (torch::optim::AdamW, the C++ API's per-tensor ATen ops)
// over 300 steps of a warm-up + cosine schedule with weight decay, from the same state and the
// same gradients, on both of loom's paths (the vectorised pass and the ATen ops for strided
// tensors). The two differ only in rounding: loom's lerp against torch's mul + add for the first
// moment, sqrt(v / bias2) against sqrt(v) / sqrt(bias2). Gradients do not depend on the weights,
// so nothing amplifies a difference: per step an element's weight rounds differently with
// probability about |du| / ulp(w) and then by one ulp, a random walk with a standard deviation of
// sqrt(steps * |du| * ulp(w)); for |du| <= 4 eps lr, lr <= 1e-3, |w| <= 1, 300 steps that is
// 1.3e-7 of max |w|. Asserted: max |difference| <= 1e-6 max |torch| for the weights and both
// moments (the bound), with the fp64 run of torch's formulas as the judge of which is off.
TEST(AdamWKernel, TracksTorchOptimAdamWOverManySteps) {
  const ops::AdamWOptions o{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  constexpr int64_t n = 100003, steps = 300;
  auto gen = core::make_generator(21);
  const auto w0 = at::randn({n}, gen, at::kFloat) * 0.3;
  auto ours = w0.clone(), ours_m = at::zeros_like(w0), ours_v = at::zeros_like(w0);
  // Every other element of a [n, 2] buffer: a strided tensor, which takes the ATen path.
  auto strided_copy = [](const at::Tensor& t) {
    auto buffer = at::zeros({t.numel(), 2}, t.options());
    buffer.select(1, 0).copy_(t);
    return buffer.select(1, 0);
  };
  auto strided = strided_copy(w0), strided_m = strided_copy(at::zeros_like(w0));
  auto strided_v = strided_copy(at::zeros_like(w0));
  ASSERT_FALSE(strided.is_contiguous());
  auto theirs = w0.clone().requires_grad_();
  torch::optim::AdamW torch_opt({theirs}, torch::optim::AdamWOptions(1e-3)
                                              .betas({o.beta1, o.beta2})
                                              .eps(o.eps)
                                              .weight_decay(o.weight_decay));
  auto exact = w0.to(at::kDouble).requires_grad_();  // torch's formulas in fp64
  torch::optim::AdamW exact_opt({exact}, torch::optim::AdamWOptions(1e-3)
                                             .betas({o.beta1, o.beta2})
                                             .eps(o.eps)
                                             .weight_decay(o.weight_decay));
  for (int64_t step = 1; step <= steps; ++step) {
    const double lr = step <= 20 ? 1e-3 * static_cast<double>(step) / 20
                                 : 1e-4 + 0.5 * (1e-3 - 1e-4) *
                                              (1 + std::cos(M_PI * static_cast<double>(step - 20) /
                                                            static_cast<double>(steps - 20)));
    // Gradients of realistic spread: most small, a few large, some exactly zero.
    auto g = at::randn({n}, gen, at::kFloat) * at::rand({n}, gen, at::kFloat).pow(3);
    g.narrow(0, 0, 7).zero_();
    ops::adamw_update_(ours, g, ours_m, ours_v, lr, step, o, /*decay=*/true);
    ops::adamw_update_(strided, strided_copy(g), strided_m, strided_v, lr, step, o,
                       /*decay=*/true);
    for (auto* opt : {&torch_opt, &exact_opt}) {
      opt->param_groups()[0].options().set_lr(lr);
      auto& param = opt->param_groups()[0].params()[0];
      param.mutable_grad() = g.to(param.scalar_type());
      opt->step();
    }
  }
  const auto& state = static_cast<torch::optim::AdamWParamState&>(
      *torch_opt.state().at(theirs.unsafeGetTensorImpl()));
  const auto& exact_state = static_cast<torch::optim::AdamWParamState&>(
      *exact_opt.state().at(exact.unsafeGetTensorImpl()));
  ASSERT_EQ(state.step(), steps);
  auto relative = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
           b.to(at::kDouble).abs().max().item<double>();
  };
  const auto w = theirs.detach();
  for (const auto& [name, weight, m, v] : {std::tuple{"vectorised", ours, ours_m, ours_v},
                                           std::tuple{"aten", strided, strided_m, strided_v}}) {
    const double dw = relative(weight, w), dm = relative(m, state.exp_avg()),
                 dv = relative(v, state.exp_avg_sq());
    std::printf(
        "adamw %s vs torch::optim::AdamW, %lld steps: weights %.2e, exp_avg %.2e, "
        "exp_avg_sq %.2e of max |torch|; vs fp64 %.2e (torch fp32 %.2e)\n",
        name, static_cast<long long>(steps), dw, dm, dv, relative(weight, exact.detach()),
        relative(w, exact.detach()));
    EXPECT_LE(dw, 1e-6) << name;
    EXPECT_LE(dm, 1e-6) << name;
    EXPECT_LE(dv, 1e-6) << name;
  }
  // The weights moved: the comparison is not of two copies of w0.
  EXPECT_GT(relative(w, w0), 1e-3);
  EXPECT_LE(relative(exact_state.exp_avg(), state.exp_avg()), 1e-6);
}

// The gradient factor inside the list update (grad_scale: the clip's factor, applied as the
// update reads each gradient) equals multiplying the gradients by it first, bit for bit on the
// CPU, on loom's pass (contiguous fp32/fp64) and on the ATen path (strided), for kAuto and kMath.
// A factor skipped, applied twice or rounded differently shows as a difference.
TEST(AdamWList, TheGradientFactorInsideEqualsScalingTheGradientsFirst) {
  const ops::AdamWOptions o{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  const std::vector<std::pair<at::ScalarType, bool>> kinds = {
      {at::kFloat, false}, {at::kFloat, true}, {at::kDouble, false}, {at::kDouble, true}};
  const auto view = [](const at::Tensor& t, bool strided) {
    return strided ? t.view({64, 64}).t() : t;
  };
  for (const auto backend : {ops::AdamWBackend::kAuto, ops::AdamWBackend::kMath}) {
    std::vector<AdamState> inside, first;
    for (size_t i = 0; i < kinds.size(); ++i) {
      auto s = adam_state(4096, 300 + i);
      for (auto* t : {&s.w, &s.g, &s.m, &s.v}) *t = t->to(kinds[i].first);
      inside.push_back(s);
      first.push_back({s.w.clone(), s.g.clone(), s.m.clone(), s.v.clone()});
    }
    for (int step = 1; step <= 2; ++step) {
      const auto factor = at::scalar_tensor(0.3 + 0.1 * step, at::kDouble);  // not a power of 2
      ops::AdamWTensors a, b;
      a.grad_scale = factor;
      a.backend = b.backend = backend;
      for (size_t i = 0; i < kinds.size(); ++i) {
        const bool strided = kinds[i].second;
        // Fresh gradients each step: the factor must act on this step's, not accumulate.
        const auto g =
            at::randn({4096}, core::make_generator(400 + 10 * i + step)).to(kinds[i].first);
        inside[i].g.copy_(g);
        first[i].g.copy_(g);
        first[i].g.mul_(factor.to(kinds[i].first));
        for (auto [list, s] : {std::pair{&a, &inside[i]}, std::pair{&b, &first[i]}}) {
          list->weights.push_back(view(s->w, strided));
          list->grads.push_back(view(s->g, strided));
          list->exp_avgs.push_back(view(s->m, strided));
          list->exp_avg_sqs.push_back(view(s->v, strided));
          list->decay.push_back(i % 2 == 0);
        }
      }
      ops::adamw_update_(a, 1e-2, step, o);
      ops::adamw_update_(b, 1e-2, step, o);
    }
    for (size_t i = 0; i < kinds.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_TRUE(at::equal(inside[i].w, first[i].w));
      EXPECT_TRUE(at::equal(inside[i].m, first[i].m));
      EXPECT_TRUE(at::equal(inside[i].v, first[i].v));
    }
  }
}

// --adamw fused: PyTorch's fused kernel (here its CPU kernel; CUDA's computes the same formulas
// in the same order) against the math path, one step from the same fp64 state at step counts 1,
// 3 and 50, with decayed and undecayed tensors and a gradient factor of 1/4 (its fp32 reciprocal
// is exact, so only fp64 roundings separate the two). The two order the arithmetic differently:
// the first moment b1 m + (1 - b1) g against lerp, each within 3 eps (|m0| + |g|) of exact; the
// second moment within 3 eps v1 each; the denominator within 4 eps each; the decay w - lr wd w
// against w (1 - lr wd), 2 eps |w0| each; the weight's add 1 eps |w1| each. So, element by
// element (eps = 2^-53, u = lr / bias1):
//   |dm| <= 6 eps (|m0| + |g|),  |dv| <= 6 eps v1,
//   |dw| <= eps (u (6 (|m0| + |g|) + 10 |m1|) / denom + 4 |w0| + 2 |w1|).
// A decay flag applied to the wrong tensors moves a weight by lr wd |w| = 1e-3 |w|, a factor
// missed moves the moments by 3/4 of (1 - b) |g|: both far above these bounds.
TEST(AdamWList, TorchsFusedKernelMatchesTheMathPathWithinFp64Rounding) {
  const ops::AdamWOptions o{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  constexpr double eps = 0x1p-53, lr = 1e-2;
  for (const int64_t step : {1, 3, 50}) {
    SCOPED_TRACE(step);
    std::vector<AdamState> fused, math;
    ops::AdamWTensors a, b;
    a.backend = ops::AdamWBackend::kFused;
    b.backend = ops::AdamWBackend::kMath;
    a.grad_scale = b.grad_scale = at::scalar_tensor(0.25, at::kDouble);
    for (int i = 0; i < 4; ++i) {
      auto s = adam_state(5003 + 7 * i, 500 + static_cast<uint64_t>(step) + i);
      for (auto* t : {&s.w, &s.g, &s.m, &s.v}) *t = t->to(at::kDouble);
      fused.push_back(s);
      math.push_back({s.w.clone(), s.g.clone(), s.m.clone(), s.v.clone()});
    }
    for (int i = 0; i < 4; ++i)
      for (auto [list, s] : {std::pair{&a, &fused[i]}, std::pair{&b, &math[i]}}) {
        list->weights.push_back(s->w);
        list->grads.push_back(s->g);
        list->exp_avgs.push_back(s->m);
        list->exp_avg_sqs.push_back(s->v);
        list->decay.push_back(i % 2 == 1);
      }
    std::vector<AdamState> before;
    for (const auto& s : math)
      before.push_back({s.w.clone(), s.g * 0.25, s.m.clone(), s.v.clone()});
    ops::adamw_update_(a, lr, step, o);
    ops::adamw_update_(b, lr, step, o);
    const double bias1 = 1 - std::pow(o.beta1, step), bias2 = 1 - std::pow(o.beta2, step);
    double worst_w = 0, worst_m = 0, worst_v = 0;
    for (int i = 0; i < 4; ++i) {
      const auto& s0 = before[i];
      const auto g = s0.g.abs(), m0 = s0.m.abs();
      const auto denom = (math[i].v / bias2).sqrt() + o.eps;
      const auto w_bound = eps * (lr / bias1 * (6 * (m0 + g) + 10 * math[i].m.abs()) / denom +
                                  4 * s0.w.abs() + 2 * math[i].w.abs()) +
                           1e-300;
      worst_w = std::max(worst_w, ((fused[i].w - math[i].w).abs() / w_bound).max().item<double>());
      worst_m = std::max(
          worst_m,
          ((fused[i].m - math[i].m).abs() / (6 * eps * (m0 + g) + 1e-300)).max().item<double>());
      worst_v = std::max(
          worst_v,
          ((fused[i].v - math[i].v).abs() / (6 * eps * math[i].v + 1e-300)).max().item<double>());
      EXPECT_GT((math[i].w - s0.w).abs().max().item<double>(), 1e-4);  // the weights moved
    }
    std::printf(
        "adamw torch fused vs math, fp64, step %lld: max |diff| / bound: weights %.3f, "
        "exp_avg %.3f, exp_avg_sq %.3f\n",
        static_cast<long long>(step), worst_w, worst_m, worst_v);
    EXPECT_LE(worst_w, 1.0);
    EXPECT_LE(worst_m, 1.0);
    EXPECT_LE(worst_v, 1.0);
  }
}

// The path a GPU takes for fp32 weights: PyTorch's kernel divides each gradient by the fp32
// reciprocal of the clip's factor. Against the same kernel fed gradients already multiplied by
// the factor (0.3: its reciprocal is not exact), one step from the same fp32 state: the
// gradients differ by at most 3 u (u = 2^-24: the reciprocal's rounding, the division's, against
// the one product), which moves m by (1 - b1) 3 u |g| and the weight's step by no more than the
// fp32 arithmetic's own error; bound, as in the one-step fp32 test above with both runs' errors:
// lr / bias1 * 12 u (|m0| + |g|) / denom + 4 u (|w0| + |w1|). A factor passed as itself instead
// of its reciprocal would scale the gradients by 11: the moments alone move by far more.
TEST(AdamWList, TorchsFusedKernelTakesTheFactorAsItsFp32Reciprocal) {
  const ops::AdamWOptions o{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  constexpr double u = 0x1p-24, lr = 1e-2, factor = 0.3;
  for (const int64_t step : {1, 7}) {
    SCOPED_TRACE(step);
    auto inside = adam_state(3001, 900 + static_cast<uint64_t>(step));
    AdamState first{inside.w.clone(), inside.g.clone(), inside.m.clone(), inside.v.clone()};
    first.g.mul_(factor);
    const auto w0 = inside.w.to(at::kDouble), m0 = inside.m.to(at::kDouble).abs();
    const auto g = first.g.to(at::kDouble).abs();
    ops::AdamWTensors a, b;
    a.backend = b.backend = ops::AdamWBackend::kFused;
    a.grad_scale = at::scalar_tensor(factor, at::kDouble);
    for (auto [list, s] : {std::pair{&a, &inside}, std::pair{&b, &first}}) {
      list->weights = {s->w};
      list->grads = {s->g};
      list->exp_avgs = {s->m};
      list->exp_avg_sqs = {s->v};
      list->decay = {true};
    }
    ops::adamw_update_(a, lr, step, o);
    ops::adamw_update_(b, lr, step, o);
    const double bias1 = 1 - std::pow(o.beta1, step), bias2 = 1 - std::pow(o.beta2, step);
    const auto w1 = first.w.to(at::kDouble);
    const auto denom = (first.v.to(at::kDouble) / bias2).sqrt() + o.eps;
    const auto bound = lr / bias1 * 12 * u * (m0 + g) / denom + 4 * u * (w0.abs() + w1.abs());
    const double worst = ((inside.w.to(at::kDouble) - w1).abs() / bound).max().item<double>();
    std::printf(
        "adamw torch fused, factor inside vs applied first, fp32, step %lld: %.3f of "
        "the bound\n",
        static_cast<long long>(step), worst);
    EXPECT_LE(worst, 1.0);
    EXPECT_LE((inside.m - first.m).abs().max().item<double>(),
              (0.1 * 3 * u * g + 3 * u * (m0 + g)).max().item<double>());
  }
}

// What PyTorch's kernel cannot do is refused by name before anything is updated: a frozen second
// moment (1-bit Adam's), strided tensors; kAuto takes the math path for both instead.
TEST(AdamWList, TorchsFusedKernelRefusesWhatItCannotDoAndAutoFallsBack) {
  ops::AdamWOptions frozen{.weight_decay = 0, .freeze_variance_after = 2};
  auto s = adam_state(4096, 9);
  const auto w0 = s.w.clone();
  auto list_of = [](AdamState& st, bool strided, ops::AdamWBackend backend) {
    ops::AdamWTensors l;
    auto v = [&](const at::Tensor& t) { return strided ? t.view({64, 64}).t() : t; };
    l.weights = {v(st.w)};
    l.grads = {v(st.g)};
    l.exp_avgs = {v(st.m)};
    l.exp_avg_sqs = {v(st.v)};
    l.decay = {false};
    l.backend = backend;
    return l;
  };
  auto msg = loom::testing::error_of(
      [&] { ops::adamw_update_(list_of(s, false, ops::AdamWBackend::kFused), 1e-2, 3, frozen); });
  EXPECT_TRUE(loom::testing::contains(msg,
                                      "cannot hold the second moment frozen "
                                      "(freeze_variance_after = 2"))
      << msg;
  msg = loom::testing::error_of([&] {
    ops::adamw_update_(list_of(s, true, ops::AdamWBackend::kFused), 1e-2, 1, ops::AdamWOptions{});
  });
  EXPECT_TRUE(loom::testing::contains(msg, "needs contiguous weights")) << msg;
  EXPECT_TRUE(at::equal(s.w, w0));  // nothing was updated
  EXPECT_EQ(ops::parse_adamw_backend("fused"), ops::AdamWBackend::kFused);
  msg = loom::testing::error_of([] { ops::parse_adamw_backend("apex"); });
  EXPECT_TRUE(loom::testing::contains(msg, "apex")) << msg;
  // kAuto with a frozen variance on strided tensors: the math path, as adamw_update_.
  auto t = adam_state(4096, 9);
  ops::adamw_update_(list_of(s, true, ops::AdamWBackend::kAuto), 1e-2, 3, frozen);
  ops::adamw_update_(t.w.view({64, 64}).t(), t.g.view({64, 64}).t(), t.m.view({64, 64}).t(),
                     t.v.view({64, 64}).t(), 1e-2, 3, frozen);
  EXPECT_TRUE(at::equal(s.w, t.w));
}

}  // namespace
