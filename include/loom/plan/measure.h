#pragma once
// Measuring a machine for the cost model (loom-plan --measure): each rank times matmuls,
// causal attention and AdamW on its device, and the ranks time all-reduces within a node and
// between nodes; rank 0 gets the profile. Collective over `world`.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/dist/communicator.h"
#include "loom/dist/mesh.h"
#include "loom/plan/machine_profile.h"

namespace loom::plan {

struct MeasureOptions {
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;  // the training precision's compute dtype
  int64_t matmul_size = 1024;         // n of the n x n x n products timed
  int64_t attention_seq = 512;        // tokens of the attention timed (8 heads of 64)
  int64_t adamw_params = int64_t{1} << 22;
  // The curves: [matmul_tokens, w] x [w, w] products for each width w, and causal attention
  // forward and backward (8 heads) for each sequence length and head_dim.
  std::vector<int64_t> matmul_widths{64, 128, 256, 512, 1024};
  int64_t matmul_tokens = 4096;
  std::vector<int64_t> attention_seqs{128, 512};
  std::vector<int64_t> attention_head_dims{32, 64, 128};
  // Ring attention's blocks (context parallelism), for each chunk length and head_dim:
  // [4, 8 heads, chunk, head_dim], a full and a causal one, forward, merge and backward.
  std::vector<int64_t> block_attention_chunks{16, 64, 256};
  // Elements of the elementwise ops timed (a product, the tanh GELU, a LayerNorm of rows of
  // 256), and the chain of tiny ops whose forward and backward give the per-op time.
  int64_t pointwise_elements = int64_t{1} << 20;
  int64_t op_chain = 64;
  // Sequences of 128 tokens in the reference model timed for compute_scale (0: not measured).
  int64_t reference_batch = 8;
  // Its samples (the fastest is kept): more than the rates', as it scales every prediction.
  int64_t reference_repeats = 15;

  int64_t repeats = 5;  // timed samples (each of runs lasting ~5 ms) after a warm-up; the median
  // The all-reduces timed: a small buffer (latency) and a large one (bandwidth), in bytes.
  int64_t small_bytes = 4 << 10;
  int64_t large_bytes = 32 << 20;

  // The options for `device` in `precision` (fp32 | bf16 | fp64; anything else a loom::Error):
  // on a GPU larger matmuls, longer attention and more elements, where small ones would time
  // launches instead.
  static MeasureOptions for_device(at::Device device, const std::string& precision);
};

// Per device the slowest rank's rates and curves (a homogeneous profile: name per-rank devices in
// the file by hand for mixed machines); memory: the device's (a GPU's total, or the host's physical
// memory divided among the ranks on it). Links: all-reduces among the ranks of a node
// (intra_node) and among one rank per node (inter_node); bandwidth and latency fitted from
// the two sizes by the ring formula. With one rank on a node, the node link is a host memory
// copy's bandwidth; with one node, inter_node is set to intra_node (nothing to measure). The
// all-reduces are of host buffers over the world's communicator (MPI): on GPUs they measure MPI
// between hosts, not NVLink or NCCL; write a GPU node's links into the file by hand.
MachineProfile measure_machine(dist::Communicator& world, const MeasureOptions& options = {});

// The links of one layout's mesh dimensions, for the profile's "links": for each dimension of
// `shape` larger than 1 ("dp", "tp", "pp", "cp"), an all-reduce over its groups (every group of
// that dimension at once, as in training), bandwidth and latency fitted as the node links are,
// the slowest group's. Its groups are those the trainer builds (dist::Mesh: tp innermost), so a
// dimension whose groups span nodes is timed across them. Collective over `world`; every rank
// returns the same links. `shape` must fit the world (dp 0: what the others leave).
std::map<std::string, Link> measure_mesh_links(const dist::CommunicatorPtr& world,
                                               const dist::MeshShape& shape,
                                               const MeasureOptions& options = {});

}  // namespace loom::plan
