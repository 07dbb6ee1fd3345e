#pragma once
// Data parallelism over a replicated model: every rank holds all parameters, computes gradients
// on its share of the global batch, and the gradients are averaged across the dp group. The
// averaging overlaps backward: gradients are grouped into buckets, and a bucket's reduction
// starts (asynchronously, through the communication hook) as soon as the last of its gradients
// has been accumulated. With gradient accumulation only the last micro-batch's backward syncs.
//
//   DataParallel dp(named_params, mesh.comm_ptr(Dim::dp));
//   dp.broadcast_parameters();                 // replicas start equal
//   for micro-batch k: dp.set_sync(k == last); loss.backward();
//   dp.finish_gradient_sync();                 // .grad now holds the dp-average
//   optimizer step; dp.zero_grad();
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/dist/communicator.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/data/grad_bucket.h"
#include "loom/parallel/grad_ready_hooks.h"

namespace loom::parallel::data {

struct DataParallelOptions {
  double bucket_mb = 25.0;         // bucket capacity in MiB (--bucket-mb)
  std::shared_ptr<CommHook> hook;  // null: AllReduceAvgHook
};

// Counters of the last synchronized backward, for benchmarks and logs.
struct SyncStats {
  int64_t buckets_launched_in_backward = 0;  // started while backward was still running
  // Bytes this rank sent for the buckets (the hook's collectives, as the communicator counts them:
  // dist::wire_bytes), and what fp32 all-reduces of the same buckets would have sent: their
  // ratio is the hook's compression ratio.
  double bytes_sent = 0;
  double fp32_bytes = 0;
  double wait_seconds = 0;                   // finish_gradient_sync blocked on communication
  // From the first bucket's launch to the end of backward (finish_gradient_sync's start): the
  // window in which communication ran alongside backward.
  double overlap_window_seconds = 0;
};

class DataParallel {
 public:
  using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;

  // Registers a hook on each parameter's gradient accumulator. Parameters that do not require
  // gradients are skipped. Throws loom::Error for a bucket size that is not positive.
  DataParallel(NamedParams params, dist::CommunicatorPtr comm, DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Copies rank 0's parameters to every rank (one broadcast per bucket-sized group).
  void broadcast_parameters();
  // Whether the next backward reduces gradients: false for every micro-batch but the last.
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }
  // After the synchronizing backward: launches any bucket backward did not complete (a
  // parameter without a gradient counts as zeros), waits for all of them, and leaves the
  // dp-average in every .grad (views of the reduced buffers). A no-op when sync is off.
  void finish_gradient_sync();

  // Zeros every gradient in place. The parameters' .grad are views of the bucket buffers (so
  // backward accumulates straight into them and nothing is copied); prefer this to resetting
  // .grad, after which the next backward's gradients are copied into the buckets once more.
  void zero_grad();

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  const dist::Communicator& comm() const { return *comm_; }
  const CommHook& hook() const { return *hook_; }
  const SyncStats& last_sync() const { return stats_; }

 private:
  void on_grad_ready(size_t bucket, size_t slot);
  // Makes parameter `slot`'s .grad the bucket's view of it, keeping (copying) its value.
  void adopt_grad(GradBucket& b, size_t slot);
  void launch_ready_buckets();
  void reset_backward_state();

  dist::CommunicatorPtr comm_;
  std::shared_ptr<CommHook> hook_;
  std::vector<GradBucket> buckets_;
  GradReadyHooks hooks_;  // after the buckets: destroyed (unhooked) before them
  std::chrono::steady_clock::time_point first_launch_{};
  size_t next_to_launch_ = 0;  // buckets launch strictly in order: every rank the same
  bool in_backward_ = false;
  bool warned_late_launch_ = false;
  bool sync_ = true;
  SyncStats stats_;
};

}  // namespace loom::parallel::data
