#include "loom/parallel/tensor/shard_spec.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "loom/core/error.h"
#include "loom/core/format.h"

namespace loom::parallel::tensor {

namespace {

// Rows of one part, and of one unit.
struct Geometry {
  int64_t part_rows, unit_rows, units;
};

Geometry geometry(const ShardSpec& s) {
  const int64_t part_rows = s.padded_size() / s.parts;
  const int64_t units = s.units > 0 ? s.units : part_rows;
  return {part_rows, part_rows / units, units};
}

// Where rank `rank`'s rows of each part start, and how many there are.
std::pair<int64_t, int64_t> rows_of(const ShardSpec& s, int64_t rank, int64_t tp) {
  const auto g = geometry(s);
  if (g.units >= tp) {
    const int64_t rows = g.units / tp * g.unit_rows;
    return {rank * rows, rows};
  }
  return {rank / (tp / g.units) * g.unit_rows, g.unit_rows};
}

}  // namespace

int64_t ShardSpec::replicas(int64_t tp) const {
  if (!sharded()) return tp;
  const auto g = geometry(*this);
  return g.units >= tp ? 1 : tp / g.units;
}

int64_t ShardSpec::local_size(int64_t tp) const {
  if (!sharded()) return full;
  return rows_of(*this, 0, tp).second * parts;
}

std::vector<int64_t> ShardSpec::full_shape(at::IntArrayRef local_shape) const {
  std::vector<int64_t> out(local_shape.begin(), local_shape.end());
  if (sharded()) out.at(static_cast<size_t>(dim)) = full;
  return out;
}

void ShardSpec::check(int64_t tp, const std::string& what) const {
  if (!sharded()) return;
  LOOM_CHECK(full > 0 && padded_size() >= full && parts >= 1 && padded_size() % parts == 0,
             "{}: invalid shard layout {}", what, describe());
  LOOM_CHECK(padded == 0 || parts == 1, "{}: a padded dimension cannot be fused ({})", what,
             describe());
  const auto g = geometry(*this);
  LOOM_CHECK(g.units > 0 && g.part_rows % g.units == 0,
             "{}: {} rows per part do not split into {} units", what, g.part_rows, g.units);
  if (g.units >= tp)
    LOOM_CHECK(g.units % tp == 0,
               "{}: {} units (heads or rows) cannot be split evenly across tp = {} ranks", what,
               g.units, tp);
  else
    LOOM_CHECK(tp % g.units == 0,
               "{}: {} units (heads) can be neither split across nor replicated over tp = {} ranks "
               "(one of the two must divide the other)",
               what, g.units, tp);
}

at::Tensor ShardSpec::shard(const at::Tensor& full_tensor, int64_t rank, int64_t tp) const {
  if (!sharded() || (tp == 1 && padded_size() == full)) return full_tensor.contiguous();
  LOOM_CHECK(rank >= 0 && rank < tp, "shard: rank {} is not in [0, tp = {})", rank, tp);
  LOOM_CHECK(full_tensor.dim() > dim && full_tensor.size(dim) == full,
             "cannot shard a tensor of shape {} along dim {}: expected size {} ({})",
             full_tensor.sizes(), dim, full, describe());
  auto t = full_tensor;
  if (padded_size() > full) {
    auto pad_shape = t.sizes().vec();
    pad_shape[static_cast<size_t>(dim)] = padded_size() - full;
    t = at::cat({t, at::zeros(pad_shape, t.options())}, dim);
  }
  const auto g = geometry(*this);
  const auto [start, rows] = rows_of(*this, rank, tp);
  std::vector<at::Tensor> pieces;
  for (int64_t p = 0; p < parts; ++p)
    pieces.push_back(t.narrow(dim, p * g.part_rows + start, rows));
  return (pieces.size() == 1 ? pieces[0] : at::cat(pieces, dim)).contiguous();
}

at::Tensor ShardSpec::unshard(const std::vector<at::Tensor>& pieces) const {
  LOOM_CHECK(!pieces.empty(), "unshard: no pieces");
  const auto tp = static_cast<int64_t>(pieces.size());
  if (!sharded()) return pieces[0];
  const int64_t reps = replicas(tp);
  const int64_t rows = local_size(tp) / parts;
  for (const auto& piece : pieces)
    LOOM_CHECK(piece.dim() > dim && piece.size(dim) == local_size(tp),
               "unshard: a piece of shape {} does not hold {} rows along dim {} ({} over tp = {})",
               piece.sizes(), local_size(tp), dim, describe(), tp);
  std::vector<at::Tensor> out;
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t r = 0; r < tp; r += reps)
      out.push_back(pieces[static_cast<size_t>(r)].narrow(dim, p * rows, rows));
  auto whole = at::cat(out, dim);
  return whole.narrow(dim, 0, full).contiguous();
}

std::string ShardSpec::describe() const {
  if (!sharded()) return grad_partial ? "replicated (partial gradients)" : "replicated";
  std::string s = fmt::format("split along dim {} of size {}", dim, full);
  if (padded > full) s += fmt::format(" padded to {}", padded);
  if (parts > 1) s += fmt::format(" in {} fused parts", parts);
  if (units > 0) s += fmt::format(" by {} units", units);
  return s;
}

}  // namespace loom::parallel::tensor
