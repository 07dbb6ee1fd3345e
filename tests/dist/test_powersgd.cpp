// The powersgd communication hook across ranks: every rank gets the same rank-r approximation of
// the mean gradient, the one an fp64 power-iteration step finds; a gradient of rank <= r comes
// through whole; error feedback loses nothing over steps; the bytes are the analytic figure; its
// state round-trips; a NaN reaches every rank and does not outlive the step.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "dist_util.h"
#include "loom/core/error.h"
#include "loom/ops/orthogonalize.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/data/powersgd_hook.h"

using loom::testing::same_on_every_rank;
using loom::testing::world;
namespace pd = loom::parallel::data;

namespace {

constexpr double kU = 5.960464477539063e-08;  // 2^-24

// A bucket of a 64 x 48 matrix and a 6 x 8 x 10 tensor (compressed at rank 2), with a bias of 48
// and a 4 x 4 matrix between them (too small to gain: sent as they are).
pd::GradBucket make_bucket() {
  pd::GradBucket b;
  b.index = 2;
  int64_t offset = 0;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{64, 48}, {48}, {4, 4}, {6, 8, 10}}) {
    b.params.push_back(at::zeros(shape));
    b.offsets.push_back(offset);
    offset += b.params.back().numel();
  }
  b.buffer = at::zeros({offset});
  return b;
}

struct View {
  int64_t offset, rows, cols;
};
const std::vector<View> kMatrices = {{0, 64, 48}, {3136, 6, 80}};
constexpr int64_t kDenseFrom = 3072, kDenseLength = 64;

constexpr int kGradientSeed = 900;

at::Tensor gradient_of(int rank, int step, int64_t n) {
  return loom::testing::rank_gradient(kGradientSeed, rank, step, n);
}

// The textbook modified Gram-Schmidt, in fp64.
at::Tensor orthonormal_columns(at::Tensor p) {
  p = p.clone();
  for (int64_t i = 0; i < p.size(1); ++i) {
    auto col = p.select(1, i);
    const double norm2 = col.dot(col).item<double>();
    if (norm2 == 0) continue;
    for (int64_t j = i + 1; j < p.size(1); ++j) {
      auto other = p.select(1, j);
      other -= col * (col.dot(other).item<double>() / norm2);
    }
    col /= std::sqrt(norm2);
  }
  return p;
}

at::Tensor matrix(const at::Tensor& flat, const View& v) {
  return flat.narrow(0, v.offset, v.rows * v.cols).view({v.rows, v.cols});
}

}  // namespace

