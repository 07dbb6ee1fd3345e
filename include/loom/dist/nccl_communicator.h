#pragma once
// The NCCL backend, for CUDA tensors. Each communicator owns one CUDA stream; an op first makes
// that stream wait for the caller's current stream (so its inputs are ready), runs there, and
// records an event. Work::wait() makes the caller's current stream wait for that event: the host
// does not block, and later kernels on the caller's stream see the result. The tensors' memory
// is marked as used on the communication stream, so the caching allocator cannot hand it out
// again before the op is done.
#include <string>

#include "loom/dist/communicator.h"

namespace loom::dist {

// True when this build has the NCCL backend (CUDA builds).
bool nccl_available();

// The identity of CUDA device `device` whatever index this process sees it under ("GPU-" and its
// UUID, as nvidia-smi prints it); "" without CUDA or such a device. Ranks started with their own
// CUDA_VISIBLE_DEVICES all see their GPU as device 0: this tells the backend plan whether they
// share one.
std::string cuda_gpu_id(int device);

// An NCCL communicator over the same ranks as `bootstrap` (an MPI communicator): rank 0 creates
// the NCCL unique id and broadcasts it through `bootstrap`. Collective over `bootstrap`; every
// rank passes the CUDA device it uses. `bootstrap` is kept for split() and the debug check.
// Throws loom::Error in a build without NCCL or on a machine without that device.
CommunicatorPtr make_nccl_communicator(CommunicatorPtr bootstrap, int device,
                                       const std::string& name);

}  // namespace loom::dist
