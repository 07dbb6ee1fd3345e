#include "loom/dist/op.h"

#include <c10/core/ScalarType.h>
#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace loom::dist {

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
  }
  return "?";
}

std::string to_string(OpKind kind) {
  switch (kind) {
    case OpKind::AllReduce:
      return "all_reduce";
    case OpKind::ReduceScatter:
      return "reduce_scatter";
    case OpKind::AllGather:
      return "all_gather";
    case OpKind::Broadcast:
      return "broadcast";
    case OpKind::AllToAll:
      return "all_to_all";
    case OpKind::Barrier:
      return "barrier";
    case OpKind::Send:
      return "send";
    case OpKind::Recv:
      return "recv";
    case OpKind::Split:
      return "split";
  }
  return "?";
}

std::string OpFingerprint::op() const {
  const auto k = static_cast<OpKind>(kind);
  const auto name = to_string(k);
  switch (k) {
    case OpKind::AllReduce:
    case OpKind::ReduceScatter:
      return fmt::format("{}({})", name, to_string(static_cast<ReduceOp>(reduce)));
    case OpKind::Broadcast:
      return fmt::format("{}(root {})", name, root);
    case OpKind::Send:
      return fmt::format("{}(to {}, tag {})", name, root, tag);
    case OpKind::Recv:
      return fmt::format("{}(from {}, tag {})", name, root, tag);
    default:
      return name;
  }
}

std::string OpFingerprint::tensor() const {
  if (dtype < 0) return "";
  std::vector<int64_t> d(dims.begin(), dims.begin() + std::min<int64_t>(ndim, kMaxDims));
  auto s = fmt::format("{}[{}{}]", c10::toString(static_cast<c10::ScalarType>(dtype)),
                       fmt::join(d, ", "), ndim > kMaxDims ? ", ..." : "");
  if (ndim > kMaxDims) s += fmt::format(" ({} elements)", numel);
  return s;
}

std::string OpFingerprint::describe() const {
  const auto t = tensor();
  return fmt::format("{} #{}{}{}", op(), seq, t.empty() ? "" : " ", t);
}

std::string OpInfo::describe() const {
  const auto t = call.tensor();
  return fmt::format("{} #{} on group '{}' (rank {} of {}; world rank {}, local rank {}){}{}",
                     call.op(), call.seq, group, group_rank, group_size, world_rank, local_rank,
                     t.empty() ? "" : " ", t);
}

double wire_bytes(OpKind kind, double payload_bytes, int group_size, bool is_root) {
  const double r = group_size;
  switch (kind) {
    case OpKind::AllReduce:
      return 2.0 * (r - 1) / r * payload_bytes;
    case OpKind::ReduceScatter:
    case OpKind::AllToAll:
      return (r - 1) / r * payload_bytes;
    case OpKind::AllGather:
      return (r - 1) * payload_bytes;
    case OpKind::Broadcast:
      return is_root && group_size > 1 ? payload_bytes : 0.0;
    case OpKind::Send:
      return payload_bytes;
    case OpKind::Recv:
    case OpKind::Barrier:
    case OpKind::Split:
      return 0.0;
  }
  return 0.0;
}

}  // namespace loom::dist
