#pragma once
// ZeRO (Rajbhandari et al., 2020): data parallelism in which the dp ranks split the training
// state instead of replicating it. One object does the three things that must agree on the
// split: gradient synchronization, the AdamW step, and (stage 3) the parameters themselves.
//
//   stage 1  optimizer state (moments, fp32 masters) sharded; gradients reduce-scattered once
//            per step from a full local buffer; updated parameters all-gathered after the step.
//   stage 2  plus gradients: each bucket is reduce-scattered as soon as backward completes it
//            (every micro-batch) and the full gradients are freed; each rank keeps its shard.
//   stage 3  plus parameters: each rank keeps only its shard of every unit (a transformer
//            block, or any module wrapped in FullyShardedModule); run_unit all-gathers the unit
//            just before its forward and frees it after, all-gathers it again when its
//            gradient arrives in backward, and prefetches the next unit's gather so it overlaps
//            compute. Parameters outside every unit (embeddings, final norm) form the root unit,
//            gathered for the whole step.
//
// Memory per rank for Ψ parameters, N ranks, Adam (bytes): fp32 params 16Ψ → 8Ψ + 8Ψ/N →
// 4Ψ + 12Ψ/N → 16Ψ/N; bf16 params with fp32 masters 16Ψ → 4Ψ + 12Ψ/N → 2Ψ + 14Ψ/N → 16Ψ/N.
//
// Every bucket is one flat buffer padded to a multiple of N (FlatLayout); rank r owns the r-th
// slice. Parameters are views of the flat buffers, so the model's modules and names are
// untouched. In stage 3 a released unit's buffer has no storage: its parameters keep their
// shapes but must not be read outside run_unit (use gather_parameters()).
//
// Per step, on every rank of the dp group, in the same order:
//   for micro-batch k: set_sync(k == last); prepare_forward(); loss.backward();
//                      finish_gradient_sync();
//   norm = clip_grad_norm(max); step(lr); zero_grad();
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/safetensors.h"
#include "loom/dist/communicator.h"
#include "loom/ops/adamw.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/grad_ready_hooks.h"
#include "loom/parallel/zero/flat_layout.h"

namespace loom::parallel::zero {

struct ZeroOptions {
  int stage = 1;            // 1, 2 or 3
  double bucket_mb = 25.0;  // stages 1-2: parameters per flat bucket, in MiB of parameters
  ops::AdamWOptions adamw;
  // Which parameters get weight decay; null: those with two or more dimensions.
  std::function<bool(const std::string&, const at::Tensor&)> decays;
  // ZeRO-Offload: masters, moments and the AdamW step live on the host (pinned when the
  // parameters are on a GPU); each step copies the gradient shard there and the updated
  // parameter shard back.
  bool offload_optimizer = false;
  bool prefetch = true;  // stage 3: start the next unit's all-gather before this one computes
  // Parameters that get a flat bucket of their own, so that their gradient shard has the same
  // layout on every engine that holds them (a tied embedding's two copies on the first and last
  // pipeline stages, whose shards are summed; see own_bucket_grad_shard). At stage 3 each is a
  // unit of its own, gathered with the root (outside any block); a name a unit already holds
  // stays in that unit (its layout is the same wherever the unit is).
  std::vector<std::string> own_bucket;
  // Stage 3: release each unit's gathered parameters after its forward and after its backward
  // (true: the least memory), or keep them gathered until the step's last backward (false: one
  // all-gather per unit per step, however many micro-batches).
  bool reshard_after_forward = true;
  // Stages 2-3: gradients accumulate whole over the step's micro-batches and are reduce-scattered
  // once, in the backward of the last one (set_sync(true)); false: reduce-scattered after every
  // backward, so only shards are kept between micro-batches. ZeRO-3 over a pipeline uses true
  // (one reduction per step instead of one per micro-batch). The whole gradients held between
  // micro-batches are not in memory(): they show in the step's peak activations.
  bool reduce_once = false;
  // How much each parameter's squares count in the gradient norm (null: 1 each). With tensor
  // parallelism, 1 / (ranks holding the same values), so a norm summed over tp counts every
  // element once.
  std::function<double(const std::string&)> norm_weight;
  // How gradients are reduce-scattered (--comm-hook): null, a plain reduce-scatter average.
  // int8, onebit, topk and threshold compress each rank's shards, with error feedback kept per
  // bucket in the hook (parallel/data/quantized_hook.h, sparse_hook.h); any other hook reduces
  // the whole bucket its own way and the engine keeps its shard (CommHook::start_reduce_scatter).
  // A hook that reduces_once_per_step() needs reduce_once at stages 2-3 (the strategy sets it).
  std::shared_ptr<data::CommHook> hook;
};

// A group of parameters gathered together in stage 3 (by fully-qualified name).
struct ZeroUnit {
  std::string name;
  std::vector<std::string> params;
};

// Bytes this rank holds, by category, counted from the tensors' storages.
struct ZeroMemory {
  int64_t parameters = 0;  // stage 3: shards plus whatever units are gathered now
  int64_t gradients = 0;
  int64_t optimizer = 0;  // with offload_optimizer: held on the host
};

struct ZeroCommStats {
  double reduce_scatter_bytes = 0;  // gradients, per step (their size in the gradients' dtype)
  double grad_bytes_sent = 0;       // what this rank sent reducing them (dist::wire_bytes)
  double grad_fp32_bytes = 0;       // what fp32 reduce-scatters of them would send
  double all_gather_bytes = 0;      // parameters, per step
  double wait_seconds = 0;          // blocked on communication in finish_gradient_sync/step
  int64_t gathers = 0;              // stage 3 unit all-gathers issued
  int64_t prefetched = 0;           // of which issued ahead of need
};

class ZeroOptimizer {
 public:
  using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;

