// local-sgd:every=H — local SGD with periodic averaging, as a loom strategy.
//
// Each data-parallel rank steps its optimizer on its own gradients; every H-th step is a
// synchronous one: its gradients are averaged across the ranks (as plain data parallelism does
// every step), and after its update the ranks' parameters and AdamW moments are averaged, so all
// ranks start the next period equal. every=1 is therefore plain data parallelism; larger H
// communicates H times less.
//
// outer_lr=η, outer_momentum=μ (DiLoCo's outer optimizer): the average is not taken as it is; the
// period's change Δ = θ_start - mean(θ) is a pseudo-gradient for Nesterov SGD: u = μu + Δ,
// θ = θ_start - η(Δ + μu). η = 1, μ = 0 (the default) is plain averaging. The outer state
// (θ_start and u) is the strategy's own, saved in checkpoints and restored on resume. It decides
// how the dp ranks agree, so it replaces the built-in data-parallel strategy and cannot be combined
// with ZeRO (which shards what it averages).
#include <loom/core/error.h>
#include <loom/train/checkpoint.h>
#include <loom/train/run_context.h>
#include <loom/train/step_result.h>
#include <loom/train/strategy.h>
#include <torch/torch.h>

#include <fmt/format.h>

namespace {

using loom::train::RunContext;
using loom::train::Strategy;
using loom::train::StrategySpec;

class LocalSgd final : public Strategy {
 public:
  explicit LocalSgd(const StrategySpec& spec)
      : every_(spec.get_int("every", 1)),
        outer_lr_(spec.get_double("outer_lr", 1.0)),
        outer_momentum_(spec.get_double("outer_momentum", 0.0)) {
    spec.check_keys({"every", "outer_lr", "outer_momentum"});
    LOOM_CHECK(every_ >= 1, "--strategy '{}': every={} must be at least 1 (steps per average)",
               spec.text, every_);
    LOOM_CHECK(outer_lr_ > 0, "--strategy '{}': outer_lr={} must be positive", spec.text,
               outer_lr_);
    LOOM_CHECK(outer_momentum_ >= 0 && outer_momentum_ < 1,
               "--strategy '{}': outer_momentum={} must be in [0, 1)", spec.text, outer_momentum_);
  }

  std::string name() const override { return "local-sgd"; }
  // The data-parallel slot: its gradient average finishes before tp's and the pipeline's
  // gradient fix-ups read the gradients.
  loom::train::StrategySlot slot() const override { return loom::train::StrategySlot::kData; }
  loom::train::StrategyTraits traits() const override {
    loom::train::StrategyTraits t;
    t.mesh_dims = {loom::dist::Dim::dp};
    t.config_keys = {"every", "outer_lr", "outer_momentum"};
    t.syncs_data_parallel_gradients = true;
    t.needs_full_gradients = true;
    return t;
  }

  void validate(const RunContext& run, const std::vector<const Strategy*>& /*all*/) const override {
    // Between averages the ranks differ, and a checkpoint holds one replica: save only where
    // they agree.
    const auto& c = run.config;
    if (!c.save_dir.empty()) {
      LOOM_CHECK(c.save_every % every_ == 0 && c.steps % every_ == 0,
                 "strategy 'local-sgd' (every={}) saves only where the ranks agree: --save-every "
                 "{} and --steps {} must be multiples of {}",
                 every_, c.save_every, c.steps, every_);
      LOOM_CHECK(c.save_every_s == 0,
                 "strategy 'local-sgd' (every={}) saves only where the ranks agree: "
                 "--save-every-s {} could fall between two averages (use --save-every)",
                 every_, c.save_every_s);
    }
  }

  void apply(RunContext& run) override {
    // Replicas start equal however they were initialized.
    torch::NoGradGuard no_grad;
    auto& dp = run.mesh->comm(loom::dist::Dim::dp);
    if (dp.size() > 1)
      for (auto& [name, p] : run.named_parameters()) dp.broadcast(p, 0);
    if (!outer_step()) return;
    for (auto& [name, p] : run.named_parameters()) {
      start_.emplace_back(name, p.detach().clone());
      velocity_.emplace_back(name, torch::zeros_like(p));
    }
  }

