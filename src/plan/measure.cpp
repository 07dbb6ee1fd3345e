#include "loom/plan/measure.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/activation.h"
#include "loom/ops/adamw.h"
#include "loom/ops/attention.h"
#include "loom/ops/attention_partial.h"
#include "loom/ops/cuda.h"
#include "loom/plan/cost_model.h"

namespace loom::plan {

namespace {

// Seconds of one run of fn over `repeats` samples after a warm-up, each sample ended by a
// device sync: the median, or with `fastest` the quickest sample (what the machine does when
// nothing else interferes: the reference the model is scaled to). A sample runs fn enough
// times to last about 5 ms: single short runs are mostly timer and scheduler noise.
double sample_seconds(int64_t repeats, at::Device device, const std::function<void()>& fn,
                      bool fastest) {
  auto sync = [&] {
    if (device.is_cuda()) at::zeros({1}, at::TensorOptions().device(device)).item<float>();
  };
  auto timed = [&](int64_t runs) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < runs; ++i) fn();
    sync();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
           static_cast<double>(runs);
  };
  fn();
  sync();
  const double once = timed(1);
  const auto runs =
      static_cast<int64_t>(std::clamp(std::ceil(5e-3 / std::max(once, 1e-9)), 1.0, 1e4));
  std::vector<double> times;
  for (int64_t i = 0; i < repeats; ++i) times.push_back(timed(runs));
  std::sort(times.begin(), times.end());
  return fastest ? times.front() : times[times.size() / 2];
}

double median_seconds(int64_t repeats, at::Device device, const std::function<void()>& fn) {
  return sample_seconds(repeats, device, fn, false);
}

// The smallest value over the ranks of `comm` (the slowest rank's rate).
double min_over(dist::Communicator& comm, double value) {
  auto t = at::full({1}, -value, at::kDouble);
  comm.all_reduce(t, dist::ReduceOp::Max);
  return -t.item<double>();
}

// The largest value over the ranks (the slowest rank's time).
double max_over(dist::Communicator& comm, double value) {
  return -min_over(comm, -value);
}