// Six steps of rank-2 PowerSGD over R ranks, each rank's gradient its own. Per step: every rank
// gets the same result; each compressed matrix equals the fp64 power-iteration step from the same
// Q on the mean of the ranks' M = gradient + error (P = M Q, orthonormalized; Q' = M^T P;
// result P Q'^T) within 16 u (rows + cols) kappa(P) |M|_2 (the fp32 products and the
// orthogonalisation's loss, amplified by P's condition number); the values sent as they are equal
// the mean within R u of the largest. Over the steps the results plus the ranks' mean carried
// error equal the sum of the true means (error feedback) within 6 steps x (4 + R) u of the
// largest gradient, M or error; the communicator counts two all-reduces of 460 float32 values a
// step.
TEST(PowerSgdHook, EveryRankGetsTheMeansRankRApproximationAndErrorFeedbackLosesNothing) {
  auto& comm = world();
  const int ranks = comm.size();
  const int64_t steps = 6;
  pd::PowerSgdHook hook(2);
  auto bucket = make_bucket();
  const int64_t n = bucket.numel();
  ASSERT_EQ(hook.values_sent(bucket), 2 * (64 + 6) + kDenseLength + 2 * (48 + 80));
  auto sum_out = at::zeros({n}, at::kDouble), sum_mean = at::zeros({n}, at::kDouble);
  double largest = 0, sent = 0, worst_ratio = 0;
  for (int t = 0; t < steps; ++t) {
    bucket.buffer.copy_(gradient_of(comm.rank(), t, n));
    const auto mean = loom::testing::mean_rank_gradient(kGradientSeed, t, n, &largest);
    const double sent_before = comm.bytes_sent();
    auto work = hook.start(bucket, comm);
    // Between start and finish the hook's error holds M, and Q is still the last step's.
    auto big_mean = hook.error(bucket.index).to(at::kDouble);
    const auto q_before = hook.q(bucket.index).to(at::kDouble);
    largest = std::max(largest, big_mean.abs().max().item<double>());
    work->wait();
    hook.finish(bucket, comm);
    sent += comm.bytes_sent() - sent_before;
    largest = std::max(largest, hook.error(bucket.index).abs().max().item<double>());
    comm.all_reduce(big_mean, loom::dist::ReduceOp::Sum);
    big_mean /= ranks;
    ASSERT_TRUE(same_on_every_rank(bucket.buffer)) << "step " << t;
    int64_t error_at = 0, q_at = 0;
    for (const auto& v : kMatrices) {
      const auto m = big_mean.narrow(0, error_at, v.rows * v.cols).view({v.rows, v.cols});
      const auto q = q_before.narrow(0, q_at, v.cols * 2).view({v.cols, 2});
      error_at += v.rows * v.cols;
      q_at += v.cols * 2;
      const auto p = at::mm(m, q);
      const auto s = at::linalg_svdvals(p);
      const double kappa = (s[0] / s[-1]).item<double>();
      const auto basis = orthonormal_columns(p);
      const auto want = at::mm(basis, at::mm(m.t(), basis).t());
      const double got_gap =
          (matrix(bucket.buffer, v).to(at::kDouble) - want).abs().max().item<double>();
      const double bound =
          16 * kU * double(v.rows + v.cols) * kappa * at::linalg_matrix_norm(m, 2).item<double>();
      EXPECT_LE(got_gap, bound) << "step " << t << ", the " << v.rows << " x " << v.cols;
      worst_ratio = std::max(worst_ratio, got_gap / bound);
    }
    const auto dense = bucket.buffer.narrow(0, kDenseFrom, kDenseLength).to(at::kDouble);
    EXPECT_LE((dense - mean.narrow(0, kDenseFrom, kDenseLength)).abs().max().item<double>(),
              ranks * kU * largest);
    sum_out += bucket.buffer.to(at::kDouble);
    sum_mean += mean;
  }
  // What is still owed: the ranks' mean carried error, placed back at the matrices.
  auto carried = at::zeros({n}, at::kDouble);
  auto errors = hook.error(bucket.index).to(at::kDouble);
  comm.all_reduce(errors, loom::dist::ReduceOp::Sum);
  int64_t error_at = 0;
  for (const auto& v : kMatrices) {
    carried.narrow(0, v.offset, v.rows * v.cols).copy_(errors.narrow(0, error_at, v.rows * v.cols));
    error_at += v.rows * v.cols;
  }
  carried /= ranks;
  const double lost = (sum_out + carried - sum_mean).abs().max().item<double>();
  // Per step and rank, M = g + e and e = M - result round once each (u of the largest M or
  // error); the values sent as they are, R u in the all-reduce's sum.
  auto largest_anywhere = at::scalar_tensor(largest, at::kDouble).reshape({1});
  comm.all_reduce(largest_anywhere, loom::dist::ReduceOp::Max);
  const double bound = steps * (4.0 + ranks) * kU * largest_anywhere.item<double>();
  EXPECT_LE(lost, bound);
  EXPECT_GT(carried.abs().max().item<double>(), 100 * bound) << "no error carried";
  // Two ring all-reduces a step (dist::wire_bytes): 2 (R - 1) / R of 4 bytes per value.
  EXPECT_NEAR(sent, steps * 2.0 * (ranks - 1) / ranks * 4.0 * double(hook.values_sent(bucket)),
              1e-9 * (sent + 1));
  if (std::getenv("LOOM_TEST_VERBOSE") != nullptr)
    std::printf(
        "powersgd at %d ranks: worst gap / bound %.3g; lost %.3g, bound %.3g, carried up "
        "to %.3g\n",
        ranks, worst_ratio, lost, bound, carried.abs().max().item<double>());
}

// A mean gradient of rank <= r comes through whole: every rank's gradient is A_r B^T with B (and
// so the mean's column space of the transposes) shared, so one power-iteration step from any Q
// finds the mean exactly, up to fp32 roundings (measured relative to the largest value); the
// carried errors, each rank's own gradient less the mean, average to zero.
TEST(PowerSgdHook, AGradientOfRankRComesThroughWhole) {
  auto& comm = world();
  pd::PowerSgdHook hook(2);
  auto bucket = make_bucket();
  auto shared = at::make_generator<at::CPUGeneratorImpl>(77);
  auto own = at::make_generator<at::CPUGeneratorImpl>(78 + comm.rank());
  bucket.buffer.copy_(gradient_of(comm.rank(), 0, bucket.numel()));
  for (const auto& v : kMatrices) {
    const auto b = at::randn({v.cols, 2}, shared);
    matrix(bucket.buffer, v).copy_(at::mm(at::randn({v.rows, 2}, own), b.t()));
  }
  auto mean = bucket.buffer.clone();
  comm.all_reduce(mean, loom::dist::ReduceOp::Avg);
  hook.start(bucket, comm)->wait();
  hook.finish(bucket, comm);
  for (const auto& v : kMatrices) {
    const auto want = matrix(mean, v);
    const double scale = want.abs().max().item<double>();
    EXPECT_LE((matrix(bucket.buffer, v) - want).abs().max().item<double>(),
              64 * kU * double(v.rows + v.cols) * scale)
        << "the " << v.rows << " x " << v.cols;
  }
  auto errors = hook.error(bucket.index).clone();
  comm.all_reduce(errors, loom::dist::ReduceOp::Avg);
  EXPECT_LE(errors.abs().max().item<double>(), 1e-4 * mean.abs().max().item<double>());
}

