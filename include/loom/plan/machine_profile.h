#pragma once
// What the cost model knows about a machine: each device's rates (matmul and attention FLOP/s,
// memory, AdamW updates per second), how many devices share a node, and the links between
// them (bandwidth, latency): within a node, between nodes, and optionally one measured per mesh
// dimension. Read from a JSON profile or taken from a built-in one.
//
//   {"devices": [{"name": "h100", "matmul_flops": 6.0e14, "attention_flops": 4.0e14,
//                 "memory_bytes": 8.0e10, "adamw_params_per_s": 9.6e10,
//                 // optional (loom-plan --measure writes them):
//                 "matmul_curve": [[256, 2.1e14], [4096, 6.0e14]],
//                 "attention_curve": [[512, 64, 1.9e14], [4096, 128, 4.2e14]],
//                 "block_attention_curve": [[64, 64, 1.1e14]], "causal_block_cost": 0.5,
//                 "pointwise_s": 8e-12, "activation_s": 6e-12, "norm_s": 7e-12,
//                 "op_s": 1e-5, "ops_overlap_kernels": true, "compute_scale": 1.2}],
//    "stage_devices": ["h100", "a100"],          // optional: one per pipeline rank
//    "devices_per_node": 8,
//    "collective_s": 2e-5,                       // optional
//    "links": {"intra_node": {"bandwidth": 3.6e11, "latency": 5e-6},
//              "inter_node": {"bandwidth": 4.0e10, "latency": 1e-5},
//              "tp": {...}}}                     // optional: dp, tp, pp, cp measured
//
// Rates are per device, links per direction in bytes per second. Without "stage_devices" every
// rank has the first device; with it, pipeline rank r (and its tp, cp and dp peers) runs on the
// device it names: devices of different speeds and memory, as the pipeline partitioner takes
// them. A mesh dimension without a link of its own uses the node's link when its groups fit in
// one node (the mesh places tp innermost, then cp, dp, pp), else the link between nodes.
#include <array>
#include <map>
#include <string>
#include <vector>

namespace loom::plan {

struct DeviceProfile {
  std::string name;
  double matmul_flops = 0;        // dense matmul FLOP/s in the training precision
  double attention_flops = 0;     // causal attention FLOP/s (forward and backward alike)
  double memory_bytes = 0;        // what a rank may hold
  double adamw_params_per_s = 0;  // AdamW update rate

  // Optional, measured by loom-plan --measure (absent: the flat rates above, nothing else).
  // matmul_curve: (width, FLOP/s) of [tokens, width] x [width, width] products, widths
  // increasing: small matmuls run below the large one's rate. attention_curve: (sequence,
  // head_dim, FLOP/s) of causal attention forward and backward, FLOPs counted as 3x forward's.
  std::vector<std::array<double, 2>> matmul_curve;
  std::vector<std::array<double, 3>> attention_curve;
  // block_attention_curve: (chunk, head_dim, FLOP/s) of ring attention's full chunk x chunk
  // blocks (context parallelism): partial forward, the merge into the running result and
  // backward, FLOPs counted as 3x the forward's 4 chunk^2 head_dim per head. These blocks run
  // outside the fused kernel on some devices (loom's CPU path materializes their scores), so
  // their rate is their own. causal_block_cost: a causal (diagonal) block's time over a full
  // one's: about 1/2 where a kernel skips the masked half, about 1 where the scores are computed
  // whole (a rank runs 2 cp - 1 full blocks and 2 causal ones).
  std::vector<std::array<double, 3>> block_attention_curve;
  double causal_block_cost = 0.5;
  // Seconds per element of one op's forward and backward: an elementwise product (pointwise),
  // the tanh GELU (activation), a LayerNorm over rows (norm); and per op (forward and
  // backward) whatever its size: the framework's dispatch and autograd bookkeeping.
  double pointwise_s = 0, activation_s = 0, norm_s = 0, op_s = 0;
  // Whether that per-op time overlaps the kernels (a GPU: the host queues ops while the device
  // runs earlier ones; a step takes the longer of the two) or adds to them (a CPU).
  bool ops_overlap_kernels = false;
  // Measured over predicted time of a reference model's forward and backward (gpt2-tiny, 8 x
  // 128 tokens: loom-plan --measure): what the op classes above leave out (the allocator,
  // caches shared by ranks, autograd's graph). Scales every stage's compute; 1 without one.
  double compute_scale = 1;
  // Dense peak FLOP/s in the training precision, for MFU (0: unknown, no MFU predicted).
  double peak_flops = 0;

