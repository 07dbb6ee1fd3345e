// prune: gradual magnitude pruning during training (Zhu & Gupta 2017). Every --prune-every steps
// from --prune-start to --prune-end the masks of the chosen linears are recomputed from the
// weights' magnitudes at the cubic schedule's sparsity, and after every optimizer step the pruned
// weights are set to zero again. A threshold covers one weight (--prune-scope layer) or all of
// them (global); where the weights are split over tensor- or pipeline-parallel ranks the ranks
// find it together, by an exact bisection on counts (ops::kth_largest_keys), so the masks are the
// single-process ones without any rank gathering a weight. The masks are the zeros of the
// weights: checkpoints, resharding and export carry them with the weights. As in the paper's
// masked forward (W * M), a pruned weight gets no gradient: a hook zeroes it before it is
// accumulated, so gradient clipping and every layout see the masked gradient. Once masks exist,
// the pruned layers take a sparse kernel where the pattern has one on the device
// (ops/sparse_linear.h; --prune-kernels off keeps the masked dense product). See
// docs/sparsity.md.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "builtin.h"
#include "loom/core/error.h"
#include "loom/ops/sparse_linear.h"
#include "loom/ops/sparsity.h"
#include "loom/parallel/tensor/layers.h"
#include "loom/train/checkpoint.h"
#include "loom/train/run_context.h"
#include "loom/train/step_result.h"

namespace loom::train::strategies {

namespace {

using ops::SparsityPattern;

struct Target {
  std::string name;
  at::Tensor weight;     // this rank's piece (a view into ZeRO's flat buffer under ZeRO-1/2)
  int64_t replicas = 1;  // tp ranks holding this same piece
  at::Tensor mask;       // bool, the weight's shape; undefined until the first update
  // What the gradient hook multiplies by: the mask, shared with the hook.
  std::shared_ptr<at::Tensor> grad_mask = std::make_shared<at::Tensor>();
  parallel::tensor::PrunableLinear* layer = nullptr;  // the layer whose weight this is
};

bool selected(const std::string& name, const std::string& targets) {
  const bool mlp = targets.find("mlp") != std::string::npos;
  const bool attention = targets.find("attention") != std::string::npos;
  if (!name.ends_with(".weight")) return false;
  if (mlp && name.find(".mlp.") != std::string::npos) return true;
  return attention && (name.find(".attn.") != std::string::npos ||
                       name.find(".self_attn.") != std::string::npos);
}

class Pruning final : public Strategy {
 public:
  explicit Pruning(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "prune"; }
  StrategyTraits traits() const override {
    return {{dist::Dim::tp, dist::Dim::pp},
            {"prune_to", "prune_pattern", "prune_start", "prune_end", "prune_every", "prune_scope",
             "prune_targets", "prune_kernels"}};
  }

  void validate(const RunContext& run, const std::vector<const Strategy*>& /*all*/) const override {
    LOOM_CHECK(!run.custom_model,
               "strategy 'prune' (--prune-*) prunes the linears of loom's GPT-2 and Llama blocks; "
               "a custom model names no such linears");
    LOOM_CHECK(!run.config.offload_optimizer,
               "strategy 'prune' with --offload-optimizer: the offloaded optimizer keeps master "
               "weights on the host, which the masks do not reach yet; train without "
               "--offload-optimizer");
    LOOM_CHECK(run.config.zero != 3,
               "strategy 'prune' with --zero 3: ZeRO-3 holds each weight as flat dp shards, and "
               "pruning them is not built yet; use --zero 1 or 2 (the weights stay whole)");
  }

