// ZeroOptimizer's gradient reduction (zero_optimizer.h): buckets are reduce-scattered in one
// launch order on every rank, through the communication hook when there is one, and their
// results added into the gradient shards.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include "loom/core/error.h"
#include "loom/parallel/zero/zero_optimizer.h"

namespace loom::parallel::zero {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

// ---- Gradients -----------------------------------------------------------------------------

void ZeroOptimizer::on_grad_ready(size_t bucket, size_t slot) {
  // Stage 1 accumulates in its full buffer, reduce_once in the parameters' .grad.
  if ((options_.stage == 1 || options_.reduce_once) && !sync_) return;
  auto& b = buckets_[bucket];
  LOOM_CHECK(b.pending > 0,
             "ZeRO: gradient of '{}' became ready twice in one backward; call "
             "finish_gradient_sync() after each backward",
             params_[b.params[slot]].first);
  if (options_.stage == 1) {
    // The gradient accumulates in the flat buffer only while .grad is its view; one that was
    // reset (a user's zero_grad(set_to_none)) is moved back in.
    auto& p = params_[b.params[slot]].second;
    auto view = param_view(b, slot, b.full_grads);
    if (!p.grad().defined() || p.grad().data_ptr() != view.data_ptr()) {
      if (p.grad().defined())
        view.copy_(p.grad());
      else
        view.zero_();
      p.mutable_grad() = view;
    }
  }
  if (--b.pending == 0) launch_ready();
}

void ZeroOptimizer::compute_launch_order() {
  // Stage 3: units in reverse order of their first forward use (the order backward completes
  // them: a unit run several times, a block shared by layers, completes at its first use), then
  // the rest (the root, whose tied embedding completes last, and units that did not run).
  // Stages 1-2: bucket order, which assign_buckets made reverse registration order.
  std::vector<bool> placed(buckets_.size(), false);
  if (options_.stage == 3) {
    std::vector<size_t> first_uses;
    for (const size_t unit : forward_order_)
      if (!placed[unit]) {
        placed[unit] = true;
        first_uses.push_back(unit);
      }
    launch_order_.assign(first_uses.rbegin(), first_uses.rend());
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi)
    if (!placed[bi]) launch_order_.push_back(bi);
}

void ZeroOptimizer::launch_ready() {
  // Strictly in launch order, the same on every rank, whatever order gradients complete in here:
  // a bucket that is ready waits for those before it, so ranks on which some parameter got no
  // gradient (and whose buckets complete later) still issue the same reductions in the same order.
  if (launch_order_.empty()) compute_launch_order();
  while (next_launch_ < launch_order_.size() && buckets_[launch_order_[next_launch_]].pending == 0)
    launch_reduce(launch_order_[next_launch_++]);
}

void ZeroOptimizer::launch_reduce(size_t bucket) {
  torch::NoGradGuard no_grad;
  auto& b = buckets_[bucket];
  InFlight f;
  f.bucket = bucket;
  f.recv = at::empty({b.layout.shard_numel()}, b.grad_shard.options());
  if (options_.stage == 1) {
    f.send = b.full_grads;  // the .grad are views of it: nothing to copy
  } else {
    // Pack this backward's gradients and drop them: from here on only the shard stays.
    f.send = at::empty({b.layout.padded_total()}, b.grad_shard.options());
    for (size_t s = 0; s < b.params.size(); ++s) {
      auto& p = params_[b.params[s]].second;
      auto view = param_view(b, s, f.send);
      if (p.grad().defined())
        view.copy_(p.grad());
      else
        view.zero_();
      p.mutable_grad() = at::Tensor();
    }
    if (b.layout.padding() > 0) f.send.narrow(0, b.layout.total(), b.layout.padding()).zero_();
    // Stage 3: the unit's backward is over; its gathered parameters go (the root stays for the
    // step's other micro-batches).
    if (options_.stage == 3 && !is_root(bucket) && options_.reshard_after_forward) release(bucket);
  }
  const double sent_before = comm_->bytes_sent();
  // One rank sends nothing: a compressing hook would only add its rounding.
  f.compressed = options_.hook && ranks_ > 1;
  if (f.compressed) {
    f.hooked.index = static_cast<int64_t>(bucket);
    f.hooked.buffer = f.send;
    for (size_t s = 0; s < b.params.size(); ++s) {
      f.hooked.params.push_back(params_[b.params[s]].second);  // shapes only (stage 3 frees them)
      f.hooked.names.push_back(params_[b.params[s]].first);
      f.hooked.offsets.push_back(b.layout.offset(s));
    }
  }
  f.work = f.compressed ? options_.hook->start_reduce_scatter(f.hooked, f.recv, *comm_)
                        : comm_->reduce_scatter_async(f.recv, f.send, dist::ReduceOp::Avg);
  stats_.grad_bytes_sent += comm_->bytes_sent() - sent_before;
  stats_.reduce_scatter_bytes += static_cast<double>(f.send.numel() * f.send.element_size());
  stats_.grad_fp32_bytes += dist::wire_bytes(
      dist::OpKind::ReduceScatter, 4.0 * static_cast<double>(f.send.numel()), comm_->size(), false);
  in_flight_.push_back(std::move(f));
  retire(/*wait=*/false);  // frees the send buffers of reductions that are done
}

void ZeroOptimizer::retire(bool wait) {
  // A hook's whole-bucket reduction may communicate in its finish (PowerSGD's second all-reduce,
  // int8's all-gather): those finish when waiting, in launch order, the same on every rank (a
  // reduction found complete early would be finished on one rank and not yet on another), and
  // the oldest of them once more than kMaxHookedInFlight are in flight — a count of launches,
  // the same on every rank — so that their whole-bucket buffers do not pile up over backward.
  constexpr size_t kMaxHookedInFlight = 2;
  const bool finish_communicates = options_.hook && !options_.hook->reduces_scatter();
  const auto start = Clock::now();
  bool blocked = wait;
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    const bool ordered = it->compressed && finish_communicates;
    const bool now =
        wait || (ordered ? in_flight_.size() > kMaxHookedInFlight : it->work->is_completed());
    if (!now) {
      ++it;
      continue;
    }
    blocked = blocked || ordered;
    it->work->wait();
    auto& b = buckets_[it->bucket];
    if (it->compressed) {
      const double sent_before = comm_->bytes_sent();
      options_.hook->finish_reduce_scatter(it->hooked, it->recv, *comm_);
      stats_.grad_bytes_sent += comm_->bytes_sent() - sent_before;
      // Past the parameters the bucket is padding: a lossy hook may deliver values there (a sign
      // of 0 decodes to +scale), which the gradient shard must not hold (its norm counts them).
      const int64_t shard = it->recv.numel();
      const int64_t kept = std::clamp<int64_t>(b.layout.total() - rank_ * shard, 0, shard);
      if (kept < shard) it->recv.narrow(0, kept, shard - kept).zero_();
    }
    if (options_.stage == 1)
      b.grad_shard.copy_(it->recv);
    else
      b.grad_shard.add_(it->recv);
    it = in_flight_.erase(it);
  }
  if (blocked) stats_.wait_seconds += seconds_since(start);
}

