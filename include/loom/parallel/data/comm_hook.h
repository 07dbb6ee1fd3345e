#pragma once
// How a gradient bucket is reduced across data-parallel ranks. The default averages it with an
// all-reduce; a hook can compress it first (the bf16 hook halves the bytes sent), which is
// where communication compression plugs in.
#include <memory>
#include <string>

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

// "avg" | "bf16"; throws loom::Error naming the valid names otherwise.
std::shared_ptr<CommHook> make_comm_hook(const std::string& name);

}  // namespace loom::parallel::data
