// The cost model and the planner: ZeRO's per-parameter bytes as the paper counts them, ring
// collective formulas, the pipeline bubble the schedule simulator predicts, how memory and time
// move with the layout, the planner's ranking and its errors, machine profiles and theirs.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "loom/dist/local_communicator.h"
#include "loom/models/config.h"
#include "loom/models/layer_costs.h"
#include "loom/parallel/pipeline/schedule.h"
#include "loom/plan/cost_model.h"
#include "loom/plan/machine_profile.h"
#include "loom/plan/measure.h"
#include "loom/plan/planner.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
namespace plan = loom::plan;
namespace models = loom::models;

namespace {

// A built-in profile without elementwise and per-op costs (ops adding to the kernels, not
// overlapping them): compute is FLOPs over rates alone.
plan::MachineProfile flops_only(const std::string& name = "h100-node") {
  auto p = plan::builtin_profile(name);
  for (auto& d : p.devices) {
    d.pointwise_s = d.activation_s = d.norm_s = d.op_s = 0;
    d.ops_overlap_kernels = false;
  }
  p.collective_s = 0;
  return p;
}

// A machine whose links cost nothing: only compute remains.
plan::MachineProfile free_links(double matmul = 1e12, double attention = 1e12) {
  auto p = flops_only();
  p.devices.front().matmul_flops = matmul;
  p.devices.front().attention_flops = attention;
  p.intra_node = p.inter_node = {1e30, 0};
  return p;
}

plan::Workload mini(int64_t batch = 32, int64_t seq = 256) {
  return {models::ModelConfig::preset("gpt2-mini"), batch, seq, "bf16"};
}

}  // namespace

// The ZeRO paper's Figure 1: 7.5 B parameters, mixed-precision Adam (2 + 2 + 12 bytes), dp 64:
// 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per device.
TEST(CostModel, ZeroStateBytesAreThePapers) {
  const plan::StateBytes mixed{2, 2, 12};
  const double psi = 7.5e9;
  EXPECT_DOUBLE_EQ(plan::zero_state_bytes(psi, mixed, 0, 64), 120e9);
  EXPECT_NEAR(plan::zero_state_bytes(psi, mixed, 1, 64) / 1e9, 31.4, 0.05);
  EXPECT_NEAR(plan::zero_state_bytes(psi, mixed, 2, 64) / 1e9, 16.6, 0.05);
  EXPECT_NEAR(plan::zero_state_bytes(psi, mixed, 3, 64) / 1e9, 1.9, 0.05);
  // loom keeps fp32 parameters, gradients and both moments: 16 bytes, fp64 32.
  const auto fp32 = plan::loom_state_bytes("bf16");
  EXPECT_DOUBLE_EQ(fp32.param + fp32.grad + fp32.optimizer, 16);
  const auto fp64 = plan::loom_state_bytes("fp64");
  EXPECT_DOUBLE_EQ(fp64.param + fp64.grad + fp64.optimizer, 32);
  EXPECT_TRUE(contains(error_of([] { plan::loom_state_bytes("fp16"); }), "fp32, bf16 or fp64"));
  EXPECT_TRUE(contains(error_of([&] { plan::zero_state_bytes(psi, mixed, 4, 2); }), "0 (none)"));
}

TEST(CostModel, RingCollectivesMoveTheirBytesOnce) {
  const plan::Link link{100e9, 1e-5};
  // 1 GB over 8 ranks: each rank sends 7/8 of it twice in an all-reduce, once in the others.
  EXPECT_NEAR(plan::all_reduce_seconds(1e9, 8, link), 2 * 7.0 / 8 * 1e-2 + 14 * 1e-5, 1e-15);
  EXPECT_NEAR(plan::reduce_scatter_seconds(1e9, 8, link), 7.0 / 8 * 1e-2 + 7 * 1e-5, 1e-15);
  EXPECT_NEAR(plan::all_gather_seconds(1e9, 8, link), 7.0 / 8 * 1e-2 + 7 * 1e-5, 1e-15);
  EXPECT_NEAR(plan::send_seconds(1e9, link), 1e-2 + 1e-5, 1e-15);
  EXPECT_EQ(plan::all_reduce_seconds(1e9, 1, link), 0);
  EXPECT_EQ(plan::reduce_scatter_seconds(1e9, 1, link), 0);
}

