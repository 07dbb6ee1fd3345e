#pragma once
// Where training steps spend their time, from PyTorch's Kineto profiler (CUPTI on a GPU): a
// Chrome trace of everything recorded (chrome://tracing, Perfetto) and a table of the top kernels
// by device time, each with the ATen op that launched it and that op's input shapes. On the CPU
// the profiler sees ops, not kernels: the table then lists ops by inclusive time (ops nest, a
// linear calls a matmul, so the rows do not add up to the step). What --profile-steps writes
// (the "profile" strategy, docs/gpu.md) and loom-bench-train --kernel-profile reports.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace torch::autograd::profiler {
struct ProfilerResult;
}

namespace loom::train {

class DeviceProfile {
 public:
  // Profiles `device`'s kernels (CUDA) or the CPU's ops, recording each op's input shapes.
  explicit DeviceProfile(at::Device device);
  ~DeviceProfile();  // stops a profile still running, keeping nothing
  DeviceProfile(const DeviceProfile&) = delete;
  DeviceProfile& operator=(const DeviceProfile&) = delete;

  // Starts recording on this thread (and the autograd threads it starts); loom::Error when a
  // profile is already running here.
  void start();
  // Waits for the device, ends the recording and returns the wall time since start() in ms.
  double stop();
  bool running() const { return running_; }

  // The recorded events as a Chrome trace at `path` (after stop()).
  void save_trace(const std::string& path) const;
  // The `top` rows by time over `steps` steps that took `wall_ms` together (after stop()):
  // {"steps", "step_ms", "kernel_ms_per_step" (the device's busy time; on the CPU the sum of
  // inclusive op times), "times": "kernel" | "inclusive op", "top": [{"name", "launched_by" (the
  // ATen op; CUDA only), "input_shapes", "ms_per_step", "calls_per_step", "share"}]}. Rows group
  // by name, launching op and shapes.
  nlohmann::ordered_json table(int64_t steps, double wall_ms, size_t top) const;
  // The same as fixed-width text, one row a line.
  static std::string format_table(const nlohmann::ordered_json& table);

 private:
  at::Device device_;
  bool running_ = false;
  double start_ms_ = 0;
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result_;
};

}  // namespace loom::train