  void finish_gradient_sync(RunContext& run, loom::train::StepResult& /*result*/) override {
    if (!synchronous(run.step + 1)) return;
    torch::NoGradGuard no_grad;
    auto& dp = run.mesh->comm(loom::dist::Dim::dp);
    // Every rank reduces every parameter's gradient (zeros where it got none), in the same order.
    for (auto& [name, p] : run.named_parameters()) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      dp.all_reduce(p.mutable_grad(), loom::dist::ReduceOp::Avg);
    }
  }

  void after_optimizer_step(RunContext& run) override {
    if (!synchronous(run.step)) return;  // run.step counts this step already
    torch::NoGradGuard no_grad;
    auto& dp = run.mesh->comm(loom::dist::Dim::dp);
    for (auto& [name, p] : run.named_parameters()) dp.all_reduce(p, loom::dist::ReduceOp::Avg);
    // The moments too (the live tensors the engine hands out; "step" is a count, equal).
    for (auto& [key, t] : run.optimizer->per_parameter_state())
      if (key != "step") dp.all_reduce(t, loom::dist::ReduceOp::Avg);
    if (!outer_step()) return;
    // Nesterov on the pseudo-gradient, from the period's starting point (equal on every rank).
    const auto params = run.named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      auto& p = params[i].second;
      auto& start = start_[i].second;
      auto& u = velocity_[i].second;
      const auto delta = start - p;
      u.mul_(outer_momentum_).add_(delta);
      p.copy_(start - outer_lr_ * (delta + outer_momentum_ * u));
      start.copy_(p);
    }
  }

  void save_state(RunContext& /*run*/, nlohmann::json& state,
                  std::vector<std::pair<std::string, at::Tensor>>& tensors) override {
    state["local_sgd"] = {
        {"every", every_}, {"outer_lr", outer_lr_}, {"outer_momentum", outer_momentum_}};
    for (const auto& [name, t] : start_) tensors.emplace_back("local_sgd.start/" + name, t);
    for (const auto& [name, t] : velocity_) tensors.emplace_back("local_sgd.velocity/" + name, t);
  }

  void load_state(RunContext& /*run*/, const loom::train::CheckpointContents& ckpt) override {
    torch::NoGradGuard no_grad;
    auto restore = [&](const std::string& prefix, auto& tensors) {
      for (auto& [name, t] : tensors) {
        auto it = ckpt.optimizer.find(prefix + name);
        LOOM_CHECK(it != ckpt.optimizer.end(),
                   "strategy 'local-sgd': checkpoint '{}' has no '{}' (written by a run without "
                   "the outer optimizer?)",
                   ckpt.dir.string(), prefix + name);
        t.copy_(it->second);
      }
    };
    restore("local_sgd.start/", start_);
    restore("local_sgd.velocity/", velocity_);
  }

  void add_metrics(const RunContext& run, const loom::train::StepResult& /*result*/,
                   nlohmann::json& record) const override {
    record["local_sgd_synchronous"] = synchronous(run.step);
  }

  std::string describe(const RunContext& run) const override {
    return fmt::format(
        "local SGD: {} data-parallel ranks step on their own gradients; every {} steps a "
        "synchronous step averages gradients, then parameters and moments{}",
        run.size(loom::dist::Dim::dp), every_,
        outer_step()
            ? fmt::format(" (outer Nesterov step, lr {}, momentum {})", outer_lr_, outer_momentum_)
            : "");
  }

 private:
  // Step s (1-based) is synchronous when every divides it.
  bool synchronous(int64_t s) const { return s % every_ == 0; }
  bool outer_step() const { return outer_lr_ != 1.0 || outer_momentum_ != 0.0; }
  int64_t every_;
  double outer_lr_, outer_momentum_;
  // The outer optimizer's state, per parameter: the period's starting point and the velocity.
  std::vector<std::pair<std::string, at::Tensor>> start_, velocity_;
};

}  // namespace

LOOM_REGISTER_STRATEGY(local_sgd, LocalSgd, "local-sgd");
