#include "loom/plan/machine_profile.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/json.h"

namespace loom::plan {

namespace {

using json = nlohmann::json;

constexpr const char* kDims[] = {"dp", "tp", "pp", "cp"};

double positive_number(const json& j, const char* key, const std::string& where) {
  LOOM_CHECK(j.contains(key), "{}: has no '{}'", where, key);
  const auto& v = j.at(key);
  LOOM_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0,
             "{}: '{}' is {}; it must be a positive number", where, key, v.dump());
  return v.get<double>();
}

// y at x on the piecewise-linear curve through (log x_i, y_i), held flat beyond its ends.
double interpolate_log(const std::vector<std::pair<double, double>>& points, double x) {
  if (points.size() == 1 || x <= points.front().first) return points.front().second;
  if (x >= points.back().first) return points.back().second;
  for (size_t i = 1; i < points.size(); ++i) {
    if (x > points[i].first) continue;
    const auto [x0, y0] = points[i - 1];
    const auto [x1, y1] = points[i];
    const double t = std::log(x / x0) / std::log(x1 / x0);
    return y0 + t * (y1 - y0);
  }
  return points.back().second;
}

// A finite number >= 0 under `key`, or 0 when the key is absent.
double optional_seconds(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key)) return 0;
  const auto& v = j.at(key);
  LOOM_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0,
             "{}: '{}' is {}; it must be a number of seconds >= 0", where, key, v.dump());
  return v.get<double>();
}

// A list of points of `N` positive numbers under `key` (absent: empty).
template <size_t N>
std::vector<std::array<double, N>> curve(const json& j, const char* key, const std::string& where) {
  std::vector<std::array<double, N>> out;
  if (!j.contains(key)) return out;
  const auto& list = j.at(key);
  const std::string fields = N == 2 ? "width, flops"
                             : std::string(key) == "block_attention_curve"
                                 ? "chunk, head_dim, flops"
                                 : "seq, head_dim, flops";
  LOOM_CHECK(list.is_array(), "{}: '{}' must be a list of [{}] points; got {}", where, key, fields,
             list.dump());
  for (const auto& point : list) {
    LOOM_CHECK(point.is_array() && point.size() == N, "{}: '{}' holds {}; each point is [{}]",
               where, key, point.dump(), fields);
    std::array<double, N> p{};
    for (size_t i = 0; i < N; ++i) {
      LOOM_CHECK(point[i].is_number(), "{}: '{}' holds {}, which is not all numbers", where, key,
                 point.dump());
      p[i] = point[i].get<double>();
    }
    out.push_back(p);
  }
  return out;
}

}  // namespace

double DeviceProfile::matmul_rate(double width) const {
  if (matmul_curve.empty()) return matmul_flops;
  std::vector<std::pair<double, double>> points;
  for (const auto& [w, flops] : matmul_curve) points.emplace_back(w, flops);
  return interpolate_log(points, width);
}

namespace {

// A (length, head_dim, rate) curve at (length, head_dim): the measured head_dim nearest in log,
// interpolated in log length.
double curve_rate(const std::vector<std::array<double, 3>>& curve, double length, double head_dim) {
  double nearest = curve.front()[1];
  for (const auto& p : curve)
    if (std::abs(std::log(p[1] / head_dim)) < std::abs(std::log(nearest / head_dim)))
      nearest = p[1];
  std::vector<std::pair<double, double>> points;
  for (const auto& p : curve)
    if (p[1] == nearest) points.emplace_back(p[0], p[2]);
  std::sort(points.begin(), points.end());
  return interpolate_log(points, length);
}

}  // namespace

double DeviceProfile::attention_rate(double seq, double head_dim) const {
  if (attention_curve.empty()) return attention_flops;
  return curve_rate(attention_curve, seq, head_dim);
}

