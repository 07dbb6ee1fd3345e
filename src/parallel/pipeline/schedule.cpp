#include "loom/parallel/pipeline/schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "loom/core/error.h"
#include "loom/core/registry.h"

namespace loom::parallel::pipeline {

void PipelineShape::validate() const {
  LOOM_CHECK(ranks >= 1, "pipeline size {} must be at least 1", ranks);
  LOOM_CHECK(virtual_stages >= 1, "--virtual-stages {} must be at least 1", virtual_stages);
  LOOM_CHECK(micro_batches >= 1, "--micro-batches {} must be at least 1", micro_batches);
}

std::string PipelineShape::describe() const {
  return fmt::format("pp {}{}, {} micro-batches", ranks,
                     virtual_stages > 1 ? fmt::format(" x v {}", virtual_stages) : "",
                     micro_batches);
}

std::string to_string(const Action& a) {
  const char kind = a.kind == Action::Kind::kForward ? 'F' : 'B';
  return a.chunk == 0 ? fmt::format("{}{}", kind, a.micro_batch)
                      : fmt::format("{}{}.{}", kind, a.micro_batch, a.chunk);
}

namespace {

void check_one_chunk(const PipelineShape& shape, const char* name) {
  LOOM_CHECK(shape.virtual_stages == 1,
             "--schedule {} runs one model chunk per rank; --virtual-stages {} needs --schedule "
             "interleaved",
             name, shape.virtual_stages);
}

}  // namespace

void GPipeSchedule::check(const PipelineShape& shape) const {
  shape.validate();
  check_one_chunk(shape, "gpipe");
}

std::vector<Action> GPipeSchedule::actions(int64_t /*rank*/, const PipelineShape& shape) const {
  std::vector<Action> out;
  for (int64_t m = 0; m < shape.micro_batches; ++m) out.push_back(forward(m));
  for (int64_t m = 0; m < shape.micro_batches; ++m) out.push_back(backward(m));
  return out;
}

void OneFOneBSchedule::check(const PipelineShape& shape) const {
  shape.validate();
  check_one_chunk(shape, "1f1b");
}

std::vector<Action> OneFOneBSchedule::actions(int64_t rank, const PipelineShape& shape) const {
  // Warm-up: enough forwards to fill the pipeline below this rank; then one forward, one
  // backward; then the backwards left. Rank r never holds more than pp - r micro-batches.
  const int64_t m = shape.micro_batches;
  const int64_t warmup = std::min(shape.ranks - rank - 1, m);
  std::vector<Action> out;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back(forward(f));
  while (f < m) {
    out.push_back(forward(f++));
    out.push_back(backward(b++));
  }
  while (b < m) out.push_back(backward(b++));
  return out;
}

void InterleavedSchedule::check(const PipelineShape& shape) const {
  shape.validate();
  LOOM_CHECK(shape.ranks > 1, "--schedule interleaved needs --pp of at least 2 (got {})",
             shape.ranks);
  LOOM_CHECK(shape.micro_batches % shape.ranks == 0,
             "--schedule interleaved sends micro-batches round the ranks in groups of pp: "
             "--micro-batches {} must be a multiple of --pp {} (e.g. {})",
             shape.micro_batches, shape.ranks,
             ((shape.micro_batches + shape.ranks - 1) / shape.ranks) * shape.ranks);
}

std::vector<Action> InterleavedSchedule::actions(int64_t rank, const PipelineShape& shape) const {
  // The rank's m * v (micro-batch, chunk) pairs in "virtual micro-batch" order k: groups of pp
  // micro-batches go through chunk 0, then the same group through chunk 1, ... (backwards run
  // the chunks in reverse). Warm-up fills every chunk of the ranks below; then 1F1B.
  const int64_t p = shape.ranks, v = shape.virtual_stages, m = shape.micro_batches;
  const int64_t total = m * v;
  auto micro_batch = [&](int64_t k) { return (k / (p * v)) * p + k % p; };
  auto chunk = [&](int64_t k, bool fwd) {
    const int64_t c = (k / p) % v;
    return fwd ? c : v - 1 - c;
  };
  const int64_t warmup = std::min(total, (p - rank - 1) * 2 + (v - 1) * p);
  std::vector<Action> out;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back(forward(micro_batch(f), chunk(f, true)));
  while (f < total) {
    out.push_back(forward(micro_batch(f), chunk(f, true)));
    ++f;
    out.push_back(backward(micro_batch(b), chunk(b, false)));
    ++b;
  }
  for (; b < total; ++b) out.push_back(backward(micro_batch(b), chunk(b, false)));
  return out;
}

std::vector<Action> forward_only_actions(const PipelineShape& shape) {
  std::vector<Action> out;
  for (int64_t m = 0; m < shape.micro_batches; ++m)
    for (int64_t c = 0; c < shape.virtual_stages; ++c) out.push_back(forward(m, c));
  return out;
}

namespace {

using Registry = core::NamedRegistry<ScheduleFactory>;

Registry& registry() {
  static Registry r("pipeline schedule");
  static const bool built_in = [] {
    r.add("gpipe", [] { return std::make_shared<const GPipeSchedule>(); });
    r.add("1f1b", [] { return std::make_shared<const OneFOneBSchedule>(); });
    r.add("interleaved", [] { return std::make_shared<const InterleavedSchedule>(); });
    return true;
  }();
  (void)built_in;
  return r;
}

}  // namespace

void register_schedule(const std::string& name, ScheduleFactory factory) {
  registry().add(name, std::move(factory));
}

std::vector<std::string> schedule_names() {
  return registry().names();
}

SchedulePtr make_schedule(const std::string& name) {
  return registry().make(name, "--schedule");
}

std::vector<double> SimulatedRun::bubble_fractions() const {
  std::vector<double> out;
  for (double b : busy) out.push_back(makespan > 0 ? (makespan - b) / makespan : 0.0);
  return out;
}

double SimulatedRun::bubble_fraction() const {
  const auto all = bubble_fractions();
  return all.empty() ? 0.0 : std::accumulate(all.begin(), all.end(), 0.0) / all.size();
}

SimulatedRun simulate(const Schedule& schedule, const PipelineShape& shape, double forward_time,
                      double backward_time) {
  schedule.check(shape);
  std::vector<std::vector<Action>> per_rank;
  for (int64_t r = 0; r < shape.ranks; ++r) per_rank.push_back(schedule.actions(r, shape));
  return simulate_actions(per_rank, shape, schedule.name(), false, forward_time, backward_time);
}

SimulatedRun simulate_actions(const std::vector<std::vector<Action>>& per_rank,
                              const PipelineShape& shape, const std::string& name,
                              bool forward_only, double forward_time, double backward_time) {
  shape.validate();
  const int64_t p = shape.ranks, v = shape.virtual_stages, m = shape.micro_batches;
  const int64_t stages = shape.stages();
  LOOM_CHECK(static_cast<int64_t>(per_rank.size()) == p,
             "schedule '{}': {} ranks' actions for {} pipeline ranks", name, per_rank.size(), p);
  // Completeness, rank by rank.
  for (int64_t r = 0; r < p; ++r) {
    std::vector<int> fwd(static_cast<size_t>(m * v), 0), bwd(static_cast<size_t>(m * v), 0);
    for (const auto& a : per_rank[static_cast<size_t>(r)]) {
      LOOM_CHECK(a.micro_batch >= 0 && a.micro_batch < m && a.chunk >= 0 && a.chunk < v,
                 "schedule '{}' rank {}: action {} is outside {} micro-batches x {} chunks", name,
                 r, to_string(a), m, v);
      const auto i = static_cast<size_t>(a.micro_batch * v + a.chunk);
      if (a.kind == Action::Kind::kForward) {
        LOOM_CHECK(++fwd[i] == 1, "schedule '{}' rank {}: {} runs twice", name, r, to_string(a));
      } else {
        LOOM_CHECK(!forward_only, "schedule '{}' rank {}: {} in a forward-only run", name, r,
                   to_string(a));
        LOOM_CHECK(fwd[i] == 1, "schedule '{}' rank {}: {} comes before its forward", name, r,
                   to_string(a));
        LOOM_CHECK(++bwd[i] == 1, "schedule '{}' rank {}: {} runs twice", name, r, to_string(a));
      }
    }
    for (int64_t i = 0; i < m * v; ++i) {
      LOOM_CHECK(fwd[static_cast<size_t>(i)] == 1,
                 "schedule '{}' rank {}: never runs {} (every micro-batch of every chunk runs "
                 "forward once)",
                 name, r, to_string(forward(i / v, i % v)));
      LOOM_CHECK(forward_only || bwd[static_cast<size_t>(i)] == 1,
                 "schedule '{}' rank {}: never runs {}", name, r,
                 to_string(backward(i / v, i % v)));
    }
  }
  // Play it out: an action starts when its rank is free and its input has arrived (the previous
  // stage's forward, or the next stage's backward).
  const double kNotYet = -1;
  std::vector<double> fdone(static_cast<size_t>(m * stages), kNotYet);
  std::vector<double> bdone(static_cast<size_t>(m * stages), kNotYet);
  auto at = [&](std::vector<double>& t, int64_t mb, int64_t stage) -> double& {
    return t[static_cast<size_t>(mb * stages + stage)];
  };
  SimulatedRun run;
  run.busy.assign(static_cast<size_t>(p), 0.0);
  run.max_in_flight.assign(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<int64_t> in_flight(static_cast<size_t>(p), 0);
  size_t remaining = 0;
  for (const auto& a : per_rank) remaining += a.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int64_t r = 0; r < p; ++r) {
      const auto ri = static_cast<size_t>(r);
      while (next[ri] < per_rank[ri].size()) {
        const auto& a = per_rank[ri][next[ri]];
        const int64_t s = shape.stage_of(r, a.chunk);
        double ready = 0;
        if (a.kind == Action::Kind::kForward) {
          if (s > 0) ready = at(fdone, a.micro_batch, s - 1);
        } else if (s < stages - 1) {
          ready = at(bdone, a.micro_batch, s + 1);
        }
        if (ready == kNotYet) break;
        const double start = std::max(clock[ri], ready);
        const double took = a.kind == Action::Kind::kForward ? forward_time : backward_time;
        clock[ri] = start + took;
        run.busy[ri] += took;
        if (a.kind == Action::Kind::kForward) {
          at(fdone, a.micro_batch, s) = clock[ri];
          if (!forward_only)
            run.max_in_flight[ri] = std::max(run.max_in_flight[ri], ++in_flight[ri]);
        } else {
          at(bdone, a.micro_batch, s) = clock[ri];
          --in_flight[ri];
        }
        ++next[ri];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      std::string blocked;
      for (int64_t r = 0; r < p; ++r) {
        const auto ri = static_cast<size_t>(r);
        if (next[ri] < per_rank[ri].size())
          blocked += fmt::format("{}rank {} at {}", blocked.empty() ? "" : ", ", r,
                                 to_string(per_rank[ri][next[ri]]));
      }
      fail("schedule '{}' deadlocks at {}: every rank waits for a message no rank will send ({})",
           name, shape.describe(), blocked);
    }
  }
  run.makespan = *std::max_element(clock.begin(), clock.end());
  return run;
}

}  // namespace loom::parallel::pipeline
