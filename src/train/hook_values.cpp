#include "loom/train/hook_values.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>
#include <utility>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/core/json.h"
#include "loom/core/safetensors.h"
#include "loom/train/checkpoint.h"

namespace loom::train {

namespace {

using nlohmann::json;
using ValueRule = parallel::data::CommHook::ValueRule;

constexpr int64_t kMaxRanks = int64_t{1} << 24;  // a bound for what a file may claim

// "b<index>/<what>" → (index, what); nullopt for a scalar entry.
std::optional<std::pair<int64_t, std::string>> split_bucket_key(const std::string& key) {
  const auto slash = key.find('/');
  if (key.size() < 3 || key[0] != 'b' || slash == std::string::npos || slash < 2) return {};
  int64_t index = 0;
  const auto [end, ec] = std::from_chars(key.data() + 1, key.data() + slash, index);
  if (ec != std::errc() || end != key.data() + slash || index < 0) return {};
  return std::make_pair(index, key.substr(slash + 1));
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t size : shape) n *= size;
  return n;
}

// How many copies of a parameter a layout holds whose gradients are summed after the
// reduction: every context-parallel rank, each pipeline stage holding it, and across tp the
// ranks sharing a key/value head or all of them for a partial replicated parameter.
int64_t summed_copies(const HookValueLayout::Param& p, int64_t tp_size, int64_t cp_size) {
  int64_t tp_copies = 1;
  if (p.spec.sharded())
    tp_copies = p.spec.replicas(tp_size);
  else if (p.spec.grad_partial)
    tp_copies = tp_size;
  return cp_size * p.stages * tp_copies;
}

}  // namespace

std::string HookValueLayout::to_json() const {
  json out = {{"owner", owner}, {"hook", hook},       {"dp", dp}, {"dp_size", dp_size},
              {"tp", tp},       {"tp_size", tp_size}, {"cp", cp}, {"cp_size", cp_size},
              {"pp", pp},       {"pp_size", pp_size}};
  json chunk_list = json::array();
  for (const auto& buckets : chunks) {
    json bucket_list = json::array();
    for (const auto& b : buckets) {
      json params_list = json::array();
      for (size_t k = 0; k < b.names.size(); ++k)
        params_list.push_back({b.names[k], b.offsets[k], b.shapes[k]});
      bucket_list.push_back({{"numel", b.numel}, {"params", params_list}});
    }
    chunk_list.push_back(bucket_list);
  }
  out["chunks"] = chunk_list;
  json specs = json::object();
  for (const auto& [name, p] : params)
    specs[name] = {p.spec.dim,   p.spec.full,         p.spec.padded, p.spec.parts,
                   p.spec.units, p.spec.grad_partial, p.stages};
  out["params"] = specs;
  return out.dump();
}

