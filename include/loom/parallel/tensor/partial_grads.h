#pragma once
// Gradients that backward leaves partial on each tensor-parallel rank, made whole: replicated
// parameters used on sequence shards (sequence parallelism: norms, biases added after a
// reduce-scatter, position embeddings) are summed across the tp group, and key/value heads
// replicated over several ranks (grouped-query attention with fewer kv heads than tp) are
// summed across the ranks that share them. One coalesced all-reduce per group per step.
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
  // Parameters this touches (0: nothing to do, e.g. tp = 1).
  int64_t num_params() const;

 private:
  struct Group {
    dist::CommunicatorPtr comm;
    std::vector<at::Tensor> params;
  };
  TpGroupPtr tp_;
  std::vector<Group> groups_;
};

}  // namespace loom::parallel::tensor
