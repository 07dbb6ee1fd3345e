#pragma once
// How a gradient bucket is reduced across data-parallel ranks. The default averages it with an
// all-reduce; a hook can compress it first (bf16 halves the bytes sent, int8 quarters them, topk
// and threshold send a small fraction of the values: sparse_hook.h), which is where communication
// compression plugs in. The communicator counts the bytes each hook sends (docs/compression.md).
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/core/option_spec.h"
#include "loom/dist/communicator.h"
#include "loom/ops/quantize.h"
#include "loom/parallel/data/grad_bucket.h"

namespace loom::parallel::data {

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
  // Whether it carries state from step to step (error feedback): training state, which
  // checkpoints hold per rank (state / load_state).
  virtual bool carries_state() const { return false; }
  // This rank's state by name (bucket by bucket), for a checkpoint; empty for a stateless hook.
  virtual std::map<std::string, at::Tensor> state() const { return {}; }
  // Restores what state() returned, on the same buckets and ranks. Throws loom::Error naming
  // the tensor when one does not fit.
  virtual void load_state(const std::map<std::string, at::Tensor>& /*state*/) {}
};

// A hook's per-bucket state keys: "b<index>/<what>" ("b3/error").
std::string bucket_state_key(int64_t index, const std::string& what);
// The bucket index of a "b<index>/error" key; nullopt for any other key.
std::optional<int64_t> bucket_of_error_key(const std::string& key);

// All-reduce average in the gradients' own dtype.
class AllReduceAvgHook : public CommHook {
 public:
  std::string name() const override { return "avg"; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
};

// Scales by 1/ranks, rounds to bfloat16, all-reduces the sum in bfloat16 (half the bytes of
// fp32), and widens the result back into the bucket. Lossy: about 3 significant digits.
class Bf16CompressHook : public CommHook {
 public:
  std::string name() const override { return "bf16"; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
};

// int8 with error feedback: each bucket is reduced as an all-to-all and an all-gather of
// blockwise int8 codes with one fp32 scale per 256 values (ops/quantize.h), so the sum is
// quantized once per hop instead of once per rank:
//   1. every rank adds its carried error to its gradient, quantizes it (the rounding becomes its
//      new error) and sends chunk j to rank j (all-to-all);
//   2. rank j dequantizes the R chunks it received, averages them, adds its own carried error
//      for that segment ("server" error), quantizes the mean and all-gathers it.
// Over steps the results sum to the true mean gradients minus the carried errors, which stay
// bounded (half a quantization step each). Bytes a rank sends per bucket (dist::wire_bytes):
// 2 (R - 1) P for packed chunks of P = S (1 + 1/64) bytes, S = segment_numel(n, R), against an
// fp32 all-reduce's 2 (R - 1) / R x 4 n: about 3.94 times fewer (docs/compression.md).
// The error buffers are per rank and per bucket: training state, saved in each rank's checkpoint
// file.
class Int8CompressHook : public CommHook {
 public:
  static constexpr int64_t kBlock = ops::kInt8Block;
  std::string name() const override { return "int8"; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
  bool carries_state() const override { return true; }
  // "b<index>/error" and "b<index>/server_error" of every bucket reduced so far.
  std::map<std::string, at::Tensor> state() const override;
  void load_state(const std::map<std::string, at::Tensor>& state) override;

  // Bytes of one packed chunk of `segment` values: the int8 codes, then the fp32 scales.
  static int64_t packed_bytes(int64_t segment) { return segment + 4 * (segment / kBlock); }
  // Each rank's segment of a bucket of `numel` values over `ranks` ranks: a multiple of kBlock
  // (the bucket is padded with zeros to ranks * segment).
  static int64_t segment_numel(int64_t numel, int64_t ranks);
  // The errors carried for bucket `index` (empty before its first reduction): this rank's whole
  // padded bucket, and its segment of the mean.
  at::Tensor error(int64_t index) const;
  at::Tensor server_error(int64_t index) const;

 private:
  struct State {
    int64_t ranks = 0, segment = 0;
    at::Tensor error, server_error;  // float32 [ranks * segment], [segment]
    at::Tensor send, recv;           // packed chunks in flight: uint8 [ranks, packed bytes]
  };
  std::map<int64_t, State> state_;  // by bucket index
};

// The registry of hooks by name: "avg", "bf16", "int8", "topk" and "threshold" are built in; a
// user's own hook registers with register_comm_hook or LOOM_REGISTER_COMM_HOOK and is then chosen
// by --comm-hook NAME[:key=value,...]. The factory gets the parsed spec and checks its options
// (spec.check_keys, the typed getters), so bad options fail when the hook is made, before any
// collective. Registering a name twice is a loom::Error.
using CommHookFactory = std::function<std::shared_ptr<CommHook>(const core::OptionSpec& spec)>;
void register_comm_hook(const std::string& name, CommHookFactory factory);
std::vector<std::string> comm_hook_names();
// Parses `text` ("int8", "topk:ratio=0.01") and makes the hook. Throws loom::Error naming the
// registered hooks when the name is not one of them, or what is wrong with an option.
std::shared_ptr<CommHook> make_comm_hook(const std::string& text);

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
