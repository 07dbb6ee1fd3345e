#include "loom/dist/mesh.h"

#include <algorithm>
#include <charconv>
#include <set>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "loom/core/error.h"
#include "loom/dist/backend_plan.h"
#include "loom/dist/local_communicator.h"
#include "loom/dist/nccl_communicator.h"
#include "loom/dist/staging_communicator.h"

namespace loom::dist {

std::string to_string(Dim d) {
  switch (d) {
    case Dim::tp:
      return "tp";
    case Dim::cp:
      return "cp";
    case Dim::dp:
      return "dp";
    case Dim::pp:
      return "pp";
  }
  return "?";
}

int64_t MeshShape::size(Dim d) const {
  switch (d) {
    case Dim::tp:
      return tp;
    case Dim::cp:
      return cp;
    case Dim::dp:
      return dp;
    case Dim::pp:
      return pp;
  }
  return 1;
}

std::string MeshShape::describe() const {
  auto s = fmt::format("dp {} x tp {} x pp {}", dp, tp, pp);
  if (cp != 1) s += fmt::format(" x cp {}", cp);
  return s;
}

MeshShape MeshShape::parse(const std::string& text) {
  MeshShape shape;
  std::set<std::string> seen;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string piece = text.substr(start, comma - start);
    const size_t eq = piece.find('=');
    const std::string name = piece.substr(0, eq);
    int64_t value = 0;
    const char* digits = eq == std::string::npos ? nullptr : piece.c_str() + eq + 1;
    const auto [end, ec] = digits ? std::from_chars(digits, piece.c_str() + piece.size(), value)
                                  : std::from_chars_result{nullptr, std::errc::invalid_argument};
    LOOM_CHECK(digits && ec == std::errc() && end == piece.c_str() + piece.size() && value >= 1,
               "mesh '{}': '{}' is not NAME=N with N a positive integer (e.g. tp=2,pp=2)", text,
               piece);
    LOOM_CHECK(name == "dp" || name == "tp" || name == "pp" || name == "cp",
               "mesh '{}': '{}' is not a mesh dimension: dp, tp, pp or cp", text, name);
    LOOM_CHECK(seen.insert(name).second, "mesh '{}': {} is given twice", text, name);
    (name == "dp"   ? shape.dp
     : name == "tp" ? shape.tp
     : name == "pp" ? shape.pp
                    : shape.cp) = value;
    start = comma + 1;
  }
  return shape;
}

MeshShape MeshShape::resolve(int64_t world_size, int64_t ranks_per_node) const {
  MeshShape s = *this;
  for (auto [name, v] : {std::pair{"tp", tp}, {"pp", pp}, {"cp", cp}})
    LOOM_CHECK(v >= 1, "mesh: --{} {} is invalid; every mesh dimension must be at least 1", name,
               v);
  LOOM_CHECK(dp >= 0,
             "mesh: --dp {} is invalid; use a size of at least 1, or 0 to take what "
             "the other dimensions leave of the world",
             dp);
  const int64_t others = tp * pp * cp;
  if (s.dp == 0) {
    LOOM_CHECK(world_size % others == 0,
               "mesh: tp {} x pp {}{} = {} ranks does not divide the world of {} processes, so "
               "dp cannot be derived; launch a multiple of {} processes",
               tp, pp, cp != 1 ? fmt::format(" x cp {}", cp) : std::string(), others, world_size,
               others);
    s.dp = world_size / others;
  }
  LOOM_CHECK(s.product() == world_size,
             "mesh: {} = {} ranks, but the world has {} processes; the product of the mesh "
             "dimensions must equal the number of processes (mpirun -np {})",
             s.describe(), s.product(), world_size, s.product());
  if (tp > ranks_per_node)
    spdlog::warn(
        "mesh: tp {} is larger than the {} ranks on this node: tensor-parallel collectives will "
        "cross nodes, which is usually much slower",
        tp, ranks_per_node);
  return s;
}