double DeviceProfile::ring_attention_seconds(double flops, int64_t cp, double chunk,
                                             double head_dim) const {
  if (block_attention_curve.empty()) return flops / attention_rate(2 * chunk, head_dim);
  // The rank's FLOPs are 2 cp full blocks' worth (its 2 causal blocks make one); its time is
  // 2 cp - 1 full blocks' and 2 causal ones'.
  const double c = static_cast<double>(cp);
  const double blocks = (2 * c - 1 + 2 * causal_block_cost) / (2 * c);
  return flops * blocks / curve_rate(block_attention_curve, chunk, head_dim);
}

const DeviceProfile& MachineProfile::device_of_stage(int64_t stage, int64_t stages) const {
  LOOM_CHECK(!devices.empty(), "machine profile '{}' has no devices", name);
  if (stage_devices.empty()) return devices.front();
  LOOM_CHECK(static_cast<int64_t>(stage_devices.size()) == stages,
             "machine profile '{}' names devices for {} pipeline ranks; this layout has {}", name,
             stage_devices.size(), stages);
  const auto& wanted = stage_devices.at(static_cast<size_t>(stage));
  for (const auto& d : devices)
    if (d.name == wanted) return d;
  fail("machine profile '{}': stage {} runs on device '{}', which it does not define", name, stage,
       wanted);
}

const Link& MachineProfile::link(const std::string& dim, int64_t span) const {
  const auto it = links.find(dim);
  if (it != links.end()) return it->second;
  // Groups of `span` consecutive ranks fall inside nodes when they tile a node exactly.
  return span <= devices_per_node && devices_per_node % span == 0 ? intra_node : inter_node;
}

void MachineProfile::validate(const std::string& source) const {
  LOOM_CHECK(!devices.empty(), "machine profile '{}': 'devices' is empty", source);
  for (const auto& d : devices) {
    LOOM_CHECK(!d.name.empty(), "machine profile '{}': a device has no name", source);
    for (const auto& [what, v] : {std::pair{"matmul_flops", d.matmul_flops},
                                  {"attention_flops", d.attention_flops},
                                  {"memory_bytes", d.memory_bytes},
                                  {"adamw_params_per_s", d.adamw_params_per_s}})
      LOOM_CHECK(std::isfinite(v) && v > 0,
                 "machine profile '{}': device '{}' has {} = {}; it must be positive", source,
                 d.name, what, v);
    LOOM_CHECK(std::isfinite(d.peak_flops) && d.peak_flops >= 0,
               "machine profile '{}': device '{}' has peak_flops = {}; it must be a FLOP/s rate "
               ">= 0 (0: unknown)",
               source, d.name, d.peak_flops);
    for (const auto& [what, v] : {std::pair{"pointwise_s", d.pointwise_s},
                                  {"activation_s", d.activation_s},
                                  {"norm_s", d.norm_s},
                                  {"op_s", d.op_s}})
      LOOM_CHECK(std::isfinite(v) && v >= 0,
                 "machine profile '{}': device '{}' has {} = {}; it must be >= 0 seconds", source,
                 d.name, what, v);
    LOOM_CHECK(
        std::isfinite(d.causal_block_cost) && d.causal_block_cost > 0 && d.causal_block_cost <= 2,
        "machine profile '{}': device '{}' has causal_block_cost = {}; it must be in (0, "
        "2] (a causal block's time over a full one's)",
        source, d.name, d.causal_block_cost);
    LOOM_CHECK(std::isfinite(d.compute_scale) && d.compute_scale > 0,
               "machine profile '{}': device '{}' has compute_scale = {}; it must be positive",
               source, d.name, d.compute_scale);
    for (size_t i = 0; i < d.matmul_curve.size(); ++i) {
      const auto& [w, flops] = d.matmul_curve[i];
      LOOM_CHECK(std::isfinite(w) && w > 0 && std::isfinite(flops) && flops > 0 &&
                     (i == 0 || w > d.matmul_curve[i - 1][0]),
                 "machine profile '{}': device '{}' has matmul_curve point [{}, {}]; widths and "
                 "rates must be positive, widths increasing",
                 source, d.name, w, flops);
    }
    for (const auto& [key, curve] : {std::pair{"attention_curve", &d.attention_curve},
                                     {"block_attention_curve", &d.block_attention_curve}})
      for (const auto& [length, hd, flops] : *curve)
        LOOM_CHECK(std::isfinite(length) && length > 0 && std::isfinite(hd) && hd > 0 &&
                       std::isfinite(flops) && flops > 0,
                   "machine profile '{}': device '{}' has {} point [{}, {}, {}]; length, "
                   "head_dim and rate must be positive",
                   source, d.name, key, length, hd, flops);
    LOOM_CHECK(std::count_if(devices.begin(), devices.end(),
                             [&](const DeviceProfile& o) { return o.name == d.name; }) == 1,
               "machine profile '{}': device '{}' is defined twice", source, d.name);
  }
  std::vector<std::string> names;
  for (const auto& d : devices) names.push_back(d.name);
  for (const auto& s : stage_devices)
    LOOM_CHECK(std::find(names.begin(), names.end(), s) != names.end(),
               "machine profile '{}': stage_devices names '{}', an unknown device (defined: {})",
               source, s, fmt::join(names, ", "));
  LOOM_CHECK(devices_per_node >= 1, "machine profile '{}': devices_per_node {} must be >= 1",
             source, devices_per_node);
  LOOM_CHECK(std::isfinite(collective_s) && collective_s >= 0,
             "machine profile '{}': collective_s {} must be >= 0 seconds", source, collective_s);
  auto check_link = [&](const std::string& what, const Link& l) {
    LOOM_CHECK(
        std::isfinite(l.bandwidth) && l.bandwidth > 0 && std::isfinite(l.latency) && l.latency >= 0,
        "machine profile '{}': link '{}' has bandwidth {} and latency {}; bandwidth must "
        "be positive and latency >= 0",
        source, what, l.bandwidth, l.latency);
  };
  check_link("intra_node", intra_node);
  check_link("inter_node", inter_node);
  for (const auto& [dim, l] : links) {
    LOOM_CHECK(std::find(std::begin(kDims), std::end(kDims), dim) != std::end(kDims),
               "machine profile '{}': link '{}' is not a mesh dimension (dp, tp, pp, cp)", source,
               dim);
    check_link(dim, l);
  }
}

