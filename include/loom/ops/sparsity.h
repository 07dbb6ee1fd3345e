#pragma once
// Magnitude pruning's arithmetic (Zhu & Gupta 2017, "To prune, or not to prune"): the cubic
// sparsity schedule, the mask patterns (unstructured, N of every M, whole blocks) and the exact
// k-th-largest threshold search that lets ranks holding pieces of one weight agree on a mask
// without gathering the weight. Pure tensor functions; the pruning strategy (train layer) decides
// what they apply to and sums the counts over the ranks that hold the pieces.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::ops {

struct SparsityPattern {
  enum class Kind { kUnstructured, kNofM, kBlock };
  Kind kind = Kind::kUnstructured;
  int64_t n = 0, m = 0;  // N of every M consecutive weights along a row are kept
  // N:Mt: also N of every M along a column, in each M x M block (so W^T is N:M too); M <= 4.
  bool transposable = false;
  int64_t block = 0;  // block x block tiles kept or dropped whole

  // "unstructured" | "N:M" (2:4, ...) | "N:Mt" (transposable, M <= 4) | "block:B"; anything else
  // is a loom::Error naming the value and the forms. N:M needs 1 <= N < M; B >= 1.
  static SparsityPattern parse(std::string_view text);
  std::string describe() const;  // as parse() reads it
  // The sparsity an N:M pattern fixes (1 - N/M); 0 for the others.
  double fixed_sparsity() const;
};

// s_t = s_f + (s_i - s_f) (1 - (t - t0) / (t1 - t0))^3 for t0 <= t <= t1 (s_i = 0 before t0,
// s_f after t1), masks updated every `every` steps from t0 and at t1.
struct PruneSchedule {
  double final_sparsity = 0;
  double initial_sparsity = 0;
  int64_t start = 0;  // t0: optimizer steps completed
  int64_t end = 0;    // t1
  int64_t every = 1;  // delta t

  // loom::Error naming the flag and the valid range: sparsities in [0, 1), start >= 0,
  // end >= start, every >= 1.
  void validate() const;
  double at(int64_t step) const;
  // Whether the masks are recomputed after step `step`: t0, t0 + every, ... up to t1, and t1.
  bool updates_at(int64_t step) const;
};

// Keeps the `n` largest magnitudes of every `m` consecutive elements along the last dimension
// (ties: the lower index); a bool tensor of w's shape. The last dimension must divide by m.
at::Tensor n_of_m_mask(const at::Tensor& w, int64_t n, int64_t m);

// Transposable N:M (Hubara et al. 2021): in each M x M block of a 2-D tensor, the mask with
// exactly N kept per row and per column whose kept magnitudes sum the most, so that both w and
// w^T are N:M along their rows. Exhaustive over every such block pattern (90 for 2:4), summed in
// a fixed order (the same mask on every rank and at any batch of blocks); ties: the first pattern
// in the order of their bits. Both dimensions must divide by M; M <= 4.
at::Tensor transposable_n_of_m_mask(const at::Tensor& w, int64_t n, int64_t m);

// The sum of |w| over each block x block tile of a 2-D tensor, in float64: [rows/B, cols/B].
// Both dimensions must divide by `block`.
at::Tensor block_scores(const at::Tensor& w, int64_t block);
// block_scores of one piece of a [rows, cols] tensor: `values` are its flattened elements
// [offset, offset + values.numel()) (a ZeRO-3 shard's segment, say), each |value| added to its
// tile's sum in float64; tiles outside the piece get 0. Pieces that cover the tensor sum to
// block_scores of the whole, up to the order of the additions.
at::Tensor block_scores_of_piece(const at::Tensor& values, int64_t offset, at::IntArrayRef shape,
                                 int64_t block);
// The elements [offset, offset + numel) of expand_block_mask(tile_mask, block).flatten(), for a
// [rows, cols] tensor, without spreading the whole mask.
at::Tensor block_mask_of_piece(const at::Tensor& tile_mask, int64_t offset, int64_t numel,
                               at::IntArrayRef shape, int64_t block);
// A per-tile bool mask [rows/B, cols/B] spread to [rows, cols].
at::Tensor expand_block_mask(const at::Tensor& tile_mask, int64_t block);

// Non-negative scores as int64 keys that order the same way (the IEEE bits of the float64
// value): what the threshold search compares, exactly, on every rank.
at::Tensor score_keys(const at::Tensor& scores);

// The k-th largest key of each of several scopes, found by bisection on the key range (64
// rounds, exact). `count_at_least(thresholds)` returns, for each scope, how many keys are >= its
// threshold, over every piece of the scope (a caller whose scopes are spread over ranks sums its
// local counts over them there). keep[s] <= 0 gives a threshold no key reaches; keep[s] at or
// above the scope's size gives 0 (every key). Keeping `key >= threshold` keeps keep[s] elements
// (more only where several equal the k-th largest).
using CountAtLeast = std::function<std::vector<int64_t>(const std::vector<int64_t>& thresholds)>;
std::vector<int64_t> kth_largest_keys(const std::vector<int64_t>& keep,
                                      const CountAtLeast& count_at_least);

}  // namespace loom::ops
