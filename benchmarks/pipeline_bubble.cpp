// loom-bench-pipeline: the pipeline bubble each schedule leaves, measured on the executor and
// compared with theory and with the schedule simulator. Under `mpirun -np P` (P = pipeline
// size = world size) every rank runs the real PipelineExecutor: activations and gradients go
// point to point between ranks, received activations are autograd leaves and the backward runs
// through torch::autograd. Only the compute is simulated: each model layer is a custom autograd
// function whose forward sleeps --layer-ms (divided by the rank's speed) and whose backward
// sleeps twice that, on a small [--rows, --width] tensor. Sleeping, not computing, is what makes
// the figure about the schedule: on a 2-core machine with up to 4 oversubscribed ranks, real
// compute would measure CPU contention.
//
// Part 1, for each schedule (gpipe, 1f1b, interleaved with v = --virtual-stages) and each
// micro-batch count m: --layers layers split evenly into P * v stages, one warm-up step, then
// --steps timed steps, each started after a barrier. A step's makespan T is the slowest rank's
// run; a rank's idle time is the time it waited on receives plus the time between its own end
// and T (a rank that finishes early idles until the step ends: the theory counts that too).
// measured_bubble = the median over steps of the mean over ranks of idle / T; worst_rank_bubble
// the largest rank's mean; executor_bubble
// is PipelineStats::bubble_fraction() (wait / the rank's own run), averaged over ranks, and
// busy_bubble = 1 - (time in forwards and backwards) / T. Theory: (P-1)/(m+P-1) for gpipe and
// 1f1b, (P-1)/(v*m+P-1) for interleaved; simulated: simulate(schedule, shape, f, b) with f, b
// the nominal per-stage (per-chunk) forward and backward times. --layer-ms 0 sleeps not at all:
// the step time is then the executor's own cost (autograd, messages, bookkeeping).
//
// Part 2 (unless --no-hetero), a heterogeneous pipeline: rank 0 runs --slow-factor times slower.
// 1f1b over --hetero-layers layers and --hetero-micro-batches micro-batches, split once evenly
// (uniform_partition) and once by partition_layers with rank 0's speed 1/slow-factor; step times
// and the speedup of the balanced split, against the steps predicted by playing the 1f1b actions
// with each stage's nominal time.
//
// Rank 0 prints one JSON object per result line on stdout and a readable line on stderr.
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "loom/apps/cli.h"
#include "bench_util.h"
#include "loom/loom.h"

namespace {

namespace pp = loom::parallel::pipeline;
using loom::bench::median;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Sleeps `ms` precisely: the kernel sleep overshoots by tens of microseconds at random, which
// adds jitter no real kernel has, so it sleeps to 0.2 ms short of the deadline and yields the
// rest (a yield lets oversubscribed ranks run, unlike a pure spin).
void sleep_ms(double ms) {
  if (ms <= 0) return;
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double, std::milli>(ms));
  const auto coarse = deadline - std::chrono::microseconds(200);
  if (Clock::now() < coarse) std::this_thread::sleep_until(coarse);
  while (Clock::now() < deadline) std::this_thread::yield();
}

// One simulated layer: forward sleeps `ms`, backward 2 * `ms`; values pass through unchanged.
struct SleepLayer : torch::autograd::Function<SleepLayer> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double ms) {
    ctx->saved_data["ms"] = ms;
    sleep_ms(ms);
    return x.clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    sleep_ms(2.0 * ctx->saved_data["ms"].toDouble());
    return {g[0], at::Tensor()};
  }
};

struct Options {
  double layer_ms = 4.0;
  int64_t rows = 4, width = 64, steps = 5;
};

// What one configuration measured, over its timed steps.
struct Measured {
  double bubble = 0;           // median over steps of the mean over ranks of idle / makespan
  double worst_bubble = 0;     // the rank with the largest mean idle share
  double executor_bubble = 0;  // mean over ranks and steps of wait / the rank's own run
  double busy_bubble = 0;      // mean of 1 - (forward + backward seconds) / makespan
  double step_s = 0;           // median makespan
};

