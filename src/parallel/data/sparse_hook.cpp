#include "loom/parallel/data/sparse_hook.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "loom/core/error.h"
#include "loom/ops/sparsify.h"

namespace loom::parallel::data {

SparseCompressHook::SparseCompressHook(std::string name, double ratio, int64_t refresh_every)
    : name_(std::move(name)), ratio_(ratio), refresh_every_(refresh_every) {
  LOOM_CHECK(ratio > 0 && ratio <= 1,
             "--comm-hook {}: ratio={} is outside (0, 1]; it is the fraction of each bucket's "
             "values a rank sends (0.01: the largest 1 %)",
             name_, ratio);
  LOOM_CHECK(refresh_every >= 1,
             "--comm-hook {}: every={} must be at least 1 (the threshold is recomputed every "
             "that many steps)",
             name_, refresh_every);
}

std::shared_ptr<CommHook> SparseCompressHook::topk(const core::OptionSpec& spec) {
  spec.check_keys({"ratio"});
  return std::make_shared<SparseCompressHook>("topk", spec.get_double("ratio", 0.01), 1);
}

std::shared_ptr<CommHook> SparseCompressHook::threshold(const core::OptionSpec& spec) {
  spec.check_keys({"ratio", "every"});
  return std::make_shared<SparseCompressHook>("threshold", spec.get_double("ratio", 0.01),
                                              spec.get_int("every", 10));
}

int64_t SparseCompressHook::capacity(int64_t numel) const {
  const auto k = static_cast<int64_t>(std::ceil(ratio_ * static_cast<double>(numel)));
  return std::min(numel, std::max<int64_t>(1, k));
}

namespace {

// One bucket's (or shard's) selection from x + error: refreshes `threshold` to the k-th largest
// magnitude when asked, selects by it, and returns the message: the indices, then the values'
// bits. A non-finite value must reach every rank (and so the trainer's check on all of them
// alike): on a step holding one (`finite` false) only non-finite values are sent, which pass any
// threshold, even +inf, and the threshold is not refreshed: the k-th largest magnitude would be
// NaN, and a NaN threshold passes nothing until the next refresh.
at::Tensor select_message(const at::Tensor& x, at::Tensor& error, bool finite, bool refresh,
                          double& threshold, int64_t capacity, int64_t& selected) {
  if (x.numel() > 0 && finite && refresh)
    threshold = ops::kth_largest_magnitude(x, error, capacity);
  const auto picked = ops::select_with_feedback(
      x, error, finite ? threshold : std::numeric_limits<double>::infinity(), capacity);
  selected = picked.selected;
  return at::cat({picked.indices, picked.values.view(at::kInt)});
}

// The mean of `ranks` messages of `capacity` pairs (messages: int32 [ranks, 2 capacity]) over
// `numel` values: added into zeros rank after rank, so every receiver sums in the same order.
at::Tensor mean_of_messages(const at::Tensor& messages, int64_t capacity, int64_t numel,
                            const at::TensorOptions& options) {
  auto sum = at::zeros({numel}, options);
  for (int64_t r = 0; r < messages.size(0); ++r) {
    const auto message = messages[r];
    ops::scatter_add_sparse_(sum, message.narrow(0, 0, capacity),
                             message.narrow(0, capacity, capacity).view(at::kFloat));
  }
  return sum.div_(static_cast<double>(messages.size(0)));
}

}  // namespace

dist::WorkPtr SparseCompressHook::start(GradBucket& bucket, dist::Communicator& comm) {
  const int64_t n = bucket.numel();
  auto& s = state_[bucket.index];
  if (!s.error.defined() || s.error.numel() != n) {
    s.capacity = capacity(n);
    s.error = at::zeros({n}, bucket.buffer.options().dtype(at::kFloat));
  }
  // A checkpoint restores the error on the host.
  if (s.error.device() != bucket.buffer.device()) s.error = s.error.to(bucket.buffer.device());
  const auto x = bucket.buffer.to(at::kFloat);
  const bool finite = at::isfinite(at::add(x, s.error)).all().item<bool>();
  s.send = select_message(x, s.error, finite, s.steps % refresh_every_ == 0, s.threshold,
                          s.capacity, s.selected);
  ++s.steps;
  s.recv = at::empty({comm.size(), s.send.numel()}, s.send.options());
  return comm.all_gather_async(s.recv, s.send);
}

dist::WorkPtr SparseCompressHook::start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                                       dist::Communicator& comm) {
  const int64_t ranks = comm.size(), shard = recv.numel();
  LOOM_CHECK(bucket.buffer.dim() == 1 && bucket.numel() == ranks * shard,
             "--comm-hook {}: a reduce-scatter of {} values into shards of {} over {} ranks", name_,
             bucket.numel(), shard, ranks);
  auto& s = scatter_state_[bucket.index];
  if (s.ranks != ranks || s.shard != shard || !s.error.defined())
    lay_out_scatter(s, ranks, shard, bucket.buffer.options());
  s.capacity = capacity(shard);
  if (s.error.device() != bucket.buffer.device()) s.error = s.error.to(bucket.buffer.device());
  const auto x = bucket.buffer.to(at::kFloat);
  const bool finite = at::isfinite(at::add(x, s.error)).all().item<bool>();
  const bool refresh = s.steps % refresh_every_ == 0;
  std::vector<at::Tensor> messages;
  double* thresholds = s.threshold.data_ptr<double>();
  for (int64_t r = 0; r < ranks; ++r) {
    auto error = s.error.narrow(0, r * shard, shard);
    int64_t selected = 0;
    messages.push_back(select_message(x.narrow(0, r * shard, shard), error, finite, refresh,
                                      thresholds[r], s.capacity, selected));
  }
  ++s.steps;
  s.send = at::stack(messages);
  s.recv = at::empty_like(s.send);
  return comm.all_to_all_async(s.recv, s.send);
}

