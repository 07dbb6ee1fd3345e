#pragma once
// How a gradient bucket is reduced across data-parallel ranks. The default averages it with an
// all-reduce; a hook can compress it first (the bf16 hook halves the bytes sent), which is
// where communication compression plugs in.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/dist/communicator.h"
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
  // Bytes this hook hands to the communicator per gradient element (for accounting).
  virtual double bytes_per_element(const GradBucket& bucket) const = 0;
};

// All-reduce average in the gradients' own dtype.
class AllReduceAvgHook : public CommHook {
 public:
  std::string name() const override { return "avg"; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  double bytes_per_element(const GradBucket& bucket) const override;
};

// Scales by 1/ranks, rounds to bfloat16, all-reduces the sum in bfloat16 (half the bytes of
// fp32), and widens the result back into the bucket. Lossy: about 3 significant digits.
class Bf16CompressHook : public CommHook {
 public:
  std::string name() const override { return "bf16"; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
  double bytes_per_element(const GradBucket&) const override { return 2.0; }
};

// The registry of hooks by name: "avg" and "bf16" are built in; a user's own hook registers
// with register_comm_hook or LOOM_REGISTER_COMM_HOOK and is then chosen by --comm-hook name.
// Registering a name twice is a loom::Error.
using CommHookFactory = std::function<std::shared_ptr<CommHook>()>;
void register_comm_hook(const std::string& name, CommHookFactory factory);
std::vector<std::string> comm_hook_names();
// Throws loom::Error naming the registered hooks when `name` is not one of them.
std::shared_ptr<CommHook> make_comm_hook(const std::string& name);

namespace detail {
struct CommHookRegistration {
  CommHookRegistration(const std::string& name, CommHookFactory factory) {
    register_comm_hook(name, std::move(factory));
  }
};
}  // namespace detail

}  // namespace loom::parallel::data

// Registers Type (a CommHook with a default constructor) under `name` at static-initialization
// time, so --comm-hook name finds it in the program that links it (the user's own binary; the
// prebuilt loom-pretrain knows the built-in hooks only). Use it once, in a .cpp file: in a header
// every file including it would register the name again, which is an error.
#define LOOM_REGISTER_COMM_HOOK(Type, name)                                \
  static const ::loom::parallel::data::detail::CommHookRegistration        \
      loom_comm_hook_registration_##Type(name, [] {                        \
        return std::static_pointer_cast<::loom::parallel::data::CommHook>( \
            std::make_shared<Type>());                                     \
      })
