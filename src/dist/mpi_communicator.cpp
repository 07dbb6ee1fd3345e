#include "loom/dist/mpi_communicator.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fmt/format.h>

#include <climits>

#include "loom/core/error.h"
#include "loom/dist/watchdog.h"

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_Query_cuda_support
#endif

namespace loom::dist {

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  fail("{} failed: {}", what, std::string(text, static_cast<size_t>(len)));
}

namespace {

// Elementwise reductions of 16-bit floats for MPI: widen to fp32, combine, round once.
template <typename T, bool IsMax>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
    b[i] = static_cast<T>(IsMax ? (x > y ? x : y) : x + y);
  }
}

struct UserOps {
  MPI_Op bf16_sum, bf16_max, f16_sum, f16_max;
  UserOps() {
    check_mpi(MPI_Op_create(&reduce16<c10::BFloat16, false>, 1, &bf16_sum), "MPI_Op_create");
    check_mpi(MPI_Op_create(&reduce16<c10::BFloat16, true>, 1, &bf16_max), "MPI_Op_create");
    check_mpi(MPI_Op_create(&reduce16<c10::Half, false>, 1, &f16_sum), "MPI_Op_create");
    check_mpi(MPI_Op_create(&reduce16<c10::Half, true>, 1, &f16_max), "MPI_Op_create");
  }
};

const UserOps& user_ops() {
  static const UserOps ops;  // created after MPI_Init, on first use; MPI frees them at finalize
  return ops;
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return MPI_FLOAT;
    case at::kDouble:
      return MPI_DOUBLE;
    case at::kBFloat16:
    case at::kHalf:
      return MPI_UINT16_T;
    case at::kInt:
      return MPI_INT32_T;
    case at::kLong:
      return MPI_INT64_T;
    case at::kByte:
      return MPI_UINT8_T;
    default:
      fail("no MPI datatype for {}", c10::toString(t));
  }
}

MPI_Op mpi_op(ReduceOp op, at::ScalarType t) {
  const bool max = op == ReduceOp::Max;  // Avg is a sum divided afterwards
  if (t == at::kBFloat16) return max ? user_ops().bf16_max : user_ops().bf16_sum;
  if (t == at::kHalf) return max ? user_ops().f16_max : user_ops().f16_sum;
  return max ? MPI_MAX : MPI_SUM;
}

int mpi_count(int64_t n, const OpInfo& info) {
  LOOM_CHECK(n <= INT_MAX, "{}: {} elements exceed MPI's count limit of {}; split the tensor",
             info.describe(), n, INT_MAX);
  return static_cast<int>(n);
}

void divide_for_avg(const at::Tensor& t, int size) {
  at::NoGradGuard no_grad;  // grad mode is per thread: this may run on the worker
  if (at::isFloatingType(t.scalar_type()))
    t.div_(size);
  else
    t.div_(size, "trunc");
}

// Work of a non-blocking point-to-point op: completes when its MPI request does.
class RequestWork : public Work {
 public:
  RequestWork(OpInfo info, MPI_Request request, at::Tensor keep_alive)
      : Work(std::move(info)), request_(request), tensor_(std::move(keep_alive)) {
    mark_started();
  }
  ~RequestWork() override {
    // A request nobody waited for: let MPI finish it on its own.
    std::lock_guard<std::mutex> lock(mutex_);
    if (request_ != MPI_REQUEST_NULL) {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Request_free(&request_);
    }
  }

 protected:
  bool test() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (request_ == MPI_REQUEST_NULL) return true;
    int flag = 0;
    const int rc = MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      try {
        check_mpi(rc, info().op().c_str());
      } catch (...) {
        error_ = std::current_exception();
      }
      request_ = MPI_REQUEST_NULL;
      return true;
    }
    return flag != 0;
  }
  bool wait_until(std::optional<Clock::time_point> deadline) override {
    // MPI_Wait would hold the request while the watchdog tests it: poll instead.
    while (!test()) {
      if (deadline && Clock::now() >= *deadline) return false;
      std::this_thread::yield();
    }
    return true;
  }
  std::exception_ptr error() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  mutable std::mutex mutex_;
  MPI_Request request_;
  at::Tensor tensor_;
  std::exception_ptr error_;
};

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name)
    : Communicator(
          std::move(name),
          [&] {
            int r = 0;
            check_mpi(MPI_Comm_rank(comm, &r), "MPI_Comm_rank");
            return r;
          }(),
          [&] {
            int s = 0;
            check_mpi(MPI_Comm_size(comm, &s), "MPI_Comm_size");
            return s;
          }()),
      comm_(comm) {
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  user_ops();
  worker_ = std::thread([this] { worker_loop(); });
}

MpiCommunicator::~MpiCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  worker_.join();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF && comm_ != MPI_COMM_NULL)
    MPI_Comm_free(&comm_);
}

std::shared_ptr<MpiCommunicator> MpiCommunicator::world() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  LOOM_CHECK(initialized, "MPI is not initialized: create a loom::dist::Runtime first");
  MPI_Comm dup = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup");
  return std::make_shared<MpiCommunicator>(dup, "world");
}

bool mpi_cuda_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
  // The compile-time macro describes the headers; the library loaded now answers for itself.
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

std::optional<std::string> MpiCommunicator::check_device(const at::Tensor& t) const {
  if (t.device().is_cpu()) return std::nullopt;
  return fmt::format(
      "the MPI backend takes CPU tensors, got one on {} (for CUDA tensors build the mesh with "
      "Runtime::mesh(shape, backend, device), which puts each group on NCCL or stages it "
      "through host memory)",
      t.device().str());
}