void SparseCompressHook::lay_out_scatter(ScatterState& s, int64_t ranks, int64_t shard,
                                         const at::TensorOptions& options) {
  s.ranks = ranks;
  s.shard = shard;
  s.error = at::zeros({ranks * shard}, options.dtype(at::kFloat));
  s.threshold = at::full({ranks}, s.resharded_threshold, at::kDouble);
  if (!s.resharded_error.defined()) {
    s.steps = 0;
    return;
  }
  // Past the parameters the bucket is padding (its gradient is zero, nothing there is owed): a
  // longer or shorter padded bucket loses nothing. The step count goes on (the refreshes keep
  // their schedule).
  const int64_t kept = std::min(s.error.numel(), s.resharded_error.numel());
  s.error.narrow(0, 0, kept).copy_(s.resharded_error.narrow(0, 0, kept));
  s.resharded_error = at::Tensor();
  s.resharded_threshold = 0;
}

void SparseCompressHook::finish_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                               dist::Communicator& /*comm*/) {
  auto& s = scatter_state_.at(bucket.index);
  recv.copy_(mean_of_messages(s.recv, s.capacity, s.shard, s.error.options()));
  s.send = s.recv = at::Tensor();
}

void SparseCompressHook::finish(GradBucket& bucket, dist::Communicator& /*comm*/) {
  auto& s = state_.at(bucket.index);
  bucket.buffer.copy_(mean_of_messages(s.recv, s.capacity, bucket.numel(), s.error.options()));
  s.send = s.recv = at::Tensor();
}

std::map<std::string, at::Tensor> SparseCompressHook::state() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [index, s] : state_) {
    out[bucket_state_key(index, "error")] = s.error;
    out[bucket_state_key(index, "steps")] = at::scalar_tensor(s.steps, at::kLong);
    out[bucket_state_key(index, "threshold")] = at::scalar_tensor(s.threshold, at::kDouble);
  }
  for (const auto& [index, s] : scatter_state_) {
    if (!s.error.defined()) continue;  // resharded, not laid out yet
    out[bucket_state_key(index, "scatter_error")] = s.error;
    out[bucket_state_key(index, "scatter_steps")] = at::scalar_tensor(s.steps, at::kLong);
    out[bucket_state_key(index, "scatter_threshold")] = s.threshold;
  }
  return out;
}

void SparseCompressHook::load_state(const std::map<std::string, at::Tensor>& state) {
  state_.clear();
  scatter_state_.clear();
  for (const auto& [key, error] : state) {
    if (const auto scattered = bucket_of_key(key, "scatter_error")) {
      load_scatter_state(*scattered, error, state);
      continue;
    }
    const auto bucket = bucket_of_key(key, "error");
    if (!bucket) continue;
    const int64_t index = *bucket;
    const auto steps = state.find(bucket_state_key(index, "steps"));
    const auto threshold = state.find(bucket_state_key(index, "threshold"));
    LOOM_CHECK(error.dim() == 1 && steps != state.end() && steps->second.numel() == 1 &&
                   threshold != state.end() && threshold->second.numel() == 1,
               "--comm-hook {} state: bucket {} needs a 1-D error and one-value steps and "
               "threshold; got an error of {} dims, steps {}, threshold {}",
               name_, index, error.dim(), steps == state.end() ? "missing" : "present",
               threshold == state.end() ? "missing" : "present");
    auto& s = state_[index];
    s.error = error.to(at::kFloat).contiguous().clone();
    s.capacity = capacity(s.error.numel());
    s.steps = steps->second.item<int64_t>();
    s.threshold = threshold->second.item<double>();
  }
}

StateReshard SparseCompressHook::reshard_rule(const std::string& key) const {
  for (const char* what : {"threshold", "scatter_error", "scatter_threshold"})
    if (bucket_of_key(key, what)) return StateReshard::kMean;
  return CommHook::reshard_rule(key);
}

