// prune: gradual magnitude pruning during training (Zhu & Gupta 2017). Every --prune-every steps
// from --prune-start to --prune-end the masks of the chosen linears are recomputed from the
// weights' magnitudes at the cubic schedule's sparsity, and after every optimizer step the pruned
// weights are set to zero again. A threshold covers one weight (--prune-scope layer) or all of
// them (global); where the weights are split over tensor- or pipeline-parallel ranks the ranks
// find it together, by an exact bisection on counts (ops::kth_largest_keys), so the masks are the
// single-process ones without any rank gathering a weight. Under ZeRO-3 each rank masks only its
// dp shard of each weight: unstructured counts are summed over dp too, block scores are summed
// from the shards' pieces, and N:M groups (which a shard boundary may cut) are chosen on the
// weight gathered one unit at a time, as a checkpoint gathers it. The masks are the zeros of the
// weights: checkpoints, resharding and export carry them with the weights. As in the paper's
// masked forward (W * M), a pruned weight gets no gradient: the gradient this rank keeps after
// the sync (whole, or ZeRO's shard) is masked before clipping and the step. Once masks exist,
// the pruned layers take a sparse kernel where the pattern has one on the device
// (ops/sparse_linear.h; --prune-kernels off keeps the masked dense product). See
// docs/sparsity.md.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <spdlog/spdlog.h>
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "builtin.h"
#include "loom/core/error.h"
#include "loom/ops/sparse_linear.h"
#include "loom/ops/sparsity.h"
#include "loom/parallel/tensor/layers.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/checkpoint.h"
#include "loom/train/run_context.h"
#include "loom/train/step_result.h"

namespace loom::train::strategies {

namespace {

using ops::SparsityPattern;

struct Target {
  std::string name;
  size_t chunk = 0;
  std::vector<int64_t> shape;  // the weight as this rank's model holds it (its tp shard)
  int64_t replicas = 1;        // tp ranks holding this same piece
  // Over the elements of this rank's piece of the weight (OptimizerEngine::param_piece: the
  // whole weight, flattened, or its ZeRO-3 shard), bool; undefined until the first update.
  at::Tensor mask;
  bool two_four = false;  // the whole weight's zeros are 2:4 (checked where a 2:4 format is set)
  // A copy of a weight another stage (or chunk) counts (a block shared across layers): pruned
  // like it, left out of global counts.
  bool copy = false;
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
    return {{dist::Dim::dp, dist::Dim::tp, dist::Dim::pp},
            {"prune_to", "prune_pattern", "prune_start", "prune_end", "prune_every", "prune_scope",
             "prune_targets", "prune_kernels"}};
  }

