#include "loom/plan/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/models/causal_lm.h"
#include "loom/models/layer_costs.h"
#include "loom/models/layer_sharing.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/parallel/pipeline/schedule.h"

namespace loom::plan {

namespace pl = parallel::pipeline;

StateBytes loom_state_bytes(const std::string& precision) {
  if (precision == "fp32" || precision == "bf16") return {4, 4, 8};
  if (precision == "fp64") return {8, 8, 16};
  fail("precision '{}' is not valid: use fp32, bf16 or fp64", precision);
}

double zero_state_bytes(double params, const StateBytes& b, int stage, int64_t dp) {
  LOOM_CHECK(stage >= 0 && stage <= 3, "ZeRO stage {} is not valid: 0 (none), 1, 2 or 3", stage);
  LOOM_CHECK(dp >= 1, "dp {} must be at least 1", dp);
  const double n = static_cast<double>(dp);
  switch (stage) {
    case 0:
      return (b.param + b.grad + b.optimizer) * params;
    case 1:
      return (b.param + b.grad) * params + b.optimizer * params / n;
    case 2:
      return b.param * params + (b.grad + b.optimizer) * params / n;
    default:
      return (b.param + b.grad + b.optimizer) * params / n;
  }
}

double all_reduce_seconds(double bytes, int64_t ranks, const Link& link) {
  if (ranks <= 1) return 0;
  const double n = static_cast<double>(ranks);
  return 2 * (n - 1) / n * bytes / link.bandwidth + 2 * (n - 1) * link.latency;
}

double reduce_scatter_seconds(double bytes, int64_t ranks, const Link& link) {
  if (ranks <= 1) return 0;
  const double n = static_cast<double>(ranks);
  return (n - 1) / n * bytes / link.bandwidth + (n - 1) * link.latency;
}

double all_gather_seconds(double bytes, int64_t ranks, const Link& link) {
  return reduce_scatter_seconds(bytes, ranks, link);
}

double send_seconds(double bytes, const Link& link) {
  return bytes / link.bandwidth + link.latency;
}

std::string Layout::describe() const {
  std::string out = fmt::format("dp {} x tp {} x pp {}", dp, tp, pp);
  if (cp > 1) out += fmt::format(" x cp {}", cp);
  if (sequence_parallel) out += " (sp)";
  if (zero > 0) out += fmt::format(", zero {}", zero);
  out += fmt::format(", {} micro-batch{}", micro_batches, micro_batches == 1 ? "" : "es");
  if (pp > 1)
    out +=
        virtual_stages > 1 ? fmt::format(", {} x {}", schedule, virtual_stages) : ", " + schedule;
  if (checkpointing != "none") out += ", recompute " + checkpointing;
  return out;
}

void check_layout(const Workload& w, const Layout& l) {
  const auto& m = w.model;
  m.validate();
  for (const auto& [what, v] : {std::pair{"dp", l.dp},
                                {"tp", l.tp},
                                {"pp", l.pp},
                                {"cp", l.cp},
                                {"micro_batches", l.micro_batches},
                                {"virtual_stages", l.virtual_stages}})
    LOOM_CHECK(v >= 1, "layout: {} = {} must be at least 1", what, v);
  LOOM_CHECK(l.zero >= 0 && l.zero <= 3, "layout: ZeRO stage {} is not valid (0-3)", l.zero);
  LOOM_CHECK(w.batch_size >= 1 && w.seq_len >= 1,
             "workload: batch size {} and sequence length {} must be at least 1", w.batch_size,
             w.seq_len);
  loom_state_bytes(w.precision);
  models::parse_activation_checkpointing(l.checkpointing);
  LOOM_CHECK(m.n_heads % l.tp == 0 && m.d_ff % l.tp == 0 &&
                 (m.n_kv_heads % l.tp == 0 || l.tp % m.n_kv_heads == 0),
             "layout: tp {} must divide n_heads {} and d_ff {} (and divide or be divided by "
             "n_kv_heads {})",
             l.tp, m.n_heads, m.d_ff, m.n_kv_heads);
  LOOM_CHECK(l.pp * l.virtual_stages <= m.n_layers,
             "layout: pp {} x {} virtual stages is more stages than the model's {} layers", l.pp,
             l.virtual_stages, m.n_layers);
  LOOM_CHECK(l.virtual_stages == 1 || (l.pp > 1 && l.schedule == "interleaved"),
             "layout: {} virtual stages need pp > 1 and the interleaved schedule",
             l.virtual_stages);
  LOOM_CHECK(w.batch_size % (l.dp * l.micro_batches) == 0,
             "layout: the batch of {} sequences does not split into dp {} x {} micro-batches",
             w.batch_size, l.dp, l.micro_batches);
  LOOM_CHECK(w.seq_len <= m.max_seq_len, "workload: seq_len {} exceeds the model's max_seq_len {}",
             w.seq_len, m.max_seq_len);
  LOOM_CHECK(l.cp == 1 || (w.seq_len % (2 * l.cp) == 0 && m.dropout == 0 && m.mtp_heads == 0),
             "layout: cp {} needs a sequence divisible by {} (got {}), no dropout and no "
             "multi-token heads",
             l.cp, 2 * l.cp, w.seq_len);
  LOOM_CHECK(!l.sequence_parallel || (l.tp > 1 && (w.seq_len / l.cp) % l.tp == 0),
             "layout: sequence parallelism needs tp > 1 dividing the sequence of {} per cp rank",
             w.seq_len / l.cp);
  if (l.pp > 1) pl::make_schedule(l.schedule)->check({l.pp, l.virtual_stages, l.micro_batches});
}

namespace {

// Bytes per element of the activations and the messages they make.
double activation_element_bytes(const std::string& precision) {
  return precision == "bf16" ? 2.0 : precision == "fp64" ? 8.0 : 4.0;
}

// One pipeline stage's share of the model.
struct StageCost {
  double params = 0;           // held (per tp rank)
  double matmul_flops = 0;     // forward, one micro-batch, this tp rank
  double attention_flops = 0;  // forward, one micro-batch, this tp rank
  int64_t layers = 0;
  bool first = false, last = false;
};

// What a stage's matmuls and attention leave out, per token of one micro-batch on one tp rank:
// elements through each class of elementwise op (forward and backward counted once: the
// profile times them together), and the number of ops. Counted from the blocks as loom writes
// them (models/gpt2.cpp, models/llama.cpp): residual adds, norms, activations, the attention
// output's copy back to [B, T, D], bias gradients, RoPE, the loss's log-softmax.
struct Elementwise {
  double pointwise = 0, activation = 0, norm = 0, ops = 0;

