#include "loom/parallel/data/comm_hook.h"

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string_view>

#include "loom/core/error.h"
#include "loom/core/registry.h"
#include "loom/parallel/data/powersgd_hook.h"
#include "loom/parallel/data/quantized_hook.h"
#include "loom/parallel/data/sparse_hook.h"

namespace loom::parallel::data {

std::string bucket_state_key(int64_t index, const std::string& what) {
  return fmt::format("b{}/{}", index, what);
}

std::optional<int64_t> bucket_of_key(const std::string& key, std::string_view what) {
  const size_t suffix = what.size() + 1;  // "/" + what
  if (key.size() <= 1 + suffix || key[0] != 'b' || !key.ends_with(what) ||
      key[key.size() - suffix] != '/')
    return std::nullopt;
  const auto digits = std::string_view(key).substr(1, key.size() - 1 - suffix);
  int64_t index = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  if (ec != std::errc() || end != digits.data() + digits.size() || index < 0) return std::nullopt;
  return index;
}

at::Tensor leading_values(const at::Tensor& entry, int64_t numel, const std::string& hook,
                          int64_t index, std::string_view what) {
  LOOM_CHECK(entry.dim() == 1 && entry.numel() >= numel,
             "--comm-hook {} state: bucket {}'s {} has shape {}; its parameters have {} values",
             hook, index, what, entry.sizes(), numel);
  return entry.narrow(0, 0, numel).to(at::kFloat).contiguous().clone();
}

std::map<int64_t, at::Tensor> owed_by_bucket(const std::map<std::string, at::Tensor>& values) {
  std::map<int64_t, at::Tensor> out;
  for (const auto& [key, owed] : values)
    if (const auto index = bucket_of_key(key, "owed"))
      out[*index] = owed.to(at::kFloat).contiguous().clone();
  return out;
}

void CommHook::load_group_values(const std::map<std::string, at::Tensor>& values,
                                 bool /*reduce_scatter*/) {
  for (const auto& [key, t] : values)
    LOOM_CHECK(key.find('/') == std::string::npos,
               "--comm-hook {} cannot take state carried from another layout ('{}'): it does not "
               "override CommHook::load_group_values",
               name(), key);
}

StateReshard CommHook::reshard_rule(const std::string& key) const {
  return bucket_of_key(key, "error") ? StateReshard::kMean : StateReshard::kFirst;
}

void StateResharder::add(const std::map<std::string, at::Tensor>& rank_state) {
  if (ranks_ > 0) {
    std::vector<std::string> mine, theirs;
    for (const auto& [key, t] : rank_state) mine.push_back(key);
    for (const auto& [key, t] : first_) theirs.push_back(key);
    for (const auto& [key, t] : pieces_) theirs.push_back(key);
    std::sort(theirs.begin(), theirs.end());
    LOOM_CHECK(mine == theirs,
               "--comm-hook {}: old rank {}'s state holds [{}], rank 0's [{}]: they cannot be "
               "resharded together",
               hook_.name(), ranks_, fmt::join(mine, ", "), fmt::join(theirs, ", "));
  }
  for (const auto& [key, t] : rank_state) {
    switch (hook_.reshard_rule(key)) {
      case StateReshard::kMean:
        if (ranks_ == 0) {
          first_[key] = t.to(at::kDouble).cpu().clone();
          mean_dtypes_[key] = t.scalar_type();
        } else {
          auto& sum = first_.at(key);
          LOOM_CHECK(sum.sizes() == t.sizes(),
                     "--comm-hook {}: '{}' has shape {} on old rank {} and {} on rank 0",
                     hook_.name(), key, fmt::join(t.sizes(), "x"), ranks_,
                     fmt::join(sum.sizes(), "x"));
          sum.add_(t.to(at::kDouble).cpu());
        }
        break;
      case StateReshard::kFirst:
        if (ranks_ == 0) first_[key] = t.cpu().clone();
        break;
      case StateReshard::kConcat:
        pieces_[key].push_back(t.cpu().clone());
        break;
    }
  }
  ++ranks_;
}

std::map<std::string, at::Tensor> StateResharder::result() const {
  LOOM_CHECK(ranks_ > 0, "--comm-hook {}: no old rank's state to reshard", hook_.name());
  std::map<std::string, at::Tensor> out;
  for (const auto& [key, t] : first_)
    out[key] = hook_.reshard_rule(key) == StateReshard::kMean
                   ? (t / static_cast<double>(ranks_)).to(mean_dtypes_.at(key))
                   : t;
  for (const auto& [key, pieces] : pieces_) out[key] = at::cat(pieces);
  return out;
}

dist::WorkPtr CommHook::start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                             dist::Communicator& comm) {
  LOOM_CHECK(bucket.numel() == comm.size() * recv.numel(),
             "--comm-hook {}: a reduce-scatter of {} values into shards of {} over {} ranks",
             name(), bucket.numel(), recv.numel(), comm.size());
  return start(bucket, comm);
}

