#pragma once
// Comparing a distributed training run with the one-process run it must equal.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "loom/models/causal_lm.h"
#include "loom/train/trainer.h"

namespace loom::testing {

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;  // before clipping, per step
  double val_loss = 0;
  std::map<std::string, at::Tensor> params;
};

// GPT-2 tiny on the byte corpus in `dir` (write_shared_corpus), 4 steps: the run every layout
// test compares. batch 24 divides by dp x accum for dp = 1..4 and accum = 1, 2; 0.05 MiB buckets
// make several buckets even for the tiny model.
inline loom::train::TrainConfig small_run_config(const std::filesystem::path& dir,
                                                 int64_t grad_accum) {
  loom::train::TrainConfig c;
  c.model = "gpt2";
  c.preset = "gpt2-tiny";
  c.data = (dir / "train.bin").string();
  c.val_data = (dir / "val.bin").string();
  c.seq_len = 32;
  c.batch_size = 24;
  c.grad_accum = grad_accum;
  c.steps = 4;
  c.lr = 3e-3;
  c.warmup_steps = 1;
  c.log_every = 1000;
  c.eval_batches = 1;
  c.bucket_mb = 0.05;
  return c;
}

inline RunResult run(loom::train::Trainer& t) {
  RunResult r;
  while (t.step() < t.config().steps) {
    const auto step = t.train_step();
    r.losses.push_back(step.loss);
    r.grad_norms.push_back(step.grad_norm);
  }
  r.val_loss = t.evaluate(1);
  // Single-process tensors, assembled from tensor-parallel or ZeRO-3 shards (collective).
  for (const auto& [name, p] : t.gather_parameters()) r.params[name] = p.clone();
  return r;
}

// Losses at every step within `rtol`; parameters within `rtol` as one vector (the norm of the
// difference over the norm of all parameters) and each tensor within 10 x `rtol`.
//
// Why a tensor gets more room: splitting the batch across ranks changes the order of every
// gradient sum, which moves each gradient element by float rounding (~1e-7 relative). Adam then
// divides by sqrt(v) + 1e-8, so an element whose gradient is itself near 1e-8 turns that
// rounding into a visible change of its step; a few such elements per tensor show up as 1e-5
// to 4e-5 relative in some tensors (the most at 3 ranks, where the average divides by 3). A real
// bug (a missing bucket, a wrong scale, a misplaced shard) moves a tensor by
// 1e-3 or more and fails both checks.
inline void expect_same_run(const RunResult& got, const RunResult& want, double rtol) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < want.losses.size(); ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], rtol * std::abs(want.losses[s])) << "step " << s + 1;
    if (std::getenv("LOOM_TEST_VERBOSE"))
      fmt::print("step {} loss {} vs {}: relative {:.3g}\n", s + 1, got.losses[s], want.losses[s],
                 std::abs(got.losses[s] - want.losses[s]) / want.losses[s]);
  }
  EXPECT_NEAR(got.val_loss, want.val_loss, rtol * std::abs(want.val_loss));
  // The gradient norm counts every element of the single-process gradient once, whatever the
  // layout shards or replicates.
  if (got.grad_norms.size() == want.grad_norms.size()) {
    for (size_t s = 0; s < want.grad_norms.size(); ++s) {
      EXPECT_NEAR(got.grad_norms[s], want.grad_norms[s], rtol * want.grad_norms[s])
          << "grad norm, step " << s + 1;
    }
  }
  double diff2 = 0, norm2 = 0, worst = 0;
  std::string worst_name;
  for (const auto& [name, want_p] : want.params) {
    auto p = want_p, q = got.params.at(name);
    if (name.ends_with("attn.c_attn.bias")) {
      // The key bias adds q.b to all of a query's scores, which softmax cancels: its true
      // gradient is exactly zero, what it gets is rounding noise, and Adam makes steps of that
      // noise. Its values are held to an absolute bound; query and value biases are compared
      // like every other tensor.
      const auto third = p.size(0) / 3;
      EXPECT_LE((q.narrow(0, third, third) - p.narrow(0, third, third)).abs().max().item<double>(),
                1e-5)
          << name << " (key part)";
      p = at::cat({p.narrow(0, 0, third), p.narrow(0, 2 * third, third)});
      q = at::cat({q.narrow(0, 0, third), q.narrow(0, 2 * third, third)});
    }
    const auto d = q - p;
    diff2 += d.pow(2).sum().item<double>();
    norm2 += p.pow(2).sum().item<double>();
    const double rel = (d.norm() / p.norm()).item<double>();
    if (std::getenv("LOOM_TEST_VERBOSE") && rel > 1e-6)
      fmt::print("  {} {:.3g} (max abs {:.3g})\n", name, rel, d.abs().max().item<double>());
    if (rel > worst) worst = rel, worst_name = name;
  }
  const double global = std::sqrt(diff2 / norm2);
  if (std::getenv("LOOM_TEST_VERBOSE"))
    fmt::print("parameters: relative difference {:.3g} overall, worst tensor {:.3g} ({})\n", global,
               worst, worst_name);
  EXPECT_LE(global, rtol);
  EXPECT_LE(worst, 10 * rtol) << "parameter " << worst_name;
}

}  // namespace loom::testing
