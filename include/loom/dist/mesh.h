#pragma once
// The device mesh: the world's ranks arranged as pp x dp x cp x tp, tp innermost so that the
// ranks of a tensor-parallel group are neighbours (on one node), then cp (context parallel), then
// dp, then pp outermost. cp sits next to tp because after tp's it is the heaviest traffic: every
// layer's keys and values travel the cp ring in forward and again, with their gradients, in
// backward, so its groups should share a node where tp x cp allows. Every rank knows its
// coordinate in each dimension and holds the communicator of the group that varies along it.
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/dist/communicator.h"

namespace loom::dist {

struct BackendPlan;

enum class Dim { tp = 0, cp = 1, dp = 2, pp = 3 };  // innermost first
constexpr int kNumDims = 4;
std::string to_string(Dim d);

struct MeshShape {
  int64_t dp = 0;  // 0: whatever the other dimensions leave of the world
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t cp = 1;

  // The shape with dp filled in, checked against the world before any collective: sizes below
  // 1, a product that is not the world size — each a loom::Error naming the numbers. tp larger than
  // the ranks on one node only logs a warning.
  MeshShape resolve(int64_t world_size, int64_t ranks_per_node) const;
  int64_t size(Dim d) const;
  int64_t product() const { return dp * tp * pp * cp; }
  // "dp 2 x tp 2 x pp 1"
  std::string describe() const;
  // "tp=2,pp=2" (any of dp, tp, pp, cp; the rest keep their defaults). A loom::Error names a
  // piece that is not NAME=POSITIVE_INTEGER, an unknown name or one given twice.
  static MeshShape parse(const std::string& text);
};

class Mesh {
 public:
  // Validates `shape` against `world`, then splits one communicator per dimension (a
  // collective over `world`; every rank must pass the same shape).
  Mesh(CommunicatorPtr world, MeshShape shape, int64_t ranks_per_node = 1);
  // The same, then each group as `plan` says (backend_plan.h): NCCL over the group's ranks on
  // CUDA device `device`, or the MPI group wrapped in a StagingCommunicator; the others stay MPI.
  Mesh(CommunicatorPtr world, MeshShape shape, int64_t ranks_per_node, const BackendPlan& plan,
       int device);
  // One process: every dimension of size 1, local communicators, no MPI.
  static std::shared_ptr<Mesh> single_process();

  const MeshShape& shape() const { return shape_; }
  int64_t size(Dim d) const { return shape_.size(d); }
  int64_t coord(Dim d) const { return coords_[static_cast<size_t>(d)]; }
  Communicator& comm(Dim d) const { return *comms_[static_cast<size_t>(d)]; }
  const CommunicatorPtr& comm_ptr(Dim d) const { return comms_[static_cast<size_t>(d)]; }
  Communicator& world() const { return *world_; }
  const CommunicatorPtr& world_ptr() const { return world_; }
  int64_t rank() const { return world_->rank(); }
  int64_t world_size() const { return world_->size(); }

  // Bytes this rank has sent over the world, the dimensions' groups, every group split from
  // them (a strategy's pipeline channels, gather or replica groups: their families,
  // Communicator::family_bytes_sent) and the groups tracked, each family once.
  double bytes_sent() const;
  // Counts `group` in bytes_sent(): for a communicator not split from the mesh's (one split
  // from them is counted already). Null is ignored.
  void track(CommunicatorPtr group);

  // The world rank at these coordinates (indexed by Dim).
  int64_t rank_at(const std::array<int64_t, kNumDims>& coords) const;
  // The coordinates of a world rank.
  std::array<int64_t, kNumDims> coords_of(int64_t rank) const;

 private:
  CommunicatorPtr world_;
  MeshShape shape_;
  std::array<int64_t, kNumDims> coords_{};
  std::array<CommunicatorPtr, kNumDims> comms_;
  std::vector<CommunicatorPtr> tracked_;
};

using MeshPtr = std::shared_ptr<Mesh>;

}  // namespace loom::dist
