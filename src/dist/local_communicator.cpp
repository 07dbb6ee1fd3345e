#include "loom/dist/local_communicator.h"

#include <ATen/ATen.h>

#include "loom/core/error.h"

namespace loom::dist {

LocalCommunicator::LocalCommunicator(std::string name) : Communicator(std::move(name), 0, 1) {}

std::shared_ptr<Communicator> LocalCommunicator::split(int color, int, const std::string& name) {
  if (color < 0) return nullptr;
  auto comm = std::make_shared<LocalCommunicator>(name);
  comm->set_timeout(timeout());
  comm->set_debug(debug());
  return in_family(comm);
}

std::optional<std::string> LocalCommunicator::check_device(const at::Tensor&) const {
  return std::nullopt;
}

WorkPtr LocalCommunicator::launch(Call call) {
  auto work = std::make_shared<HostWork>(call.info);
  work->mark_started();
  try {
    switch (call.kind()) {
      case OpKind::ReduceScatter:
      case OpKind::AllGather:
      case OpKind::AllToAll:
        // One rank: the output is the input (reduce over one, gather of one, exchange with self).
        call.output.view({-1}).copy_(call.input.reshape({-1}));
        break;
      case OpKind::AllReduce:  // sum, avg and max of one tensor are the tensor
      case OpKind::Broadcast:
      case OpKind::Barrier:
        break;
      case OpKind::Send:
      case OpKind::Recv:
      case OpKind::Split:
        fail("internal: {} is not an op of the local communicator", to_string(call.kind()));
    }
    work->complete();
  } catch (...) {
    work->complete(std::current_exception());
  }
  return work;
}

}  // namespace loom::dist