// With free links and balanced stages, the predicted bubble is the simulator's (backward twice
// a forward), and 1F1B's in-flight micro-batches are the simulator's too.
TEST(CostModel, PipelineBubbleIsTheSimulators) {
  const auto machine = free_links();
  for (const char* schedule : {"1f1b", "gpipe"}) {
    for (const int64_t pp : {2, 3}) {
      plan::Layout l;
      l.pp = pp;
      l.micro_batches = 8;
      l.schedule = schedule;
      const auto w = mini();
      const auto p = plan::predict(w, l, machine);
      const auto sim = loom::parallel::pipeline::simulate(
          *loom::parallel::pipeline::make_schedule(schedule), {pp, 1, 8}, 1.0, 2.0);
      // The stages' FLOPs differ a little (the head), so the bubble does too: within 0.05.
      EXPECT_NEAR(p.bubble_fraction, sim.bubble_fraction(), 0.05) << schedule << " pp " << pp;
      const int64_t most = *std::max_element(sim.max_in_flight.begin(), sim.max_in_flight.end());
      EXPECT_EQ(p.in_flight, most) << schedule << " pp " << pp;
    }
  }
}

TEST(CostModel, MemoryAndTimeMoveWithTheLayout) {
  const auto machine = flops_only();
  const auto w = mini();
  plan::Layout base;
  base.dp = 8;
  // Each ZeRO stage holds less model state than the one before.
  double previous = 1e300;
  for (int zero = 0; zero <= 3; ++zero) {
    auto l = base;
    l.zero = zero;
    const auto p = plan::predict(w, l, machine);
    const double state = p.parameter_bytes + p.gradient_bytes + p.optimizer_bytes;
    EXPECT_LT(state, previous) << "zero " << zero;
    previous = state;
  }
  // Recomputing every block keeps less (each block's input and one block's activations, against
  // every block's; a small vocabulary, so that the logits do not dominate) and takes longer.
  auto full = base;
  full.checkpointing = "full";
  auto small_vocab = w;
  small_vocab.model.vocab_size = 256;
  EXPECT_LT(plan::predict(small_vocab, full, machine).activation_bytes,
            plan::predict(small_vocab, base, machine).activation_bytes / 3);
  const auto kept = plan::predict(w, base, machine);
  // Recomputation runs each block's forward again (not the embedding's or the head's: with a
  // small vocabulary they are a sliver of the step).
  EXPECT_NEAR(plan::predict(small_vocab, full, machine).compute_s /
                  plan::predict(small_vocab, base, machine).compute_s,
              4.0 / 3.0, 0.02);
  EXPECT_LT(plan::predict(w, full, machine).compute_s, 4.0 / 3.0 * kept.compute_s);
  // Compute scales with the device's rate; tp's exchanges with its link.
  auto slow = machine;
  slow.devices.front().matmul_flops /= 2;
  slow.devices.front().attention_flops /= 2;
  EXPECT_NEAR(plan::predict(w, base, slow).compute_s, 2 * kept.compute_s, 1e-12);
  plan::Layout tp2;
  tp2.tp = 2;
  tp2.dp = 4;
  auto narrow = machine;
  narrow.links["tp"] = {machine.intra_node.bandwidth / 10, 0};
  auto wide = machine;
  wide.links["tp"] = {machine.intra_node.bandwidth, 0};
  EXPECT_NEAR(plan::predict(w, tp2, narrow).tp_comm_s, 10 * plan::predict(w, tp2, wide).tp_comm_s,
              1e-9);
  // MFU: the model's training FLOPs per token at the predicted rate, over 8 H100s' dense peak;
  // none where the profile has no peak.
  EXPECT_NEAR(kept.mfu,
              kept.tokens_per_s * models::model_flops_per_token(w.model, w.seq_len) / (8 * 989e12),
              1e-12);
  auto no_peak = machine;
  no_peak.devices.front().peak_flops = 0;
  EXPECT_EQ(plan::predict(w, base, no_peak).mfu, 0);
  // Shared blocks: fewer parameters held, the same compute.
  auto shared = w;
  shared.model.share_layers = "all";
  const auto s = plan::predict(shared, base, machine);
  EXPECT_DOUBLE_EQ(kept.parameter_bytes - s.parameter_bytes,
                   4.0 * 5 * static_cast<double>(w.model.block_parameters()));
  EXPECT_NEAR(s.compute_s, kept.compute_s, 1e-12);
  // A layout that cannot run this workload says why.
  auto bad = base;
  bad.tp = 3;
  bad.dp = 1;
  EXPECT_TRUE(contains(error_of([&] { plan::predict(w, bad, machine); }), "tp 3 must divide"));
  auto empty = w;
  empty.seq_len = 0;
  EXPECT_TRUE(contains(error_of([&] { plan::predict(empty, base, machine); }),
                       "sequence length 0 must be at least 1"));
  bad = base;
  bad.micro_batches = 3;
  EXPECT_TRUE(contains(error_of([&] { plan::predict(w, bad, machine); }),
                       "does not split into dp 8 x 3 micro-batches"));
}

