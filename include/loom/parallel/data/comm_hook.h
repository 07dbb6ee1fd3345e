#pragma once
// How a gradient bucket is reduced across data-parallel ranks. The default averages it with an
// all-reduce; a hook can compress it first (bf16 halves the bytes sent; int8 quarters them and
// onebit sends a bit per value: quantized_hook.h; topk and threshold send a small fraction of the
// values: sparse_hook.h; powersgd sends low-rank factors: powersgd_hook.h), which is where
// communication compression plugs in. The communicator counts the bytes each hook sends
// (docs/compression.md).
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "loom/core/option_spec.h"
#include "loom/dist/communicator.h"
#include "loom/ops/adamw.h"
#include "loom/parallel/data/grad_bucket.h"

namespace loom::parallel::data {

// How one state() entry is carried over when a checkpoint resumes with another number of
// data-parallel ranks on the same buckets (CommHook::reshard_rule, StateResharder). What the run
// owes, the mean of the ranks' carried errors plus what the group carries once, stays the same.
enum class StateReshard {
  kMean,    // a rank's own carried error: every new rank gets the old ranks' mean
  kFirst,   // held alike by every rank (a warm start, a momentum, a step count): the first's
  kConcat,  // one piece per rank of what the group holds once: the pieces joined in dp order
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual std::string name() const = 0;
  // Starts reducing `bucket.buffer` across `comm` and returns the work in flight. Called during
  // backward, on the thread running it; must not block on the communication.
  virtual dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) = 0;
  // After that work completed: leave the mean over ranks of every rank's buffer in
  // `bucket.buffer`.
  virtual void finish(GradBucket& bucket, dist::Communicator& comm) {}
  // Called by the strategy that owns the hook before each optimizer step's reductions, with the
  // number of optimizer steps completed (the same on every rank; restored by a resume). A step
  // may reduce a bucket more than once (ZeRO-2/3 reduce every micro-batch).
  virtual void begin_step(int64_t /*steps_completed*/) {}
  // Whether it carries state from step to step (error feedback): training state, which
  // checkpoints hold per rank (state / load_state).
  virtual bool carries_state() const { return false; }
  // This rank's state by name (bucket by bucket), for a checkpoint; empty for a stateless hook.
  virtual std::map<std::string, at::Tensor> state() const { return {}; }
  // Restores what state() returned, on the same buckets and ranks. Throws loom::Error naming
  // the tensor when one does not fit.
  virtual void load_state(const std::map<std::string, at::Tensor>& /*state*/) {}
  // How entry `key` of state() is resharded: "b<i>/error" kMean, anything else kFirst.
  virtual StateReshard reshard_rule(const std::string& key) const;
  // Restores a state resharded from another number of ranks (StateResharder: kConcat entries
  // hold every old rank's piece). The default: load_state, for hooks whose state does not depend
  // on the number of ranks.
  virtual void load_resharded_state(const std::map<std::string, at::Tensor>& state) {
    load_state(state);
  }
  // After load_resharded_state, for each bucket (its index and size) as this rank (of `ranks`)
  // will reduce it: lays the state out for it now, so that a checkpoint written before the next
  // reduction holds it. The default: nothing to do.
  virtual void lay_out_resharded(int64_t /*index*/, int64_t /*numel*/, int64_t /*rank*/,
                                 int64_t /*ranks*/) {}

  // Resharding across layouts (another tp, cp or pp size, other buckets, another ZeRO stage;
  // train/hook_values.h), where a bucket's values no longer line up with the old ones: per-value
  // state is carried per parameter. From `group`, the StateResharder result over every rank of
  // one old data-parallel group, and the shapes of that group's buckets, returns entries
  // "b<index>/<what>" holding one value per parameter value of the bucket (in bucket order, no
  // padding): "owed", what the group still owes the gradient (its ranks' mean carried error plus
  // what it carries once), and for a momentum compression "momentum" and "variance". Entries
  // without a bucket prefix are scalars held alike ("variance_steps"). Anything else (a warm
  // start, a threshold, a step count) is not carried: it starts afresh. The default: {} (a hook
  // that does not say how its state maps onto values restarts it at zero, with a warning).
  virtual std::map<std::string, at::Tensor> group_values(
      const std::map<std::string, at::Tensor>& /*group*/,
      const std::map<int64_t, BucketShape>& /*buckets*/) const {
    return {};
  }
  // How entry <what> of group_values combines over copies of a parameter whose gradients are
  // summed after the reduction (tensor-parallel partial sums, context-parallel ranks, a tied
  // embedding's pipeline stages) and splits over the new ones: kSum for what is linear in the
  // gradient ("owed", "momentum"), kRms for a mean square ("variance": its square roots add).
  enum class ValueRule { kSum, kRms };
  virtual ValueRule value_rule(const std::string& /*what*/) const { return ValueRule::kSum; }
  // Takes group_values entries built for this rank's buckets (every rank of a dp group alike:
  // each carries the whole of what is owed, so their mean is it), replacing any state; laid out
  // by lay_out_resharded as a reshard across numbers of ranks is. `reduce_scatter`: the buckets
  // are ZeRO's, reduced by start_reduce_scatter where the hook reduces_scatter(). The default
  // takes only an empty map: given bucket entries it throws loom::Error (a hook that makes
  // values must also take them, or its state would be dropped while reported carried).
  virtual void load_group_values(const std::map<std::string, at::Tensor>& values,
                                 bool reduce_scatter);

