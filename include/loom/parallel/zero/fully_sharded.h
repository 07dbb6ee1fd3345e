#pragma once
// ZeRO-3 for any LibTorch module. LibTorch has no module hooks, so a module whose parameters
// should be gathered just in time is declared as FullyShardedModule<M> instead of M: it is an
// M (same constructor, same parameters and names), whose forward runs M::forward inside the
// ZeRO engine's run_unit once the engine is bound. Unbound (or at stages 1-2) it is plain M.
//
//   struct Net : torch::nn::Module {
//     std::shared_ptr<zero::FullyShardedModule<Block>> a, b;   // instead of shared_ptr<Block>
//     Net() { a = register_module("a", std::make_shared<zero::FullyShardedModule<Block>>(64));
//             ... }
//   };
//   auto net = std::make_shared<Net>();
//   auto engine = zero::shard_module(*net, dp_comm, {.stage = 3});   // units a, b, root
//   engine->prepare_forward(); net->forward(x).backward(); engine->finish_gradient_sync(); ...
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "loom/parallel/zero/zero_optimizer.h"

namespace loom::parallel::zero {

// What every FullyShardedModule<M> is, whatever M: the link to the engine that gathers it.
class ShardedUnitHandle {
 public:
  virtual ~ShardedUnitHandle() = default;
  void bind(ZeroOptimizer* engine, size_t unit) {
    engine_ = engine;
    unit_ = unit;
  }
  void unbind() { engine_ = nullptr; }

 protected:
  at::Tensor run_sharded(const std::function<at::Tensor()>& fn) {
    return engine_ != nullptr ? engine_->run_unit(unit_, fn) : fn();
  }

 private:
  ZeroOptimizer* engine_ = nullptr;
  size_t unit_ = 0;
};

template <class M>
class FullyShardedModule : public M, public ShardedUnitHandle {
 public:
  using M::M;
  template <class... Args>
  at::Tensor forward(Args&&... args) {
    return run_sharded([&] { return M::forward(std::forward<Args>(args)...); });
  }
};

// The units of a module tree: one per FullyShardedModule in it (named by its path), holding the
// parameters under it that no deeper FullyShardedModule holds. Parameters outside all of them
// are left to the engine's root unit.
std::vector<ZeroUnit> find_sharded_units(torch::nn::Module& root);

// Builds the engine over root's parameters with find_sharded_units' units and binds every
// FullyShardedModule to it (unbind them, or destroy the modules, before the engine goes).
// Collective over `comm`.
std::unique_ptr<ZeroOptimizer> shard_module(torch::nn::Module& root, dist::CommunicatorPtr comm,
                                            ZeroOptions options);

}  // namespace loom::parallel::zero
