#pragma once
// Which token windows make up each batch. Deterministic in (seed, step, sample index) only, so a
// resumed run sees exactly the data the uninterrupted run would, and a data-parallel rank draws
// its share of a global batch without talking to the others.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/data/mixture.h"
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

// A source of training windows: one or more token shards (a window never crosses a shard
// boundary) and its weight in a mixture (mixture.h).
struct SamplerSource {
  std::string name;
  std::vector<std::shared_ptr<const TokenShard>> shards;
  double weight = 1;
  int64_t tokens() const;  // in all its shards
};

// Opens the shards of parsed --data sources (mixture.h).
std::vector<SamplerSource> open_sources(const std::vector<DataSourceSpec>& specs);

class WindowSampler {
 public:
  // One shard. Throws loom::Error if it holds fewer than seq_len + 1 tokens, or (kEpoch) unless
  // samples_per_step > 0 (the global batch: it numbers the samples of the run).
  WindowSampler(std::shared_ptr<const TokenShard> shard, int64_t seq_len, uint64_t seed,
                Sampling sampling = Sampling::kRandom, int64_t samples_per_step = 0);
  // Sources mixed by weight: sample g of the run comes from the source MixtureSchedule deals it
  // to, and is that source's k-th, drawn by the source's own epochs (kEpoch above, over the
  // windows of all its shards together: each window of each shard once per epoch). A source's
  // shard 0 keeps a one-shard sampler's cut and order, so one source of one shard draws what the
  // constructor above draws. kRandom takes one source of one shard only (loom's draw before
  // mixtures). Throws loom::Error naming the shard too short for a window, or the flag.
  WindowSampler(std::vector<SamplerSource> sources, int64_t seq_len, uint64_t seed,
                Sampling sampling, int64_t samples_per_step);

  // Samples [first, first + count) of optimizer step `step`'s global batch, as `sampling` draws
  // them.
  Batch training_batch(int64_t step, int64_t first, int64_t count) const;
  // Where sample `index` of step `step` comes from.
  struct Window {
    int64_t source = 0;
    int64_t shard = 0;  // within the source
    int64_t start = 0;  // token offset in that shard
  };
  Window window(int64_t step, int64_t index) const;
  int64_t window_start(int64_t step, int64_t index) const { return window(step, index).start; }
  // kEpoch: a source's windows per epoch (W above, summed over its shards); kRandom: the
  // positions a window may start at.
  int64_t windows_per_epoch(int64_t source = 0) const;
  // The samples of each source among the run's first `samples` (epochs: this over
  // windows_per_epoch). Stateless: a few thousand hashes at most.
  std::vector<int64_t> samples_drawn(int64_t samples) const;
  Sampling sampling() const { return sampling_; }

  // Windows [first, first + count) in file order over every shard of every source in turn:
  // window i of a shard is tokens[i*T, i*T + T) with targets tokens[i*T + 1, i*T + T + 1).
  // Used for evaluation (one sampler per validation source).
  Batch sequential_batch(int64_t first, int64_t count) const;
  // How many sequential windows fit in the shards.
  int64_t num_sequential_windows() const;

  int64_t seq_len() const { return seq_len_; }
  const std::vector<SamplerSource>& sources() const { return sources_; }
  // Tokens in all shards of all sources.
  int64_t tokens() const;
  // "'path'" for one shard, else the count of sources and shards (for messages).
  std::string describe() const;
  // The first shard (a one-shard sampler's only one).
  const TokenShard& shard() const { return *sources_.front().shards.front(); }

 private:
  struct ShardWindows {
    int64_t epoch_windows = 0;  // W of this shard
    int64_t max_offset = 0;     // the largest shift of an epoch's cut
  };
  struct SourceWindows {
    std::vector<ShardWindows> shards;
    std::vector<int64_t> first;  // first[i]: the source's windows before shard i's
    int64_t epoch_windows = 0;   // the source's W
  };
  Batch make_batch(const std::vector<Window>& windows) const;

  std::vector<SamplerSource> sources_;
  int64_t seq_len_;
  uint64_t seed_;
  Sampling sampling_;
  int64_t samples_per_step_;
  std::vector<SourceWindows> windows_;  // kEpoch, per source
  std::unique_ptr<MixtureSchedule> mixture_;
};

}  // namespace loom::data