// Seconds of fn's forward and of the backward from its output (a gradient of ones-like
// values), median over repeats.
double forward_backward_seconds(int64_t repeats, at::Device device, const at::Tensor& input,
                                const std::function<at::Tensor(const at::Tensor&)>& fn) {
  auto x = input.detach().clone().set_requires_grad(true);
  at::Tensor grad;
  return median_seconds(repeats, device, [&] {
    auto y = fn(x);
    if (!grad.defined()) grad = at::randn_like(y);
    y.backward(grad);
    x.mutable_grad().reset();
  });
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

// Times gpt2-tiny's forward and backward (o.reference_batch x 128 tokens, byte vocabulary)
// and divides by what the cost model predicts for it from `device`'s rates.
double reference_scale(const DeviceProfile& device, const MeasureOptions& o) {
  auto config = models::ModelConfig::preset("gpt2-tiny");
  config.vocab_size = 256;
  const int64_t seq = 128;
  LOOM_CHECK(o.dtype == at::kFloat || o.dtype == at::kDouble || o.dtype == at::kBFloat16,
             "measure: the reference model runs in fp32, fp64 or bf16, not {}",
             c10::toString(o.dtype));
  const bool autocast = o.dtype == at::kBFloat16;
  auto model = models::make_model(config);
  model->to(o.device, autocast ? at::kFloat : o.dtype);
  models::init_parameters(*model, 0);
  model->train();
  const auto ids = at::TensorOptions().device(o.device).dtype(at::kLong);
  auto tokens = at::randint(0, config.vocab_size, {o.reference_batch, seq + 1}, ids);
  auto input = tokens.narrow(1, 0, seq), targets = tokens.narrow(1, 1, seq);
  const double measured = sample_seconds(
      std::max(o.repeats, o.reference_repeats), o.device,
      [&] {
        at::Tensor loss;
        {
          core::Bf16Autocast guard(autocast, o.device.type());
          loss = model->loss(input, targets);
        }
        loss.backward();
        for (auto& p : model->parameters()) p.mutable_grad().reset();
      },
      /*fastest=*/true);
  MachineProfile one;
  one.name = "reference";
  one.devices.push_back(device);
  one.devices.back().compute_scale = 1;
  const auto precision = o.dtype == at::kDouble ? "fp64" : autocast ? "bf16" : "fp32";
  const auto predicted = predict({config, o.reference_batch, seq, precision}, Layout{}, one);
  return measured / predicted.compute_s;
}

// Seconds a small all-reduce adds between matmuls of about a millisecond each, the slowest
// rank's: what a collective costs a training step beyond its bytes, when the ranks are busy
// computing around it (0 for one rank).
double collective_overhead(dist::Communicator& world, const DeviceProfile& d,
                           const MeasureOptions& o) {
  if (world.size() == 1) return 0;
  const auto on = at::TensorOptions().device(o.device).dtype(o.dtype);
  const auto n = std::max<int64_t>(
      16, static_cast<int64_t>(std::cbrt(std::min(d.matmul_flops, 1e15) * 1e-3 / 2)));
  auto a = at::randn({n, n}, on), b = at::randn({n, n}, on), c = at::empty({n, n}, on);
  auto buffer = at::ones({1024}, at::kFloat);
  const int64_t rounds = 20;
  // A fixed number of rounds on every rank (the collectives must pair up), the median sample.
  auto timed = [&](bool with_collective) {
    std::vector<double> samples;
    for (int64_t k = 0; k <= o.repeats; ++k) {  // the first is a warm-up
      world.barrier();
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < rounds; ++i) {
        at::mm_out(c, a, b);
        if (with_collective) {
          if (o.device.is_cuda()) c.sum().item<float>();  // the host waits, as a step does
          world.all_reduce(buffer, dist::ReduceOp::Sum);
        }
      }
      if (o.device.is_cuda()) c.sum().item<float>();
      if (k > 0)
        samples.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(samples.begin(), samples.end());
    return samples[samples.size() / 2] / static_cast<double>(rounds);
  };
  const double alone = timed(false), with = timed(true);
  return max_over(world, std::max(0.0, with - alone));
}

}  // namespace

MeasureOptions MeasureOptions::for_device(at::Device device, const std::string& precision) {
  LOOM_CHECK(precision == "fp32" || precision == "bf16" || precision == "fp64",
             "--precision '{}' is not valid: use fp32, bf16 or fp64", precision);
  MeasureOptions o;
  o.device = device;
  o.dtype = precision == "bf16" ? at::kBFloat16 : precision == "fp64" ? at::kDouble : at::kFloat;
  if (device.is_cuda()) {
    o.matmul_size = 4096;
    o.attention_seq = 2048;
    o.matmul_widths = {256, 512, 1024, 2048, 4096, 8192};
    o.matmul_tokens = 8192;
    o.attention_seqs = {512, 2048, 8192};
    o.attention_head_dims = {64, 128};
    o.block_attention_chunks = {256, 1024, 4096};
    o.pointwise_elements = int64_t{1} << 24;
  }
  return o;
}

