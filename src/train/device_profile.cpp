#include "loom/train/device_profile.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "loom/core/error.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace loom::train {

namespace {

namespace prof = torch::profiler::impl;

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// "[16, 1024, 768], [768]"; empty inputs (an optional argument) as [].
std::string shapes_text(const torch::autograd::profiler::KinetoEvent& e) {
  if (!e.hasShapes()) return "";
  std::vector<std::string> parts;
  for (const auto& s : e.shapes()) parts.push_back(fmt::format("[{}]", fmt::join(s, ", ")));
  return fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace

DeviceProfile::DeviceProfile(at::Device device) : device_(device) {}

DeviceProfile::~DeviceProfile() {
  if (running_) {
    try {
      torch::autograd::profiler::disableProfiler();
    } catch (...) {  // NOLINT(bugprone-empty-catch): nothing to keep from a profile abandoned
    }
  }
}

void DeviceProfile::start() {
  LOOM_CHECK(!running_ && !prof::profilerEnabled(),
             "profile: a profiler is already running on this thread");
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
  std::set<prof::ActivityType> activities = {prof::ActivityType::CPU};
  if (device_.is_cuda()) activities.insert(prof::ActivityType::CUDA);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  running_ = true;
  start_ms_ = now_ms();
}

double DeviceProfile::stop() {
  LOOM_CHECK(running_, "profile: stop() without start()");
#ifdef LOOM_WITH_CUDA
  if (device_.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device_);
    c10::cuda::device_synchronize();
  }
#endif
  const double wall = now_ms() - start_ms_;
  result_ = torch::autograd::profiler::disableProfiler();
  running_ = false;
  return wall;
}

void DeviceProfile::save_trace(const std::string& path) const {
  LOOM_CHECK(result_, "profile: no recorded profile to save (stop() first)");
  result_->save(path);
}

nlohmann::ordered_json DeviceProfile::table(int64_t steps, double wall_ms, size_t top) const {
  LOOM_CHECK(result_, "profile: no recorded profile (stop() first)");
  LOOM_CHECK(steps >= 1, "profile: steps {} must be >= 1", steps);
  const bool kernels = device_.is_cuda();
  // The CPU ops by correlation id: what launched each kernel, with its shapes.
  std::map<uint64_t, std::pair<std::string, std::string>> ops;
  if (kernels)
    for (const auto& e : result_->events())
      if (e.deviceType() == c10::DeviceType::CPU && e.correlationId() != 0)
        ops[e.correlationId()] = {e.name(), shapes_text(e)};
  struct Total {
    double ns = 0;
    int64_t calls = 0;
  };
  std::map<std::tuple<std::string, std::string, std::string>, Total> rows;
  double busy_ns = 0;
  const auto wanted = kernels ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  for (const auto& e : result_->events()) {
    if (e.deviceType() != wanted) continue;
    std::string launcher, shapes = kernels ? "" : shapes_text(e);
    if (kernels) {
      const auto op = ops.find(e.linkedCorrelationId());
      if (op != ops.end()) std::tie(launcher, shapes) = op->second;
    }
    auto& t = rows[{e.name(), launcher, shapes}];
    t.ns += static_cast<double>(e.durationNs());
    t.calls += 1;
    busy_ns += static_cast<double>(e.durationNs());
  }
  std::vector<std::pair<std::tuple<std::string, std::string, std::string>, Total>> sorted(
      rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  const double per_step = 1.0 / static_cast<double>(steps);
  nlohmann::ordered_json out = {{"steps", steps},
                                {"step_ms", wall_ms * per_step},
                                {"kernel_ms_per_step", busy_ns * 1e-6 * per_step},
                                {"distinct", sorted.size()},
                                {"times", kernels ? "kernel" : "inclusive op"}};
  auto& list = out["top"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < sorted.size() && i < top; ++i) {
    const auto& [key, t] = sorted[i];
    nlohmann::ordered_json row = {{"name", std::get<0>(key).substr(0, 160)}};
    if (kernels) row["launched_by"] = std::get<1>(key);
    row["input_shapes"] = std::get<2>(key).substr(0, 200);
    row["ms_per_step"] = t.ns * 1e-6 * per_step;
    row["calls_per_step"] = static_cast<double>(t.calls) * per_step;
    row["share"] = busy_ns > 0 ? t.ns / busy_ns : 0.0;
    list.push_back(std::move(row));
  }
  return out;
}

std::string DeviceProfile::format_table(const nlohmann::ordered_json& t) {
  std::string s = fmt::format(
      "{} steps, {:.3f} ms a step (wall), {:.3f} ms of {} time a step, {} distinct rows\n",
      t.at("steps").get<int64_t>(), t.at("step_ms").get<double>(),
      t.at("kernel_ms_per_step").get<double>(), t.at("times").get<std::string>(),
      t.at("distinct").get<size_t>());
  s += fmt::format("{:>10} {:>7} {:>8}  {:<60} {:<28} {}\n", "ms/step", "share", "calls", "name",
                   "launched by", "input shapes");
  for (const auto& r : t.at("top")) {
    const std::string name = r.at("name").get<std::string>();
    s += fmt::format("{:>10.4f} {:>6.1f}% {:>8.1f}  {:<60} {:<28} {}\n",
                     r.at("ms_per_step").get<double>(), 100 * r.at("share").get<double>(),
                     r.at("calls_per_step").get<double>(), name.substr(0, 60),
                     r.value("launched_by", std::string("-")).substr(0, 28),
                     r.at("input_shapes").get<std::string>());
  }
  return s;
}

}  // namespace loom::train
