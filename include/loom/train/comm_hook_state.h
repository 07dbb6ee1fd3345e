#pragma once
// Communication hooks' per-rank state (error feedback) in checkpoints, for the strategies that
// own hooks (data-parallel, zero). Each rank saves its hooks' tensors into its own rank-state
// file (rank_state_name) under "<prefix>/c<chunk>/", with the layout they belong to (the hook,
// the mesh, the buckets' sizes) and where its buckets' values sit in the model
// (HookValueLayout). On resume a rank restores them when the layout is the same. When only the
// number of data-parallel ranks changed (the owner gives a reshard key: everything but that
// number), each rank builds its state from every old rank of its group, file by file, by the
// hooks' reshard rules (parallel/data/comm_hook.h: StateResharder). When the layout changed
// otherwise (tp, cp or pp sizes, buckets, the ZeRO stage; the same --comm-hook), every old
// group's per-value state is carried per parameter to this rank's buckets (hook_values.h). Each
// way, what the run owes stays the same. When none applies (another hook, no file, a file that
// does not load) it warns and its hooks start at zero, and the run continues.
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "loom/core/safetensors.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/train/hook_values.h"

namespace loom::train {

struct CheckpointContents;
struct RunContext;

class CommHookState {
 public:
  // `prefix` names the owner in the file ("data-parallel"); hooks, one per model chunk.
  // `reduce_scatter`: the owner reduces its buckets with start_reduce_scatter where a hook
  // reduces_scatter() (ZeRO).
  CommHookState(std::string prefix, std::vector<std::shared_ptr<parallel::data::CommHook>> hooks,
                bool reduce_scatter = false);
  // Each chunk's buckets, as the owner lays them out.
  using Buckets = std::vector<std::vector<parallel::data::BucketShape>>;

  // Where the state may be resharded across numbers of data-parallel ranks: `key` names all the
  // layout but that number (the hook, the other dimensions with this rank's coordinates, the
  // buckets), `dp_rank` is this rank's place among its group of `dp_size`. An empty key: never.
  struct Reshard {
    std::string key;
    int64_t dp_rank = 0, dp_size = 1;
  };

  bool carries_state() const;
  // Whether a hook asks that this step's gradients not be clipped
  // (CommHook::exempt_from_clipping_this_step).
  bool exempts_step_from_clipping() const;
  // Adds this rank's hook tensors (on the host), `layout`, `reshard` and where `buckets` sit in
  // the model to a rank-state file's contents.
  void save(const RunContext& run, const std::string& layout, const Reshard& reshard,
            const Buckets& buckets, core::NamedTensors& tensors,
            std::map<std::string, std::string>& metadata) const;
  // Restores them from this rank's file of `checkpoint` when it was saved for `layout`, else
  // reshards them from the files saved under the same reshard key, else carries every old
  // group's values per parameter onto `buckets`; warns naming the reason when none can be done.
  // Every rank or none (collective over the world): when any rank's state restarts at zero,
  // every rank's does.
  void load(const RunContext& run, const CheckpointContents& checkpoint, const std::string& layout,
            const Reshard& reshard, const Buckets& buckets);

 private:
  // What load does on this rank: "" when the state was taken (restored, resharded or carried);
  // else why not, the hooks left empty.
  std::string take_state(const RunContext& run, const CheckpointContents& checkpoint,
                         const std::string& layout, const Reshard& reshard, const Buckets& buckets);
  // "" when restored; else why not. On a throw the hooks are left empty.
  std::string restore(const std::string& file, const std::string& layout);
  // From every file of `checkpoint` saved under `reshard.key`: how many old ranks they were (0:
  // none), or throws loom::Error (the hooks are then left empty).
  int64_t reshard_from(const CheckpointContents& checkpoint, const Reshard& reshard);
  // From every file of `checkpoint` that records its hook layout (HookValueLayout) for this
  // run's --comm-hook: how many old groups were carried onto `mine` (0: no file records one), or
  // throws loom::Error (the hooks are then left empty).
  int64_t carry_across_layouts(const CheckpointContents& checkpoint, const HookValueLayout& mine);
  HookValueLayout value_layout(const RunContext& run, const Buckets& buckets) const;

  std::string prefix_;
  std::vector<std::shared_ptr<parallel::data::CommHook>> hooks_;
  bool reduce_scatter_;
};

// The gradient reduction's figures in a metrics record, as both reducing strategies (data-parallel
// and zero) write them: `grad_sync_bytes` (what the hook's collectives sent this step) and, when
// anything was sent, `compression_ratio` (what fp32 collectives of the same buckets would have
// sent, divided by it).
void record_grad_sync(nlohmann::json& record, double bytes_sent, double fp32_bytes);

}  // namespace loom::train
