#pragma once
// A group of one rank: the communicator of a process started without mpirun, and of every mesh
// dimension of size 1 there. Each collective is what it means for a single rank (all_reduce
// leaves the tensor as it is, all_gather copies); it needs no MPI, so the library works in a
// plain single-process program.
#include "loom/dist/communicator.h"

namespace loom::dist {

class LocalCommunicator : public Communicator {
 public:
  explicit LocalCommunicator(std::string name = "world");
  std::string backend() const override { return "local"; }
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;

 protected:
  WorkPtr launch(Call call) override;
  std::optional<std::string> check_device(const at::Tensor& t) const override;
};

}  // namespace loom::dist