TEST(Planner, RanksTheLayoutsThatFit) {
  plan::PlanRequest r;
  r.workload = mini();
  r.world = 8;
  r.machine = plan::builtin_profile("h100-node");
  const auto plans = plan::plan_layouts(r);
  ASSERT_GT(plans.size(), 10u);
  for (size_t i = 0; i < plans.size(); ++i) {
    EXPECT_EQ(plans[i].layout.world(), 8);
    EXPECT_LE(plans[i].prediction.memory_bytes, 80e9);
    if (i > 0) {
      EXPECT_LE(plans[i].prediction.tokens_per_s, plans[i - 1].prediction.tokens_per_s);
    }
  }
  const auto j = nlohmann::json::parse(plan::plan_json(plans, 3));
  ASSERT_EQ(j.size(), 3u);
  for (const char* key : {"dp", "tp", "pp", "zero", "micro_batches", "schedule", "step_s",
                          "memory_bytes", "tokens_per_s"})
    EXPECT_TRUE(j[0].contains(key)) << key;
  EXPECT_EQ(j[0]["dp"].get<int64_t>() * j[0]["tp"].get<int64_t>() * j[0]["pp"].get<int64_t>() *
                j[0]["cp"].get<int64_t>(),
            8);
  EXPECT_TRUE(contains(plan::format_plan(plans, 2), "tokens/s"));
  // Too little memory anywhere: the error names the least any layout needs.
  r.machine.devices.front().memory_bytes = 1e6;
  const auto msg = error_of([&] { plan::plan_layouts(r); });
  EXPECT_TRUE(contains(msg,
                       "no layout of 8 ranks fits in 0.00 GiB per rank; the least memory "
                       "any needs is"))
      << msg;
  // A world no layout divides the model into.
  r.machine = plan::builtin_profile("h100-node");
  r.world = 7;
  r.workload.batch_size = 6;
  EXPECT_TRUE(contains(error_of([&] { plan::plan_layouts(r); }), "no layout of 7 ranks"));
}

