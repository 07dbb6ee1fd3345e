#include "kernel_checks.h"

#include <map>
#include <mutex>
#include <utility>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/cuda.h"

namespace loom::ops::detail {

kernels::ElementDtype element_dtype(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat:
      return kernels::ElementDtype::kFloat32;
    case at::kDouble:
      return kernels::ElementDtype::kFloat64;
    case at::kHalf:
      return kernels::ElementDtype::kFloat16;
    case at::kBFloat16:
      return kernels::ElementDtype::kBFloat16;
    default:
      fail("{} of {} are not supported (fp32, fp64, fp16, bf16)", what, c10::toString(t));
  }
}

std::optional<std::string> linear_input_problem(const at::Tensor& x, int64_t in_features,
                                                const at::Tensor& values) {
  if (x.dim() < 1 || x.size(-1) != in_features)
    return fmt::format("x must be [..., {}] (the weight's input features); got shape {}",
                       in_features, x.sizes());
  if (x.scalar_type() != values.scalar_type())
    return fmt::format("x is {} but the weight is {}", c10::toString(x.scalar_type()),
                       c10::toString(values.scalar_type()));
  if (x.device() != values.device())
    return fmt::format("x is on {} but the weight on {}", x.device().str(), values.device().str());
  return std::nullopt;
}

std::optional<std::string> sm80_problem(const at::Tensor& x, const std::string& kernel) {
  if (!built_with_cuda()) return "this loom was built without CUDA (LOOM_WITH_CUDA=OFF)";
  const int cc = cuda_compute_capability(x.device().index());
  if (cc < 80)
    return fmt::format("{} needs compute capability 8.0 or newer; {} has {}", kernel,
                       x.device().str(), cc < 0 ? "none" : fmt::format("{}.{}", cc / 10, cc % 10));
  return std::nullopt;
}

std::optional<std::string> kernel_image_missing(const std::string& kernel, int device,
                                                const std::function<kernels::Status(int)>& check) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int>, std::optional<std::string>> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  auto it = known.find(key);
  if (it == known.end()) {
    const auto status = check(device);
    it = known.emplace(key, status.ok() ? std::nullopt : std::optional(status.message)).first;
  }
  return it->second;
}

}  // namespace loom::ops::detail
