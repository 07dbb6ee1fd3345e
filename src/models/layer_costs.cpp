#include "loom/models/layer_costs.h"

#include "loom/core/error.h"

namespace loom::models {

std::string to_string_cost_kinds() {
  return "uniform, params, flops";
}

parallel::pipeline::LayerCosts layer_costs(const ModelConfig& c, const std::string& kind,
                                           const CostShape& shape) {
  LOOM_CHECK(kind == "uniform" || kind == "params" || kind == "flops",
             "layer cost '{}' is not known; valid: {} (measured times come from the Trainer, "
             "--pp-partition measured)",
             kind, to_string_cost_kinds());
  const double d = static_cast<double>(c.d_model), ff = static_cast<double>(c.d_ff);
  const double mlp = static_cast<double>(c.mlp_weights());  // dense, blocks or low rank
  const double v = static_cast<double>(c.vocab_size), t = static_cast<double>(shape.seq_len);
  const double kv = static_cast<double>(c.n_kv_heads * c.head_dim());
  const double tp = static_cast<double>(shape.tp);
  // Weights of one block's matmuls (what its FLOPs scale with) and all of its parameters.
  double matmul = 0, params = 0;
  if (c.family == Family::kGpt2) {
    matmul = 4 * d * d + mlp;
    params = matmul + 3 * d + d + ff + d + 4 * d;  // biases and two LayerNorms
  } else {
    matmul = 2 * d * d + 2 * d * kv + mlp;
    params = matmul + 2 * d;  // two RMSNorms
  }
  const double embed_params = v * d + (c.family == Family::kGpt2 ? c.max_seq_len * d : 0.0);
  const double head_params = v * d + (c.family == Family::kGpt2 ? 2 * d : d);  // copy or lm_head
  // Per token, forward: 2 FLOPs per weight, causal attention's two [T, T] products (half of
  // 4 T d), the head's projection and softmax cross-entropy.
  const double layer_flops = 2 * matmul + 2 * t * d;
  const double embed_flops = d;
  const double head_flops = 2 * d * v + 5 * v;

  const double tokens = static_cast<double>(shape.micro_batch) * t;
  const double in_flight = static_cast<double>(shape.in_flight);
  const double act = in_flight * 2 * tokens * (34 * d + 5 * c.n_heads * t) / tp;
  const double state_per_param = 16.0 / tp;

  parallel::pipeline::LayerCosts out;
  out.kind = kind;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    out.layer_bytes.push_back(params * state_per_param + act);
    out.layer_time.push_back(kind == "uniform" ? 1.0 : kind == "params" ? params : layer_flops);
  }
  out.first_bytes = embed_params * state_per_param + in_flight * tokens * d * 4 / tp;
  out.last_bytes = head_params * state_per_param + in_flight * tokens * v * 4 * 2 / tp;  // logits
  if (kind == "params") {
    out.first_time = embed_params;
    out.last_time = head_params;
  } else if (kind == "flops") {
    out.first_time = embed_flops;
    out.last_time = head_flops;
  }
  // Multi-token heads sit on the last stage: each a block and a norm, run once in forward and
  // again (recomputed) in backward, and its own pass through the unembedding. Their activations
  // and logits exist one head at a time, beside the trunk each micro-batch keeps for them.
  if (c.mtp_heads > 0) {
    const double heads = static_cast<double>(c.mtp_heads);
    const double head_norm = c.family == Family::kGpt2 ? 2 * d : d;
    out.last_bytes += heads * (params + head_norm) * state_per_param +
                      in_flight * tokens * d * 4 / tp +
                      2 * tokens * (34 * d + 5 * c.n_heads * t) / tp + tokens * v * 4 * 2 / tp;
    const double recompute = 4.0 / 3.0;  // forward + backward + one more forward
    if (kind == "uniform")
      out.last_time += heads;
    else if (kind == "params")
      out.last_time += heads * (params + head_norm);
    else
      out.last_time += heads * recompute * (layer_flops + head_flops);
  }
  return out;
}

double model_flops_per_token(const ModelConfig& config, int64_t seq_len) {
  const int64_t d = config.d_model;
  int64_t lookups = 0;  // parameters read by lookups, not multiplied
  if (config.family == Family::kGpt2) lookups += config.max_seq_len * d;  // positions
  if (!config.tie_embeddings) lookups += config.vocab_size * d;           // the input embedding
  // Multi-token heads: their parameters are in num_parameters; each also multiplies by the
  // shared unembedding and attends like one more block (their recompute in backward is not
  // counted, as no recomputation is). A block shared by several layers multiplies at each.
  const int64_t reused = (config.n_layers - config.unique_blocks()) * config.block_parameters();
  const double n = static_cast<double>(config.num_parameters() + reused - lookups +
                                       config.mtp_heads * config.vocab_size * d);
  return 6.0 * n + 12.0 * static_cast<double>((config.n_layers + config.mtp_heads) * d * seq_len);
}

}  // namespace loom::models
