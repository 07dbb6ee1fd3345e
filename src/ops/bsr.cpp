#include "loom/ops/bsr.h"

#include <ATen/ATen.h>

#include "kernel_checks.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/cuda.h"
#include "sparse/bsr.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

namespace {

namespace k = loom::kernels;

k::BsrShape shape_of(const BsrWeight& w) {
  return {w.out_features, w.in_features, w.block};
}

k::BsrDtype dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? k::BsrDtype::kBFloat16 : k::BsrDtype::kFloat16;
}

}  // namespace

BsrWeight bsr_compress(const at::Tensor& w, int64_t block) {
  LOOM_CHECK(w.dim() == 2, "bsr_compress: the weight must be [out, in]; got shape {}", w.sizes());
  LOOM_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf,
             "bsr_compress: the weight must be bf16 or fp16; got {}",
             c10::toString(w.scalar_type()));
  BsrWeight out{w.size(0), w.size(1), block, {}, {}, {}};
  const auto status = k::bsr_check(shape_of(out));
  LOOM_CHECK(status.ok(), "bsr_compress: {}", status.message);
  const int64_t r = out.out_features / block, c = out.in_features / block;
  // [R, C, B, B]: tile (i, j) row-major; the kept ones in row-major order of (i, j).
  const auto tiles = w.detach().reshape({r, block, c, block}).permute({0, 2, 1, 3});
  const auto kept = tiles.ne(0).flatten(2).any(2);  // [R, C]
  const auto index = kept.flatten().nonzero().flatten();
  out.values = tiles.reshape({r * c, block, block}).index_select(0, index).contiguous();
  out.tile_col = (index % c).to(at::kInt).contiguous();
  out.row_start = at::cat({at::zeros({1}, kept.options().dtype(at::kLong)), kept.sum(1).cumsum(0)})
                      .to(at::kInt)
                      .contiguous();
  return out;
}

std::optional<std::string> bsr_unsupported(const at::Tensor& x, const BsrWeight& w) {
  if (auto why = detail::linear_input_problem(x, w.in_features, w.values)) return why;
  for (const auto* index : {&w.row_start, &w.tile_col})
    if (index->scalar_type() != at::kInt || index->device() != x.device())
      return fmt::format("the weight's tile indices must be int32 on {}; got {} on {}",
                         x.device().str(), c10::toString(index->scalar_type()),
                         index->device().str());
  if (!x.is_cuda()) return std::nullopt;
  if (auto why = detail::sm80_problem(x, "the block-sparse kernel (mma.sync)")) return why;
#ifdef LOOM_WITH_CUDA
  return detail::kernel_image_missing("bsr", static_cast<int>(x.device().index()),
                                      k::bsr_device_check);
#else
  return std::nullopt;
#endif
}

at::Tensor bsr_linear(const at::Tensor& x, const BsrWeight& w) {
  if (auto why = bsr_unsupported(x, w)) LOOM_CHECK(false, "bsr_linear: {}", *why);
  auto x2 = x.detach().reshape({-1, w.in_features}).contiguous();
  if (reinterpret_cast<uintptr_t>(x2.data_ptr()) % 16 != 0) x2 = x2.clone();  // a view's offset
  const int64_t tokens = x2.size(0);
  auto y = at::empty({tokens, w.out_features}, x2.options());
  if (x2.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x2.device());
    const auto s =
        k::bsr_matmul(dtype_of(x2), x2.data_ptr(), tokens, w.row_start.data_ptr<int32_t>(),
                      w.tile_col.data_ptr<int32_t>(), w.values.data_ptr(), shape_of(w),
                      y.data_ptr(), c10::cuda::getCurrentCUDAStream().stream());
    LOOM_CHECK(s.ok(), "bsr_linear: {}", s.message);
#endif
  } else {
    const auto rows = w.row_start.cpu().contiguous(), cols = w.tile_col.cpu().contiguous();
    const auto values = w.values.cpu().contiguous();
    k::bsr_matmul_host(dtype_of(x2), static_cast<const uint16_t*>(x2.data_ptr()), tokens,
                       rows.data_ptr<int32_t>(), cols.data_ptr<int32_t>(),
                       static_cast<const uint16_t*>(values.data_ptr()), shape_of(w),
                       static_cast<uint16_t*>(y.data_ptr()));
  }
  auto sizes = x.sizes().vec();
  sizes.back() = w.out_features;
  return y.view(sizes);
}

}  // namespace loom::ops
