#include "loom/dist/communicator.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/dist/process_info.h"
#include "loom/dist/watchdog.h"

namespace loom::dist {

namespace {

thread_local bool t_caller_will_wait = false;

// Sets the flag for the duration of one blocking call.
class BlockingCall {
 public:
  BlockingCall() : previous_(t_caller_will_wait) { t_caller_will_wait = true; }
  ~BlockingCall() { t_caller_will_wait = previous_; }
  BlockingCall(const BlockingCall&) = delete;
  BlockingCall& operator=(const BlockingCall&) = delete;

 private:
  bool previous_;
};

bool supported(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong:
    case at::kByte:
      return true;
    default:
      return false;
  }
}

}  // namespace

at::Tensor on_comm_device(const Communicator& comm, const at::Tensor& t) {
  const auto device = comm.tensor_device();
  return device && t.device() != *device ? t.to(*device) : t;
}

std::string describe_tensor(const at::Tensor& t) {
  if (!t.defined()) return "(no tensor)";
  return fmt::format("{}[{}]", c10::toString(t.scalar_type()), fmt::join(t.sizes(), ", "));
}

std::optional<std::string> find_mismatch(const std::vector<OpFingerprint>& all,
                                         const OpInfo& info) {
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    return fmt::format(
        "LOOM_DIST_DEBUG: ranks of group '{}' issued different collectives: rank 0 issued {}, "
        "but rank {} issued {} (seen from rank {}; world rank {}). Every rank of a group must "
        "issue the same collectives in the same order on tensors of the same shape and dtype",
        info.group, all[0].describe(), r, all[r].describe(), info.group_rank, info.world_rank);
  }
  return std::nullopt;
}

Communicator::Communicator(std::string name, int rank, int size)
    : name_(std::move(name)),
      rank_(rank),
      size_(size),
      timeout_(default_timeout()),
      debug_(debug_from_env()) {
  const auto p = process_info();
  world_rank_ = p.world_rank;
  local_rank_ = p.local_rank;
}

void Communicator::set_timeout(Seconds timeout) {
  LOOM_CHECK(timeout.count() > 0, "communication timeout must be positive; got {} s",
             timeout.count());
  timeout_ = timeout;
}

bool Communicator::caller_will_wait() {
  return t_caller_will_wait;
}

void Communicator::check_tensor(const char* op, const char* what, const at::Tensor& t,
                                bool written) const {
  LOOM_CHECK(t.defined(), "{} on group '{}': the {} tensor is undefined", op, name_, what);
  LOOM_CHECK(supported(t.scalar_type()),
             "{} on group '{}': dtype {} of the {} tensor is not supported; use float32, "
             "float64, bfloat16, float16, int32, int64 or uint8",
             op, name_, c10::toString(t.scalar_type()), what);
  if (auto why = check_device(t)) fail("{} on group '{}': {}", op, name_, *why);
  LOOM_CHECK(!written || t.is_contiguous(),
             "{} on group '{}': the {} tensor {} must be contiguous (strides {}); pass a "
             "contiguous tensor and copy the result where it is needed",
             op, name_, what, describe_tensor(t), t.strides());
}

void Communicator::check_peer(const char* op, const char* what, int peer, bool allow_self) const {
  LOOM_CHECK(peer >= 0 && peer < size_,
             "{} on group '{}': {} {} is not a rank of the group (0..{})", op, name_, what, peer,
             size_ - 1);
  LOOM_CHECK(allow_self || peer != rank_,
             "{} on group '{}': {} {} is this rank itself; point-to-point needs another rank", op,
             name_, what, peer);
}

Communicator::Call Communicator::make_call(OpKind kind, const at::Tensor& shape_of) {
  Call c;
  c.info.group = name_;
  c.info.group_rank = rank_;
  c.info.group_size = size_;
  c.info.world_rank = world_rank_;
  c.info.local_rank = local_rank_;
  c.info.timeout = timeout_;
  c.debug = debug_;
  auto& f = c.info.call;
  f.kind = static_cast<int64_t>(kind);
  f.seq = kind == OpKind::Send || kind == OpKind::Recv ? p2p_seq_++ : seq_++;
  if (shape_of.defined()) {
    f.dtype = static_cast<int64_t>(shape_of.scalar_type());
    f.numel = shape_of.numel();
    f.ndim = shape_of.dim();
    for (int64_t d = 0; d < std::min<int64_t>(f.ndim, OpFingerprint::kMaxDims); ++d)
      f.dims[static_cast<size_t>(d)] = shape_of.size(d);
  }
  return c;
}

std::shared_ptr<HostWork> Communicator::start_watched(OpKind kind) {
  auto work = std::make_shared<HostWork>(make_call(kind, at::Tensor()).info);
  work->mark_started();
  Watchdog::instance().track(work);
  return work;
}

double Communicator::bytes_sent() const {
  double total = 0;
  for (const auto& b : bytes_sent_) total += b.load(std::memory_order_relaxed);
  return total;
}

double Communicator::bytes_sent(OpKind kind) const {
  return bytes_sent_.at(static_cast<size_t>(kind)).load(std::memory_order_relaxed);
}

double Communicator::family_bytes_sent() const {
  return family_->load(std::memory_order_relaxed);
}

std::shared_ptr<Communicator> Communicator::in_family(std::shared_ptr<Communicator> child) const {
  if (child) child->family_ = family_;
  return child;
}

void Communicator::take_family_place_of(Communicator& inner) {
  family_ = inner.family_;
  inner.family_ = std::make_shared<std::atomic<double>>(0.0);
}

