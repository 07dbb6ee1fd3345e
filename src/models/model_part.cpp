// The slice of a model one pipeline stage holds (ModelPart), its blocks, and the parameters it
// shares with other slices: a tied embedding, blocks shared across layers (layer_sharing.h).
#include <algorithm>
#include <charconv>

#include <fmt/ranges.h>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/models/causal_lm.h"
#include "loom/models/layer_sharing.h"

namespace loom::models {

std::string ModelPart::describe(int64_t n_layers) const {
  const int64_t end = end_layer < 0 ? n_layers : end_layer;
  std::string out = end > first_layer ? fmt::format("layers {}-{}", first_layer, end - 1)
                                      : std::string("no layers");
  if (first) out = "embedding + " + out;
  if (last) out += " + head";
  return out;
}

std::vector<int64_t> CausalLM::held_blocks() const {
  return models::held_blocks(owners_, part_.first_layer, part_.end_layer);
}

void CausalLM::register_blocks(std::string prefix, std::shared_ptr<torch::nn::Module> container,
                               std::vector<std::shared_ptr<torch::nn::Module>> blocks) {
  const auto held = held_blocks();
  LOOM_CHECK(blocks.size() == held.size(), "register_blocks: {} blocks for the {} that {} holds",
             blocks.size(), held.size(), part_.describe(config_.n_layers));
  blocks_prefix_ = std::move(prefix);
  blocks_ = std::move(blocks);
  block_layers_ = held;
  block_uses_.assign(blocks_.size(), 0);
  block_of_layer_.clear();
  for (int64_t layer = part_.first_layer; layer < part_.end_layer; ++layer) {
    const auto it = std::find(held.begin(), held.end(), owners_[static_cast<size_t>(layer)]);
    const auto index = static_cast<size_t>(it - held.begin());
    block_of_layer_.push_back(index);
    ++block_uses_[index];
  }
  for (size_t i = 0; i < blocks_.size(); ++i)
    container->register_module(std::to_string(block_layers_[i]), blocks_[i]);
}

void CausalLM::adopt_blocks(std::string prefix,
                            std::vector<std::shared_ptr<torch::nn::Module>> blocks) {
  LOOM_CHECK(static_cast<int64_t>(blocks.size()) == part_.end_layer - part_.first_layer,
             "adopt_blocks: {} blocks for {}", blocks.size(), part_.describe(config_.n_layers));
  LOOM_CHECK(held_blocks().size() == blocks.size(),
             "adopt_blocks: a custom model's blocks are its own; it cannot share them across "
             "layers (share_layers '{}')",
             config_.share_layers);
  blocks_prefix_ = std::move(prefix);
  blocks_ = std::move(blocks);
  block_layers_.clear();
  block_of_layer_.clear();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    block_layers_.push_back(part_.first_layer + static_cast<int64_t>(i));
    block_of_layer_.push_back(i);
  }
  block_uses_.assign(blocks_.size(), 1);  // distinct modules (make_custom_model checks)
}

std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> CausalLM::blocks() const {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
  for (size_t i = 0; i < blocks_.size(); ++i)
    out.emplace_back(fmt::format("{}.{}", blocks_prefix_, block_layers_[i]), blocks_[i]);
  return out;
}

int64_t CausalLM::owner_of(const std::string& name) const {
  const auto prefix = blocks_prefix_ + ".";
  if (blocks_prefix_.empty() || !name.starts_with(prefix)) return -1;
  int64_t layer = -1;
  const auto* begin = name.data() + prefix.size();
  const auto [end, ec] = std::from_chars(begin, name.data() + name.size(), layer);
  if (ec != std::errc() || end == begin || *end != '.') return -1;
  return std::find(block_layers_.begin(), block_layers_.end(), layer) != block_layers_.end() ? layer
                                                                                             : -1;
}

std::string CausalLM::tied_embedding_copy() const {
  return config_.tie_embeddings && part_.last && !part_.first ? embedding_weight_name() : "";
}

std::vector<std::string> CausalLM::shared_across_parts() const {
  std::vector<std::string> out;
  if (is_whole()) return out;
  const bool tied =
      config_.tie_embeddings && (part_.first || part_.last) && !(part_.first && part_.last);
  for (const auto& item : named_parameters()) {
    const auto& name = item.key();
    const int64_t owner = owner_of(name);
    const bool shared = owner >= 0
                            ? used_outside(owners_, owner, part_.first_layer, part_.end_layer)
                            : tied && name == embedding_weight_name();
    if (shared) out.push_back(name);
  }
  return out;
}

bool CausalLM::is_copy(const std::string& name) const {
  if (name == tied_embedding_copy()) return true;
  const int64_t owner = owner_of(name);
  return owner >= 0 && owner < part_.first_layer;
}

std::vector<int64_t> CausalLM::stages_holding(const std::string& name,
                                              const std::vector<int64_t>& bounds) const {
  const int64_t stages = static_cast<int64_t>(bounds.size()) - 1;
  LOOM_CHECK(stages >= 1 && bounds.front() == 0 && bounds.back() == config_.n_layers,
             "stages_holding: stage bounds [{}] do not split {} layers", fmt::join(bounds, ", "),
             config_.n_layers);
  const int64_t owner = owner_of(name);
  std::vector<int64_t> out;
  for (int64_t s = 0; s < stages; ++s) {
    const int64_t first = bounds[static_cast<size_t>(s)], end = bounds[static_cast<size_t>(s) + 1];
    bool holds = false;
    if (owner >= 0) {
      for (int64_t layer = first; layer < end && !holds; ++layer)
        holds = owners_[static_cast<size_t>(layer)] == owner;
    } else if (config_.tie_embeddings && name == embedding_weight_name()) {
      holds = s == 0 || s == stages - 1;
    } else {
      // Not shared: the one stage holding this part's layers (or its embedding or head).
      holds = first == part_.first_layer && end == part_.end_layer;
    }
    if (holds) out.push_back(s);
  }
  return out;
}

}  // namespace loom::models
