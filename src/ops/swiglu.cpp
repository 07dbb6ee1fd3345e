#include "loom/ops/swiglu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include "activation/swiglu.h"
#include "kernel_checks.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/cuda.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Why the fused op cannot take these inputs ("" when it can).
std::string unsupported(const at::Tensor& gate, const at::Tensor& up) {
  if (!gate.is_cpu() && !gate.is_cuda())
    return fmt::format("CPU and CUDA tensors only; got {}", gate.device().str());
  if (gate.is_cuda() && !built_with_cuda())
    return fmt::format("{}: this loom was built without CUDA", gate.device().str());
  if (up.device() != gate.device())
    return fmt::format("gate on {} and up on {}", gate.device().str(), up.device().str());
  if (up.scalar_type() != gate.scalar_type())
    return fmt::format("gate and up must share a dtype; got {} and {}",
                       c10::toString(gate.scalar_type()), c10::toString(up.scalar_type()));
  if (up.sizes() != gate.sizes())
    return fmt::format("gate {} and up {} must have one shape", gate.sizes(), up.sizes());
  const auto t = gate.scalar_type();
  if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16 &&
      !(t == at::kDouble && gate.is_cpu()))
    return fmt::format("fp32, fp16 or bf16 (fp64 on the CPU) only; got {}", c10::toString(t));
  return "";
}

void check_status(const kernels::Status& s) {
  LOOM_CHECK(s.ok(), "fused SwiGLU: {}", s.message);
}

constexpr int64_t kCpuGrain = 16384;  // elements per parallel task on the CPU

// Runs `host()` on the CPU or `device(stream)` on CUDA.
template <typename Host, typename Device>
void dispatch(const at::Tensor& t, Host&& host, Device&& device) {
  if (t.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(t.device());
    device(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
#else
    (void)device;
    fail("fused SwiGLU on {}: this loom was built without CUDA", t.device().str());
#endif
  } else {
    host();
  }
}

struct FusedSwiglu : torch::autograd::Function<FusedSwiglu> {
  // gate, up: contiguous, one shape and dtype.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    auto out = at::empty_like(gate);
    const kernels::SwigluShape shape{
        detail::element_dtype(gate.scalar_type(), "fused SwiGLU: gate"), gate.numel()};
    const kernels::SwigluForwardArgs args{gate.const_data_ptr(), up.const_data_ptr(),
                                          out.data_ptr()};
    dispatch(
        gate,
        [&] {
          at::parallel_for(0, shape.n, kCpuGrain, [&](int64_t begin, int64_t end) {
            check_status(kernels::swiglu_forward_host(shape, args, begin, end));
          });
        },
        [&](cudaStream_t stream) {
          check_status(kernels::swiglu_forward_apply(shape, args, stream));
        });
    ctx->save_for_backward({gate, up});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& gate = saved[0];
    const at::Tensor& up = saved[1];
    const auto grad_out = grads[0].to(gate.scalar_type()).contiguous();
    auto grad_gate = at::empty_like(gate), grad_up = at::empty_like(up);
    const kernels::SwigluShape shape{
        detail::element_dtype(gate.scalar_type(), "fused SwiGLU: gate"), gate.numel()};
    const kernels::SwigluBackwardArgs args{gate.const_data_ptr(), up.const_data_ptr(),
                                           grad_out.const_data_ptr(), grad_gate.data_ptr(),
                                           grad_up.data_ptr()};
    dispatch(
        gate,
        [&] {
          at::parallel_for(0, shape.n, kCpuGrain, [&](int64_t begin, int64_t end) {
            check_status(kernels::swiglu_backward_host(shape, args, begin, end));
          });
        },
        [&](cudaStream_t stream) {
          check_status(kernels::swiglu_backward_apply(shape, args, stream));
        });
    return {grad_gate, grad_up};
  }
};

}  // namespace

ActivationBackend parse_activation_backend(const std::string& name) {
  return parse_fused_choice(name, "activation backend");
}

bool uses_fused_swiglu(ActivationBackend backend, const at::Tensor& gate, const at::Tensor& up) {
  switch (backend) {
    case ActivationBackend::kMath:
      return false;
    case ActivationBackend::kAuto:
      return gate.is_cuda() && unsupported(gate, up).empty();
    case ActivationBackend::kFused:
      break;
  }
  const auto why = unsupported(gate, up);
  LOOM_CHECK(why.empty(), "--swiglu fused: {} (use --swiglu math or auto)", why);
  return true;
}

at::Tensor fused_swiglu(const at::Tensor& gate, const at::Tensor& up) {
  const auto why = unsupported(gate, up);
  LOOM_CHECK(why.empty(), "fused SwiGLU: {}", why);
  return FusedSwiglu::apply(gate.contiguous(), up.contiguous());
}

at::Tensor math_swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(gate) * up;
}

at::Tensor swiglu(ActivationBackend backend, const at::Tensor& gate, const at::Tensor& up) {
  return uses_fused_swiglu(backend, gate, up) ? fused_swiglu(gate, up) : math_swiglu(gate, up);
}

}  // namespace loom::ops