  // Takes over the parameters that require gradients: makes them views of flat buffers,
  // broadcasts rank 0's values (replicas start equal), shards the optimizer state and, at
  // stage 3, the parameters. `units` matter at stage 3 only. Collective over `comm`. Throws
  // loom::Error for a stage outside 1-3, a bucket size that is not positive, a unit naming a
  // parameter that does not exist or is in another unit, or a unit mixing dtypes.
  ZeroOptimizer(NamedParams params, dist::CommunicatorPtr comm, ZeroOptions options,
                std::vector<ZeroUnit> units = {});
  // Leaves stage-3 parameters released (no storage). Autograd graphs recorded through run_unit
  // refer to the engine: run their backward before destroying it.
  ~ZeroOptimizer();
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  int stage() const { return options_.stage; }
  const dist::Communicator& comm() const { return *comm_; }
  size_t num_buckets() const { return buckets_.size(); }
  // Bucket i's values: its parameters' (the same for any number of ranks), and padded to a
  // multiple of the ranks (what a communication hook reduces).
  int64_t bucket_params_numel(size_t i) const { return buckets_.at(i).layout.total(); }
  int64_t bucket_padded_numel(size_t i) const { return buckets_.at(i).layout.padded_total(); }
  // Bucket i's parameters as they lie in it (names, shapes, offsets; no padding).
  data::BucketShape bucket_shape(size_t i) const;
  int64_t num_params() const { return static_cast<int64_t>(params_.size()); }
  // The unit index for a unit name given at construction; throws loom::Error otherwise.
  size_t unit_index(const std::string& name) const;

  // Stage 3: gathers the root unit (a no-op when it is gathered, and at stages 1-2). Call before
  // each forward.
  void prepare_forward();
  // Runs `fn` (the unit's forward) with unit `unit`'s parameters gathered. Stages 1-2: just fn.
  at::Tensor run_unit(size_t unit, const std::function<at::Tensor()>& fn);
  // Stage 3: frees every gathered unit, the root included (after evaluation, say).
  void release_parameters();

  // Whether the next backward ends the step's last micro-batch. Stage 1 reduces gradients only
  // then; stages 2-3 reduce every micro-batch (full gradients never outlive one backward) and
  // free the root unit after the last.
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }
  // After every backward: reduces what backward did not (a parameter without a gradient counts
  // as zeros), waits, and adds the dp-average into this rank's gradient shards.
  void finish_gradient_sync();

