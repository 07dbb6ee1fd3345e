#pragma once
// What the ops that wrap loom's CUDA kernels (flash attention, 2:4, block-sparse) ask before a
// call, in one place: an input that fits a linear layer's weight, a CUDA device of compute
// capability 8.0 or newer, and whether this build has the kernel's image for the device (asked
// once per kernel and device). Internal to src/ops.
#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>

#include "common/element_dtype.h"
#include "common/status.h"

namespace loom::ops::detail {

// Why x cannot multiply a weight of `in_features` input features whose values are `values`
// (shape [..., in], the same dtype and device), or nullopt.
std::optional<std::string> linear_input_problem(const at::Tensor& x, int64_t in_features,
                                                const at::Tensor& values);

// Why `kernel` (e.g. "the 2:4 kernel (mma.sp)") cannot run on x's CUDA device: no CUDA build, a
// device below compute capability 8.0; or nullopt.
std::optional<std::string> sm80_problem(const at::Tensor& x, const std::string& kernel);

// check(device)'s message when it fails, asked once per (kernel, device) and remembered.
std::optional<std::string> kernel_image_missing(const std::string& kernel, int device,
                                                const std::function<kernels::Status(int)>& check);

// The kernels' element type of `t` (fp32, fp64, fp16, bf16); anything else is a loom::Error
// naming `what` (e.g. "fused cross-entropy: logits") and the valid types.
kernels::ElementDtype element_dtype(at::ScalarType t, const char* what);

}  // namespace loom::ops::detail
