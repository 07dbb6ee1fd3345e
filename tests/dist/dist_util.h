#pragma once
// Helpers of the multi-rank tests: the process's Runtime, a directory every rank shares, and the
// test gradients of the communication-hook tests.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

#include "../test_util.h"
#include "loom/core/files.h"
#include "loom/dist/runtime.h"
#include "loom/parallel/data/comm_hook.h"

namespace loom::testing {

inline dist::Runtime*& runtime_slot() {
  static dist::Runtime* rt = nullptr;
  return rt;
}
inline void set_runtime(dist::Runtime* rt) {
  runtime_slot() = rt;
}
inline dist::Runtime& runtime() {
  return *runtime_slot();
}
inline dist::Communicator& world() {
  return *runtime().world();
}

// Rank `rank`'s test gradient at step `step` (n values) from a generator seeded with
// seed + 31 rank + step: the same on every rank that asks, so each can form the mean.
inline at::Tensor rank_gradient(int seed, int rank, int step, int64_t n) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed + 31 * rank + step);
  return at::randn({n}, g) * (1.0 + step % 3) + 0.01 * rank;
}

// ZeRO's reduction of `bucket` through `hook` into `recv` (start, wait, finish); returns the bytes
// this rank sent.
inline double reduce_scatter_through(parallel::data::CommHook& hook,
                                     parallel::data::GradBucket& bucket, const at::Tensor& recv,
                                     dist::Communicator& comm) {
  const double before = comm.bytes_sent();
  hook.start_reduce_scatter(bucket, recv, comm)->wait();
  hook.finish_reduce_scatter(bucket, recv, comm);
  return comm.bytes_sent() - before;
}

// Error feedback loses nothing: over `steps` reductions the outputs summed (`sum_out`) equal the
// true means summed (`sum_mean`) minus what the ranks still owe (`owed`), up to fp32 roundings —
// (R + 32) u of the largest value compressed per step (a gradient or twice a carried error), a
// few roundings per add, as many adds as ranks — while what is owed, the size of what a lost or
// doubled error would leave, is over 100 times that bound. All fp64, this rank's part.
inline void expect_feedback_loses_nothing(const at::Tensor& sum_out, const at::Tensor& sum_mean,
                                          const at::Tensor& owed, int64_t steps, double largest,
                                          const std::string& what) {
  const double lost = (sum_out - sum_mean + owed).abs().max().item<double>();
  const double bound = static_cast<double>(steps) * (world().size() + 32) * 0x1p-24 * largest;
  EXPECT_LE(lost, bound) << what;
  EXPECT_GT(owed.abs().max().item<double>(), 100 * bound) << what << ": no error carried";
  if (std::getenv("LOOM_TEST_VERBOSE") != nullptr)
    std::printf("%s at %d ranks: lost %.3g, bound %.3g, owed up to %.3g\n", what.c_str(),
                world().size(), lost, bound, owed.abs().max().item<double>());
}

// The mean over the world's ranks of their rank_gradient(seed, rank, step, n), in fp64 (every rank
// computes it alone); *largest grows to the largest magnitude among them when given.
inline at::Tensor mean_rank_gradient(int seed, int step, int64_t n, double* largest = nullptr) {
  const int ranks = world().size();
  auto mean = at::zeros({n}, at::kDouble);
  for (int r = 0; r < ranks; ++r) {
    const auto g = rank_gradient(seed, r, step, n);
    if (largest != nullptr) *largest = std::max(*largest, g.abs().max().item<double>());
    mean += g.to(at::kDouble) / ranks;
  }
  return mean;
}

// Whether every rank of the world holds the same bits in t. Collective.
inline bool same_on_every_rank(const at::Tensor& t) {
  auto all = at::empty({world().size(), t.numel()}, t.options());
  world().all_gather(all, t.contiguous().view({-1}));
  for (int r = 1; r < world().size(); ++r)
    if (!at::equal(all[r], all[0])) return false;
  return true;
}

// A fresh directory with the same path on every rank (rank 0 picks the name), removed at scope
// exit once every rank is done with it. Collective over the world.
class SharedTempDir {
 public:
  SharedTempDir() {
    auto id = at::zeros({1}, at::kLong);
    if (world().rank() == 0) id.fill_(static_cast<int64_t>(std::random_device{}() & 0x7fffffff));
    world().broadcast(id, 0);
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("loom_dist_test_{}", id.item<int64_t>());
    if (world().rank() == 0) std::filesystem::create_directories(path_);
    world().barrier();
  }
  ~SharedTempDir() {
    world().barrier();
    std::error_code ec;
    if (world().rank() == 0) loom::core::remove_tree(path_, ec);
  }
  SharedTempDir(const SharedTempDir&) = delete;
  SharedTempDir& operator=(const SharedTempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// Rank 0 writes the byte-level corpus (train.bin, val.bin, tokenizer meta) into `dir`; every
// rank returns once it is there.
inline void write_shared_corpus(const SharedTempDir& dir, size_t train_bytes, size_t val_bytes) {
  if (world().rank() == 0) write_corpus_data(dir.path(), train_bytes, val_bytes);
  world().barrier();
}

}  // namespace loom::testing
