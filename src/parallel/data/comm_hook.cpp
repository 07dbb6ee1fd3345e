#include "loom/parallel/data/comm_hook.h"

#include <ATen/ATen.h>

#include "loom/core/error.h"

namespace loom::parallel::data {

dist::WorkPtr AllReduceAvgHook::start(GradBucket& bucket, dist::Communicator& comm) {
  return comm.all_reduce_async(bucket.buffer, dist::ReduceOp::Avg);
}

double AllReduceAvgHook::bytes_per_element(const GradBucket& bucket) const {
  return static_cast<double>(bucket.buffer.element_size());
}

dist::WorkPtr Bf16CompressHook::start(GradBucket& bucket, dist::Communicator& comm) {
  // Scaling before rounding keeps the bf16 sum in range whatever the number of ranks.
  bucket.scratch = (bucket.buffer / static_cast<double>(comm.size())).to(at::kBFloat16);
  return comm.all_reduce_async(bucket.scratch, dist::ReduceOp::Sum);
}

void Bf16CompressHook::finish(GradBucket& bucket, dist::Communicator&) {
  bucket.buffer.copy_(bucket.scratch);
  bucket.scratch = at::Tensor();
}

std::shared_ptr<CommHook> make_comm_hook(const std::string& name) {
  if (name == "avg") return std::make_shared<AllReduceAvgHook>();
  if (name == "bf16") return std::make_shared<Bf16CompressHook>();
  fail("unknown communication hook '{}'; valid: avg, bf16", name);
}

}  // namespace loom::parallel::data
