#pragma once
// The MPI backend (Open MPI), for CPU tensors. Collectives run in order on one communication
// thread per communicator, so an async op overlaps whatever the caller does next (backward,
// say). A blocking op on an idle communicator runs on the caller's thread instead, which costs
// no hand-off. Point-to-point ops are MPI non-blocking sends/receives posted by the caller.
// bfloat16 and float16 are reduced by user-defined MPI ops (accumulating each pair in fp32).
#include <mpi.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "loom/dist/communicator.h"

namespace loom::dist {

class MpiCommunicator : public Communicator {
 public:
  // Takes ownership of `comm` (freed on destruction unless it is a predefined communicator).
  // MPI must be initialized with MPI_THREAD_MULTIPLE.
  MpiCommunicator(MPI_Comm comm, std::string name);
  ~MpiCommunicator() override;

  // A duplicate of MPI_COMM_WORLD (loom's traffic never mixes with the application's).
  static std::shared_ptr<MpiCommunicator> world();

  std::string backend() const override { return "mpi"; }
  std::optional<at::Device> tensor_device() const override { return at::Device(at::kCPU); }
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;
  MPI_Comm handle() const { return comm_; }

 protected:
  WorkPtr launch(Call call) override;
  std::optional<std::string> check_device(const at::Tensor& t) const override;

 private:
  struct Task {
    std::shared_ptr<HostWork> work;
    Call call;
  };
  void submit(Task task);
  void finish_inline();  // after an op ran on a caller's thread
  void execute(Task& task);
  void run(Call& call);
  void worker_loop();

  MPI_Comm comm_;
  std::mutex mutex_;
  std::condition_variable work_cv_;  // the worker waits here for a task
  std::condition_variable idle_cv_;  // split() waits here for the queue to drain
  int idle_waiters_ = 0;  // wake threads only when someone waits: a needless wake-up costs
                          // microseconds per op on a machine whose cores are all busy
  std::deque<Task> queue_;
  bool busy_ = false;  // an op is executing (on the worker or inline on a caller)
  bool stopping_ = false;
  std::thread worker_;
};

// Whether the Open MPI in use takes CUDA device pointers (its CUDA extension, asked at run time);
// false for an MPI without the extension.
bool mpi_cuda_aware();

// Throws loom::Error with MPI's description of `code` unless it is MPI_SUCCESS.
void check_mpi(int code, const char* what);

}  // namespace loom::dist
