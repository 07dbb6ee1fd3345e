#include "loom/ops/sparsify.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <optional>

#include "compression/sparsify.h"
#include "loom/core/error.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

namespace {

void check_pair(const at::Tensor& x, const at::Tensor& error, const char* what) {
  LOOM_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat,
             "{}: takes a float32 1-D tensor, got {} of {} dims", what,
             c10::toString(x.scalar_type()), x.dim());
  LOOM_CHECK(error.sizes() == x.sizes() && error.scalar_type() == at::kFloat &&
                 error.is_contiguous() && error.device() == x.device(),
             "{}: the error is {} of {} values on {}, the input {} values of float32 on {}; they "
             "must agree (and the error be contiguous)",
             what, c10::toString(error.scalar_type()), error.numel(), error.device().str(),
             x.numel(), x.device().str());
  LOOM_CHECK(x.device().is_cpu() || x.is_cuda(), "{} on {}: CPU and CUDA tensors only", what,
             x.device().str());
}

void check_status(const kernels::Status& status, const char* what) {
  LOOM_CHECK(status.ok(), "{}: {}", what, status.message);
}

#ifdef LOOM_WITH_CUDA
cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

}  // namespace

SparseSelection select_with_feedback(const at::Tensor& x_in, at::Tensor& error, double threshold,
                                     int64_t capacity) {
  check_pair(x_in, error, "select_with_feedback");
  const auto x = x_in.contiguous();
  const int64_t n = x.numel();
  check_status(kernels::select_check(n, capacity), "select_with_feedback");
  const auto t = static_cast<float>(threshold);
  const int64_t chunks = kernels::select_chunks(n);
  auto counts = at::empty({chunks}, x.options().dtype(at::kInt));
  SparseSelection s{at::full({capacity}, -1, x.options().dtype(at::kInt)),
                    at::zeros({capacity}, x.options()), 0};
  const float* xp = x.const_data_ptr<float>();
  float* ep = error.data_ptr<float>();
#ifdef LOOM_WITH_CUDA
  // Both passes launch on x's device.
  std::optional<c10::cuda::CUDAGuard> guard;
  if (x.is_cuda()) guard.emplace(x.device());
#endif
  if (x.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    check_status(
        kernels::select_count_apply(xp, ep, n, t, counts.data_ptr<int32_t>(), stream_of(x)),
        "select_with_feedback");
#else
    fail("select_with_feedback on {}: this loom was built without CUDA", x.device().str());
#endif
  } else {
    at::parallel_for(0, chunks, 64, [&](int64_t begin, int64_t end) {
      kernels::select_count_host(xp, ep, n, t, counts.data_ptr<int32_t>(), begin, end);
    });
  }
  // Each chunk's first slot: the exclusive prefix sum of the counts.
  const auto inclusive = at::cumsum(counts, 0, at::kLong);
  const auto offsets = (inclusive - counts).contiguous();
  s.selected = chunks > 0 ? inclusive[chunks - 1].item<int64_t>() : 0;
  if (x.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    check_status(kernels::select_write_apply(xp, ep, n, t, offsets.const_data_ptr<int64_t>(),
                                             capacity, s.indices.data_ptr<int32_t>(),
                                             s.values.data_ptr<float>(), stream_of(x)),
                 "select_with_feedback");
#endif
  } else {
    at::parallel_for(0, chunks, 64, [&](int64_t begin, int64_t end) {
      kernels::select_write_host(xp, ep, n, t, offsets.const_data_ptr<int64_t>(), capacity,
                                 s.indices.data_ptr<int32_t>(), s.values.data_ptr<float>(), begin,
                                 end);
    });
  }
  return s;
}

double kth_largest_magnitude(const at::Tensor& x, const at::Tensor& error, int64_t k) {
  check_pair(x, error, "kth_largest_magnitude");
  LOOM_CHECK(k >= 1 && k <= x.numel(), "kth_largest_magnitude: k = {} is outside 1..{}", k,
             x.numel());
  // The same fp32 sum the selection forms; topk orders NaN above every number.
  const auto magnitudes = at::add(x, error).abs_();
  return std::get<0>(at::topk(magnitudes, k, 0, /*largest=*/true, /*sorted=*/false))
      .min()
      .item<double>();
}

void scatter_add_sparse_(at::Tensor& dense, const at::Tensor& indices_in,
                         const at::Tensor& values_in) {
  LOOM_CHECK(dense.dim() == 1 && dense.scalar_type() == at::kFloat && dense.is_contiguous(),
             "scatter_add_sparse_: dense must be a contiguous float32 1-D tensor, got {} of {} "
             "dims",
             c10::toString(dense.scalar_type()), dense.dim());
  LOOM_CHECK(indices_in.dim() == 1 && values_in.dim() == 1 &&
                 indices_in.numel() == values_in.numel() && indices_in.scalar_type() == at::kInt &&
                 values_in.scalar_type() == at::kFloat && indices_in.device() == dense.device() &&
                 values_in.device() == dense.device(),
             "scatter_add_sparse_: indices (int32) and values (float32) must be 1-D of one length "
             "on dense's device; got {} {} and {} {} on {} and {}",
             c10::toString(indices_in.scalar_type()), indices_in.numel(),
             c10::toString(values_in.scalar_type()), values_in.numel(), indices_in.device().str(),
             values_in.device().str());
  const auto indices = indices_in.contiguous();
  const auto values = values_in.contiguous();
  if (dense.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(dense.device());
    check_status(kernels::scatter_add_apply(
                     dense.data_ptr<float>(), dense.numel(), indices.const_data_ptr<int32_t>(),
                     values.const_data_ptr<float>(), indices.numel(), stream_of(dense)),
                 "scatter_add_sparse_");
    return;
#else
    fail("scatter_add_sparse_ on {}: this loom was built without CUDA", dense.device().str());
#endif
  }
  kernels::scatter_add_host(dense.data_ptr<float>(), dense.numel(),
                            indices.const_data_ptr<int32_t>(), values.const_data_ptr<float>(),
                            indices.numel());
}

}  // namespace loom::ops
