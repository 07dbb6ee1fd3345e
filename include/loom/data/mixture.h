#pragma once
// Data mixtures: several token sources, each one or more shards, drawn in proportion to their
// weights (--data web=web/*.bin:0.7,code=code.bin:0.3). Which source sample g of a run comes
// from is a function of (seed, g) alone, like the windows within a source (sampler.h), so a
// resumed run continues the same mixture bit for bit at any layout.
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

struct DataSourceSpec {
  std::string name;                          // unique within a spec
  std::string pattern;                       // the path as given: a file, or a glob
  std::vector<std::filesystem::path> paths;  // its shards, in name order
  double weight = 1;                         // normalized: a spec's weights sum to 1
};

// Parses a comma-separated list of sources, each `[NAME=]PATH[:WEIGHT]`: PATH a token shard or a
// glob in its last component ('web/shard_*.bin', matching files in name order); WEIGHT a
// positive number (default 1), normalized over the list; NAME (default: the file's stem, or for
// a glob the name of its directory) names the source in metrics and messages. One plain path is
// a source of weight 1 named after its file, as --data always read. Throws loom::Error naming
// `flag`, the entry and what is wrong: an empty entry, a weight that is not a positive number, a
// glob that matches nothing, a missing file, a directory, two sources of one name.
std::vector<DataSourceSpec> parse_data_sources(const std::string& spec,
                                               std::string_view flag = "--data");

// Which source sample g of the run is drawn from, and which of that source's samples it is
// (its k-th, counting from 0 over the run).
struct SourceDraw {
  int64_t source = 0;
  int64_t index = 0;
};

// The stateless mixing rule. Samples are dealt in blocks of kBlock: each source gets a fixed
// quota of every block (its weight × kBlock, rounded by largest remainder so the quotas sum to
// kBlock), and within block b the quotas' positions are shuffled by a permutation keyed by
// (seed, b). So a source's share of any whole block is exact to 1/kBlock, and its share of a
// batch varies as a draw without replacement from the block. A source's samples are numbered in
// the run's order (its k-th sample comes after its (k-1)-th), so its epochs follow one another.
// Sample g's source and number depend on (seed, g) alone; the block's table (kBlock entries, a
// fraction of a millisecond to make) is kept for the block last asked about. One source:
// sample g is its g-th.
class MixtureSchedule {
 public:
  static constexpr int64_t kBlock = 4096;
  // Throws loom::Error for no weights, a weight that is not positive and finite, or one too
  // small to get a sample in a block (below 1 / (2 kBlock) of the total).
  MixtureSchedule(const std::vector<double>& weights, uint64_t seed);

  SourceDraw draw(int64_t g) const;
  // Samples of each source in every block.
  const std::vector<int64_t>& quotas() const { return quota_; }
  int64_t sources() const { return static_cast<int64_t>(quota_.size()); }

 private:
  std::vector<int64_t> quota_;
  std::vector<int64_t> first_;  // first_[s]: the block positions before source s's
  uint64_t seed_;
  // The last block's deal: each position's source and its number among the source's positions
  // in the block. Guarded: samplers may be read from several threads.
  mutable std::mutex mutex_;
  mutable int64_t block_ = -1;
  mutable std::vector<int32_t> source_at_, index_at_;
};

}  // namespace loom::data
