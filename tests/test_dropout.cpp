// Dropout with counter-based masks: Philox4x32-10 against its published known answers, the host
// reference (kernels/dropout) against the definition written out element by element, the mask's
// statistics, its independence from how the logical tensor is split, and ops::dropout (CPU,
// every floating dtype, autograd) against the reference. The CUDA kernel is checked against the
// same reference by kernels.dropout_emulated.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "dropout/dropout.h"
#include "dropout/philox.h"
#include "loom/core/rng.h"
#include "loom/ops/cuda.h"
#include "loom/ops/dropout.h"
#include "test_util.h"

namespace kernels = loom::kernels;
namespace ops = loom::ops;
using loom::testing::contains;
using loom::testing::error_of;

namespace {

// The draw for logical element (s, a, b, c), written out as dropout.h defines it.
uint32_t definition_draw(const kernels::DropoutParams& k, int64_t s, int64_t a, int64_t b,
                         int64_t c) {
  const uint32_t row = uint32_t(a * k.logical[2] + b);
  const auto out = kernels::philox4x32_10({{uint32_t(c / 4), row, uint32_t(s), k.site}},
                                          k.key[0], k.key[1]);
  return out.v[c % 4];
}

kernels::DropoutParams params(std::vector<int64_t> size, std::vector<int64_t> offset,
                              std::vector<int64_t> logical, double p, uint32_t site = 5) {
  kernels::DropoutParams k;
  k.key[0] = 0x12345678u;
  k.key[1] = 0x9abcdef0u;
  k.site = site;
  k.drop_below = kernels::dropout_threshold(p);
  k.scale = 1.0 / (1.0 - p);
  for (int d = 0; d < 4; ++d) {
    k.size[d] = size[d];
    k.offset[d] = offset[d];
    k.logical[d] = logical[d];
  }
  return k;
}

// The reference's output for all rows, from x (or the mask, x empty).
std::vector<double> run_host(const kernels::DropoutParams& k, const std::vector<double>& x) {
  std::vector<double> y(static_cast<size_t>(k.numel()), -1.0);
  kernels::dropout_host<double>(x.empty() ? nullptr : x.data(), y.data(), k, 0, k.rows());
  return y;
}

}  // namespace

// The three philox4x32 10 lines of Random123's kat_vectors file (counter, key -> output).
TEST(DropoutKernelsHost, PhiloxMatchesThePublishedKnownAnswers) {
  struct Kat {
    kernels::Philox4x32 counter;
    uint32_t key[2];
    kernels::Philox4x32 want;
  };
  const Kat kats[] = {
      {{{0, 0, 0, 0}}, {0, 0}, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}}},
      {{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
       {0xffffffffu, 0xffffffffu},
       {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}}},
      {{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
       {0xa4093822u, 0x299f31d0u},
       {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}}},
  };
  for (const auto& kat : kats) {
    const auto got = kernels::philox4x32_10(kat.counter, kat.key[0], kat.key[1]);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], kat.want.v[i]) << "word " << i;
  }
}

