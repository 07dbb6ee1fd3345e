#include "loom/train/comm_hook_state.h"

#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "loom/train/checkpoint.h"
#include "loom/train/run_context.h"

namespace loom::train {

CommHookState::CommHookState(std::string prefix,
                             std::vector<std::shared_ptr<parallel::data::CommHook>> hooks)
    : prefix_(std::move(prefix)), hooks_(std::move(hooks)) {}

bool CommHookState::carries_state() const {
  return !hooks_.empty() && hooks_.front()->carries_state();
}

void CommHookState::save(const std::string& layout, core::NamedTensors& tensors,
                         std::map<std::string, std::string>& metadata) const {
  if (!carries_state()) return;
  for (size_t c = 0; c < hooks_.size(); ++c)
    for (const auto& [key, t] : hooks_[c]->state())
      tensors.emplace_back(fmt::format("{}/c{}/{}", prefix_, c, key), t.cpu());
  metadata[prefix_ + ".layout"] = layout;
}

void CommHookState::load(const RunContext& run, const CheckpointContents& checkpoint,
                         const std::string& layout) {
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
  spdlog::warn(
      "--comm-hook {}: its error feedback restarts at zero on this resume: {} (the run "
      "continues, not bit for bit as it would have)",
      run.config.comm_hook, why);
}

std::string CommHookState::restore(const std::string& file, const std::string& layout) {
  const auto saved = core::load_safetensors(file);
  const auto it = saved.metadata.find(prefix_ + ".layout");
  if (it == saved.metadata.end() || it->second != layout)
    return fmt::format(
        "it was saved for {}, and this run is {} (error feedback is not resharded yet)",
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
