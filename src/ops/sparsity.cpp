#include "loom/ops/sparsity.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <vector>

#include "loom/core/error.h"

namespace loom::ops {

namespace {

bool parse_int(std::string_view text, int64_t& out) {
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end && !text.empty();
}

// Above every key: the bits of +inf plus one (NaN scores are refused before they get here).
constexpr int64_t kAboveEveryKey = 0x7FF0000000000001LL;

}  // namespace

SparsityPattern SparsityPattern::parse(std::string_view text) {
  SparsityPattern p;
  const auto bad = [&] {
    return fmt::format(
        "--prune-pattern '{}' is not valid: unstructured, N:M (keep N of every M consecutive "
        "weights of a row, 1 <= N < M, e.g. 2:4), N:Mt (transposable: N of M along rows and "
        "columns, M <= 4, e.g. 2:4t) or block:B (B x B tiles, B >= 1)",
        text);
  };
  if (text == "unstructured") return p;
  if (text.starts_with("block:")) {
    p.kind = Kind::kBlock;
    LOOM_CHECK(parse_int(text.substr(6), p.block) && p.block >= 1, "{}", bad());
    return p;
  }
  const auto colon = text.find(':');
  LOOM_CHECK(colon != std::string_view::npos, "{}", bad());
  p.kind = Kind::kNofM;
  auto m_text = text.substr(colon + 1);
  if (m_text.ends_with('t')) {
    p.transposable = true;
    m_text.remove_suffix(1);
  }
  LOOM_CHECK(parse_int(text.substr(0, colon), p.n) && parse_int(m_text, p.m), "{}", bad());
  LOOM_CHECK(p.n >= 1 && p.n < p.m,
             "--prune-pattern '{}': N:M keeps N of every M weights and needs 1 <= N < M (N {} and "
             "M {})",
             text, p.n, p.m);
  LOOM_CHECK(!p.transposable || p.m <= 4,
             "--prune-pattern '{}': a transposable N:M pattern is searched exhaustively over M x M "
             "blocks, which needs M <= 4 (M {})",
             text, p.m);
  return p;
}

std::string SparsityPattern::describe() const {
  switch (kind) {
    case Kind::kUnstructured:
      return "unstructured";
    case Kind::kNofM:
      return fmt::format("{}:{}{}", n, m, transposable ? "t" : "");
    case Kind::kBlock:
      return fmt::format("block:{}", block);
  }
  return "?";
}

double SparsityPattern::fixed_sparsity() const {
  return kind == Kind::kNofM ? 1.0 - static_cast<double>(n) / static_cast<double>(m) : 0.0;
}

void PruneSchedule::validate() const {
  LOOM_CHECK(final_sparsity >= 0 && final_sparsity < 1,
             "--prune-to {} is not a sparsity: it must be in [0, 1)", final_sparsity);
  LOOM_CHECK(initial_sparsity >= 0 && initial_sparsity <= final_sparsity,
             "the initial sparsity {} must be in [0, --prune-to {}]", initial_sparsity,
             final_sparsity);
  LOOM_CHECK(start >= 0, "--prune-start {} must be >= 0 (optimizer steps completed)", start);
  LOOM_CHECK(end >= start,
             "--prune-end {} is before --prune-start {}: the final step of the "
             "schedule must be at or after its start",
             end, start);
  LOOM_CHECK(every >= 1, "--prune-every {} must be >= 1 (steps between mask updates)", every);
}

double PruneSchedule::at(int64_t step) const {
  if (step < start) return 0.0;
  if (step >= end) return final_sparsity;
  const double progress = static_cast<double>(step - start) / static_cast<double>(end - start);
  const double left = 1.0 - progress;
  return final_sparsity + (initial_sparsity - final_sparsity) * left * left * left;
}

bool PruneSchedule::updates_at(int64_t step) const {
  if (step < start || step > end) return false;
  return step == end || (step - start) % every == 0;
}

at::Tensor n_of_m_mask(const at::Tensor& w, int64_t n, int64_t m) {
  LOOM_CHECK(w.dim() >= 1 && w.size(-1) % m == 0,
             "an N:M mask groups the last dimension by M = {}: a tensor of shape {} does not "
             "divide",
             m, fmt::format("[{}]", fmt::join(w.sizes(), ", ")));
  const auto groups = w.detach().abs().reshape({-1, m});
  // topk keeps the lower index among equal values only with a stable sort: sort instead.
  const auto order = std::get<1>(groups.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true));
  auto keep = at::zeros_like(groups, groups.options().dtype(at::kBool));
  keep.scatter_(1, order.narrow(1, 0, n), true);
  return keep.reshape(w.sizes());
}

