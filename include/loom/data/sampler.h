#pragma once
// Which token windows make up each batch. Deterministic in (seed, step, sample index) only, so a
// resumed run sees exactly the data the uninterrupted run would, and so later a data-parallel
// rank can draw its share of a global batch without talking to the others.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "loom/data/token_shard.h"

namespace loom::data {

struct Batch {
  at::Tensor inputs;   // [B, T] int64
  at::Tensor targets;  // [B, T] int64: inputs shifted by one token
};

// The samples [first, first + count) of a global batch that data-parallel rank `rank` of `ranks`
// trains on: equal contiguous shares in rank order, so the union over ranks is the batch the
// single-process run sees. Throws loom::Error unless `ranks` divides `global`.
struct BatchShard {
  int64_t first = 0;
  int64_t count = 0;
};
BatchShard shard_batch(int64_t global, int64_t rank, int64_t ranks);

class WindowSampler {
 public:
  // Throws loom::Error if the shard holds fewer than seq_len + 1 tokens.
  WindowSampler(std::shared_ptr<const TokenShard> shard, int64_t seq_len, uint64_t seed);

  // Samples [first, first + count) of optimizer step `step`, each a window starting at a
  // position drawn from (seed, step, sample index).
  Batch random_batch(int64_t step, int64_t first, int64_t count) const;

  // Windows [first, first + count) in file order: window i is tokens[i*T, i*T + T) with
  // targets tokens[i*T + 1, i*T + T + 1). Used for evaluation.
  Batch sequential_batch(int64_t first, int64_t count) const;
  // How many sequential windows fit in the shard.
  int64_t num_sequential_windows() const;

  int64_t seq_len() const { return seq_len_; }
  const TokenShard& shard() const { return *shard_; }

 private:
  Batch make_batch(const std::vector<int64_t>& starts) const;

  std::shared_ptr<const TokenShard> shard_;
  int64_t seq_len_;
  uint64_t seed_;
};

}  // namespace loom::data
