#pragma once
// Collective and point-to-point communication over a group of ranks, on torch tensors. One
// interface, several backends: MPI for CPU tensors, NCCL for CUDA tensors, and a local one for a
// group of one rank (a process started without mpirun). The base class validates every call the
// same way for all of them, numbers the collectives, registers each op with the watchdog and,
// in debug mode, has the backend check that every rank issues the same collective.
#include <ATen/core/Tensor.h>

#include <array>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/dist/work.h"

namespace loom::dist {

// The first rank whose fingerprint differs from rank 0's, as an error message; nullopt if all
// agree. `all` holds one fingerprint per rank of the group.
std::optional<std::string> find_mismatch(const std::vector<OpFingerprint>& all, const OpInfo& info);

// "float32[4, 1024]"
std::string describe_tensor(const at::Tensor& t);

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  virtual std::string backend() const = 0;  // "mpi" | "nccl" | "local"
  // The one device whose tensors this backend takes (MPI: the CPU; NCCL: its GPU); nullopt when
  // it takes tensors on any device (local, staging).
  virtual std::optional<at::Device> tensor_device() const { return std::nullopt; }

  // The watchdog's limit for ops issued from now on (default: the process-wide one, which
  // Runtime sets from --comm-timeout).
  void set_timeout(Seconds timeout);
  Seconds timeout() const { return timeout_; }
  // Debug mode (LOOM_DIST_DEBUG=1 at construction): before each collective, every rank checks
  // that the whole group issues the same op on the same shape and dtype.
  void set_debug(bool debug) { debug_ = debug; }
  bool debug() const { return debug_; }

  // Supported dtypes: float32, float64, bfloat16, float16, int32, int64, uint8. Tensors an op
  // writes (the all_reduce/broadcast tensor, outputs, recv buffers) must be contiguous.
  // Avg on integer tensors divides the sum by size() rounding toward zero.
  WorkPtr all_reduce_async(const at::Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  // output: input.numel() / size() elements; rank r gets the reduction of input's r-th chunk.
  WorkPtr reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                               ReduceOp op = ReduceOp::Sum);
  // output: size() * input.numel() elements, every rank's input in rank order.
  WorkPtr all_gather_async(const at::Tensor& output, const at::Tensor& input);
  WorkPtr broadcast_async(const at::Tensor& tensor, int root);
  // input and output: equal numel, divisible by size(); input's chunk j goes to rank j, and
  // output's chunk i comes from rank i.
  WorkPtr all_to_all_async(const at::Tensor& output, const at::Tensor& input);
  WorkPtr barrier_async();
  // Point-to-point; messages between two ranks with the same tag arrive in order.
  WorkPtr send_async(const at::Tensor& tensor, int dst, int tag = 0);
  WorkPtr recv_async(const at::Tensor& tensor, int src, int tag = 0);

