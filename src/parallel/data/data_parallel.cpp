#include "loom/parallel/data/data_parallel.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <chrono>

#include "loom/core/error.h"

#include <spdlog/spdlog.h>

namespace loom::parallel::data {

namespace {}  // namespace

DataParallel::DataParallel(NamedParams params, dist::CommunicatorPtr comm,
                           DataParallelOptions options)
    : comm_(std::move(comm)),
      hook_(options.hook ? options.hook : std::make_shared<AllReduceAvgHook>()) {
  LOOM_CHECK(comm_ != nullptr, "DataParallel needs a communicator");
  LOOM_CHECK(options.bucket_mb > 0, "--bucket-mb {} is invalid; it must be positive",
             options.bucket_mb);
  std::vector<at::Tensor> tensors;
  std::vector<std::string> names;
  for (auto& [name, p] : params) {
    if (!p.requires_grad()) continue;
    LOOM_CHECK(p.is_leaf(), "DataParallel: parameter '{}' is not a leaf tensor", name);
    tensors.push_back(p);
    names.push_back(name);
  }
  const auto bucket_bytes = static_cast<int64_t>(options.bucket_mb * 1024.0 * 1024.0);
  const auto plan = assign_buckets(tensors, std::max<int64_t>(bucket_bytes, 1));
  buckets_.resize(plan.size());
  for (size_t b = 0; b < plan.size(); ++b) {
    auto& bucket = buckets_[b];
    bucket.index = static_cast<int64_t>(b);
    int64_t numel = 0;
    for (size_t k : plan[b]) {
      bucket.params.push_back(tensors[k]);
      bucket.names.push_back(names[k]);
      bucket.offsets.push_back(numel);
      numel += tensors[k].numel();
    }
    bucket.buffer = at::zeros({numel}, tensors[plan[b].front()].options().requires_grad(false));
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      adopt_grad(bucket, slot);
      hooks_.add(bucket.params[slot], bucket.names[slot],
                 [this, b, slot] { on_grad_ready(b, slot); });
    }
  }
  reset_backward_state();
}

DataParallel::~DataParallel() {
  // Reductions still in flight keep their buffers alive (the communicator holds the tensors),
  // so there is nothing to wait for here; waiting could hang a rank that is unwinding an error
  // while its peers never issue the matching collective. The hooks go with hooks_.
}

void DataParallel::reset_backward_state() {
  for (auto& b : buckets_) {
    b.pending = static_cast<int64_t>(b.params.size());
    b.work = nullptr;
  }
  next_to_launch_ = 0;
  in_backward_ = false;
}

void DataParallel::broadcast_parameters() {
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    auto flat = at::empty_like(b.buffer);
    for (size_t i = 0; i < b.params.size(); ++i)
      flat.narrow(0, b.offsets[i], b.params[i].numel()).copy_(b.params[i].reshape({-1}));
    comm_->broadcast(flat, 0);
    for (size_t i = 0; i < b.params.size(); ++i)
      b.params[i].copy_(flat.narrow(0, b.offsets[i], b.params[i].numel()).view_as(b.params[i]));
  }
}

void DataParallel::adopt_grad(GradBucket& b, size_t slot) {
  auto& p = b.params[slot];
  auto view = b.grad_view(slot);
  const auto& grad = p.grad();
  if (grad.defined() && grad.data_ptr() == view.data_ptr()) return;  // already the view
  // A gradient autograd allocated (first step, or after .grad was reset): move it into the
  // bucket and make the view the parameter's gradient, so later backwards accumulate in place.
  if (grad.defined())
    view.copy_(grad);
  else
    view.zero_();  // no gradient in this backward: zeros on this rank
  p.mutable_grad() = view;
}

void DataParallel::zero_grad() {
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b.buffer.zero_();
    for (size_t i = 0; i < b.params.size(); ++i) adopt_grad(b, i);
  }
}

void DataParallel::on_grad_ready(size_t bucket, size_t slot) {
  if (!sync_) return;
  if (!in_backward_) {
    in_backward_ = true;
    stats_ = SyncStats{};
  }
  auto& b = buckets_[bucket];
  adopt_grad(b, slot);
  LOOM_CHECK(b.pending > 0,
             "DataParallel: gradient of '{}' became ready twice in one backward; call "
             "finish_gradient_sync() after each synchronizing backward",
             b.names[slot]);
  --b.pending;
  launch_ready_buckets();
}

void DataParallel::launch_ready_buckets() {
  torch::NoGradGuard no_grad;
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_].pending == 0) {
    auto& b = buckets_[next_to_launch_];
    if (next_to_launch_ == 0) first_launch_ = std::chrono::steady_clock::now();
    const double sent_before = comm_->bytes_sent();
    b.work = hook_->start(b, *comm_);
    stats_.bytes_sent += comm_->bytes_sent() - sent_before;
    stats_.fp32_bytes += dist::wire_bytes(
        dist::OpKind::AllReduce, 4.0 * static_cast<double>(b.numel()), comm_->size(), false);
    ++stats_.buckets_launched_in_backward;
    ++next_to_launch_;
  }
}

void DataParallel::finish_gradient_sync() {
  if (!sync_) return;
  torch::NoGradGuard no_grad;
  if (!in_backward_) stats_ = SyncStats{};
  const auto launched_in_backward = stats_.buckets_launched_in_backward;
  if (launched_in_backward > 0)
    stats_.overlap_window_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - first_launch_).count();
  // Parameters that got no gradient in this backward: they count as zeros on this rank.
  for (size_t k = next_to_launch_; k < buckets_.size(); ++k) {
    auto& b = buckets_[k];
    if (b.pending == 0) continue;
    if (!warned_late_launch_) {
      warned_late_launch_ = true;
      spdlog::warn(
          "DataParallel: bucket {} (holding '{}', ...) was incomplete when backward ended: some "
          "parameter got no gradient. Such gradients count as zeros (so the optimizer still "
          "updates those parameters, unlike without data parallelism), and buckets from {} on "
          "start only after backward, without overlap",
          k, b.names.front(), k);
    }
    for (size_t i = 0; i < b.params.size(); ++i) adopt_grad(b, i);
    b.pending = 0;
  }
  launch_ready_buckets();
  stats_.buckets_launched_in_backward = launched_in_backward;
  for (auto& b : buckets_) {
    const auto start = std::chrono::steady_clock::now();
    b.work->wait();
    stats_.wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double sent_before = comm_->bytes_sent();
    hook_->finish(b, *comm_);  // the gradients are views of the buffer: nothing to copy back
    stats_.bytes_sent += comm_->bytes_sent() - sent_before;
  }
  reset_backward_state();
}

}  // namespace loom::parallel::data
