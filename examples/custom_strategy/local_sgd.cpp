// local-sgd:every=H — local SGD with periodic averaging, as a loom strategy.
//
// Each data-parallel rank steps its optimizer on its own gradients; every H-th step is a
// synchronous one: its gradients are averaged across the ranks (as plain data parallelism does
// every step), and after its update the ranks' parameters and AdamW moments are averaged, so all
// ranks start the next period equal. every=1 is therefore plain data parallelism; larger H
// communicates H times less. It decides how the dp ranks agree, so it replaces the built-in
// data-parallel strategy and cannot be combined with ZeRO (which shards what it averages).
#include <loom/core/error.h>
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
  explicit LocalSgd(const StrategySpec& spec) : every_(spec.get_int("every", 1)) {
    spec.check_keys({"every"});
    LOOM_CHECK(every_ >= 1, "--strategy '{}': every={} must be at least 1 (steps per average)",
               spec.text, every_);
  }

  std::string name() const override { return "local-sgd"; }
  // The data-parallel slot: its gradient average finishes before tp's and the pipeline's
  // gradient fix-ups read the gradients.
  loom::train::StrategySlot slot() const override { return loom::train::StrategySlot::kData; }
  loom::train::StrategyTraits traits() const override {
    loom::train::StrategyTraits t;
    t.mesh_dims = {loom::dist::Dim::dp};
    t.config_keys = {"every"};
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
    }
  }

  void apply(RunContext& run) override {
    // Replicas start equal however they were initialized.
    torch::NoGradGuard no_grad;
    auto& dp = run.mesh->comm(loom::dist::Dim::dp);
    if (dp.size() > 1)
      for (auto& [name, p] : run.named_parameters()) dp.broadcast(p, 0);
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
  }

  void save_state(RunContext& /*run*/, nlohmann::json& state,
                  std::vector<std::pair<std::string, at::Tensor>>& /*tensors*/) override {
    state["local_sgd"] = {{"every", every_}};
  }

  void add_metrics(const RunContext& run, const loom::train::StepResult& /*result*/,
                   nlohmann::json& record) const override {
    record["local_sgd_synchronous"] = synchronous(run.step);
  }

  std::string describe(const RunContext& run) const override {
    return fmt::format(
        "local SGD: {} data-parallel ranks step on their own gradients; every {} steps a "
        "synchronous step averages gradients, then parameters and moments",
        run.size(loom::dist::Dim::dp), every_);
  }

 private:
  // Step s (1-based) is synchronous when every divides it.
  bool synchronous(int64_t s) const { return s % every_ == 0; }
  int64_t every_;
};

}  // namespace

LOOM_REGISTER_STRATEGY(local_sgd, LocalSgd, "local-sgd");
