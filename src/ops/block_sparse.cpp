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

// out_T[rows of tile i] = panel_i . (the tiles of in_T that panel_i's tiles name, stacked), for
// every tile i of the output; in_T is [tiles_in * B, N], the result [tiles_out * B, N].
at::Tensor panel_product(const std::vector<std::vector<int64_t>>& tiles,
                         const std::vector<at::Tensor>& panels, const at::Tensor& in_t,
                         int64_t out_rows, int64_t block) {
  const int64_t n = in_t.size(1);
  auto out_t = at::zeros({out_rows, n}, in_t.options());
  const auto in_tiles = in_t.view({in_t.size(0) / block, block, n});
  for (size_t i = 0; i < tiles.size(); ++i) {
    if (tiles[i].empty()) continue;
    const auto index = at::tensor(tiles[i], at::kLong);
    const auto gathered =
        in_tiles.index_select(0, index).reshape({static_cast<int64_t>(tiles[i].size()) * block, n});
    auto rows = out_t.narrow(0, static_cast<int64_t>(i) * block, block);
    at::mm_out(rows, panels[i], gathered);
  }
  return out_t;
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
    const auto w = BlockSparseWeight::compress(weight.detach(), tile_mask, block);
    LOOM_CHECK(x.size(-1) == w.in,
               "block_sparse_linear: input {} does not end in the weight's {} input features",
               shape_of(x), w.in);
    const auto x_t = x.detach().reshape({-1, w.in}).t().contiguous();  // [in, N]
    const auto y_t = panel_product(w.row_tiles, w.row_panels, x_t, w.out, block);
    ctx->save_for_backward({x_t, weight, tile_mask});
    ctx->saved_data["block"] = block;
    auto sizes = x.sizes().vec();
    sizes.back() = w.out;
    return y_t.t().contiguous().view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x_t = saved[0];
    const auto& weight = saved[1];
    const int64_t block = ctx->saved_data["block"].toInt();
    const auto w = BlockSparseWeight::compress(weight.detach(), saved[2], block);
    const auto dy_t = grads[0].reshape({-1, w.out}).t().contiguous();  // [out, N]
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      const auto dx_t = panel_product(w.col_tiles, w.col_panels, dy_t, w.in, block);
      auto sizes = grads[0].sizes().vec();
      sizes.back() = w.in;
      dx = dx_t.t().contiguous().view(sizes);
    }
    if (ctx->needs_input_grad(1)) {
      // Each kept tile's gradient: its output rows of dy times its input rows of x.
      dw = at::zeros_like(weight);
      const int64_t n = x_t.size(1);
      const auto x_tiles = x_t.view({w.in / block, block, n});
      for (size_t r = 0; r < w.row_tiles.size(); ++r) {
        const auto& cols = w.row_tiles[r];
        if (cols.empty()) continue;
        const auto gathered = x_tiles.index_select(0, at::tensor(cols, at::kLong))
                                  .reshape({static_cast<int64_t>(cols.size()) * block, n});
        const auto panel = dy_t.narrow(0, static_cast<int64_t>(r) * block, block).mm(gathered.t());
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
                                              int64_t block) {
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
  for (int64_t r = 0; r < rows; ++r) {
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
  for (int64_t c = 0; c < cols; ++c) {
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