at::Tensor transposable_n_of_m_mask(const at::Tensor& w, int64_t n, int64_t m) {
  LOOM_CHECK(m >= 1 && m <= 4 && n >= 1 && n < m,
             "a transposable N:M mask needs 1 <= N < M <= 4; got {}:{}", n, m);
  LOOM_CHECK(w.dim() == 2 && w.size(0) % m == 0 && w.size(1) % m == 0,
             "a transposable N:M mask tiles a 2-D weight by {} x {}: shape {} does not divide", m,
             m, fmt::format("[{}]", fmt::join(w.sizes(), ", ")));
  // Every m x m pattern with n ones per row and per column, as the positions it keeps.
  std::vector<int64_t> positions;
  int64_t patterns = 0;
  for (uint32_t bits = 0; bits < (1u << (m * m)); ++bits) {
    bool ok = true;
    for (int64_t i = 0; i < m && ok; ++i) {
      int64_t row = 0, col = 0;
      for (int64_t j = 0; j < m; ++j) {
        row += (bits >> (i * m + j)) & 1u;
        col += (bits >> (j * m + i)) & 1u;
      }
      ok = row == n && col == n;
    }
    if (!ok) continue;
    for (int64_t k = 0; k < m * m; ++k)
      if ((bits >> k) & 1u) positions.push_back(k);
    ++patterns;
  }
  const auto index = at::tensor(positions, at::kLong).view({patterns, n * m});
  const int64_t r = w.size(0) / m, c = w.size(1) / m;
  const auto blocks = w.detach()
                          .abs()
                          .to(at::kDouble)
                          .cpu()
                          .reshape({r, m, c, m})
                          .permute({0, 2, 1, 3})
                          .reshape({r * c, m * m});
  auto best = at::empty({r * c}, at::kLong);
  // In chunks (the scores are blocks x patterns), each score a sum in the pattern's position
  // order: elementwise adds, so the same on every rank whatever the chunk.
  constexpr int64_t kChunk = 16384;
  for (int64_t first = 0; first < r * c; first += kChunk) {
    const auto part = blocks.narrow(0, first, std::min(kChunk, r * c - first));
    auto score = at::zeros({part.size(0), patterns}, at::kDouble);
    for (int64_t j = 0; j < n * m; ++j) score += part.index_select(1, index.select(1, j));
    best.narrow(0, first, part.size(0)).copy_(score.argmax(1));  // the first of equal maxima
  }
  auto keep = at::zeros({r * c, m * m}, at::kBool);
  keep.scatter_(1, index.index_select(0, best), true);
  return keep.reshape({r, c, m, m}).permute({0, 2, 1, 3}).reshape(w.sizes()).to(w.device());
}

at::Tensor block_scores(const at::Tensor& w, int64_t block) {
  LOOM_CHECK(w.dim() == 2 && w.size(0) % block == 0 && w.size(1) % block == 0,
             "a block mask tiles a 2-D weight by {} x {}: shape {} does not divide", block, block,
             fmt::format("[{}]", fmt::join(w.sizes(), ", ")));
  const int64_t r = w.size(0) / block, c = w.size(1) / block;
  return w.detach().abs().to(at::kDouble).reshape({r, block, c, block}).sum(at::IntArrayRef{1, 3});
}

namespace {

// The tile (row-major over [rows/B, cols/B]) of each element [offset, offset + numel) of a
// flattened [rows, cols] tensor.
at::Tensor piece_tiles(int64_t offset, int64_t numel, at::IntArrayRef shape, int64_t block,
                       const at::Device& device) {
  LOOM_CHECK(shape.size() == 2 && shape[0] % block == 0 && shape[1] % block == 0,
             "a block mask tiles a 2-D weight by {} x {}: shape {} does not divide", block, block,
             fmt::format("[{}]", fmt::join(shape, ", ")));
  LOOM_CHECK(offset >= 0 && numel >= 0 && offset + numel <= shape[0] * shape[1],
             "a piece of elements [{}, {}) is outside a weight of {} elements", offset,
             offset + numel, shape[0] * shape[1]);
  const auto index =
      at::arange(offset, offset + numel, at::TensorOptions(at::kLong).device(device));
  const auto rows = at::floor_divide(index, shape[1]), cols = at::remainder(index, shape[1]);
  return at::floor_divide(rows, block) * (shape[1] / block) + at::floor_divide(cols, block);
}

}  // namespace

