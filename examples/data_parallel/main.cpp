// loom-example-data-parallel: data parallelism on your own LibTorch module, in ~60 lines.
//
//   mpirun -np 4 build/examples/loom-example-data-parallel
//
// Each rank fits the same small network to its own share of a regression problem; DataParallel
// averages the gradients across ranks while backward runs, so every rank takes the same
// optimizer step and the replicas stay identical. Rank 0 prints the loss; at the end every rank
// checks that its parameters equal rank 0's (exit status 1 if not).
#include <torch/torch.h>

#include <cstdio>
#include <optional>

#include "loom/apps/cli.h"
#include "loom/loom.h"

namespace {

struct Net : torch::nn::Module {
  torch::nn::Linear in{nullptr}, out{nullptr};
  Net() {
    in = register_module("in", torch::nn::Linear(8, 32));
    out = register_module("out", torch::nn::Linear(32, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(torch::tanh(in(x))); }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Data-parallel training of a LibTorch module with loom.",
               "loom-example-data-parallel"};
  int steps = 200;
  app.add_option("--steps", steps, "Optimizer steps")->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace();              // MPI; rank 0 of 1 without mpirun
    auto mesh = runtime->mesh({});  // every rank data-parallel
    auto& dp_comm = mesh->comm(loom::dist::Dim::dp);

    Net net;
    loom::parallel::data::DataParallel::NamedParams params;
    for (const auto& p : net.named_parameters()) params.emplace_back(p.key(), p.value());
    loom::parallel::data::DataParallel dp(params, mesh->comm_ptr(loom::dist::Dim::dp),
                                          {.bucket_mb = 0.001});  // tiny buckets: several
    dp.broadcast_parameters();  // whatever each rank initialized, rank 0's values win
    torch::optim::Adam opt(net.parameters(), torch::optim::AdamOptions(1e-2));

    // This rank's share of the data: its own generator, so ranks see different samples.
    torch::manual_seed(100 + static_cast<uint64_t>(dp_comm.rank()));
    const auto x = torch::randn({256, 8});
    const auto y = (x.sum(1, true) * 0.5).sin();
    for (int step = 1; step <= steps; ++step) {
      auto loss = torch::mse_loss(net.forward(x), y);
      loss.backward();
      dp.finish_gradient_sync();  // .grad = mean over ranks
      opt.step();
      dp.zero_grad();
      auto mean = loss.detach().reshape({1}).clone();
      dp_comm.all_reduce(mean, loom::dist::ReduceOp::Avg);
      if (dp_comm.rank() == 0 && (step % 50 == 0 || step == 1))
        std::printf("step %d  loss %.5f  (%d ranks, %zu buckets)\n", step, mean.item<double>(),
                    dp_comm.size(), dp.buckets().size());
    }
    // The replicas must be identical: compare every parameter with rank 0's.
    for (const auto& p : net.parameters()) {
      auto theirs = p.detach().clone();
      dp_comm.broadcast(theirs, 0);
      LOOM_CHECK(torch::equal(theirs, p.detach()), "rank {}: parameters differ from rank 0's",
                 dp_comm.rank());
    }
    if (dp_comm.rank() == 0) std::printf("replicas identical on all %d ranks\n", dp_comm.size());
  });
}
