#include "loom/ops/quantize.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include "compression/quantize.h"
#include "loom/core/error.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

static_assert(kInt8Block == kernels::kQuantBlock, "ops and kernels quantize in the same blocks");

namespace {

void check_values(const at::Tensor& x, const char* what) {
  LOOM_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat,
             "{}: takes a float32 1-D tensor, got {} of {} dims", what,
             c10::toString(x.scalar_type()), x.dim());
  LOOM_CHECK(x.numel() % kInt8Block == 0, "{}: {} values do not split into blocks of {}", what,
             x.numel(), kInt8Block);
}

Int8Blocks quantize(const at::Tensor& x_in, at::Tensor* error) {
  const auto x = x_in.contiguous();
  const int64_t n = x.numel();
  Int8Blocks q{at::empty({n}, x.options().dtype(at::kChar)),
               at::empty({n / kInt8Block}, x.options())};
  float* e = error != nullptr ? error->data_ptr<float>() : nullptr;
  if (x.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    const auto status = kernels::quantize_int8_apply(
        x.const_data_ptr<float>(), e, q.codes.data_ptr<int8_t>(), q.scales.data_ptr<float>(), n,
        c10::cuda::getCurrentCUDAStream().stream());
    LOOM_CHECK(status.ok(), "quantize_int8 kernel: {}", status.message);
    return q;
#else
    LOOM_CHECK(false, "quantize_int8 on {}: this loom was built without CUDA", x.device().str());
#endif
  }
  LOOM_CHECK(x.device().is_cpu(), "quantize_int8 on {}: CPU and CUDA tensors only",
             x.device().str());
  const float* xp = x.const_data_ptr<float>();
  int8_t* cp = q.codes.data_ptr<int8_t>();
  float* sp = q.scales.data_ptr<float>();
  at::parallel_for(0, n / kInt8Block, 64, [&](int64_t begin, int64_t end) {
    kernels::quantize_int8_host(xp, e, cp, sp, n, begin, end);
  });
  return q;
}

}  // namespace

Int8Blocks quantize_int8(const at::Tensor& x) {
  check_values(x, "quantize_int8");
  return quantize(x, nullptr);
}

at::Tensor dequantize_int8(const at::Tensor& codes, const at::Tensor& scales) {
  LOOM_CHECK(codes.dim() >= 1 && codes.size(-1) % kInt8Block == 0 &&
                 scales.size(-1) * kInt8Block == codes.size(-1),
             "dequantize_int8: {} codes and {} scales do not match blocks of {}", codes.size(-1),
             scales.size(-1), kInt8Block);
  auto sizes = codes.sizes().vec();
  sizes.back() /= kInt8Block;
  sizes.push_back(kInt8Block);
  return (codes.to(at::kFloat).view(sizes) * scales.unsqueeze(-1)).view(codes.sizes());
}

Int8Blocks quantize_int8_with_feedback(const at::Tensor& x, at::Tensor& error) {
  check_values(x, "quantize_int8_with_feedback");
  LOOM_CHECK(error.sizes() == x.sizes() && error.scalar_type() == at::kFloat &&
                 error.is_contiguous() && error.device() == x.device(),
             "quantize_int8_with_feedback: the error is {} of {} values on {}, the input {} "
             "values of float32 on {}; they must agree (and the error be contiguous)",
             c10::toString(error.scalar_type()), error.numel(), error.device().str(), x.numel(),
             x.device().str());
  return quantize(x, &error);
}

}  // namespace loom::ops
