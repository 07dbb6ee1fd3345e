#pragma once
// Model FLOPs utilization: the FLOPs the model needs per token, times tokens per second, over
// the device's peak.
//
// FLOPs per token for training (forward + backward), PaLM's count (Chowdhery et al., 2022,
// appendix B): 6 N + 12 L d T, where N is the parameters that enter matrix products (all of
// them except the position embedding and, when it is not tied to the output head, the token
// embedding: lookups multiply nothing), L the layers, d the model width and T the sequence
// length. 6 N covers each weight's multiply-add in forward (2) and backward (4); 12 L d T the
// attention scores and their product with the values, counted whole even when causal (a causal
// kernel skips half of it, so its MFU reads low by that much, as the convention has it).
#include <cstdint>
#include <optional>
#include <string>

#include "loom/models/config.h"

namespace loom::train {

// Training FLOPs per token (forward + backward) of `config` at sequence length seq_len.
double model_flops_per_token(const models::ModelConfig& config, int64_t seq_len);

// Dense bf16 tensor-core peak in FLOP/s of a device by the name its driver reports, from a
// small table (H100 and H200 SXM: 989e12; H100 PCIe: 756e12; A100: 312e12; L40S: 362e12;
// RTX 4090: 165e12); nullopt for a name not in it.
std::optional<double> peak_flops_for_device(const std::string& name);

// tokens_per_s * flops_per_token / peak, or nullopt when peak <= 0.
std::optional<double> mfu(double tokens_per_s, double flops_per_token, double peak_flops);

}  // namespace loom::train