  // ZeRO's gradient reduction (parallel/zero): `bucket.buffer` holds comm.size() equal shards in
  // rank order (the parameters' gradients at bucket.offsets, zeros after the last); once the work
  // is done and finish_reduce_scatter has run, `recv` (one shard, the buffer's dtype) holds the
  // mean over ranks of every rank's shard comm.rank(). The default runs the hook's own reduction
  // (start, finish) on the whole bucket and keeps this rank's shard: any hook serves ZeRO, at the
  // bytes of its all-reduce. Hooks whose reduces_scatter() is true reduce the shard layout itself
  // (avg, int8, onebit, topk, threshold): a reduce-scatter's bytes, compressed. Their
  // finish_reduce_scatter must not communicate: ZeRO runs it when it finds the work complete,
  // which is not at the same point on every rank (the default's finish runs after backward, in
  // launch order).
  virtual bool reduces_scatter() const { return false; }
  virtual dist::WorkPtr start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                             dist::Communicator& comm);
  virtual void finish_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                     dist::Communicator& comm);
  // Whether the hook must see each optimizer step's gradient once, whole (a momentum compression:
  // its reduction is a momentum update). ZeRO-2/3 then accumulate the micro-batches' gradients
  // and reduce once per step instead of after every backward.
  virtual bool reduces_once_per_step() const { return false; }
  // Whether the reductions started in this step (after begin_step) deliver the exact average
  // (avg; any hook's dense warm-up). MomentumCompressionHook learns its preconditioner from them.
  virtual bool reduces_exactly_this_step() const { return false; }
  // Whether the gradients this step's reductions return are not to be clipped by their global
  // norm (MomentumCompressionHook's preconditioned steps: that norm measures mostly compression
  // noise). Asked after the step's reductions finished.
  virtual bool exempt_from_clipping_this_step() const { return false; }
};

// Builds one new rank's hook state from every old rank's state() (added in dp order, one at a
// time, so a checkpoint's files are read one by one), by `hook`'s reshard_rule. kMean entries are
// summed in fp64 and divided once; kConcat pieces joined along their first dimension.
class StateResharder {
 public:
  explicit StateResharder(const CommHook& hook) : hook_(hook) {}
  // Throws loom::Error naming the entry when this rank's entries or a kMean entry's shape differ
  // from the first rank's.
  void add(const std::map<std::string, at::Tensor>& rank_state);
  int64_t ranks() const { return ranks_; }
  std::map<std::string, at::Tensor> result() const;

 private:
  const CommHook& hook_;
  int64_t ranks_ = 0;
  std::map<std::string, at::Tensor> first_;                // kFirst, and kMean's fp64 sums
  std::map<std::string, std::vector<at::Tensor>> pieces_;  // kConcat
  std::map<std::string, at::ScalarType> mean_dtypes_;      // kMean entries' own dtypes
};

// A hook's per-bucket state keys: "b<index>/<what>" ("b3/error").
std::string bucket_state_key(int64_t index, const std::string& what);
// The bucket index of a "b<index>/<what>" key; nullopt for any other key.
std::optional<int64_t> bucket_of_key(const std::string& key, std::string_view what);

// The first `numel` values of a 1-D state entry, as a float32 tensor of their own (what
// group_values hands on); loom::Error naming the hook, the bucket `index` and `what` when the
// entry is not 1-D or holds fewer values.
at::Tensor leading_values(const at::Tensor& entry, int64_t numel, const std::string& hook,
                          int64_t index, std::string_view what);

// The "b<index>/owed" entries of load_group_values' `values`, by bucket index, each as a float32
// tensor of its own (what the error-feedback hooks take back as their carried error).
std::map<int64_t, at::Tensor> owed_by_bucket(const std::map<std::string, at::Tensor>& values);

