#pragma once
// Which token windows make up each batch. Deterministic in (seed, step, sample index) only, so a
// resumed run sees exactly the data the uninterrupted run would, and a data-parallel rank draws
// its share of a global batch without talking to the others.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

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

// How training windows are drawn (--sampling).
//   kEpoch   without replacement: the shard is cut into W windows of seq_len + 1 tokens
//            (consecutive windows share one token, as sequential_batch's), and epoch e visits
//            each once, in the order of a permutation keyed by (seed, e); sample g of the run
//            (step * samples_per_step + its index in the step) is epoch g / W's (g mod W)-th.
//            Each epoch after the first shifts the cut by an offset in [0, seq_len) keyed by
//            (seed, e), so windows do not always start at the same tokens. Stateless: any sample
//            is computed from (seed, g) alone, so a resume continues bit for bit.
//   kRandom  with replacement: each window starts at a position hashed from (seed, step,
//            sample index); some tokens are never seen, others several times (loom before
//            2026-12-07, and checkpoints from then resume with it).
enum class Sampling { kEpoch, kRandom };
std::string to_string(Sampling sampling);
// "epoch" or "random"; anything else is a loom::Error naming the valid names.
Sampling parse_sampling(const std::string& name);

// A keyed permutation of [0, n) (n >= 1) evaluated one index at a time: a balanced Feistel
// network over the smallest even number of bits covering n, cycle-walked into [0, n). The same
// (key, n) gives the same permutation on every machine.
int64_t permute_index(int64_t index, int64_t n, uint64_t key);

class WindowSampler {
 public:
  // Throws loom::Error if the shard holds fewer than seq_len + 1 tokens, or (kEpoch) unless
  // samples_per_step > 0 (the global batch: it numbers the samples of the run).
  WindowSampler(std::shared_ptr<const TokenShard> shard, int64_t seq_len, uint64_t seed,
                Sampling sampling = Sampling::kRandom, int64_t samples_per_step = 0);

  // Samples [first, first + count) of optimizer step `step`'s global batch, as `sampling` draws
  // them.
  Batch training_batch(int64_t step, int64_t first, int64_t count) const;
  // Where sample `index` of step `step` starts in the shard.
  int64_t window_start(int64_t step, int64_t index) const;
  // kEpoch: windows per epoch (W above); kRandom: the positions a window may start at.
  int64_t windows_per_epoch() const;
  Sampling sampling() const { return sampling_; }

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
  Sampling sampling_;
  int64_t samples_per_step_;
  int64_t epoch_windows_ = 0;  // kEpoch: W
  int64_t max_offset_ = 0;     // kEpoch: the largest shift of an epoch's cut
};

}  // namespace loom::data