  // The L2 norm of the whole (dp-averaged) gradient, from the shards in one all-reduce; scales
  // the shards by max_norm / (norm + 1e-6) when above max_norm > 0. Returns the norm before.
  double clip_grad_norm(double max_norm);
  // The two halves of clip_grad_norm, for a norm over more groups than dp (pipeline stages,
  // tensor-parallel shards): the squared norm of this engine's dp-averaged gradient, weighted
  // by norm_weight, summed over the dp group (one all-reduce); and scaling every shard.
  double grad_norm_squared();
  void scale_gradients(double factor);
  // This rank's shard of the dp-averaged gradient of a parameter named in own_bucket (after
  // finish_gradient_sync), to modify in place.
  at::Tensor own_bucket_grad_shard(const std::string& name);
  // This rank's part of any parameter's dp-averaged gradient (after finish_gradient_sync): a
  // 1-D view of its gradient shard, to modify in place (empty when the rank holds none of it),
  // and the element of the flattened parameter where it starts. What tensor parallelism needs
  // to sum gradients that are partial across tp ranks (PartialGradSync).
  std::pair<at::Tensor, int64_t> grad_shard_of(const std::string& name);
  // This rank's part of a parameter's values, to modify in place (between steps): at stage 3 a
  // 1-D view of its shard of the parameter (empty when the rank holds none of it) and the
  // element of the flattened parameter where it starts; at stages 1-2 the whole parameter,
  // flattened, from 0. What a strategy that edits weights after the step (pruning) writes to.
  std::pair<at::Tensor, int64_t> param_piece_of(const std::string& name);
  // One AdamW step on this rank's shards, then (stages 1-2) all-gathers the parameters.
  void step(double lr);
  // Zeros the gradient shards (and stage 1's full buffers).
  void zero_grad();
  int64_t steps_taken() const { return steps_; }
  int64_t num_decayed() const { return decayed_; }
  int64_t num_not_decayed() const { return num_params() - decayed_; }

  // Every parameter by name, whole (a collective at stage 3, where it all-gathers unit by unit
  // into new tensors; stages 1-2 return aliases of the live parameters). With `only_rank`, the
  // other ranks take part in the collectives but return an empty map and hold one unit at most.
  std::map<std::string, at::Tensor> gather_parameters(
      std::optional<int64_t> only_rank = std::nullopt);
  // The same, one bucket (at stage 3, one unit) at a time: `visit` is called with each
  // parameter, whole, and at stage 3 the unit's gathered buffer is freed once its parameters were
  // visited (unless `visit` keeps one): no rank holds more than one gathered unit. Collective at
  // stage 3; with `only_rank`, the other ranks take part in the collectives but visit nothing. A
  // `visit` that throws leaves the other ranks waiting in the next gather: catch inside it.
  void for_each_gathered_parameter(
      std::optional<int64_t> only_rank,
      const std::function<void(const std::string& name, const at::Tensor& value)>& visit);

  // This rank's shard of the optimizer state (moments, masters, step), for a checkpoint, and
  // what identifies the layout it belongs to.
  core::NamedTensors state() const;
  std::map<std::string, std::string> state_metadata() const;
  // Restores what state() returned on the same dp rank of the same layout. Throws loom::Error
  // naming `source` when the metadata shows another stage, dp size, rank or parameter layout,
  // or an entry is missing or misshapen.
  void load_state(const std::map<std::string, at::Tensor>& state,
                  const std::map<std::string, std::string>& metadata, const std::string& source);
  // Restores from whole per-parameter state instead (what assemble_zero_shards makes of the
  // shards of any layout, or a replicated AdamW's): "<name>.exp_avg", "<name>.exp_avg_sq" and
  // optionally "<name>.master", each with the parameter's elements; this rank takes its
  // segments. A missing or misshapen entry is a loom::Error naming `source`, raised before
  // anything is written.
  void load_param_state(const std::map<std::string, at::Tensor>& state, int64_t step,
                        const std::string& source);

  ZeroMemory memory() const;
  const ZeroCommStats& comm_stats() const { return stats_; }
  // Clears the counters (the trainer does at the start of each step).
  void reset_comm_stats() { stats_ = ZeroCommStats{}; }