// What the FLOPs leave out, as docs/planner.md counts it for GPT-2 (tp 1, no dropout), per
// token: each block's LayerNorms (2 d), GELU (d_ff) and elementwise products (residual adds,
// the attention output's copy, the projections' biases: 4 d); the embedding's 2 d; the head's
// LayerNorm (d), log-softmax (vocab) and loss gradient (vocab). Ops: 14 per block, 4 for the
// embedding, 6 for the head. One micro-batch on one rank: forward and backward together add
// exactly these, at the profile's seconds per element and per op.
TEST(CostModel, ElementwiseOpsAndTheMeasuredScaleAddToCompute) {
  const auto w = mini(8, 128);
  const plan::Layout one;
  const auto base = free_links();
  const double t0 = plan::predict(w, one, base).compute_s;
  const double tokens = 8 * 128, d = 256, ff = 1024, v = static_cast<double>(w.model.vocab_size);
  const double layers = static_cast<double>(w.model.n_layers);
  auto with = [&](auto set) {
    auto p = base;
    set(p.devices.front());
    return plan::predict(w, one, p).compute_s - t0;
  };
  EXPECT_NEAR(with([](auto& dv) { dv.pointwise_s = 1e-9; }),
              tokens * (layers * 4 * d + 2 * d + v) * 1e-9, 1e-12);
  EXPECT_NEAR(with([](auto& dv) { dv.activation_s = 1e-9; }), tokens * (layers * ff + v) * 1e-9,
              1e-12);
  EXPECT_NEAR(with([](auto& dv) { dv.norm_s = 1e-9; }), tokens * (layers * 2 * d + d) * 1e-9,
              1e-12);
  EXPECT_NEAR(with([](auto& dv) { dv.op_s = 1e-5; }), (layers * 14 + 4 + 6) * 1e-5, 1e-12);
  // Where ops overlap the kernels (a GPU), a step takes the longer of the two.
  EXPECT_NEAR(with([](auto& dv) {
                dv.op_s = 1.0;
                dv.ops_overlap_kernels = true;
              }),
              layers * 14 + 4 + 6 - t0, 1e-9);
  EXPECT_NEAR(with([](auto& dv) {
                dv.op_s = 1e-30;
                dv.ops_overlap_kernels = true;
              }),
              0, 1e-15);
  // The measured scale multiplies compute; a curve below the flat rate at this width slows it.
  EXPECT_NEAR(with([](auto& dv) { dv.compute_scale = 1.5; }), 0.5 * t0, 1e-12);
  EXPECT_GT(with([](auto& dv) { dv.matmul_curve = {{128, 1e11}, {4096, 1e12}}; }), t0);
  // Llama counts differently, and RMSNorm is elementwise products, not a fused norm.
  plan::Workload llama{models::ModelConfig::preset("llama-tiny"), 8, 128, "fp32"};
  auto p = base;
  p.devices.front().norm_s = 1e-9;
  EXPECT_NEAR(plan::predict(llama, one, p).compute_s, plan::predict(llama, one, base).compute_s,
              1e-15);
}

// Each blocking collective on a step's path pays the profile's collective_s: per micro-batch
// and block, tp's two exchanges each way, plus the vocabulary-parallel embedding (one each way)
// and loss (three forward, one backward); per step, dp's reduction of its one bucket and the
// loss's and gradient norm's all-reduces; ZeRO-3 gathers each unit (6 blocks and the root)
// forward and backward and reduce-scatters it, per micro-batch.
TEST(CostModel, CollectivesPayTheirOverhead) {
  auto w = mini(8, 128);
  w.model.vocab_size = 256;  // 4.8 M parameters: one 25 MiB bucket of fp32 gradients
  auto with = [&](const plan::Layout& l, double overhead) {
    auto p = free_links();
    p.collective_s = overhead;
    return plan::predict(w, l, p);
  };
  plan::Layout tp2;
  tp2.tp = 2;
  tp2.micro_batches = 2;
  const double layers = static_cast<double>(w.model.n_layers);
  EXPECT_NEAR(with(tp2, 1e-3).tp_comm_s - with(tp2, 0).tp_comm_s,
              2 * (layers * 4 + 1 + 3 + 1 + 1) * 1e-3, 1e-12);
  plan::Layout dp2;
  dp2.dp = 2;
  EXPECT_NEAR(with(dp2, 1e-3).dp_comm_s - with(dp2, 0).dp_comm_s, (1 + 2) * 1e-3, 1e-12);
  dp2.zero = 3;
  dp2.micro_batches = 2;
  EXPECT_NEAR(with(dp2, 1e-3).dp_comm_s - with(dp2, 0).dp_comm_s, (2 * 7 * 2 + 7 * 2 + 2) * 1e-3,
              1e-12);
  // One rank: nothing to wait for.
  EXPECT_EQ(with(plan::Layout{}, 1e-3).step_s, with(plan::Layout{}, 0).step_s);
}

