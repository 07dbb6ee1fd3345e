#pragma once
// How one parameter of a tensor-parallel model relates to the same parameter of the
// single-process model: which dimension is split, in which pieces, and who holds what. This is
// what makes "a sharded model equals the single-process model, slice by slice" checkable, and
// what initialization, checkpoints and exports use to go between the two.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::parallel::tensor {

struct ShardSpec {
  // The split dimension; -1: every rank holds the whole tensor (replicated).
  int64_t dim = -1;
  // Size of `dim` in the single-process model.
  int64_t full = 0;
  // Size of `dim` after padding (the vocabulary): rows [full, padded) are zeros that exist only
  // in the sharded layout. 0: no padding.
  int64_t padded = 0;
  // Fused projections (GPT-2's c_attn holds [q; k; v]) are split part by part, so each rank
  // holds its heads' q, k and v.
  int64_t parts = 1;
  // Indivisible units per part (attention heads); 0: every row is a unit. With fewer units
  // than tp ranks, each unit is held by tp / units ranks (grouped-query attention with fewer
  // key/value heads than ranks), whose gradients are partial and summed across those ranks.
  int64_t units = 0;
  // A replicated parameter used on a shard of the data (sequence parallelism: norms, biases
  // added after a reduce-scatter): each rank's gradient is partial, summed across tp.
  bool grad_partial = false;

  bool sharded() const { return dim >= 0; }
  int64_t padded_size() const { return padded > 0 ? padded : full; }
  // Ranks holding the same piece (1 unless units < tp).
  int64_t replicas(int64_t tp) const;
  // Rows of `dim` one rank holds.
  int64_t local_size(int64_t tp) const;
  // The single-process shape, given the shape a rank holds.
  std::vector<int64_t> full_shape(at::IntArrayRef local_shape) const;

  // Throws loom::Error, naming `what`, when tp cannot split the dimension this way.
  void check(int64_t tp, const std::string& what) const;

  // Rank `rank`'s piece of the single-process tensor (padded with zeros where needed).
  at::Tensor shard(const at::Tensor& full_tensor, int64_t rank, int64_t tp) const;
  // The single-process tensor, from every rank's piece (indexed by rank; padding dropped).
  at::Tensor unshard(const std::vector<at::Tensor>& pieces) const;

  std::string describe() const;
};

}  // namespace loom::parallel::tensor
