// loom-bench-block-sparse: a linear layer's forward + backward on the CPU, dense
// (at::linear, what an unpruned layer costs) against ops::block_sparse_linear at several block
// sparsities, at transformer shapes. The variants take turns rep by rep, so machine noise hits
// all alike; one JSON line per (shape, sparsity): median milliseconds and the speed-up over
// dense. docs/benchmarks.md has the command and the figures.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "loom/apps/cli.h"
#include "loom/loom.h"
#include "loom/ops/block_sparse.h"

namespace {

struct Options {
  int64_t tokens = 2048;
  int64_t block = 32;
  int64_t d_model = 768;
  int64_t reps = 7;
  int threads = 2;
  std::vector<double> sparsities{0.5, 0.75, 0.9};
};

double time_ms(const std::function<void()>& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

void run(const Options& o) {
  LOOM_CHECK(o.reps > 0 && o.tokens > 0 && o.threads > 0,
             "--reps {}, --tokens {} and --threads {} must be positive", o.reps, o.tokens,
             o.threads);
  at::set_num_threads(o.threads);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  // GPT-2's linears: attention projection, MLP up, MLP down.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {o.d_model, o.d_model}, {4 * o.d_model, o.d_model}, {o.d_model, 4 * o.d_model}};
  for (const auto& [out, in] : shapes) {
    const auto x0 = at::randn({o.tokens, in}, gen);
    const auto dy = at::randn({o.tokens, out}, gen);
    auto w = (at::randn({out, in}, gen) * 0.02).requires_grad_();
    struct Variant {
      double sparsity;
      at::Tensor tiles;  // undefined: dense
      std::vector<double> ms;
    };
    std::vector<Variant> variants{{0.0, {}, {}}};
    for (const double s : o.sparsities)
      variants.push_back({s, at::rand({out / o.block, in / o.block}, gen) >= s, {}});
    for (int64_t rep = 0; rep <= o.reps; ++rep) {  // rep 0 is the warm-up
      for (auto& v : variants) {
        auto x = x0.clone().requires_grad_();
        w.mutable_grad() = at::Tensor();
        const double ms = time_ms([&] {
          const auto y = v.tiles.defined() ? loom::ops::block_sparse_linear(x, w, v.tiles, o.block)
                                           : at::linear(x, w);
          y.backward(dy);
        });
        if (rep > 0) v.ms.push_back(ms);
      }
    }
    const double dense_ms = loom::bench::median(variants[0].ms);
    for (const auto& v : variants) {
      const double ms = loom::bench::median(v.ms);
      const double kept = v.tiles.defined() ? v.tiles.to(at::kDouble).mean().item<double>() : 1.0;
      const nlohmann::ordered_json row = {{"out", out},
                                          {"in", in},
                                          {"tokens", o.tokens},
                                          {"block", o.block},
                                          {"variant", v.tiles.defined() ? "block_sparse" : "dense"},
                                          {"sparsity", v.sparsity},
                                          {"tiles_kept", kept},
                                          {"threads", at::get_num_threads()},
                                          {"median_ms_fwd_bwd", ms},
                                          {"speedup_vs_dense", dense_ms / ms}};
      std::printf("%s\n", row.dump().c_str());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "A linear layer's forward + backward on the CPU: dense against loom's block-sparse "
      "product at several block sparsities.",
      "loom-bench-block-sparse"};
  Options o;
  app.add_option("--tokens", o.tokens, "Rows of the activations (batch x sequence)")
      ->capture_default_str();
  app.add_option("--block", o.block, "Tile size B (B x B tiles)")->capture_default_str();
  app.add_option("--d-model", o.d_model, "Model width (shapes d x d, 4d x d, d x 4d)")
      ->capture_default_str();
  app.add_option("--sparsities", o.sparsities, "Block sparsities to time")->capture_default_str();
  app.add_option("--reps", o.reps, "Timed repetitions (after one warm-up)")->capture_default_str();
  app.add_option("--threads", o.threads, "Intra-op threads")->capture_default_str();
  return loom::apps::run_app(app, argc, argv, [&] { run(o); });
}
