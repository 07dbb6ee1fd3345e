#include "loom/parallel/data/comm_hook.h"

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
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

MomentumCompressionHook::MomentumCompressionHook(std::shared_ptr<CommHook> inner, double beta)
    : inner_(std::move(inner)), beta_(beta) {
  LOOM_CHECK(inner_ != nullptr, "MomentumCompressionHook: no hook to send the momentum through");
  LOOM_CHECK(beta >= 0 && beta < 1,
             "--comm-hook {}: momentum={} is outside [0, 1); it is AdamW's beta1 (0.9 by default), "
             "the momentum's decay",
             inner_->name(), beta);
}

dist::WorkPtr MomentumCompressionHook::start(GradBucket& bucket, dist::Communicator& comm) {
  auto& m = momentum_[bucket.index];
  if (!m.defined()) m = at::zeros({bucket.numel()}, bucket.buffer.options().dtype(at::kFloat));
  // Every rank restored the same sizes from one checkpoint layout, so all stop alike.
  LOOM_CHECK(m.numel() == bucket.numel(),
             "--comm-hook {}: bucket {} carries a momentum of {} values for {} gradients (state "
             "from another model or bucket size?)",
             name(), bucket.index, m.numel(), bucket.numel());
  if (m.device() != bucket.buffer.device()) m = m.to(bucket.buffer.device());  // a checkpoint's
  // m must be the same on every rank, but a rank whose checkpoint file did not load starts from
  // zero while the others restore theirs (CommHookState warns and goes on): the first reduction
  // of each bucket after construction or a restore takes rank 0's. Blocking, once per bucket.
  if (agreed_.insert(bucket.index).second) comm.broadcast(m, 0);
  // This rank's momentum, beta m + (1 - beta) g, in the gradient's place.
  bucket.buffer.mul_(1 - beta_).add_(m, beta_);
  return inner_->start(bucket, comm);
}

void MomentumCompressionHook::finish(GradBucket& bucket, dist::Communicator& comm) {
  inner_->finish(bucket, comm);
  auto& m = momentum_.at(bucket.index);
  // The same result on every rank, so every rank takes the same branch.
  if (!at::isfinite(bucket.buffer).all().item<bool>()) return;
  // A copy: the buffer is overwritten below (to(kFloat) of an fp32 buffer would be the buffer).
  const auto averaged = bucket.buffer.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  // The gradient whose momentum update beta m + (1 - beta) g is the averaged momentum.
  bucket.buffer.copy_((averaged - beta_ * m) / (1 - beta_));
  m.copy_(averaged);
}

std::map<std::string, at::Tensor> MomentumCompressionHook::state() const {
  auto out = inner_->state();
  for (const auto& [index, m] : momentum_) out[bucket_state_key(index, "momentum")] = m;
  return out;
}

void MomentumCompressionHook::load_momentum(const std::map<std::string, at::Tensor>& state) {
  momentum_.clear();
  agreed_.clear();
  for (const auto& [key, m] : state) {
    const auto bucket = bucket_of_key(key, "momentum");
    if (!bucket) continue;
    LOOM_CHECK(m.dim() == 1, "--comm-hook {} state: bucket {}'s momentum has {} dims, not 1",
               name(), *bucket, m.dim());
    momentum_[*bucket] = m.to(at::kFloat).contiguous().clone();
  }
}

void MomentumCompressionHook::load_state(const std::map<std::string, at::Tensor>& state) {
  load_momentum(state);
  inner_->load_state(state);
}

StateReshard MomentumCompressionHook::reshard_rule(const std::string& key) const {
  return bucket_of_key(key, "momentum") ? StateReshard::kFirst : inner_->reshard_rule(key);
}

void MomentumCompressionHook::load_resharded_state(const std::map<std::string, at::Tensor>& state) {
  load_momentum(state);
  inner_->load_resharded_state(state);
}

void MomentumCompressionHook::lay_out_resharded(int64_t index, int64_t numel, int64_t rank,
                                                int64_t ranks) {
  if (const auto it = momentum_.find(index); it != momentum_.end() && it->second.numel() != numel) {
    auto fitted = at::zeros({numel}, it->second.options());
    const int64_t kept = std::min(numel, it->second.numel());
    fitted.narrow(0, 0, kept).copy_(it->second.narrow(0, 0, kept));
    it->second = fitted;
  }
  inner_->lay_out_resharded(index, numel, rank, ranks);
}

at::Tensor MomentumCompressionHook::momentum(int64_t index) const {
  const auto it = momentum_.find(index);
  return it == momentum_.end() ? at::Tensor() : it->second;
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

std::shared_ptr<CommHook> make_comm_hook(const std::string& text) {
  auto spec = core::OptionSpec::parse(text, "--comm-hook");
  const auto factory = registry().find(spec.name);
  LOOM_CHECK(factory, "--comm-hook '{}': '{}' is not a known communication hook; valid: {}", text,
             spec.name, fmt::join(comm_hook_names(), ", "));
  // "warmup" and "momentum" are every hook's keys: read here, hidden from the factory's check.
  const bool warms_up = spec.options.contains("warmup");
  const int64_t warmup = spec.get_int("warmup", 0);
  const bool compresses_momentum = spec.options.contains("momentum");
  const double momentum = spec.get_double("momentum", 0);
  spec.options.erase("warmup");
  spec.options.erase("momentum");
  auto hook = factory(spec);
  LOOM_CHECK(hook != nullptr, "the factory of communication hook '{}' returned nothing", spec.name);
  if (warms_up) hook = std::make_shared<DenseWarmupHook>(std::move(hook), warmup);
  if (compresses_momentum)
    hook = std::make_shared<MomentumCompressionHook>(std::move(hook), momentum);
  return hook;
}

}  // namespace loom::parallel::data
