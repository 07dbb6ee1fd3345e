// loom-bench-dp-overlap: how much of the gradient all-reduce data parallelism hides behind
// backward. Under `mpirun -np N`, for a GPT-2 preset, it times (median of --steps each,
// interleaved):
//   compute  forward + backward with gradient sync off (no communication)
//   comm     the same buckets all-reduced with nothing else running
//   overlap  forward + backward with bucketed sync on, plus waiting for the last bucket
// hidden = (compute + comm - overlap) / comm: 1 when communication is entirely hidden, 0 when
// the step takes as long as doing the two one after the other. Rank 0 prints one JSON line.
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
  CLI::App app{"Data-parallel communication hidden by overlap with backward.",
               "loom-bench-dp-overlap"};
  std::string preset = "gpt2-124m";
  int64_t batch = 1, seq_len = 64, steps = 5, vocab = 50304;
  double bucket_mb = 25.0;
  int threads = 1;
  std::string hook = "avg";
  app.add_option("--preset", preset, "GPT-2 preset")->capture_default_str();
  app.add_option("--batch-size", batch, "Sequences per rank")->capture_default_str();
  app.add_option("--seq-len", seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--vocab-size", vocab, "Vocabulary (50304: GPT-2's, padded)")
      ->capture_default_str();
  app.add_option("--steps", steps, "Timed repetitions of each variant")->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb, "Gradient bucket size")->capture_default_str();
  app.add_option("--comm-hook", hook, "avg | bf16")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads per rank")->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace(loom::dist::RuntimeOptions{.threads = threads});
    auto world = runtime->world();
    auto config = loom::models::ModelConfig::preset(preset);
    config.vocab_size = vocab;
    auto model = loom::models::make_model(config);
    loom::models::init_parameters(*model, 1);
    loom::parallel::data::DataParallel::NamedParams params;
    for (const auto& item : model->named_parameters())
      params.emplace_back(item.key(), item.value());
    loom::parallel::data::DataParallel dp(
        params, world,
        {.bucket_mb = bucket_mb, .hook = loom::parallel::data::make_comm_hook(hook)});
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + world->rank());
    auto tokens = at::randint(vocab, {batch, seq_len + 1}, gen, at::kLong);
    auto inputs = tokens.narrow(1, 0, seq_len), targets = tokens.narrow(1, 1, seq_len);
    auto fwd_bwd = [&] {
      loom::models::next_token_loss(model->forward(inputs), targets).backward();
    };
    auto timed = [&](auto&& f) {
      world->barrier();
      const auto start = Clock::now();
      f();
      auto s =
          at::full({1}, std::chrono::duration<double>(Clock::now() - start).count(), at::kDouble);
      world->all_reduce(s, loom::dist::ReduceOp::Max);
      return s.item<double>();
    };
    std::vector<double> compute, comm, overlap, window;
    for (int64_t i = 0; i < steps + 1; ++i) {  // the first round warms up
      dp.zero_grad();
      dp.set_sync(false);
      const double c = timed(fwd_bwd);
      const double m = timed([&] {
        std::vector<loom::dist::WorkPtr> works;
        for (const auto& b : dp.buckets()) works.push_back(world->all_reduce_async(b.buffer));
        for (auto& w : works) w->wait();
      });
      dp.zero_grad();
      dp.set_sync(true);
      const double o = timed([&] {
        fwd_bwd();
        dp.finish_gradient_sync();
      });
      if (i == 0) continue;
      compute.push_back(c);
      comm.push_back(m);
      overlap.push_back(o);
      window.push_back(dp.last_sync().overlap_window_seconds);
    }
    if (world->rank() == 0) {
      const double c = median(compute), m = median(comm), o = median(overlap);
      double grad_bytes = 0;
      for (const auto& b : dp.buckets()) grad_bytes += static_cast<double>(b.bytes());
      nlohmann::json j = {
          {"bench", "dp_overlap"},
          {"ranks", world->size()},
          {"preset", preset},
          {"params", config.num_parameters()},
          {"batch_per_rank", batch},
          {"seq_len", seq_len},
          {"buckets", dp.buckets().size()},
          {"bucket_mb", bucket_mb},
          {"grad_MB", grad_bytes / 1e6},
          {"hook", hook},
          {"threads", threads},
          {"compute_s", c},
          {"comm_s", m},
          {"overlap_s", o},
          {"hidden_fraction", (c + m - o) / m},
          {"buckets_launched_in_backward", dp.last_sync().buckets_launched_in_backward},
          {"overlap_window_s", median(window)}};
      std::printf("%s\n", j.dump().c_str());
    }
  });
}