std::shared_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& name) {
  // Ordered after the ops already issued: wait for the queue to drain, then split inline.
  MPI_Comm out = MPI_COMM_NULL;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    ++idle_waiters_;
    idle_cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
    --idle_waiters_;
    busy_ = true;
  }
  auto watched = start_watched(OpKind::Split);
  const int rc = MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out);
  watched->complete();
  finish_inline();
  check_mpi(rc, "MPI_Comm_split");
  if (out == MPI_COMM_NULL) return nullptr;
  auto comm = std::make_shared<MpiCommunicator>(out, name);
  comm->set_timeout(timeout());
  comm->set_debug(debug());
  return in_family(comm);
}

WorkPtr MpiCommunicator::launch(Call call) {
  if (call.kind() == OpKind::Send || call.kind() == OpKind::Recv) {
    MPI_Request request = MPI_REQUEST_NULL;
    const auto& t = call.kind() == OpKind::Send ? call.input : call.output;
    const int count = mpi_count(t.numel(), call.info);
    if (call.kind() == OpKind::Send)
      check_mpi(MPI_Isend(t.data_ptr(), count, mpi_type(t.scalar_type()), call.peer(), call.tag(),
                          comm_, &request),
                "MPI_Isend");
    else
      check_mpi(MPI_Irecv(t.data_ptr(), count, mpi_type(t.scalar_type()), call.peer(), call.tag(),
                          comm_, &request),
                "MPI_Irecv");
    return std::make_shared<RequestWork>(call.info, request, t);
  }
  auto work = std::make_shared<HostWork>(call.info);
  submit(Task{work, std::move(call)});
  return work;
}

void MpiCommunicator::submit(Task task) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (caller_will_wait() && queue_.empty() && !busy_) {
    busy_ = true;
    lock.unlock();
    Watchdog::instance().track(task.work);  // before it runs: this call may be the one that hangs
    execute(task);
    finish_inline();
    return;
  }
  queue_.push_back(std::move(task));
  lock.unlock();
  work_cv_.notify_one();
}

void MpiCommunicator::finish_inline() {
  std::lock_guard<std::mutex> lock(mutex_);
  busy_ = false;
  if (!queue_.empty()) work_cv_.notify_one();  // queued by another thread meanwhile
  if (idle_waiters_ > 0) idle_cv_.notify_all();
}

void MpiCommunicator::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_cv_.wait(lock, [&] { return (!queue_.empty() && !busy_) || (stopping_ && !busy_); });
    if (queue_.empty()) return;  // stopping, nothing left
    Task task = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    execute(task);
    lock.lock();
    busy_ = false;
    if (idle_waiters_ > 0) idle_cv_.notify_all();
  }
}

void MpiCommunicator::execute(Task& task) {
  task.work->mark_started();
  try {
    if (task.call.debug) {
      std::vector<OpFingerprint> all(static_cast<size_t>(size()));
      check_mpi(MPI_Allgather(&task.call.info.call, sizeof(OpFingerprint), MPI_BYTE, all.data(),
                              sizeof(OpFingerprint), MPI_BYTE, comm_),
                "MPI_Allgather (LOOM_DIST_DEBUG check)");
      if (auto mismatch = find_mismatch(all, task.call.info)) throw Error(*mismatch);
    }
    run(task.call);
    // MPI wrote through a raw pointer: tell autograd the tensor changed.
    if (task.call.output.defined() && !task.call.output.is_inference())
      task.call.output.unsafeGetTensorImpl()->bump_version();
    task.call = Call{};  // release the tensors before anyone is woken
    task.work->complete();
  } catch (...) {
    task.call = Call{};
    task.work->complete(std::current_exception());
  }
}

void MpiCommunicator::run(Call& c) {
  const auto& info = c.info;
  switch (c.kind()) {
    case OpKind::AllReduce: {
      auto& t = c.output;
      check_mpi(
          MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), mpi_count(t.numel(), info),
                        mpi_type(t.scalar_type()), mpi_op(c.reduce(), t.scalar_type()), comm_),
          "MPI_Allreduce");
      if (c.reduce() == ReduceOp::Avg) divide_for_avg(t, size());
      break;
    }
    case OpKind::ReduceScatter: {
      auto& out = c.output;
      check_mpi(MPI_Reduce_scatter_block(c.input.data_ptr(), out.data_ptr(),
                                         mpi_count(out.numel(), info), mpi_type(out.scalar_type()),
                                         mpi_op(c.reduce(), out.scalar_type()), comm_),
                "MPI_Reduce_scatter_block");
      if (c.reduce() == ReduceOp::Avg) divide_for_avg(out, size());
      break;
    }
    case OpKind::AllGather: {
      const auto type = mpi_type(c.input.scalar_type());
      const int n = mpi_count(c.input.numel(), info);
      check_mpi(MPI_Allgather(c.input.data_ptr(), n, type, c.output.data_ptr(), n, type, comm_),
                "MPI_Allgather");
      break;
    }
    case OpKind::Broadcast: {
      auto& t = c.output;
      check_mpi(MPI_Bcast(t.data_ptr(), mpi_count(t.numel(), info), mpi_type(t.scalar_type()),
                          c.peer(), comm_),
                "MPI_Bcast");
      break;
    }
    case OpKind::AllToAll: {
      const auto type = mpi_type(c.input.scalar_type());
      const int n = mpi_count(c.input.numel() / size(), info);
      check_mpi(MPI_Alltoall(c.input.data_ptr(), n, type, c.output.data_ptr(), n, type, comm_),
                "MPI_Alltoall");
      break;
    }
    case OpKind::Barrier:
      check_mpi(MPI_Barrier(comm_), "MPI_Barrier");
      break;
    case OpKind::Send:
    case OpKind::Recv:
    case OpKind::Split:
      fail("internal: {} does not go through the queue", to_string(c.kind()));
  }
}

}  // namespace loom::dist
