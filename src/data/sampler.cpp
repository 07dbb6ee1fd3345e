#include "loom/data/sampler.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

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
    : WindowSampler(
          std::vector<SamplerSource>{
              {shard ? shard->path().stem().string() : "", {std::move(shard)}, 1.0}},
          seq_len, seed, sampling, samples_per_step) {}

WindowSampler::WindowSampler(std::vector<SamplerSource> sources, int64_t seq_len, uint64_t seed,
                             Sampling sampling, int64_t samples_per_step)
    : sources_(std::move(sources)),
      seq_len_(seq_len),
      seed_(seed),
      sampling_(sampling),
      samples_per_step_(samples_per_step) {
  LOOM_CHECK(seq_len_ > 0, "sequence length {} must be positive", seq_len_);
  LOOM_CHECK(!sources_.empty(), "a window sampler needs at least one source");
  std::vector<double> weights;
  for (const auto& source : sources_) {
    LOOM_CHECK(!source.shards.empty(), "data source '{}' has no shards", source.name);
    for (const auto& shard : source.shards)
      LOOM_CHECK(shard->size() > seq_len_,
                 "token file '{}' has {} tokens; a window of seq_len {} needs at least {}",
                 shard->path().string(), shard->size(), seq_len_, seq_len_ + 1);
    weights.push_back(source.weight);
  }
  if (sampling_ == Sampling::kRandom) {
    LOOM_CHECK(sources_.size() == 1 && sources_.front().shards.size() == 1,
               "--sampling random draws from one token file; {} sources of {} files are drawn "
               "by epochs (--sampling epoch)",
               sources_.size(), sources_.front().shards.size());
    return;
  }
  LOOM_CHECK(samples_per_step_ > 0,
             "epoch sampling numbers the run's samples by the global batch: samples_per_step "
             "{} must be positive",
             samples_per_step_);
  for (const auto& source : sources_) {
    SourceWindows sw;
    for (const auto& shard : source.shards) {
      // W windows whose cut may shift by up to seq_len - 1 tokens and still fit: the last one,
      // starting at offset + (W - 1) T, needs T + 1 tokens.
      const int64_t size = shard->size();
      ShardWindows w;
      w.epoch_windows = std::max<int64_t>(1, (size - seq_len_) / seq_len_);
      w.max_offset = std::min(seq_len_ - 1, size - 1 - w.epoch_windows * seq_len_);
      sw.first.push_back(sw.epoch_windows);
      sw.epoch_windows += w.epoch_windows;
      sw.shards.push_back(w);
    }
    windows_.push_back(std::move(sw));
  }
  mixture_ = std::make_unique<MixtureSchedule>(weights, seed_);
}

int64_t WindowSampler::windows_per_epoch(int64_t source) const {
  LOOM_CHECK(source >= 0 && source < static_cast<int64_t>(sources_.size()),
             "source {} of {} sources", source, sources_.size());
  return sampling_ == Sampling::kEpoch ? windows_[source].epoch_windows : shard().size() - seq_len_;
}

std::string WindowSampler::describe() const {
  if (sources_.size() == 1 && sources_.front().shards.size() == 1)
    return fmt::format("'{}'", shard().path().string());
  int64_t shards = 0;
  for (const auto& source : sources_) shards += static_cast<int64_t>(source.shards.size());
  return fmt::format("{} source{} ({} shards)", sources_.size(), sources_.size() == 1 ? "" : "s",
                     shards);
}

int64_t SamplerSource::tokens() const {
  int64_t n = 0;
  for (const auto& shard : shards) n += shard->size();
  return n;
}

int64_t WindowSampler::tokens() const {
  int64_t n = 0;
  for (const auto& source : sources_) n += source.tokens();
  return n;
}

