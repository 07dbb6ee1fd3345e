#include "loom/plan/measure.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/ops/adamw.h"
#include "loom/ops/attention.h"
#include "loom/ops/cuda.h"
#include "loom/plan/cost_model.h"

namespace loom::plan {

namespace {

// Median seconds of `repeats` runs of fn after one warm-up, each ended by a device sync.
double median_seconds(int64_t repeats, at::Device device, const std::function<void()>& fn) {
  auto sync = [&] {
    if (device.is_cuda()) at::zeros({1}, at::TensorOptions().device(device)).item<float>();
  };
  fn();
  sync();
  std::vector<double> times;
  for (int64_t i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    sync();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The smallest value over the ranks of `comm` (the slowest rank's rate).
double min_over(dist::Communicator& comm, double value) {
  auto t = at::full({1}, -value, at::kDouble);
  comm.all_reduce(t, dist::ReduceOp::Max);
  return -t.item<double>();
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

// Bandwidth and latency of `comm`'s ring all-reduce, fitted from a small and a large buffer.
Link measure_link(dist::Communicator& comm, const MeasureOptions& o) {
  const int64_t n = comm.size();
  const double ring = 2.0 * static_cast<double>(n - 1) / static_cast<double>(n);
  auto timed = [&](int64_t bytes) {
    auto buffer = at::ones({std::max<int64_t>(1, bytes / 4)}, at::kFloat);
    comm.all_reduce(buffer, dist::ReduceOp::Sum);  // warm-up
    std::vector<double> times;
    for (int64_t i = 0; i < o.repeats; ++i) {
      comm.barrier();  // every rank starts together, outside the timed region
      const auto start = std::chrono::steady_clock::now();
      comm.all_reduce(buffer, dist::ReduceOp::Sum);
      times.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
    const double t = times[times.size() / 2];
    // Every rank takes the slowest's time: the ring runs at its pace.
    auto slowest = at::full({1}, t, at::kDouble);
    comm.all_reduce(slowest, dist::ReduceOp::Max);
    return slowest.item<double>();
  };
  const double small = timed(o.small_bytes), large = timed(o.large_bytes);
  Link link;
  link.bandwidth =
      ring * static_cast<double>(o.large_bytes - o.small_bytes) / std::max(large - small, 1e-9);
  link.latency =
      std::max(0.0, (small - ring * static_cast<double>(o.small_bytes) / link.bandwidth) /
                        (2.0 * static_cast<double>(n - 1)));
  return link;
}

// What one process can copy in host memory per second (the "link" between ranks that share
// nothing but a node's memory, when there is only one of them to measure with).
Link memory_copy_link(const MeasureOptions& o) {
  auto src = at::ones({o.large_bytes / 4}, at::kFloat), dst = at::empty_like(src);
  const double t = median_seconds(o.repeats, at::kCPU, [&] { dst.copy_(src); });
  return {static_cast<double>(o.large_bytes) / t, 0.0};
}

}  // namespace

MachineProfile measure_machine(dist::Communicator& world, const MeasureOptions& o) {
  LOOM_CHECK(o.repeats >= 1 && o.matmul_size >= 16 && o.attention_seq >= 16 &&
                 o.adamw_params >= 1024 && o.small_bytes >= 4 && o.large_bytes > o.small_bytes,
             "measure: repeats {}, matmul size {}, attention tokens {}, AdamW parameters {} and "
             "buffer sizes {} < {} must be at least 1, 16, 16, 1024 and 4 bytes",
             o.repeats, o.matmul_size, o.attention_seq, o.adamw_params, o.small_bytes,
             o.large_bytes);
  const auto on = at::TensorOptions().device(o.device).dtype(o.dtype);
  DeviceProfile d;
  d.name = o.device.is_cuda() ? "cuda" : "cpu";
  {
    const int64_t n = o.matmul_size;
    auto a = at::randn({n, n}, on), b = at::randn({n, n}, on), c = at::empty({n, n}, on);
    const double t = median_seconds(o.repeats, o.device, [&] { at::mm_out(c, a, b); });
    d.matmul_flops = min_over(world, 2.0 * static_cast<double>(n * n * n) / t);
  }
  {
    const int64_t heads = 8, hd = 64, seq = o.attention_seq;
    auto q = at::randn({1, heads, seq, hd}, on), k = at::randn_like(q), v = at::randn_like(q);
    const double t = median_seconds(o.repeats, o.device, [&] { ops::attention(q, k, v); });
    // Causal: half of the two [T, T] products' 4 T^2 hd FLOPs per head.
    d.attention_flops = min_over(world, 2.0 * static_cast<double>(heads * seq * seq * hd) / t);
  }
  {
    const auto fp = at::TensorOptions().device(o.device).dtype(o.dtype == at::kDouble ? at::kDouble
                                                                                      : at::kFloat);
    auto w = at::randn({o.adamw_params}, fp), g = at::randn_like(w);
    auto m = at::zeros_like(w), v = at::zeros_like(w);
    int64_t step = 0;
    const double t = median_seconds(o.repeats, o.device, [&] {
      ops::adamw_update_(w, g, m, v, 1e-4, ++step, ops::AdamWOptions{}, true);
    });
    d.adamw_params_per_s = min_over(world, static_cast<double>(o.adamw_params) / t);
  }
  // The ranks of each node (by host name), then one rank per node.
  const auto host = static_cast<int64_t>(core::stable_hash(host_name()) >> 1);
  auto hosts = at::empty({world.size()}, at::kLong);
  world.all_gather(hosts, at::full({1}, host, at::kLong));
  std::vector<int64_t> node_of, seen;
  for (int64_t r = 0; r < world.size(); ++r) {
    const int64_t h = hosts[r].item<int64_t>();
    auto it = std::find(seen.begin(), seen.end(), h);
    if (it == seen.end()) it = seen.insert(seen.end(), h);
    node_of.push_back(it - seen.begin());
  }
  const int64_t my_node = node_of[static_cast<size_t>(world.rank())];
  const int64_t on_my_node = std::count(node_of.begin(), node_of.end(), my_node);
  const bool leader =
      std::find(node_of.begin(), node_of.end(), my_node) - node_of.begin() == world.rank();
  if (o.device.is_cuda()) {
    d.memory_bytes = min_over(
        world,
        static_cast<double>(ops::cuda_total_memory(o.device.index() < 0 ? 0 : o.device.index())));
  } else {
    const double host_memory =
        static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
    d.memory_bytes = min_over(world, host_memory / static_cast<double>(on_my_node));
  }
  MachineProfile p;
  p.name = "measured";
  p.devices.push_back(d);
  auto node = world.split(static_cast<int>(my_node), world.rank(), "measure-node");
  auto leaders = world.split(leader ? 0 : -1, world.rank(), "measure-leaders");
  int64_t per_node = on_my_node;
  auto most = at::full({1}, per_node, at::kLong);
  world.all_reduce(most, dist::ReduceOp::Max);
  p.devices_per_node = most.item<int64_t>();
  Link intra = node->size() > 1 ? measure_link(*node, o) : memory_copy_link(o);
  // Every rank takes node 0's link figures (rank 0 writes the profile): broadcast them.
  auto figures = at::tensor({intra.bandwidth, intra.latency}, at::kDouble);
  world.broadcast(figures, 0);
  p.intra_node = {figures[0].item<double>(), figures[1].item<double>()};
  const bool several_nodes = !seen.empty() && seen.size() > 1;
  Link inter = p.intra_node;
  if (several_nodes && leaders) inter = measure_link(*leaders, o);
  figures = at::tensor({inter.bandwidth, inter.latency}, at::kDouble);
  world.broadcast(figures, 0);
  p.inter_node = {figures[0].item<double>(), figures[1].item<double>()};
  p.validate("measured");
  return p;
}

}  // namespace loom::plan
