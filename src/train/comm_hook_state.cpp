#include "loom/train/comm_hook_state.h"

#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>

#include "loom/core/error.h"
#include "loom/core/safetensors.h"
#include "loom/train/checkpoint.h"
#include "loom/train/run_context.h"

namespace loom::train {

CommHookState::CommHookState(std::string prefix,
                             std::vector<std::shared_ptr<parallel::data::CommHook>> hooks)
    : prefix_(std::move(prefix)), hooks_(std::move(hooks)) {}

bool CommHookState::carries_state() const {
  return !hooks_.empty() && hooks_.front()->carries_state();
}

bool CommHookState::exempts_step_from_clipping() const {
  return std::any_of(hooks_.begin(), hooks_.end(),
                     [](const auto& hook) { return hook->exempt_from_clipping_this_step(); });
}

void CommHookState::save(const std::string& layout, const Reshard& reshard,
                         core::NamedTensors& tensors,
                         std::map<std::string, std::string>& metadata) const {
  if (!carries_state()) return;
  for (size_t c = 0; c < hooks_.size(); ++c)
    for (const auto& [key, t] : hooks_[c]->state())
      tensors.emplace_back(fmt::format("{}/c{}/{}", prefix_, c, key), t.cpu());
  metadata[prefix_ + ".layout"] = layout;
  if (!reshard.key.empty()) {
    metadata[prefix_ + ".reshard_key"] = reshard.key;
    metadata[prefix_ + ".dp_rank"] = std::to_string(reshard.dp_rank);
    metadata[prefix_ + ".dp_size"] = std::to_string(reshard.dp_size);
  }
}

void CommHookState::load(const RunContext& run, const CheckpointContents& checkpoint,
                         const std::string& layout, const Reshard& reshard) {
  if (!carries_state()) return;
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
      return;
    }
  }
  if (checkpoint.state.contains("rank_state_files") && !reshard.key.empty()) {
    try {
      if (const int64_t from = reshard_from(checkpoint, reshard); from > 0) {
        spdlog::info(
            "--comm-hook {}: error feedback resharded from the {} data-parallel ranks that saved "
            "it (each rank carries their mean error; what the group carries once is split anew)",
            run.config.comm_hook, from);
        return;
      }
    } catch (const std::exception& e) {
      why += fmt::format("; resharding it failed: {}", e.what());
    }
  }
  spdlog::warn(
      "--comm-hook {}: its error feedback restarts at zero on this resume: {} (the run "
      "continues, not bit for bit as it would have)",
      run.config.comm_hook, why);
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
