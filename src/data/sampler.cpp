#include "loom/data/sampler.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "loom/core/error.h"
#include "loom/core/rng.h"

namespace loom::data {

std::string to_string(Sampling sampling) {
  return sampling == Sampling::kEpoch ? "epoch" : "random";
}

Sampling parse_sampling(const std::string& name) {
  if (name == "epoch") return Sampling::kEpoch;
  if (name == "random") return Sampling::kRandom;
  fail("--sampling '{}' is not valid: epoch (without replacement) or random (with replacement)",
       name);
}

int64_t permute_index(int64_t index, int64_t n, uint64_t key) {
  LOOM_CHECK(n >= 1 && index >= 0 && index < n, "permute_index: index {} outside [0, {})", index,
             n);
  // Half-width h: 2h bits cover n (h >= 1). Each round maps (l, r) to (r, l ^ F(r)), a
  // bijection of [0, 4^h); values landing at or past n walk on (at most 3 times in 4 on average).
  int half = 1;
  while ((int64_t{1} << (2 * half)) < n) ++half;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  auto x = static_cast<uint64_t>(index);
  do {
    uint64_t l = x >> half, r = x & mask;
    for (uint64_t round = 0; round < 6; ++round) {
      const uint64_t f = core::mix_seed({key, round, r}) & mask;
      const uint64_t next = l ^ f;
      l = r;
      r = next;
    }
    x = (l << half) | r;
  } while (x >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(x);
}

WindowSampler::WindowSampler(std::shared_ptr<const TokenShard> shard, int64_t seq_len,
                             uint64_t seed, Sampling sampling, int64_t samples_per_step)
    : shard_(std::move(shard)),
      seq_len_(seq_len),
      seed_(seed),
      sampling_(sampling),
      samples_per_step_(samples_per_step) {
  LOOM_CHECK(seq_len_ > 0, "sequence length {} must be positive", seq_len_);
  LOOM_CHECK(shard_->size() > seq_len_,
             "token file '{}' has {} tokens; a window of seq_len {} needs at least {}",
             shard_->path().string(), shard_->size(), seq_len_, seq_len_ + 1);
  if (sampling_ == Sampling::kEpoch) {
    LOOM_CHECK(samples_per_step_ > 0,
               "epoch sampling numbers the run's samples by the global batch: samples_per_step "
               "{} must be positive",
               samples_per_step_);
    // W windows whose cut may shift by up to seq_len - 1 tokens and still fit: the last one,
    // starting at offset + (W - 1) T, needs T + 1 tokens.
    const int64_t size = shard_->size();
    epoch_windows_ = std::max<int64_t>(1, (size - seq_len_) / seq_len_);
    max_offset_ = std::min(seq_len_ - 1, size - 1 - epoch_windows_ * seq_len_);
  }
}

int64_t WindowSampler::windows_per_epoch() const {
  return sampling_ == Sampling::kEpoch ? epoch_windows_ : shard_->size() - seq_len_;
}

int64_t WindowSampler::window_start(int64_t step, int64_t index) const {
  if (sampling_ == Sampling::kRandom) {
    const auto span = static_cast<uint64_t>(shard_->size() - seq_len_);  // starts: [0, span)
    const uint64_t h =
        core::mix_seed({seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(index)});
    return static_cast<int64_t>(h % span);
  }
  const int64_t g = step * samples_per_step_ + index;
  const int64_t epoch = g / epoch_windows_;
  // Keys apart from kRandom's hashes (which take three values): a domain tag first.
  constexpr uint64_t kEpochTag = 0x65706f6368;  // "epoch"
  const uint64_t key = core::mix_seed({kEpochTag, seed_, static_cast<uint64_t>(epoch)});
  const int64_t offset =
      epoch == 0 ? 0 : static_cast<int64_t>(core::mix_seed({key, 1}) % uint64_t(max_offset_ + 1));
  return offset + permute_index(g % epoch_windows_, epoch_windows_, key) * seq_len_;
}

Batch WindowSampler::make_batch(const std::vector<int64_t>& starts) const {
  const auto n = static_cast<int64_t>(starts.size());
  auto inputs = at::empty({n, seq_len_}, at::kLong);
  auto targets = at::empty({n, seq_len_}, at::kLong);
  auto* in = inputs.data_ptr<int64_t>();
  auto* tg = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    shard_->copy_to(starts[i], seq_len_, in + i * seq_len_);
    shard_->copy_to(starts[i] + 1, seq_len_, tg + i * seq_len_);
  }
  return {inputs, targets};
}

Batch WindowSampler::training_batch(int64_t step, int64_t first, int64_t count) const {
  LOOM_CHECK(step >= 0 && first >= 0 && count >= 0 &&
                 (sampling_ == Sampling::kRandom || first + count <= samples_per_step_),
             "samples [{}, {}) of step {} are not in a global batch of {}", first, first + count,
             step, samples_per_step_);
  std::vector<int64_t> starts;
  starts.reserve(count);
  for (int64_t i = first; i < first + count; ++i) starts.push_back(window_start(step, i));
  return make_batch(starts);
}

int64_t WindowSampler::num_sequential_windows() const {
  return (shard_->size() - 1) / seq_len_;
}

Batch WindowSampler::sequential_batch(int64_t first, int64_t count) const {
  LOOM_CHECK(first >= 0 && first + count <= num_sequential_windows(),
             "windows [{}, {}) of length {} do not fit in '{}' ({} tokens, {} windows)", first,
             first + count, seq_len_, shard_->path().string(), shard_->size(),
             num_sequential_windows());
  std::vector<int64_t> starts;
  for (int64_t i = first; i < first + count; ++i) starts.push_back(i * seq_len_);
  return make_batch(starts);
}

BatchShard shard_batch(int64_t global, int64_t rank, int64_t ranks) {
  LOOM_CHECK(ranks > 0 && rank >= 0 && rank < ranks, "data shard: rank {} of {} is not valid", rank,
             ranks);
  LOOM_CHECK(global % ranks == 0,
             "a global batch of {} sequences cannot be split evenly across {} data-parallel "
             "ranks; use a batch size that is a multiple of {}",
             global, ranks, ranks);
  const int64_t share = global / ranks;
  return {rank * share, share};
}

}  // namespace loom::data