// The rate curves: log-linear between points, flat beyond the ends; attention takes the
// nearest measured head_dim.
TEST(MachineProfile, RateCurvesInterpolate) {
  plan::DeviceProfile d;
  d.matmul_flops = 7e12;
  d.attention_flops = 5e12;
  EXPECT_EQ(d.matmul_rate(100), 7e12);  // no curve: the flat rates
  EXPECT_EQ(d.attention_rate(100, 64), 5e12);
  d.matmul_curve = {{128, 1e12}, {512, 4e12}};
  EXPECT_DOUBLE_EQ(d.matmul_rate(64), 1e12);
  EXPECT_DOUBLE_EQ(d.matmul_rate(256), 2.5e12);  // halfway in log width
  EXPECT_DOUBLE_EQ(d.matmul_rate(4096), 4e12);
  d.attention_curve = {{128, 32, 1e12}, {512, 32, 3e12}, {128, 128, 2e12}, {512, 128, 8e12}};
  EXPECT_DOUBLE_EQ(d.attention_rate(256, 32), 2e12);
  EXPECT_DOUBLE_EQ(d.attention_rate(256, 40), 2e12);  // 32 is nearer than 128 in log
  EXPECT_DOUBLE_EQ(d.attention_rate(256, 100), 5e12);
  EXPECT_DOUBLE_EQ(d.attention_rate(1024, 128), 8e12);
}

// Ring attention's time: without a block curve, the fused rate at the rank's slice (two
// chunks); with one, 2 cp - 1 full blocks and 2 causal ones at the curve's rate.
TEST(MachineProfile, RingAttentionTakesTheBlockRate) {
  plan::DeviceProfile d;
  d.attention_flops = 5e12;
  d.attention_curve = {{128, 32, 1e12}, {512, 32, 3e12}};
  EXPECT_DOUBLE_EQ(d.ring_attention_seconds(1e12, 2, 64, 32), 1.0);  // 1e12 at a slice of 128
  d.block_attention_curve = {{16, 32, 1e11}, {64, 32, 4e11}};
  d.causal_block_cost = 1;  // a CPU's: 2 cp + 1 blocks for 2 cp's FLOPs
  EXPECT_DOUBLE_EQ(d.ring_attention_seconds(1e12, 2, 32, 32), 1e12 * 5 / 4 / 2.5e11);
  d.causal_block_cost = 0.5;  // a kernel that skips the masked half: the FLOPs' time
  EXPECT_DOUBLE_EQ(d.ring_attention_seconds(1e12, 4, 16, 40), 1e12 / 1e11);
}

