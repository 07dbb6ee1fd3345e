#include "loom/dist/gather_tensors.h"

#include <ATen/ATen.h>

#include <cstring>

#include "loom/core/error.h"

namespace loom::dist {

namespace {

// Each tensor travels as a header (dtype, rank, sizes, name length), its name's bytes, then its
// data; a first message gives the count. One tag throughout: messages with one tag between two
// ranks arrive in order.
constexpr int kTag = 7100;
constexpr int64_t kMaxDims = 8;

}  // namespace

core::NamedTensors gather_named_tensors(Communicator& comm, int root,
                                        const core::NamedTensors& mine) {
  LOOM_CHECK(root >= 0 && root < comm.size(), "gather_named_tensors: root {} outside [0, {})", root,
             comm.size());
  if (comm.rank() != root) {
    comm.send(on_comm_device(comm, at::full({1}, static_cast<int64_t>(mine.size()), at::kLong)),
              root, kTag);
    for (const auto& [name, tensor] : mine) {
      const auto t = on_comm_device(comm, tensor.detach()).contiguous();
      LOOM_CHECK(t.dim() <= kMaxDims, "gather_named_tensors: '{}' has {} dimensions (at most {})",
                 name, t.dim(), kMaxDims);
      auto header = at::zeros({kMaxDims + 3}, at::kLong);
      auto h = header.accessor<int64_t, 1>();
      h[0] = static_cast<int64_t>(t.scalar_type());
      h[1] = t.dim();
      h[2] = static_cast<int64_t>(name.size());
      for (int64_t d = 0; d < t.dim(); ++d) h[d + 3] = t.size(d);
      auto name_bytes = at::empty({static_cast<int64_t>(name.size())}, at::kByte);
      std::memcpy(name_bytes.data_ptr(), name.data(), name.size());
      comm.send(on_comm_device(comm, header), root, kTag);
      if (!name.empty()) comm.send(on_comm_device(comm, name_bytes), root, kTag);
      if (t.numel() > 0) comm.send(t, root, kTag);
    }
    return {};
  }
  // Received on the group's device (a GPU for NCCL), returned on the host.
  const auto device = comm.tensor_device().value_or(at::Device(at::kCPU));
  const auto receive = [&](at::IntArrayRef sizes, at::ScalarType dtype, int src) {
    auto t = at::empty(sizes, at::TensorOptions(dtype).device(device));
    if (t.numel() > 0) comm.recv(t, src, kTag);
    return t.cpu();
  };
  // The root's own tensors too: a caller gets one device for all of them.
  core::NamedTensors out;
  for (const auto& [name, tensor] : mine) out.emplace_back(name, tensor.detach().cpu());
  for (int src = 0; src < comm.size(); ++src) {
    if (src == root) continue;
    const auto count = receive({1}, at::kLong, src).item<int64_t>();
    for (int64_t i = 0; i < count; ++i) {
      const auto header = receive({kMaxDims + 3}, at::kLong, src);
      auto h = header.accessor<int64_t, 1>();
      std::string name(static_cast<size_t>(h[2]), '\0');
      if (h[2] > 0) {
        const auto name_bytes = receive({h[2]}, at::kByte, src);
        std::memcpy(name.data(), name_bytes.data_ptr(), name.size());
      }
      std::vector<int64_t> sizes;
      for (int64_t d = 0; d < h[1]; ++d) sizes.push_back(h[d + 3]);
      out.emplace_back(std::move(name), receive(sizes, static_cast<at::ScalarType>(h[0]), src));
    }
  }
  return out;
}

core::NamedTensors all_gather_named_tensors(Communicator& comm, const core::NamedTensors& mine) {
  core::NamedTensors out;
  for (int root = 0; root < comm.size(); ++root) {
    auto got = gather_named_tensors(comm, root, mine);
    if (root == comm.rank()) out = std::move(got);
  }
  return out;
}

}  // namespace loom::dist
