#pragma once
// The block-sparse linear product on the CPU: a weight [out, in] of which only some B x B tiles
// are kept (a block-pruned weight, ops/sparsity.h) multiplies activations by its kept tiles
// alone, forward and backward, so the work falls with the sparsity. Each tile row's kept tiles
// sit side by side as one [B, k B] panel and multiply the matching column tiles of the
// token-major activations gathered into one [N, k B] block: one matrix product per tile row
// (per tile column for the input gradient), written straight into the output's columns, with
// no transposed copy of the activations.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace loom::ops {

// Which panels BlockSparseWeight::compress builds (the tile lists always): the forward reads the
// row panels, the input gradient the column panels.
struct BlockSparsePanels {
  bool row_panels = true;
  bool column_panels = true;
};

// A weight's kept tiles, in the two layouts the products read.
struct BlockSparseWeight {
  int64_t out = 0, in = 0, block = 0;
  // Per tile row r: the kept tiles' column indices, and their values side by side [B, k_r B].
  std::vector<std::vector<int64_t>> row_tiles;
  std::vector<at::Tensor> row_panels;
  // Per tile column c: the kept tiles' row indices, and their transposes side by side
  // [B, k_c B] (what the input gradient multiplies by).
  std::vector<std::vector<int64_t>> col_tiles;
  std::vector<at::Tensor> col_panels;

  // From a dense weight [out, in] and a bool tile mask [out/B, in/B]; both dimensions must
  // divide by `block` (loom::Error naming the shapes otherwise). Panels left out stay empty.
  static BlockSparseWeight compress(const at::Tensor& weight, const at::Tensor& tile_mask,
                                    int64_t block, BlockSparsePanels panels = {});
  int64_t kept_tiles() const;
  // The dense weight with the dropped tiles zero (from the row panels: compress must build them).
  at::Tensor to_dense() const;
};

// x [..., in] times the weight's transpose: [..., out], as at::linear(x, weight * mask) (bias
// none). Differentiable in x and in the dense weight; the weight's gradient is zero outside the
// kept tiles (a pruned tile gets no update). The tile mask is a bool [out/B, in/B].
at::Tensor block_sparse_linear(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& tile_mask, int64_t block);

}  // namespace loom::ops