// The pieces are walked in chunks of this many elements, so the tile indices and float64 copies
// a chunk needs stay small next to the piece (a ZeRO-3 shard holds only its piece).
constexpr int64_t kPieceChunk = int64_t{1} << 20;

at::Tensor block_scores_of_piece(const at::Tensor& values, int64_t offset, at::IntArrayRef shape,
                                 int64_t block) {
  const auto flat = values.detach().reshape({-1});
  piece_tiles(offset, 0, shape, block, flat.device());  // checks the shape for an empty piece
  auto scores =
      at::zeros({shape[0] / block * (shape[1] / block)}, flat.options().dtype(at::kDouble));
  for (int64_t at = 0; at < flat.numel(); at += kPieceChunk) {
    const int64_t n = std::min(kPieceChunk, flat.numel() - at);
    scores.index_add_(0, piece_tiles(offset + at, n, shape, block, flat.device()),
                      flat.narrow(0, at, n).to(at::kDouble).abs());
  }
  return scores.reshape({shape[0] / block, shape[1] / block});
}

at::Tensor block_mask_of_piece(const at::Tensor& tile_mask, int64_t offset, int64_t numel,
                               at::IntArrayRef shape, int64_t block) {
  const auto tiles = tile_mask.reshape({-1});
  auto mask = at::empty({numel}, tiles.options());
  for (int64_t at = 0; at < numel; at += kPieceChunk) {
    const int64_t n = std::min(kPieceChunk, numel - at);
    mask.narrow(0, at, n).copy_(
        tiles.index_select(0, piece_tiles(offset + at, n, shape, block, tiles.device())));
  }
  if (numel == 0) piece_tiles(offset, 0, shape, block, tiles.device());  // the checks
  return mask;
}

at::Tensor expand_block_mask(const at::Tensor& tile_mask, int64_t block) {
  const int64_t r = tile_mask.size(0), c = tile_mask.size(1);
  return tile_mask.reshape({r, 1, c, 1})
      .expand({r, block, c, block})
      .reshape({r * block, c * block});
}

at::Tensor score_keys(const at::Tensor& scores) {
  const auto s = scores.detach().to(at::kDouble).contiguous();
  LOOM_CHECK(!at::isnan(s).any().item<bool>(), "pruning scores must not be NaN");
  // Non-negative IEEE doubles order as their bit patterns do; -0.0 becomes +0.0 first.
  return (s.abs() + 0.0).view(at::kLong);
}

std::vector<int64_t> kth_largest_keys(const std::vector<int64_t>& keep,
                                      const CountAtLeast& count_at_least) {
  const size_t scopes = keep.size();
  std::vector<int64_t> lo(scopes, 0), hi(scopes, kAboveEveryKey);
  // Invariant: count(lo) >= keep > count(hi). Keys are >= 0, so count(0) is the scope's size.
  const auto totals = count_at_least(lo);
  LOOM_CHECK(totals.size() == scopes, "threshold search: {} counts for {} scopes", totals.size(),
             scopes);
  std::vector<bool> done(scopes);
  for (size_t s = 0; s < scopes; ++s) {
    if (keep[s] <= 0) {
      lo[s] = kAboveEveryKey;  // nothing reaches it
      done[s] = true;
    } else if (keep[s] >= totals[s]) {
      done[s] = true;  // 0: every key
    }
  }
  for (int round = 0; round < 64; ++round) {
    bool any = false;
    std::vector<int64_t> mid(scopes);
    for (size_t s = 0; s < scopes; ++s) {
      const bool open = !done[s] && hi[s] - lo[s] > 1;
      mid[s] = open ? lo[s] + (hi[s] - lo[s]) / 2 : lo[s];
      any = any || open;
    }
    if (!any) break;  // every rank sees the same counts, so every rank stops in the same round
    const auto counts = count_at_least(mid);
    for (size_t s = 0; s < scopes; ++s) {
      if (done[s] || hi[s] - lo[s] <= 1) continue;
      (counts[s] >= keep[s] ? lo[s] : hi[s]) = mid[s];
    }
  }
  return lo;
}

}  // namespace loom::ops
