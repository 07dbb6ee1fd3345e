// loom-example-tensor-parallel: tensor parallelism in your own LibTorch module, in ~80 lines.
//
//   mpirun -np 2 build/examples/loom-example-tensor-parallel
//
// A two-layer MLP written with loom's column- and row-parallel layers: each rank holds half of
// the hidden units (tp = world size). The same module with no group (tp = 1) is its
// single-process twin. Both start from the same full weights (each rank takes its shard), train
// on the same data, and at the end the shards, gathered, must equal the twin's weights (exit
// status 1 if not). Rank 0 prints the loss.
#include <torch/torch.h>

#include <cstdio>
#include <optional>

#include "loom/apps/cli.h"
#include "loom/loom.h"

namespace pt = loom::parallel::tensor;

namespace {

struct Mlp : torch::nn::Module {
  std::shared_ptr<pt::ColumnParallelLinear> up;
  std::shared_ptr<pt::RowParallelLinear> down;
  pt::TpGroupPtr tp;
  explicit Mlp(pt::TpGroupPtr group) : tp(std::move(group)) {
    up = register_module("up", std::make_shared<pt::ColumnParallelLinear>(
                                   8, 64, tp, pt::ColumnParallelOptions{}, "mlp.up"));
    down = register_module("down",
                           std::make_shared<pt::RowParallelLinear>(64, 1, tp, true, 0, "mlp.down"));
  }
  // [batch, 1, 8] -> [batch, 1, 1]: enter the TP region once, leave it in the row layer.
  torch::Tensor forward(const torch::Tensor& x) {
    return down->forward(torch::tanh(up->forward(pt::enter_tp_region(x, *tp, 1))));
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tensor-parallel training of a LibTorch module with loom.",
               "loom-example-tensor-parallel"};
  int steps = 100;
  app.add_option("--steps", steps, "Optimizer steps")->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace();
    auto mesh = runtime->mesh({.tp = runtime->world()->size()});  // every rank one tp shard
    auto group = std::make_shared<pt::TpGroup>(mesh->comm_ptr(loom::dist::Dim::tp));
    Mlp sharded(group), twin(std::make_shared<pt::TpGroup>());  // twin: tp = 1

    // The same full weights everywhere (seeded), each rank keeping its shard of them.
    torch::manual_seed(0);
    const auto specs = pt::collect_shard_specs(sharded, false);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : twin.named_parameters()) {
        auto full = torch::randn(p.value().sizes()) * 0.3;
        p.value().copy_(full);
        sharded.named_parameters()[p.key()].copy_(
            specs.at(p.key()).shard(full, group->rank(), group->size()));
      }
    }
    torch::optim::SGD opt_sharded(sharded.parameters(), 0.05), opt_twin(twin.parameters(), 0.05);
    for (int step = 0; step < steps; ++step) {
      auto x = torch::randn({32, 1, 8});  // same draws on every rank (same seed)
      auto y = torch::sin(x.sum(-1, true));
      for (auto* m : {&sharded, &twin}) {
        auto& opt = m == &sharded ? opt_sharded : opt_twin;
        opt.zero_grad();
        auto loss = torch::mse_loss(m->forward(x), y);
        loss.backward();
        opt.step();
        if (m == &sharded && group->rank() == 0 && (step % 25 == 0 || step == steps - 1))
          std::printf("step %3d  loss %.5f\n", step, loss.item<double>());
      }
    }
    // Gather the shards into single-process tensors and compare with the twin.
    double worst = 0;
    for (auto& p : twin.named_parameters()) {
      const auto& spec = specs.at(p.key());
      auto mine = sharded.named_parameters()[p.key()].detach().contiguous();
      at::Tensor whole = mine;
      if (spec.sharded() && group->size() > 1) {
        auto all = torch::empty({group->size(), mine.numel()});
        group->comm()->all_gather(all, mine.view({-1}));
        std::vector<at::Tensor> pieces;
        for (int64_t r = 0; r < group->size(); ++r) pieces.push_back(all[r].view_as(mine));
        whole = spec.unshard(pieces);
      }
      worst = std::max(worst, (whole - p.value()).abs().max().item<double>());
    }
    const bool same = worst < 1e-5;
    std::printf("rank %lld: tp %lld shards %s the single-process twin (max diff %.2g)\n",
                static_cast<long long>(group->rank()), static_cast<long long>(group->size()),
                same ? "equal" : "DIFFER FROM", worst);
    return same ? 0 : 1;
  });
}
