#pragma once
// The collectives of tensor (and sequence) parallelism as autograd functions: each names the
// boundary of a tensor-parallel region, does one collective forward and its dual backward.
// At tp = 1 every one of them returns its input unchanged and communicates nothing.
//
//   region entry (replicated input)      copy_to_tp_region            identity | all-reduce
//   region exit (partial sums)           reduce_from_tp_region        all-reduce | identity
//   entry, sequence parallel             gather_from_sequence_region  all-gather | reduce-scatter
//   exit, sequence parallel              reduce_scatter_to_sequence_region
//                                                                     reduce-scatter | all-gather
//   into sequence shards (no sum)        scatter_to_sequence_region   own chunk | all-gather
//   a sharded tensor made whole          gather_from_tp_region        all-gather | own chunk
//
// `dim` is the dimension split across the group (the sequence: 1 for [batch, seq, hidden]);
// its size must be divisible by tp where the op splits it. The group's stats() count the
// elements each op moves.
#include <ATen/core/Tensor.h>

#include "loom/parallel/tensor/tp_group.h"

namespace loom::parallel::tensor {

at::Tensor copy_to_tp_region(const at::Tensor& x, TpGroup& tp);
at::Tensor reduce_from_tp_region(const at::Tensor& x, TpGroup& tp);
at::Tensor gather_from_tp_region(const at::Tensor& x, TpGroup& tp, int64_t dim);
at::Tensor gather_from_sequence_region(const at::Tensor& x, TpGroup& tp, int64_t dim);
at::Tensor reduce_scatter_to_sequence_region(const at::Tensor& x, TpGroup& tp, int64_t dim);
at::Tensor scatter_to_sequence_region(const at::Tensor& x, TpGroup& tp, int64_t dim);

// Where a column-parallel layer's input enters its region: all-gathered along the sequence
// with sequence parallelism, else copied (replicated).
at::Tensor enter_tp_region(const at::Tensor& x, TpGroup& tp, int64_t seq_dim);
// Where a row-parallel layer's partial output leaves its region: reduce-scattered along the
// sequence with sequence parallelism, else all-reduced.
at::Tensor exit_tp_region(const at::Tensor& x, TpGroup& tp, int64_t seq_dim);

// Around layers that split features into whole blocks per rank (BlockDiagonalLinear): the
// input `x` (replicated [batch, seq, d], or with sequence parallelism this rank's sequence chunk)
// becomes this rank's 1/tp of the features over the whole sequence; without sequence
// parallelism its own chunk forward and an all-gather backward, with it an all-gather of the
// sequence forward (its reduce-scatter backward sums each rank's gradient of its own features).
at::Tensor enter_feature_blocks(const at::Tensor& x, TpGroup& tp, int64_t seq_dim);
// And back: this rank's features [batch, seq, d / tp] all-gathered into [batch, seq, d] (with
// sequence parallelism then cut to this rank's sequence chunk). Neither needs an all-reduce.
at::Tensor exit_feature_blocks(const at::Tensor& y, TpGroup& tp, int64_t seq_dim);

// The plain collectives the functions above are built from (no autograd), for layers that
// need them directly. Each returns a new tensor.
at::Tensor all_reduce_sum(const at::Tensor& x, TpGroup& tp);
at::Tensor all_gather_along(const at::Tensor& x, TpGroup& tp, int64_t dim);
at::Tensor reduce_scatter_along(const at::Tensor& x, TpGroup& tp, int64_t dim);
// This rank's 1/tp chunk of x along dim (a copy).
at::Tensor chunk_along(const at::Tensor& x, TpGroup& tp, int64_t dim);

}  // namespace loom::parallel::tensor
