#include "loom/ops/block_sparse.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "loom/core/error.h"

namespace loom::ops {

namespace {

std::string shape_of(const at::Tensor& t) {
  return fmt::format("[{}]", fmt::join(t.sizes(), ", "));
}

// Tiles `tiles` of the column tiles of a token-major a [N, T B], side by side: [N, k B]. One
// tile is a strided view the BLAS reads as it is; several are concatenated (measured faster
// than index_select along the tile dimension, which copies tile by tile through a slow path).
at::Tensor gather_column_tiles(const at::Tensor& a, const std::vector<int64_t>& tiles,
                               int64_t block) {
  if (tiles.size() == 1) return a.narrow(1, tiles[0] * block, block);
  std::vector<at::Tensor> parts;
  parts.reserve(tiles.size());
  for (const auto t : tiles) parts.push_back(a.narrow(1, t * block, block));
  return at::cat(parts, 1);
}

// out[:, tile i] = (the column tiles of `in` that tiles[i] names, side by side) . panels[i]^T,
// for every column tile i of out; in is [N, T_in B], panels[i] [B, k_i B], out [N, out_cols].
// Token-major throughout: no transposed copy of the activations, and each product is written
// straight into its columns of out (a strided matrix the BLAS writes in place).
at::Tensor panel_product(const std::vector<std::vector<int64_t>>& tiles,
                         const std::vector<at::Tensor>& panels, const at::Tensor& in,
                         int64_t out_cols, int64_t block) {
  auto out = at::empty({in.size(0), out_cols}, in.options());
  for (size_t i = 0; i < tiles.size(); ++i) {
    auto cols = out.narrow(1, static_cast<int64_t>(i) * block, block);
    if (tiles[i].empty()) {
      cols.zero_();
      continue;
    }
    at::mm_out(cols, gather_column_tiles(in, tiles[i], block), panels[i].t());
  }
  return out;
}

class BlockSparseLinearFn : public torch::autograd::Function<BlockSparseLinearFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const at::Tensor& tile_mask, int64_t block) {
    LOOM_CHECK(x.device().is_cpu() && weight.device().is_cpu(),
               "block_sparse_linear is the CPU product: input on {}, weight on {}",
               x.device().str(), weight.device().str());
    LOOM_CHECK(x.scalar_type() == weight.scalar_type(),
               "block_sparse_linear: input is {} and the weight {}; they must agree",
               c10::toString(x.scalar_type()), c10::toString(weight.scalar_type()));
    const auto w = BlockSparseWeight::compress(weight.detach(), tile_mask, block,
                                               {.row_panels = true, .column_panels = false});
    LOOM_CHECK(x.size(-1) == w.in,
               "block_sparse_linear: input {} does not end in the weight's {} input features",
               shape_of(x), w.in);
    const auto x2 = x.detach().reshape({-1, w.in}).contiguous();  // [N, in]
    const auto y = panel_product(w.row_tiles, w.row_panels, x2, w.out, block);
    ctx->save_for_backward({x2, weight, tile_mask});
    ctx->saved_data["block"] = block;
    auto sizes = x.sizes().vec();
    sizes.back() = w.out;
    return y.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x2 = saved[0];
    const auto& weight = saved[1];
    const int64_t block = ctx->saved_data["block"].toInt();
    const auto w = BlockSparseWeight::compress(
        weight.detach(), saved[2], block,
        {.row_panels = false, .column_panels = ctx->needs_input_grad(0)});
    const auto dy = grads[0].reshape({-1, w.out}).contiguous();  // [N, out]
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      auto sizes = grads[0].sizes().vec();
      sizes.back() = w.in;
      dx = panel_product(w.col_tiles, w.col_panels, dy, w.in, block).view(sizes);
    }
    if (ctx->needs_input_grad(1)) {
      // Each tile row's kept tiles' gradient at once: its columns of dy, transposed, times the
      // matching column tiles of x side by side ([B, N] . [N, k B], a sum over the tokens).
      dw = at::zeros_like(weight);
      for (size_t r = 0; r < w.row_tiles.size(); ++r) {
        const auto& cols = w.row_tiles[r];
        if (cols.empty()) continue;
        const auto panel = dy.narrow(1, static_cast<int64_t>(r) * block, block)
                               .t()
                               .mm(gather_column_tiles(x2, cols, block));
        auto rows = dw.narrow(0, static_cast<int64_t>(r) * block, block);
        for (size_t j = 0; j < cols.size(); ++j)
          rows.narrow(1, cols[j] * block, block)
              .copy_(panel.narrow(1, static_cast<int64_t>(j) * block, block));
      }
    }
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

BlockSparseWeight BlockSparseWeight::compress(const at::Tensor& weight, const at::Tensor& tile_mask,
                                              int64_t block, BlockSparsePanels panels) {
  LOOM_CHECK(block >= 1, "block-sparse weight: block size {} must be >= 1", block);
  LOOM_CHECK(weight.dim() == 2 && weight.size(0) % block == 0 && weight.size(1) % block == 0,
             "block-sparse weight: {} x {} tiles do not tile a weight of shape {}", block, block,
             shape_of(weight));
  BlockSparseWeight w;
  w.out = weight.size(0);
  w.in = weight.size(1);
  w.block = block;
  const int64_t rows = w.out / block, cols = w.in / block;
  LOOM_CHECK(tile_mask.dim() == 2 && tile_mask.size(0) == rows && tile_mask.size(1) == cols,
             "block-sparse weight: the tile mask is {}, and a {} weight in {} x {} tiles needs "
             "[{}, {}]",
             shape_of(tile_mask), shape_of(weight), block, block, rows, cols);
  const auto mask = tile_mask.to(at::kBool).cpu().contiguous();
  const auto m = mask.accessor<bool, 2>();
  w.row_tiles.resize(static_cast<size_t>(rows));
  w.col_tiles.resize(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (m[r][c]) {
        w.row_tiles[static_cast<size_t>(r)].push_back(c);
        w.col_tiles[static_cast<size_t>(c)].push_back(r);
      }
  const auto by_row = weight.contiguous().view({rows, block, cols, block});
  for (int64_t r = 0; panels.row_panels && r < rows; ++r) {
    const auto& kept = w.row_tiles[static_cast<size_t>(r)];
    if (kept.empty()) {
      w.row_panels.emplace_back();
      continue;
    }
    // [B, k, B] -> [B, k B]: tile j's columns at j B.
    w.row_panels.push_back(by_row[r]
                               .index_select(1, at::tensor(kept, at::kLong))
                               .reshape({block, static_cast<int64_t>(kept.size()) * block}));
  }
  for (int64_t c = 0; panels.column_panels && c < cols; ++c) {
    const auto& kept = w.col_tiles[static_cast<size_t>(c)];
    if (kept.empty()) {
      w.col_panels.emplace_back();
      continue;
    }
    // Tiles (r_j, c) as [k, B rows, B cols]; the panel holds their transposes side by side.
    const auto tiles = by_row.select(2, c).index_select(0, at::tensor(kept, at::kLong));
    w.col_panels.push_back(
        tiles.permute({2, 0, 1}).reshape({block, static_cast<int64_t>(kept.size()) * block}));
  }
  return w;
}

int64_t BlockSparseWeight::kept_tiles() const {
  int64_t n = 0;
  for (const auto& r : row_tiles) n += static_cast<int64_t>(r.size());
  return n;
}

at::Tensor BlockSparseWeight::to_dense() const {
  LOOM_CHECK(row_panels.size() == row_tiles.size(),
             "BlockSparseWeight::to_dense reads the row panels, which compress did not build");
  at::Tensor dense;
  for (const auto& p : row_panels)
    if (p.defined()) dense = at::zeros({out, in}, p.options());
  if (!dense.defined()) return at::zeros({out, in});
  for (size_t r = 0; r < row_tiles.size(); ++r)
    for (size_t j = 0; j < row_tiles[r].size(); ++j)
      dense.narrow(0, static_cast<int64_t>(r) * block, block)
          .narrow(1, row_tiles[r][j] * block, block)
          .copy_(row_panels[r].narrow(1, static_cast<int64_t>(j) * block, block));
  return dense;
}

at::Tensor block_sparse_linear(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& tile_mask, int64_t block) {
  return BlockSparseLinearFn::apply(x, weight, tile_mask, block);
}

}  // namespace loom::ops