void SparseCompressHook::load_resharded_state(const std::map<std::string, at::Tensor>& state) {
  std::map<std::string, at::Tensor> plain;
  for (const auto& [key, t] : state)
    if (key.find("/scatter_") == std::string::npos) plain.emplace(key, t);
  load_state(plain);
  for (const auto& [key, error] : state) {
    const auto index = bucket_of_key(key, "scatter_error");
    if (!index) continue;
    const auto steps = state.find(bucket_state_key(*index, "scatter_steps"));
    const auto threshold = state.find(bucket_state_key(*index, "scatter_threshold"));
    LOOM_CHECK(error.dim() == 1 && steps != state.end() && steps->second.numel() == 1 &&
                   threshold != state.end() && threshold->second.numel() > 0,
               "--comm-hook {} state: bucket {}'s resharded reduce-scatter error needs its "
               "steps and thresholds beside it",
               name_, *index);
    auto& s = scatter_state_[*index];  // ranks 0: laid out by lay_out_resharded
    s.resharded_error = error.to(at::kFloat).contiguous().clone();
    s.resharded_threshold = threshold->second.to(at::kDouble).mean().item<double>();
    s.steps = steps->second.item<int64_t>();
  }
}

void SparseCompressHook::lay_out_resharded(int64_t index, int64_t numel, int64_t /*rank*/,
                                           int64_t ranks) {
  const auto it = scatter_state_.find(index);
  if (it != scatter_state_.end() && it->second.resharded_error.defined())
    lay_out_scatter(it->second, ranks, numel / ranks, at::TensorOptions(at::kCPU));
  // An error taken from another layout holds the parameters' values; ZeRO's whole-bucket
  // reduction (under a momentum compression) adds its padding.
  if (const auto plain = state_.find(index); plain != state_.end() &&
                                             plain->second.error.defined() &&
                                             plain->second.error.numel() != numel) {
    auto& s = plain->second;
    auto fitted = at::zeros({numel}, s.error.options());
    const int64_t kept = std::min(numel, s.error.numel());
    fitted.narrow(0, 0, kept).copy_(s.error.narrow(0, 0, kept));
    s.error = fitted;
    s.capacity = capacity(numel);
  }
}

std::map<std::string, at::Tensor> SparseCompressHook::group_values(
    const std::map<std::string, at::Tensor>& group,
    const std::map<int64_t, BucketShape>& buckets) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [index, shape] : buckets) {
    for (const char* what : {"error", "scatter_error"}) {
      const auto it = group.find(bucket_state_key(index, what));
      if (it != group.end())
        out[bucket_state_key(index, "owed")] =
            leading_values(it->second, shape.numel, name_, index, what);
    }
  }
  return out;
}

void SparseCompressHook::load_group_values(const std::map<std::string, at::Tensor>& values,
                                           bool reduce_scatter) {
  state_.clear();
  scatter_state_.clear();
  for (auto& [index, error] : owed_by_bucket(values)) {
    if (reduce_scatter) {
      scatter_state_[index].resharded_error = std::move(error);  // steps 0: thresholds anew
    } else {
      auto& s = state_[index];
      s.capacity = capacity(error.numel());
      s.error = std::move(error);
    }
  }
}

void SparseCompressHook::load_scatter_state(int64_t index, const at::Tensor& error,
                                            const std::map<std::string, at::Tensor>& state) {
  const auto steps = state.find(bucket_state_key(index, "scatter_steps"));
  const auto threshold = state.find(bucket_state_key(index, "scatter_threshold"));
  const int64_t ranks =
      threshold == state.end() || threshold->second.dim() != 1 ? 0 : threshold->second.numel();
  LOOM_CHECK(error.dim() == 1 && steps != state.end() && steps->second.numel() == 1 && ranks > 0 &&
                 error.numel() % ranks == 0,
             "--comm-hook {} state: bucket {}'s reduce-scatter needs a 1-D error, one-value "
             "steps and a threshold per shard whose count divides the error's length; got an "
             "error of {} dims and {} values, steps {}, {} thresholds",
             name_, index, error.dim(), error.numel(), steps == state.end() ? "missing" : "present",
             ranks);
  auto& s = scatter_state_[index];
  s.ranks = ranks;
  s.shard = error.numel() / ranks;
  s.error = error.to(at::kFloat).contiguous().clone();
  s.steps = steps->second.item<int64_t>();
  s.threshold = threshold->second.to(at::kDouble).cpu().contiguous().clone();
}

const SparseCompressHook::State& SparseCompressHook::state_of(int64_t index) const {
  const auto it = state_.find(index);
  LOOM_CHECK(it != state_.end(), "--comm-hook {}: bucket {} has not been reduced yet", name_,
             index);
  return it->second;
}

at::Tensor SparseCompressHook::error(int64_t index) const {
  const auto it = state_.find(index);
  return it == state_.end() ? at::Tensor() : it->second.error;
}

at::Tensor SparseCompressHook::scatter_error(int64_t index) const {
  const auto it = scatter_state_.find(index);
  return it == scatter_state_.end() ? at::Tensor() : it->second.error;
}

double SparseCompressHook::threshold_of(int64_t index) const {
  return state_of(index).threshold;
}

int64_t SparseCompressHook::last_selected(int64_t index) const {
  return state_of(index).selected;
}

}  // namespace loom::parallel::data
