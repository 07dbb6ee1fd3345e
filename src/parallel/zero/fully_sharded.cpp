#include "loom/parallel/zero/fully_sharded.h"

#include <algorithm>
#include <set>

namespace loom::parallel::zero {

namespace {

struct FoundUnit {
  std::string path;
  std::shared_ptr<torch::nn::Module> module;
  ShardedUnitHandle* handle;
};

std::vector<FoundUnit> find_handles(torch::nn::Module& root) {
  std::vector<FoundUnit> out;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    auto* handle = dynamic_cast<ShardedUnitHandle*>(item.value().get());
    if (handle != nullptr) out.push_back({item.key(), item.value(), handle});
  }
  return out;
}

}  // namespace

std::vector<ZeroUnit> find_sharded_units(torch::nn::Module& root) {
  auto found = find_handles(root);
  // Deepest first, so a nested FullyShardedModule keeps its own parameters.
  std::vector<size_t> order(found.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::count(found[a].path.begin(), found[a].path.end(), '.') >
           std::count(found[b].path.begin(), found[b].path.end(), '.');
  });
  std::set<std::string> taken;
  std::vector<ZeroUnit> units(found.size());
  for (size_t i : order) {
    units[i].name = found[i].path;
    for (const auto& p : found[i].module->named_parameters(/*recurse=*/true)) {
      auto name = found[i].path + "." + p.key();
      if (taken.insert(name).second) units[i].params.push_back(std::move(name));
    }
  }
  return units;
}

std::unique_ptr<ZeroOptimizer> shard_module(torch::nn::Module& root, dist::CommunicatorPtr comm,
                                            ZeroOptions options) {
  ZeroOptimizer::NamedParams params;
  for (const auto& p : root.named_parameters(/*recurse=*/true))
    params.emplace_back(p.key(), p.value());
  auto units = find_sharded_units(root);
  auto engine = std::make_unique<ZeroOptimizer>(std::move(params), std::move(comm),
                                                std::move(options), units);
  auto found = find_handles(root);
  for (size_t i = 0; i < found.size(); ++i) found[i].handle->bind(engine.get(), i);
  return engine;
}

}  // namespace loom::parallel::zero