std::string MachineProfile::to_json() const {
  json j;
  j["devices"] = json::array();
  for (const auto& d : devices) {
    json o = {{"name", d.name},
              {"matmul_flops", d.matmul_flops},
              {"attention_flops", d.attention_flops},
              {"memory_bytes", d.memory_bytes},
              {"adamw_params_per_s", d.adamw_params_per_s}};
    if (!d.matmul_curve.empty()) o["matmul_curve"] = d.matmul_curve;
    if (!d.attention_curve.empty()) o["attention_curve"] = d.attention_curve;
    if (!d.block_attention_curve.empty()) {
      o["block_attention_curve"] = d.block_attention_curve;
      o["causal_block_cost"] = d.causal_block_cost;
    }
    for (const auto& [key, v] : {std::pair{"pointwise_s", d.pointwise_s},
                                 {"activation_s", d.activation_s},
                                 {"norm_s", d.norm_s},
                                 {"op_s", d.op_s}})
      if (v > 0) o[key] = v;
    if (d.ops_overlap_kernels) o["ops_overlap_kernels"] = true;
    if (d.compute_scale != 1) o["compute_scale"] = d.compute_scale;
    if (d.peak_flops > 0) o["peak_flops"] = d.peak_flops;
    j["devices"].push_back(o);
  }
  if (!stage_devices.empty()) j["stage_devices"] = stage_devices;
  j["devices_per_node"] = devices_per_node;
  if (collective_s > 0) j["collective_s"] = collective_s;
  j["links"]["intra_node"] = {{"bandwidth", intra_node.bandwidth}, {"latency", intra_node.latency}};
  j["links"]["inter_node"] = {{"bandwidth", inter_node.bandwidth}, {"latency", inter_node.latency}};
  for (const auto& [dim, l] : links)
    j["links"][dim] = {{"bandwidth", l.bandwidth}, {"latency", l.latency}};
  return j.dump(2);
}