WorkPtr Communicator::issue(Call call) {
  const auto& payload = call.input.defined() ? call.input : call.output;
  if (payload.defined()) {
    const double bytes =
        wire_bytes(call.kind(), static_cast<double>(payload.nbytes()), size_, call.peer() == rank_);
    bytes_sent_.at(static_cast<size_t>(call.kind())).fetch_add(bytes, std::memory_order_relaxed);
    family_->fetch_add(bytes, std::memory_order_relaxed);
  }
  auto work = launch(std::move(call));
  Watchdog::instance().track(work);
  return work;
}

WorkPtr Communicator::all_reduce_async(const at::Tensor& tensor, ReduceOp op) {
  check_tensor("all_reduce", "reduced", tensor, true);
  auto c = make_call(OpKind::AllReduce, tensor);
  c.info.call.reduce = static_cast<int64_t>(op);
  c.output = tensor;
  return issue(std::move(c));
}

WorkPtr Communicator::reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                                           ReduceOp op) {
  check_tensor("reduce_scatter", "output", output, true);
  check_tensor("reduce_scatter", "input", input, false);
  LOOM_CHECK(input.scalar_type() == output.scalar_type(),
             "reduce_scatter on group '{}': input {} and output {} differ in dtype", name_,
             describe_tensor(input), describe_tensor(output));
  LOOM_CHECK(input.numel() == output.numel() * size_,
             "reduce_scatter on group '{}': input {} must hold size ({}) x the output's {} "
             "elements",
             name_, describe_tensor(input), size_, output.numel());
  auto c = make_call(OpKind::ReduceScatter, input);
  c.info.call.reduce = static_cast<int64_t>(op);
  c.output = output;
  c.input = input.contiguous();
  return issue(std::move(c));
}

WorkPtr Communicator::all_gather_async(const at::Tensor& output, const at::Tensor& input) {
  check_tensor("all_gather", "output", output, true);
  check_tensor("all_gather", "input", input, false);
  LOOM_CHECK(input.scalar_type() == output.scalar_type(),
             "all_gather on group '{}': input {} and output {} differ in dtype", name_,
             describe_tensor(input), describe_tensor(output));
  LOOM_CHECK(output.numel() == input.numel() * size_,
             "all_gather on group '{}': output {} must hold size ({}) x the input's {} elements",
             name_, describe_tensor(output), size_, input.numel());
  auto c = make_call(OpKind::AllGather, input);
  c.output = output;
  c.input = input.contiguous();
  return issue(std::move(c));
}

WorkPtr Communicator::broadcast_async(const at::Tensor& tensor, int root) {
  check_tensor("broadcast", "broadcast", tensor, true);
  check_peer("broadcast", "root", root, true);
  auto c = make_call(OpKind::Broadcast, tensor);
  c.info.call.root = root;
  c.output = tensor;
  return issue(std::move(c));
}

WorkPtr Communicator::all_to_all_async(const at::Tensor& output, const at::Tensor& input) {
  check_tensor("all_to_all", "output", output, true);
  check_tensor("all_to_all", "input", input, false);
  LOOM_CHECK(input.scalar_type() == output.scalar_type() && input.numel() == output.numel() &&
                 input.numel() % size_ == 0,
             "all_to_all on group '{}': input {} and output {} must have the same dtype and "
             "number of elements, divisible by the group size {}",
             name_, describe_tensor(input), describe_tensor(output), size_);
  auto c = make_call(OpKind::AllToAll, input);
  c.output = output;
  c.input = input.contiguous();
  return issue(std::move(c));
}

WorkPtr Communicator::barrier_async() {
  return issue(make_call(OpKind::Barrier, at::Tensor()));
}

WorkPtr Communicator::send_async(const at::Tensor& tensor, int dst, int tag) {
  check_tensor("send", "sent", tensor, false);
  check_peer("send", "destination", dst, false);
  auto c = make_call(OpKind::Send, tensor);
  c.info.call.root = dst;
  c.info.call.tag = tag;
  c.input = tensor.contiguous();
  return issue(std::move(c));
}

WorkPtr Communicator::recv_async(const at::Tensor& tensor, int src, int tag) {
  check_tensor("recv", "receive", tensor, true);
  check_peer("recv", "source", src, false);
  auto c = make_call(OpKind::Recv, tensor);
  c.info.call.root = src;
  c.info.call.tag = tag;
  c.output = tensor;
  return issue(std::move(c));
}

void Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  BlockingCall blocking;
  all_reduce_async(tensor, op)->wait();
}
void Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  BlockingCall blocking;
  reduce_scatter_async(output, input, op)->wait();
}
void Communicator::all_gather(const at::Tensor& output, const at::Tensor& input) {
  BlockingCall blocking;
  all_gather_async(output, input)->wait();
}
void Communicator::broadcast(const at::Tensor& tensor, int root) {
  BlockingCall blocking;
  broadcast_async(tensor, root)->wait();
}
void Communicator::all_to_all(const at::Tensor& output, const at::Tensor& input) {
  BlockingCall blocking;
  all_to_all_async(output, input)->wait();
}
void Communicator::barrier() {
  BlockingCall blocking;
  barrier_async()->wait();
}
void Communicator::send(const at::Tensor& tensor, int dst, int tag) {
  BlockingCall blocking;
  send_async(tensor, dst, tag)->wait();
}
void Communicator::recv(const at::Tensor& tensor, int src, int tag) {
  BlockingCall blocking;
  recv_async(tensor, src, tag)->wait();
}

}  // namespace loom::dist