// Slices with offsets in every dimension, column offsets and widths that are no multiple of 4,
// and a row range split in two: each element as the definition says.
TEST(DropoutKernelsHost, ReferenceIsTheDefinitionElementByElement) {
  const std::vector<kernels::DropoutParams> cases = {
      params({3, 2, 5, 11}, {0, 0, 0, 0}, {3, 2, 5, 11}, 0.1),
      params({2, 1, 3, 6}, {7, 1, 2, 3}, {9, 4, 5, 13}, 0.5),
      params({1, 1, 1, 1}, {4, 0, 0, 5}, {5, 1, 1, 8}, 0.3),
      params({2, 3, 1, 9}, {0, 2, 0, 4}, {2, 5, 1, 13}, 0.0),
  };
  for (const auto& k : cases) {
    std::vector<double> x(static_cast<size_t>(k.numel()));
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.25 + double(i);
    const auto y = run_host(k, x);
    const auto mask = run_host(k, {});
    // Two row ranges, in the other order, give the same as one pass.
    std::vector<double> split(y.size(), -1.0);
    const int64_t half = k.rows() / 2;
    kernels::dropout_host<double>(x.data(), split.data(), k, half, k.rows());
    kernels::dropout_host<double>(x.data(), split.data(), k, 0, half);
    int64_t kept = 0;
    for (int64_t i0 = 0, e = 0; i0 < k.size[0]; ++i0)
      for (int64_t i1 = 0; i1 < k.size[1]; ++i1)
        for (int64_t i2 = 0; i2 < k.size[2]; ++i2)
          for (int64_t i3 = 0; i3 < k.size[3]; ++i3, ++e) {
            const bool keep = definition_draw(k, i0 + k.offset[0], i1 + k.offset[1],
                                              i2 + k.offset[2], i3 + k.offset[3]) >= k.drop_below;
            kept += keep;
            const auto i = static_cast<size_t>(e);
            EXPECT_EQ(y[i], keep ? x[i] * k.scale : 0.0) << "element " << e;
            EXPECT_EQ(mask[i], keep ? k.scale : 0.0) << "element " << e;
            EXPECT_EQ(split[i], y[i]) << "element " << e;
          }
    if (k.drop_below == 0) {
      EXPECT_EQ(kept, k.numel());
    }
  }
}

// Every element of the logical tensor's slices is the logical tensor's element there: any split
// of the tensor (tensor-, sequence-, data-parallel) applies the one-process mask.
TEST(DropoutKernelsHost, SlicesOfTheLogicalTensorAreItsMask) {
  const std::vector<int64_t> logical{4, 6, 5, 14};
  const auto whole = run_host(params({4, 6, 5, 14}, {0, 0, 0, 0}, logical, 0.4), {});
  const std::vector<std::vector<int64_t>> slices[] = {
      {{2, 6, 5, 14}, {2, 0, 0, 0}},  // data-parallel rank 1 of 2
      {{4, 3, 5, 14}, {0, 3, 0, 0}},  // heads split over tp 2
      {{4, 6, 2, 14}, {0, 0, 3, 0}},  // a sequence chunk
      {{1, 2, 3, 5}, {3, 1, 2, 9}},   // an odd column window
  };
  for (const auto& s : slices) {
    const auto k = params(s[0], s[1], logical, 0.4);
    const auto part = run_host(k, {});
    for (int64_t i0 = 0, e = 0; i0 < k.size[0]; ++i0)
      for (int64_t i1 = 0; i1 < k.size[1]; ++i1)
        for (int64_t i2 = 0; i2 < k.size[2]; ++i2)
          for (int64_t i3 = 0; i3 < k.size[3]; ++i3, ++e) {
            const int64_t w = (((i0 + k.offset[0]) * 6 + i1 + k.offset[1]) * 5 + i2 + k.offset[2]) *
                                  14 +
                              i3 + k.offset[3];
            EXPECT_EQ(part[size_t(e)], whole[size_t(w)]) << "element " << e;
          }
  }
}