  void apply(RunContext& run) override {
    const auto& c = run.config.prune;
    pattern_ = SparsityPattern::parse(c.pattern);
    schedule_ = {.final_sparsity = pattern_.kind == SparsityPattern::Kind::kNofM
                                       ? pattern_.fixed_sparsity()
                                       : c.to,
                 .start = c.start,
                 .end = c.end_step(run.config.steps),
                 .every = c.every};
    schedule_.validate();
    const int64_t tp = run.size(dist::Dim::tp);
    for (size_t chunk = 0; chunk < run.chunks.size(); ++chunk) {
      std::map<std::string, parallel::tensor::PrunableLinear*> layers;
      for (const auto& item : run.chunks[chunk]->named_modules())
        if (auto* l = dynamic_cast<parallel::tensor::PrunableLinear*>(item.value().get()))
          layers[item.key()] = l;
      for (const auto& [name, p] : run.named_parameters(chunk)) {
        if (!selected(name, c.targets) || p.dim() != 2) continue;
        const auto& spec = run.chunks[chunk]->shard_spec(name);
        check_divides(name, p, spec);
        Target t{name, p, spec.sharded() ? spec.replicas(tp) : tp, {}};
        const auto layer = layers.find(name.substr(0, name.size() - std::string(".weight").size()));
        if (layer != layers.end()) t.layer = layer->second;
        // A pruned weight's gradient is zero (the masked forward's), whatever the product was.
        auto p_mut = p;
        p_mut.register_hook([mask = t.grad_mask](const at::Tensor& grad) {
          return mask->defined() ? grad * *mask : at::Tensor();
        });
        targets_.push_back(std::move(t));
      }
    }
    if (c.kernels == "off") {
      kernels_ = "off (--prune-kernels off): the masked dense product";
    } else if (pattern_.kind == SparsityPattern::Kind::kNofM && pattern_.n == 2 &&
               pattern_.m == 4) {
      format_ = {ops::SparseLinearFormat::Kind::kTwoFour, 0, pattern_.transposable};
      kernels_ = pattern_.transposable
                     ? "2:4 tensor-core kernel on CUDA in bf16/fp16 for the forward and the input "
                       "gradient, else the masked dense product"
                     : "2:4 tensor-core kernel on CUDA in bf16/fp16 for the forward, else the "
                       "masked dense product";
    } else if (pattern_.kind == SparsityPattern::Kind::kBlock) {
      format_ = {ops::SparseLinearFormat::Kind::kBlock, pattern_.block};
      kernels_ = fmt::format(
          "block-sparse product from {:.0f}% of tiles dropped (on the CPU; on "
          "CUDA with 32 or 64 tiles in bf16/fp16), else the masked dense "
          "product",
          100 * ops::kBlockSparseMinTileSparsity);
    } else {
      kernels_ = fmt::format("the masked dense product (no kernel for {})", pattern_.describe());
    }
  }

  void after_optimizer_step(RunContext& run) override {
    if (schedule_.updates_at(run.step)) update_masks(run);
    torch::NoGradGuard no_grad;
    for (auto& t : targets_)
      if (t.mask.defined()) t.weight.mul_(t.mask);
  }

  // Resuming: the masks are where the saved weights are zero.
  void load_state(RunContext& run, const CheckpointContents& /*checkpoint*/) override {
    if (run.step < schedule_.start) return;
    for (auto& t : targets_) t.mask = t.weight.detach() != 0;
    measure(run);
    publish_masks();
  }

  void save_state(RunContext& /*run*/, nlohmann::json& state,
                  std::vector<std::pair<std::string, at::Tensor>>& /*tensors*/) override {
    state["prune"] = {{"sparsity", sparsity_}, {"pattern", pattern_.describe()}};
  }

  void add_metrics(const RunContext& /*run*/, const StepResult& /*result*/,
                   nlohmann::json& record) const override {
    record["sparsity"] = sparsity_;
  }

  std::string describe(const RunContext& run) const override {
    const auto& c = run.config.prune;
    return fmt::format(
        "pruning: {} to sparsity {:.3g} over steps {}..{} (masks every {} steps, {} threshold), "
        "{} weights on this rank ({}); products: {}",
        pattern_.describe(), schedule_.final_sparsity, schedule_.start, schedule_.end,
        schedule_.every, c.scope, targets_.size(), c.targets, kernels_);
  }

