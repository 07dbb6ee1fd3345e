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

#include "dist_util.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/cuda.h"
#include "loom/train/trainer.h"

#include <algorithm>

namespace loom::testing {

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;  // before clipping, per step
  double val_loss = 0;
  std::map<std::string, at::Tensor> params;
};

// The device the layout tests train on: LOOM_TEST_DEVICE, "cpu" when unset. scripts/gpu-check
// sets "cuda" and runs them with every rank on its one GPU (docs/gpu.md).
inline std::string test_device() {
  const char* device = std::getenv("LOOM_TEST_DEVICE");
  return device != nullptr && *device != '\0' ? device : "cpu";
}

// The mesh a layout test trains on, for tensors on test_device(): MPI groups on the CPU; on a
// GPU each group on the transport the backend plan gives it (host staging when the ranks share
// one GPU, as under scripts/gpu-check).
inline dist::MeshPtr layout_mesh(dist::MeshShape shape) {
  const auto device = test_device();
  if (device == "cpu") return runtime().mesh(shape);
  const int cuda = dist::rank_cuda_device(device, runtime().local_rank(), ops::cuda_device_count(),
                                          ops::built_with_cuda());
  return runtime().mesh(shape, dist::BackendChoice::automatic, cuda);
}

// GPT-2 tiny on the byte corpus in `dir` (write_shared_corpus), 4 steps: the run every layout
// test compares, in fp64 unless `precision` says otherwise (docs/testing.md: why fp64). batch 24
// divides by dp x accum for dp = 1..4 and accum = 1, 2; 0.05 MiB buckets make several buckets
// even for the tiny model.
inline loom::train::TrainConfig small_run_config(const std::filesystem::path& dir,
                                                 int64_t grad_accum,
                                                 const std::string& precision = "fp64") {
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
  c.precision = precision;
  c.device = test_device();
  return c;
}

// GPT-2 tiny or Llama tiny (4 heads, 2 kv heads) on the byte corpus in `dir`, 3 steps in fp64,
// vocabulary 257 (the byte data uses ids < 256; 257 makes tp pad it): the run the tensor- and
// context-parallel layout tests compare.
inline loom::train::TrainConfig tiny_layout_config(const std::filesystem::path& dir,
                                                   const std::string& model) {
  loom::train::TrainConfig c;
  c.model = model;
  c.preset = model == "gpt2" ? "gpt2-tiny" : "llama-tiny";
  c.vocab_size = 257;
  c.data = (dir / "train.bin").string();
  c.val_data = (dir / "val.bin").string();
  c.seq_len = 32;
  c.batch_size = 8;
  c.steps = 3;
  c.lr = 3e-3;
  c.warmup_steps = 1;
  c.log_every = 1000;
  c.eval_batches = 1;
  c.precision = "fp64";  // compared with the fp64 bounds below
  c.device = test_device();
  return c;
}

// A layout a test trains under and compares with one process.
struct TrainLayout {
  const char* name;
  dist::MeshShape shape;
  int64_t zero = 0;
  bool sequence_parallel = false;
  bool interleaved = false;            // 2 virtual stages per rank
  const char* checkpointing = "none";  // --activation-checkpointing
  const char* partition = "flops";     // --pp-partition
  bool without_dropout = false;        // only for configs without dropout (context parallelism)
};

// `config` set to run as `layout`: its mesh sizes, ZeRO stage and settings; a pipeline gets
// 2 micro-batches (interleaved: 2 virtual stages).
inline loom::train::TrainConfig with_layout(loom::train::TrainConfig c, const TrainLayout& l) {
  c.dp = l.shape.dp;
  c.tp = l.shape.tp;
  c.pp = l.shape.pp;
  c.cp = l.shape.cp;
  c.zero = l.zero;
  c.sequence_parallel = l.sequence_parallel;
  c.activation_checkpointing = l.checkpointing;
  c.pp_partition = l.partition;
  if (l.interleaved) {
    c.schedule = "interleaved";
    c.virtual_stages = 2;
  }
  if (l.shape.pp > 1) c.grad_accum = 2;
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
  // Single-process tensors, assembled from tensor-parallel or ZeRO-3 shards (collective), on the
  // host whatever the layout left them on (pipeline stages arrive there), so that runs on
  // different layouts compare.
  for (const auto& [name, p] : t.gather_parameters())
    r.params[name] = p.to(at::kCPU, at::kDouble).clone();
  return r;
}

