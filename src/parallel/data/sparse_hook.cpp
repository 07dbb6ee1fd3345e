#include "loom/parallel/data/sparse_hook.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <cmath>
#include <limits>

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
  // A non-finite value must reach every rank (and so the trainer's check on all of them alike):
  // a step holding one sends only non-finite values, which pass any threshold, even +inf. Such
  // a step (the trainer skips it) keeps the previous threshold rather than refresh it: the k-th
  // largest magnitude would be NaN, and a NaN threshold passes nothing until the next refresh.
  const bool finite = at::isfinite(at::add(x, s.error)).all().item<bool>();
  if (n > 0 && finite && s.steps % refresh_every_ == 0)
    s.threshold = ops::kth_largest_magnitude(x, s.error, s.capacity);
  ++s.steps;
  const double threshold = finite ? s.threshold : std::numeric_limits<double>::infinity();
  const auto picked = ops::select_with_feedback(x, s.error, threshold, s.capacity);
  s.selected = picked.selected;
  // One message: the indices, then the values' bits.
  s.send = at::cat({picked.indices, picked.values.view(at::kInt)});
  s.recv = at::empty({comm.size(), s.send.numel()}, s.send.options());
  return comm.all_gather_async(s.recv, s.send);
}

void SparseCompressHook::finish(GradBucket& bucket, dist::Communicator& comm) {
  auto& s = state_.at(bucket.index);
  auto sum = at::zeros({bucket.numel()}, s.error.options());
  for (int64_t r = 0; r < comm.size(); ++r) {
    const auto message = s.recv[r];
    ops::scatter_add_sparse_(sum, message.narrow(0, 0, s.capacity),
                             message.narrow(0, s.capacity, s.capacity).view(at::kFloat));
  }
  bucket.buffer.copy_(sum.div_(static_cast<double>(comm.size())));
  s.send = s.recv = at::Tensor();
}

std::map<std::string, at::Tensor> SparseCompressHook::state() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [index, s] : state_) {
    out[bucket_state_key(index, "error")] = s.error;
    out[bucket_state_key(index, "steps")] = at::scalar_tensor(s.steps, at::kLong);
    out[bucket_state_key(index, "threshold")] = at::scalar_tensor(s.threshold, at::kDouble);
  }
  return out;
}

void SparseCompressHook::load_state(const std::map<std::string, at::Tensor>& state) {
  state_.clear();
  for (const auto& [key, error] : state) {
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

double SparseCompressHook::threshold_of(int64_t index) const {
  return state_of(index).threshold;
}

int64_t SparseCompressHook::last_selected(int64_t index) const {
  return state_of(index).selected;
}

}  // namespace loom::parallel::data
