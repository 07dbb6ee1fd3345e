#pragma once
// A communicator for CUDA tensors over a backend that only moves host memory (MPI without CUDA
// support): every op copies the tensors it reads into host buffers (pinned, for CUDA tensors),
// runs on the wrapped communicator, and copies what it wrote back when the caller waits. Used
// for the mesh groups whose ranks share a GPU (BackendPlan's Transport::mpi_staged), where NCCL
// cannot run. The copies are synchronous on the caller's current stream: correct first; their
// cost is the price of sharing a GPU between ranks.
#include "loom/dist/communicator.h"

namespace loom::dist {

class StagingCommunicator : public Communicator {
 public:
  // Takes the wrapped communicator's ranks and name; ops run on it.
  explicit StagingCommunicator(CommunicatorPtr inner);

  std::string backend() const override { return inner_->backend() + "+staging"; }
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;
  const CommunicatorPtr& inner() const { return inner_; }

 protected:
  WorkPtr launch(Call call) override;
  // Any device: CPU tensors are staged too (the copies then stay on the host, which is how the
  // staging is tested without a GPU).
  std::optional<std::string> check_device(const at::Tensor&) const override { return std::nullopt; }

 private:
  CommunicatorPtr inner_;
};

}  // namespace loom::dist
