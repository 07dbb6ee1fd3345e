#pragma once
// Which transport each group of the mesh uses, decided once from where every rank's tensors live
// (--dist-backend auto|nccl|mpi). NCCL needs the ranks of a group on distinct GPUs; ranks that
// share a GPU (2-rank tests on one device, a heterogeneous node with fewer GPUs than ranks)
// communicate over MPI, which takes CUDA tensors directly when Open MPI is CUDA-aware and
// otherwise through host buffers (StagingCommunicator). A pure function of its inputs, so every
// rank computes the same plan and the rules are tested with made-up device maps.
#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "loom/dist/mesh.h"

namespace loom::dist {

enum class BackendChoice { automatic, nccl, mpi };
// "auto" | "nccl" | "mpi"; anything else is a loom::Error naming the value and the choices.
BackendChoice parse_backend_choice(std::string_view name);
std::string to_string(BackendChoice choice);

enum class Transport {
  local,       // a group of one rank: nothing crosses a process boundary
  mpi,         // CPU tensors over MPI
  nccl,        // CUDA tensors over NCCL
  mpi_cuda,    // CUDA tensors handed to a CUDA-aware MPI
  mpi_staged,  // CUDA tensors copied to host buffers, sent over MPI, copied back
};
std::string to_string(Transport t);

// Where one rank's tensors live: its host and CUDA device (-1: the CPU), and that GPU's identity
// (cuda_gpu_id; "" when unknown). Two ranks share a GPU when host and identity agree
// (host and index when an identity is missing): under per-rank CUDA_VISIBLE_DEVICES every rank
// sees its own GPU as device 0.
struct RankDevice {
  std::string host;
  int device = -1;
  std::string gpu_id;
};

struct BackendPlan {
  std::array<Transport, kNumDims> dims{Transport::local, Transport::local, Transport::local,
                                       Transport::local};
  Transport of(Dim d) const { return dims[static_cast<size_t>(d)]; }
  // "dp nccl, tp mpi (CUDA tensors staged through host memory), pp local"
  std::string describe(const MeshShape& shape) const;
};

struct BackendFacts {
  bool nccl_available = false;  // the build has NCCL (nccl_available())
  bool mpi_cuda_aware = false;  // Open MPI takes device pointers (mpi_cuda_aware())
};

// The plan for a mesh of `shape` (resolved: dp filled in) whose world rank r keeps its tensors on
// devices[r]. Errors (loom::Error, naming ranks and devices): a device map of the wrong length; a
// group mixing CPU and CUDA ranks; nccl asked for on CPU ranks, in a build without NCCL, or for a
// group whose ranks share a GPU.
BackendPlan plan_backends(const MeshShape& shape, const std::vector<RankDevice>& devices,
                          BackendChoice choice, const BackendFacts& facts);

// The CUDA device of a rank started with `--device DEVICE` on a node with `device_count` visible
// GPUs: "cuda" spreads the node's ranks over its GPUs (local rank modulo the count, so ranks share
// GPUs when there are more ranks than GPUs: the plan then puts their groups on MPI), "cuda:K"
// puts every rank on GPU K; -1 for "cpu". A loom::Error naming the flag's value when the device
// does not exist (no GPU visible, or K >= device_count).
int rank_cuda_device(const std::string& device, int local_rank, int device_count,
                     bool built_with_cuda);

}  // namespace loom::dist
