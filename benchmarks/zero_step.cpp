// loom-bench-zero-step: ZeRO stages 0-3 side by side in one run. Under `mpirun -np N`, it
// builds one Trainer per stage (same model, data, seed and global batch; dp = N), then times
// their training steps interleaved (stage 0, 1, 2, 3, stage 0, ...) so machine noise hits every
// stage alike: each step is the slowest rank's wall time, after one warm-up step per stage.
// Rank 0 prints one JSON line per stage: median step time and its ratio to stage 0, and the
// per-rank memory the Trainer reports (parameters, gradients, optimizer state counted from
// tensors; peak activations measured by the allocator during the step).
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "bench_util.h"
#include "loom/apps/cli.h"
#include "loom/core/files.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{"ZeRO stages 0-3: per-rank memory and step time.", "loom-bench-zero-step"};
  std::string preset = "gpt2-mini";
  std::string checkpointing = "none";
  int64_t batch = 8, seq_len = 64, steps = 5;
  double bucket_mb = 4.0;
  int threads = 1;
  app.add_option("--preset", preset, "GPT-2 or Llama preset (byte vocabulary)")
      ->capture_default_str();
  app.add_option("--batch-size", batch, "Global batch (sequences per step)")->capture_default_str();
  app.add_option("--seq-len", seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps per stage")->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb, "Gradient bucket size (MiB)")->capture_default_str();
  app.add_option("--activation-checkpointing", checkpointing, "none | full | selective")
      ->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads per rank")->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace(loom::dist::RuntimeOptions{.threads = threads});
    auto world = runtime->world();
    const int64_t n = world->size();
    // Synthetic bytes as the corpus, written by rank 0 into a directory every rank can see.
    auto id = at::zeros({1}, at::kLong);
    if (world->rank() == 0) id.fill_(static_cast<int64_t>(std::random_device{}() & 0x7fffffff));
    world->broadcast(id, 0);
    const auto dir = std::filesystem::temp_directory_path() /
                     fmt::format("loom_bench_zero_{}", id.item<int64_t>());
    if (world->rank() == 0) {
      std::filesystem::create_directories(dir);
      std::vector<uint16_t> tokens(1 << 20);
      std::mt19937 gen(1);
      for (auto& t : tokens) t = static_cast<uint16_t>(gen() % 256);
      loom::data::write_llmc_shard(dir / "train.bin", tokens);
      loom::data::save_tokenizer_meta(loom::data::ByteTokenizer(), dir);
    }
    world->barrier();

    const auto mesh = runtime->mesh({});
    std::vector<std::unique_ptr<loom::train::Trainer>> trainers;
    for (int64_t stage = 0; stage <= 3; ++stage) {
      loom::train::TrainConfig c;
      c.model = loom::models::to_string(loom::models::ModelConfig::preset(preset).family);
      c.preset = preset;
      c.data = (dir / "train.bin").string();
      c.seq_len = seq_len;
      c.batch_size = batch;
      c.steps = 1000000;
      c.warmup_steps = 1;
      c.log_every = 1000000;
      c.bucket_mb = bucket_mb;
      c.zero = stage;
      c.activation_checkpointing = checkpointing;
      trainers.push_back(std::make_unique<loom::train::Trainer>(c, mesh));
    }
    std::vector<std::vector<double>> times(trainers.size());
    for (int64_t i = 0; i < steps + 1; ++i)
      for (size_t s = 0; s < trainers.size(); ++s) {
        world->barrier();
        const auto start = std::chrono::steady_clock::now();
        trainers[s]->train_step();
        auto t = at::full(
            {1}, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
            at::kDouble);
        world->all_reduce(t, loom::dist::ReduceOp::Max);
        if (i > 0) times[s].push_back(t.item<double>());
      }
    const double stage0 = loom::bench::median(times[0]);
    for (size_t s = 0; s < trainers.size(); ++s) {
      const auto m = trainers[s]->memory_report();
      if (world->rank() != 0) continue;
      int64_t params = 0;
      for (const auto& p : trainers[s]->model().parameters()) params += p.numel();
      nlohmann::json j = {
          {"bench", "zero_step"},
          {"stage", s},
          {"dp", n},
          {"preset", preset},
          {"params", params},
          {"batch", batch},
          {"seq_len", seq_len},
          {"activation_checkpointing", checkpointing},
          {"threads", threads},
          {"step_s", loom::bench::median(times[s])},
          {"step_vs_stage0", loom::bench::median(times[s]) / stage0},
          {"parameters_mib", m.parameters / 1048576.0},
          {"gradients_mib", m.gradients / 1048576.0},
          {"optimizer_mib", m.optimizer / 1048576.0},
          {"peak_activations_mib", m.peak_activations / 1048576.0},
          {"state_bytes_per_param", static_cast<double>(m.parameters + m.gradients + m.optimizer) /
                                        static_cast<double>(params)}};
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
    trainers.clear();
    world->barrier();
    std::error_code ec;
    if (world->rank() == 0) loom::core::remove_tree(dir, ec);
    return 0;
  });
}
