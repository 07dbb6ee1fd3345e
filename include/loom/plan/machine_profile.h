#pragma once
// What the cost model knows about a machine: each device's rates (matmul and attention FLOP/s,
// memory, AdamW updates per second), how many devices share a node, and the links between
// them (bandwidth, latency): within a node, between nodes, and optionally one measured per mesh
// dimension. Read from a JSON profile or taken from a built-in one.
//
//   {"devices": [{"name": "h100", "matmul_flops": 6.0e14, "attention_flops": 4.0e14,
//                 "memory_bytes": 8.0e10, "adamw_params_per_s": 9.6e10}],
//    "stage_devices": ["h100", "a100"],          // optional: one per pipeline rank
//    "devices_per_node": 8,
//    "links": {"intra_node": {"bandwidth": 3.6e11, "latency": 5e-6},
//              "inter_node": {"bandwidth": 4.0e10, "latency": 1e-5},
//              "tp": {...}}}                     // optional: dp, tp, pp, cp measured
//
// Rates are per device, links per direction in bytes per second. Without "stage_devices" every
// rank has the first device; with it, pipeline rank r (and its tp, cp and dp peers) runs on the
// device it names: devices of different speeds and memory, as the pipeline partitioner takes
// them. A mesh dimension without a link of its own uses the node's link when its groups fit in
// one node (the mesh places tp innermost, then cp, dp, pp), else the link between nodes.
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
};

// Built-in profiles, from vendors' datasheets discounted to what dense training typically
// reaches (docs/planner.md lists the figures): "h100-node" (8 x H100 SXM per node: NVLink for
// tp and cp, InfiniBand 400 Gb/s for pp and dp), "h200-node" (the same with H200's memory).
// Unknown names are a loom::Error listing them.
MachineProfile builtin_profile(const std::string& name);
std::vector<std::string> builtin_profile_names();

}  // namespace loom::plan