// The kept fraction over 2^20 elements is 1 - p within 6 standard deviations, in each of the four
// words of a draw and overall; masks of neighbouring samples, sites and steps are uncorrelated.
TEST(DropoutKernelsHost, KeepsOneMinusPAndDrawsIndependently) {
  const int64_t cols = 1024, rows = 256, samples = 4;
  for (const double p : {0.1, 0.5, 0.9}) {
    auto k = params({samples, 1, rows, cols}, {0, 0, 0, 0}, {samples, 1, rows, cols}, p);
    const auto mask = run_host(k, {});
    const double n = double(mask.size());
    double kept = 0, by_word[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < mask.size(); ++i) {
      const bool keep = mask[i] != 0;
      kept += keep;
      by_word[(i % size_t(cols)) % 4] += keep;
    }
    const double sigma = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(kept / n, 1 - p, 6 * sigma) << "p " << p;
    for (const double w : by_word) EXPECT_NEAR(w / (n / 4), 1 - p, 6 * 2 * sigma) << "p " << p;
    // Correlation of the keep indicators of sample 0 and sample 1 (same coordinates), and of
    // site 5 and site 6, and of two keys (steps): each within 6 / sqrt(elements) of 0.
    k.site = 6;
    const auto other_site = run_host(k, {});
    k.site = 5;
    k.key[0] ^= 1;
    const auto other_key = run_host(k, {});
    const size_t per_sample = size_t(rows * cols);
    auto correlation = [&](const std::vector<double>& a, size_t a0, const std::vector<double>& b,
                           size_t b0) {
      double sa = 0, sb = 0, sab = 0;
      for (size_t i = 0; i < per_sample; ++i) {
        const double x = a[a0 + i] != 0, y = b[b0 + i] != 0;
        sa += x, sb += y, sab += x * y;
      }
      const double m = double(per_sample);
      const double cov = sab / m - (sa / m) * (sb / m);
      return cov / (p * (1 - p));
    };
    const double bound = 6 / std::sqrt(double(per_sample));
    EXPECT_NEAR(correlation(mask, 0, mask, per_sample), 0, bound) << "samples, p " << p;
    EXPECT_NEAR(correlation(mask, 0, other_site, 0), 0, bound) << "sites, p " << p;
    EXPECT_NEAR(correlation(mask, 0, other_key, 0), 0, bound) << "keys, p " << p;
  }
}

TEST(DropoutKernelsHost, ChecksNameWhatIsOutOfRange) {
  auto msg = kernels::dropout_check(params({2, 1, 1, 8}, {0, 0, 0, 5}, {2, 1, 1, 12}, 0.1)).message;
  EXPECT_TRUE(contains(msg, "columns") && contains(msg, "[5, 13)") && contains(msg, "12")) << msg;
  msg = kernels::dropout_check(params({1, 1, 1, 1}, {0, 0, 0, 0}, {1, 70000, 70000, 1}, 0.1)).message;
  EXPECT_TRUE(contains(msg, "70000 x 70000") && contains(msg, "2^32")) << msg;
  msg = kernels::dropout_check(params({1, 1, 1, 1}, {0, 0, 0, 0}, {1, 1, 1, int64_t(1) << 35}, 0.1))
            .message;
  EXPECT_TRUE(contains(msg, "2^34")) << msg;
  EXPECT_TRUE(kernels::dropout_check(params({2, 3, 4, 5}, {1, 1, 1, 1}, {3, 4, 5, 6}, 0.1)).ok());
  EXPECT_EQ(kernels::dropout_threshold(0.0), 0u);
  EXPECT_EQ(kernels::dropout_threshold(0.5), 0x80000000u);
}

namespace {

ops::DropoutPosition position(int64_t step, int64_t first_sample, uint64_t seed = 11) {
  return ops::DropoutPosition{.seed = seed, .step = step, .first_sample = first_sample};
}

}  // namespace