MachineProfile measure_machine(dist::Communicator& world, const MeasureOptions& o) {
  LOOM_CHECK(o.repeats >= 1 && o.matmul_size >= 16 && o.attention_seq >= 16 &&
                 o.adamw_params >= 1024 && o.small_bytes >= 4 && o.large_bytes > o.small_bytes,
             "measure: repeats {}, matmul size {}, attention tokens {}, AdamW parameters {} and "
             "buffer sizes {} < {} must be at least 1, 16, 16, 1024 and 4 bytes",
             o.repeats, o.matmul_size, o.attention_seq, o.adamw_params, o.small_bytes,
             o.large_bytes);
  LOOM_CHECK(o.matmul_tokens >= 1 && o.pointwise_elements >= 256 && o.op_chain >= 1,
             "measure: matmul tokens {}, elementwise elements {} and op chain {} must be at least "
             "1, 256 and 1",
             o.matmul_tokens, o.pointwise_elements, o.op_chain);
  for (size_t i = 0; i < o.matmul_widths.size(); ++i)
    LOOM_CHECK(o.matmul_widths[i] >= 1 && (i == 0 || o.matmul_widths[i] > o.matmul_widths[i - 1]),
               "measure: matmul widths must be positive and increasing; got {} after {}",
               o.matmul_widths[i], i == 0 ? 0 : o.matmul_widths[i - 1]);
  for (const auto v : o.attention_seqs)
    LOOM_CHECK(v >= 1, "measure: attention sequence length {} must be at least 1", v);
  for (const auto v : o.attention_head_dims)
    LOOM_CHECK(v >= 1, "measure: attention head_dim {} must be at least 1", v);
  for (const auto v : o.block_attention_chunks)
    LOOM_CHECK(v >= 1, "measure: ring attention chunk {} must be at least 1", v);
  const auto on = at::TensorOptions().device(o.device).dtype(o.dtype);
  DeviceProfile d;
  d.name = o.device.is_cuda() ? "cuda" : "cpu";
  {
    const int64_t n = o.matmul_size;
    auto a = at::randn({n, n}, on), b = at::randn({n, n}, on), c = at::empty({n, n}, on);
    const double t = median_seconds(o.repeats, o.device, [&] { at::mm_out(c, a, b); });
    d.matmul_flops = min_over(world, 2.0 * static_cast<double>(n * n * n) / t);
  }
  for (const int64_t w : o.matmul_widths) {
    auto a = at::randn({o.matmul_tokens, w}, on), b = at::randn({w, w}, on);
    auto c = at::empty({o.matmul_tokens, w}, on);
    const double t = median_seconds(o.repeats, o.device, [&] { at::mm_out(c, a, b); });
    d.matmul_curve.push_back(
        {static_cast<double>(w),
         min_over(world, 2.0 * static_cast<double>(o.matmul_tokens * w * w) / t)});
  }
  {
    const int64_t heads = 8, hd = 64, seq = o.attention_seq;
    auto q = at::randn({1, heads, seq, hd}, on), k = at::randn_like(q), v = at::randn_like(q);
    const double t = median_seconds(o.repeats, o.device, [&] { ops::attention(q, k, v); });
    // Causal: half of the two [T, T] products' 4 T^2 hd FLOPs per head.
    d.attention_flops = min_over(world, 2.0 * static_cast<double>(heads * seq * seq * hd) / t);
  }
  // Forward and backward, as training runs it: the backward's share differs with the shape.
  for (const int64_t hd : o.attention_head_dims) {
    for (const int64_t seq : o.attention_seqs) {
      const int64_t heads = 8;
      auto q = at::randn({1, heads, seq, hd}, on).set_requires_grad(true);
      auto k = at::randn_like(q).set_requires_grad(true);
      auto v = at::randn_like(q).set_requires_grad(true);
      auto grad = at::randn_like(q);
      const double t = median_seconds(o.repeats, o.device, [&] {
        ops::attention(q, k, v).backward(grad);
        for (auto* x : {&q, &k, &v}) x->mutable_grad().reset();
      });
      d.attention_curve.push_back(
          {static_cast<double>(seq), static_cast<double>(hd),
           min_over(world, 3 * 2.0 * static_cast<double>(heads * seq * seq * hd) / t)});
    }
  }
  // Ring attention's blocks, as RingAttention runs them: the partial forward merged into the
  // running result, and the partial backward with its gradients added into the rank's own. Full
  // blocks give the curve; causal (diagonal) ones, timed beside them, their cost relative to a
  // full one's (the median over the points).
  std::vector<double> causal_costs;
  for (const int64_t hd : o.attention_head_dims) {
    for (const int64_t chunk : o.block_attention_chunks) {
      const int64_t batch = 4, heads = 8;
      auto q = at::randn({batch, heads, chunk, hd}, on), k = at::randn_like(q),
           v = at::randn_like(q), dout = at::randn_like(q);
      auto dq = at::zeros_like(q), dk = at::zeros_like(q), dv = at::zeros_like(q);
      const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
      auto block_seconds = [&](ops::BlockMask mask) {
        return median_seconds(o.repeats, o.device, [&] {
          auto acc = ops::empty_partial_attention(q);
          ops::merge_partial_attention(acc, ops::attention_partial_forward(q, k, v, mask, scale));
          const auto g =
              ops::attention_partial_backward(q, k, v, acc.out, acc.lse, dout, mask, scale);
          dq.add_(g.dq), dk.add_(g.dk), dv.add_(g.dv);
        });
      };
      const double full = max_over(world, block_seconds(ops::BlockMask::kFull));
      const double causal = max_over(world, block_seconds(ops::BlockMask::kCausal));
      d.block_attention_curve.push_back(
          {static_cast<double>(chunk), static_cast<double>(hd),
           3 * 4.0 * static_cast<double>(batch * heads * chunk * chunk * hd) / full});
      causal_costs.push_back(std::clamp(causal / full, 0.05, 2.0));
    }
  }
  if (!causal_costs.empty()) {
    std::nth_element(causal_costs.begin(), causal_costs.begin() + causal_costs.size() / 2,
                     causal_costs.end());
    d.causal_block_cost = causal_costs[causal_costs.size() / 2];
  }
  {
    // Elementwise ops, forward and backward, per element.
    const int64_t rows = std::max<int64_t>(1, o.pointwise_elements / 256);
    const auto n = static_cast<double>(rows * 256);
    auto x = at::randn({rows, 256}, on), w = at::randn({rows, 256}, on);
    d.pointwise_s = max_over(world, forward_backward_seconds(o.repeats, o.device, x, [&](auto& in) {
                                      return in * w.detach().requires_grad_(true);
                                    }) / n);
    d.activation_s = max_over(world, forward_backward_seconds(o.repeats, o.device, x, [](auto& in) {
                                       return ops::gelu_tanh(in);
                                     }) / n);
    auto gamma = at::ones({256}, on).requires_grad_(true), beta = at::zeros({256}, on);
    beta.requires_grad_(true);
    d.norm_s = max_over(world, forward_backward_seconds(o.repeats, o.device, x, [&](auto& in) {
                                 return at::layer_norm(in, {256}, gamma, beta);
                               }) / n);
    // Tiny ops: what remains is dispatch and autograd.
    auto tiny = at::randn({16}, on);
    const double chain = forward_backward_seconds(o.repeats, o.device, tiny, [&](auto& in) {
      auto y = in;
      for (int64_t i = 0; i < o.op_chain; ++i) y = y * 1.0001;
      return y;
    });
    d.op_s = max_over(world, chain / static_cast<double>(o.op_chain));
    d.ops_overlap_kernels = o.device.is_cuda();
  }
  if (o.reference_batch > 0) d.compute_scale = max_over(world, reference_scale(d, o));
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
  p.collective_s = collective_overhead(world, d, o);
  p.validate("measured");
  return p;
}

std::map<std::string, Link> measure_mesh_links(const dist::CommunicatorPtr& world,
                                               const dist::MeshShape& shape,
                                               const MeasureOptions& o) {
  const dist::Mesh mesh(world, shape, /*ranks_per_node=*/world->size());
  std::map<std::string, Link> links;
  for (const auto dim : {dist::Dim::tp, dist::Dim::cp, dist::Dim::dp, dist::Dim::pp}) {
    if (mesh.size(dim) < 2) continue;
    const Link mine = measure_link(mesh.comm(dim), o);
    // Every rank takes the slowest group's figures (and so writes the same profile).
    links[dist::to_string(dim)] = {min_over(*world, mine.bandwidth),
                                   max_over(*world, mine.latency)};
  }
  return links;
}

}  // namespace loom::plan
