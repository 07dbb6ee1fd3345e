#include "loom/data/sampler.h"

#include <ATen/ATen.h>

#include "loom/core/error.h"
#include "loom/core/rng.h"

namespace loom::data {

WindowSampler::WindowSampler(std::shared_ptr<const TokenShard> shard, int64_t seq_len,
                             uint64_t seed)
    : shard_(std::move(shard)), seq_len_(seq_len), seed_(seed) {
  LOOM_CHECK(seq_len_ > 0, "sequence length {} must be positive", seq_len_);
  LOOM_CHECK(shard_->size() > seq_len_,
             "token file '{}' has {} tokens; a window of seq_len {} needs at least {}",
             shard_->path().string(), shard_->size(), seq_len_, seq_len_ + 1);
}

Batch WindowSampler::make_batch(const std::vector<int64_t>& starts) const {
  const auto n = static_cast<int64_t>(starts.size());
  auto inputs = at::empty({n, seq_len_}, at::kLong);
  auto targets = at::empty({n, seq_len_}, at::kLong);
  const auto tokens = shard_->tokens();
  auto* in = inputs.data_ptr<int64_t>();
  auto* tg = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* src = tokens.data() + starts[i];
    for (int64_t t = 0; t < seq_len_; ++t) {
      in[i * seq_len_ + t] = src[t];
      tg[i * seq_len_ + t] = src[t + 1];
    }
  }
  return {inputs, targets};
}

Batch WindowSampler::random_batch(int64_t step, int64_t first, int64_t count) const {
  const auto span = static_cast<uint64_t>(shard_->size() - seq_len_);  // valid starts: [0, span)
  std::vector<int64_t> starts;
  starts.reserve(count);
  for (int64_t i = first; i < first + count; ++i) {
    const uint64_t h =
        core::mix_seed({seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(i)});
    starts.push_back(static_cast<int64_t>(h % span));
  }
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
