#pragma once
// Which kernels a training step's device time goes to, from PyTorch's Kineto profiler (CUPTI on
// a GPU): the benchmark runs a few extra steps under it and reports, per kernel name, the device
// time per step and launches per step, beside the step's wall time. On a GPU a step whose
// kernels sum to much less than its wall time waits on the host (launches, syncs); one whose
// kernels fill it is bound by those kernels. On the CPU the profiler sees ops, not kernels: ops
// nest (a linear calls a matmul), so the CPU table's times are inclusive and do not add up to
// the step.
#include <c10/core/DeviceType.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace loom_bench {

class KernelProfile {
 public:
  explicit KernelProfile(c10::DeviceType device) : device_(device) {}

  void start() {
    namespace prof = torch::profiler::impl;
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
    const std::set<prof::ActivityType> activities = {
        device_ == c10::DeviceType::CUDA ? prof::ActivityType::CUDA : prof::ActivityType::CPU};
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  }

  // Ends the profile (the caller has synchronized the device) and summarizes `steps` steps that
  // took `wall_ms` together: the `top` kernels by device time.
  nlohmann::ordered_json stop(int64_t steps, double wall_ms, size_t top) {
    const auto result = torch::autograd::profiler::disableProfiler();
    struct Total {
      double ns = 0;
      int64_t calls = 0;
    };
    std::map<std::string, Total> by_name;
    double busy_ns = 0;
    for (const auto& e : result->events()) {
      if (e.deviceType() != device_) continue;
      auto& t = by_name[e.name()];
      t.ns += static_cast<double>(e.durationNs());
      t.calls += 1;
      busy_ns += static_cast<double>(e.durationNs());
    }
    std::vector<std::pair<std::string, Total>> rows(by_name.begin(), by_name.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
    const double per_step = 1.0 / static_cast<double>(steps);
    nlohmann::ordered_json out = {
        {"steps", steps},
        {"step_ms", wall_ms * per_step},
        {"kernel_ms_per_step", busy_ns * 1e-6 * per_step},
        {"distinct_kernels", rows.size()},
        {"times", device_ == c10::DeviceType::CUDA ? "kernel" : "inclusive op"}};
    auto& list = out["top"] = nlohmann::ordered_json::array();
    for (size_t i = 0; i < rows.size() && i < top; ++i)
      list.push_back({{"name", rows[i].first.substr(0, 160)},
                      {"ms_per_step", rows[i].second.ns * 1e-6 * per_step},
                      {"calls_per_step", static_cast<double>(rows[i].second.calls) * per_step}});
    return out;
  }

 private:
  c10::DeviceType device_;
};

}  // namespace loom_bench