HookValueLayout HookValueLayout::from_json(const std::string& text, const std::string& source) {
  const auto fail = [&](const std::string& what) {
    throw Error(fmt::format("'{}': its hook layout {}", source, what));
  };
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    fail(fmt::format("is not valid JSON: {}", e.what()));
  }
  HookValueLayout out;
  try {
    out.owner = j.at("owner").get<std::string>();
    out.hook = j.at("hook").get<std::string>();
    const auto place = [&](const char* key, int64_t& value, int64_t min, int64_t max) {
      value =
          core::json_int64(j.at(key), fmt::format("'{}': hook layout {}", source, key), min, max);
    };
    place("dp_size", out.dp_size, 1, kMaxRanks);
    place("tp_size", out.tp_size, 1, kMaxRanks);
    place("cp_size", out.cp_size, 1, kMaxRanks);
    place("pp_size", out.pp_size, 1, kMaxRanks);
    place("dp", out.dp, 0, out.dp_size - 1);
    place("tp", out.tp, 0, out.tp_size - 1);
    place("cp", out.cp, 0, out.cp_size - 1);
    place("pp", out.pp, 0, out.pp_size - 1);
    const auto where = [&](const std::string& what) {
      return fmt::format("'{}': hook layout {}", source, what);
    };
    for (const auto& bucket_list : j.at("chunks")) {
      auto& buckets = out.chunks.emplace_back();
      for (const auto& b : bucket_list) {
        auto& shape = buckets.emplace_back();
        shape.numel = core::json_int64(b.at("numel"), where("bucket numel"), 0);
        for (const auto& p : b.at("params")) {
          if (!p.is_array() || p.size() != 3)
            fail(fmt::format("has a parameter entry {}", p.dump()));
          shape.names.push_back(p[0].get<std::string>());
          shape.offsets.push_back(core::json_int64(p[1], where("parameter offset"), 0));
          shape.shapes.push_back(core::json_int64_list(p[2], where("parameter shape"), 0));
          if (shape.offsets.back() + numel_of(shape.shapes.back()) > shape.numel)
            fail(fmt::format("puts '{}' past its bucket's {} values", shape.names.back(),
                             shape.numel));
        }
      }
    }
    for (const auto& [name, s] : j.at("params").items()) {
      if (!s.is_array() || s.size() != 7)
        fail(fmt::format("has a spec for '{}' of {}", name, s.dump()));
      Param p;
      p.spec.dim = core::json_int64(s[0], where("spec dim"), -1);
      p.spec.full = core::json_int64(s[1], where("spec size"), 0);
      p.spec.padded = core::json_int64(s[2], where("spec padding"), 0);
      p.spec.parts = core::json_int64(s[3], where("spec parts"), 1);
      p.spec.units = core::json_int64(s[4], where("spec units"), 0);
      if (!s[5].is_boolean()) fail(fmt::format("gives '{}' a partial flag {}", name, s[5].dump()));
      p.spec.grad_partial = s[5].get<bool>();
      // A tied embedding is on 2 stages; a shared block on up to every one.
      p.stages = core::json_int64(s[6], where("stages"), 1, kMaxRanks);
      p.spec.check(out.tp_size, fmt::format("'{}': parameter '{}'", source, name));
      out.params.emplace(name, p);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(fmt::format("is malformed: {}", e.what()));
  }
  for (const auto& buckets : out.chunks)
    for (const auto& b : buckets)
      for (const auto& name : b.names)
        if (!out.params.count(name)) fail(fmt::format("has no spec for '{}'", name));
  return out;
}

HookValueTotals::HookValueTotals(const parallel::data::CommHook& hook, std::set<std::string> wanted)
    : hook_(&hook), wanted_(std::move(wanted)) {}

void HookValueTotals::add_group(const HookValueLayout& layout,
                                const std::vector<std::map<std::string, at::Tensor>>& values) {
  LOOM_CHECK(groups_ == 0 || (layout.tp_size == tp_size_ && layout.cp_size == cp_size_),
             "the checkpoint's rank-state files disagree on their layout: the group of tp rank "
             "{}, cp rank {}, pp rank {} says tp {} and cp {}, an earlier one tp {} and cp {}",
             layout.tp, layout.cp, layout.pp, layout.tp_size, layout.cp_size, tp_size_, cp_size_);
  LOOM_CHECK(values.size() == layout.chunks.size(),
             "the hook values of the group of tp rank {}, cp rank {}, pp rank {} hold {} model "
             "chunks; its layout has {}",
             layout.tp, layout.cp, layout.pp, values.size(), layout.chunks.size());
  tp_size_ = layout.tp_size;
  cp_size_ = layout.cp_size;
  ++groups_;
  for (size_t c = 0; c < values.size(); ++c) {
    for (const auto& [key, t] : values[c]) {
      const auto split = split_bucket_key(key);
      if (!split) {
        scalars_.emplace(key, t);
        continue;
      }
      const auto& [index, what] = *split;
      LOOM_CHECK(index < static_cast<int64_t>(layout.chunks[c].size()),
                 "hook value '{}' names bucket {} of chunk {}, which has {}", key, index, c,
                 layout.chunks[c].size());
      const auto& bucket = layout.chunks[c][static_cast<size_t>(index)];
      LOOM_CHECK(t.dim() == 1 && t.numel() == bucket.numel,
                 "hook value '{}' holds {} values; its bucket's parameters have {}", key, t.numel(),
                 bucket.numel);
      const bool rms = hook_->value_rule(what) == ValueRule::kRms;
      for (size_t k = 0; k < bucket.names.size(); ++k) {
        const auto& name = bucket.names[k];
        if (!wanted_.empty() && !wanted_.count(name)) continue;
        auto piece = t.narrow(0, bucket.offsets[k], numel_of(bucket.shapes[k]))
                         .to(at::kDouble)
                         .view(bucket.shapes[k]);
        if (rms) piece = piece.clamp_min(0).sqrt();
        auto& p = pieces_[what][name];
        p.param = layout.params.at(name);
        auto& sum = p.by_tp[layout.tp];
        sum = sum.defined() ? sum + piece : piece.clone();
        ++p.added[layout.tp];
      }
    }
  }
}