WindowSampler::Window WindowSampler::window(int64_t step, int64_t index) const {
  if (sampling_ == Sampling::kRandom) {
    const auto span = static_cast<uint64_t>(shard().size() - seq_len_);  // starts: [0, span)
    const uint64_t h =
        core::mix_seed({seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(index)});
    return {0, 0, static_cast<int64_t>(h % span)};
  }
  const auto [source, k] = mixture_->draw(step * samples_per_step_ + index);
  const auto& sw = windows_[source];
  const int64_t epoch = k / sw.epoch_windows;
  // Keys apart from kRandom's hashes (which take three values): a domain tag first. Source 0
  // keeps the key a one-source sampler has always used.
  constexpr uint64_t kEpochTag = 0x65706f6368;  // "epoch"
  const uint64_t key = source == 0
                           ? core::mix_seed({kEpochTag, seed_, static_cast<uint64_t>(epoch)})
                           : core::mix_seed({kEpochTag, seed_, static_cast<uint64_t>(epoch),
                                             static_cast<uint64_t>(source)});
  const int64_t j = permute_index(k % sw.epoch_windows, sw.epoch_windows, key);
  const auto shard = std::upper_bound(sw.first.begin(), sw.first.end(), j) - sw.first.begin() - 1;
  const auto& w = sw.shards[shard];
  // Each shard's cut shifts by its own offset (shard 0's as a one-shard sampler's).
  const uint64_t h = shard == 0 ? core::mix_seed({key, 1})
                                : core::mix_seed({key, 1, static_cast<uint64_t>(shard)});
  const int64_t offset = epoch == 0 ? 0 : static_cast<int64_t>(h % uint64_t(w.max_offset + 1));
  return {source, shard, offset + (j - sw.first[shard]) * seq_len_};
}

std::vector<int64_t> WindowSampler::samples_drawn(int64_t samples) const {
  std::vector<int64_t> out(sources_.size(), 0);
  if (sampling_ == Sampling::kRandom || sources_.size() == 1) {
    out.front() = samples;
    return out;
  }
  // Whole blocks give each source its quota; the last, partial block is counted draw by draw.
  const int64_t block = MixtureSchedule::kBlock;
  const int64_t whole = samples / block;
  for (size_t s = 0; s < out.size(); ++s) out[s] = whole * mixture_->quotas()[s];
  for (int64_t g = whole * block; g < samples; ++g) ++out[mixture_->draw(g).source];
  return out;
}

Batch WindowSampler::make_batch(const std::vector<Window>& windows) const {
  const auto n = static_cast<int64_t>(windows.size());
  auto inputs = at::empty({n, seq_len_}, at::kLong);
  auto targets = at::empty({n, seq_len_}, at::kLong);
  auto* in = inputs.data_ptr<int64_t>();
  auto* tg = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& shard = *sources_[windows[i].source].shards[windows[i].shard];
    shard.copy_to(windows[i].start, seq_len_, in + i * seq_len_);
    shard.copy_to(windows[i].start + 1, seq_len_, tg + i * seq_len_);
  }
  return {inputs, targets};
}

Batch WindowSampler::training_batch(int64_t step, int64_t first, int64_t count) const {
  LOOM_CHECK(step >= 0 && first >= 0 && count >= 0 &&
                 (sampling_ == Sampling::kRandom || first + count <= samples_per_step_),
             "samples [{}, {}) of step {} are not in a global batch of {}", first, first + count,
             step, samples_per_step_);
  std::vector<Window> windows;
  windows.reserve(count);
  for (int64_t i = first; i < first + count; ++i) windows.push_back(window(step, i));
  return make_batch(windows);
}

int64_t WindowSampler::num_sequential_windows() const {
  int64_t n = 0;
  for (const auto& source : sources_)
    for (const auto& shard : source.shards) n += (shard->size() - 1) / seq_len_;
  return n;
}

Batch WindowSampler::sequential_batch(int64_t first, int64_t count) const {
  const int64_t total = num_sequential_windows();
  LOOM_CHECK(first >= 0 && count >= 0 && first + count <= total,
             "windows [{}, {}) of length {} do not fit in {} ({} tokens, {} windows)", first,
             first + count, seq_len_, describe(), tokens(), total);
  std::vector<Window> windows;
  windows.reserve(count);
  int64_t source = 0, shard = 0, before = 0;  // windows in the shards before this one
  for (int64_t i = first; i < first + count; ++i) {
    auto in_shard = [&] { return (sources_[source].shards[shard]->size() - 1) / seq_len_; };
    while (i - before >= in_shard()) {
      before += in_shard();
      if (++shard == static_cast<int64_t>(sources_[source].shards.size())) {
        shard = 0;
        ++source;
      }
    }
    windows.push_back({source, shard, (i - before) * seq_len_});
  }
  return make_batch(windows);
}

std::vector<SamplerSource> open_sources(const std::vector<DataSourceSpec>& specs) {
  std::vector<SamplerSource> out;
  for (const auto& spec : specs) {
    SamplerSource source{spec.name, {}, spec.weight};
    for (const auto& path : spec.paths) source.shards.push_back(std::make_shared<TokenShard>(path));
    out.push_back(std::move(source));
  }
  return out;
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