void CommHook::finish_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                     dist::Communicator& comm) {
  finish(bucket, comm);
  recv.copy_(bucket.buffer.narrow(0, comm.rank() * recv.numel(), recv.numel()));
}

dist::WorkPtr AllReduceAvgHook::start(GradBucket& bucket, dist::Communicator& comm) {
  return comm.all_reduce_async(bucket.buffer, dist::ReduceOp::Avg);
}

dist::WorkPtr AllReduceAvgHook::start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                                     dist::Communicator& comm) {
  return comm.reduce_scatter_async(recv, bucket.buffer, dist::ReduceOp::Avg);
}

dist::WorkPtr Bf16CompressHook::start(GradBucket& bucket, dist::Communicator& comm) {
  // Scaling before rounding keeps the bf16 sum in range whatever the number of ranks.
  bucket.scratch = (bucket.buffer / static_cast<double>(comm.size())).to(at::kBFloat16);
  return comm.all_reduce_async(bucket.scratch, dist::ReduceOp::Sum);
}

void Bf16CompressHook::finish(GradBucket& bucket, dist::Communicator&) {
  bucket.buffer.copy_(bucket.scratch);
  bucket.scratch = at::Tensor();
}

// ---- warm-up -----------------------------------------------------------------------------

DenseWarmupHook::DenseWarmupHook(std::shared_ptr<CommHook> inner, int64_t warmup)
    : inner_(std::move(inner)), warmup_(warmup) {
  LOOM_CHECK(inner_ != nullptr, "DenseWarmupHook: no hook to hand over to");
  LOOM_CHECK(warmup >= 0,
             "--comm-hook {}: warmup={} must be >= 0 (the optimizer steps reduced by the "
             "plain average before the hook starts)",
             inner_->name(), warmup);
}

void DenseWarmupHook::begin_step(int64_t steps_completed) {
  steps_completed_ = steps_completed;
  inner_->begin_step(steps_completed);
}

dist::WorkPtr DenseWarmupHook::start(GradBucket& bucket, dist::Communicator& comm) {
  dense_in_flight_[bucket.index] = dense();
  return dense() ? dense_.start(bucket, comm) : inner_->start(bucket, comm);
}

void DenseWarmupHook::finish(GradBucket& bucket, dist::Communicator& comm) {
  if (dense_in_flight_.at(bucket.index)) {
    dense_.finish(bucket, comm);
  } else {
    inner_->finish(bucket, comm);
  }
}

dist::WorkPtr DenseWarmupHook::start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                                    dist::Communicator& comm) {
  dense_in_flight_[bucket.index] = dense();
  return dense() ? dense_.start_reduce_scatter(bucket, recv, comm)
                 : inner_->start_reduce_scatter(bucket, recv, comm);
}

void DenseWarmupHook::finish_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                            dist::Communicator& comm) {
  if (dense_in_flight_.at(bucket.index)) {
    dense_.finish_reduce_scatter(bucket, recv, comm);
  } else {
    inner_->finish_reduce_scatter(bucket, recv, comm);
  }
}

std::map<std::string, at::Tensor> DenseWarmupHook::state() const {
  return inner_->state();
}

void DenseWarmupHook::load_state(const std::map<std::string, at::Tensor>& state) {
  inner_->load_state(state);
}

