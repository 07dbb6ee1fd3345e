#include "loom/parallel/data/grad_bucket.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "loom/core/error.h"

namespace loom::parallel::data {

at::Tensor GradBucket::grad_view(size_t i) const {
  const auto& p = params.at(i);
  return buffer.narrow(0, offsets.at(i), p.numel()).view(p.sizes());
}

BucketShape shape_of(const GradBucket& bucket) {
  BucketShape out;
  out.names = bucket.names;
  out.offsets = bucket.offsets;
  for (size_t i = 0; i < bucket.params.size(); ++i) {
    out.shapes.push_back(bucket.params[i].sizes().vec());
    out.numel = std::max(out.numel, bucket.offsets[i] + bucket.params[i].numel());
  }
  return out;
}

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params,
                                                int64_t bucket_bytes) {
  LOOM_CHECK(bucket_bytes > 0, "bucket size must be positive; got {} bytes", bucket_bytes);
  std::vector<std::vector<size_t>> buckets;
  int64_t filled = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    const bool same_dtype =
        !buckets.empty() && params[buckets.back().front()].scalar_type() == p.scalar_type();
    if (buckets.empty() || !same_dtype || filled + bytes > bucket_bytes) {
      if (buckets.empty() || !buckets.back().empty()) buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(k);
    filled += bytes;
  }
  return buckets;
}

}  // namespace loom::parallel::data