// Runs `shape` under `schedule` with stage s holding layers [bounds[s], bounds[s+1]) and this
// rank's layers sleeping layer_ms / speed.
Measured run_pipeline(const loom::dist::CommunicatorPtr& world, const pp::PipelineShape& shape,
                      const std::string& schedule, const std::vector<int64_t>& bounds, double speed,
                      const Options& o) {
  const int64_t rank = world->rank(), p = shape.ranks, v = shape.virtual_stages;
  const int64_t last_stage = shape.stages() - 1;
  pp::PipelineExecutor executor(world, shape, pp::make_schedule(schedule));
  // Each chunk scales its input by a parameter, so the first stage's output needs a gradient
  // too and every stage's backward reaches a leaf.
  std::vector<at::Tensor> weights;
  for (int64_t c = 0; c < v; ++c) weights.push_back(at::ones({o.width}).requires_grad_(true));
  const auto tokens = at::ones({o.rows, o.width});
  const double ms = o.layer_ms / speed;
  const double inv_m = 1.0 / static_cast<double>(shape.micro_batches);
  auto forward = [&](int64_t chunk, int64_t /*micro_batch*/, const at::Tensor& input) {
    const int64_t stage = shape.stage_of(rank, chunk);
    auto h = (input.defined() ? input : tokens) * weights[static_cast<size_t>(chunk)];
    for (int64_t l = bounds[static_cast<size_t>(stage)]; l < bounds[static_cast<size_t>(stage) + 1];
         ++l)
      h = SleepLayer::apply(h, ms);
    return stage == last_stage ? h.sum() * inv_m : h;
  };

  std::vector<std::vector<double>> idle_share(static_cast<size_t>(p));
  std::vector<double> makespans, executor_bubbles, busy_bubbles, step_bubbles;
  for (int64_t step = 0; step < o.steps + 1; ++step) {
    for (auto& w : weights) w.mutable_grad() = at::Tensor();
    world->barrier();
    const auto stats = executor.run(forward);
    // Every rank's run, wait and busy seconds, on every rank.
    auto all = at::zeros({p, 3}, at::kDouble);
    all[rank][0] = stats.seconds;
    all[rank][1] = stats.wait_seconds;
    all[rank][2] = stats.forward_seconds + stats.backward_seconds;
    world->all_reduce(all, loom::dist::ReduceOp::Sum);
    if (step == 0) continue;  // warm-up
    auto a = all.accessor<double, 2>();
    double makespan = 0;
    for (int64_t r = 0; r < p; ++r) makespan = std::max(makespan, a[r][0]);
    double sum = 0, exec = 0, busy = 0;
    for (int64_t r = 0; r < p; ++r) {
      const double share = (a[r][1] + makespan - a[r][0]) / makespan;
      idle_share[static_cast<size_t>(r)].push_back(share);
      sum += share;
      exec += a[r][1] / a[r][0];
      busy += 1.0 - a[r][2] / makespan;
    }
    makespans.push_back(makespan);
    step_bubbles.push_back(sum / static_cast<double>(p));
    executor_bubbles.push_back(exec / static_cast<double>(p));
    busy_bubbles.push_back(busy / static_cast<double>(p));
  }
  auto mean = [](const std::vector<double>& x) {
    double s = 0;
    for (double e : x) s += e;
    return x.empty() ? 0.0 : s / static_cast<double>(x.size());
  };
  Measured out;
  // The median step: a virtual machine's vCPU is now and then descheduled for a millisecond,
  // which lands in one step's idle time and says nothing about the schedule.
  out.bubble = median(step_bubbles);
  for (const auto& r : idle_share) out.worst_bubble = std::max(out.worst_bubble, mean(r));
  out.executor_bubble = mean(executor_bubbles);
  out.busy_bubble = mean(busy_bubbles);
  out.step_s = median(makespans);
  return out;
}

