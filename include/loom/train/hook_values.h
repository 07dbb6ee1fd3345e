#pragma once
// Communication hooks' per-value state carried across layouts: a resume with another tp, cp or
// pp size, other buckets or another ZeRO stage (CommHookState's third way, after restoring the
// same layout and resharding across numbers of dp ranks). Each rank's rank-state file records
// where its buckets' values sit in the model (HookValueLayout). On resume every old
// data-parallel group's state becomes per-value entries (CommHook::group_values), those become
// per-parameter totals over every copy the old layout had (HookValueTotals), and each new rank
// takes its share for its own buckets.
//
// The total of "owed" (or of a momentum) is what the whole run owes that parameter's gradient:
// copies whose gradients are summed after the reduction (tensor-parallel partial sums and shared
// key/value heads, context-parallel ranks, copies on several pipeline stages) add up,
// replicas that compute the same gradient count once, and a tensor-parallel shard goes to its
// place in the single-process parameter. Each copy in the new layout takes an equal share, so
// the copies add up to the total again. A kRms entry (a variance) does the same with its square
// roots.
#include <ATen/core/Tensor.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/tensor/shard_spec.h"

namespace loom::train {

struct HookValueLayout {
  std::string owner;  // the strategy whose entries they are ("data-parallel", "zero")
  std::string hook;   // its --comm-hook text
  // This rank's coordinates and the mesh's sizes.
  int64_t dp = 0, dp_size = 1, tp = 0, tp_size = 1, cp = 0, cp_size = 1, pp = 0, pp_size = 1;
  // Per model chunk, its buckets.
  std::vector<std::vector<parallel::data::BucketShape>> chunks;
  // Per parameter in them: how its pieces make up the single-process parameter.
  struct Param {
    parallel::tensor::ShardSpec spec;
    int64_t stages = 1;  // pipeline stages holding a copy of it (a tied embedding: 2)
  };
  std::map<std::string, Param> params;

  std::string to_json() const;
  // Throws loom::Error naming `source` and what is malformed.
  static HookValueLayout from_json(const std::string& text, const std::string& source);
};

class HookValueTotals {
 public:
  // Keeps only the parameters in `wanted` (those of this rank's new buckets; empty: every one);
  // `hook` gives each entry's ValueRule and builds the values (group_values).
  HookValueTotals(const parallel::data::CommHook& hook, std::set<std::string> wanted);
  // One old data-parallel group: values[c] is what group_values made of chunk c's state, and
  // `layout` any of the group's ranks' layouts. Throws loom::Error when an entry does not fit
  // its bucket or the layout's sizes differ from an earlier group's.
  void add_group(const HookValueLayout& layout,
                 const std::vector<std::map<std::string, at::Tensor>>& values);
  // Entries for this rank's buckets, chunk by chunk, in group_values' form: each parameter's
  // total split over its copies in `mine`. Throws loom::Error naming a parameter whose old pieces
  // do not make up the whole (a group missing, another model).
  std::vector<std::map<std::string, at::Tensor>> values_for(const HookValueLayout& mine) const;
  // Groups added.
  int64_t groups() const { return groups_; }
  // Every parameter's total by entry, in the single-process shape, fp64 (a kRms entry's square
  // roots). Throws as values_for.
  std::map<std::string, std::map<std::string, at::Tensor>> totals() const;

 private:
  struct Pieces {
    HookValueLayout::Param param;
    std::map<int64_t, at::Tensor> by_tp;  // summed over cp ranks and pipeline copies (fp64)
    std::map<int64_t, int64_t> added;     // how many, by tp rank
  };
  at::Tensor total(const std::string& what, const std::string& name, const Pieces& p) const;

  const parallel::data::CommHook* hook_;
  std::set<std::string> wanted_;
  std::map<std::string, std::map<std::string, Pieces>> pieces_;  // by entry, then parameter
  std::map<std::string, at::Tensor> scalars_;                    // entries without a bucket
  int64_t groups_ = 0, tp_size_ = 0, cp_size_ = 0;
};

struct CheckpointContents;

// Reads every old data-parallel group of `checkpoint` (the rank-state files that record their
// HookValueLayout; each group's files one at a time, in dp order) into totals for `wanted`
// through `hook`, which must be the --comm-hook `hook_text` they were saved with: groups() is 0
// when no file records a layout. Throws loom::Error naming what is missing or does not fit (a
// file for another hook, a group or rank whose file is missing).
HookValueTotals read_hook_values(const CheckpointContents& checkpoint,
                                 const parallel::data::CommHook& hook, const std::string& hook_text,
                                 std::set<std::string> wanted = {});

// The rank-state file metadata key holding a rank's HookValueLayout.
inline constexpr const char* kHookValueLayoutKey = "comm_hook.values";

}  // namespace loom::train