void ZeroOptimizer::finish_gradient_sync() {
  if (options_.stage == 1 && !sync_) return;
  torch::NoGradGuard no_grad;
  if (options_.reduce_once && !sync_) {
    // Nothing was reduced: the gradients wait whole in .grad for the last micro-batch.
    forward_pos_ = 0;
    if (options_.stage == 3) {
      if (!forward_order_.empty()) order_recorded_ = true;
      if (options_.reshard_after_forward)
        for (size_t bi = 0; bi < buckets_.size(); ++bi)
          if (!is_root(bi)) release(bi);
    }
    return;
  }
  // Buckets whose parameters did not all get a gradient: those count as zeros on this rank.
  if (launch_order_.empty()) compute_launch_order();
  for (size_t k = next_launch_; k < launch_order_.size(); ++k) {
    auto& b = buckets_[launch_order_[k]];
    if (b.pending > 0 && !warned_incomplete_) {
      warned_incomplete_ = true;
      spdlog::warn(
          "ZeRO: {} was incomplete when backward ended (a parameter got no gradient); missing "
          "gradients count as zeros, and reductions from there on start after backward",
          b.name);
    }
    b.pending = 0;
  }
  launch_ready();
  retire(/*wait=*/true);
  for (auto& b : buckets_) b.pending = static_cast<int64_t>(b.params.size());
  next_launch_ = 0;
  forward_pos_ = 0;
  if (options_.stage == 3) {
    if (!forward_order_.empty()) order_recorded_ = true;
    for (size_t bi = 0; bi < buckets_.size(); ++bi)
      if ((!is_root(bi) && options_.reshard_after_forward) || sync_) release(bi);
  }
}

}  // namespace loom::parallel::zero