// All-reduce average in the gradients' own dtype.
class AllReduceAvgHook : public CommHook {
 public:
  std::string name() const override { return "avg"; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  bool reduces_exactly_this_step() const override { return true; }
  // A plain reduce-scatter average in the gradients' own dtype.
  bool reduces_scatter() const override { return true; }
  dist::WorkPtr start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                     dist::Communicator& comm) override;
  void finish_reduce_scatter(GradBucket& /*bucket*/, const at::Tensor& /*recv*/,
                             dist::Communicator& /*comm*/) override {}
};

// Scales by 1/ranks, rounds to bfloat16, all-reduces the sum in bfloat16 (half the bytes of
// fp32), and widens the result back into the bucket. Lossy: about 3 significant digits.
class Bf16CompressHook : public CommHook {
 public:
  std::string name() const override { return "bf16"; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
};

// --comm-hook NAME:...,warmup=N (any hook): during the first N optimizer steps every reduction is
// the plain average (AllReduceAvgHook: an all-reduce, or under ZeRO a reduce-scatter, in the
// gradients' own dtype), then the named hook takes over with its state (error feedback) at zero.
// 1-bit Adam's warm-up: the optimizer's statistics settle on exact gradients before compression
// starts (docs/compression.md). The step comes from begin_step (the optimizer's count, the same
// on every rank and restored by a resume), so every rank switches at the same step and no state
// of its own is needed; without a begin_step call it stays at step 0 (dense).
class DenseWarmupHook : public CommHook {
 public:
  DenseWarmupHook(std::shared_ptr<CommHook> inner, int64_t warmup);
  std::string name() const override { return inner_->name(); }
  void begin_step(int64_t steps_completed) override;
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
  bool carries_state() const override { return inner_->carries_state(); }
  std::map<std::string, at::Tensor> state() const override;
  void load_state(const std::map<std::string, at::Tensor>& state) override;
  StateReshard reshard_rule(const std::string& key) const override {
    return inner_->reshard_rule(key);
  }
  void load_resharded_state(const std::map<std::string, at::Tensor>& state) override {
    inner_->load_resharded_state(state);
  }
  void lay_out_resharded(int64_t index, int64_t numel, int64_t rank, int64_t ranks) override {
    inner_->lay_out_resharded(index, numel, rank, ranks);
  }
  std::map<std::string, at::Tensor> group_values(
      const std::map<std::string, at::Tensor>& group,
      const std::map<int64_t, BucketShape>& buckets) const override {
    return inner_->group_values(group, buckets);
  }
  ValueRule value_rule(const std::string& what) const override { return inner_->value_rule(what); }
  void load_group_values(const std::map<std::string, at::Tensor>& values,
                         bool reduce_scatter) override {
    inner_->load_group_values(values, reduce_scatter);
  }
  bool reduces_scatter() const override { return inner_->reduces_scatter(); }
  dist::WorkPtr start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                     dist::Communicator& comm) override;
  void finish_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                             dist::Communicator& comm) override;
  bool reduces_once_per_step() const override { return inner_->reduces_once_per_step(); }
  bool reduces_exactly_this_step() const override {
    return dense() || inner_->reduces_exactly_this_step();
  }

  int64_t warmup() const { return warmup_; }
  CommHook& inner() { return *inner_; }

 private:
  bool dense() const { return steps_completed_ < warmup_; }
  std::shared_ptr<CommHook> inner_;
  AllReduceAvgHook dense_;
  int64_t warmup_;
  int64_t steps_completed_ = 0;
  std::map<int64_t, bool> dense_in_flight_;  // by bucket index: started during the warm-up
};