// ops::dropout on the CPU: y = x * mask with the reference's mask, in fp32 and fp64 exactly; bf16
// and fp16 as fp32 products rounded once; backward applies the same mask to the gradient.
TEST(Dropout, OpIsTheReferenceAndItsGradientTheMask) {
  const auto pos = position(3, 8);
  const uint32_t site = ops::dropout_site(2, ops::DropoutPlace::kMlp);
  auto x64 = at::randn({3, 7, 10}, at::TensorOptions().dtype(at::kDouble));
  const auto mask = ops::dropout_mask({3, 7, 10}, at::kDouble, 0.3, pos, site);
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    auto x = x64.to(dtype).clone().requires_grad_();
    auto y = ops::dropout(x, 0.3, pos, site);
    EXPECT_EQ(y.scalar_type(), dtype);
    const auto want = (x.detach().to(at::kFloat) * mask.to(at::kFloat)).to(dtype);
    if (dtype == at::kDouble) {
      EXPECT_TRUE(at::equal(y, x.detach() * mask));
    } else {
      EXPECT_TRUE(at::equal(y, want)) << dtype;
    }
    const auto g = at::randn_like(y);
    y.backward(g);
    if (dtype == at::kDouble) {
      EXPECT_TRUE(at::equal(x.grad(), g * mask));
    } else {
      EXPECT_TRUE(at::equal(x.grad(), (g.to(at::kFloat) * mask.to(at::kFloat)).to(dtype)))
          << dtype;
    }
  }
  // About 30% dropped, and the kept ones scaled by 1 / 0.7.
  const double dropped = (mask == 0).to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(dropped, 0.3, 0.1);
  EXPECT_NEAR(mask.max().item<double>(), 1 / 0.7, 1e-15);
  // p == 0: the input itself, nothing drawn.
  EXPECT_TRUE(ops::dropout(x64, 0.0, pos, site).is_same(x64));
  EXPECT_FALSE(ops::dropout_mask({2, 2}, at::kFloat, 0.0, pos, site).defined());
}

// The mask is a function of (seed, step, site, global sample, coordinates) only: micro-batches at
// their first samples assemble the whole batch's mask; a tensor-parallel split (split_slice)
// holds the whole tensor's slice; a change of seed, step or site changes it.
TEST(Dropout, MaskFollowsTheSamplesAndNotTheSplit) {
  const uint32_t site = ops::dropout_site(0, ops::DropoutPlace::kAttentionProbs);
  const auto whole = ops::dropout_mask({8, 4, 6, 6}, at::kFloat, 0.2, position(1, 0), site);
  // Micro-batches (or data-parallel ranks) of 2 samples each.
  std::vector<at::Tensor> parts;
  for (int64_t first = 0; first < 8; first += 2)
    parts.push_back(ops::dropout_mask({2, 4, 6, 6}, at::kFloat, 0.2, position(1, first), site));
  EXPECT_TRUE(at::equal(at::cat(parts, 0), whole));
  // Heads over 4 ranks, the sequence over 2, the columns over 3.
  for (const auto& [dim, ranks] : std::vector<std::pair<int64_t, int64_t>>{{1, 4}, {2, 2}, {3, 3}}) {
    std::vector<int64_t> shape{8, 4, 6, 6};
    shape[dim] /= ranks;
    for (int64_t r = 0; r < ranks; ++r) {
      const auto part = ops::dropout_mask(shape, at::kFloat, 0.2, position(1, 0), site,
                                          ops::split_slice(shape, dim, ranks, r));
      EXPECT_TRUE(at::equal(part, whole.narrow(dim, r * shape[dim], shape[dim])))
          << "dim " << dim << " rank " << r;
    }
  }
  EXPECT_FALSE(
      at::equal(ops::dropout_mask({8, 4, 6, 6}, at::kFloat, 0.2, position(2, 0), site), whole));
  EXPECT_FALSE(at::equal(
      ops::dropout_mask({8, 4, 6, 6}, at::kFloat, 0.2, position(1, 0, 12), site), whole));
  EXPECT_FALSE(at::equal(ops::dropout_mask({8, 4, 6, 6}, at::kFloat, 0.2, position(1, 0),
                                           ops::dropout_site(1, ops::DropoutPlace::kAttentionProbs)),
                         whole));
  // Sites are distinct for every layer and place.
  EXPECT_EQ(ops::dropout_site(-1, ops::DropoutPlace::kInput), 0u);
  EXPECT_NE(ops::dropout_site(0, ops::DropoutPlace::kMlp),
            ops::dropout_site(1, ops::DropoutPlace::kInput));
}

