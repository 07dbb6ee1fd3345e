// loom-bench-adamw: one AdamW step over a model's parameters on the CPU, three ways, from the same
// state and gradients: loom's vectorised pass (ops::adamw_update_, what loom's optimizers and
// ZeRO's offloaded optimizer run), torch::optim::AdamW (LibTorch's C++ optimizer: ATen ops per
// tensor) and at::_fused_adamw_ (the fused CPU kernel behind PyTorch's AdamW(fused=True)). The
// variants take turns step by step, so machine noise hits all alike; one JSON line per variant:
// the median step time and parameters per second, and the ratio to loom's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "loom/apps/cli.h"
#include "loom/loom.h"

namespace {

struct Options {
  std::string preset = "gpt2-mini";
  int64_t steps = 10;
  int threads = 2;
};

void run(const Options& o) {
  LOOM_CHECK(o.steps > 0, "--steps {} must be positive", o.steps);
  LOOM_CHECK(o.threads > 0, "--threads {} must be positive", o.threads);
  at::set_num_threads(o.threads);
  const auto model = loom::models::make_model(loom::models::ModelConfig::preset(o.preset));
  const loom::ops::AdamWOptions hp{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  const double lr = 1e-3;

  // One set of buffers per variant (each updates its own in place), equal at the start.
  struct Buffers {
    std::vector<at::Tensor> w, g, m, v;
  };
  auto gen = loom::core::make_generator(1);
  Buffers ours;
  int64_t params = 0;
  for (const auto& p : model->parameters()) {
    ours.w.push_back(at::randn(p.sizes(), gen, at::kFloat) * 0.02);
    ours.g.push_back(at::randn(p.sizes(), gen, at::kFloat));
    ours.m.push_back(at::zeros(p.sizes()));
    ours.v.push_back(at::zeros(p.sizes()));
    params += p.numel();
  }
  auto copy = [](const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> out;
    for (const auto& t : ts) out.push_back(t.clone());
    return out;
  };
  Buffers fused{copy(ours.w), ours.g, copy(ours.m), copy(ours.v)};
  std::vector<at::Tensor> fused_steps;
  for (size_t i = 0; i < ours.w.size(); ++i) fused_steps.push_back(at::zeros({}, at::kFloat));
  std::vector<at::Tensor> torch_params;
  for (size_t i = 0; i < ours.w.size(); ++i) {
    torch_params.push_back(ours.w[i].clone().requires_grad_());
    torch_params.back().mutable_grad() = ours.g[i];
  }
  torch::optim::AdamW torch_opt(torch_params, torch::optim::AdamWOptions(lr)
                                                  .betas({hp.beta1, hp.beta2})
                                                  .eps(hp.eps)
                                                  .weight_decay(hp.weight_decay));

  int64_t step = 0;
  struct Variant {
    const char* name;
    std::function<void()> step;
    std::vector<double> ms;
  };
  std::vector<Variant> variants = {
      {"loom ops::adamw_update_",
       [&] {
         for (size_t i = 0; i < ours.w.size(); ++i)
           loom::ops::adamw_update_(ours.w[i], ours.g[i], ours.m[i], ours.v[i], lr, step, hp,
                                    /*decay=*/true);
       },
       {}},
      {"torch::optim::AdamW", [&] { torch_opt.step(); }, {}},
      {"at::_fused_adamw_",
       [&] {
         // The step counters are the kernel's own state (it increments them).
         at::_fused_adamw_(fused.w, fused.g, fused.m, fused.v, {}, fused_steps, lr, hp.beta1,
                           hp.beta2, hp.weight_decay, hp.eps, /*amsgrad=*/false,
                           /*maximize=*/false);
       },
       {}},
  };
  for (step = 1; step <= o.steps + 1; ++step) {  // step 1 is the warm-up
    for (auto& v : variants) {
      const auto start = std::chrono::steady_clock::now();
      v.step();
      const std::chrono::duration<double, std::milli> took =
          std::chrono::steady_clock::now() - start;
      if (step > 1) v.ms.push_back(took.count());
    }
  }
  // The three ran the same updates: a sanity check, not the accuracy test (that is
  // AdamWKernel.TracksTorchOptimAdamWOverManySteps).
  auto max_diff = [](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i)
      worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
    return worst;
  };
  std::vector<at::Tensor> torch_w;
  for (const auto& p : torch_params) torch_w.push_back(p.detach());
  const double loom_ms = loom::bench::median(variants[0].ms);
  for (const auto& v : variants) {
    const double ms = loom::bench::median(v.ms);
    const nlohmann::ordered_json row = {
        {"variant", v.name},
        {"preset", o.preset},
        {"parameters", params},
        {"tensors", ours.w.size()},
        {"threads", at::get_num_threads()},
        {"steps", o.steps},
        {"median_ms", ms},
        {"parameters_per_s", static_cast<double>(params) / (ms * 1e-3)},
        {"time_vs_loom", ms / loom_ms}};
    std::printf("%s\n", row.dump().c_str());
  }
  std::fprintf(stderr, "max |w loom - w torch| = %.3g, |w loom - w fused| = %.3g\n",
               max_diff(ours.w, torch_w), max_diff(ours.w, fused.w));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "One AdamW step on the CPU: loom's vectorised pass against torch::optim::AdamW and "
      "PyTorch's fused kernel.",
      "loom-bench-adamw"};
  Options o;
  app.add_option("--preset", o.preset, "Model whose parameter shapes are updated")
      ->capture_default_str();
  app.add_option("--steps", o.steps, "Timed steps (after one warm-up)")->capture_default_str();
  app.add_option("--threads", o.threads, "Intra-op threads")->capture_default_str();
  return loom::apps::run_app(app, argc, argv, [&] { run(o); });
}