  // The matmul rate at `width` (the curve interpolated in log width and clamped at its ends;
  // matmul_flops without one); the attention rate at (seq, head_dim) (the measured head_dim
  // nearest in log, interpolated in log seq; attention_flops without a curve).
  double matmul_rate(double width) const;
  double attention_rate(double seq, double head_dim) const;
  // Seconds of the forward share of a cp rank's ring attention: `flops` (its causal attention's
  // forward FLOPs) over `cp` ranks in blocks of `chunk` tokens. With a block curve: 2 cp - 1 full
  // blocks and 2 causal ones at the curve's rate (read as attention_rate reads its own); without
  // one, the fused kernel's rate at the rank's slice of two chunks.
  double ring_attention_seconds(double flops, int64_t cp, double chunk, double head_dim) const;
};

struct Link {
  double bandwidth = 0;  // bytes per second, one direction
  double latency = 0;    // seconds per message
};

struct MachineProfile {
  std::string name;  // where it came from: the file, or the built-in profile's name
  std::vector<DeviceProfile> devices;
  std::vector<std::string> stage_devices;  // per pipeline rank; empty: every rank has devices[0]
  int64_t devices_per_node = 8;
  Link intra_node, inter_node;
  // Seconds a blocking collective costs beyond moving its bytes, while the ranks compute
  // around it (handing it to the communication thread, waiting for the slowest rank): measured
  // by timing small all-reduces between matmuls. Each tp, cp, ZeRO and dp collective on a
  // step's path pays it once.
  double collective_s = 0;
  std::map<std::string, Link> links;  // measured per mesh dimension: "dp", "tp", "pp", "cp"

  // The device of pipeline rank `rank` of `ranks`; a list of another length is a loom::Error.
  const DeviceProfile& device_of_stage(int64_t rank, int64_t ranks) const;
  // The link of mesh dimension `dim` ("dp", "tp", "pp", "cp") whose groups span `span`
  // consecutive ranks (tp: tp; cp: tp x cp; dp: tp x cp x dp; pp: the world): its own when the
  // profile has one, else the node's or the one between nodes.
  const Link& link(const std::string& dim, int64_t span) const;

  // Throws loom::Error naming `source` and what is wrong: no devices, a rate that is not a
  // positive number, a stage naming a device the profile does not define, a missing link, a
  // link that is not a mesh dimension.
  void validate(const std::string& source) const;
  std::string to_json() const;
  static MachineProfile from_json(const std::string& text, const std::string& source);
  static MachineProfile load(const std::string& path);
  // A built-in profile's name, or the file `name` holds.
  static MachineProfile named(const std::string& name);
  // Whether `name` is a built-in profile or a file holding a profile (a JSON object with
  // "links"), rather than the pipeline partitioner's device file ({"devices": [{"speed"...}]}).
  static bool is_profile(const std::string& name);
};

// Built-in profiles, from vendors' datasheets discounted to what dense training typically
// reaches (docs/planner.md lists the figures): "h100-node" (8 x H100 SXM per node: NVLink for
// tp and cp, InfiniBand 400 Gb/s for pp and dp), "h200-node" (the same with H200's memory).
// Unknown names are a loom::Error listing them.
MachineProfile builtin_profile(const std::string& name);
std::vector<std::string> builtin_profile_names();

}  // namespace loom::plan