// The step `schedule` takes when stage s's forward of a micro-batch takes stage_forward[s] and
// its backward twice that, messages free (pp::simulate takes one time for every stage; this
// plays the same actions with a time per stage, for the heterogeneous splits).
double predicted_step(const pp::Schedule& schedule, const pp::PipelineShape& shape,
                      const std::vector<double>& stage_forward) {
  const int64_t p = shape.ranks, stages = shape.stages(), m = shape.micro_batches;
  std::vector<std::vector<pp::Action>> actions;
  for (int64_t r = 0; r < p; ++r) actions.push_back(schedule.actions(r, shape));
  // done[kind][micro_batch * stages + stage]: when that pass ended; < 0 not yet.
  std::vector<std::vector<double>> done(2,
                                        std::vector<double>(static_cast<size_t>(m * stages), -1));
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int64_t r = 0; r < p; ++r) {
      const auto ri = static_cast<size_t>(r);
      for (; next[ri] < actions[ri].size(); ++next[ri]) {
        const auto& a = actions[ri][next[ri]];
        const int64_t s = shape.stage_of(r, a.chunk);
        const bool fwd = a.kind == pp::Action::Kind::kForward;
        const int64_t from = fwd ? s - 1 : s + 1;  // the stage whose output this action needs
        double ready = 0;
        if (from >= 0 && from < stages) {
          ready = done[fwd ? 0 : 1][static_cast<size_t>(a.micro_batch * stages + from)];
          if (ready < 0) break;
        }
        const double took = stage_forward[static_cast<size_t>(s)] * (fwd ? 1.0 : 2.0);
        clock[ri] = std::max(clock[ri], ready) + took;
        done[fwd ? 0 : 1][static_cast<size_t>(a.micro_batch * stages + s)] = clock[ri];
        progressed = true;
      }
    }
  }
  return *std::max_element(clock.begin(), clock.end());
}

