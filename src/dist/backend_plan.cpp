#include "loom/dist/backend_plan.h"

#include <fmt/format.h>

#include <map>
#include <utility>

#include "loom/core/error.h"

namespace loom::dist {

BackendChoice parse_backend_choice(std::string_view name) {
  if (name == "auto") return BackendChoice::automatic;
  if (name == "nccl") return BackendChoice::nccl;
  if (name == "mpi") return BackendChoice::mpi;
  fail("--dist-backend '{}' is not one of auto, nccl, mpi", name);
}

std::string to_string(BackendChoice choice) {
  switch (choice) {
    case BackendChoice::automatic:
      return "auto";
    case BackendChoice::nccl:
      return "nccl";
    case BackendChoice::mpi:
      return "mpi";
  }
  return "?";
}

std::string to_string(Transport t) {
  switch (t) {
    case Transport::local:
      return "local";
    case Transport::mpi:
      return "mpi";
    case Transport::nccl:
      return "nccl";
    case Transport::mpi_cuda:
      return "mpi (CUDA-aware: device memory passed directly)";
    case Transport::mpi_staged:
      return "mpi (CUDA tensors staged through host memory)";
  }
  return "?";
}

std::string BackendPlan::describe(const MeshShape& shape) const {
  std::string out;
  for (const Dim d : {Dim::dp, Dim::tp, Dim::pp, Dim::cp}) {
    if (shape.size(d) == 1) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {}", to_string(d), to_string(of(d)));
  }
  return out.empty() ? "one rank: no communication" : out;
}

namespace {

std::string describe_device(const RankDevice& d) {
  if (d.device < 0) return fmt::format("the CPU of {}", d.host);
  if (d.gpu_id.empty()) return fmt::format("cuda:{} of {}", d.device, d.host);
  return fmt::format("cuda:{} ({}) of {}", d.device, d.gpu_id, d.host);
}

}  // namespace

BackendPlan plan_backends(const MeshShape& shape, const std::vector<RankDevice>& devices,
                          BackendChoice choice, const BackendFacts& facts) {
  LOOM_CHECK(static_cast<int64_t>(devices.size()) == shape.product(),
             "backend plan: {} ranks' devices for a mesh of {} = {} ranks", devices.size(),
             shape.describe(), shape.product());
  BackendPlan plan;
  // The group along d holds the ranks whose other coordinates agree: with tp innermost, a
  // rank's coordinate along dimension k is (rank / stride_k) % size_k.
  std::array<int64_t, kNumDims> stride{};
  int64_t s = 1;
  for (int k = 0; k < kNumDims; ++k) {
    stride[static_cast<size_t>(k)] = s;
    s *= shape.size(static_cast<Dim>(k));
  }
  for (int k = 0; k < kNumDims; ++k) {
    const auto dim = static_cast<Dim>(k);
    const int64_t n = shape.size(dim), step = stride[static_cast<size_t>(k)];
    if (n == 1) continue;  // local
    bool any_cuda = false, all_distinct = true;
    std::string shared;  // the first pair of ranks of one group on one GPU, for the message
    for (int64_t first = 0; first < shape.product(); ++first) {
      if ((first / step) % n != 0) continue;  // each group once, from its coordinate-0 rank
      const bool cuda = devices[static_cast<size_t>(first)].device >= 0;
      any_cuda = any_cuda || cuda;
      std::map<std::pair<std::string, std::string>, int64_t> seen;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = first + i * step;
        const auto& d = devices[static_cast<size_t>(r)];
        LOOM_CHECK((d.device >= 0) == cuda,
                   "the {} group of ranks {} and {} mixes devices: {} and {}; every rank of a "
                   "run keeps its tensors on one kind of device (--device)",
                   to_string(dim), first, r, describe_device(devices[static_cast<size_t>(first)]),
                   describe_device(d));
        const auto gpu = d.gpu_id.empty() ? std::to_string(d.device) : d.gpu_id;
        const auto [it, inserted] = seen.emplace(std::pair{d.host, gpu}, r);
        if (!inserted && cuda && all_distinct) {
          all_distinct = false;
          shared = fmt::format("ranks {} and {} share {}", it->second, r, describe_device(d));
        }
      }
    }
    Transport& t = plan.dims[static_cast<size_t>(k)];
    if (!any_cuda) {
      LOOM_CHECK(choice != BackendChoice::nccl,
                 "--dist-backend nccl: the {} group's tensors are on the CPU, and NCCL only "
                 "moves CUDA tensors (use --device cuda, or --dist-backend auto|mpi)",
                 to_string(dim));
      t = Transport::mpi;
      continue;
    }
    const Transport over_mpi = facts.mpi_cuda_aware ? Transport::mpi_cuda : Transport::mpi_staged;
    switch (choice) {
      case BackendChoice::nccl:
        LOOM_CHECK(facts.nccl_available,
                   "--dist-backend nccl: this loom was built without NCCL (use --dist-backend "
                   "mpi, or a CUDA build)");
        LOOM_CHECK(all_distinct,
                   "--dist-backend nccl: in the {} group {}, and NCCL needs one GPU per rank "
                   "of a group (use --dist-backend auto or mpi, or give each rank its own GPU)",
                   to_string(dim), shared);
        t = Transport::nccl;
        break;
      case BackendChoice::mpi:
        t = over_mpi;
        break;
      case BackendChoice::automatic:
        t = facts.nccl_available && all_distinct ? Transport::nccl : over_mpi;
        break;
    }
  }
  return plan;
}

int rank_cuda_device(const std::string& device, int local_rank, int device_count,
                     bool built_with_cuda) {
  if (device == "cpu") return -1;
  int index = -1;
  if (device == "cuda") {
    index = device_count > 0 ? local_rank % device_count : 0;
  } else {
    const std::string prefix = "cuda:";
    LOOM_CHECK(device.starts_with(prefix) && device.size() > prefix.size() &&
                   device.find_first_not_of("0123456789", prefix.size()) == std::string::npos &&
                   device.size() - prefix.size() <= 6,
               "--device '{}' is not valid: cpu, cuda or cuda:N (N a device index)", device);
    index = std::stoi(device.substr(prefix.size()));
  }
  LOOM_CHECK(index < device_count,
             "--device {}: there is no such CUDA device ({} visible; this loom was built {} CUDA)",
             device, device_count, built_with_cuda ? "with" : "without");
  return index;
}

}  // namespace loom::dist