// ---- momentum compression ----------------------------------------------------------------

MomentumCompressionHook::MomentumCompressionHook(std::shared_ptr<CommHook> inner, double beta,
                                                 MomentumPreconditioning preconditioning)
    : inner_(std::move(inner)), beta_(beta), preconditioning_(preconditioning) {
  LOOM_CHECK(inner_ != nullptr, "MomentumCompressionHook: no hook to send the momentum through");
  LOOM_CHECK(beta >= 0 && beta < 1,
             "--comm-hook {}: momentum={} is outside [0, 1); it is AdamW's beta1 (0.9 by default), "
             "the momentum's decay",
             inner_->name(), beta);
  LOOM_CHECK(preconditioning.beta2 >= 0 && preconditioning.beta2 < 1 && preconditioning.eps > 0 &&
                 preconditioning.limit > 0,
             "--comm-hook {}: preconditioning with beta2 = {}, eps = {} and limit = {}: beta2 "
             "must be in [0, 1), eps > 0 (the optimizer's) and limit > 0",
             inner_->name(), preconditioning.beta2, preconditioning.eps, preconditioning.limit);
}

const at::Tensor& MomentumCompressionHook::divisor(Bucket& b) {
  if (b.divisor_steps != b.variance_steps) {
    // AdamW's denominator with the variance frozen after W steps: sqrt(v / (1 - beta2^W)) + eps.
    const double correction =
        1 - std::pow(preconditioning_.beta2, static_cast<double>(b.variance_steps));
    b.divisor = (b.variance / correction).sqrt_().add_(preconditioning_.eps);
    b.divisor_steps = b.variance_steps;
  }
  return b.divisor;
}

dist::WorkPtr MomentumCompressionHook::start(GradBucket& bucket, dist::Communicator& comm) {
  auto& b = buckets_[bucket.index];
  const auto options = bucket.buffer.options().dtype(at::kFloat);
  if (!b.momentum.defined()) b.momentum = at::zeros({bucket.numel()}, options);
  // Every rank restored the same sizes from one checkpoint layout, so all stop alike.
  for (const auto* t : {&b.momentum, &b.variance})
    LOOM_CHECK(!t->defined() || t->numel() == bucket.numel(),
               "--comm-hook {}: bucket {} carries a {} of {} values for {} gradients (state from "
               "another model or bucket size?)",
               name(), bucket.index, t == &b.momentum ? "momentum" : "variance", t->numel(),
               bucket.numel());
  // A checkpoint's state comes to the CPU.
  if (b.momentum.device() != bucket.buffer.device()) b.momentum = b.momentum.to(options.device());
  if (b.variance.defined() && b.variance.device() != bucket.buffer.device()) {
    b.variance = b.variance.to(options.device());
    b.divisor_steps = -1;
  }
  // m and v must be the same on every rank, but a rank whose checkpoint file did not load starts
  // from zero while the others restore theirs (CommHookState warns and goes on): the first
  // reduction of each bucket after construction or a restore takes rank 0's. Blocking, once per
  // bucket. The variance exists once an exact step was seen: rank 0's count says whether.
  if (!b.agreed) {
    comm.broadcast(b.momentum, 0);
    if (preconditioning_.enabled) {
      auto steps = at::full({1}, b.variance_steps, options.dtype(at::kLong));
      comm.broadcast(steps, 0);
      b.variance_steps = steps.item<int64_t>();
      if (b.variance_steps > 0) {
        if (!b.variance.defined()) b.variance = at::zeros({bucket.numel()}, options);
        comm.broadcast(b.variance, 0);
      } else {
        b.variance = at::Tensor();
      }
      b.divisor_steps = -1;
    }
    b.agreed = true;
  }
  // This rank's momentum, beta m + (1 - beta) g, in the gradient's place; once compression starts
  // after exact steps, divided by AdamW's denominator and clamped (the class comment).
  bucket.buffer.mul_(1 - beta_).add_(b.momentum, beta_);
  b.exact_in_flight = inner_->reduces_exactly_this_step();
  b.scaled_in_flight = !b.exact_in_flight && b.variance_steps > 0;
  if (b.scaled_in_flight) {
    // A rank's own momentum is noisier than the mean whose variance d holds, by up to sqrt(R).
    const double limit = preconditioning_.limit * std::sqrt(static_cast<double>(comm.size()));
    bucket.buffer.div_(divisor(b)).clamp_(-limit, limit);
  } else if (!b.exact_in_flight && preconditioning_.enabled && !warned_unpreconditioned_) {
    warned_unpreconditioned_ = true;
    spdlog::warn(
        "--comm-hook {}: compressing momenta without preconditioning: no exact step gave a "
        "variance (no warmup=, or resumed from a checkpoint written without one); values whose "
        "variance is about 0 may take outsized steps (docs/compression.md)",
        name());
  }
  return inner_->start(bucket, comm);
}

