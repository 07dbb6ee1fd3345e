#include "loom/dist/nccl_communicator.h"

#include "loom/core/error.h"

#ifdef LOOM_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <memory>
#include <thread>
#endif

namespace loom::dist {

#ifndef LOOM_WITH_CUDA

bool nccl_available() {
  return false;
}

std::string cuda_gpu_id(int) {
  return "";
}

CommunicatorPtr make_nccl_communicator(CommunicatorPtr, int, const std::string& name) {
  fail("cannot create NCCL communicator '{}': loom was built without CUDA (LOOM_WITH_CUDA=OFF)",
       name);
}

#else

namespace {

void check_nccl(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  fail("{} failed: {} ({})", what, ncclGetErrorString(r), ncclGetLastError(nullptr));
}

void check_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  fail("{} failed: {}", what, cudaGetErrorString(e));
}

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclFloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    default:
      fail("no NCCL datatype for {}", c10::toString(t));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Avg:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
  }
  return ncclSum;
}

// The NCCL communicator handle, shared by the communicator and its works: a work the watchdog
// still holds may outlive the communicator.
struct NcclHandle {
  ncclComm_t comm = nullptr;
  std::atomic<bool> aborted{false};
  // Ends the communicator's kernels now, from any thread (the watchdog's, before it ends the
  // job): a rank blocked on one of its ops then sees an error instead of hanging. Once.
  void abort() {
    if (comm != nullptr && !aborted.exchange(true)) ncclCommAbort(comm);
  }
  ~NcclHandle() {
    if (comm != nullptr && !aborted.load()) ncclCommDestroy(comm);
  }
};

// Completes when the event recorded after the op on the communication stream has fired.
class CudaWork : public Work {
 public:
  // host_sync: wait() blocks the host too (a barrier), not only the caller's stream.
  CudaWork(OpInfo info, cudaEvent_t done, int device, std::shared_ptr<NcclHandle> comm,
           bool host_sync)
      : Work(std::move(info)),
        done_(done),
        device_(device),
        comm_(std::move(comm)),
        host_sync_(host_sync) {
    mark_started();
  }
  ~CudaWork() override { cudaEventDestroy(done_); }
  bool has_fatal_error() const override { return fatal_.load(); }
  void abort_communicator() override { comm_->abort(); }