// `config` trained in this process alone (a Trainer on a mesh of one rank).
inline RunResult run_alone(const loom::train::TrainConfig& config) {
  loom::train::Trainer t(config);
  return run(t);
}

// How far one run is from another: the worst relative difference of each kind.
struct RunDifference {
  double loss = 0;        // worst step (and the validation loss), relative
  double grad_norm = 0;   // worst step, relative
  double parameters = 0;  // all parameters as one vector: |got - want| / |want|
  double tensor = 0;      // worst tensor, |got - want| / |want|
  std::string tensor_name;
  double key_bias = 0;  // the attention key bias, absolute (see below)
  std::string describe() const {
    return fmt::format(
        "loss {:.3g}, grad norm {:.3g}, parameters {:.3g}, worst tensor {:.3g} ({}), "
        "key bias {:.3g} absolute",
        loss, grad_norm, parameters, tensor, tensor_name, key_bias);
  }
};

// max that keeps a NaN: a NaN difference is the worst there is, never overwritten.
inline double worst_of(double worst, double x) {
  if (std::isnan(worst)) return worst;
  return std::isnan(x) || x > worst ? x : worst;
}

inline RunDifference compare_runs(const RunResult& got, const RunResult& want) {
  RunDifference d;
  const auto relative = [](double a, double b) { return std::abs(a - b) / std::abs(b); };
  EXPECT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < std::min(got.losses.size(), want.losses.size()); ++s)
    d.loss = worst_of(d.loss, relative(got.losses[s], want.losses[s]));
  d.loss = worst_of(d.loss, relative(got.val_loss, want.val_loss));
  // The gradient norm counts every element of the single-process gradient once, whatever the
  // layout shards or replicates.
  if (got.grad_norms.size() == want.grad_norms.size())
    for (size_t s = 0; s < want.grad_norms.size(); ++s)
      d.grad_norm = worst_of(d.grad_norm, relative(got.grad_norms[s], want.grad_norms[s]));
  double diff2 = 0, norm2 = 0;
  for (const auto& [name, want_p] : want.params) {
    auto p = want_p;
    auto it = got.params.find(name);
    if (it == got.params.end()) {
      ADD_FAILURE() << "parameter " << name << " is missing";
      continue;
    }
    auto q = it->second;
    if (name.ends_with("attn.c_attn.bias")) {
      // The key bias adds q.b to all of a query's scores, which softmax cancels: its true
      // gradient is exactly zero, what it gets is rounding noise, and Adam makes steps of that
      // noise (at most lr * noise / eps each). Its values are held to an absolute bound; query
      // and value biases are compared like every other tensor.
      const auto third = p.size(0) / 3;
      d.key_bias = worst_of(
          d.key_bias,
          (q.narrow(0, third, third) - p.narrow(0, third, third)).abs().max().item<double>());
      p = at::cat({p.narrow(0, 0, third), p.narrow(0, 2 * third, third)});
      q = at::cat({q.narrow(0, 0, third), q.narrow(0, 2 * third, third)});
    }
    const auto diff = q - p;
    diff2 += diff.pow(2).sum().item<double>();
    norm2 += p.pow(2).sum().item<double>();
    // Relative to the reference tensor; absolute where it is all zeros (a pruned weight).
    const double ref_norm = p.norm().item<double>();
    const double rel = diff.norm().item<double>() / (ref_norm > 0 ? ref_norm : 1.0);
    if (!std::isnan(d.tensor) && (std::isnan(rel) || rel > d.tensor)) {
      d.tensor = rel;  // a NaN counts as the worst, and stays
      d.tensor_name = name;
    }
  }
  d.parameters = std::sqrt(diff2 / norm2);
  if (std::getenv("LOOM_TEST_VERBOSE")) fmt::print("run difference: {}\n", d.describe());
  return d;
}

// fp64 runs of two layouts differ only by the order of sums. Each gradient element moves by
// about n*u of the terms summed into it (u = 1.1e-16; n up to ~2e4 here), and Adam turns that
// into a parameter change of at most lr * delta_g / eps = 3e-3 * 1e-13 / 1e-8 ~ 3e-8 per step for
// an element whose gradient is pure noise, typically 1e-12 relative for a tensor. Measured:
// ~1e-13 (docs/testing.md). A real bug moves a tensor by 1e-4 or more (the broken variants in
// the tests measure it), so this bound sits at least 1e5 below a bug.
inline constexpr double kFp64Relative = 1e-9;
// The attention key bias: true gradient zero, so each element is pure noise, and its steps stay
// below 4 steps x 3e-8 (the worst case above).
inline constexpr double kFp64KeyBiasAbsolute = 1e-6;