// Context parallelism's attention is timed at the block rate: blocks 4x slower than the fused
// attention make a cp step's compute slower and leave a step without cp as it was; a block curve
// at the fused rate, with causal blocks at half a full one's cost, predicts what no curve does.
// Per-op and elementwise costs are zeroed so that the kernels set the compute.
TEST(CostModel, RingAttentionRunsAtTheBlockRate) {
  const auto w = mini(8, 128);  // gpt2-mini: head_dim 32; at cp 2 a slice of 64, chunks of 32
  auto machine = plan::builtin_profile("h100-node");
  auto& dev = machine.devices.front();
  dev.pointwise_s = dev.activation_s = dev.norm_s = dev.op_s = 0;
  dev.attention_curve = {{64, 32, 1e14}, {128, 32, 2e14}};
  plan::Layout cp;
  cp.cp = 2;
  plan::Layout one;
  const auto before = plan::predict(w, cp, machine), one_before = plan::predict(w, one, machine);
  dev.block_attention_curve = {{32, 32, 1e14 / 4}};
  const auto after = plan::predict(w, cp, machine);
  EXPECT_GT(after.compute_s, before.compute_s);
  EXPECT_EQ(plan::predict(w, one, machine).compute_s, one_before.compute_s);
  dev.block_attention_curve = {{32, 32, 1e14}};
  dev.causal_block_cost = 0.5;
  EXPECT_DOUBLE_EQ(plan::predict(w, cp, machine).compute_s, before.compute_s);
}