 protected:
  bool test() override {
    // After the watchdog's abort the handle is gone and the op's kernels were cut short, even if
    // its event has fired: the result is not to be used, and the handle not to be asked.
    if (comm_->aborted.load()) {
      record_error(fmt::format("{}: its NCCL communicator was aborted", info().describe()));
      return true;
    }
    const auto e = cudaEventQuery(done_);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) {
      record_error(fmt::format("{}: {}", info().describe(), cudaGetErrorString(e)));
      return true;
    }
    // Still running: has the communicator failed (a peer died, a network error)?
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_->comm, &async);
    if (async == ncclSuccess || async == ncclInProgress) return false;
    record_error(fmt::format("{}: NCCL reported {}", info().describe(), ncclGetErrorString(async)));
    return true;
  }
  bool wait_until(std::optional<Clock::time_point> deadline) override {
    if (deadline || host_sync_) {
      while (!test()) {
        if (deadline && Clock::now() >= *deadline) return false;
        std::this_thread::yield();
      }
    } else if (test() && error()) {
      return true;  // failed already: wait() rethrows
    }
    // Stream-ordered wait: the caller's stream runs on only after the op.
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    check_cuda(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream().stream(), done_, 0),
               "cudaStreamWaitEvent");
    return true;
  }
  std::exception_ptr error() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  void record_error(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::make_exception_ptr(Error(message));
    fatal_ = true;  // a failed NCCL op leaves the communicator unusable
  }
  cudaEvent_t done_;
  int device_;
  std::shared_ptr<NcclHandle> comm_;
  bool host_sync_;
  std::atomic<bool> fatal_{false};
  mutable std::mutex mutex_;
  std::exception_ptr error_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(CommunicatorPtr bootstrap, int device, const std::string& name)
      : Communicator(name, bootstrap->rank(), bootstrap->size()),
        bootstrap_(std::move(bootstrap)),
        device_(device) {
    int count = 0;
    check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    LOOM_CHECK(device >= 0 && device < count,
               "NCCL communicator '{}': CUDA device {} does not exist (this node has {})", name,
               device, count);
    set_timeout(bootstrap_->timeout());
    set_debug(bootstrap_->debug());
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    ncclUniqueId id;
    if (rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    auto id_bytes = at::from_blob(&id, {static_cast<int64_t>(sizeof(id))}, at::kByte);
    bootstrap_->broadcast(id_bytes, 0);
    check_nccl(ncclCommInitRank(&handle_->comm, size(), id, rank()), "ncclCommInitRank");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    take_family_place_of(*bootstrap_);  // the group's sends are NCCL's from here on
  }
  ~NcclCommunicator() override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  std::string backend() const override { return "nccl"; }
  std::optional<at::Device> tensor_device() const override {
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
  }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override {
    auto sub = bootstrap_->split(color, key, name + ".bootstrap");
    if (!sub) return nullptr;
    return in_family(std::make_shared<NcclCommunicator>(sub, device_, name));
  }

 protected:
  std::optional<std::string> check_device(const at::Tensor& t) const override {
    if (t.is_cuda() && t.device().index() == device_) return std::nullopt;
    return fmt::format("the NCCL communicator takes tensors on cuda:{}, got one on {}", device_,
                       t.device().str());
  }

  WorkPtr launch(Call c) override {
    LOOM_CHECK(!handle_->aborted.load(),
               "{}: the NCCL communicator '{}' was aborted (the watchdog ended its ops)",
               c.info.describe(), name());
    if (c.debug && c.kind() != OpKind::Send && c.kind() != OpKind::Recv) {
      std::vector<OpFingerprint> all(static_cast<size_t>(size()));
      auto mine =
          at::from_blob(&c.info.call, {static_cast<int64_t>(sizeof(OpFingerprint))}, at::kByte);
      auto gathered = at::from_blob(
          all.data(), {static_cast<int64_t>(all.size() * sizeof(OpFingerprint))}, at::kByte);
      bootstrap_->all_gather(gathered, mine);
      if (auto mismatch = find_mismatch(all, c.info)) throw Error(*mismatch);
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    const auto caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
    cudaEvent_t ready = nullptr, done = nullptr;
    check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(ready, caller.stream()), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_, ready, 0), "cudaStreamWaitEvent");
    cudaEventDestroy(ready);  // safe: destruction is deferred until the event completes

    auto& out = c.output;
    auto& in = c.input;
    switch (c.kind()) {
      case OpKind::AllReduce:
        check_nccl(ncclAllReduce(out.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()),
                                 nccl_type(out.scalar_type()), nccl_op(c.reduce()), handle_->comm,
                                 stream_),
                   "ncclAllReduce");
        break;
      case OpKind::ReduceScatter:
        check_nccl(ncclReduceScatter(in.data_ptr(), out.data_ptr(),
                                     static_cast<size_t>(out.numel()), nccl_type(out.scalar_type()),
                                     nccl_op(c.reduce()), handle_->comm, stream_),
                   "ncclReduceScatter");
        break;
      case OpKind::AllGather:
        check_nccl(ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()),
                                 nccl_type(in.scalar_type()), handle_->comm, stream_),
                   "ncclAllGather");
        break;
      case OpKind::Broadcast:
        check_nccl(ncclBroadcast(out.data_ptr(), out.data_ptr(), static_cast<size_t>(out.numel()),
                                 nccl_type(out.scalar_type()), c.peer(), handle_->comm, stream_),
                   "ncclBroadcast");
        break;
      case OpKind::AllToAll: {
        const auto chunk = static_cast<size_t>(in.numel() / size());
        const auto bytes = chunk * in.element_size();
        const auto type = nccl_type(in.scalar_type());
        check_nccl(ncclGroupStart(), "ncclGroupStart");
        for (int r = 0; r < size(); ++r) {
          const auto offset = static_cast<size_t>(r) * bytes;
          check_nccl(ncclSend(static_cast<char*>(in.data_ptr()) + offset, chunk, type, r,
                              handle_->comm, stream_),
                     "ncclSend");
          check_nccl(ncclRecv(static_cast<char*>(out.data_ptr()) + offset, chunk, type, r,
                              handle_->comm, stream_),
                     "ncclRecv");
        }
        check_nccl(ncclGroupEnd(), "ncclGroupEnd");
        break;
      }
      case OpKind::Barrier: {
        auto one = at::ones({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device_));
        check_nccl(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclInt32, ncclSum,
                                 handle_->comm, stream_),
                   "ncclAllReduce (barrier)");
        out = one;
        break;
      }
      case OpKind::Send:  // NCCL has no tags: messages to one peer arrive in issue order
        check_nccl(ncclSend(in.data_ptr(), static_cast<size_t>(in.numel()),
                            nccl_type(in.scalar_type()), c.peer(), handle_->comm, stream_),
                   "ncclSend");
        break;
      case OpKind::Recv:
        check_nccl(ncclRecv(out.data_ptr(), static_cast<size_t>(out.numel()),
                            nccl_type(out.scalar_type()), c.peer(), handle_->comm, stream_),
                   "ncclRecv");
        break;
      case OpKind::Split:
        fail("internal: split does not go through launch()");
    }
    const c10::cuda::CUDAStream comm_stream =
        c10::cuda::getStreamFromExternal(stream_, static_cast<c10::DeviceIndex>(device_));
    for (const auto* t : {&out, &in})
      if (t->defined())
        c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), comm_stream);
    check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(done, stream_), "cudaEventRecord");
    return std::make_shared<CudaWork>(c.info, done, device_, handle_, c.kind() == OpKind::Barrier);
  }

 private:
  CommunicatorPtr bootstrap_;
  int device_;
  std::shared_ptr<NcclHandle> handle_ = std::make_shared<NcclHandle>();
  cudaStream_t stream_ = nullptr;
};

}  // namespace

bool nccl_available() {
  return true;
}

std::string cuda_gpu_id(int device) {
  int count = 0;
  cudaDeviceProp prop{};
  if (device < 0 || cudaGetDeviceCount(&count) != cudaSuccess || device >= count ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess)
    return "";
  std::string id = "GPU-";  // then 8-4-4-4-12 hex digits
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) id += '-';
    id += fmt::format("{:02x}", static_cast<unsigned char>(prop.uuid.bytes[i]));
  }
  return id;
}

CommunicatorPtr make_nccl_communicator(CommunicatorPtr bootstrap, int device,
                                       const std::string& name) {
  LOOM_CHECK(bootstrap != nullptr, "NCCL communicator '{}' needs a bootstrap communicator", name);
  return std::make_shared<NcclCommunicator>(std::move(bootstrap), device, name);
}

#endif

}  // namespace loom::dist
