#pragma once
// PowerSGD (Vogels et al. 2019): each gradient matrix M (rows x cols: a parameter's first
// dimension by the rest) is sent as two thin factors from one step of power iteration, with
// error feedback, warm-started from the last step's factor. Per bucket and step, on every rank:
//   1. M = gradient + carried error (float32), for each matrix the hook compresses;
//   2. P = M Q (Q: cols x rank, the last step's, the same on every rank); one all-reduce averages
//      every matrix's P together with the bucket's uncompressed values (biases, norms, matrices
//      too small to gain), started during backward;
//   3. P is orthogonalized (ops/orthogonalize.h: loom's kernel on CUDA tensors); Q = M^T P; a
//      second all-reduce averages Q (after backward, as int8's second stage);
//   4. the gradient becomes P Q^T and the carried error M - P Q^T.
// The averages of steps 2 and 3 are the same on every rank, so every rank gets the same P Q^T:
// the rank-`rank` approximation of the mean gradient that one power-iteration step from Q finds.
// A matrix is compressed when rank (rows + cols) <= rows cols / 2 (it sends at most half its
// values); the first Q is uniform in [-1, 1), drawn from integers alone (splitmix64 seeded by the
// bucket index), so every rank, whatever its CPU or library, draws the same bits. Bytes a rank
// sends per bucket (dist::wire_bytes): 2 (R - 1)/R x 4 (sum over compressed matrices of
// rank (rows + cols) + uncompressed values), against 2 (R - 1)/R x 4 n for the fp32 all-reduce
// (docs/compression.md).
// A step whose averaged Q is not finite (a NaN or an infinity in some rank's gradient; every rank
// sees the same Q) leaves the non-finite values in the gradient for the trainer's check, resets
// the error to 0 and Q to the first step's. A column of Q that comes back all zero (a matrix
// whose gradient was zero on every rank) takes the first step's column again, so warm start
// cannot stick at zero. The error is M less the gradient as stored: with bf16 gradients their
// rounding to bf16 is fed back too.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/core/option_spec.h"
#include "loom/parallel/data/comm_hook.h"

namespace loom::parallel::data {

class PowerSgdHook : public CommHook {
 public:
  // rank in [1, ops::max_orthogonalize_rank()] (32); loom::Error naming the value otherwise.
  explicit PowerSgdHook(int64_t rank);
  // --comm-hook powersgd[:rank=R] (default 4).
  explicit PowerSgdHook(const core::OptionSpec& spec);

  std::string name() const override { return "powersgd"; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
  bool carries_state() const override { return true; }
  // "b<index>/error" (float32: the compressed matrices' errors, one after another) and
  // "b<index>/q" (float32: their Q factors) of every bucket reduced so far.
  // Taken from another layout, "b<index>/pending_owed" (float32, the bucket's parameters' values)
  // until the bucket's next reduction adds it: to the matrices' errors, and to the gradient of
  // the values sent as they are.
  std::map<std::string, at::Tensor> state() const override;
  void load_state(const std::map<std::string, at::Tensor>& state) override;
  // "owed": the mean error of each matrix at its place in the bucket (plus any pending); Q is not
  // carried (the first step's is drawn again).
  std::map<std::string, at::Tensor> group_values(
      const std::map<std::string, at::Tensor>& group,
      const std::map<int64_t, BucketShape>& buckets) const override;
  void load_group_values(const std::map<std::string, at::Tensor>& values,
                         bool reduce_scatter) override;

  int64_t rank() const { return rank_; }
  // Whether a rows x cols matrix is sent as factors: rank (rows + cols) <= rows cols / 2.
  bool compresses(int64_t rows, int64_t cols) const;
  // Float32 values a rank contributes per step for `bucket`'s parameters: the two all-reduces'
  // lengths added up (P and the uncompressed values, then Q).
  int64_t values_sent(const GradBucket& bucket) const;
  // Of bucket `index` (empty before its first reduction): the error carried, and the Q factors.
  at::Tensor error(int64_t index) const;
  at::Tensor q(int64_t index) const;

 private:
  struct Matrix {
    int64_t bucket_offset = 0, rows = 0, cols = 0;
    int64_t error_offset = 0, p_offset = 0, q_offset = 0;
  };
  struct Layout {
    std::vector<Matrix> matrices;
    std::vector<std::pair<int64_t, int64_t>> dense;  // (bucket offset, length): sent as they are
    int64_t error_numel = 0, p_numel = 0, q_numel = 0, dense_numel = 0;
  };
  struct State {
    Layout layout;
    at::Tensor error;    // [error_numel]; from start to finish it holds M = gradient + error
    at::Tensor q;        // [q_numel]
    at::Tensor first_q;  // [q_numel]: the first step's, for columns that die and a NaN's reset
    at::Tensor message;  // in flight: [p_numel + dense_numel]
  };
  Layout layout_of(const std::vector<std::vector<int64_t>>& shapes,
                   const std::vector<int64_t>& offsets) const;
  Layout layout_of(const GradBucket& bucket) const;
  static at::Tensor draw_first_q(int64_t bucket_index, int64_t numel, const at::Tensor& like);

  int64_t rank_;
  std::map<int64_t, State> state_;              // by bucket index
  std::map<int64_t, at::Tensor> pending_owed_;  // by bucket index: from another layout
};

}  // namespace loom::parallel::data
