#pragma once
// The shape of a decoder-only language model, for both families loom ships.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace loom::models {

// kCustom: a user's own LibTorch module trained through loom (custom_model.h); its config
// carries only what the runtime reads (vocabulary, sequence length, width, blocks).
enum class Family { kGpt2, kLlama, kCustom };

std::string to_string(Family family);
Family family_from_string(const std::string& name);  // "gpt2" | "llama" | "custom"

struct ModelConfig {
  Family family = Family::kGpt2;
  int64_t vocab_size = 50257;
  int64_t max_seq_len = 1024;  // GPT-2: learned positions; Llama: RoPE table length
  int64_t d_model = 768;
  int64_t n_layers = 12;
  int64_t n_heads = 12;
  int64_t n_kv_heads = 12;  // < n_heads: grouped-query attention (Llama only)
  int64_t d_ff = 3072;      // MLP hidden width (SwiGLU's gate/up width for Llama)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;  // Llama only
  // RoPE frequency scaling for contexts longer than the model was first trained on (Llama only),
  // as Hugging Face's rope types: "" (none), "linear" (every frequency divided by factor) or
  // "llama3" (Llama 3.1's: wavelengths longer than original_max_seq_len / low_freq_factor
  // divided by factor, shorter than original_max_seq_len / high_freq_factor kept, those between
  // interpolated).
  struct RopeScaling {
    std::string type;
    double factor = 1.0;
    double low_freq_factor = 1.0;
    double high_freq_factor = 4.0;
    int64_t original_max_seq_len = 8192;
    bool operator==(const RopeScaling&) const = default;
  };
  RopeScaling rope_scaling;
  double dropout = 0.0;
  bool tie_embeddings = true;  // GPT-2: always; Llama: usually untied
  // The MLP's linears as this many independent blocks (block-diagonal; 1: dense). Must divide
  // d_model and d_ff; under tensor parallelism a multiple of tp (each rank holds whole blocks).
  int64_t ffn_blocks = 1;
  // The MLP's linears as products of two rank-`ffn_rank` factors (0: dense). Below
  // min(d_model, d_ff); not with ffn_blocks > 1.
  int64_t ffn_rank = 0;
  // Multi-token prediction: this many extra output heads (0: none). Head k (1..mtp_heads) is one
  // transformer block on the trunk (the last block's input) with its own final norm and the
  // shared unembedding, and predicts the token k + 1 places ahead (Gloeckle et al. 2024).
  int64_t mtp_heads = 0;
  static constexpr int64_t kMaxMtpHeads = 16;
  // Cross-layer parameter sharing (layer_sharing.h: "", "all", "cycle:K", "repeat:K" or
  // "L=O,..."): the layers that share a block use one set of weights, stored once under the name
  // of the first of them.
  std::string share_layers;

  int64_t head_dim() const { return d_model / n_heads; }
  // Throws loom::Error naming the field, its value and what would be valid.
  void validate() const;
  // The weights of one block's MLP linears (GPT-2: 2, Llama: 3), as ffn_blocks or ffn_rank
  // make them.
  int64_t mlp_weights() const;
  // Parameters of one transformer block.
  int64_t block_parameters() const;
  // Parameters of one multi-token prediction head: a block and its final norm.
  int64_t mtp_head_parameters() const;
  // Number of parameters (tied embeddings and shared blocks counted once), the multi-token heads
  // included.
  int64_t num_parameters() const;
  // Per layer, the layer whose block it runs (parse_layer_sharing of share_layers).
  std::vector<int64_t> layer_owners() const;
  // Distinct transformer blocks (n_layers without sharing).
  int64_t unique_blocks() const;

  nlohmann::json to_json() const;
  static ModelConfig from_json(const nlohmann::json& j);

  // Presets: gpt2-tiny, gpt2-mini, gpt2-124m, gpt2-350m, llama-tiny, llama-mini, llama-1b,
  // llama-8b.
  // Unknown names throw loom::Error listing the valid ones.
  static ModelConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();
};

}  // namespace loom::models
