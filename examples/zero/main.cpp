// loom-example-zero: ZeRO-3 on your own LibTorch module, in ~90 lines.
//
//   mpirun -np 2 build/examples/loom-example-zero
//
// A small residual MLP whose blocks are declared as zero::FullyShardedModule<Block>: each rank
// keeps 1/N of every parameter, the optimizer state and the gradients; a block's parameters are
// gathered just before its forward (and again in backward) and freed right after. The same
// module trained without ZeRO on one process (the twin, on every rank's data) must end with the
// same weights (exit status 1 if not). Rank 0 prints the loss and the memory per rank.
#include <torch/torch.h>

#include <cstdio>
#include <optional>

#include "loom/apps/cli.h"
#include "loom/loom.h"

namespace zero = loom::parallel::zero;

namespace {

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear up{nullptr}, down{nullptr};
  BlockImpl(int64_t width, int64_t hidden) {
    up = register_module("up", torch::nn::Linear(width, hidden));
    down = register_module("down", torch::nn::Linear(hidden, width));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(x))); }
};

// Declared with FullyShardedModule: the only change ZeRO-3 asks of the model.
struct Net : torch::nn::Module {
  std::vector<std::shared_ptr<zero::FullyShardedModule<BlockImpl>>> blocks;
  torch::nn::Linear head{nullptr};
  Net() {
    torch::manual_seed(0);  // the same initial weights on every rank and in the twin
    for (int i = 0; i < 4; ++i)
      blocks.push_back(
          register_module("block" + std::to_string(i),
                          std::make_shared<zero::FullyShardedModule<BlockImpl>>(16, 61)));
    head = register_module("head", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b->forward(x);
    return head(x);
  }
};

torch::Tensor batch_of(int64_t rank, int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
  return torch::randn({16, 16}, gen);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeRO-3 training of a LibTorch module with loom.", "loom-example-zero"};
  int steps = 50;
  app.add_option("--steps", steps, "Optimizer steps")->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace();
    auto world = runtime->world();
    const int64_t n = world->size(), rank = world->rank();
    Net net, twin;
    auto engine = zero::shard_module(net, world, {.stage = 3});
    loom::train::AdamW twin_opt(
        [&] {
          loom::core::NamedTensors p;
          for (auto& item : twin.named_parameters()) p.emplace_back(item.key(), item.value());
          return p;
        }(),
        {}, [](const std::string&, const at::Tensor& p) { return p.dim() >= 2; });
    for (int step = 0; step < steps; ++step) {
      auto x = batch_of(rank, step);
      engine->prepare_forward();
      auto loss = torch::sin(net.forward(x)).pow(2).mean();
      loss.backward();
      engine->finish_gradient_sync();  // gradients reduce-scattered: each rank keeps its shard
      engine->clip_grad_norm(1.0);
      engine->step(1e-2);
      engine->zero_grad();
      // The twin sees every rank's batch and averages, as data parallelism does.
      for (int64_t r = 0; r < n; ++r)
        (torch::sin(twin.forward(batch_of(r, step))).pow(2).mean() / static_cast<double>(n))
            .backward();
      std::vector<at::Tensor> twin_params;
      for (auto& p : twin.parameters()) twin_params.push_back(p);
      loom::train::clip_grad_norm(twin_params, 1.0);
      twin_opt.step(1e-2);
      twin_opt.zero_grad();
      if (rank == 0 && (step % 10 == 0 || step == steps - 1))
        std::printf("step %3d  loss %.5f\n", step, loss.item<double>());
    }
    const auto memory = engine->memory();
    int64_t total = 0;
    for (const auto& p : twin.parameters()) total += p.numel();
    double worst = 0;
    for (const auto& [name, p] : engine->gather_parameters()) {
      const auto want = twin.named_parameters()[name];
      worst = std::max(worst, ((p - want).norm() / want.norm()).item<double>());
    }
    for (auto& b : net.blocks) b->unbind();
    const bool same = worst < 1e-5;
    if (rank == 0)
      std::printf(
          "rank 0 holds %lld B of parameters, %lld B of gradients, %lld B of optimizer "
          "state for %lld parameters\n",
          static_cast<long long>(memory.parameters), static_cast<long long>(memory.gradients),
          static_cast<long long>(memory.optimizer), static_cast<long long>(total));
    std::printf(
        "rank %lld: ZeRO-3 on %lld ranks %s the one-process twin (worst relative "
        "difference %.2g)\n",
        static_cast<long long>(rank), static_cast<long long>(n), same ? "matches" : "DIFFERS FROM",
        worst);
    return same ? 0 : 1;
  });
}
