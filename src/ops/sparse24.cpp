#include "loom/ops/sparse24.h"

#include <ATen/ATen.h>

#include "kernel_checks.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/cuda.h"
#include "sparse/sparse24.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

namespace {

namespace k = loom::kernels;

k::Sparse24Shape shape_of(const Sparse24Weight& w) {
  return {w.out_features, w.in_features};
}

k::Sparse24Dtype dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? k::Sparse24Dtype::kBFloat16
                                          : k::Sparse24Dtype::kFloat16;
}

const uint16_t* bits(const at::Tensor& t) {
  return static_cast<const uint16_t*>(t.data_ptr());
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

std::string chunk_name(int64_t flat, int64_t in_features) {
  const int64_t row = flat / in_features, col = flat % in_features;
  return fmt::format("row {}, columns {}..{}", row, col, col + 3);
}

}  // namespace

at::Tensor Sparse24Weight::to_dense() const {
  const auto values_cpu = values.cpu().contiguous();
  const auto meta_cpu = meta.cpu().contiguous();
  auto dense = at::empty({out_features, in_features}, values_cpu.options());
  const int64_t bad = k::sparse24_decompress_host(
      bits(values_cpu), static_cast<const uint32_t*>(meta_cpu.data_ptr()), shape_of(*this),
      static_cast<uint16_t*>(dense.data_ptr()));
  LOOM_CHECK(bad < 0, "Sparse24Weight: metadata word {} is not a valid ordered pair per chunk",
             bad);
  return dense.to(values.device());
}

Sparse24Weight sparse24_compress(const at::Tensor& w, bool verify) {
  LOOM_CHECK(w.dim() == 2, "sparse24_compress: the weight must be [out, in]; got shape {}",
             w.sizes());
  LOOM_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf,
             "sparse24_compress: the weight must be bf16 or fp16; got {}",
             c10::toString(w.scalar_type()));
  Sparse24Weight out;
  out.out_features = w.size(0);
  out.in_features = w.size(1);
  const auto shape = shape_of(out);
  const auto status = k::sparse24_check(shape);
  LOOM_CHECK(status.ok(), "sparse24_compress: weight of shape {}: {}", w.sizes(), status.message);
  const auto dense = w.detach().contiguous();
  out.values = at::empty({out.out_features, out.in_features / 2}, dense.options());
  out.meta = at::empty({out.in_features / k::kSparse24Step, out.out_features},
                       dense.options().dtype(at::kInt));
  int64_t first_violation = -1;
  if (dense.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(dense.device());
    const int64_t none = out.out_features * out.in_features;
    auto violation = at::full({1}, none, dense.options().dtype(at::kLong));
    const auto s = k::sparse24_compress(
        dense.data_ptr(), shape, out.values.data_ptr(), static_cast<uint32_t*>(out.meta.data_ptr()),
        violation.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream().stream());
    LOOM_CHECK(s.ok(), "sparse24_compress: {}", s.message);
    if (verify) {
      first_violation = violation.item<int64_t>();
      if (first_violation == none) first_violation = -1;
    }
#else
    LOOM_CHECK(false, "sparse24_compress: a CUDA weight needs a loom built with LOOM_WITH_CUDA");
#endif
  } else {
    first_violation =
        k::sparse24_compress_host(bits(dense), shape, static_cast<uint16_t*>(out.values.data_ptr()),
                                  static_cast<uint32_t*>(out.meta.data_ptr()));
  }
  LOOM_CHECK(!verify || first_violation < 0,
             "sparse24_compress: the weight is not 2:4 sparse: {} has more than two nonzeros "
             "(prune it with --prune-pattern 2:4 first)",
             chunk_name(first_violation, out.in_features));
  return out;
}

std::optional<std::string> sparse24_unsupported(const at::Tensor& x, const Sparse24Weight& w) {
  if (auto why = detail::linear_input_problem(x, w.in_features, w.values)) return why;
  if (w.meta.defined() && (w.meta.scalar_type() != at::kInt || w.meta.device() != x.device()))
    return fmt::format("the weight's metadata must be int32 on {}; got {} on {}",
                       x.device().str(), c10::toString(w.meta.scalar_type()),
                       w.meta.device().str());
  const auto status = k::sparse24_matmul_check(shape_of(w), 0);
  if (!status.ok()) return status.message;
  if (!x.is_cuda()) return std::nullopt;
  if (auto why = detail::sm80_problem(x, "the 2:4 kernel (mma.sp)")) return why;
#ifdef LOOM_WITH_CUDA
  return detail::kernel_image_missing("sparse24", static_cast<int>(x.device().index()),
                                      k::sparse24_device_check);
#else
  return std::nullopt;
#endif
}

at::Tensor sparse24_linear(const at::Tensor& x, const Sparse24Weight& w) {
  if (auto why = sparse24_unsupported(x, w)) LOOM_CHECK(false, "sparse24_linear: {}", *why);
  auto x2 = x.detach().reshape({-1, w.in_features}).contiguous();
  if (!aligned16(x2)) x2 = x2.clone();  // a view's storage offset
  const int64_t tokens = x2.size(0);
  auto y = at::empty({tokens, w.out_features}, x2.options());
  const auto meta = static_cast<const uint32_t*>(w.meta.data_ptr());
  if (x2.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x2.device());
    LOOM_CHECK(aligned16(w.values) && aligned16(w.meta),
               "sparse24_linear: the weight's values and metadata must start 16-byte aligned");
    const auto s =
        k::sparse24_matmul(dtype_of(x2), x2.data_ptr(), tokens, w.values.data_ptr(), meta,
                           shape_of(w), y.data_ptr(), c10::cuda::getCurrentCUDAStream().stream());
    LOOM_CHECK(s.ok(), "sparse24_linear: {}", s.message);
#endif
  } else {
    k::sparse24_matmul_host(dtype_of(x2), bits(x2), tokens, bits(w.values), meta, shape_of(w),
                            static_cast<uint16_t*>(y.data_ptr()));
  }
  auto sizes = x.sizes().vec();
  sizes.back() = w.out_features;
  return y.view(sizes);
}

}  // namespace loom::ops