// The state (error and Q) round-trips: a hook restored from another's state() reduces the next
// step to the same bits; a NaN in one rank's gradient reaches every rank's result, and the step
// leaves no NaN behind (error 0, Q drawn afresh: the first step's Q again).
TEST(PowerSgdHook, StateRoundTripsAndANaNDoesNotOutliveItsStep) {
  auto& comm = world();
  pd::PowerSgdHook hook(2);
  auto bucket = make_bucket();
  const int64_t n = bucket.numel();
  at::Tensor first_q;
  for (int t = 0; t < 3; ++t) {
    bucket.buffer.copy_(gradient_of(comm.rank(), t, n));
    auto work = hook.start(bucket, comm);
    if (t == 0) first_q = hook.q(bucket.index).clone();
    work->wait();
    hook.finish(bucket, comm);
  }
  pd::PowerSgdHook restored(2);
  restored.load_state(hook.state());
  auto twin = make_bucket();
  for (auto* b : {&bucket, &twin}) b->buffer.copy_(gradient_of(comm.rank(), 3, n));
  hook.start(bucket, comm)->wait();
  hook.finish(bucket, comm);
  restored.start(twin, comm)->wait();
  restored.finish(twin, comm);
  EXPECT_TRUE(at::equal(bucket.buffer, twin.buffer));
  EXPECT_TRUE(at::equal(hook.error(bucket.index), restored.error(twin.index)));
  EXPECT_TRUE(at::equal(hook.q(bucket.index), restored.q(twin.index)));

  bucket.buffer.copy_(gradient_of(comm.rank(), 4, n));
  if (comm.rank() == 0) bucket.buffer[100] = std::numeric_limits<float>::quiet_NaN();
  hook.start(bucket, comm)->wait();
  hook.finish(bucket, comm);
  EXPECT_FALSE(at::isfinite(matrix(bucket.buffer, kMatrices[0])).all().item<bool>());
  EXPECT_TRUE(at::equal(hook.error(bucket.index), at::zeros_like(hook.error(bucket.index))));
  EXPECT_TRUE(at::equal(hook.q(bucket.index), first_q));

  // State that does not fit the bucket is named, not used.
  pd::PowerSgdHook wrong(2);
  wrong.load_state({{"b2/error", at::zeros({5})}, {"b2/q", at::zeros({3})}});
  EXPECT_THROW(wrong.start(bucket, comm), loom::Error);
}

// A matrix whose gradient is zero on every rank for a step gives a zero P column, so Q = M^T P
// comes back zero; warm start would keep it there and send that matrix as zeros for good. The
// dead columns take the first Q's again, and the next step's gradients come through.
TEST(PowerSgdHook, AZeroGradientDoesNotStallTheFactors) {
  auto& comm = world();
  pd::PowerSgdHook hook(2);
  auto bucket = make_bucket();
  const int64_t n = bucket.numel();
  auto work = hook.start(bucket, comm);  // every gradient zero
  const auto first_q = hook.q(bucket.index).clone();
  work->wait();
  hook.finish(bucket, comm);
  EXPECT_TRUE(at::equal(hook.q(bucket.index), first_q));
  bucket.buffer.copy_(gradient_of(comm.rank(), 1, n));
  auto mean = bucket.buffer.clone();
  comm.all_reduce(mean, loom::dist::ReduceOp::Avg);
  hook.start(bucket, comm)->wait();
  hook.finish(bucket, comm);
  for (const auto& v : kMatrices)
    EXPECT_GT(matrix(bucket.buffer, v).abs().max().item<double>(),
              0.1 * matrix(mean, v).abs().max().item<double>())
        << "the " << v.rows << " x " << v.cols << " came through as zeros";
}

// With bf16 gradients the carried error is M less the gradient as stored (rounded to bf16), so
// the rounding is fed back too: error + stored gradient = M within fp32 rounding, where the bf16
// rounding alone is about 2^-9 of the values.
TEST(PowerSgdHook, Bf16GradientsFeedTheirRoundingBack) {
  auto& comm = world();
  pd::PowerSgdHook hook(2);
  auto bucket = make_bucket();
  bucket.buffer = bucket.buffer.to(at::kBFloat16);
  for (int t = 0; t < 3; ++t) {
    bucket.buffer.copy_(gradient_of(comm.rank(), t, bucket.numel()));
    auto work = hook.start(bucket, comm);
    const auto big = hook.error(bucket.index).clone();  // M, between start and finish
    work->wait();
    hook.finish(bucket, comm);
    int64_t from = 0;
    for (const auto& v : kMatrices) {
      const auto m = big.narrow(0, from, v.rows * v.cols).view({v.rows, v.cols});
      const auto e = hook.error(bucket.index).narrow(0, from, v.rows * v.cols).view(m.sizes());
      from += v.rows * v.cols;
      const double gap =
          (e + matrix(bucket.buffer, v).to(at::kFloat) - m).abs().max().item<double>();
      EXPECT_LE(gap, 4 * kU * m.abs().max().item<double>()) << "step " << t;
    }
  }
}
