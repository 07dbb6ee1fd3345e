// loom-bench-tp-step: tensor parallelism against data parallelism on the same ranks, and the bytes
// the TP collectives move against the formula. Under `mpirun -np N`, for GPT-2-shaped layers
// (a preset's width, heads and MLP, --layers of them), it times full training steps (forward,
// backward, gradient sync, clip, AdamW; median of --steps after one warm-up) in three layouts
// of the same global batch:
//   dp     dp = N, tp = 1: each rank the whole model and 1/N of the batch
//   tp     tp = N: each rank 1/N of every layer and the whole batch
//   tp+sp  tp = N with sequence parallelism
// and counts, per step, the elements the TP collectives moved: analytic figure per step =
// (4 * layers + 2) * b * s * h for activations (two region entries and two exits per block,
// each forward and backward, plus the embedding's exit and the head's entry), as all-reduces
// without sequence parallelism and as the same number of all-gathers plus reduce-scatters with
// it; plus 3 * b * s fp32 values for the vocabulary-parallel loss. Rank 0 prints one JSON line
// per layout.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "loom/apps/cli.h"
#include "bench_util.h"
#include "loom/loom.h"

namespace {

using Clock = std::chrono::steady_clock;

using loom::bench::median;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tensor parallelism vs data parallelism: step time and communication volume.",
               "loom-bench-tp-step"};
  std::string preset = "gpt2-124m";
  int64_t layers = 2, batch = 4, seq_len = 128, steps = 5, vocab = 8192;
  int threads = 1;
  app.add_option("--preset", preset, "GPT-2 preset whose layer shape to use")
      ->capture_default_str();
  app.add_option("--layers", layers, "Transformer blocks")->capture_default_str();
  app.add_option("--batch-size", batch, "Global batch (sequences per step)")->capture_default_str();
  app.add_option("--seq-len", seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--vocab-size", vocab, "Vocabulary")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps per layout")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads per rank")->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    namespace pt = loom::parallel::tensor;
    runtime.emplace(loom::dist::RuntimeOptions{.threads = threads});
    auto world = runtime->world();
    const int64_t n = world->size();
    LOOM_CHECK(batch % n == 0, "--batch-size {} must be divisible by the {} ranks", batch, n);
    LOOM_CHECK(seq_len % n == 0,
               "--seq-len {} must be divisible by the {} ranks (sequence parallelism splits it)",
               seq_len, n);
    auto config = loom::models::ModelConfig::preset(preset);
    config.vocab_size = vocab;
    config.n_layers = layers;
    config.max_seq_len = std::max(config.max_seq_len, seq_len);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    auto tokens = at::randint(vocab, {batch, seq_len + 1}, gen, at::kLong);

    for (const std::string layout : {"dp", "tp", "tp+sp"}) {
      const bool tp_on = layout != "dp";
      auto group = std::make_shared<pt::TpGroup>(
          tp_on ? world : nullptr, pt::TpOptions{.sequence_parallel = layout == "tp+sp"});
      auto model = loom::models::make_model(config, group);
      loom::models::init_parameters(*model, 1);
      loom::core::NamedTensors params;
      for (const auto& item : model->named_parameters())
        params.emplace_back(item.key(), item.value());
      std::unique_ptr<loom::parallel::data::DataParallel> dp;
      if (!tp_on) dp = std::make_unique<loom::parallel::data::DataParallel>(params, world);
      pt::PartialGradSync partial(params, model->shard_specs(), group);
      loom::train::AdamW optimizer(params, {});
      // dp: this rank's 1/n of the batch; tp: the whole batch on every rank.
      const int64_t rows = tp_on ? batch : batch / n, first = tp_on ? 0 : world->rank() * rows;
      auto inputs = tokens.narrow(0, first, rows).narrow(1, 0, seq_len);
      auto targets = tokens.narrow(0, first, rows).narrow(1, 1, seq_len);
      std::vector<double> times;
      loom::parallel::tensor::TpCommStats stats;
      for (int64_t i = 0; i < steps + 1; ++i) {
        world->barrier();
        group->stats().reset();
        const auto start = Clock::now();
        model->loss(inputs, targets).backward();
        if (dp) dp->finish_gradient_sync();
        partial.sync();
        loom::train::clip_grad_norm(*model, 1.0);
        optimizer.step(1e-4);
        if (dp)
          dp->zero_grad();
        else
          optimizer.zero_grad();
        auto s =
            at::full({1}, std::chrono::duration<double>(Clock::now() - start).count(), at::kDouble);
        world->all_reduce(s, loom::dist::ReduceOp::Max);
        if (i > 0) times.push_back(s.item<double>());
        stats = group->stats();
      }
      const int64_t bsh = batch * seq_len * config.d_model;
      const int64_t analytic = tp_on ? (4 * layers + 2) * bsh : 0;
      const int64_t counted =
          layout == "tp+sp" ? stats.all_gather_elements : stats.all_reduce_elements;
      if (world->rank() == 0) {
        nlohmann::json j = {{"bench", "tp_step"},
                            {"layout", layout},
                            {"ranks", n},
                            {"preset", preset},
                            {"layers", layers},
                            {"d_model", config.d_model},
                            {"batch", batch},
                            {"seq_len", seq_len},
                            {"vocab", vocab},
                            {"threads", threads},
                            {"step_s", median(times)},
                            {"tp_all_reduce_elements", stats.all_reduce_elements},
                            {"tp_all_gather_elements", stats.all_gather_elements},
                            {"tp_reduce_scatter_elements", stats.reduce_scatter_elements},
                            {"tp_loss_elements", stats.loss_elements},
                            {"tp_bytes", stats.bytes},
                            {"analytic_elements_per_kind", analytic},
                            {"counted_equals_analytic",
                             counted == analytic &&
                                 (layout != "tp+sp" || stats.reduce_scatter_elements == analytic)}};
        std::printf("%s\n", j.dump().c_str());
        std::fflush(stdout);
      }
    }
    return 0;
  });
}
