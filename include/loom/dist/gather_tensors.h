#pragma once
// Collecting named tensors of different names and shapes from every rank of a group onto one
// rank: what a pipeline's stages send rank 0 when it writes a checkpoint or an export.
#include "loom/core/safetensors.h"
#include "loom/dist/communicator.h"

namespace loom::dist {

// Point-to-point over `comm`: every rank but `root` sends `mine` (any names, shapes and devices;
// each travels on the group's device: the host over MPI, the GPU over NCCL); `root` returns its
// own tensors followed by rank 1's, rank 2's, ... in rank order, all of them on the host (its own
// copied there from a GPU), and the others return nothing. Every rank of `comm` must call it. For
// checkpoints and exports: each tensor costs a few messages and a host sync.
core::NamedTensors gather_named_tensors(Communicator& comm, int root,
                                        const core::NamedTensors& mine);

// Every rank gets every rank's tensors (its own first, then the others' in rank order): one
// gather_named_tensors per rank, so meant for small groups (a pipeline) and modest sizes.
core::NamedTensors all_gather_named_tensors(Communicator& comm, const core::NamedTensors& mine);

}  // namespace loom::dist
