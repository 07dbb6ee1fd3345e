// The communication-compression kernels on a GPU (kernels/compression): int8 quantization, sign
// packing, threshold selection and scatter-add, and PowerSGD's orthogonalisation, each equal to
// its host reference bit for bit. Every test skips with a message where no CUDA device exists (CI
// and the dev machines); scripts/gpu-check runs them on a GPU machine.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "loom/ops/cuda.h"
#include "loom/ops/orthogonalize.h"
#include "loom/ops/quantize.h"
#include "loom/ops/sign_pack.h"
#include "loom/ops/sparsify.h"

namespace ops = loom::ops;

#define SKIP_WITHOUT_GPU()                                                               \
  do {                                                                                   \
    if (!ops::built_with_cuda()) GTEST_SKIP() << "built without LOOM_WITH_CUDA";         \
    if (ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine"; \
    if (ops::cuda_compute_capability(0) < 80) GTEST_SKIP() << "the kernels need sm_80+"; \
  } while (0)

// The int8 quantization kernel on a GPU equals its host reference bit for bit (codes, scales
// and the updated error; a NaN scale only as NaN, whose payload bits may differ), on blocks of
// seven decades, an all-zero block and a NaN.
TEST(QuantizeInt8Gpu, KernelEqualsTheHostReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t blocks = 300;
  auto x = at::randn({blocks, ops::kInt8Block}) *
           at::pow(10.0, at::arange(blocks, at::kFloat).remainder(7) - 3).unsqueeze(1);
  x[4].zero_();
  x = x.flatten();
  x[9 * ops::kInt8Block + 3] = std::nanf("");
  auto error_cpu = at::randn({blocks * ops::kInt8Block}) * 1e-3;
  auto error_gpu = error_cpu.cuda();
  const auto want = ops::quantize_int8_with_feedback(x, error_cpu);
  const auto got = ops::quantize_int8_with_feedback(x.cuda(), error_gpu);
  EXPECT_TRUE(at::equal(got.codes.cpu(), want.codes));
  const auto bits = [](const at::Tensor& t) {
    return at::where(at::isnan(t.cpu()), at::zeros_like(t.cpu()), t.cpu()).view(at::kInt);
  };
  EXPECT_TRUE(at::equal(at::isnan(got.scales.cpu()), at::isnan(want.scales)));
  EXPECT_TRUE(at::equal(bits(got.scales), bits(want.scales)));
  EXPECT_TRUE(at::equal(bits(error_gpu), bits(error_cpu)));
}

// Sign packing and unpacking on a GPU equal their host reference bit for bit: the words, the
// scales (a NaN as NaN) and the updated error, and the decoded values, on blocks of seven decades,
// an all-zero block and a NaN.
TEST(SignPackGpu, KernelsEqualTheHostReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t blocks = 300;
  auto x = at::randn({blocks, ops::kSignBlock}) *
           at::pow(10.0, at::arange(blocks, at::kFloat).remainder(7) - 3).unsqueeze(1);
  x[4].zero_();
  x = x.flatten();
  x[9 * ops::kSignBlock + 3] = std::nanf("");
  auto error_cpu = at::randn({blocks * ops::kSignBlock}) * 1e-3;
  error_cpu.narrow(0, 4 * ops::kSignBlock, ops::kSignBlock).zero_();
  auto error_gpu = error_cpu.cuda();
  const auto want = ops::pack_signs_with_feedback(x, error_cpu);
  const auto got = ops::pack_signs_with_feedback(x.cuda(), error_gpu);
  EXPECT_TRUE(at::equal(got.words.cpu(), want.words));
  const auto bits = [](const at::Tensor& t) {
    return at::where(at::isnan(t.cpu()), at::zeros_like(t.cpu()), t.cpu()).view(at::kInt);
  };
  EXPECT_TRUE(at::equal(at::isnan(got.scales.cpu()), at::isnan(want.scales)));
  EXPECT_TRUE(at::equal(bits(got.scales), bits(want.scales)));
  EXPECT_TRUE(at::equal(bits(error_gpu), bits(error_cpu)));
  EXPECT_TRUE(at::equal(bits(ops::unpack_signs(want.words.cuda(), want.scales.cuda())),
                        bits(ops::unpack_signs(want.words, want.scales))));
}

// Threshold selection and scatter-add on a GPU equal their host reference bit for bit: the
// chunk counts (through the selected total), the indices and values in index order with a
// capacity below the count, the updated error (a NaN as NaN), and the sums of two ranks' lists.
TEST(SparseSelectGpu, KernelsEqualTheHostReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 1000003;
  auto x = at::randn({n});
  x[77] = std::nanf("");
  auto error_cpu = at::randn({n}) * 0.1;
  auto error_gpu = error_cpu.cuda();
  // With a NaN among them the k-th largest magnitude is NaN on both (its sign bit may differ:
  // measured -nan on the CPU, nan on an H200); the selection below uses the finite values'.
  EXPECT_TRUE(std::isnan(ops::kth_largest_magnitude(x, error_cpu, 5000)));
  EXPECT_TRUE(std::isnan(ops::kth_largest_magnitude(x.cuda(), error_gpu, 5000)));
  const auto finite = at::nan_to_num(x, 0.0);
  const double t = ops::kth_largest_magnitude(finite, error_cpu, 5000);
  EXPECT_EQ(ops::kth_largest_magnitude(finite.cuda(), error_gpu, 5000), t);
  const auto want = ops::select_with_feedback(x, error_cpu, t, 4000);
  const auto got = ops::select_with_feedback(x.cuda(), error_gpu, t, 4000);
  EXPECT_EQ(got.selected, want.selected);
  EXPECT_TRUE(at::equal(got.indices.cpu(), want.indices));
  const auto bits = [](const at::Tensor& v) {
    return at::where(at::isnan(v.cpu()), at::zeros_like(v.cpu()), v.cpu()).view(at::kInt);
  };
  EXPECT_TRUE(at::equal(bits(got.values), bits(want.values)));
  EXPECT_TRUE(at::equal(bits(error_gpu), bits(error_cpu)));
  auto sum_cpu = at::zeros({n});
  auto sum_gpu = sum_cpu.cuda();
  for (int rank = 0; rank < 2; ++rank) {
    const auto idx = at::randperm(n, at::kInt).narrow(0, 0, 20000);
    const auto val = at::randn({20000});
    ops::scatter_add_sparse_(sum_cpu, idx, val);
    ops::scatter_add_sparse_(sum_gpu, idx.cuda(), val.cuda());
  }
  EXPECT_TRUE(at::equal(sum_gpu.cpu(), sum_cpu));
}

// PowerSGD's orthogonalisation on a GPU equals its host reference bit for bit: 40 matrices of 1
// to 5000 rows at rank 4 and one of 3000 rows at rank 32, packed apart, one with a zero column.
TEST(OrthogonalizeGpu, KernelEqualsTheHostReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  for (const int64_t rank : {int64_t(4), int64_t(32)}) {
    std::vector<int64_t> offsets, rows;
    int64_t total = 0;
    const int64_t matrices = rank == 4 ? 40 : 1;
    for (int64_t m = 0; m < matrices; ++m) {
      offsets.push_back(total + 3);
      rows.push_back(rank == 4 ? 1 + (m * 131) % 5000 : 3000);
      total += 3 + rows.back() * rank;
    }
    auto cpu = at::randn({total});
    cpu.narrow(0, offsets[0], rows[0] * rank).view({rows[0], rank}).select(1, 1).zero_();
    auto gpu = cpu.cuda();
    ops::orthogonalize_columns_(cpu, offsets, rows, rank);
    ops::orthogonalize_columns_(gpu, offsets, rows, rank);
    EXPECT_TRUE(at::equal(gpu.cpu(), cpu)) << "rank " << rank;
  }
}
