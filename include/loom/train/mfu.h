#pragma once
// Model FLOPs utilization: the FLOPs the model needs per token (models::model_flops_per_token,
// layer_costs.h: PaLM's 6 N + 12 L d T), times tokens per second, over the device's peak.
#include <cstdint>
#include <optional>
#include <string>

#include "loom/models/config.h"
#include "loom/models/layer_costs.h"

namespace loom::train {

using models::model_flops_per_token;

// Dense bf16 tensor-core peak in FLOP/s of a device by the name its driver reports, from a
// small table (H100 and H200 SXM: 989e12; H100 PCIe: 756e12; A100: 312e12; L40S: 362e12;
// RTX 4090: 165e12); nullopt for a name not in it.
std::optional<double> peak_flops_for_device(const std::string& name);

// tokens_per_s * flops_per_token / peak, or nullopt when peak <= 0.
std::optional<double> mfu(double tokens_per_s, double flops_per_token, double peak_flops);

}  // namespace loom::train