TEST(MachineProfile, ReadsWritesAndRefusesBadFiles) {
  const auto h100 = plan::builtin_profile("h100-node");
  const auto back = plan::MachineProfile::from_json(h100.to_json(), "back");
  EXPECT_EQ(back.devices.front().matmul_flops, h100.devices.front().matmul_flops);
  EXPECT_EQ(back.link("tp", 2).bandwidth, h100.intra_node.bandwidth);
  // A group within a node of 8 takes the node's link; one across nodes the link between them;
  // a dimension's own (measured) link wins.
  EXPECT_EQ(h100.link("dp", 8).bandwidth, h100.intra_node.bandwidth);
  EXPECT_EQ(h100.link("dp", 16).bandwidth, h100.inter_node.bandwidth);
  auto measured = h100;
  measured.links["dp"] = {1e9, 0};
  EXPECT_EQ(measured.link("dp", 8).bandwidth, 1e9);
  EXPECT_TRUE(contains(error_of([] { plan::builtin_profile("tpu"); }), "h100-node, h200-node"));
  auto refused = [](const std::string& text, const std::string& says) {
    const auto msg = error_of([&] { plan::MachineProfile::from_json(text, "p.json"); });
    EXPECT_TRUE(contains(msg, says) && contains(msg, "p.json")) << msg;
  };
  refused("{\"devices\": [", "not valid JSON");
  auto j = nlohmann::json::parse(h100.to_json());
  j["stage_devices"] = {"h100", "a100"};
  refused(j.dump(), "stage_devices names 'a100', an unknown device (defined: h100)");
  j = nlohmann::json::parse(h100.to_json());
  j["devices"][0]["matmul_flops"] = -1;
  refused(j.dump(), "'matmul_flops' is -1");
  j = nlohmann::json::parse(h100.to_json());
  j["links"].erase("inter_node");
  refused(j.dump(), "'links' has no 'inter_node'");
  j = nlohmann::json::parse(h100.to_json());
  j["links"]["xx"] = {{"bandwidth", 1}, {"latency", 0}};
  refused(j.dump(), "link 'xx' is neither intra_node, inter_node nor a mesh dimension");
  // The measured extras read back, and bad ones are refused.
  auto extras = h100;
  auto& dev = extras.devices.front();
  dev.matmul_curve = {{128, 1e12}, {1024, 5e12}};
  dev.attention_curve = {{512, 64, 2e12}};
  dev.block_attention_curve = {{128, 64, 1e12}};
  dev.causal_block_cost = 0.9;
  dev.compute_scale = 1.25;
  const auto read = plan::MachineProfile::from_json(extras.to_json(), "x").devices.front();
  EXPECT_EQ(read.matmul_curve, dev.matmul_curve);
  EXPECT_EQ(read.attention_curve, dev.attention_curve);
  EXPECT_EQ(read.block_attention_curve, dev.block_attention_curve);
  EXPECT_EQ(read.causal_block_cost, 0.9);
  EXPECT_EQ(read.compute_scale, 1.25);
  EXPECT_EQ(read.op_s, dev.op_s);
  EXPECT_EQ(read.pointwise_s, dev.pointwise_s);
  EXPECT_TRUE(read.ops_overlap_kernels);
  const auto with_extras = nlohmann::json::parse(extras.to_json());
  j = with_extras;
  j["devices"][0]["pointwise_s"] = -1e-9;
  refused(j.dump(), "'pointwise_s' is -1e-09; it must be a number of seconds >= 0");
  j = with_extras;
  j["devices"][0]["matmul_curve"] = {{1024, 1e12}, {128, 5e12}};
  refused(j.dump(),
          "matmul_curve point [128, 5000000000000]; widths and rates must be positive, "
          "widths increasing");
  j = with_extras;
  j["devices"][0]["attention_curve"] = {{512, 64}};
  refused(j.dump(), "each point is [seq, head_dim, flops]");
  j = with_extras;
  j["devices"][0]["block_attention_curve"] = {{128, 0, 1e12}};
  refused(j.dump(),
          "block_attention_curve point [128, 0, 1000000000000]; length, head_dim and "
          "rate must be positive");
  j = with_extras;
  j["devices"][0]["block_attention_curve"] = {{128}};
  refused(j.dump(), "each point is [chunk, head_dim, flops]");
  j = with_extras;
  j["devices"][0]["causal_block_cost"] = 3;
  refused(j.dump(), "causal_block_cost = 3; it must be in (0, 2]");
  j = with_extras;
  j["devices"][0]["compute_scale"] = 0;
  refused(j.dump(), "'compute_scale' is 0");
  j = with_extras;
  j["devices"][0]["ops_overlap_kernels"] = "yes";
  refused(j.dump(), "'ops_overlap_kernels' is \"yes\"; use true or false");
  // Heterogeneous stages: a slower second pipeline rank gets fewer layers, and the step is
  // slower than on two fast ones.
  auto mixed = nlohmann::json::parse(flops_only().to_json());
  auto slow = mixed["devices"][0];
  slow["name"] = "slow";
  slow["matmul_flops"] = slow["matmul_flops"].get<double>() / 4;
  slow["attention_flops"] = slow["attention_flops"].get<double>() / 4;
  mixed["devices"].push_back(slow);
  mixed["stage_devices"] = {"h100", "slow"};
  const auto hetero = plan::MachineProfile::from_json(mixed.dump(), "mixed");
  plan::Layout l;
  l.pp = 2;
  l.micro_batches = 8;
  const auto w = mini();
  const auto on_mixed = plan::predict(w, l, hetero);
  EXPECT_GT(on_mixed.step_s, plan::predict(w, l, flops_only()).step_s);
  ASSERT_EQ(on_mixed.stage_bounds.size(), 3u);
  EXPECT_GT(on_mixed.stage_bounds[1], w.model.n_layers / 2);  // the slow rank: fewer layers
  ASSERT_EQ(on_mixed.rank_memory_bytes.size(), 2u);
  // Planning on it: every layout has its 2 pipeline ranks; a world they do not divide is refused.
  plan::PlanRequest r;
  r.workload = w;
  r.world = 4;
  r.machine = hetero;
  for (const auto& planned : plan::plan_layouts(r)) EXPECT_EQ(planned.layout.pp, 2);
  r.world = 3;
  EXPECT_TRUE(contains(error_of([&] { plan::plan_layouts(r); }),
                       "names devices for 2 pipeline ranks, which do not divide the world of 3"));
  l.pp = 4;
  EXPECT_TRUE(contains(error_of([&] { plan::predict(w, l, hetero); }),
                       "names devices for 2 pipeline ranks; this layout has 4"));
}

