#pragma once
// The distributed runtime of one process: initializes MPI (with MPI_THREAD_MULTIPLE), works out
// where this rank sits (world rank, rank on its node), sets the intra-op thread count, the
// watchdog timeout and debug mode, and finalizes MPI at the end. Launch with
// `mpirun -np N <program>` (or `srun` under Slurm); a program started on its own is rank 0 of 1.
#include <memory>

#include "loom/dist/backend_plan.h"
#include "loom/dist/communicator.h"
#include "loom/dist/mesh.h"

namespace loom::dist {

struct RuntimeOptions {
  Seconds comm_timeout{300.0};  // the watchdog limit of every communicator (--comm-timeout)
  // Intra-op threads per rank; 0: OMP_NUM_THREADS if set, else cores / ranks on this node.
  int threads = 0;
};

class Runtime {
 public:
  // Throws loom::Error if MPI cannot provide MPI_THREAD_MULTIPLE, or if MPI was already
  // finalized in this process (MPI can be initialized once per process).
  explicit Runtime(RuntimeOptions options = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const CommunicatorPtr& world() const { return world_; }
  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  int local_rank() const;
  int local_size() const;

  // The mesh of this world (validated before any collective; see MeshShape::resolve).
  MeshPtr mesh(MeshShape shape) const;
  // The mesh with each group on the transport --dist-backend `choice` gives it, for tensors on
  // CUDA device `device` (-1: the CPU): every rank's device is gathered, plan_backends decides
  // (backend_plan.h), rank 0 logs the plan. Collective over the world.
  MeshPtr mesh(MeshShape shape, BackendChoice choice, int device) const;

 private:
  bool initialized_mpi_ = false;
  CommunicatorPtr world_;
};

}  // namespace loom::dist

namespace loom::dist {

// In a job of several ranks, ends all of them now (MPI_Abort with `code`): an error on one rank
// must not leave the others waiting in a collective. Returns (does nothing) in a one-rank job.
void abort_job_if_multi_rank(int code);

}  // namespace loom::dist