// --comm-hook NAME:...,momentum=B (any hook): 1-bit Adam's momentum compression (Tang et al.
// 2021). The hook keeps m, the averaged momentum after the last step (the same on every rank; zero
// at the start), and sends each rank's local momentum B m + (1 - B) g through the named hook in
// place of its gradient g. Of the mean m' that comes back it hands the optimizer the gradient
// whose momentum update gives m' exactly, (m' - B m) / (1 - B), and keeps m'. An AdamW with
// beta1 = B (the trainer checks it) and its variance frozen then steps with the compressed,
// averaged momentum, as 1-bit Adam does, and the named hook's error feedback carries what the
// compression of a momentum lost, not of a gradient. Wrapping a warmup=N hook, the first N steps
// average the local momenta exactly, so m is the exact momentum when compression starts. A step
// whose result is not finite (every rank gets the same result) leaves m as it was, as the
// optimizer is left (the trainer stops before the update). The first reduction of each bucket
// after construction or a restore broadcasts rank 0's m (and preconditioner), so a rank whose
// checkpoint file failed to load cannot drift from the others. Gradient clipping scales what the
// optimizer gets, not m: while it clips, the optimizer's momentum drifts from m (the gap shrinks
// by B each step). The optimizer should freeze its variance (--freeze-variance-after, 1-bit
// Adam): a moving variance is fed the returned gradients, whose compression errors are
// 1 / (1 - B) times larger. Under ZeRO every rank needs all of m' (its next local momentum), so
// the reduction is the named hook's whole-bucket one (the default start_reduce_scatter), once per
// step (reduces_once_per_step).
//
// Preconditioning (precondition=1, the default): on the steps whose reduction is exact (the
// warm-up) the hook keeps AdamW's variance of the averaged gradients it returns, v (the
// optimizer's beta2; the same on every rank), and once compression starts it sends the local
// momentum divided by d = sqrt(v / (1 - beta2^W)) + eps (W exact steps) and multiplies the mean
// by d again: with --freeze-variance-after W the optimizer's update m' / d is then the
// compressed quantity itself. A compressor with a scale per block of values (onebit, int8) thus
// gives each value an error on the scale of the block's updates, not of its momenta: compressing
// m itself hands a value whose variance is ~0 (a position row past --seq-len, an attention key
// bias, a vocabulary row the corpus never holds) a momentum of its block's mean size, which the
// optimizer divides by ~eps (docs/compression.md: the 1-bit Adam run that diverged). d matches
// the optimizer's denominator where the optimizer sees what the hook returned: not where clipping
// scaled the warm-up's gradients, tensor parallelism sums partial gradients or a pipeline sums a
// tied embedding's copies after the reduction (then it is a preconditioner, not the optimizer's
// own; the clamp, MomentumPreconditioning::limit, bounds what a value with d ~ eps can send).
// Without an exact step (no warm-up; a warning once) or with precondition=0, the momentum itself
// is compressed. With
// unclipped=1 the steps it preconditions are exempt from the trainer's gradient clipping: the
// returned gradients carry the compression's error over 1 - B, so their norm (5 to 10 times the
// exact one, measured) shrinks every clipped step. Off by default: after a short warm-up, unclipped
// steps blew up (docs/compression.md).
struct MomentumPreconditioning {
  bool enabled = true;
  bool unclipped = false;  // exempt_from_clipping_this_step on the preconditioned steps
  double beta2 = 0.95;     // the optimizer's (make_comm_hook takes them from its AdamWOptions)
  double eps = 1e-8;
  // |m / d| is clamped to this many of AdamW's unit steps, times sqrt(R) over R ranks (a rank's
  // own momentum is noisier than the mean whose variance d holds), before it is compressed (what
  // is cut is dropped, as clipping drops it). A value whose variance was ~0 during the warm-up and
  // that learns later (a byte first seen after it; under pp, a tied embedding row whose gradient
  // this stage's part did not hold) would otherwise send m / eps and set its whole block's scale.
  double limit = 10;
};

