#pragma once
// Measuring a machine for the cost model (loom-plan --measure): each rank times matmuls,
// causal attention and AdamW on its device, and the ranks time all-reduces within a node and
// between nodes; rank 0 gets the profile. Collective over `world`.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "loom/dist/communicator.h"
#include "loom/plan/machine_profile.h"

namespace loom::plan {

struct MeasureOptions {
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;  // the training precision's compute dtype
  int64_t matmul_size = 1024;         // n of the n x n x n products timed
  int64_t attention_seq = 512;        // tokens of the attention timed (8 heads of 64)
  int64_t adamw_params = int64_t{1} << 22;
  int64_t repeats = 5;  // timed runs after a warm-up; the median is kept
  // The all-reduces timed: a small buffer (latency) and a large one (bandwidth), in bytes.
  int64_t small_bytes = 4 << 10;
  int64_t large_bytes = 32 << 20;
};

// Per device the slowest rank's rates (a homogeneous profile: name per-rank devices in the file
// by hand for mixed machines); memory: the device's (a GPU's total, or the host's physical
// memory divided among the ranks on it). Links: all-reduces among the ranks of a node
// (intra_node) and among one rank per node (inter_node); bandwidth and latency fitted from
// the two sizes by the ring formula. With one rank on a node, the node link is a host memory
// copy's bandwidth; with one node, inter_node is set to intra_node (nothing to measure). The
// all-reduces are of host buffers over the world's communicator (MPI): on GPUs they measure MPI
// between hosts, not NVLink or NCCL; write a GPU node's links into the file by hand.
MachineProfile measure_machine(dist::Communicator& world, const MeasureOptions& options = {});

}  // namespace loom::plan