  void validate(const RunContext& run, const std::vector<const Strategy*>& /*all*/) const override {
    LOOM_CHECK(!run.custom_model,
               "strategy 'prune' (--prune-*) prunes the linears of loom's GPT-2 and Llama blocks; "
               "a custom model names no such linears");
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
        Target t{.name = name,
                 .chunk = chunk,
                 .shape = p.sizes().vec(),
                 .replicas = spec.sharded() ? spec.replicas(tp) : tp,
                 .copy = run.chunks[chunk]->is_copy(name)};
        const auto layer = layers.find(name.substr(0, name.size() - std::string(".weight").size()));
        if (layer != layers.end()) t.layer = layer->second;
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

  // The masked forward's gradient: what this rank keeps after the sync (the whole gradient, or
  // ZeRO's shard of it), masked before the norm, clipping and the step see it. The dp reduction
  // (slot 600) has finished; tensor parallelism's partial sums (slot 200) come after.
  void finish_gradient_sync(RunContext& run, StepResult& /*result*/) override {
    torch::NoGradGuard no_grad;
    for (auto& t : targets_) {
      if (!t.mask.defined()) continue;
      const auto piece = run.optimizer->param_piece(t.chunk, t.name);
      auto grad = run.optimizer->grad_piece(t.chunk, t.name);
      if (grad.values.numel() == 0) continue;
      const int64_t start = grad.offset - piece.offset;
      LOOM_CHECK(start >= 0 && start + grad.values.numel() <= t.mask.numel(),
                 "prune: the gradient of '{}' this rank keeps (elements [{}, {})) is not within "
                 "its piece of the weight ([{}, {}))",
                 t.name, grad.offset, grad.offset + grad.values.numel(), piece.offset,
                 piece.offset + t.mask.numel());
      grad.values.mul_(t.mask.narrow(0, start, grad.values.numel()));
    }
  }

  void after_optimizer_step(RunContext& run) override {
    // The step moved the pruned weights too: mask first, so a mask update sees the weights as
    // masked so far (a weight pruned earlier scores 0 and stays pruned).
    apply_masks(run);
    if (!schedule_.updates_at(run.step)) return;
    update_masks(run);
    apply_masks(run);
  }

  // Resuming: the masks are where the saved weights are zero.
  void load_state(RunContext& run, const CheckpointContents& /*checkpoint*/) override {
    if (run.step < schedule_.start) return;
    for (auto& t : targets_) t.mask = piece_of(run, t).values != 0;
    if (format_.kind == ops::SparseLinearFormat::Kind::kTwoFour)
      visit_whole(run, [&](Target& t, const at::Tensor& w) {
        t.two_four = is_two_four(w != 0, format_.transposable);
      });
    measure(run);
    publish_masks(run);
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

  OptimizerEngine::ParamPiece piece_of(RunContext& run, const Target& t) const {
    auto piece = run.optimizer->param_piece(t.chunk, t.name);
    const int64_t numel = t.shape.at(0) * t.shape.at(1);
    LOOM_CHECK(piece.dp_shard || piece.values.numel() == numel,
               "prune: the optimizer holds {} elements of '{}', not the {} of its weight",
               piece.values.numel(), t.name, numel);
    return piece;
  }

  // Whether this rank holds disjoint dp shards of the weights (ZeRO-3), not whole weights.
  bool dp_sharded(RunContext& run) const {
    return !targets_.empty() && piece_of(run, targets_.front()).dp_shard;
  }

  void apply_masks(RunContext& run) {
    torch::NoGradGuard no_grad;
    for (auto& t : targets_)
      if (t.mask.defined()) piece_of(run, t).values.mul_(t.mask);
  }

  // Calls fn(target, whole weight) for every target: the weight itself where this rank holds
  // it whole; under ZeRO-3 gathered, one unit at a time, by every dp rank together.
  void visit_whole(RunContext& run, const std::function<void(Target&, const at::Tensor&)>& fn) {
    if (!dp_sharded(run)) {
      for (auto& t : targets_) fn(t, piece_of(run, t).values.view(t.shape));
      return;
    }
    const auto engines = run.optimizer->sharded_state();
    LOOM_CHECK(engines.size() == run.chunks.size(),
               "prune: {} sharded optimizer engines for {} model chunks", engines.size(),
               run.chunks.size());
    for (size_t chunk = 0; chunk < engines.size(); ++chunk) {
      std::map<std::string, Target*> by_name;
      for (auto& t : targets_)
        if (t.chunk == chunk) by_name[t.name] = &t;
      engines[chunk]->for_each_gathered_parameter(
          std::nullopt, [&](const std::string& name, const at::Tensor& value) {
            auto it = by_name.find(name);
            if (it != by_name.end()) fn(*it->second, value.detach().view(it->second->shape));
          });
    }
  }

  // Sums one tensor per target over dp (in place), in one all-reduce: pieces of ZeRO-3 shards.
  static void sum_over_dp(RunContext& run, std::vector<at::Tensor>& parts) {
    if (run.size(dist::Dim::dp) == 1 || parts.empty()) return;
    std::vector<at::Tensor> flat;
    for (const auto& p : parts) flat.push_back(p.reshape({-1}));
    auto& dp = run.mesh->comm(dist::Dim::dp);
    auto all = dist::on_comm_device(dp, at::cat(flat));
    dp.all_reduce(all, dist::ReduceOp::Sum);
    all = all.to(parts.front().device());
    int64_t at = 0;
    for (auto& p : parts) {
      p = all.narrow(0, at, p.numel()).view(p.sizes());
      at += p.numel();
    }
  }

  // Sums per-target counts over the ranks holding pieces of each weight: over dp when the
  // counts are of ZeRO-3 shards (`over_dp`), over tp (a piece several tp ranks hold counted
  // once), then, for the global scope, over the targets and the stages (pp).
  std::vector<int64_t> reduce_counts(RunContext& run, std::vector<int64_t> local, bool global,
                                     bool over_dp) const {
    const auto sum_over = [&](dist::Dim dim) {
      auto& comm = run.mesh->comm(dim);
      auto t = dist::on_comm_device(comm, at::tensor(local, at::kLong));
      comm.all_reduce(t, dist::ReduceOp::Sum);
      t = t.cpu();
      for (size_t i = 0; i < local.size(); ++i)
        local[i] = t[static_cast<int64_t>(i)].item<int64_t>();
    };
    if (over_dp && run.size(dist::Dim::dp) > 1) sum_over(dist::Dim::dp);
    if (run.size(dist::Dim::tp) > 1) {
      sum_over(dist::Dim::tp);
      for (size_t i = 0; i < local.size(); ++i) local[i] /= targets_[i].replicas;
    }
    if (!global) return local;
    int64_t sum = 0;
    for (size_t i = 0; i < local.size(); ++i)
      if (!targets_[i].copy) sum += local[i];
    if (run.size(dist::Dim::pp) > 1) {
      auto& pp = run.mesh->comm(dist::Dim::pp);
      auto t = dist::on_comm_device(pp, at::full({1}, sum, at::kLong));
      pp.all_reduce(t, dist::ReduceOp::Sum);
      sum = t.cpu().item<int64_t>();
    }
    return {sum};
  }

  // Per target, the sums of `values` (a tensor over its piece) over each block x block tile of
  // the whole weight: from the whole weight, or from the ZeRO-3 shards' pieces summed over dp.
  std::vector<at::Tensor> tile_sums(RunContext& run,
                                    const std::function<at::Tensor(const Target&)>& values) {
    const bool sharded = dp_sharded(run);
    std::vector<at::Tensor> sums;
    for (const auto& t : targets_) {
      const auto v = values(t);
      sums.push_back(
          sharded ? ops::block_scores_of_piece(v, piece_of(run, t).offset, t.shape, pattern_.block)
                  : ops::block_scores(v.view(t.shape).to(at::kDouble), pattern_.block));
    }
    if (sharded) sum_over_dp(run, sums);
    return sums;
  }

  void update_masks(RunContext& run) {
    torch::NoGradGuard no_grad;
    const bool sharded = dp_sharded(run);
    if (pattern_.kind == SparsityPattern::Kind::kNofM) {
      // No threshold: each group (or M x M block) on its own, from the whole weight, since a
      // ZeRO-3 shard boundary may cut a group.
      visit_whole(run, [&](Target& t, const at::Tensor& w) {
        const auto mask = pattern_.transposable
                              ? ops::transposable_n_of_m_mask(w, pattern_.n, pattern_.m)
                              : ops::n_of_m_mask(w, pattern_.n, pattern_.m);
        if (format_.kind == ops::SparseLinearFormat::Kind::kTwoFour)
          t.two_four = is_two_four(mask, format_.transposable);
        const auto offset = sharded ? piece_of(run, t).offset : 0;
        const auto numel = sharded ? piece_of(run, t).values.numel() : mask.numel();
        auto piece = mask.reshape({-1}).narrow(0, offset, numel).clone();
        t.mask = t.mask.defined() ? t.mask & piece : piece;
      });
      measure(run);
      publish_masks(run);
      return;
    }
    const bool global = run.config.prune.scope == "global";
    const bool blocks = pattern_.kind == SparsityPattern::Kind::kBlock;
    // The pieces are masked already: a weight pruned earlier scores 0, below any threshold that
    // keeps fewer than the weights still alive. Tile scores are whole on every dp rank (summed
    // from the shards); magnitudes stay pieces, whose counts are summed over dp.
    std::vector<at::Tensor> keys;
    if (blocks) {
      for (const auto& s : tile_sums(run, [&](const Target& t) { return piece_of(run, t).values; }))
        keys.push_back(ops::score_keys(s).flatten());
    } else {
      for (const auto& t : targets_) keys.push_back(ops::score_keys(piece_of(run, t).values.abs()));
    }
    const bool keys_over_dp = sharded && !blocks;
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
      return reduce_counts(run, local, global, keys_over_dp);
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
        const auto tiles = mask.reshape({t.shape[0] / b, t.shape[1] / b});
        if (sharded) {
          const auto piece = piece_of(run, t);
          mask = ops::block_mask_of_piece(tiles, piece.offset, piece.values.numel(), t.shape, b);
        } else {
          mask = ops::expand_block_mask(tiles, b).reshape({-1});
        }
      }
      t.mask = t.mask.defined() ? t.mask & mask : mask;
    }
    measure(run);
    publish_masks(run);
  }