// Measuring one process: positive rates that make a valid profile, one device per node, the node
// link a memory copy's and the link between nodes the same (nothing to measure). Small sizes:
// what is checked is the plumbing, not the machine.
TEST(MachineProfile, MeasuresThisProcess) {
  loom::dist::LocalCommunicator one;
  plan::MeasureOptions options;
  options.matmul_size = 64;
  options.attention_seq = 64;
  options.adamw_params = 4096;
  options.repeats = 2;
  options.large_bytes = 1 << 20;
  options.matmul_widths = {16, 32};
  options.matmul_tokens = 64;
  options.attention_seqs = {32};
  options.attention_head_dims = {16, 32};
  options.block_attention_chunks = {8, 16, 32};
  options.pointwise_elements = 4096;
  options.reference_batch = 1;
  options.reference_repeats = 1;
  const auto p = plan::measure_machine(one, options);
  ASSERT_EQ(p.devices.size(), 1u);
  EXPECT_GT(p.devices[0].matmul_flops, 1e6);
  EXPECT_GT(p.devices[0].attention_flops, 1e6);
  EXPECT_GT(p.devices[0].adamw_params_per_s, 1e3);
  EXPECT_GT(p.devices[0].memory_bytes, 1e6);
  EXPECT_EQ(p.devices[0].matmul_curve.size(), 2u);
  EXPECT_EQ(p.devices[0].attention_curve.size(), 2u);
  ASSERT_EQ(p.devices[0].block_attention_curve.size(), 6u);  // per head_dim, per chunk
  for (const auto& [chunk, hd, flops] : p.devices[0].block_attention_curve) EXPECT_GT(flops, 1e6);
  EXPECT_EQ(p.devices[0].block_attention_curve.front()[0], 8);
  EXPECT_TRUE(p.devices[0].causal_block_cost > 0 && p.devices[0].causal_block_cost <= 2);
  EXPECT_GT(p.devices[0].pointwise_s, 0);
  EXPECT_GT(p.devices[0].activation_s, 0);
  EXPECT_GT(p.devices[0].norm_s, 0);
  EXPECT_GT(p.devices[0].op_s, 0);
  // The reference model's measured time over the prediction from these very rates: a model
  // within a factor of 20 of the machine, either way.
  EXPECT_TRUE(p.devices[0].compute_scale > 0.05 && p.devices[0].compute_scale < 20)
      << p.devices[0].compute_scale;
  EXPECT_FALSE(p.devices[0].ops_overlap_kernels);
  EXPECT_EQ(p.devices_per_node, 1);
  EXPECT_EQ(p.inter_node.bandwidth, p.intra_node.bandwidth);
  // What it wrote reads back, and plans.
  const auto back = plan::MachineProfile::from_json(p.to_json(), "measured.json");
  plan::Layout l;
  EXPECT_GT(plan::predict(mini(8, 64), l, back).tokens_per_s, 0);
  options.repeats = 0;
  EXPECT_TRUE(contains(error_of([&] { plan::measure_machine(one, options); }), "repeats 0"));
}

// loom-plan --measure-mesh's layout: NAME=N pieces, the rest defaults; bad pieces named.
TEST(Measure, MeshShapeParsesAndNamesBadPieces) {
  const auto s = loom::dist::MeshShape::parse("tp=2,pp=4");
  EXPECT_EQ(s.tp, 2);
  EXPECT_EQ(s.pp, 4);
  EXPECT_EQ(s.cp, 1);
  EXPECT_EQ(s.dp, 0);
  EXPECT_EQ(loom::dist::MeshShape::parse("dp=3").dp, 3);
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {"tp=0", "'tp=0' is not NAME=N"},
           {"tp=2x", "'tp=2x' is not NAME=N"},
           {"tp", "'tp' is not NAME=N"},
           {"", "'' is not NAME=N"},
           {"tp=2,", "'' is not NAME=N"},
           {"ep=2", "'ep' is not a mesh dimension: dp, tp, pp or cp"},
           {"tp=2,tp=4", "tp is given twice"}}) {
    const auto msg = error_of([&] { loom::dist::MeshShape::parse(text); });
    EXPECT_TRUE(contains(msg, want)) << text << ": " << msg;
  }
}
