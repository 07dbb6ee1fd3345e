#pragma once
// Gradients that backward leaves partial on each tensor-parallel rank, made whole: replicated
// parameters used on sequence shards (sequence parallelism: norms, biases added after a
// reduce-scatter, position embeddings) are summed across the tp group, and key/value heads
// replicated over several ranks (grouped-query attention with fewer kv heads than tp) are
// summed across the ranks that share them. One coalesced all-reduce per group per step.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loom/parallel/tensor/shard_spec.h"
#include "loom/parallel/tensor/tp_group.h"

namespace loom::parallel::tensor {

class PartialGradSync {
 public:
  using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;
  // Collective over the tp group when replica groups are needed (they are split off here).
  PartialGradSync(const NamedParams& params, const std::map<std::string, ShardSpec>& specs,
                  TpGroupPtr tp);

  // Sums the partial gradients in place. Call after backward (and after the data-parallel
  // sync has finished writing them), once per optimizer step.
  void sync();
  // Where a gradient lives when it is not param.grad(): this rank's part of the flattened
  // gradient (a 1-D view, empty when it holds none) and the element it starts at. ZeRO keeps
  // only such a shard of each gradient (ZeroOptimizer::grad_shard_of).
  struct GradPiece {
    at::Tensor values;
    int64_t offset = 0;
  };
  using GradPieceFn = std::function<GradPiece(const std::string& name)>;
  // Sums the pieces `piece` returns instead of whole gradients. The ranks summing a parameter
  // must hold the same piece of it (same offset and length): checked on the first call over
  // the group, a loom::Error naming the parameter otherwise (the ZeRO buckets of the tp ranks
  // were laid out differently).
  void sync(const GradPieceFn& piece);
  // Parameters this touches (0: nothing to do, e.g. tp = 1).
  int64_t num_params() const;

 private:
  struct Group {
    dist::CommunicatorPtr comm;
    std::vector<std::string> names;
    std::vector<at::Tensor> params;
    bool pieces_checked = false;
  };
  // One coalesced all-reduce (sum) of `parts`, written back into them.
  static void sum_in_place(Group& group, const std::vector<at::Tensor>& parts);
  TpGroupPtr tp_;
  std::vector<Group> groups_;
};

}  // namespace loom::parallel::tensor