std::string split_string(const pp::Partition& part) {
  std::string out;
  for (int64_t s = 0; s < part.shape.stages(); ++s)
    out += fmt::format("{}{}", s == 0 ? "" : "/", part.layers(s));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pipeline bubble of each schedule: measured vs theory vs simulator.",
               "loom-bench-pipeline"};
  Options o;
  std::vector<std::string> schedules{"gpipe", "1f1b", "interleaved"};
  std::vector<int64_t> micro_batches{4, 8, 16};
  int64_t layers = 0, virtual_stages = 2, hetero_layers = 16, hetero_m = 8;
  double slow_factor = 2.0;
  bool no_hetero = false;
  app.add_option("--schedules", schedules, "Schedules to measure")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--micro-batches", micro_batches, "Micro-batch counts m to measure")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--layers", layers,
                 "Model layers in part 1 (0: 8, or pp x virtual stages if that is more)")
      ->capture_default_str();
  app.add_option("--virtual-stages", virtual_stages, "Model chunks per rank for interleaved")
      ->capture_default_str();
  app.add_option("--layer-ms", o.layer_ms,
                 "Simulated forward time of one layer (ms); 0: no sleeping, the step is the "
                 "executor's own overhead")
      ->capture_default_str();
  app.add_option("--rows", o.rows, "Rows of the activation tensor")->capture_default_str();
  app.add_option("--width", o.width, "Columns of the activation tensor")->capture_default_str();
  app.add_option("--steps", o.steps, "Timed steps per configuration (after one warm-up)")
      ->capture_default_str();
  app.add_flag("--no-hetero", no_hetero, "Skip the heterogeneous part");
  app.add_option("--hetero-layers", hetero_layers, "Layers in the heterogeneous part")
      ->capture_default_str();
  app.add_option("--hetero-micro-batches", hetero_m, "Micro-batches in the heterogeneous part")
      ->capture_default_str();
  app.add_option("--slow-factor", slow_factor, "How many times slower rank 0 is (part 2)")
      ->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace(loom::dist::RuntimeOptions{.threads = 1});
    auto world = runtime->world();
    const int64_t p = world->size(), rank = world->rank();
    LOOM_CHECK(o.layer_ms >= 0 && o.steps >= 1 && slow_factor > 0,
               "--layer-ms must be >= 0, --steps and --slow-factor positive");
    LOOM_CHECK(virtual_stages >= 2, "--virtual-stages {} must be at least 2", virtual_stages);
    if (layers == 0) layers = std::max<int64_t>(8, p * virtual_stages);
    auto print = [&](const nlohmann::json& j, const std::string& line) {
      if (rank != 0) return;
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
      std::fprintf(stderr, "%s\n", line.c_str());
      std::fflush(stderr);
    };

    for (const auto& name : schedules) {
      const bool interleaved = name == "interleaved";
      const int64_t v = interleaved ? virtual_stages : 1;
      for (const int64_t m : micro_batches) {
        if (interleaved && (p < 2 || m % p != 0)) continue;
        const pp::PipelineShape shape{p, v, m};
        LOOM_CHECK(layers >= shape.stages(), "--layers {} is fewer than the {} stages of {}",
                   layers, shape.stages(), shape.describe());
        pp::LayerCosts costs;
        costs.layer_time.assign(static_cast<size_t>(layers), o.layer_ms * 1e-3);
        costs.layer_bytes.assign(static_cast<size_t>(layers), 0.0);
        const auto part = pp::uniform_partition(costs, shape, pp::uniform_devices(p));
        const auto measured = run_pipeline(world, shape, name, part.bounds, 1.0, o);
        // Nominal times of one stage (one chunk) per micro-batch.
        const double f =
            static_cast<double>(layers) / static_cast<double>(shape.stages()) * o.layer_ms * 1e-3;
        const auto sim = pp::simulate(*pp::make_schedule(name), shape, f, 2 * f);
        const double simulated = sim.bubble_fraction();
        const double theory = static_cast<double>(p - 1) / static_cast<double>(v * m + p - 1);
        const double gap = theory > 0 ? std::abs(measured.bubble - theory) / theory : 0.0;
        print(
            {{"bench", "pipeline_bubble"},
             {"schedule", name},
             {"pp", p},
             {"v", v},
             {"m", m},
             {"layers", layers},
             {"layer_ms", o.layer_ms},
             {"measured_bubble", measured.bubble},
             {"worst_rank_bubble", measured.worst_bubble},
             {"executor_bubble", measured.executor_bubble},
             {"busy_bubble", measured.busy_bubble},
             {"theory_bubble", theory},
             {"simulated_bubble", simulated},
             {"relative_gap", gap},
             {"step_s", measured.step_s},
             {"simulated_step_s", sim.makespan}},
            fmt::format("{:<11} pp {} v {} m {:>2}: bubble measured {:.3f} (worst rank {:.3f}, "
                        "executor {:.3f}) theory {:.3f} simulated {:.3f} gap {:.1f}% step {:.3f} s",
                        name, p, v, m, measured.bubble, measured.worst_bubble,
                        measured.executor_bubble, theory, simulated, 100 * gap, measured.step_s));
      }
    }

    if (no_hetero) return;
    const pp::PipelineShape shape{p, 1, hetero_m};
    pp::LayerCosts costs;
    costs.layer_time.assign(static_cast<size_t>(hetero_layers), o.layer_ms * 1e-3);
    costs.layer_bytes.assign(static_cast<size_t>(hetero_layers), 0.0);
    auto devices = pp::uniform_devices(p);
    devices[0].speed = 1.0 / slow_factor;
    const double speed = devices[static_cast<size_t>(rank)].speed;
    const auto even = pp::uniform_partition(costs, shape, devices);
    const auto balanced = pp::partition_layers(costs, shape, devices);
    const auto t_even = run_pipeline(world, shape, "1f1b", even.bounds, speed, o);
    const auto t_balanced = run_pipeline(world, shape, "1f1b", balanced.bounds, speed, o);
    const auto one_f_one_b = pp::make_schedule("1f1b");
    const double predicted_even = predicted_step(*one_f_one_b, shape, even.time);
    const double predicted_balanced = predicted_step(*one_f_one_b, shape, balanced.time);
    for (const auto& [label, part, t, predicted] :
         {std::tuple{"uniform", even, t_even, predicted_even},
          std::tuple{"partition_layers", balanced, t_balanced, predicted_balanced}}) {
      print({{"bench", "pipeline_hetero"},
             {"split", label},
             {"schedule", "1f1b"},
             {"pp", p},
             {"m", hetero_m},
             {"layers", hetero_layers},
             {"slow_factor", slow_factor},
             {"layers_per_stage", split_string(part)},
             {"predicted_step_s", predicted},
             {"step_s", t.step_s},
             {"measured_bubble", t.bubble}},
            fmt::format("hetero 1f1b pp {} m {} rank 0 {}x slower, {:<16} split {:<12} step {:.3f} "
                        "s (predicted {:.3f} s)",
                        p, hetero_m, slow_factor, label, split_string(part), t.step_s, predicted));
    }
    print(
        {{"bench", "pipeline_hetero"},
         {"split", "speedup"},
         {"pp", p},
         {"m", hetero_m},
         {"speedup", t_even.step_s / t_balanced.step_s},
         {"predicted_speedup", predicted_even / predicted_balanced}},
        fmt::format("hetero speedup of partition_layers over uniform: {:.2f}x (predicted {:.2f}x)",
                    t_even.step_s / t_balanced.step_s, predicted_even / predicted_balanced));
  });
}