Mesh::Mesh(CommunicatorPtr world, MeshShape shape, int64_t ranks_per_node)
    : world_(std::move(world)), shape_(shape.resolve(world_->size(), ranks_per_node)) {
  coords_ = coords_of(world_->rank());
  // The group along dimension d: the ranks that share every other coordinate.
  for (int d = 0; d < kNumDims; ++d) {
    int64_t color = 0;
    for (int o = kNumDims - 1; o >= 0; --o) {
      if (o == d) continue;
      color = color * shape_.size(static_cast<Dim>(o)) + coords_[static_cast<size_t>(o)];
    }
    comms_[static_cast<size_t>(d)] =
        world_->split(static_cast<int>(color), static_cast<int>(coords_[static_cast<size_t>(d)]),
                      to_string(static_cast<Dim>(d)));
  }
}

Mesh::Mesh(CommunicatorPtr world, MeshShape shape, int64_t ranks_per_node, const BackendPlan& plan,
           int device)
    : Mesh(std::move(world), shape, ranks_per_node) {
  for (int d = 0; d < kNumDims; ++d) {
    auto& comm = comms_[static_cast<size_t>(d)];
    switch (plan.dims[static_cast<size_t>(d)]) {
      case Transport::nccl:
        comm = make_nccl_communicator(comm, device, comm->name());
        break;
      case Transport::mpi_staged:
        comm = std::make_shared<StagingCommunicator>(comm);
        break;
      case Transport::mpi_cuda:
        // MpiCommunicator takes host memory only; Runtime::mesh plans staging instead.
        fail(
            "mesh: group '{}' is planned as CUDA-aware MPI, which loom does not drive yet "
            "(use staging: BackendFacts::mpi_cuda_aware = false)",
            comm->name());
      case Transport::local:
        // One rank: nothing to send, and no backend to refuse the tensors' device (ZeRO and
        // the runtime issue their collectives at size 1 too).
        comm = std::make_shared<LocalCommunicator>(comm->name());
        break;
      case Transport::mpi:
        break;
    }
  }
}

std::shared_ptr<Mesh> Mesh::single_process() {
  return std::make_shared<Mesh>(std::make_shared<LocalCommunicator>(), MeshShape{.dp = 1});
}

double Mesh::bytes_sent() const {
  // Each family once: the dimensions' groups are split from the world (or built on such a
  // group), and a strategy's own groups from those.
  std::vector<const Communicator*> seen;
  double total = 0;
  auto add = [&](const CommunicatorPtr& c) {
    if (!c || std::any_of(seen.begin(), seen.end(),
                          [&](const Communicator* s) { return s->same_family(*c); }))
      return;
    seen.push_back(c.get());
    total += c->family_bytes_sent();
  };
  add(world_);
  for (const auto& c : comms_) add(c);
  for (const auto& c : tracked_) add(c);
  return total;
}

void Mesh::track(CommunicatorPtr group) {
  if (group) tracked_.push_back(std::move(group));
}

int64_t Mesh::rank_at(const std::array<int64_t, kNumDims>& coords) const {
  int64_t rank = 0;
  for (int d = kNumDims - 1; d >= 0; --d) {
    const auto c = coords[static_cast<size_t>(d)];
    const auto n = shape_.size(static_cast<Dim>(d));
    LOOM_CHECK(c >= 0 && c < n, "mesh: coordinate {} along {} is outside 0..{}", c,
               to_string(static_cast<Dim>(d)), n - 1);
    rank = rank * n + c;
  }
  return rank;
}

std::array<int64_t, kNumDims> Mesh::coords_of(int64_t rank) const {
  LOOM_CHECK(rank >= 0 && rank < shape_.product(), "mesh: rank {} is outside 0..{}", rank,
             shape_.product() - 1);
  std::array<int64_t, kNumDims> c{};
  for (int d = 0; d < kNumDims; ++d) {
    const auto n = shape_.size(static_cast<Dim>(d));
    c[static_cast<size_t>(d)] = rank % n;
    rank /= n;
  }
  return c;
}

}  // namespace loom::dist