// Every kind of difference within `relative` (and the key bias within its absolute bound).
inline void expect_same_run(const RunResult& got, const RunResult& want,
                            double relative = kFp64Relative,
                            double key_bias_absolute = kFp64KeyBiasAbsolute) {
  const auto d = compare_runs(got, want);
  EXPECT_LE(d.loss, relative) << d.describe();
  EXPECT_LE(d.grad_norm, relative) << d.describe();
  EXPECT_LE(d.parameters, relative) << d.describe();
  EXPECT_LE(d.tensor, relative) << "parameter " << d.tensor_name << "; " << d.describe();
  EXPECT_LE(d.key_bias, key_bias_absolute) << d.describe();
}

// A bf16 layout against bf16 one process: every step's loss within 1e-2 relative, all
// parameters as one vector within 2e-2. Sharded runs round differently in bf16; a real bug (a bias
// added twice, a missing reduction) moves the loss by far more. Adam's first steps are close to
// lr * sign(gradient): an element whose gradient is near zero can flip sign under bf16 rounding
// and move by 2 * lr, so parameters get more room than losses. `what` names the run in the log.
inline void expect_bf16_tracks(const RunResult& got, const RunResult& want,
                               const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t s = 0; s < want.losses.size(); ++s)
    EXPECT_NEAR(got.losses[s], want.losses[s], 1e-2 * want.losses[s]) << "step " << s + 1;
  double diff2 = 0, norm2 = 0;
  for (const auto& [name, p] : want.params) {
    diff2 += (got.params.at(name) - p).pow(2).sum().item<double>();
    norm2 += p.pow(2).sum().item<double>();
  }
  EXPECT_LE(std::sqrt(diff2 / norm2), 2e-2);
  if (std::getenv("LOOM_TEST_VERBOSE")) {
    double worst = 0;
    for (size_t s = 0; s < want.losses.size(); ++s)
      worst = std::max(worst, std::abs(got.losses[s] - want.losses[s]) / want.losses[s]);
    fmt::print("bf16 {}: losses within {:.3g} relative, parameters {:.3g} relative\n", what, worst,
               std::sqrt(diff2 / norm2));
  }
}

// A deliberately broken variant must be told apart: its difference at least `factor` x the
// bound, so the bound is known to catch that bug with room to spare.
inline void expect_caught(const RunResult& broken, const RunResult& want, const char* what,
                          double factor = 1000, double relative = kFp64Relative) {
  const auto d = compare_runs(broken, want);
  fmt::print("[broken variant] {}: {}\n", what, d.describe());
  EXPECT_GE(std::max(d.tensor, d.loss), factor * relative) << what << ": " << d.describe();
}

// An fp32 layout against the fp32 single-process run, with bounds from the fp64 run of the same
// training: both fp32 runs carry their own rounding error against the (nearly exact) fp64 run,
// of the same size on the same CPU, so their difference stays within a few times the fp32 run's
// own error. 10x that, plus a floor of 100 fp32 ulps for losses, is the bound, and it follows
// the CPU: a machine whose kernels round differently measures its own error. A bug (1e-4 and up)
// is above it where the fp32 error is below 1e-5 (measured ~1e-6).
inline void expect_fp32_run_close(const RunResult& got32, const RunResult& want32,
                                  const RunResult& want64) {
  const auto error = compare_runs(want32, want64);
  const auto d = compare_runs(got32, want32);
  const double u32 = 6e-8;
  fmt::print("[fp32 smoke] fp32 vs fp64 error: {}\n[fp32 smoke] layout vs one process: {}\n",
             error.describe(), d.describe());
  EXPECT_LE(d.loss, 10 * error.loss + 100 * u32) << d.describe();
  EXPECT_LE(d.parameters, 10 * error.parameters + 100 * u32) << d.describe();
  EXPECT_LE(error.parameters, 1e-3) << "the fp32 run is far from fp64: " << error.describe();
}

}  // namespace loom::testing