at::Tensor HookValueTotals::total(const std::string& what, const std::string& name,
                                  const Pieces& p) const {
  // Every tp rank's piece, each the sum over the cp ranks and pipeline stages holding it.
  std::vector<at::Tensor> pieces;
  for (int64_t r = 0; r < tp_size_; ++r) {
    const auto it = p.by_tp.find(r);
    const int64_t added = it == p.by_tp.end() ? 0 : p.added.at(r);
    LOOM_CHECK(added == cp_size_ * p.param.stages,
               "'{}' of parameter '{}': the checkpoint holds {} pieces of tp rank {}'s part, and "
               "its layout (cp {}, {} pipeline stages) makes {}",
               what, name, added, r, cp_size_, p.param.stages, cp_size_ * p.param.stages);
    pieces.push_back(it->second);
  }
  const auto& spec = p.param.spec;
  if (!spec.sharded()) {
    auto sum = pieces[0].clone();
    for (size_t r = 1; r < pieces.size(); ++r) sum += pieces[r];
    // Partial gradients add up; replicas of one gradient count once.
    return spec.grad_partial ? sum : sum / static_cast<double>(tp_size_);
  }
  // Ranks sharing a unit (a key/value head) hold partial gradients of it: summed, the sum
  // standing for each of them.
  const int64_t reps = spec.replicas(tp_size_);
  for (int64_t first = 0; reps > 1 && first < tp_size_; first += reps) {
    auto sum = pieces[static_cast<size_t>(first)].clone();
    for (int64_t r = first + 1; r < first + reps; ++r) sum += pieces[static_cast<size_t>(r)];
    for (int64_t r = first; r < first + reps; ++r) pieces[static_cast<size_t>(r)] = sum;
  }
  return spec.unshard(pieces);
}

std::map<std::string, std::map<std::string, at::Tensor>> HookValueTotals::totals() const {
  std::map<std::string, std::map<std::string, at::Tensor>> out;
  for (const auto& [what, by_name] : pieces_)
    for (const auto& [name, p] : by_name) out[what][name] = total(what, name, p);
  return out;
}

std::vector<std::map<std::string, at::Tensor>> HookValueTotals::values_for(
    const HookValueLayout& mine) const {
  std::vector<std::map<std::string, at::Tensor>> out(mine.chunks.size());
  for (size_t c = 0; c < mine.chunks.size(); ++c) {
    out[c] = scalars_;
    for (size_t i = 0; i < mine.chunks[c].size(); ++i) {
      const auto& bucket = mine.chunks[c][i];
      // One parameter's total at a time: made, cut to this rank's piece, dropped.
      for (const auto& [what, by_name] : pieces_) {
        const bool rms = hook_->value_rule(what) == ValueRule::kRms;
        auto values = at::zeros({bucket.numel}, at::kFloat);
        for (size_t k = 0; k < bucket.names.size(); ++k) {
          const auto& name = bucket.names[k];
          const auto it = by_name.find(name);
          LOOM_CHECK(it != by_name.end(),
                     "the checkpoint's hook state has '{}' of other parameters but none of '{}'",
                     what, name);
          const auto& param = mine.params.at(name);
          const auto whole = total(what, name, it->second);
          LOOM_CHECK(whole.sizes().vec() == param.spec.full_shape(bucket.shapes[k]),
                     "'{}' of parameter '{}' has shape {} in the checkpoint, {} in this model",
                     what, name, whole.sizes(),
                     at::IntArrayRef(param.spec.full_shape(bucket.shapes[k])));
          auto piece = param.spec.shard(whole, mine.tp, mine.tp_size) /
                       static_cast<double>(summed_copies(param, mine.tp_size, mine.cp_size));
          if (rms) piece = piece.square();
          values.narrow(0, bucket.offsets[k], numel_of(bucket.shapes[k]))
              .copy_(piece.reshape({-1}));
        }
        out[c][parallel::data::bucket_state_key(static_cast<int64_t>(i), what)] = values;
      }
    }
  }
  return out;
}