 private:
  // A block or N:M group must lie within one rank's piece, and within one part of a fused
  // projection, for the masks to be the single-process ones.
  void check_divides(const std::string& name, const at::Tensor& p,
                     const parallel::tensor::ShardSpec& spec) const {
    const auto shape = fmt::format("[{}]", fmt::join(p.sizes(), ", "));
    if (pattern_.kind == SparsityPattern::Kind::kNofM)
      LOOM_CHECK(p.size(1) % pattern_.m == 0,
                 "--prune-pattern {}: '{}' holds {} {} on this rank, whose rows of {} do not "
                 "split into groups of {}",
                 pattern_.describe(), name, shape, spec.sharded() ? "(its tp shard)" : "",
                 p.size(1), pattern_.m);
    if (pattern_.kind == SparsityPattern::Kind::kNofM && pattern_.transposable) {
      const int64_t rows_per_part = p.size(0) / std::max<int64_t>(1, spec.parts);
      LOOM_CHECK(rows_per_part % pattern_.m == 0,
                 "--prune-pattern {}: '{}' is {} on this rank ({} part(s) of {} rows), whose "
                 "columns do not split into groups of {} within a part",
                 pattern_.describe(), name, shape, spec.parts, rows_per_part, pattern_.m);
    }
    if (pattern_.kind == SparsityPattern::Kind::kBlock) {
      const int64_t rows_per_part = p.size(0) / std::max<int64_t>(1, spec.parts);
      LOOM_CHECK(rows_per_part % pattern_.block == 0 && p.size(1) % pattern_.block == 0,
                 "--prune-pattern {}: '{}' is {} on this rank ({} part(s) of {} rows), which "
                 "{} x {} blocks do not tile; choose a block size that divides both dimensions "
                 "of every shard",
                 pattern_.describe(), name, shape, spec.parts, rows_per_part, pattern_.block,
                 pattern_.block);
    }
  }

  // Sums per-target counts over the ranks holding pieces of each weight (tp; each piece once),
  // then, for the global scope, over the stages (pp).
  std::vector<int64_t> reduce_counts(RunContext& run, std::vector<int64_t> local,
                                     bool global) const {
    if (run.size(dist::Dim::tp) > 1) {
      auto& tp = run.mesh->comm(dist::Dim::tp);
      auto t = dist::on_comm_device(tp, at::tensor(local, at::kLong));
      tp.all_reduce(t, dist::ReduceOp::Sum);
      t = t.cpu();
      for (size_t i = 0; i < local.size(); ++i)
        local[i] = t[static_cast<int64_t>(i)].item<int64_t>() / targets_[i].replicas;
    }
    if (!global) return local;
    int64_t sum = 0;
    for (const auto v : local) sum += v;
    if (run.size(dist::Dim::pp) > 1) {
      auto& pp = run.mesh->comm(dist::Dim::pp);
      auto t = dist::on_comm_device(pp, at::full({1}, sum, at::kLong));
      pp.all_reduce(t, dist::ReduceOp::Sum);
      sum = t.cpu().item<int64_t>();
    }
    return {sum};
  }

  void update_masks(RunContext& run) {
    torch::NoGradGuard no_grad;
    if (pattern_.kind == SparsityPattern::Kind::kNofM) {
      // From the weights as masked so far: the step just taken moved the pruned ones too.
      for (auto& t : targets_) {
        const auto alive = t.mask.defined() ? t.weight.detach() * t.mask : t.weight.detach();
        t.mask = pattern_.transposable
                     ? ops::transposable_n_of_m_mask(alive, pattern_.n, pattern_.m)
                     : ops::n_of_m_mask(alive, pattern_.n, pattern_.m);
      }
      measure(run);
      publish_masks();
      return;
    }
    const bool global = run.config.prune.scope == "global";
    const bool blocks = pattern_.kind == SparsityPattern::Kind::kBlock;
    std::vector<at::Tensor> keys;
    for (const auto& t : targets_) {
      // Weights pruned earlier stay pruned (their score is 0, below any threshold that keeps
      // fewer than the weights still alive).
      auto w = t.mask.defined() ? t.weight.detach() * t.mask : t.weight.detach();
      keys.push_back(
          ops::score_keys(blocks ? ops::block_scores(w, pattern_.block) : w.abs()).flatten());
    }
    const auto count = [&](const std::vector<int64_t>& thresholds) {
      // One host copy per round for all targets (a GPU would sync once per .item()).
      std::vector<at::Tensor> sums;
      for (size_t i = 0; i < targets_.size(); ++i)
        sums.push_back((keys[i] >= thresholds[global ? 0 : i]).sum());
      std::vector<int64_t> local(targets_.size());
      if (!sums.empty()) {
        const auto host = at::stack(sums).cpu();
        for (size_t i = 0; i < local.size(); ++i)
          local[i] = host[static_cast<int64_t>(i)].item<int64_t>();
      }
      return reduce_counts(run, local, global);
    };
    const double sparsity = schedule_.at(run.step);
    auto totals = count(std::vector<int64_t>(global ? 1 : targets_.size(), 0));
    std::vector<int64_t> keep;
    for (const auto total : totals)
      keep.push_back(std::llround((1.0 - sparsity) * static_cast<double>(total)));
    const auto thresholds = ops::kth_largest_keys(keep, count);
    for (size_t i = 0; i < targets_.size(); ++i) {
      auto& t = targets_[i];
      auto mask = keys[i] >= thresholds[global ? 0 : i];
      if (blocks) {
        const int64_t b = pattern_.block;
        mask =
            ops::expand_block_mask(mask.reshape({t.weight.size(0) / b, t.weight.size(1) / b}), b);
      }
      mask = mask.reshape(t.weight.sizes());
      t.mask = t.mask.defined() ? t.mask & mask : mask;
    }
    measure(run);
    publish_masks();
  }

