#pragma once
// The context-parallel group a model's sequences are split over. Each sequence is cut into
// 2 * cp chunks and rank r holds chunks r and 2 cp - 1 - r (in that order): under a causal mask
// a chunk late in the sequence attends to more keys than an early one, and pairing the i-th
// earliest with the i-th latest gives every rank the same attention work (context_balance_test
// checks it). Positions, the loss and the targets all follow the same cut.
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>

#include "loom/dist/communicator.h"

namespace loom::parallel::context {

// What ring attention did on this rank since the last reset.
struct ContextStats {
  int64_t score_elements = 0;  // query-key pairs whose score was computed (causal work)
  int64_t messages = 0;        // ring sends
  int64_t bytes = 0;           // bytes of those sends
  double wait_s = 0;           // time blocked waiting for the ring after computing
  void reset() { *this = ContextStats{}; }
};

class ContextGroup {
 public:
  // comm null or of size 1: cp = 1 (no split, no collective).
  explicit ContextGroup(dist::CommunicatorPtr comm = nullptr);

  int64_t size() const { return comm_ ? comm_->size() : 1; }
  int64_t rank() const { return comm_ ? comm_->rank() : 0; }
  dist::Communicator* comm() const { return comm_.get(); }
  const dist::CommunicatorPtr& comm_ptr() const { return comm_; }

  // The chunks (of 2 * size()) that `rank` holds, in the order its slice lists them.
  std::array<int64_t, 2> chunks_of(int64_t rank) const { return {rank, 2 * size() - 1 - rank}; }
  // Throws loom::Error naming the length when 2 * cp does not divide it.
  void check_seq_len(int64_t seq_len) const;
  // The global positions [local_len] of this rank's tokens, for a slice of `local_len` tokens
  // (seq_len / cp), as int64 on `device`.
  at::Tensor local_positions(int64_t local_len, at::Device device) const;
  // This rank's slice of x along `dim`, which holds the whole sequence (token ids, targets).
  at::Tensor slice_sequence(const at::Tensor& x, int64_t dim) const;

  ContextStats& stats() { return stats_; }
  const ContextStats& stats() const { return stats_; }

 private:
  dist::CommunicatorPtr comm_;
  ContextStats stats_;
};

using ContextGroupPtr = std::shared_ptr<ContextGroup>;

// Query-key pairs inside the causal mask that `rank` computes for a sequence of `seq_len`
// tokens at context-parallel size `cp` with the chunk assignment above: what ring attention's
// stats count, for the balance check and the docs.
int64_t causal_score_elements(int64_t seq_len, int64_t cp, int64_t rank);

}  // namespace loom::parallel::context