HookValueTotals read_hook_values(const CheckpointContents& checkpoint,
                                 const parallel::data::CommHook& hook, const std::string& hook_text,
                                 std::set<std::string> wanted) {
  // The old ranks by group (tp, cp and pp coordinates), each by its dp rank.
  std::map<std::tuple<int64_t, int64_t, int64_t>,
           std::map<int64_t, std::pair<std::filesystem::path, HookValueLayout>>>
      groups;
  for (const auto& name : checkpoint.state.at("rank_state_files")) {
    const auto path = checkpoint.dir / name.get<std::string>();
    const auto meta = core::SafetensorsReader(path).metadata();
    const auto it = meta.find(kHookValueLayoutKey);
    if (it == meta.end()) continue;
    auto old = HookValueLayout::from_json(it->second, path.string());
    LOOM_CHECK(old.hook == hook_text,
               "'{}' holds the state of --comm-hook {}, and this run uses {}: another hook's "
               "state is not carried over",
               path.string(), old.hook, hook_text);
    auto& group = groups[{old.tp, old.cp, old.pp}];
    const int64_t dp = old.dp;
    LOOM_CHECK(group.emplace(dp, std::make_pair(path, std::move(old))).second,
               "two rank-state files hold the same place in the old layout: '{}' and '{}'",
               group.at(dp).first.string(), path.string());
  }
  HookValueTotals totals(hook, wanted);
  if (groups.empty()) return totals;
  const auto& any = groups.begin()->second.begin()->second.second;
  LOOM_CHECK(static_cast<int64_t>(groups.size()) == any.tp_size * any.cp_size * any.pp_size,
             "the old layout (tp {}, cp {}, pp {}) had {} data-parallel groups, and the "
             "checkpoint holds the hook state of {}",
             any.tp_size, any.cp_size, any.pp_size, any.tp_size * any.cp_size * any.pp_size,
             groups.size());
  for (const auto& [coords, ranks] : groups) {
    const auto& layout = ranks.begin()->second.second;
    LOOM_CHECK(static_cast<int64_t>(ranks.size()) == layout.dp_size &&
                   ranks.rbegin()->first == layout.dp_size - 1,
               "the old group of tp rank {}, cp rank {}, pp rank {} had {} data-parallel ranks, "
               "and the checkpoint holds the hook state of {}",
               std::get<0>(coords), std::get<1>(coords), std::get<2>(coords), layout.dp_size,
               ranks.size());
    // A group holding none of the wanted parameters (another pipeline stage's) is only counted.
    bool holds_wanted = wanted.empty();
    for (const auto& buckets : layout.chunks)
      for (const auto& b : buckets)
        for (const auto& name : b.names) holds_wanted = holds_wanted || wanted.count(name) > 0;
    if (!holds_wanted) {
      totals.add_group(layout,
                       std::vector<std::map<std::string, at::Tensor>>(layout.chunks.size()));
      continue;
    }
    std::vector<parallel::data::StateResharder> resharders(layout.chunks.size(),
                                                           parallel::data::StateResharder(hook));
    for (const auto& [dp, file] : ranks) {  // one file at a time, in dp order
      const core::SafetensorsReader reader(file.first);
      for (size_t c = 0; c < layout.chunks.size(); ++c) {
        const auto prefix = fmt::format("{}/c{}/", layout.owner, c);
        std::map<std::string, at::Tensor> state;
        for (const auto& name : reader.names())
          if (name.rfind(prefix, 0) == 0) state[name.substr(prefix.size())] = reader.read(name);
        resharders[c].add(state);
      }
    }
    std::vector<std::map<std::string, at::Tensor>> values;
    for (size_t c = 0; c < layout.chunks.size(); ++c) {
      std::map<int64_t, parallel::data::BucketShape> shapes;
      for (size_t i = 0; i < layout.chunks[c].size(); ++i)
        shapes.emplace(static_cast<int64_t>(i), layout.chunks[c][i]);
      const auto state = resharders[c].result();
      values.push_back(hook.group_values(state, shapes));
      // A hook that carries state but does not say how it maps onto values would lose it here
      // while the resume reported it carried.
      LOOM_CHECK(state.empty() || !values.back().empty(),
                 "--comm-hook {} does not say how its state maps onto parameter values "
                 "(CommHook::group_values), so it cannot be carried to another layout",
                 hook_text);
    }
    totals.add_group(layout, values);
  }
  return totals;
}

}  // namespace loom::train