  // The gradient hooks mask with the new masks, and the layers take the pattern's product: a
  // 2:4 one only where the zeros are 2:4 (a resumed checkpoint pruned otherwise is not), a block
  // one told its tile sparsity (so it needs no device sync per call).
  void publish_masks() {
    using Kind = ops::SparseLinearFormat::Kind;
    for (auto& t : targets_) {
      *t.grad_mask = t.mask;
      if (t.layer == nullptr) continue;
      const auto layer_name = t.name.substr(0, t.name.rfind('.'));
      auto format = format_;
      if (format.kind == Kind::kTwoFour && !is_two_four(t.mask, format.transposable)) {
        spdlog::warn("{}: its zeros are not {} (resumed from weights pruned otherwise?): it keeps "
                     "the masked dense product",
                     layer_name, format.transposable ? "2:4 along rows and columns" : "2:4");
        format = {};
      }
      if (format.kind == Kind::kBlock) {
        const int64_t b = format.block;
        const auto tiles = t.mask.reshape({t.mask.size(0) / b, b, t.mask.size(1) / b, b})
                               .any(3)
                               .any(1);
        format.tile_sparsity = 1.0 - tiles.to(at::kDouble).mean().item<double>();
      }
      t.layer->set_sparse_format(format, layer_name);
    }
  }

  // At most 2 kept of every 4 along the rows (and, transposable, along the columns).
  static bool is_two_four(const at::Tensor& mask, bool transposable) {
    auto ok = (mask.reshape({-1, 4}).sum(1) <= 2).all();
    if (transposable && mask.size(0) % 4 == 0)
      ok = ok & (mask.t().contiguous().reshape({-1, 4}).sum(1) <= 2).all();
    else if (transposable)
      return false;
    return ok.item<bool>();
  }

  // The fraction of zeros among every target weight of the model (all ranks' pieces, once).
  void measure(RunContext& run) {
    std::vector<int64_t> zeros, totals;
    for (const auto& t : targets_) {
      zeros.push_back((t.weight.detach() * t.mask == 0).sum().item<int64_t>());
      totals.push_back(t.weight.numel());
    }
    const auto z = reduce_counts(run, zeros, true), n = reduce_counts(run, totals, true);
    sparsity_ = n[0] > 0 ? static_cast<double>(z[0]) / static_cast<double>(n[0]) : 0.0;
  }

  SparsityPattern pattern_;
  ops::PruneSchedule schedule_;
  std::vector<Target> targets_;
  ops::SparseLinearFormat format_;  // what the layers take once masks exist
  std::string kernels_;             // the products, for the setup log
  double sparsity_ = 0;
};

}  // namespace

void register_prune() {
  register_strategy("prune", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<Pruning>(spec);
  });
}

}  // namespace loom::train::strategies
