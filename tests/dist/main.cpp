// Entry point of the multi-rank test binary: ctest runs it under `mpirun -np N` for N = 1..4.
// One Runtime for the whole process (MPI is initialized once).
#include <gtest/gtest.h>

#include <cstdlib>

#include "dist_util.h"
#include "loom/core/logging.h"
#include "loom/dist/runtime.h"

int main(int argc, char** argv) {
  // Ranks other than 0 print failures only (the printer is chosen inside InitGoogleTest, before
  // MPI tells us the rank: Open MPI's launcher says it in the environment).
  const char* launcher_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (launcher_rank == nullptr) launcher_rank = std::getenv("PMI_RANK");
  if (launcher_rank != nullptr && std::atoi(launcher_rank) != 0) GTEST_FLAG_SET(brief, true);
  ::testing::InitGoogleTest(&argc, argv);
  loom::dist::RuntimeOptions options;
  // A test that deadlocks (one rank failed an ASSERT and skipped a collective) is ended by the
  // watchdog instead of by ctest's timeout, with the op that hung in the log.
  const char* timeout = std::getenv("LOOM_TEST_COMM_TIMEOUT");
  options.comm_timeout = loom::dist::Seconds(timeout ? std::atof(timeout) : 120.0);
  loom::dist::Runtime runtime(options);
  loom::testing::set_runtime(&runtime);
  loom::core::setup_logging(runtime.rank() == 0 ? "warn" : "error");
  const int result = RUN_ALL_TESTS();
  loom::testing::set_runtime(nullptr);
  return result;
}
