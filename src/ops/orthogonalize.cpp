#include "loom/ops/orthogonalize.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "compression/orthogonalize.h"
#include "loom/core/error.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

int64_t max_orthogonalize_rank() {
  return kernels::kMaxOrthoRank;
}

void orthogonalize_columns_(at::Tensor& data, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& rows, int64_t rank) {
  LOOM_CHECK(data.dim() == 1 && data.scalar_type() == at::kFloat && data.is_contiguous(),
             "orthogonalize_columns_: takes a contiguous float32 1-D buffer, got {} of {} dims",
             c10::toString(data.scalar_type()), data.dim());
  const auto checked = kernels::orthogonalize_check(rank, int64_t(offsets.size()));
  LOOM_CHECK(checked.ok(), "orthogonalize_columns_: {}", checked.message);
  LOOM_CHECK(offsets.size() == rows.size(),
             "orthogonalize_columns_: {} offsets for {} row counts; one of each per matrix",
             offsets.size(), rows.size());
  // Every matrix inside the buffer and apart from the others (sorted by offset, each ending at
  // or before the next begins), so that no two CUDA blocks write the same values.
  std::vector<size_t> order(offsets.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
  int64_t end = 0;
  for (const size_t m : order) {
    LOOM_CHECK(offsets[m] >= end && rows[m] >= 0 && offsets[m] + rows[m] * rank <= data.numel(),
               "orthogonalize_columns_: matrix {} ({} rows of {} from offset {}) is outside the "
               "buffer of {} values or overlaps another matrix",
               m, rows[m], rank, offsets[m], data.numel());
    end = offsets[m] + rows[m] * rank;
  }
  const auto matrices = int64_t(offsets.size());
  if (matrices == 0) return;
  if (data.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(data.device());
    std::vector<int64_t> layout(offsets);
    layout.insert(layout.end(), rows.begin(), rows.end());
    const auto device_layout =
        at::tensor(layout, at::kLong).to(data.device(), /*non_blocking=*/false);
    const int64_t* dl = device_layout.const_data_ptr<int64_t>();
    const auto status = kernels::orthogonalize_apply(
        data.data_ptr<float>(), dl, dl + matrices, rank, matrices,
        c10::cuda::getCurrentCUDAStream(data.device().index()).stream());
    LOOM_CHECK(status.ok(), "orthogonalize kernel: {}", status.message);
    return;
#else
    LOOM_CHECK(false, "orthogonalize_columns_ on {}: this loom was built without CUDA",
               data.device().str());
#endif
  }
  LOOM_CHECK(data.device().is_cpu(), "orthogonalize_columns_ on {}: CPU and CUDA tensors only",
             data.device().str());
  float* p = data.data_ptr<float>();
  at::parallel_for(0, matrices, 1, [&](int64_t begin, int64_t stop) {
    kernels::orthogonalize_host(p, offsets.data(), rows.data(), rank, begin, stop);
  });
}

}  // namespace loom::ops
