#include "loom/parallel/pipeline/partition.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/format.h"

namespace loom::parallel::pipeline {

bool is_device_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return false;
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("devices") || !j["devices"].is_array()) return false;
  for (const auto& d : j["devices"])
    if (!d.is_object() || !d.contains("speed")) return false;
  return true;
}

std::vector<DeviceSpec> uniform_devices(int64_t pp) {
  return std::vector<DeviceSpec>(static_cast<size_t>(std::max<int64_t>(pp, 0)));
}

std::vector<DeviceSpec> load_device_file(const std::string& path, int64_t pp) {
  std::ifstream in(path);
  LOOM_CHECK(in.good(), "--pp-devices '{}': cannot open the device file", path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    fail("--pp-devices '{}' is not valid JSON: {}", path, e.what());
  }
  LOOM_CHECK(j.is_object() && j.contains("devices") && j["devices"].is_array(),
             "--pp-devices '{}' must be a JSON object with a \"devices\" array (one entry per "
             "pipeline rank: {{\"name\": ..., \"speed\": ..., \"memory_gb\": ...}})",
             path);
  const auto& list = j["devices"];
  LOOM_CHECK(static_cast<int64_t>(list.size()) == pp,
             "--pp-devices '{}' lists {} devices but --pp is {}: give one per pipeline rank", path,
             list.size(), pp);
  std::vector<DeviceSpec> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& d = list[i];
    DeviceSpec spec;
    try {
      spec.name = d.value("name", fmt::format("device{}", i));
      spec.speed = d.value("speed", 1.0);
      spec.memory_gb = d.value("memory_gb", 0.0);
    } catch (const std::exception& e) {
      fail("--pp-devices '{}': device {} is malformed: {}", path, i, e.what());
    }
    LOOM_CHECK(std::isfinite(spec.speed) && spec.speed > 0,
               "--pp-devices '{}': device {} ('{}') has speed {}; it must be > 0 (relative "
               "throughput, 1 = reference)",
               path, i, spec.name, spec.speed);
    LOOM_CHECK(std::isfinite(spec.memory_gb) && spec.memory_gb >= 0,
               "--pp-devices '{}': device {} ('{}') has memory_gb {}; it must be >= 0 (0: no "
               "limit)",
               path, i, spec.name, spec.memory_gb);
    out.push_back(spec);
  }
  return out;
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct Evaluator {
  const LayerCosts& costs;
  const PipelineShape& shape;
  const std::vector<DeviceSpec>& devices;
  std::vector<double> time_prefix, bytes_prefix;

  Evaluator(const LayerCosts& c, const PipelineShape& s, const std::vector<DeviceSpec>& d)
      : costs(c), shape(s), devices(d) {
    time_prefix.push_back(0);
    bytes_prefix.push_back(0);
    for (size_t i = 0; i < c.layer_time.size(); ++i) {
      time_prefix.push_back(time_prefix.back() + c.layer_time[i]);
      bytes_prefix.push_back(bytes_prefix.back() + c.layer_bytes[i]);
    }
  }
  const DeviceSpec& device(int64_t stage) const {
    return devices[static_cast<size_t>(shape.rank_of(stage))];
  }
  double time(int64_t stage, int64_t begin, int64_t end) const {
    double t = time_prefix[static_cast<size_t>(end)] - time_prefix[static_cast<size_t>(begin)];
    if (stage == 0) t += costs.first_time;
    if (stage == shape.stages() - 1) t += costs.last_time;
    return t / device(stage).speed;
  }
  double bytes(int64_t stage, int64_t begin, int64_t end) const {
    double b = bytes_prefix[static_cast<size_t>(end)] - bytes_prefix[static_cast<size_t>(begin)];
    if (stage == 0) b += costs.first_bytes;
    if (stage == shape.stages() - 1) b += costs.last_bytes;
    return b;
  }
  // A chunk may use 1/v of its rank's memory.
  double capacity(int64_t stage) const {
    const double gb = device(stage).memory_gb;
    return gb > 0 ? gb * kGiB / static_cast<double>(shape.virtual_stages)
                  : std::numeric_limits<double>::infinity();
  }
};

void check_inputs(const LayerCosts& costs, const PipelineShape& shape,
                  const std::vector<DeviceSpec>& devices) {
  shape.validate();
  const auto layers = static_cast<int64_t>(costs.layer_time.size());
  LOOM_CHECK(costs.layer_bytes.size() == costs.layer_time.size(),
             "partition: {} layer times but {} layer sizes", costs.layer_time.size(),
             costs.layer_bytes.size());
  LOOM_CHECK(static_cast<int64_t>(devices.size()) == shape.ranks, "partition: {} devices for pp {}",
             devices.size(), shape.ranks);
  LOOM_CHECK(layers >= shape.stages(),
             "the model has {} layers but the pipeline has {} stages (pp {} x virtual stages "
             "{}): every stage needs at least one layer; lower --pp or --virtual-stages",
             layers, shape.stages(), shape.ranks, shape.virtual_stages);
}