void MomentumCompressionHook::finish(GradBucket& bucket, dist::Communicator& comm) {
  inner_->finish(bucket, comm);
  auto& b = buckets_.at(bucket.index);
  // The same result on every rank, so every rank takes the same branch.
  if (!at::isfinite(bucket.buffer).all().item<bool>()) return;
  // A copy: the buffer is overwritten below (to(kFloat) of an fp32 buffer would be the buffer).
  auto averaged = bucket.buffer.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  if (b.scaled_in_flight) averaged.mul_(divisor(b));
  // The gradient whose momentum update beta m + (1 - beta) g is the averaged momentum.
  bucket.buffer.copy_((averaged - beta_ * b.momentum) / (1 - beta_));
  b.momentum.copy_(averaged);
  if (b.exact_in_flight && preconditioning_.enabled) {
    // AdamW's variance update on the mean gradient, as the optimizer applies it.
    if (!b.variance.defined()) b.variance = at::zeros({bucket.numel()}, averaged.options());
    const auto g = bucket.buffer.to(at::kFloat);
    b.variance.mul_(preconditioning_.beta2).addcmul_(g, g, 1 - preconditioning_.beta2);
    ++b.variance_steps;
  }
}

std::map<std::string, at::Tensor> MomentumCompressionHook::state() const {
  auto out = inner_->state();
  for (const auto& [index, b] : buckets_) {
    if (!b.momentum.defined()) continue;
    out[bucket_state_key(index, "momentum")] = b.momentum;
    if (b.variance.defined()) {
      out[bucket_state_key(index, "variance")] = b.variance;
      out[bucket_state_key(index, "variance_steps")] = at::full({1}, b.variance_steps, at::kLong);
    }
  }
  return out;
}

void MomentumCompressionHook::load_buckets(const std::map<std::string, at::Tensor>& state) {
  buckets_.clear();
  for (const auto& [key, t] : state) {
    for (const char* what : {"momentum", "variance", "variance_steps"}) {
      const auto index = bucket_of_key(key, what);
      if (!index) continue;
      auto& b = buckets_[*index];
      if (std::string_view(what) == "variance_steps") {
        LOOM_CHECK(t.numel() == 1 && t.item<int64_t>() >= 0,
                   "--comm-hook {} state: bucket {}'s variance_steps must be one count >= 0",
                   name(), *index);
        b.variance_steps = t.item<int64_t>();
      } else {
        LOOM_CHECK(t.dim() == 1, "--comm-hook {} state: bucket {}'s {} has {} dims, not 1", name(),
                   *index, what, t.dim());
        (std::string_view(what) == "momentum" ? b.momentum : b.variance) =
            t.to(at::kFloat).contiguous().clone();
      }
    }
  }
  // Preconditioning off, a variance restored is dropped (the run compresses m itself); on, one
  // missing starts from zero steps (a checkpoint written without it).
  for (auto& [index, b] : buckets_) {
    if (!preconditioning_.enabled || !b.variance.defined()) {
      b.variance = at::Tensor();
      b.variance_steps = 0;
    }
  }
}

void MomentumCompressionHook::load_state(const std::map<std::string, at::Tensor>& state) {
  load_buckets(state);
  inner_->load_state(state);
}

