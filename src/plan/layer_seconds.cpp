#include "loom/plan/layer_seconds.h"

#include <algorithm>

#include "loom/models/causal_lm.h"
#include "loom/models/layer_costs.h"

namespace loom::plan {

namespace pl = parallel::pipeline;

Elementwise& Elementwise::operator+=(const Elementwise& o) {
  pointwise += o.pointwise, activation += o.activation, norm += o.norm, ops += o.ops;
  return *this;
}

double Elementwise::seconds(const DeviceProfile& dev, double tokens) const {
  return tokens * (pointwise * dev.pointwise_s + activation * dev.activation_s + norm * dev.norm_s);
}

// Per token: one block, the embedding (first stage), the final norm, head and loss (last).
// Residual-stream tensors are [tokens, d] on every tp rank, or [tokens / tp, d] with sequence
// parallelism; the rest are split by tp.
Elementwise block_elementwise(const models::ModelConfig& m, double tp, bool sp) {
  const double d = static_cast<double>(m.d_model), f = static_cast<double>(m.d_ff) / tp;
  const double residual = sp ? d / tp : d;
  const double heads = d / tp, kv = kv_elements(m, tp);
  Elementwise e;
  if (m.family == models::Family::kGpt2) {
    // Two LayerNorms, the GELU (its bias fused), two residual adds, the attention output's
    // copy, the output projections' biases; dropout masks two residual branches.
    e.norm = 2 * residual;
    e.activation = f;
    e.pointwise = 2 * residual + heads + d / tp + (m.dropout > 0 ? 2 * residual : 0.0);
    e.ops = 14;
  } else {
    // Two RMSNorms of four elementwise ops each, SiLU times the up projection, RoPE on q and k
    // (three ops each), two residual adds, the attention output's copy.
    e.pointwise = 2 * 4 * residual + f + 3 * (heads + kv) + 2 * residual + heads;
    e.activation = f;
    e.ops = 30;
  }
  return e;
}

double kv_elements(const models::ModelConfig& m, double tp) {
  return static_cast<double>(m.n_kv_heads * m.head_dim()) /
         std::min(tp, static_cast<double>(m.n_kv_heads));
}

// Elements per token one block keeps for its backward, counted from the tensors autograd saves
// in loom's blocks (and checked against the peak of a 2- and a 4-layer model: docs/planner.md).
// Those on the residual stream are whole on each tp rank (1/tp of the sequence with sequence
// parallelism); the rest are split by tp. loom's attention kernels keep no [T, T] scores, only
// a log-sum-exp per head.
// The norms' outputs are kept whole by the column-parallel matmuls they feed: with sequence
// parallelism, as the all-gathered tensor (a gpt2-mini tp 2 run keeps 11.6 MiB less with it,
// not the 24 MiB that splitting the outputs too would save).
//   GPT-2: the two LayerNorms' inputs (2 d on the residual stream) and outputs (2 d); q, k, v
//          (3 d), the attention output in [B, T, D] (d), the MLP's input to the GELU and its
//          output (2 d_ff); a dropout mask per residual branch.
//   Llama: the two RMSNorms' inputs and outputs (the same 2 + 2 d); q, k, v after RoPE
//          (d + 2 kv), the attention output and its copy (2 d), one more [T, d] copy of q; gate,
//          SiLU, up and their product (4 d_ff).
//   Under cp, ring attention's output in [B, H, T, hd] too, in the accumulation dtype, beside
//   the [B, T, D] copy the projection reads.
double block_saved_elements(const models::ModelConfig& m, double tp, bool sp, int64_t cp,
                            double acc) {
  const double d = static_cast<double>(m.d_model), f = static_cast<double>(m.d_ff);
  const double heads = static_cast<double>(m.n_heads);
  const double residual = sp ? d / tp : d;
  const double norms = 2 * residual + 2 * d;
  const double ring_output = cp > 1 ? acc * d / tp : 0.0;
  if (m.family == models::Family::kGpt2)
    return norms + (4 * d + 2 * f + 2 * heads) / tp + (m.dropout > 0 ? 2 * residual : 0.0) +
           ring_output;
  return norms + (4 * d + 4 * f + heads) / tp + 2 * kv_elements(m, tp) + ring_output;
}

// Ring attention's backward (parallel/context/ring_attention.cpp), in the accumulation dtype:
// the query gradient (and the output's gradient converted to it under bf16), this rank's own
// key/value gradient, the one carried round the ring and the one arriving, and a block pair's
// gradients (half the slice each); in the run's dtype: the key/value block held and, with more
// than 2 ranks, the next one arriving beside it (at cp 2 the last step, which holds the most
// gradients, receives no block).
double block_backward_peak_elements(const models::ModelConfig& m, double tp, int64_t cp,
                                    double acc) {
  const double mlp = static_cast<double>(m.d_ff) / tp * (m.family == models::Family::kGpt2 ? 1 : 2);
  if (cp == 1) return mlp;
  const double q = static_cast<double>(m.d_model) / tp, kv = 2 * kv_elements(m, tp);
  const double accumulated = q * (acc > 1 ? 2 : 1) + 3 * kv + (q + kv) / 2;
  const double blocks = (cp > 2 ? 2 : 1) * kv;
  return std::max(mlp, acc * accumulated + blocks);
}

double accumulation_per_element(const std::string& precision) {
  return precision == "bf16" ? 2.0 : 1.0;
}

Elementwise embedding_elementwise(const models::ModelConfig& m, double tp, bool sp) {
  const double d = static_cast<double>(m.d_model), residual = sp ? d / tp : d;
  Elementwise e;
  e.pointwise = m.family == models::Family::kGpt2 ? 2 * residual : residual;  // + positions
  e.ops = m.family == models::Family::kGpt2 ? 4 : 2;
  return e;
}

Elementwise head_elementwise(const models::ModelConfig& m, double tp, bool sp) {
  const double d = static_cast<double>(m.d_model), residual = sp ? d / tp : d;
  const double v = static_cast<double>(m.vocab_size) / tp;
  Elementwise e;
  if (m.family == models::Family::kGpt2)
    e.norm = residual;
  else
    e.pointwise = 4 * residual;
  e.activation = v;  // log-softmax
  e.pointwise += v;  // the loss's gradient
  e.ops = m.family == models::Family::kGpt2 ? 6 : 9;
  return e;
}

double activation_element_bytes(const std::string& precision) {
  return precision == "bf16" ? 2.0 : precision == "fp64" ? 8.0 : 4.0;
}

namespace {

// Forward and backward seconds of work whose kernels take `kernels` forward (`attention` of it
// in attention), with elementwise ops of `elementwise` seconds and `ops` seconds of per-op
// cost, forward and backward together: a third of those in forward. Backward runs the kernels
// twice over, plus what `mode` recomputes; on a device whose ops overlap its kernels each pass
// takes the longer of the two.
LayerSeconds split(double kernels, double attention, double elementwise, double ops,
                   const DeviceProfile& dev, models::ActivationCheckpointing mode) {
  auto pass = [&](double k, double o) { return dev.ops_overlap_kernels ? std::max(k, o) : k + o; };
  LayerSeconds out;
  out.forward = dev.compute_scale * pass(kernels + elementwise / 3, ops / 3);
  out.backward = dev.compute_scale * pass(2 * kernels + 2 * elementwise / 3, 2 * ops / 3);
  out.attention = dev.compute_scale * attention;
  if (mode == models::ActivationCheckpointing::kFull) out.backward += out.forward;
  if (mode == models::ActivationCheckpointing::kSelective) out.backward += out.attention;
  return out;
}

}  // namespace

PipelineCosts pipeline_costs(const Workload& w, const Layout& l, const MachineProfile& machine,
                             int64_t in_flight) {
  const auto& m = w.model;
  const auto mode = models::parse_activation_checkpointing(l.checkpointing);
  const double e = activation_element_bytes(w.precision);
  const double acc = accumulation_per_element(w.precision);
  const auto state = loom_state_bytes(w.precision);
  const double d = static_cast<double>(m.d_model), v = static_cast<double>(m.vocab_size);
  const double tp = static_cast<double>(l.tp);
  const int64_t micro = w.batch_size / (l.dp * l.micro_batches);  // sequences per micro-batch
  const int64_t local_seq = w.seq_len / l.cp;
  const double tokens = static_cast<double>(micro * local_seq);  // a rank's, per micro-batch
  // The partitioner's FLOPs per token (attention at this rank's sequence slice); attention
  // attends over the whole sequence (ring attention brings the other ranks' keys).
  const auto flops = models::layer_costs(m, "flops", {micro, local_seq, l.tp, 1});
  const double local_attention = 2.0 * static_cast<double>(local_seq) * d;
  const double attention = 2.0 * static_cast<double>(w.seq_len) * d * tokens / tp;
  const double width = d / tp;  // the matmuls' narrowest side on a tp rank (its rate's key)
  const double head_dim = static_cast<double>(m.head_dim());
  const auto block = block_elementwise(m, tp, l.sequence_parallel);
  const auto embedding = embedding_elementwise(m, tp, l.sequence_parallel);
  const auto head = head_elementwise(m, tp, l.sequence_parallel);

  auto block_seconds = [&](const DeviceProfile& dev, size_t layer) {
    const double mm =
        (flops.layer_time[layer] - local_attention) * tokens / tp / dev.matmul_rate(width);
    // Under cp, ring attention's blocks of half a rank's slice (their rate: the profile's).
    const double attn =
        l.cp > 1 ? dev.ring_attention_seconds(attention, l.cp, static_cast<double>(local_seq) / 2,
                                              head_dim)
                 : attention / dev.attention_rate(static_cast<double>(local_seq), head_dim);
    return split(mm + attn, attn, block.seconds(dev, tokens), block.ops * dev.op_s, dev, mode);
  };
  // The reference: the pipeline rank fastest at a block; the others' speeds relative to it.
  const auto none = models::ActivationCheckpointing::kNone;
  std::vector<double> per_block;
  for (int64_t r = 0; r < l.pp; ++r) {
    const auto s = block_seconds(machine.device_of_stage(r, l.pp), 0);
    per_block.push_back(s.forward + s.backward);
  }
  const auto fastest = std::min_element(per_block.begin(), per_block.end()) - per_block.begin();
  const auto& ref = machine.device_of_stage(fastest, l.pp);

  PipelineCosts out;
  auto& c = out.costs;
  c.kind = "model";
  // Bytes: training state as ZeRO shards it over dp (tp splits it), activations in flight.
  const double block_params = static_cast<double>(m.block_parameters()) / tp;
  const double residual_input = tokens * d * e / (l.sequence_parallel ? tp : 1.0);
  const double kept =
      mode == models::ActivationCheckpointing::kFull
          ? residual_input
          : tokens * e * block_saved_elements(m, tp, l.sequence_parallel, l.cp, acc);
  const double in = static_cast<double>(in_flight);
  for (size_t i = 0; i < flops.layer_time.size(); ++i) {
    out.layers.push_back(block_seconds(ref, i));
    c.layer_time.push_back(out.layers.back().forward + out.layers.back().backward);
    c.layer_bytes.push_back(zero_state_bytes(block_params, state, l.zero, l.dp) + in * kept);
  }
  out.first = split(0, 0, embedding.seconds(ref, tokens), embedding.ops * ref.op_s, ref, none);
  const double head_mm = flops.last_time * tokens / tp / ref.matmul_rate(width);
  out.last = split(head_mm, 0, head.seconds(ref, tokens), head.ops * ref.op_s, ref, none);
  c.first_time = out.first.forward + out.first.backward;
  c.last_time = out.last.forward + out.last.backward;
  const double embed_params =
      (v * d + (m.family == models::Family::kGpt2 ? static_cast<double>(m.max_seq_len) * d : 0.0)) /
      tp;
  const double head_params = ((m.tie_embeddings ? 0.0 : v * d) +
                              static_cast<double>(m.mtp_heads * m.mtp_head_parameters())) /
                             tp;
  c.first_bytes = zero_state_bytes(embed_params, state, l.zero, l.dp) + in * residual_input;
  c.last_bytes = zero_state_bytes(head_params, state, l.zero, l.dp) + 2 * tokens * v / tp * 4;
  // Multi-token heads: the trunk each in-flight micro-batch keeps for them, and one head's
  // block at a time (recomputed) with its logits.
  if (m.mtp_heads > 0)
    c.last_bytes += in * residual_input +
                    tokens * e * block_saved_elements(m, tp, l.sequence_parallel, l.cp, acc) +
                    2 * tokens * v / tp * 4;
  for (int64_t r = 0; r < l.pp; ++r) {
    const auto& dev = machine.device_of_stage(r, l.pp);
    pl::DeviceSpec spec;
    spec.name = dev.name;
    spec.speed = per_block[static_cast<size_t>(fastest)] / per_block[static_cast<size_t>(r)];
    spec.memory_gb = dev.memory_bytes / (1024.0 * 1024.0 * 1024.0);
    out.devices.push_back(spec);
  }
  return out;
}

}  // namespace loom::plan