Partition finish(const Evaluator& ev, std::vector<int64_t> bounds) {
  Partition p;
  p.shape = ev.shape;
  p.devices = ev.devices;
  p.bounds = std::move(bounds);
  for (int64_t s = 0; s < ev.shape.stages(); ++s) {
    p.time.push_back(ev.time(s, p.first_layer(s), p.end_layer(s)));
    p.bytes.push_back(ev.bytes(s, p.first_layer(s), p.end_layer(s)));
  }
  return p;
}

}  // namespace

double Partition::imbalance() const {
  if (time.empty()) return 1.0;
  double sum = 0, worst = 0;
  for (double t : time) sum += t, worst = std::max(worst, t);
  return sum > 0 ? worst / (sum / static_cast<double>(time.size())) : 1.0;
}

std::string Partition::describe() const {
  std::string out;
  for (int64_t s = 0; s < shape.stages(); ++s) {
    const int64_t r = shape.rank_of(s);
    const auto& d = devices[static_cast<size_t>(r)];
    out += fmt::format(
        "\n  stage {} on pp rank {} ({}, speed {:g}{}): layers {}-{} ({}){}{} | predicted time "
        "{:.3g} | memory {}",
        s, r, d.name, d.speed, d.memory_gb > 0 ? fmt::format(", {:g} GiB", d.memory_gb) : "",
        first_layer(s), end_layer(s) - 1, layers(s), s == 0 ? " + embedding" : "",
        s == shape.stages() - 1 ? " + head" : "", time[static_cast<size_t>(s)],
        core::format_bytes(static_cast<int64_t>(bytes[static_cast<size_t>(s)])));
  }
  return out;
}

Partition uniform_partition(const LayerCosts& costs, const PipelineShape& shape,
                            const std::vector<DeviceSpec>& devices) {
  check_inputs(costs, shape, devices);
  const auto layers = static_cast<int64_t>(costs.layer_time.size());
  const int64_t stages = shape.stages();
  std::vector<int64_t> bounds{0};
  for (int64_t s = 0; s < stages; ++s)
    bounds.push_back(bounds.back() + layers / stages + (s < layers % stages ? 1 : 0));
  return finish(Evaluator(costs, shape, devices), bounds);
}

Partition partition_layers(const LayerCosts& costs, const PipelineShape& shape,
                           const std::vector<DeviceSpec>& devices) {
  check_inputs(costs, shape, devices);
  const Evaluator ev(costs, shape, devices);
  const auto layers = static_cast<int64_t>(costs.layer_time.size());
  const int64_t stages = shape.stages();
  // best[s][j]: the smallest bottleneck (then the smallest sum of squared stage times, which
  // spreads what the bottleneck leaves free) of stages 0..s-1 holding layers [0, j).
  constexpr double kInf = std::numeric_limits<double>::infinity();
  struct Cell {
    double worst = kInf, squares = kInf;
    int64_t from = -1;
  };
  std::vector<std::vector<Cell>> best(static_cast<size_t>(stages + 1),
                                      std::vector<Cell>(static_cast<size_t>(layers + 1)));
  best[0][0] = {0, 0, 0};
  for (int64_t s = 0; s < stages; ++s) {
    // Stage s ends at j, leaving at least one layer for each stage after it.
    for (int64_t j = s + 1; j <= layers - (stages - s - 1); ++j) {
      auto& cell = best[static_cast<size_t>(s + 1)][static_cast<size_t>(j)];
      for (int64_t i = s; i < j; ++i) {
        const auto& prev = best[static_cast<size_t>(s)][static_cast<size_t>(i)];
        if (prev.worst == kInf) continue;
        if (ev.bytes(s, i, j) > ev.capacity(s)) continue;
        const double t = ev.time(s, i, j);
        const double worst = std::max(prev.worst, t), squares = prev.squares + t * t;
        const double eps = 1e-12 * std::max(1.0, worst);
        if (worst < cell.worst - eps ||
            (std::abs(worst - cell.worst) <= eps && squares < cell.squares))
          cell = {worst, squares, i};
      }
    }
  }
  if (best[static_cast<size_t>(stages)][static_cast<size_t>(layers)].worst == kInf) {
    // Name what the even split would need, rank by rank, against what each has.
    const auto even = uniform_partition(costs, shape, devices);
    std::string needs;
    for (int64_t r = 0; r < shape.ranks; ++r) {
      double need = 0;
      for (int64_t c = 0; c < shape.virtual_stages; ++c)
        need += even.bytes[static_cast<size_t>(shape.stage_of(r, c))];
      needs += fmt::format("{}rank {} needs {} of {:g} GiB", needs.empty() ? "" : "; ", r,
                           core::format_bytes(static_cast<int64_t>(need)),
                           devices[static_cast<size_t>(r)].memory_gb);
    }
    fail(
        "no pipeline partition of {} layers into {} stages fits the devices' memory (an even "
        "split: {}); add pipeline ranks, shard more (--tp, --zero), or lower --micro-batch size",
        layers, stages, needs);
  }
  std::vector<int64_t> bounds(static_cast<size_t>(stages + 1));
  bounds[static_cast<size_t>(stages)] = layers;
  for (int64_t s = stages; s > 0; --s)
    bounds[static_cast<size_t>(s - 1)] =
        best[static_cast<size_t>(s)][static_cast<size_t>(bounds[static_cast<size_t>(s)])].from;
  return finish(ev, bounds);
}

}  // namespace loom::parallel::pipeline
