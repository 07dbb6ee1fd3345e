#include "loom/train/mfu.h"

#include <utility>
#include <vector>

namespace loom::train {

std::optional<double> peak_flops_for_device(const std::string& name) {
  // Vendor datasheets, dense (no 2:4 sparsity) bf16 tensor-core rates. More specific names
  // first: "H100 PCIe" before "H100".
  static const std::vector<std::pair<std::string, double>> table = {
      {"H200", 989e12}, {"H100 PCIe", 756e12}, {"H100", 989e12},
      {"A100", 312e12}, {"L40S", 362e12},      {"RTX 4090", 165e12}};
  for (const auto& [key, peak] : table)
    if (name.find(key) != std::string::npos) return peak;
  return std::nullopt;
}

std::optional<double> mfu(double tokens_per_s, double flops_per_token, double peak_flops) {
  if (peak_flops <= 0) return std::nullopt;
  return tokens_per_s * flops_per_token / peak_flops;
}

}  // namespace loom::train