class MomentumCompressionHook : public CommHook {
 public:
  // beta in [0, 1), preconditioning.beta2 in [0, 1), eps > 0; loom::Error naming the value
  // otherwise.
  MomentumCompressionHook(std::shared_ptr<CommHook> inner, double beta,
                          MomentumPreconditioning preconditioning = {});
  std::string name() const override { return inner_->name(); }
  void begin_step(int64_t steps_completed) override { inner_->begin_step(steps_completed); }
  bool reduces_once_per_step() const override { return true; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
  bool carries_state() const override { return true; }
  // The named hook's state, and per bucket "b<index>/momentum" (float32, the bucket's length),
  // after an exact step with preconditioning also "b<index>/variance" (the same length) and
  // "b<index>/variance_steps" (int64, one value: W).
  std::map<std::string, at::Tensor> state() const override;
  void load_state(const std::map<std::string, at::Tensor>& state) override;
  // Those three are held alike by every rank (kFirst); the named hook's entries by its rules.
  StateReshard reshard_rule(const std::string& key) const override;
  void load_resharded_state(const std::map<std::string, at::Tensor>& state) override;
  // Also fits the momentum and variance to `numel` (ZeRO's padded bucket changes with the number
  // of ranks; past the parameters it is padding, never delivered: values kept, new padding zero).
  void lay_out_resharded(int64_t index, int64_t numel, int64_t rank, int64_t ranks) override;
  // The named hook's values, and "momentum", "variance" (kRms) and the scalar "variance_steps".
  // The named hook reduces whole buckets (ZeRO included).
  std::map<std::string, at::Tensor> group_values(
      const std::map<std::string, at::Tensor>& group,
      const std::map<int64_t, BucketShape>& buckets) const override;
  ValueRule value_rule(const std::string& what) const override;
  void load_group_values(const std::map<std::string, at::Tensor>& values,
                         bool reduce_scatter) override;
  // With unclipped=1, true on the steps it preconditions (the class comment: the norm of the
  // gradients it returns is mostly compression noise over 1 - B).
  bool exempt_from_clipping_this_step() const override;

  double beta() const { return beta_; }
  const MomentumPreconditioning& preconditioning() const { return preconditioning_; }
  CommHook& inner() { return *inner_; }
  // Bucket `index`'s averaged momentum (empty before its first reduction).
  at::Tensor momentum(int64_t index) const;
  // Bucket `index`'s variance of the exactly averaged gradients and how many steps it holds
  // (empty and 0 before the first, or without preconditioning).
  at::Tensor variance(int64_t index) const;
  int64_t variance_steps(int64_t index) const;

 private:
  struct Bucket {
    at::Tensor momentum, variance;
    int64_t variance_steps = 0;
    at::Tensor divisor;  // d, computed from variance once its steps stop changing
    int64_t divisor_steps = -1;
    bool exact_in_flight = false, scaled_in_flight = false;
    bool agreed = false;  // m (and v) came from rank 0 since construction or the last restore
  };
  void load_buckets(const std::map<std::string, at::Tensor>& state);
  const at::Tensor& divisor(Bucket& b);
  std::shared_ptr<CommHook> inner_;
  double beta_;
  MomentumPreconditioning preconditioning_;
  std::map<int64_t, Bucket> buckets_;  // by bucket index
  bool warned_unpreconditioned_ = false;
};

// The registry of hooks by name: "avg", "bf16", "int8", "onebit", "powersgd", "topk" and
// "threshold" are built in; a user's own hook registers with register_comm_hook or
// LOOM_REGISTER_COMM_HOOK and is then chosen by --comm-hook NAME[:key=value,...]. The factory gets
// the parsed spec and checks its options (spec.check_keys, the typed getters), so bad options fail
// when the hook is made, before any collective. The keys "warmup" and "momentum" belong to every
// hook: make_comm_hook takes them out of the spec before the factory sees them and wraps the hook
// in a DenseWarmupHook, then in a MomentumCompressionHook (whose keys "precondition" and
// "unclipped", 0 or 1, are also taken out). Registering a name twice is a loom::Error.
using CommHookFactory = std::function<std::shared_ptr<CommHook>(const core::OptionSpec& spec)>;
void register_comm_hook(const std::string& name, CommHookFactory factory);
std::vector<std::string> comm_hook_names();
// Parses `text` ("int8", "topk:ratio=0.01,warmup=50") and makes the hook. Throws loom::Error
// naming the registered hooks when the name is not one of them, or what is wrong with an option
// (warmup: an integer >= 0; momentum: a number in [0, 1); precondition, unclipped: 0 or 1, with
// momentum; unclipped=1 with preconditioning).
// A momentum compression preconditions with `optimizer`'s beta2 and eps.
std::shared_ptr<CommHook> make_comm_hook(const std::string& text,
                                         const ops::AdamWOptions& optimizer = {});

namespace detail {
template <typename Type>
std::shared_ptr<Type> make_hook(const core::OptionSpec& spec) {
  if constexpr (std::is_constructible_v<Type, const core::OptionSpec&>) {
    return std::make_shared<Type>(spec);
  } else {
    spec.check_keys({});
    return std::make_shared<Type>();
  }
}

struct CommHookRegistration {
  CommHookRegistration(const std::string& name, CommHookFactory factory) {
    register_comm_hook(name, std::move(factory));
  }
};
}  // namespace detail

}  // namespace loom::parallel::data

// Registers Type under `name` at static-initialization time, so --comm-hook name finds it in the
// program that links it (the user's own binary; the prebuilt loom-pretrain knows the built-in
// hooks only). Type is constructed from the const core::OptionSpec& when it can be (it reads and
// checks its own options), else default-constructed, taking no options. Use it once, in a .cpp
// file: in a header every file including it would register the name again, which is an error.
#define LOOM_REGISTER_COMM_HOOK(Type, name)                                               \
  static const ::loom::parallel::data::detail::CommHookRegistration                       \
      loom_comm_hook_registration_##Type(name, [](const ::loom::core::OptionSpec& spec) { \
        return std::static_pointer_cast<::loom::parallel::data::CommHook>(                \
            ::loom::parallel::data::detail::make_hook<Type>(spec));                       \
      })
