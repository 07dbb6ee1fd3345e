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
#include "loom/plan/layer_seconds.h"

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

// One pipeline stage's share of the model.
struct StageCost {
  double params = 0;     // held (per tp rank)
  LayerSeconds seconds;  // one micro-batch on its rank
  int64_t layers = 0;
  bool first = false, last = false;
};

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

  // The per-layer seconds and bytes the partitioner balances (pipeline_costs, which training
  // with --pp-partition model partitions by too), with the in-flight count the schedule gives
  // before any time is known; a split that fits no rank's memory is still made, without
  // limits, so that the planner can report what it would need.
  const pl::PipelineShape shape{l.pp, l.virtual_stages, l.micro_batches};
  int64_t partition_in_flight = 1;
  if (l.pp > 1) {
    const auto unit = pl::simulate(*pl::make_schedule(l.schedule), shape, 1.0, 2.0);
    for (const auto n : unit.max_in_flight)
      partition_in_flight =
          std::max(partition_in_flight, (n + l.virtual_stages - 1) / l.virtual_stages);
  }
  const auto pc = pipeline_costs(w, l, machine, partition_in_flight);
  std::vector<int64_t> bounds{0, m.n_layers};
  if (l.pp > 1) {
    try {
      bounds = pl::partition_layers(pc.costs, shape, pc.devices).bounds;
    } catch (const Error&) {
      auto unlimited = pc.devices;
      for (auto& dev : unlimited) dev.memory_gb = 0;
      bounds = pl::partition_layers(pc.costs, shape, unlimited).bounds;
    }
  }
  Prediction out;
  out.stage_bounds = bounds;

  // Per stage: parameters held, and seconds of one micro-batch's forward and backward (its
  // layers' on the reference device over its rank's speed).
  const auto owners = m.layer_owners();
  const double block_params = static_cast<double>(m.block_parameters());
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
    auto add = [&](const LayerSeconds& t) {
      c.seconds.forward += t.forward, c.seconds.backward += t.backward;
      c.seconds.attention += t.attention;
    };
    for (int64_t i = first; i < end; ++i) add(pc.layers[static_cast<size_t>(i)]);
    if (c.first) {
      c.params += embed_params;
      add(pc.first);
    }
    if (c.last) {
      // The head (a copy of a tied embedding when the model is split), its loss, the MTP heads.
      c.params += head_params + (m.tie_embeddings && stages > 1 ? v * d : 0.0);
      add(pc.last);
    }
    c.params /= tp;
    const double speed = pc.devices[static_cast<size_t>(s % l.pp)].speed;
    c.seconds.forward /= speed, c.seconds.backward /= speed, c.seconds.attention /= speed;
  }

  // Per stage, seconds for one micro-batch's forward and backward, exchanges included.
  const auto mode = models::parse_activation_checkpointing(l.checkpointing);
  const double act_bytes = tokens * d * e;  // one [micro, seq, d] activation of this rank
  const double boundary = l.sequence_parallel ? act_bytes / tp : act_bytes;
  const double kv_bytes = 2.0 * tokens * kv_elements(m, tp) * e;
  // What a blocking collective costs beyond its bytes (handing it over, waiting for the group),
  // where the group has more than one rank.
  auto collective = [&](int64_t ranks) { return ranks > 1 ? machine.collective_s : 0.0; };
  double worst_f = 0, worst_b = 0;
  int64_t worst_layers = 0;
  std::vector<double> f_of(static_cast<size_t>(stages)), b_of(static_cast<size_t>(stages));
  for (int64_t s = 0; s < stages; ++s) {
    const auto& c = stage[static_cast<size_t>(s)];
    const double layers = static_cast<double>(c.layers);
    const double forward = c.seconds.forward, backward = c.seconds.backward;
    const double attn = c.seconds.attention;
    // Tensor parallelism: two all-reduces (or all-gather + reduce-scatter pairs) per layer each
    // way, plus the recompute's under full checkpointing.
    // Each collective also costs the profile's collective_s on the path (see below).
    const double tp_layer =
        2 * (all_reduce_seconds(act_bytes, l.tp, machine.link("tp", l.tp)) + collective(l.tp));
    // The vocabulary-parallel embedding and loss: one exchange each way on the first stage,
    // three forward and one backward on the last.
    const double tp_f = layers * tp_layer + (c.first ? 1 : 0) * collective(l.tp) +
                        (c.last ? 3 : 0) * collective(l.tp);
    const double tp_b =
        layers * tp_layer * (mode == models::ActivationCheckpointing::kFull ? 2 : 1) +
        (c.first ? 1 : 0) * collective(l.tp) + (c.last ? 1 : 0) * collective(l.tp);
    // Context parallelism: cp - 1 hops of this rank's keys and values per layer (their
    // gradients too in backward), hidden behind the attention they feed where it is longer.
    const double hop = send_seconds(kv_bytes, machine.link("cp", l.tp * l.cp));
    const double cp_f =
        l.cp > 1 ? layers * (std::max(0.0, (l.cp - 1) * hop - attn / std::max(layers, 1.0)) +
                             static_cast<double>(l.cp - 1) * collective(l.cp))
                 : 0;
    const double cp_b =
        l.cp > 1
            ? layers * (std::max(0.0, 2 * (l.cp - 1) * hop - 2 * attn / std::max(layers, 1.0)) +
                        2 * static_cast<double>(l.cp - 1) * collective(l.cp))
            : 0;
    // Pipeline: the activation out after forward, its gradient back after backward.
    const double pp_f =
        c.last ? 0 : send_seconds(boundary, machine.link("pp", l.world())) + collective(l.pp);
    const double pp_b =
        c.first ? 0 : send_seconds(boundary, machine.link("pp", l.world())) + collective(l.pp);
    f_of[static_cast<size_t>(s)] = forward + tp_f + cp_f + pp_f;
    b_of[static_cast<size_t>(s)] = backward + tp_b + cp_b + pp_b;
    if (f_of[static_cast<size_t>(s)] + b_of[static_cast<size_t>(s)] > worst_f + worst_b) {
      worst_f = f_of[static_cast<size_t>(s)];
      worst_b = b_of[static_cast<size_t>(s)];
      worst_layers = c.layers * l.virtual_stages;
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
  const double layer_full =
      tokens * e *
      block_saved_elements(m, tp, l.sequence_parallel, l.cp, accumulation_per_element(w.precision));
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
    // GELU's input; SwiGLU's gate and up), or ring attention's buffers, beside everything still
    // saved.
    activations += tokens * e *
                   block_backward_peak_elements(m, tp, l.cp, accumulation_per_element(w.precision));
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
  // The collectives' own cost: a reduction per 25 MiB bucket (ZeRO-1/2: and an all-gather
  // after the step; ZeRO-2: per micro-batch), ZeRO-3's gather of every unit (its blocks and
  // the root) in each forward and backward and its reduce-scatter; the loss's and the gradient
  // norm's all-reduces over the world.
  const double buckets = std::max(1.0, std::ceil(worst_grad_bytes / (25.0 * 1024 * 1024)));
  const double mb = static_cast<double>(l.micro_batches);
  const double units = static_cast<double>(worst_layers + 1);
  double dp_collectives = 0;
  switch (l.zero) {
    case 0:
      dp_collectives = buckets;
      break;
    case 1:
      dp_collectives = 2 * buckets;
      break;
    case 2:
      dp_collectives = buckets * mb + buckets;
      break;
    default:
      dp_collectives = 2 * units * mb + units * (l.pp == 1 ? mb : 1.0);
  }
  dp_exposed += dp_collectives * collective(l.dp);
  out.dp_comm_s = l.dp > 1 ? dp_exposed : 0;
  out.dp_comm_s += 2 * collective(l.world());
  // The update: each rank's parameters (its ZeRO shard) through AdamW; the slowest rank's.
  out.optimizer_s = update_s;
  out.step_s = makespan + out.dp_comm_s + out.optimizer_s;
  out.tokens_per_s = static_cast<double>(w.batch_size * w.seq_len) / out.step_s;
  double peak = 0;  // summed over the ranks: each pipeline rank's tp x cp x dp peers
  for (int64_t r = 0; r < l.pp; ++r)
    peak += machine.device_of_stage(r, l.pp).peak_flops * static_cast<double>(l.world() / l.pp);
  bool known = true;
  for (int64_t r = 0; r < l.pp; ++r)
    known = known && machine.device_of_stage(r, l.pp).peak_flops > 0;
  if (known && peak > 0)
    out.mfu = out.tokens_per_s * models::model_flops_per_token(m, w.seq_len) / peak;
  return out;
}

}  // namespace loom::plan