MachineProfile MachineProfile::from_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("machine profile '{}' is not valid JSON: {}", source, e.what());
  }
  LOOM_CHECK(j.is_object(), "machine profile '{}' must be a JSON object", source);
  MachineProfile out;
  out.name = source;
  LOOM_CHECK(j.contains("devices") && j["devices"].is_array(),
             "machine profile '{}' has no 'devices' list", source);
  for (const auto& d : j["devices"]) {
    LOOM_CHECK(d.is_object() && d.contains("name") && d["name"].is_string(),
               "machine profile '{}': each device is an object with a 'name'; got {}", source,
               d.dump());
    DeviceProfile p;
    p.name = d["name"].get<std::string>();
    const auto where = fmt::format("machine profile '{}', device '{}'", source, p.name);
    p.matmul_flops = positive_number(d, "matmul_flops", where);
    p.attention_flops = positive_number(d, "attention_flops", where);
    p.memory_bytes = positive_number(d, "memory_bytes", where);
    p.adamw_params_per_s = positive_number(d, "adamw_params_per_s", where);
    p.matmul_curve = curve<2>(d, "matmul_curve", where);
    p.attention_curve = curve<3>(d, "attention_curve", where);
    p.block_attention_curve = curve<3>(d, "block_attention_curve", where);
    if (d.contains("causal_block_cost"))
      p.causal_block_cost = positive_number(d, "causal_block_cost", where);
    p.pointwise_s = optional_seconds(d, "pointwise_s", where);
    p.activation_s = optional_seconds(d, "activation_s", where);
    p.norm_s = optional_seconds(d, "norm_s", where);
    p.op_s = optional_seconds(d, "op_s", where);
    if (d.contains("compute_scale")) p.compute_scale = positive_number(d, "compute_scale", where);
    if (d.contains("peak_flops")) p.peak_flops = positive_number(d, "peak_flops", where);
    if (d.contains("ops_overlap_kernels")) {
      LOOM_CHECK(d["ops_overlap_kernels"].is_boolean(),
                 "{}: 'ops_overlap_kernels' is {}; use true or false", where,
                 d["ops_overlap_kernels"].dump());
      p.ops_overlap_kernels = d["ops_overlap_kernels"].get<bool>();
    }
    out.devices.push_back(p);
  }
  if (j.contains("stage_devices")) {
    LOOM_CHECK(j["stage_devices"].is_array(),
               "machine profile '{}': 'stage_devices' must be a list of device names", source);
    for (const auto& s : j["stage_devices"]) {
      LOOM_CHECK(s.is_string(), "machine profile '{}': stage_devices holds {}, not a name", source,
                 s.dump());
      out.stage_devices.push_back(s.get<std::string>());
    }
  }
  if (j.contains("collective_s"))
    out.collective_s =
        optional_seconds(j, "collective_s", fmt::format("machine profile '{}'", source));
  if (j.contains("devices_per_node"))
    out.devices_per_node = core::json_int64(
        j["devices_per_node"], fmt::format("machine profile '{}': devices_per_node", source), 1);
  LOOM_CHECK(j.contains("links") && j["links"].is_object(),
             "machine profile '{}' has no 'links' object (intra_node, inter_node)", source);
  for (const char* needed : {"intra_node", "inter_node"})
    LOOM_CHECK(j["links"].contains(needed), "machine profile '{}': 'links' has no '{}'", source,
               needed);
  for (const auto& [key, l] : j["links"].items()) {
    const bool node = key == "intra_node" || key == "inter_node";
    LOOM_CHECK(node || std::find(std::begin(kDims), std::end(kDims), key) != std::end(kDims),
               "machine profile '{}': link '{}' is neither intra_node, inter_node nor a mesh "
               "dimension (dp, tp, pp, cp)",
               source, key);
    const auto where = fmt::format("machine profile '{}', link '{}'", source, key);
    LOOM_CHECK(l.is_object(), "{}: must be an object with bandwidth and latency", where);
    Link link;
    link.bandwidth = positive_number(l, "bandwidth", where);
    LOOM_CHECK(l.contains("latency") && l["latency"].is_number(), "{}: has no numeric 'latency'",
               where);
    link.latency = l["latency"].get<double>();
    if (key == "intra_node")
      out.intra_node = link;
    else if (key == "inter_node")
      out.inter_node = link;
    else
      out.links[key] = link;
  }
  out.validate(source);
  return out;
}

