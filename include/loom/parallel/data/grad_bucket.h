#pragma once
// A group of gradients reduced across data-parallel ranks as one flat buffer. Buckets are built
// in reverse registration order (roughly the order backward produces gradients), so the first
// bucket fills early in backward and its all-reduce overlaps the rest of it.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/dist/work.h"

namespace loom::parallel::data {

struct GradBucket {
  int64_t index = 0;
  at::Tensor buffer;               // flat, the parameters' dtype; holds their gradients
  std::vector<at::Tensor> params;  // in bucket order
  std::vector<std::string> names;  // their fully-qualified names
  std::vector<int64_t> offsets;    // element offset of each parameter in `buffer`
  at::Tensor scratch;              // free for a communication hook (the bf16 copy, say)

  // Per-backward state.
  int64_t pending = 0;  // gradients not yet ready
  dist::WorkPtr work;   // the reduction in flight, once launched

  int64_t numel() const { return buffer.numel(); }
  int64_t bytes() const { return buffer.numel() * static_cast<int64_t>(buffer.element_size()); }
  // The slice of `buffer` that holds parameter i's gradient, shaped like the parameter.
  at::Tensor grad_view(size_t i) const;
};

// A bucket's parameters as they lie in it, without their values: what another layout needs to
// map a hook's per-value state back onto parameters (CommHook::group_values).
struct BucketShape {
  std::vector<std::string> names;            // fully-qualified, in bucket order
  std::vector<std::vector<int64_t>> shapes;  // as this rank holds them (tensor-parallel shards)
  std::vector<int64_t> offsets;              // element offset of each in the bucket
  int64_t numel = 0;                         // the parameters' values (no padding)
};
// `bucket`'s shape.
BucketShape shape_of(const GradBucket& bucket);

// Assigns parameters (in registration order) to buckets of at most `bucket_bytes` each, walking
// them in reverse; a parameter larger than that gets a bucket of its own, and a bucket holds one
// dtype. Returns, for each bucket, the parameter indices it holds, in bucket order. Deterministic
// in the parameters' sizes and dtypes, so every rank builds the same buckets.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                int64_t bucket_bytes);

}  // namespace loom::parallel::data
