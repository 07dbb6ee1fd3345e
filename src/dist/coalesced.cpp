#include "loom/dist/coalesced.h"

#include <ATen/ATen.h>

namespace loom::dist {

void all_reduce_coalesced(Communicator& comm, const std::vector<at::Tensor>& parts, ReduceOp op) {
  if (parts.size() == 1 && parts.front().is_contiguous()) {
    if (parts.front().numel() > 0) comm.all_reduce(parts.front(), op);
    return;
  }
  std::vector<at::Tensor> flat_parts;
  for (const auto& p : parts) flat_parts.push_back(p.reshape({-1}));
  if (flat_parts.empty()) return;
  auto flat = at::cat(flat_parts);
  if (flat.numel() == 0) return;
  comm.all_reduce(flat, op);
  int64_t offset = 0;
  for (const auto& p : parts) {
    const int64_t n = p.numel();
    p.copy_(flat.narrow(0, offset, n).view_as(p));
    offset += n;
  }
}

}  // namespace loom::dist