  // The layers take the pattern's product: a 2:4 one only where the zeros are 2:4 (a resumed
  // checkpoint pruned otherwise is not), a block one told its tile sparsity (so it needs no
  // device sync per call).
  void publish_masks(RunContext& run) {
    using Kind = ops::SparseLinearFormat::Kind;
    std::vector<at::Tensor> kept_per_tile;
    if (format_.kind == Kind::kBlock)
      kept_per_tile = tile_sums(run, [](const Target& t) { return t.mask; });
    for (size_t i = 0; i < targets_.size(); ++i) {
      auto& t = targets_[i];
      if (t.layer == nullptr) continue;
      const auto layer_name = t.name.substr(0, t.name.rfind('.'));
      auto format = format_;
      if (format.kind == Kind::kTwoFour && !t.two_four) {
        spdlog::warn("{}: its zeros are not {} (resumed from weights pruned otherwise?): it keeps "
                     "the masked dense product",
                     layer_name, format.transposable ? "2:4 along rows and columns" : "2:4");
        format = {};
      }
      if (format.kind == Kind::kBlock)
        format.tile_sparsity = 1.0 - (kept_per_tile[i] > 0).to(at::kDouble).mean().item<double>();
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
      const auto piece = piece_of(run, t).values.detach();
      zeros.push_back((piece * t.mask == 0).sum().item<int64_t>());
      totals.push_back(piece.numel());
    }
    const bool sharded = dp_sharded(run);
    const auto z = reduce_counts(run, zeros, true, sharded),
               n = reduce_counts(run, totals, true, sharded);
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
