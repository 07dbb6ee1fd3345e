#include "loom/ops/sign_pack.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include "compression/sign_pack.h"
#include "loom/core/error.h"
#include "loom/core/format.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

static_assert(kSignBlock == kernels::kSignBlock, "ops and kernels pack signs in the same blocks");

SignBlocks pack_signs_with_feedback(const at::Tensor& x_in, at::Tensor& error) {
  LOOM_CHECK(x_in.dim() == 1 && x_in.scalar_type() == at::kFloat,
             "pack_signs_with_feedback: takes a float32 1-D tensor, got {} of {} dims",
             c10::toString(x_in.scalar_type()), x_in.dim());
  LOOM_CHECK(x_in.numel() % kSignBlock == 0,
             "pack_signs_with_feedback: {} values do not split into blocks of {}", x_in.numel(),
             kSignBlock);
  LOOM_CHECK(error.sizes() == x_in.sizes() && error.scalar_type() == at::kFloat &&
                 error.is_contiguous() && error.device() == x_in.device(),
             "pack_signs_with_feedback: the error is {} of {} values on {}, the input {} values "
             "of float32 on {}; they must agree (and the error be contiguous)",
             c10::toString(error.scalar_type()), error.numel(), error.device().str(), x_in.numel(),
             x_in.device().str());
  const auto x = x_in.contiguous();
  const int64_t n = x.numel();
  SignBlocks s{at::empty({n / 32}, x.options().dtype(at::kInt)),
               at::empty({n / kSignBlock}, x.options())};
  const float* xp = x.const_data_ptr<float>();
  float* ep = error.data_ptr<float>();
  auto* wp = reinterpret_cast<uint32_t*>(s.words.data_ptr<int32_t>());
  float* sp = s.scales.data_ptr<float>();
  if (x.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    const auto status = kernels::sign_pack_apply(
        xp, ep, wp, sp, n, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    LOOM_CHECK(status.ok(), "sign_pack kernel: {}", status.message);
    return s;
#else
    LOOM_CHECK(false, "pack_signs_with_feedback on {}: this loom was built without CUDA",
               x.device().str());
#endif
  }
  LOOM_CHECK(x.device().is_cpu(), "pack_signs_with_feedback on {}: CPU and CUDA tensors only",
             x.device().str());
  at::parallel_for(0, n / kSignBlock, 16, [&](int64_t begin, int64_t end) {
    kernels::sign_pack_host(xp, ep, wp, sp, n, begin, end);
  });
  return s;
}

at::Tensor unpack_signs(const at::Tensor& words_in, const at::Tensor& scales_in) {
  LOOM_CHECK(words_in.dim() >= 1 && words_in.scalar_type() == at::kInt &&
                 scales_in.scalar_type() == at::kFloat && scales_in.dim() == words_in.dim() &&
                 words_in.sizes().slice(0, words_in.dim() - 1) ==
                     scales_in.sizes().slice(0, scales_in.dim() - 1) &&
                 words_in.size(-1) == scales_in.size(-1) * (kSignBlock / 32) &&
                 words_in.device() == scales_in.device(),
             "unpack_signs: words {} ({}) and scales {} ({}) do not match: int32 words, float32 "
             "scales, the same leading dims and device, {} words per scale",
             words_in.sizes(), c10::toString(words_in.scalar_type()), scales_in.sizes(),
             c10::toString(scales_in.scalar_type()), kSignBlock / 32);
  const auto words = words_in.contiguous();
  const auto scales = scales_in.contiguous();
  auto sizes = words.sizes().vec();
  sizes.back() *= 32;
  auto out = at::empty(sizes, scales.options());
  const int64_t n = out.numel();
  const auto* wp = reinterpret_cast<const uint32_t*>(words.const_data_ptr<int32_t>());
  const float* sp = scales.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (out.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(out.device());
    const auto status = kernels::sign_unpack_apply(
        wp, sp, op, n, c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
    LOOM_CHECK(status.ok(), "sign_unpack kernel: {}", status.message);
    return out;
#else
    LOOM_CHECK(false, "unpack_signs on {}: this loom was built without CUDA", out.device().str());
#endif
  }
  LOOM_CHECK(out.device().is_cpu(), "unpack_signs on {}: CPU and CUDA tensors only",
             out.device().str());
  at::parallel_for(0, n / kSignBlock, 16, [&](int64_t begin, int64_t end) {
    kernels::sign_unpack_host(wp, sp, op, n, begin, end);
  });
  return out;
}

}  // namespace loom::ops