  Elementwise& operator+=(const Elementwise& o) {
    pointwise += o.pointwise, activation += o.activation, norm += o.norm, ops += o.ops;
    return *this;
  }
  // Seconds for `tokens` tokens, forward and backward.
  double seconds(const DeviceProfile& dev, double tokens) const {
    return tokens *
           (pointwise * dev.pointwise_s + activation * dev.activation_s + norm * dev.norm_s);
  }
};

// Per token: one block, the embedding (first stage), the final norm, head and loss (last).
// Residual-stream tensors are [tokens, d] on every tp rank, or [tokens / tp, d] with sequence
// parallelism; the rest are split by tp.
Elementwise block_elementwise(const models::ModelConfig& m, double tp, bool sp) {
  const double d = static_cast<double>(m.d_model), f = static_cast<double>(m.d_ff) / tp;
  const double residual = sp ? d / tp : d;
  const double heads = d / tp, kv = static_cast<double>(m.n_kv_heads * m.head_dim()) /
                                    std::min(tp, static_cast<double>(m.n_kv_heads));
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

// Elements per token one block keeps for its backward, counted from the tensors autograd saves
// in loom's blocks (and checked against the peak of a 2- and a 4-layer model: docs/planner.md).
// Those on the residual stream are whole on each tp rank (1/tp of the sequence with sequence
// parallelism); the rest are split by tp. loom's attention kernels keep no [T, T] scores, only
// a log-sum-exp per head.
//   GPT-2: the two LayerNorms' inputs and outputs (4 d); q, k, v (3 d), the attention output
//          in [B, T, D] (d), the MLP's input to the GELU and its output (2 d_ff); a dropout mask
//          per residual branch.
//   Llama: the two RMSNorms' inputs and outputs (4 d); q, k, v after RoPE (d + 2 kv), the
//          attention output and its copy (2 d), one more [T, d] copy of q; gate, SiLU, up and
//          their product (4 d_ff).
double block_saved_elements(const models::ModelConfig& m, double tp, bool sp) {
  const double d = static_cast<double>(m.d_model), f = static_cast<double>(m.d_ff);
  const double heads = static_cast<double>(m.n_heads);
  const double residual = sp ? d / tp : d;
  if (m.family == models::Family::kGpt2)
    return 4 * residual + (4 * d + 2 * f + 2 * heads) / tp + (m.dropout > 0 ? 2 * residual : 0.0);
  const double kv = static_cast<double>(m.n_kv_heads * m.head_dim());
  return 4 * residual + (4 * d + 2 * kv + 4 * f + heads) / tp;
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

}  // namespace

Prediction predict(const Workload& w, const Layout& l, const MachineProfile& machine) {
  check_layout(w, l);
  const auto& m = w.model;
  const int64_t stages = l.pp * l.virtual_stages;
  const double e = activation_element_bytes(w.precision);
  const auto state = loom_state_bytes(w.precision);
  const double d = static_cast<double>(m.d_model), v = static_cast<double>(m.vocab_size);
  const double tp = static_cast<double>(l.tp);
  const int64_t micro = w.batch_size / (l.dp * l.micro_batches);  // sequences per micro-batch
  const int64_t local_seq = w.seq_len / l.cp;
  const double tokens = static_cast<double>(micro * local_seq);  // a rank's, per micro-batch

  // The partitioner's per-layer costs (FLOPs per token at this rank's sequence slice) and its
  // split of the layers over the pipeline ranks' speeds.
  const auto costs = models::layer_costs(m, "flops", {micro, local_seq, l.tp, 1});
  std::vector<pl::DeviceSpec> devices;
  double fastest = 0;
  for (int64_t r = 0; r < l.pp; ++r)
    fastest = std::max(fastest, machine.device_of_stage(r, l.pp).matmul_flops);
  for (int64_t r = 0; r < l.pp; ++r) {
    const auto& dev = machine.device_of_stage(r, l.pp);
    devices.push_back({dev.name, dev.matmul_flops / fastest, 0});
  }
  const pl::PipelineShape shape{l.pp, l.virtual_stages, l.micro_batches};
  const auto bounds = l.pp > 1 ? pl::partition_layers(costs, shape, devices).bounds
                               : std::vector<int64_t>{0, m.n_layers};
  Prediction out;
  out.stage_bounds = bounds;

  // Per stage: parameters and forward FLOPs. Attention's two [T, T] products per token attend
  // over the whole sequence (ring attention brings the other ranks' keys).
  const auto owners = m.layer_owners();
  const double block_params = static_cast<double>(m.block_parameters());
  const double attention_per_token = 2.0 * static_cast<double>(w.seq_len) * d;
  const double local_attention = 2.0 * static_cast<double>(local_seq) * d;  // in costs
  const double embed_params =
      v * d + (m.family == models::Family::kGpt2 ? static_cast<double>(m.max_seq_len) * d : 0.0);
  const double head_params =
      (m.tie_embeddings ? 0.0 : v * d) + static_cast<double>(m.mtp_heads * m.mtp_head_parameters());
  std::vector<StageCost> stage(static_cast<size_t>(stages));
  for (int64_t s = 0; s < stages; ++s) {
    auto& c = stage[static_cast<size_t>(s)];
    const int64_t first = bounds[static_cast<size_t>(s)], end = bounds[static_cast<size_t>(s) + 1];
    c.layers = end - first;
    c.first = s == 0;
    c.last = s == stages - 1;
    c.params = block_params * static_cast<double>(models::held_blocks(owners, first, end).size());
    for (int64_t i = first; i < end; ++i)
      c.matmul_flops += costs.layer_time[static_cast<size_t>(i)] - local_attention;
    c.attention_flops = static_cast<double>(c.layers) * attention_per_token;
    if (c.first) c.params += embed_params;
    if (c.last) {
      // The head (a copy of a tied embedding when the model is split), its loss, the MTP heads.
      c.params += head_params + (m.tie_embeddings && stages > 1 ? v * d : 0.0);
      c.matmul_flops += costs.last_time;
    }
    c.params /= tp;
    c.matmul_flops *= tokens / tp;
    c.attention_flops *= tokens / tp;
  }

  // Per stage, seconds for one micro-batch's forward and backward, exchanges included.
  const auto mode = models::parse_activation_checkpointing(l.checkpointing);
  const double act_bytes = tokens * d * e;  // one [micro, seq, d] activation of this rank
  const double boundary = l.sequence_parallel ? act_bytes / tp : act_bytes;
  const double kv_bytes = 2.0 * tokens * static_cast<double>(m.n_kv_heads * m.head_dim()) * e /
                          std::min(tp, static_cast<double>(m.n_kv_heads));
  double worst_f = 0, worst_b = 0;
  std::vector<double> f_of(static_cast<size_t>(stages)), b_of(static_cast<size_t>(stages));
  const double width = d / tp;  // the matmuls' narrowest side on a tp rank (its rate's key)
  const double head_dim = static_cast<double>(m.head_dim());
  for (int64_t s = 0; s < stages; ++s) {
    const auto& c = stage[static_cast<size_t>(s)];
    const auto& dev = machine.device_of_stage(s % l.pp, l.pp);
    const double layers = static_cast<double>(c.layers);
    const double mm = c.matmul_flops / dev.matmul_rate(width);
    const double attn =
        c.attention_flops / dev.attention_rate(static_cast<double>(local_seq), head_dim);
    // Elementwise ops and per-op costs, a third in forward and two in backward.
    Elementwise elementwise;
    for (int64_t i = 0; i < c.layers; ++i)
      elementwise += block_elementwise(m, tp, l.sequence_parallel);
    if (c.first) elementwise += embedding_elementwise(m, tp, l.sequence_parallel);
    if (c.last) elementwise += head_elementwise(m, tp, l.sequence_parallel);
    const double pointwise = elementwise.seconds(dev, tokens);
    const double ops = elementwise.ops * dev.op_s;
    auto add_ops = [&](double kernels, double share) {
      return dev.ops_overlap_kernels ? std::max(kernels, share * ops) : kernels + share * ops;
    };
    const double scale = dev.compute_scale;
    const double forward = scale * add_ops(mm + attn + pointwise / 3, 1.0 / 3);
    double backward = scale * add_ops(2 * (mm + attn) + 2 * pointwise / 3, 2.0 / 3);
    if (mode == models::ActivationCheckpointing::kFull) backward += forward;
    if (mode == models::ActivationCheckpointing::kSelective) backward += scale * attn;
    // Tensor parallelism: two all-reduces (or all-gather + reduce-scatter pairs) per layer each
    // way, plus the recompute's under full checkpointing.
    const double tp_layer = 2 * all_reduce_seconds(act_bytes, l.tp, machine.link("tp", l.tp));
    const double tp_f = layers * tp_layer;
    const double tp_b = tp_f * (mode == models::ActivationCheckpointing::kFull ? 2 : 1);
    // Context parallelism: cp - 1 hops of this rank's keys and values per layer (their
    // gradients too in backward), hidden behind the attention they feed where it is longer.
    const double hop = send_seconds(kv_bytes, machine.link("cp", l.tp * l.cp));
    const double cp_f =
        l.cp > 1 ? layers * std::max(0.0, (l.cp - 1) * hop - attn / std::max(layers, 1.0)) : 0;
    const double cp_b =
        l.cp > 1 ? layers * std::max(0.0, 2 * (l.cp - 1) * hop - 2 * attn / std::max(layers, 1.0))
                 : 0;
    // Pipeline: the activation out after forward, its gradient back after backward.
    const double pp_f = c.last ? 0 : send_seconds(boundary, machine.link("pp", l.world()));
    const double pp_b = c.first ? 0 : send_seconds(boundary, machine.link("pp", l.world()));
    f_of[static_cast<size_t>(s)] = forward + tp_f + cp_f + pp_f;
    b_of[static_cast<size_t>(s)] = backward + tp_b + cp_b + pp_b;
    if (f_of[static_cast<size_t>(s)] + b_of[static_cast<size_t>(s)] > worst_f + worst_b) {
      worst_f = f_of[static_cast<size_t>(s)];
      worst_b = b_of[static_cast<size_t>(s)];
      const double mb = static_cast<double>(l.micro_batches);
      out.compute_s = mb * (forward + backward);
      out.tp_comm_s = mb * (tp_f + tp_b);
      out.cp_comm_s = mb * (cp_f + cp_b);
      out.pp_comm_s = mb * (pp_f + pp_b);
    }
  }
  // A rank runs its chunks one after another; the simulator takes one time per stage: the
  // slowest stage's (the schedule balances nothing else).
  double makespan = 0;
  // Per pipeline rank: micro-batches whose activations each of its chunks holds at once.
  std::vector<int64_t> in_flight(static_cast<size_t>(l.pp), 1);
  if (l.pp > 1) {
    const auto run = pl::simulate(*pl::make_schedule(l.schedule), shape, worst_f, worst_b);
    makespan = run.makespan;
    out.bubble_fraction = run.bubble_fraction();
    for (int64_t r = 0; r < l.pp; ++r)
      in_flight[static_cast<size_t>(r)] =
          (run.max_in_flight[static_cast<size_t>(r)] + l.virtual_stages - 1) / l.virtual_stages;
    out.in_flight = *std::max_element(in_flight.begin(), in_flight.end());
  } else {
    makespan = static_cast<double>(l.micro_batches) * (worst_f + worst_b);
  }

  // Memory per pipeline rank: its chunks' model state, ZeRO-3's gathered units, activations.
  const double layer_full = tokens * e * block_saved_elements(m, tp, l.sequence_parallel);
  const double layer_input = l.sequence_parallel ? act_bytes / tp : act_bytes;
  double worst_memory = -1;
  double worst_grad_bytes = 0, worst_params = 0;
  double update_s = 0;  // the slowest rank's AdamW pass
  const double tied_copy = m.tie_embeddings && stages > 1 ? v * d : 0.0;
  for (int64_t r = 0; r < l.pp; ++r) {
    double params = 0, activations = 0, root = 0;
    for (int64_t chunk = 0; chunk < l.virtual_stages; ++chunk) {
      const auto& c = stage[static_cast<size_t>(chunk * l.pp + r)];
      params += c.params;
      // What ZeRO-3 keeps gathered for the whole step: the parameters outside every block.
      if (c.first) root += embed_params / tp;
      if (c.last) root += (head_params + tied_copy) / tp;
      const double layers = static_cast<double>(c.layers);
      const double kept = mode == models::ActivationCheckpointing::kFull ? layers * layer_input
                                                                         : layers * layer_full;
      activations += static_cast<double>(in_flight[static_cast<size_t>(r)]) * kept;
      // The logits (fp32) and their gradient on the last stage.
      if (c.last) activations += 2 * tokens * v / tp * 4;
    }
    if (mode == models::ActivationCheckpointing::kFull) activations += layer_full;  // recompute
    // At the peak, in a block's backward: the gradients of its MLP's hidden activations (the
    // GELU's input; SwiGLU's gate and up), beside everything still saved.
    activations += tokens * e * static_cast<double>(m.d_ff) / tp *
                   (m.family == models::Family::kGpt2 ? 1.0 : 2.0);
    double p = 0, g = 0, o = 0;
    const double n = static_cast<double>(l.dp);
    switch (l.zero) {
      case 0:
        p = state.param * params, g = state.grad * params, o = state.optimizer * params;
        break;
      case 1:
        p = state.param * params, g = state.grad * params, o = state.optimizer * params / n;
        break;
      case 2:
        p = state.param * params, g = state.grad * params / n, o = state.optimizer * params / n;
        break;
      default:
        // The shard, plus the root unit, the block being run and the one prefetched, gathered.
        p = state.param * (params / n + root + 2 * block_params / tp);
        g = state.grad * params / n, o = state.optimizer * params / n;
    }
    const double total = p + g + o + activations;
    out.rank_memory_bytes.push_back(total);
    update_s = std::max(update_s, params / (l.zero > 0 ? static_cast<double>(l.dp) : 1.0) /
                                      machine.device_of_stage(r, l.pp).adamw_params_per_s);
    if (total > worst_memory) {
      worst_memory = total;
      out.parameter_bytes = p, out.gradient_bytes = g, out.optimizer_bytes = o;
      out.activation_bytes = activations;
      worst_grad_bytes = state.grad * params;
      worst_params = params;
    }
  }
  out.memory_bytes = worst_memory;

  // Data parallelism: the gradient reduction, overlapped with the last backward as the
  // runtime's buckets are (the last bucket, 25 MiB, always shows); ZeRO-1/2 all-gather the
  // updated parameters after the step; ZeRO-3 gathers every unit in each forward and backward,
  // prefetched behind the compute.
  const auto& dp_link = machine.link("dp", l.tp * l.cp * l.dp);
  const double reduce = l.zero == 0 ? all_reduce_seconds(worst_grad_bytes, l.dp, dp_link)
                                    : reduce_scatter_seconds(worst_grad_bytes, l.dp, dp_link);
  const double tail_bytes = std::min(worst_grad_bytes, 25.0 * 1024 * 1024);
  const double tail = l.zero == 0 ? all_reduce_seconds(tail_bytes, l.dp, dp_link)
                                  : reduce_scatter_seconds(tail_bytes, l.dp, dp_link);
  double dp_exposed = std::max(reduce - worst_b, std::min(reduce, tail));
  // ZeRO-2 and -3 reduce-scatter after every micro-batch's backward (stage 3 over a pipeline
  // once per step: its gradients accumulate whole), each behind that backward.
  if ((l.zero == 2 || (l.zero == 3 && l.pp == 1)) && l.micro_batches > 1)
    dp_exposed *= static_cast<double>(l.micro_batches);
  const double param_bytes = state.param * worst_params;
  if (l.zero == 1 || l.zero == 2) dp_exposed += all_gather_seconds(param_bytes, l.dp, dp_link);
  if (l.zero == 3) {
    const double gathers = 2 * all_gather_seconds(param_bytes, l.dp, dp_link);
    dp_exposed += static_cast<double>(l.micro_batches) * std::max(0.0, gathers - worst_f - worst_b);
  }
  out.dp_comm_s = l.dp > 1 ? dp_exposed : 0;
  // The update: each rank's parameters (its ZeRO shard) through AdamW; the slowest rank's.
  out.optimizer_s = update_s;
  out.step_s = makespan + out.dp_comm_s + out.optimizer_s;
  out.tokens_per_s = static_cast<double>(w.batch_size * w.seq_len) / out.step_s;
  return out;
}

}  // namespace loom::plan
