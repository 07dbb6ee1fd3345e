#include "loom/dist/runtime.h"

#include <ATen/Parallel.h>
#include <mpi.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "loom/core/error.h"
#include "loom/dist/mpi_communicator.h"
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