  // Ops on one communicator must be issued from one thread at a time, in the same order on
  // every rank (the order is what matches them up across ranks).
  //
  // Blocking forms: the async op, then wait(). A blocking op on an idle communicator may run
  // on the calling thread (no hand-off to a communication thread).
  void all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                      ReduceOp op = ReduceOp::Sum);
  void all_gather(const at::Tensor& output, const at::Tensor& input);
  void broadcast(const at::Tensor& tensor, int root);
  void all_to_all(const at::Tensor& output, const at::Tensor& input);
  void barrier();
  void send(const at::Tensor& tensor, int dst, int tag = 0);
  void recv(const at::Tensor& tensor, int src, int tag = 0);

  // A new communicator over the ranks that pass the same color, ranked by key (ties by rank).
  // Collective over this communicator. A negative color joins no group and returns nullptr.
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  // Collectives issued so far on this communicator.
  int64_t collectives_issued() const { return seq_; }
  // Bytes this rank has sent on this communicator so far, counted per op as dist::wire_bytes
  // (op.h) says: in total, or for one kind of op. Readable from any thread.
  double bytes_sent() const;
  double bytes_sent(OpKind kind) const;
  // Bytes this rank has sent on this communicator's family: it, every communicator split from
  // it (and from those), and the ones built on top of them (a wrapper such as host staging takes
  // the place of what it wraps, so each op counts once). A strategy's own groups (pipeline
  // channels, ZeRO-3's gather group, tensor parallelism's replica groups) are split from the
  // mesh's, so Mesh::bytes_sent counts them without being told. Readable from any thread.
  double family_bytes_sent() const;
  // Whether two communicators count into one family total.
  bool same_family(const Communicator& other) const { return family_ == other.family_; }

 protected:
  Communicator(std::string name, int rank, int size);
  // split() implementations return their new communicator through this: it joins the family.
  std::shared_ptr<Communicator> in_family(std::shared_ptr<Communicator> child) const;
  // For a communicator that sends through `inner`: it takes inner's place in inner's family,
  // and inner counts apart from then on (its sends are this one's, counted here).
  void take_family_place_of(Communicator& inner);

  // One validated call, handed to the backend.
  // What the op is (kind, reduce op, root or peer, tag) lives in info.call, once.
  struct Call {
    OpKind kind() const { return static_cast<OpKind>(info.call.kind); }
    ReduceOp reduce() const { return static_cast<ReduceOp>(info.call.reduce); }
    int peer() const { return static_cast<int>(info.call.root); }  // root, destination, source
    int tag() const { return static_cast<int>(info.call.tag); }
    at::Tensor output;   // written (all_reduce/broadcast: in place; recv: the buffer)
    at::Tensor input;    // read (contiguous); undefined for in-place ops and barrier
    OpInfo info;         // info.call: the fingerprint the debug check compares
    bool debug = false;  // debug mode as it was when the op was issued
  };
  virtual WorkPtr launch(Call call) = 0;
  // Whether the backend takes tensors on this device; else the message says why not.
  virtual std::optional<std::string> check_device(const at::Tensor& t) const = 0;
  // True while a blocking form is waiting for the op it launches (backends may run it inline).
  static bool caller_will_wait();
  // For collectives a backend runs outside launch() (split): numbered, started and watched by
  // the watchdog; the backend completes it.
  std::shared_ptr<HostWork> start_watched(OpKind kind);

 private:
  WorkPtr issue(Call call);
  Call make_call(OpKind kind, const at::Tensor& shape_of);
  void check_tensor(const char* op, const char* what, const at::Tensor& t, bool written) const;
  void check_peer(const char* op, const char* what, int peer, bool allow_self) const;

  std::string name_;
  int rank_, size_;
  int world_rank_ = 0, local_rank_ = 0;  // for messages
  Seconds timeout_;
  bool debug_;
  int64_t seq_ = 0;      // collectives issued
  int64_t p2p_seq_ = 0;  // point-to-point ops issued
  std::array<std::atomic<double>, kNumOpKinds> bytes_sent_{};
  std::shared_ptr<std::atomic<double>> family_ = std::make_shared<std::atomic<double>>(0.0);
};

using CommunicatorPtr = std::shared_ptr<Communicator>;

// `t` where `comm` takes it: itself when it already is, else a copy on comm.tensor_device(). For
// the small host-side values (counts, headers, RNG states, checkpoint tensors) that must cross
// whatever transport a group was planned on.
at::Tensor on_comm_device(const Communicator& comm, const at::Tensor& t);

// Gives the ops issued on `comm` during its lifetime another watchdog limit: for a wait whose
// length is legitimately unbounded (the other ranks waiting while rank 0 writes a checkpoint).
class ScopedTimeout {
 public:
  ScopedTimeout(Communicator& comm, Seconds timeout) : comm_(comm), saved_(comm.timeout()) {
    comm_.set_timeout(timeout);
  }
  ~ScopedTimeout() { comm_.set_timeout(saved_); }
  ScopedTimeout(const ScopedTimeout&) = delete;
  ScopedTimeout& operator=(const ScopedTimeout&) = delete;

 private:
  Communicator& comm_;
  Seconds saved_;
};

}  // namespace loom::dist
