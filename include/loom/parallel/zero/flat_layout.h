#pragma once
// How a group of parameters lies in one flat buffer that is sharded across the data-parallel
// ranks: parameters back to back in the order given, the total padded up to a multiple of the
// number of ranks, rank r owning elements [r * shard, (r + 1) * shard). A parameter may straddle
// two shards; the segments say which part of which parameter a rank owns.
#include <cstdint>
#include <vector>

namespace loom::parallel::zero {

// The part of one parameter that falls in a rank's shard.
struct FlatSegment {
  size_t param = 0;          // index in the layout's parameter list
  int64_t param_offset = 0;  // first element of the parameter (flattened) in the shard
  int64_t shard_offset = 0;  // where it lies in the shard
  int64_t numel = 0;
};

class FlatLayout {
 public:
  FlatLayout() = default;
  // numels: element counts of the parameters, in buffer order. ranks >= 1.
  FlatLayout(std::vector<int64_t> numels, int64_t ranks);

  int64_t ranks() const { return ranks_; }
  size_t num_params() const { return numels_.size(); }
  int64_t numel(size_t param) const { return numels_.at(param); }
  int64_t offset(size_t param) const { return offsets_.at(param); }
  int64_t total() const { return total_; }                  // elements of all parameters
  int64_t padded_total() const { return shard_ * ranks_; }  // a multiple of ranks
  int64_t shard_numel() const { return shard_; }
  int64_t padding() const { return padded_total() - total_; }

  // The parameters' parts in rank `rank`'s shard, in buffer order.
  std::vector<FlatSegment> segments(int64_t rank) const;

 private:
  std::vector<int64_t> numels_, offsets_;
  int64_t ranks_ = 1, total_ = 0, shard_ = 0;
};

}  // namespace loom::parallel::zero