StateReshard MomentumCompressionHook::reshard_rule(const std::string& key) const {
  for (const char* what : {"momentum", "variance", "variance_steps"})
    if (bucket_of_key(key, what)) return StateReshard::kFirst;
  return inner_->reshard_rule(key);
}

void MomentumCompressionHook::load_resharded_state(const std::map<std::string, at::Tensor>& state) {
  load_buckets(state);
  inner_->load_resharded_state(state);
}

void MomentumCompressionHook::lay_out_resharded(int64_t index, int64_t numel, int64_t rank,
                                                int64_t ranks) {
  if (const auto it = buckets_.find(index); it != buckets_.end()) {
    for (auto* t : {&it->second.momentum, &it->second.variance}) {
      if (!t->defined() || t->numel() == numel) continue;
      auto fitted = at::zeros({numel}, t->options());
      const int64_t kept = std::min(numel, t->numel());
      fitted.narrow(0, 0, kept).copy_(t->narrow(0, 0, kept));
      *t = fitted;
    }
    it->second.divisor_steps = -1;
  }
  inner_->lay_out_resharded(index, numel, rank, ranks);
}

std::map<std::string, at::Tensor> MomentumCompressionHook::group_values(
    const std::map<std::string, at::Tensor>& group,
    const std::map<int64_t, BucketShape>& buckets) const {
  auto out = inner_->group_values(group, buckets);
  int64_t variance_steps = -1;
  for (const auto& [index, shape] : buckets) {
    for (const char* what : {"momentum", "variance"}) {
      const auto it = group.find(bucket_state_key(index, what));
      if (it == group.end()) continue;
      out[bucket_state_key(index, what)] =
          leading_values(it->second, shape.numel, name(), index, what);
    }
    if (const auto it = group.find(bucket_state_key(index, "variance_steps")); it != group.end())
      variance_steps = std::max(variance_steps, it->second.item<int64_t>());
  }
  if (variance_steps >= 0) out["variance_steps"] = at::full({1}, variance_steps, at::kLong);
  return out;
}

CommHook::ValueRule MomentumCompressionHook::value_rule(const std::string& what) const {
  if (what == "momentum") return ValueRule::kSum;
  if (what == "variance") return ValueRule::kRms;
  return inner_->value_rule(what);
}

void MomentumCompressionHook::load_group_values(const std::map<std::string, at::Tensor>& values,
                                                bool /*reduce_scatter*/) {
  buckets_.clear();
  const auto steps = values.find("variance_steps");
  std::map<std::string, at::Tensor> inner;
  for (const auto& [key, t] : values) {
    const auto momentum = bucket_of_key(key, "momentum");
    const auto variance = bucket_of_key(key, "variance");
    if (momentum) {
      buckets_[*momentum].momentum = t.to(at::kFloat).contiguous().clone();
    } else if (variance && preconditioning_.enabled && steps != values.end()) {
      auto& b = buckets_[*variance];
      b.variance = t.to(at::kFloat).contiguous().clone();
      b.variance_steps = steps->second.item<int64_t>();
    } else if (!variance && key != "variance_steps") {
      inner.emplace(key, t);
    }
  }
  // The named hook reduces whole buckets under ZeRO too (reduces_once_per_step).
  inner_->load_group_values(inner, /*reduce_scatter=*/false);
}

bool MomentumCompressionHook::exempt_from_clipping_this_step() const {
  if (!preconditioning_.enabled || !preconditioning_.unclipped ||
      inner_->reduces_exactly_this_step())
    return false;
  return std::any_of(buckets_.begin(), buckets_.end(),
                     [](const auto& item) { return item.second.variance_steps > 0; });
}

at::Tensor MomentumCompressionHook::momentum(int64_t index) const {
  const auto it = buckets_.find(index);
  return it == buckets_.end() ? at::Tensor() : it->second.momentum;
}

at::Tensor MomentumCompressionHook::variance(int64_t index) const {
  const auto it = buckets_.find(index);
  return it == buckets_.end() ? at::Tensor() : it->second.variance;
}