 private:
  enum class Gathered { kNo, kInFlight, kYes };
  struct Bucket {
    std::string name;            // unit name (stage 3) or "bucket N"
    std::vector<size_t> params;  // indices into params_, in buffer order
    FlatLayout layout;
    at::Tensor full;         // flat, padded; the parameters are views of it
    at::Tensor param_shard;  // stage 3: this rank's parameters (else a view of full)
    at::Tensor full_grads;   // stage 1: flat gradient buffer the .grad views
    at::Tensor grad_shard;   // this rank's averaged gradient (stage 1: view of full_grads)
    // In ops::accumulation_dtype of the parameters (fp32; fp64 for fp64 parameters); master
    // when the parameters are narrower, or when offloaded.
    at::Tensor master, exp_avg, exp_avg_sq;
    // Offloaded from a GPU: pinned host memory the gradient shard is copied down into.
    at::Tensor host_grad;
    std::vector<FlatSegment> segments;
    std::vector<bool> segment_decays;
    std::vector<double> segment_norm_weights;  // empty: all 1
    // Per backward: gradients not yet complete.
    int64_t pending = 0;
    // Stage 3.
    Gathered gathered = Gathered::kYes;
    dist::WorkPtr gather_work;
  };
  struct InFlight {
    size_t bucket;
    dist::WorkPtr work;
    at::Tensor send, recv;
    bool compressed = false;  // through options_.hook (finish_reduce_scatter still to run)
    data::GradBucket hooked;  // what the hook reduces: `send` and the parameters in it
  };

  void on_grad_ready(size_t bucket, size_t slot);
  void compute_launch_order();
  // Launches, in launch order, every bucket whose gradients are complete and whose predecessors
  // have launched.
  void launch_ready();
  void launch_reduce(size_t bucket);
  // Adds finished reductions into the gradient shards and drops their buffers (all of them,
  // waiting, when `wait`).
  void retire(bool wait);
  // The segment of parameter `name` in this rank's `shard` of its bucket (grad_shard or
  // param_shard), and where it starts in the flattened parameter.
  std::pair<at::Tensor, int64_t> piece_of(const std::string& name, at::Tensor Bucket::*shard);
  at::Tensor shard_view(const Bucket& b, const at::Tensor& flat) const;
  at::Tensor param_view(const Bucket& b, size_t slot, const at::Tensor& flat) const;
  void gather(size_t bucket, bool prefetch);
  void wait_gathered(size_t bucket);
  void release(size_t bucket);
  // Starts gathering the unit at `position` + direction of the recorded forward order.
  void prefetch_after(int64_t position, int direction);
  // Gathered with the root unit and kept until the step's last backward (the root itself and
  // stage 3's own buckets).
  bool is_root(size_t bucket) const {
    return std::find(roots_.begin(), roots_.end(), bucket) != roots_.end();
  }
  friend struct PreBackwardGather;
  void pre_backward(size_t bucket);

  ZeroOptions options_;
  dist::CommunicatorPtr comm_;
  dist::CommunicatorPtr gather_comm_;  // stage 3: parameter gathers (else comm_)
  int64_t rank_ = 0, ranks_ = 1;
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<Bucket> buckets_;
  std::vector<std::optional<size_t>> bucket_of_unit_;  // per unit given; empty units: none
  std::vector<std::string> unit_names_;
  std::vector<size_t> roots_;
  GradReadyHooks hooks_;  // after the buckets: destroyed (unhooked) before them
  std::vector<InFlight> in_flight_;
  std::vector<size_t> launch_order_;  // buckets in the order their reductions are issued
  size_t next_launch_ = 0;
  bool warned_incomplete_ = false;
  // Stage 3: the order units ran in the first forward, and where this forward is in it.
  std::vector<size_t> forward_order_;
  size_t forward_pos_ = 0;
  bool order_recorded_ = false, order_broken_ = false;
  bool sync_ = true;
  int64_t steps_ = 0, decayed_ = 0;
  at::Device host_{at::kCPU};
  ZeroCommStats stats_;
};

}  // namespace loom::parallel::zero
