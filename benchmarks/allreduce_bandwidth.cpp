// loom-bench-allreduce: all-reduce bus bandwidth of loom's MPI backend against raw
// MPI_Allreduce on the same buffers, in one run: for each size, raw and loom alternate
// (raw, loom-blocking, loom-async, raw, ...) so machine noise hits all three. Run under
// `mpirun -np N`; rank 0 prints one JSON line per size.
//   bus bandwidth = 2 (n - 1) / n x bytes / time   (the ring all-reduce's traffic per rank)
#include <ATen/ATen.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "loom/apps/cli.h"
#include "loom/loom.h"

namespace {

using Clock = std::chrono::steady_clock;

// Median seconds of one call, over `reps` calls, each timed between barriers.
template <typename F>
double median_seconds(int reps, MPI_Comm comm, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(comm);
    const auto start = Clock::now();
    f();
    double s = std::chrono::duration<double>(Clock::now() - start).count();
    MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, comm);  // the slowest rank's time
    t.push_back(s);
  }
  std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(t.size() / 2), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"All-reduce bus bandwidth: loom's MPI backend vs raw MPI_Allreduce.",
               "loom-bench-allreduce"};
  int64_t min_bytes = 1024, max_bytes = 256ll << 20;
  double budget_s = 1.0;
  app.add_option("--min-bytes", min_bytes, "Smallest buffer")->capture_default_str();
  app.add_option("--max-bytes", max_bytes, "Largest buffer (sizes grow 4x)")->capture_default_str();
  app.add_option("--seconds", budget_s, "Time per size and variant (sets the repetitions)")
      ->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace(loom::dist::RuntimeOptions{.threads = 1});
    auto& loom_comm = *runtime->world();
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    const int n = loom_comm.size();
    for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      auto a = at::ones({bytes / 4}, at::kFloat);
      auto b = at::ones({bytes / 4}, at::kFloat);
      auto c = at::ones({bytes / 4}, at::kFloat);
      auto raw_call = [&] {
        MPI_Allreduce(MPI_IN_PLACE, a.data_ptr(), static_cast<int>(a.numel()), MPI_FLOAT, MPI_SUM,
                      raw);
      };
      auto loom_call = [&] { loom_comm.all_reduce(b); };
      auto loom_async = [&] { loom_comm.all_reduce_async(c)->wait(); };
      // Repetitions from one timed call, so each variant runs about `budget_s`.
      const double once = median_seconds(3, raw, raw_call);
      int reps = static_cast<int>(std::clamp(budget_s / std::max(once, 1e-7) / 3.0, 3.0, 2000.0));
      MPI_Bcast(&reps, 1, MPI_INT, 0, raw);
      std::vector<double> t_raw, t_loom, t_async;
      for (int round = 0; round < 3; ++round) {
        t_raw.push_back(median_seconds(reps, raw, raw_call));
        t_loom.push_back(median_seconds(reps, raw, loom_call));
        t_async.push_back(median_seconds(reps, raw, loom_async));
      }
      auto best = [](std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
      const double factor = 2.0 * (n - 1) / n * static_cast<double>(bytes) / 1e9;
      if (loom_comm.rank() == 0) {
        const double raw_bw = factor / best(t_raw), loom_bw = factor / best(t_loom),
                     async_bw = factor / best(t_async);
        nlohmann::json j = {{"bench", "allreduce"},
                            {"ranks", n},
                            {"bytes", bytes},
                            {"reps", reps},
                            {"raw_us", 1e6 * best(t_raw)},
                            {"loom_us", 1e6 * best(t_loom)},
                            {"loom_async_us", 1e6 * best(t_async)},
                            {"raw_mpi_busbw_GBps", raw_bw},
                            {"loom_busbw_GBps", loom_bw},
                            {"loom_async_busbw_GBps", async_bw},
                            {"loom_over_raw", loom_bw / raw_bw},
                            {"loom_async_over_raw", async_bw / raw_bw}};
        std::printf("%s\n", j.dump().c_str());
        std::fflush(stdout);
      }
    }
    MPI_Comm_free(&raw);
  });
}
