#pragma once
// What one communication op is: its kind, reduce op, root or peer, sequence number, dtype and
// shape (a fixed-size fingerprint, exchanged across ranks in debug mode), and where it runs
// (group, ranks, timeout). Kept as plain numbers; the strings for messages are made only when a
// message is written, so issuing an op formats nothing.
#include <array>
#include <chrono>
#include <cstdint>
#include <string>

namespace loom::dist {

using Seconds = std::chrono::duration<double>;

enum class ReduceOp { Sum, Avg, Max };
std::string to_string(ReduceOp op);

enum class OpKind : int64_t {
  AllReduce = 1,
  ReduceScatter,
  AllGather,
  Broadcast,
  AllToAll,
  Barrier,
  Send,
  Recv,
  Split  // creating a sub-communicator: collective, watched like the others
};
std::string to_string(OpKind kind);
constexpr int kNumOpKinds = static_cast<int>(OpKind::Split) + 1;

// The bytes one rank sends for one op under the bandwidth-optimal algorithm of its kind over a
// group of `group_size` ranks (ring all-reduce, reduce-scatter, all-gather; pairwise
// all-to-all), from `payload_bytes`: the tensor all_reduce and broadcast work on, the input of
// the others. all_reduce 2(R-1)/R x payload; reduce_scatter and all_to_all (R-1)/R x payload (the
// chunk a rank keeps is not sent); all_gather x payload; broadcast the payload from the
// root, 0 elsewhere; send the payload; recv, barrier and split 0. It is the traffic a collective
// needs, the measure compressors are compared by (docs/compression.md); a library's tree or
// small-message algorithms may send otherwise.
double wire_bytes(OpKind kind, double payload_bytes, int group_size, bool is_root);

struct OpFingerprint {
  static constexpr int kMaxDims = 6;
  int64_t kind = 0, reduce = 0, dtype = -1, root = -1, tag = 0, seq = 0, numel = 0, ndim = 0;
  std::array<int64_t, kMaxDims> dims{};

  bool operator==(const OpFingerprint&) const = default;
  // "all_reduce(sum)", "broadcast(root 0)", "send(to 1, tag 0)"
  std::string op() const;
  // "Float[4, 8]" ("" for a barrier)
  std::string tensor() const;
  // "all_reduce(sum) #12 Float[4, 8]"
  std::string describe() const;
};

struct OpInfo {
  OpFingerprint call;  // seq: index among the group's collectives (p2p ops: their own count)
  std::string group;   // the communicator's name: "world", "dp", "tp", ...
  int group_rank = 0;  // this rank in the group
  int group_size = 1;
  int world_rank = 0;
  int local_rank = 0;      // rank among the processes on this node
  Seconds timeout{300.0};  // the watchdog's limit for this op

  std::string op() const { return call.op(); }
  int64_t seq() const { return call.seq; }
  // "all_reduce(sum) #12 on group 'dp' (rank 1 of 2; world rank 3, local rank 1) Float[1024]"
  std::string describe() const;
};

}  // namespace loom::dist
