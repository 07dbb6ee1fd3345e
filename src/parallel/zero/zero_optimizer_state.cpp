// ZeroOptimizer's checkpoint state: each rank's shards of the moments (and masters) with the
// metadata that lets a resume check the layout, or reshard into another one. Split from
// zero_optimizer.cpp by concern: gathering, reducing and stepping live there.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/parallel/zero/zero_optimizer.h"

namespace loom::parallel::zero {

core::NamedTensors ZeroOptimizer::state() const {
  core::NamedTensors out;
  out.emplace_back("zero.step", at::tensor(steps_, at::kLong));
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const auto& b = buckets_[bi];
    const auto key = fmt::format("zero.bucket{}", bi);
    out.emplace_back(key + ".exp_avg", b.exp_avg.cpu());
    out.emplace_back(key + ".exp_avg_sq", b.exp_avg_sq.cpu());
    if (b.master.defined()) out.emplace_back(key + ".master", b.master.cpu());
  }
  return out;
}

data::BucketShape ZeroOptimizer::bucket_shape(size_t i) const {
  const auto& b = buckets_.at(i);
  data::BucketShape out;
  for (size_t slot = 0; slot < b.params.size(); ++slot) {
    out.names.push_back(params_[b.params[slot]].first);
    out.shapes.push_back(params_[b.params[slot]].second.sizes().vec());
    out.offsets.push_back(b.layout.offset(slot));
  }
  out.numel = b.layout.total();
  return out;
}

std::map<std::string, std::string> ZeroOptimizer::state_metadata() const {
  std::string layout;
  for (const auto& b : buckets_)
    layout += fmt::format("{}{}", layout.empty() ? "" : ",", b.layout.total());
  // A fingerprint of the parameter names in buffer order: a model with other parameters (or
  // another bucket size) lays them out differently.
  uint64_t names = 1469598103934665603ULL;
  for (const auto& b : buckets_)
    for (size_t k : b.params)
      for (char c : params_[k].first)
        names = (names ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  // Each bucket's parameters and shapes, in buffer order: what a loader needs to cut the flat
  // shards back into parameters (and so to resume in another layout).
  nlohmann::json params = nlohmann::json::array();
  for (const auto& b : buckets_) {
    nlohmann::json bucket = nlohmann::json::array();
    for (size_t k : b.params) bucket.push_back({params_[k].first, params_[k].second.sizes().vec()});
    params.push_back(bucket);
  }
  return {{"zero_stage", std::to_string(options_.stage)},
          {"dp_size", std::to_string(ranks_)},
          {"dp_rank", std::to_string(rank_)},
          {"bucket_numels", layout},
          {"bucket_params", params.dump()},
          {"param_names_fnv1a", fmt::format("{:016x}", names)}};
}

void ZeroOptimizer::load_param_state(const std::map<std::string, at::Tensor>& state, int64_t step,
                                     const std::string& source) {
  torch::NoGradGuard no_grad;
  // Everything is checked before anything is written.
  for (const auto& b : buckets_)
    for (size_t k : b.params)
      for (const char* suffix : {".exp_avg", ".exp_avg_sq"}) {
        const auto& [name, p] = params_[k];
        auto it = state.find(name + suffix);
        LOOM_CHECK(it != state.end(), "'{}' has no optimizer entry '{}{}'", source, name, suffix);
        LOOM_CHECK(it->second.numel() == p.numel(),
                   "'{}': optimizer entry '{}{}' has {} elements, the parameter {}", source, name,
                   suffix, it->second.numel(), p.numel());
      }
  steps_ = step;
  for (auto& b : buckets_) {
    for (const auto& seg : b.segments) {
      const auto& name = params_[b.params[seg.param]].first;
      auto piece = [&](const std::string& key) {
        return state.at(key).reshape({-1}).narrow(0, seg.param_offset, seg.numel);
      };
      b.exp_avg.narrow(0, seg.shard_offset, seg.numel).copy_(piece(name + ".exp_avg"));
      b.exp_avg_sq.narrow(0, seg.shard_offset, seg.numel).copy_(piece(name + ".exp_avg_sq"));
      if (b.master.defined() && state.count(name + ".master"))
        b.master.narrow(0, seg.shard_offset, seg.numel).copy_(piece(name + ".master"));
    }
    // Masters the state does not have are the parameters themselves (fp32 saved without one).
    if (b.master.defined())
      for (const auto& seg : b.segments)
        if (!state.count(params_[b.params[seg.param]].first + ".master"))
          b.master.narrow(0, seg.shard_offset, seg.numel)
              .copy_(b.param_shard.narrow(0, seg.shard_offset, seg.numel));
  }
}

void ZeroOptimizer::load_state(const std::map<std::string, at::Tensor>& state,
                               const std::map<std::string, std::string>& metadata,
                               const std::string& source) {
  torch::NoGradGuard no_grad;
  const auto expected = state_metadata();
  auto meta = [&](const char* key) {
    auto it = metadata.find(key);
    return it == metadata.end() ? std::string("(none)") : it->second;
  };
  LOOM_CHECK(meta("dp_size") == expected.at("dp_size") && meta("dp_rank") == expected.at("dp_rank"),
             "ZeRO shard '{}' was written by dp rank {} of {}; this is dp rank {} of {}. ZeRO "
             "optimizer shards resume only at the dp size they were saved at",
             source, meta("dp_rank"), meta("dp_size"), expected.at("dp_rank"),
             expected.at("dp_size"));
  LOOM_CHECK(meta("zero_stage") == expected.at("zero_stage"),
             "ZeRO shard '{}' was written at stage {}; this run is at stage {}", source,
             meta("zero_stage"), expected.at("zero_stage"));
  LOOM_CHECK(meta("bucket_numels") == expected.at("bucket_numels") &&
                 meta("param_names_fnv1a") == expected.at("param_names_fnv1a"),
             "ZeRO shard '{}' lays the parameters out differently (buckets {} vs {} here): the "
             "model or --bucket-mb changed",
             source, meta("bucket_numels"), expected.at("bucket_numels"));
  auto get = [&](const std::string& key, const at::Tensor& into) {
    auto it = state.find(key);
    LOOM_CHECK(it != state.end(), "ZeRO shard '{}' has no entry '{}'", source, key);
    LOOM_CHECK(it->second.numel() == into.numel(),
               "ZeRO shard '{}': '{}' has {} elements, the layout needs {}", source, key,
               it->second.numel(), into.numel());
    into.copy_(it->second.reshape(into.sizes()));
  };
  auto it = state.find("zero.step");
  LOOM_CHECK(it != state.end(), "ZeRO shard '{}' has no entry 'zero.step'", source);
  steps_ = it->second.item<int64_t>();
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    auto& b = buckets_[bi];
    const auto key = fmt::format("zero.bucket{}", bi);
    get(key + ".exp_avg", b.exp_avg);
    get(key + ".exp_avg_sq", b.exp_avg_sq);
    if (!b.master.defined()) continue;
    // A master the shard does not have (parameters in the state's dtype, saved without
    // --offload-optimizer) is the parameter shard itself.
    if (state.count(key + ".master") == 0 && b.param_shard.scalar_type() == b.master.scalar_type())
      b.master.copy_(b.param_shard);
    else
      get(key + ".master", b.master);
  }
}

}  // namespace loom::parallel::zero
