#include "loom/dist/runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <mpi.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>

#include "loom/core/error.h"
#include "loom/dist/mpi_communicator.h"
#include "loom/dist/nccl_communicator.h"
#include "loom/dist/process_info.h"
#include "loom/dist/watchdog.h"

namespace loom::dist {

Runtime::Runtime(RuntimeOptions options) {
  LOOM_CHECK(options.comm_timeout.count() > 0, "--comm-timeout {} is invalid; it must be positive",
             options.comm_timeout.count());
  LOOM_CHECK(options.threads >= 0, "--threads {} is invalid; use 0 (automatic) or more",
             options.threads);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  LOOM_CHECK(!finalized,
             "MPI was already finalized in this process; a process can hold one "
             "loom::dist::Runtime, once");
  if (!initialized) {
    int provided = 0;
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    initialized_mpi_ = true;
    LOOM_CHECK(provided == MPI_THREAD_MULTIPLE,
               "MPI provides thread level {} but loom needs MPI_THREAD_MULTIPLE ({}): its "
               "communication threads call MPI concurrently. Use an MPI built with thread "
               "support (Open MPI is by default)",
               provided, MPI_THREAD_MULTIPLE);
  } else {
    int provided = 0;
    MPI_Query_thread(&provided);
    LOOM_CHECK(provided == MPI_THREAD_MULTIPLE,
               "MPI was initialized with thread level {}; loom needs MPI_THREAD_MULTIPLE",
               provided);
  }
  set_default_timeout(options.comm_timeout);

  ProcessInfo info;
  MPI_Comm_rank(MPI_COMM_WORLD, &info.world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &info.world_size);
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, info.world_rank,
                                MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  MPI_Comm_rank(node, &info.local_rank);
  MPI_Comm_size(node, &info.local_size);
  MPI_Comm_free(&node);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  info.host = host;
  set_process_info(info);

  // One intra-op pool per rank, sized so the ranks on a node share its cores.
  int threads = options.threads;
  if (threads == 0 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    threads = std::max(1, cores / info.local_size);
  }
  if (threads > 0) at::set_num_threads(threads);

  world_ = MpiCommunicator::world();
  if (info.world_size > 1)
    spdlog::debug("rank {} of {} on {} (local rank {} of {}), {} intra-op threads", info.world_rank,
                  info.world_size, info.host, info.local_rank, info.local_size,
                  at::get_num_threads());
}

Runtime::~Runtime() {
  // The communicators' threads and the watchdog use MPI: stop them before finalizing.
  world_.reset();
  Watchdog::instance().stop();
  if (initialized_mpi_) MPI_Finalize();
}

int Runtime::local_rank() const {
  return process_info().local_rank;
}
int Runtime::local_size() const {
  return process_info().local_size;
}

MeshPtr Runtime::mesh(MeshShape shape) const {
  return std::make_shared<Mesh>(world_, shape, local_size());
}

MeshPtr Runtime::mesh(MeshShape shape, BackendChoice choice, int device) const {
  // The shape is checked before any collective, so a bad one fails alike on every rank (the
  // node-size warning is left to the Mesh, which resolves again).
  const auto resolved = shape.resolve(world_->size(), std::numeric_limits<int64_t>::max());
  // Every rank's host name and device, so that every rank plans the same from the same facts.
  constexpr int64_t kHostBytes = 256;
  const auto host = process_info().host;
  auto name = at::zeros({1, kHostBytes}, at::kByte);
  std::memcpy(name.data_ptr(), host.data(),
              std::min<size_t>(host.size(), static_cast<size_t>(kHostBytes - 1)));
  auto names = at::zeros({world_->size(), kHostBytes}, at::kByte);
  world_->all_gather(names, name);
  auto devices_of = at::zeros({world_->size()}, at::kLong);
  world_->all_gather(devices_of, at::full({1}, static_cast<int64_t>(device), at::kLong));
  // The GPU's identity too: ranks with their own CUDA_VISIBLE_DEVICES all say device 0.
  constexpr int64_t kIdBytes = 64;
  const auto gpu_id = device >= 0 ? cuda_gpu_id(device) : std::string();
  auto id = at::zeros({1, kIdBytes}, at::kByte);
  std::memcpy(id.data_ptr(), gpu_id.data(),
              std::min<size_t>(gpu_id.size(), static_cast<size_t>(kIdBytes - 1)));
  auto ids = at::zeros({world_->size(), kIdBytes}, at::kByte);
  world_->all_gather(ids, id);
  std::vector<RankDevice> devices;
  for (int r = 0; r < world_->size(); ++r)
    devices.push_back({std::string(reinterpret_cast<const char*>(names[r].data_ptr())),
                       static_cast<int>(devices_of[r].item<int64_t>()),
                       std::string(reinterpret_cast<const char*>(ids[r].data_ptr()))});
  // Open MPI's CUDA support is detected and reported, but MpiCommunicator takes host memory
  // only: groups that cannot use NCCL stage through host buffers either way.
  const bool cuda_aware = device >= 0 && mpi_cuda_aware();
  const auto plan = plan_backends(resolved, devices, choice,
                                  {.nccl_available = nccl_available(), .mpi_cuda_aware = false});
  if (rank() == 0) {
    spdlog::info("communication (--dist-backend {}): {}", to_string(choice),
                 plan.describe(resolved));
    if (cuda_aware)
      spdlog::info(
          "Open MPI is CUDA-aware here; loom still stages MPI groups' CUDA tensors "
          "through host memory");
  }
  return std::make_shared<Mesh>(world_, shape, local_size(), plan, device);
}

}  // namespace loom::dist

namespace loom::dist {

void abort_job_if_multi_rank(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
}

}  // namespace loom::dist
