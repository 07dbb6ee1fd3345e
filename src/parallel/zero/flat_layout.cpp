#include "loom/parallel/zero/flat_layout.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom::parallel::zero {

FlatLayout::FlatLayout(std::vector<int64_t> numels, int64_t ranks)
    : numels_(std::move(numels)), ranks_(ranks) {
  LOOM_CHECK(ranks_ >= 1, "a flat layout needs at least one rank; got {}", ranks_);
  offsets_.reserve(numels_.size());
  for (const int64_t n : numels_) {
    LOOM_CHECK(n >= 0, "a parameter cannot have {} elements", n);
    offsets_.push_back(total_);
    total_ += n;
  }
  shard_ = (total_ + ranks_ - 1) / ranks_;
}

std::vector<FlatSegment> FlatLayout::segments(int64_t rank) const {
  LOOM_CHECK(rank >= 0 && rank < ranks_, "rank {} is outside the layout's {} ranks", rank, ranks_);
  const int64_t begin = rank * shard_, end = begin + shard_;
  std::vector<FlatSegment> out;
  for (size_t i = 0; i < numels_.size(); ++i) {
    const int64_t lo = std::max(begin, offsets_[i]);
    const int64_t hi = std::min(end, offsets_[i] + numels_[i]);
    if (lo >= hi) continue;
    out.push_back({i, lo - offsets_[i], lo - begin, hi - lo});
  }
  return out;
}

}  // namespace loom::parallel::zero
