#include "loom/train/mfu.h"

#include <utility>
#include <vector>

namespace loom::train {

double model_flops_per_token(const models::ModelConfig& config, int64_t seq_len) {
  const int64_t d = config.d_model;
  int64_t lookups = 0;  // parameters read by lookups, not multiplied
  if (config.family == models::Family::kGpt2) lookups += config.max_seq_len * d;  // positions
  if (!config.tie_embeddings) lookups += config.vocab_size * d;  // the input embedding
  // Multi-token heads: their parameters are in num_parameters; each also multiplies by the
  // shared unembedding and attends like one more block (their recompute in backward is not
  // counted, as no recomputation is). A block shared by several layers multiplies at each.
  const int64_t reused = (config.n_layers - config.unique_blocks()) * config.block_parameters();
  const double n = static_cast<double>(config.num_parameters() + reused - lookups +
                                       config.mtp_heads * config.vocab_size * d);
  return 6.0 * n + 12.0 * static_cast<double>((config.n_layers + config.mtp_heads) * d * seq_len);
}

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