TEST(Dropout, StreamHoldsThePositionItIsGiven) {
  ops::DropoutStream stream(5);
  stream.set_micro_batch(4, 12);
  EXPECT_EQ(stream.position().seed, 5u);
  EXPECT_EQ(stream.position().step, 4);
  EXPECT_EQ(stream.position().first_sample, 12);
  const auto saved = stream.position();
  stream.reseed(6);
  EXPECT_EQ(stream.position().step, 0);
  stream.restore(saved);
  EXPECT_EQ(stream.position().seed, 5u);
  EXPECT_TRUE(contains(error_of([&] { stream.set_micro_batch(-1, 0); }), "step -1"));
}

TEST(Dropout, BadArgumentsAreClearErrors) {
  const auto pos = position(0, 0);
  const auto x = at::ones({2, 3});
  auto msg = error_of([&] { ops::dropout(x, 1.0, pos, 0); });
  EXPECT_TRUE(contains(msg, "probability 1") && contains(msg, "[0, 1)")) << msg;
  msg = error_of([&] { ops::dropout(x, -0.1, pos, 0); });
  EXPECT_TRUE(contains(msg, "-0.1")) << msg;
  msg = error_of([&] { ops::dropout(at::ones({1, 2, 3, 4, 5}), 0.1, pos, 0); });
  EXPECT_TRUE(contains(msg, "5 dimensions") && contains(msg, "1 to 4")) << msg;
  msg = error_of([&] { ops::dropout(at::ones({2, 3}, at::kLong), 0.1, pos, 0); });
  EXPECT_TRUE(contains(msg, "floating types only")) << msg;
  msg = error_of([&] { ops::dropout(x, 0.1, pos, 0, {{2, 3, 1}, {0, 0, 0}}); });
  EXPECT_TRUE(contains(msg, "3 logical sizes")) << msg;
  msg = error_of([&] { ops::dropout(x, 0.1, pos, 0, {{2, 4}, {0, 2}}); });
  EXPECT_TRUE(contains(msg, "[2, 5)") && contains(msg, "logical size 4")) << msg;
  msg = error_of([&] { ops::dropout_site(-2, ops::DropoutPlace::kMlp); });
  EXPECT_TRUE(contains(msg, "layer -2")) << msg;
}

// On a GPU (skipped elsewhere; scripts/gpu-check runs it): the kernel's masks and products equal
// the CPU's bit for bit, in every dtype and for slices, and its backward applies the same mask.
TEST(DropoutGpu, KernelEqualsTheCpuBitForBit) {
  if (!loom::ops::built_with_cuda()) GTEST_SKIP() << "built without LOOM_WITH_CUDA";
  if (loom::ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const auto pos = position(7, 40);
  const uint32_t site = ops::dropout_site(3, ops::DropoutPlace::kAttentionProbs);
  const std::vector<int64_t> shape{3, 4, 33, 70};
  const auto slice = ops::split_slice(shape, 1, 2, 1);
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    const auto x = at::randn(shape).to(dtype);
    const auto cpu_mask = ops::dropout_mask(shape, dtype, 0.15, pos, site, slice);
    const auto gpu_mask = ops::dropout_mask(shape, at::TensorOptions().dtype(dtype).device(at::kCUDA),
                                            0.15, pos, site, slice);
    EXPECT_TRUE(at::equal(gpu_mask.cpu(), cpu_mask)) << dtype;
    auto xg = x.cuda().requires_grad_();
    auto y = ops::dropout(xg, 0.15, pos, site, slice);
    EXPECT_TRUE(at::equal(y.cpu(), ops::dropout(x, 0.15, pos, site, slice))) << dtype;
    const auto g = at::randn(shape).to(dtype);
    y.backward(g.cuda());
    EXPECT_TRUE(at::equal(xg.grad().cpu(), ops::dropout(g, 0.15, pos, site, slice))) << dtype;
  }
}
