// loom-example-pipeline: pipeline parallelism over your own LibTorch module, driven by a
// schedule you write yourself, in ~120 lines.
//
//   mpirun -np 2 build/examples/loom-example-pipeline
//
// A residual MLP of 8 blocks is split into one stage per rank. A custom schedule, "lifo-gpipe"
// (all forwards, then the backwards newest first), is registered by name exactly as a
// zero-bubble schedule would be, checked by loom's simulator, and run by PipelineExecutor.
// The same module trained on one process (the twin, on every rank) must end with the same
// weights (exit status 1 if not).
#include <torch/torch.h>

#include <cstdio>
#include <optional>

#include "loom/apps/cli.h"
#include "loom/loom.h"

namespace pl = loom::parallel::pipeline;

namespace {

// All forwards, then the backwards in reverse order: the newest micro-batch's activations go
// first. It is a Schedule like the built-in ones: a name and each rank's list of actions.
class LifoGPipe : public pl::Schedule {
 public:
  std::string name() const override { return "lifo-gpipe"; }
  std::vector<pl::Action> actions(int64_t /*rank*/, const pl::PipelineShape& shape) const override {
    std::vector<pl::Action> out;
    for (int64_t m = 0; m < shape.micro_batches; ++m) out.push_back(pl::forward(m));
    for (int64_t m = shape.micro_batches - 1; m >= 0; --m) out.push_back(pl::backward(m));
    return out;
  }
};
LOOM_REGISTER_SCHEDULE(LifoGPipe, "lifo-gpipe");  // now --schedule lifo-gpipe finds it too

constexpr int64_t kBlocks = 8, kWidth = 16, kMicroBatches = 4, kMicro = 8;

torch::nn::Sequential make_block(int64_t i) {
  torch::manual_seed(100 + i);  // the same weights on every rank and in the twin
  return torch::nn::Sequential(torch::nn::Linear(kWidth, 4 * kWidth), torch::nn::GELU(),
                               torch::nn::Linear(4 * kWidth, kWidth));
}

torch::Tensor run_blocks(std::vector<torch::nn::Sequential>& blocks, torch::Tensor x) {
  for (auto& b : blocks) x = x + b->forward(x);
  return x;
}

torch::Tensor loss_of(const torch::Tensor& y) {
  return torch::sin(y).pow(2).mean();
}

torch::Tensor micro_batch(int step, int64_t k) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + k);
  return torch::randn({kMicro, kWidth}, gen);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pipeline parallelism with a custom schedule.", "loom-example-pipeline"};
  int steps = 20;
  app.add_option("--steps", steps, "Optimizer steps")->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace();
    auto world = runtime->world();
    const int64_t pp = world->size(), rank = world->rank();
    const pl::PipelineShape shape{pp, 1, kMicroBatches};
    auto schedule = pl::make_schedule("lifo-gpipe");  // simulated and checked by the executor
    pl::PipelineExecutor executor(world, shape, schedule);
    // This rank's stage: an even share of the blocks.
    const int64_t first = rank * kBlocks / pp, end = (rank + 1) * kBlocks / pp;
    std::vector<torch::nn::Sequential> stage, twin;
    for (int64_t i = 0; i < kBlocks; ++i) {
      twin.push_back(make_block(i));
      if (i >= first && i < end) stage.push_back(make_block(i));
    }
    auto params_of = [](std::vector<torch::nn::Sequential>& blocks) {
      std::vector<torch::Tensor> out;
      for (auto& b : blocks)
        for (auto& p : b->parameters()) out.push_back(p);
      return out;
    };
    torch::optim::SGD opt(params_of(stage), 0.05), twin_opt(params_of(twin), 0.05);
    for (int step = 0; step < steps; ++step) {
      const auto stats = executor.run([&](int64_t, int64_t k, const at::Tensor& in) {
        auto y = run_blocks(stage, rank == 0 ? micro_batch(step, k) : in);
        return rank == pp - 1 ? loss_of(y) / static_cast<double>(kMicroBatches) : y;
      });
      opt.step();
      opt.zero_grad();
      double twin_loss = 0;
      for (int64_t k = 0; k < kMicroBatches; ++k) {
        auto loss = loss_of(run_blocks(twin, micro_batch(step, k))) / double(kMicroBatches);
        loss.backward();
        twin_loss += loss.item<double>();
      }
      twin_opt.step();
      twin_opt.zero_grad();
      if (rank == pp - 1 && (step % 5 == 0 || step == steps - 1)) {
        double loss = 0;
        for (double l : stats.outputs) loss += l;
        std::printf("step %3d  loss %.6f (twin %.6f)  waited %.0f%% of the step\n", step, loss,
                    twin_loss, 100 * stats.bubble_fraction());
      }
    }
    double worst = 0;
    for (int64_t i = first; i < end; ++i) {
      auto mine = stage[static_cast<size_t>(i - first)]->parameters();
      auto want = twin[static_cast<size_t>(i)]->parameters();
      for (size_t j = 0; j < mine.size(); ++j)
        worst = std::max(worst, ((mine[j] - want[j]).norm() / want[j].norm()).item<double>());
    }
    // Every stage's verdict, on rank 0.
    auto all_worst = at::full({1}, worst, at::kDouble);
    world->all_reduce(all_worst, loom::dist::ReduceOp::Max);
    const bool same = worst < 1e-5, all_same = all_worst.item<double>() < 1e-5;
    std::printf("rank %lld: blocks %lld-%lld %s the twin (worst relative difference %.2g)\n",
                static_cast<long long>(rank), static_cast<long long>(first),
                static_cast<long long>(end - 1), same ? "match" : "DIFFER FROM", worst);
    if (rank == 0)
      std::printf("custom schedule '%s' on pp %lld: %s\n", schedule->name().c_str(),
                  static_cast<long long>(pp),
                  all_same ? "all stages match the one-process twin"
                           : "some stage DIFFERS FROM the one-process twin");
    if (!all_same) std::exit(1);
  });
}