int64_t MomentumCompressionHook::variance_steps(int64_t index) const {
  const auto it = buckets_.find(index);
  return it == buckets_.end() ? 0 : it->second.variance_steps;
}

namespace {

using Registry = core::NamedRegistry<CommHookFactory>;

Registry& registry() {
  static Registry r("communication hook");
  static const bool built_in = [] {
    r.add("avg",
          [](const core::OptionSpec& spec) { return detail::make_hook<AllReduceAvgHook>(spec); });
    r.add("bf16",
          [](const core::OptionSpec& spec) { return detail::make_hook<Bf16CompressHook>(spec); });
    r.add("int8",
          [](const core::OptionSpec& spec) { return detail::make_hook<Int8CompressHook>(spec); });
    r.add("onebit",
          [](const core::OptionSpec& spec) { return detail::make_hook<OneBitCompressHook>(spec); });
    r.add("powersgd",
          [](const core::OptionSpec& spec) { return detail::make_hook<PowerSgdHook>(spec); });
    r.add("topk", [](const core::OptionSpec& spec) { return SparseCompressHook::topk(spec); });
    r.add("threshold",
          [](const core::OptionSpec& spec) { return SparseCompressHook::threshold(spec); });
    return true;
  }();
  (void)built_in;
  return r;
}

}  // namespace

void register_comm_hook(const std::string& name, CommHookFactory factory) {
  registry().add(name, std::move(factory));
}

std::vector<std::string> comm_hook_names() {
  return registry().names();
}

std::shared_ptr<CommHook> make_comm_hook(const std::string& text,
                                         const ops::AdamWOptions& optimizer) {
  auto spec = core::OptionSpec::parse(text, "--comm-hook");
  const auto factory = registry().find(spec.name);
  LOOM_CHECK(factory, "--comm-hook '{}': '{}' is not a known communication hook; valid: {}", text,
             spec.name, fmt::join(comm_hook_names(), ", "));
  // "warmup" and "momentum" are every hook's keys: read here, hidden from the factory's check.
  const bool warms_up = spec.options.contains("warmup");
  const int64_t warmup = spec.get_int("warmup", 0);
  const bool compresses_momentum = spec.options.contains("momentum");
  const double momentum = spec.get_double("momentum", 0);
  const bool names_precondition = spec.options.contains("precondition");
  const int64_t precondition = spec.get_int("precondition", 1);
  LOOM_CHECK(precondition == 0 || precondition == 1,
             "--comm-hook '{}': precondition={} must be 0 or 1", text, precondition);
  LOOM_CHECK(!names_precondition || compresses_momentum,
             "--comm-hook '{}': precondition= applies to a momentum compression only; add "
             "momentum=B (B = --beta1)",
             text);
  const bool names_unclipped = spec.options.contains("unclipped");
  const int64_t unclipped = spec.get_int("unclipped", 0);
  LOOM_CHECK(unclipped == 0 || unclipped == 1, "--comm-hook '{}': unclipped={} must be 0 or 1",
             text, unclipped);
  LOOM_CHECK(!names_unclipped || compresses_momentum,
             "--comm-hook '{}': unclipped= applies to a momentum compression only; add momentum=B "
             "(B = --beta1)",
             text);
  LOOM_CHECK(unclipped == 0 || precondition == 1,
             "--comm-hook '{}': unclipped=1 exempts the preconditioned steps from clipping; with "
             "precondition=0 there are none",
             text);
  spec.options.erase("warmup");
  spec.options.erase("momentum");
  spec.options.erase("precondition");
  spec.options.erase("unclipped");
  auto hook = factory(spec);
  LOOM_CHECK(hook != nullptr, "the factory of communication hook '{}' returned nothing", spec.name);
  if (warms_up) hook = std::make_shared<DenseWarmupHook>(std::move(hook), warmup);
  if (compresses_momentum)
    hook = std::make_shared<MomentumCompressionHook>(
        std::move(hook), momentum,
        MomentumPreconditioning{.enabled = precondition == 1,
                                .unclipped = unclipped == 1,
                                .beta2 = optimizer.beta2,
                                .eps = optimizer.eps});
  return hook;
}

}  // namespace loom::parallel::data