MachineProfile MachineProfile::load(const std::string& path) {
  return from_json(core::read_file(path), path);
}

MachineProfile MachineProfile::named(const std::string& name) {
  const auto names = builtin_profile_names();
  if (std::find(names.begin(), names.end(), name) != names.end()) return builtin_profile(name);
  LOOM_CHECK(std::filesystem::exists(name),
             "machine profile '{}' is neither a file nor built in (built-in: {})", name,
             fmt::join(names, ", "));
  return load(name);
}

bool MachineProfile::is_profile(const std::string& name) {
  const auto names = builtin_profile_names();
  if (std::find(names.begin(), names.end(), name) != names.end()) return true;
  std::error_code error;
  if (!std::filesystem::is_regular_file(name, error)) return false;
  const auto j = json::parse(core::read_file(name), nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("links");
}

std::vector<std::string> builtin_profile_names() {
  return {"h100-node", "h200-node"};
}

MachineProfile builtin_profile(const std::string& name) {
  // Datasheet rates discounted to what dense training reaches: 989 TFLOP/s bf16 dense -> 60 % in
  // matmuls, 40 % in attention; AdamW is memory-bound (28 bytes read and written per fp32
  // parameter) at about 80 % of HBM bandwidth. NVLink 4: 450 GB/s per direction, 80 % of it in
  // ring collectives; one 400 Gb/s InfiniBand NIC per GPU: 50 GB/s, 80 % of it.
  MachineProfile p;
  p.name = name;
  DeviceProfile d;
  d.peak_flops = 989e12;  // dense bf16
  d.matmul_flops = 0.60 * d.peak_flops;
  d.attention_flops = 0.40 * d.peak_flops;
  if (name == "h100-node") {
    d.name = "h100";
    d.memory_bytes = 80e9;
    d.adamw_params_per_s = 0.8 * 3.35e12 / 28;
  } else if (name == "h200-node") {
    d.name = "h200";
    d.memory_bytes = 141e9;
    d.adamw_params_per_s = 0.8 * 4.8e12 / 28;
  } else {
    fail("machine profile '{}' is not built in; built-in: {} (or pass a JSON file)", name,
         fmt::join(builtin_profile_names(), ", "));
  }
  // Elementwise ops are memory-bound: bf16 elements moved, forward and backward, at 70 % of HBM
  // bandwidth (a product 9 moves, the GELU 5, a LayerNorm 6). An op's launch and dispatch,
  // about 10 us, overlaps the kernels queued before it.
  const double hbm = name == "h100-node" ? 3.35e12 : 4.8e12;
  d.pointwise_s = 9 * 2 / (0.7 * hbm);
  d.activation_s = 5 * 2 / (0.7 * hbm);
  d.norm_s = 6 * 2 / (0.7 * hbm);
  d.op_s = 1e-5;
  d.ops_overlap_kernels = true;
  p.devices.push_back(d);
  p.devices_per_node = 8;
  p.collective_s = 2e-5;               // a NCCL launch and the wait for the group
  p.intra_node = {0.8 * 450e9, 5e-6};  // NVLink
  p.inter_node = {0.8 * 50e9, 1e-5};   // InfiniBand
  p.validate(name);
  return p;
}

}  // namespace loom::plan
