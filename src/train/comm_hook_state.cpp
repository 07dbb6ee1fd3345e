#include "loom/train/comm_hook_state.h"

#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "loom/core/error.h"
#include "loom/core/safetensors.h"
#include "loom/models/causal_lm.h"
#include "loom/train/checkpoint.h"
#include "loom/train/run_context.h"

namespace loom::train {

CommHookState::CommHookState(std::string prefix,
                             std::vector<std::shared_ptr<parallel::data::CommHook>> hooks,
                             bool reduce_scatter)
    : prefix_(std::move(prefix)), hooks_(std::move(hooks)), reduce_scatter_(reduce_scatter) {}

HookValueLayout CommHookState::value_layout(const RunContext& run, const Buckets& buckets) const {
  HookValueLayout out;
  out.owner = prefix_;
  out.hook = run.config.comm_hook;
  out.dp = run.coord(dist::Dim::dp);
  out.dp_size = run.size(dist::Dim::dp);
  out.tp = run.coord(dist::Dim::tp);
  out.tp_size = run.size(dist::Dim::tp);
  out.cp = run.coord(dist::Dim::cp);
  out.cp_size = run.size(dist::Dim::cp);
  out.pp = run.coord(dist::Dim::pp);
  out.pp_size = run.size(dist::Dim::pp);
  out.chunks = buckets;
  LOOM_CHECK(buckets.size() == run.chunks.size(), "{} chunks of buckets for {} model chunks",
             buckets.size(), run.chunks.size());
  for (size_t c = 0; c < buckets.size(); ++c) {
    const auto& chunk = *run.chunks[c];
    for (const auto& bucket : buckets[c])
      for (const auto& name : bucket.names) {
        HookValueLayout::Param p;
        p.spec = chunk.shard_spec(name);
        // Copies on several stages (a tied embedding, shared blocks) have their gradients
        // summed.
        p.stages =
            out.pp_size > 1
                ? static_cast<int64_t>(chunk.stages_holding(name, run.plan.stage_bounds).size())
                : 1;
        out.params.emplace(name, p);
      }
  }
  return out;
}

bool CommHookState::carries_state() const {
  return !hooks_.empty() && hooks_.front()->carries_state();
}

bool CommHookState::exempts_step_from_clipping() const {
  return std::any_of(hooks_.begin(), hooks_.end(),
                     [](const auto& hook) { return hook->exempt_from_clipping_this_step(); });
}

void CommHookState::save(const RunContext& run, const std::string& layout, const Reshard& reshard,
                         const Buckets& buckets, core::NamedTensors& tensors,
                         std::map<std::string, std::string>& metadata) const {
  if (!carries_state()) return;
  for (size_t c = 0; c < hooks_.size(); ++c)
    for (const auto& [key, t] : hooks_[c]->state())
      tensors.emplace_back(fmt::format("{}/c{}/{}", prefix_, c, key), t.cpu());
  metadata[prefix_ + ".layout"] = layout;
  metadata[kHookValueLayoutKey] = value_layout(run, buckets).to_json();
  if (!reshard.key.empty()) {
    metadata[prefix_ + ".reshard_key"] = reshard.key;
    metadata[prefix_ + ".dp_rank"] = std::to_string(reshard.dp_rank);
    metadata[prefix_ + ".dp_size"] = std::to_string(reshard.dp_size);
  }
}

void CommHookState::load(const RunContext& run, const CheckpointContents& checkpoint,
                         const std::string& layout, const Reshard& reshard,
                         const Buckets& buckets) {
  if (!carries_state()) return;
  auto why = take_state(run, checkpoint, layout, reshard, buckets);
  // Every rank or none: a rank whose state restarted at zero while the others took theirs would
  // compress a parameter that tp replicates (the same gradient on every tp rank, reduced in
  // separate dp groups) otherwise than its replicas do, and the replicas would drift apart.
  auto failed = at::full({1}, why.empty() ? 0 : 1, at::kInt);
  if (run.mesh->world_size() > 1) run.mesh->world().all_reduce(failed, dist::ReduceOp::Max);
  if (failed.item<int>() == 0) return;
  if (why.empty()) {
    for (auto& hook : hooks_) hook->load_state({});
    why = "another rank could not take its state, and every rank starts alike";
  }
  spdlog::warn(
      "--comm-hook {}: its error feedback restarts at zero on this resume: {} (the run "
      "continues, not bit for bit as it would have)",
      run.config.comm_hook, why);
}

std::string CommHookState::take_state(const RunContext& run, const CheckpointContents& checkpoint,
                                      const std::string& layout, const Reshard& reshard,
                                      const Buckets& buckets) {
  const auto file = checkpoint.dir / rank_state_name(run.mesh->rank(), run.mesh->world_size());
  std::string why;
  if (!checkpoint.state.contains("rank_state_files")) {
    why =
        "the checkpoint holds none (written without an error-feedback hook, or before a "
        "gradient was reduced)";
  } else if (!std::filesystem::exists(file)) {
    why = fmt::format("the checkpoint was written by another number of ranks (it has no '{}')",
                      file.filename().string());
  } else {
    // A file that does not load costs this rank its error feedback, not the run: the other
    // ranks are not waiting on this one here, so a throw would leave them to the watchdog.
    try {
      why = restore(file.string(), layout);
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (why.empty()) {
      spdlog::info("--comm-hook {}: error feedback restored from '{}'", run.config.comm_hook,
                   file.string());
      return {};
    }
  }
  if (checkpoint.state.contains("rank_state_files") && !reshard.key.empty()) {
    try {
      if (const int64_t from = reshard_from(checkpoint, reshard); from > 0) {
        spdlog::info(
            "--comm-hook {}: error feedback resharded from the {} data-parallel ranks that saved "
            "it (each rank carries their mean error; what the group carries once is split anew)",
            run.config.comm_hook, from);
        return {};
      }
    } catch (const std::exception& e) {
      why += fmt::format("; resharding it failed: {}", e.what());
    }
  }
  if (checkpoint.state.contains("rank_state_files")) {
    try {
      if (const int64_t groups = carry_across_layouts(checkpoint, value_layout(run, buckets));
          groups > 0) {
        spdlog::info(
            "--comm-hook {}: error feedback carried from another layout: the {} data-parallel "
            "groups that saved it, per parameter, onto this rank's buckets (what the run owes "
            "each parameter stays the same)",
            run.config.comm_hook, groups);
        return {};
      }
    } catch (const std::exception& e) {
      why += fmt::format("; carrying it across layouts failed: {}", e.what());
    }
  }
  for (auto& hook : hooks_) hook->load_state({});
  return why;
}

int64_t CommHookState::reshard_from(const CheckpointContents& checkpoint, const Reshard& reshard) {
  // The old ranks of this rank's group, by their place in it. A file that cannot be read is
  // skipped here: if it was one of the group's, the count below says so.
  std::map<int64_t, std::filesystem::path> sources;
  int64_t group_size = 0;
  for (const auto& name : checkpoint.state.at("rank_state_files")) {
    const auto path = checkpoint.dir / name.get<std::string>();
    std::map<std::string, std::string> meta;
    try {
      meta = core::SafetensorsReader(path).metadata();
    } catch (const std::exception&) {
      continue;
    }
    const auto key = meta.find(prefix_ + ".reshard_key");
    const auto place = meta.find(prefix_ + ".dp_rank");
    const auto size = meta.find(prefix_ + ".dp_size");
    if (key == meta.end() || key->second != reshard.key || place == meta.end() ||
        size == meta.end())
      continue;
    const int64_t dp_rank = std::stoll(place->second);
    group_size = std::stoll(size->second);
    LOOM_CHECK(sources.emplace(dp_rank, path).second,
               "two rank-state files hold data-parallel rank {} of this group: '{}' and '{}'",
               dp_rank, sources.at(dp_rank).string(), path.string());
  }
  if (sources.empty()) return 0;
  LOOM_CHECK(static_cast<int64_t>(sources.size()) == group_size &&
                 sources.rbegin()->first == group_size - 1,
             "the group saved its state from {} data-parallel ranks, and {} of their files were "
             "found and read",
             group_size, sources.size());
  try {
    std::vector<parallel::data::StateResharder> resharders;
    for (const auto& hook : hooks_) resharders.emplace_back(*hook);
    for (const auto& [dp_rank, path] : sources) {  // one file at a time, in dp order
      const core::SafetensorsReader reader(path);
      for (size_t c = 0; c < hooks_.size(); ++c) {
        const auto prefix = fmt::format("{}/c{}/", prefix_, c);
        std::map<std::string, at::Tensor> state;
        for (const auto& name : reader.names())
          if (name.rfind(prefix, 0) == 0) state[name.substr(prefix.size())] = reader.read(name);
        resharders[c].add(state);
      }
    }
    for (size_t c = 0; c < hooks_.size(); ++c)
      hooks_[c]->load_resharded_state(resharders[c].result());
  } catch (...) {
    for (auto& hook : hooks_) hook->load_state({});
    throw;
  }
  return static_cast<int64_t>(sources.size());
}

int64_t CommHookState::carry_across_layouts(const CheckpointContents& checkpoint,
                                            const HookValueLayout& mine) {
  std::set<std::string> wanted;
  for (const auto& buckets : mine.chunks)
    for (const auto& b : buckets) wanted.insert(b.names.begin(), b.names.end());
  // group_values and the rules read no state of the hook's own: any chunk's hook serves.
  const auto totals = read_hook_values(checkpoint, *hooks_.front(), mine.hook, wanted);
  if (totals.groups() == 0) return 0;
  try {
    const auto carried = totals.values_for(mine);
    for (size_t c = 0; c < hooks_.size(); ++c)
      hooks_[c]->load_group_values(carried.at(c), reduce_scatter_);
  } catch (...) {
    for (auto& hook : hooks_) hook->load_state({});
    throw;
  }
  return totals.groups();
}

std::string CommHookState::restore(const std::string& file, const std::string& layout) {
  const auto saved = core::load_safetensors(file);
  const auto it = saved.metadata.find(prefix_ + ".layout");
  if (it == saved.metadata.end() || it->second != layout)
    return fmt::format("it was saved for {}, and this run is {}",
                       it == saved.metadata.end() ? std::string("no hook") : it->second, layout);
  try {
    for (size_t c = 0; c < hooks_.size(); ++c) {
      const auto prefix = fmt::format("{}/c{}/", prefix_, c);
      std::map<std::string, at::Tensor> state;
      for (const auto& [key, t] : saved.tensors)
        if (key.rfind(prefix, 0) == 0) state[key.substr(prefix.size())] = t;
      hooks_[c]->load_state(state);
    }
  } catch (...) {
    for (auto& hook : hooks_) hook->load_state({});
    throw;
  }
  return {};
}

void record_grad_sync(nlohmann::json& record, double bytes_sent, double fp32_bytes) {
  record["grad_sync_bytes"] = bytes_sent;
  if (bytes_sent > 0) record["compression_ratio"] = fp32_bytes / bytes_sent;
}

}  // namespace loom::train
