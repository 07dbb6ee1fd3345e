#pragma once
// Sparse gradient exchange with error feedback (Deep Gradient Compression; DCT's hard
// thresholding): each rank sends only its largest accumulated gradients, as (index, value)
// pairs, and keeps everything else in an error buffer that is added to the next step's gradient,
// so nothing is lost, only delayed. Per bucket of n values over R ranks, with k = ceil(ratio n):
//   1. v = gradient + carried error; the threshold is the k-th largest |v| (topk: every step;
//      threshold: every `every` steps, reused in between);
//   2. the values with |v| >= threshold, at most k of them in ascending index order, are sent;
//      the carried error becomes v with the sent values zeroed (ops/sparsify.h);
//   3. an all-gather of every rank's k pairs (padding: index -1), started during backward; each
//      rank then adds the R lists into zeros, rank after rank, and divides by R: every rank
//      computes the same sums in the same order, so the replicas stay equal bit for bit.
// Bytes a rank sends per bucket (dist::wire_bytes): (R - 1) 8 k, against an fp32 all-reduce's
// 2 (R - 1) / R x 4 n: n / (R k) times fewer, about 1 / (R ratio) (docs/compression.md).
// Between refreshes of the threshold fewer than k values may pass it (the rest of the message is
// padding) or more (those past k wait in the error, lower indices first).
// Under ZeRO (reduce_scatter) each of the R shards of a bucket is selected as a bucket of its own
// (its own threshold and k_s = ceil(ratio shard) values, from this rank's error for it), an
// all-to-all sends shard r's pairs to rank r, and rank r adds the R lists into zeros, rank after
// rank, and divides by R. Bytes: (R - 1) 8 k_s against a reduce-scatter's (R - 1) 4 shard, about
// 1 / (2 ratio) times fewer; the error ("b<index>/scatter_error") is bucket-sized, as the sender
// selects from every shard.
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "loom/core/option_spec.h"
#include "loom/parallel/data/comm_hook.h"

namespace loom::parallel::data {

class SparseCompressHook : public CommHook {
 public:
  // `name` is what --comm-hook calls it; ratio in (0, 1], refresh_every >= 1 (loom::Error naming
  // the value otherwise).
  SparseCompressHook(std::string name, double ratio, int64_t refresh_every);
  // --comm-hook topk[:ratio=R] (default 0.01) and threshold[:ratio=R,every=K] (0.01, 10).
  static std::shared_ptr<CommHook> topk(const core::OptionSpec& spec);
  static std::shared_ptr<CommHook> threshold(const core::OptionSpec& spec);

  std::string name() const override { return name_; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
  bool carries_state() const override { return true; }
  // "b<index>/error" (float32), "b<index>/steps" (int64) and "b<index>/threshold" (float64) of
  // every bucket reduced so far.
  std::map<std::string, at::Tensor> state() const override;
  void load_state(const std::map<std::string, at::Tensor>& state) override;
  // Each rank finds its threshold from its own values: resharded, the old ranks' mean (kMean),
  // as the errors (the reduce-scatter's too); the step counts are held alike (kFirst).
  StateReshard reshard_rule(const std::string& key) const override;
  // The data-parallel state as load_state; the reduce-scatter's kept until lay_out_resharded
  // cuts it into the new shards (ZeRO's padded bucket size), every shard's threshold the mean of
  // the old ones.
  void load_resharded_state(const std::map<std::string, at::Tensor>& state) override;
  void lay_out_resharded(int64_t index, int64_t numel, int64_t rank, int64_t ranks) override;
  // "owed": the mean error (the reduce-scatter's, over the whole bucket). Taken back as the
  // error, with the step count and thresholds afresh (found again on the next step).
  std::map<std::string, at::Tensor> group_values(
      const std::map<std::string, at::Tensor>& group,
      const std::map<int64_t, BucketShape>& buckets) const override;
  void load_group_values(const std::map<std::string, at::Tensor>& values,
                         bool reduce_scatter) override;
  bool reduces_scatter() const override { return true; }
  // State "b<index>/scatter_error" (float32 [R shard]), "b<index>/scatter_steps" and
  // "b<index>/scatter_threshold" (float64 [R], a threshold per shard).
  dist::WorkPtr start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                     dist::Communicator& comm) override;
  void finish_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                             dist::Communicator& comm) override;

  double ratio() const { return ratio_; }
  int64_t refresh_every() const { return refresh_every_; }
  // Values each rank sends of a bucket of `numel`: ceil(ratio numel), at least 1, at most numel.
  int64_t capacity(int64_t numel) const;
  // Of bucket `index`'s last reduction: the error carried (float32 [n]; empty before the first),
  // the threshold used, and how many values passed it (may exceed the capacity).
  at::Tensor error(int64_t index) const;
  // The reduce-scatter's error of bucket `index` (float32 [R shard]; empty before the first).
  at::Tensor scatter_error(int64_t index) const;
  double threshold_of(int64_t index) const;
  int64_t last_selected(int64_t index) const;

 private:
  struct State {
    int64_t capacity = 0, steps = 0, selected = 0;
    double threshold = 0;
    at::Tensor error;       // float32 [n]
    at::Tensor send, recv;  // int32 [2 capacity] (indices, then values' bits), [R, 2 capacity]
  };
  struct ScatterState {
    int64_t ranks = 0, shard = 0, capacity = 0, steps = 0;  // capacity: per shard
    at::Tensor error;                                       // float32 [ranks shard]
    at::Tensor threshold;                                   // float64 [ranks], on the host
    at::Tensor send, recv;                                  // int32 [ranks, 2 capacity]
    // Restored from another number of ranks, until laid out: the old ranks' mean error in
    // bucket order and the mean of their thresholds.
    at::Tensor resharded_error;
    double resharded_threshold = 0;
  };
  // (Re)allocates `s` for `ranks` shards of `shard` values: zero errors and a fresh step count,
  // or what a reshard left in it.
  static void lay_out_scatter(ScatterState& s, int64_t ranks, int64_t shard,
                              const at::TensorOptions& options);
  const State& state_of(int64_t index) const;
  void load_scatter_state(int64_t index, const at::Tensor& error,
                          const std::map<std::string, at::Tensor>& state);

  std::string name_;
  double ratio_;
  int64_t refresh_every_;
  std::map<int64_t, State> state_;                 // by bucket index
  std::map<int64_t, ScatterState> scatter_state_;  // by bucket index
};

}  // namespace loom::parallel::data
