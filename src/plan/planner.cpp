#include "loom/plan/planner.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "loom/core/error.h"

namespace loom::plan {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) out.push_back(k);
  return out;
}

// The layouts to try: every (tp, pp, cp, dp) splitting the world, then micro-batches,
// schedules, ZeRO stages and checkpointing modes.
std::vector<Layout> candidates(const PlanRequest& r) {
  const auto& w = r.workload;
  const auto& m = w.model;
  std::vector<Layout> out;
  // A profile that names a device per pipeline rank fixes pp.
  const auto fixed_pp = static_cast<int64_t>(r.machine.stage_devices.size());
  for (const int64_t tp : divisors(r.world))
    for (const int64_t pp : divisors(r.world / tp))
      for (const int64_t cp : divisors(r.world / tp / pp)) {
        if (fixed_pp > 0 && pp != fixed_pp) continue;
        if (cp > 1 && !r.context_parallel) continue;
        const int64_t dp = r.world / tp / pp / cp;
        if (w.batch_size % dp != 0 || pp > m.n_layers) continue;
        for (const int64_t micro : divisors(w.batch_size / dp)) {
          if (micro > r.max_micro_batches) continue;
          std::vector<std::pair<std::string, int64_t>> schedules{{"1f1b", 1}};
          if (pp > 1) {
            schedules.emplace_back("gpipe", 1);
            if (micro % pp == 0 && 2 * pp <= m.n_layers) schedules.emplace_back("interleaved", 2);
          }
          for (const auto& [schedule, virtual_stages] : schedules)
            for (const int zero : r.zero_stages) {
              if (zero > 0 && dp == 1) continue;
              for (const auto& checkpointing : r.checkpointing) {
                Layout l;
                l.dp = dp, l.tp = tp, l.pp = pp, l.cp = cp;
                l.zero = zero;
                l.micro_batches = micro;
                l.virtual_stages = virtual_stages;
                l.schedule = schedule;
                l.checkpointing = checkpointing;
                // Sequence parallelism only saves memory: on wherever it can be.
                l.sequence_parallel = r.sequence_parallel && tp > 1 && (w.seq_len / cp) % tp == 0;
                out.push_back(l);
              }
            }
        }
      }
  return out;
}

}  // namespace

std::vector<PlannedLayout> plan_layouts(const PlanRequest& r) {
  LOOM_CHECK(r.world >= 1, "plan: the world of {} ranks must have at least 1", r.world);
  LOOM_CHECK(r.workload.batch_size >= 1 && r.workload.seq_len >= 1,
             "plan: batch size {} and sequence length {} must be at least 1", r.workload.batch_size,
             r.workload.seq_len);
  r.machine.validate(r.machine.name);
  const auto fixed_pp = static_cast<int64_t>(r.machine.stage_devices.size());
  LOOM_CHECK(fixed_pp == 0 || r.world % fixed_pp == 0,
             "plan: machine profile '{}' names devices for {} pipeline ranks, which do not "
             "divide the world of {} ranks",
             r.machine.name, fixed_pp, r.world);
  double capacity = std::numeric_limits<double>::infinity();
  std::vector<PlannedLayout> fit;
  PlannedLayout least;
  least.prediction.memory_bytes = std::numeric_limits<double>::infinity();
  int64_t runnable = 0;
  for (const auto& l : candidates(r)) {
    try {
      check_layout(r.workload, l);
    } catch (const Error&) {
      continue;  // this split cannot run the model (heads, sequence, schedule)
    }
    ++runnable;
    const auto p = predict(r.workload, l, r.machine);
    // Each pipeline rank against its own device.
    bool fits = true;
    for (int64_t rank = 0; rank < l.pp; ++rank) {
      const double memory = r.machine.device_of_stage(rank, l.pp).memory_bytes;
      capacity = std::min(capacity, memory);
      fits = fits && p.rank_memory_bytes[static_cast<size_t>(rank)] <= memory;
    }
    if (p.memory_bytes < least.prediction.memory_bytes) least = {l, p};
    if (fits) fit.push_back({l, p});
  }
  LOOM_CHECK(runnable > 0,
             "plan: no layout of {} ranks can run this model (tp must divide its {} heads, pp "
             "at most its {} layers, dp the batch of {})",
             r.world, r.workload.model.n_heads, r.workload.model.n_layers, r.workload.batch_size);
  LOOM_CHECK(!fit.empty(),
             "plan: no layout of {} ranks fits in {:.2f} GiB per rank; the least memory any "
             "needs is {:.2f} GiB ({}): use devices with that much memory, more ranks, or a "
             "smaller batch",
             r.world, capacity / (1 << 30), least.prediction.memory_bytes / (1 << 30),
             least.layout.describe());
  std::stable_sort(fit.begin(), fit.end(), [](const PlannedLayout& a, const PlannedLayout& b) {
    if (a.prediction.tokens_per_s != b.prediction.tokens_per_s)
      return a.prediction.tokens_per_s > b.prediction.tokens_per_s;
    return a.prediction.memory_bytes < b.prediction.memory_bytes;
  });
  return fit;
}

bool LayoutConstraints::allows(const Layout& l) const {
  auto agrees = [](const auto& want, const auto& value) { return !want || *want == value; };
  return agrees(dp, l.dp) && agrees(tp, l.tp) && agrees(pp, l.pp) && agrees(cp, l.cp) &&
         agrees(micro_batches, l.micro_batches) && agrees(zero, l.zero) &&
         agrees(checkpointing, l.checkpointing) && agrees(sequence_parallel, l.sequence_parallel) &&
         (l.pp == 1 || (agrees(schedule, l.schedule) && agrees(virtual_stages, l.virtual_stages)));
}

std::string LayoutConstraints::describe() const {
  std::vector<std::string> parts;
  for (const auto& [what, v] : {std::pair{"dp", dp},
                                {"tp", tp},
                                {"pp", pp},
                                {"cp", cp},
                                {"micro-batches", micro_batches},
                                {"virtual-stages", virtual_stages}})
    if (v) parts.push_back(fmt::format("{} {}", what, *v));
  if (zero) parts.push_back(fmt::format("zero {}", *zero));
  if (schedule) parts.push_back("schedule " + *schedule);
  if (checkpointing) parts.push_back("activation-checkpointing " + *checkpointing);
  if (sequence_parallel) parts.push_back(*sequence_parallel ? "sequence-parallel" : "no sp");
  return parts.empty() ? "none" : fmt::format("{}", fmt::join(parts, ", "));
}

LayoutChoice choose_layout(PlanRequest request, const LayoutConstraints& fixed,
                           const std::function<bool(const Layout&)>& runnable) {
  // What the search leaves out by default, it tries when asked for.
  if (fixed.zero) request.zero_stages = {*fixed.zero};
  if (fixed.checkpointing) request.checkpointing = {*fixed.checkpointing};
  if (fixed.micro_batches)
    request.max_micro_batches = std::max(request.max_micro_batches, *fixed.micro_batches);
  if (fixed.cp && *fixed.cp > 1) request.context_parallel = true;
  if (fixed.sequence_parallel) request.sequence_parallel = *fixed.sequence_parallel;
  const auto plans = plan_layouts(request);
  LayoutChoice out;
  out.fitting = plans.size();
  for (const auto& p : plans) {
    if (!fixed.allows(p.layout) || (runnable && !runnable(p.layout))) continue;
    if (out.allowed == 0)
      out.best = p;
    else if (out.allowed == 1)
      out.runner_up = p;
    ++out.allowed;
  }
  LOOM_CHECK(out.allowed > 0,
             "plan: of the {} layouts of {} ranks that fit, none has {} (the layout flags given "
             "with --plan auto) and goes with the run's other flags; the best without them is {} "
             "at {:.0f} predicted tokens/s: drop the flags that conflict, or pass the whole "
             "layout without --plan auto",
             plans.size(), request.world, fixed.describe(), plans.front().layout.describe(),
             plans.front().prediction.tokens_per_s);
  return out;
}

std::string explain_choice(const LayoutChoice& c, const LayoutConstraints& fixed,
                           const std::string& profile) {
  const auto& p = c.best.prediction;
  std::string out = fmt::format(
      "on profile '{}', {} layouts fit{}; chose {}: predicted {:.0f} tokens/s, {:.2f} GiB per "
      "rank (per step: compute {:.3g} s, tp {:.3g} s, cp {:.3g} s, pp {:.3g} s, dp {:.3g} s, "
      "optimizer {:.3g} s; bubble {:.1f} %)",
      profile, c.fitting,
      fixed.describe() == "none" ? std::string()
                                 : fmt::format(", {} of them with {}", c.allowed, fixed.describe()),
      c.best.layout.describe(), p.tokens_per_s, p.memory_bytes / (1 << 30), p.compute_s,
      p.tp_comm_s, p.cp_comm_s, p.pp_comm_s, p.dp_comm_s, p.optimizer_s, 100 * p.bubble_fraction);
  if (c.runner_up)
    out += fmt::format("; next: {} at {:.0f} tokens/s ({:+.1f} %)", c.runner_up->layout.describe(),
                       c.runner_up->prediction.tokens_per_s,
                       100 * (c.runner_up->prediction.tokens_per_s / p.tokens_per_s - 1));
  return out;
}

std::string format_plan(const std::vector<PlannedLayout>& plans, size_t top) {
  std::string out = fmt::format("{:>3}  {:<58} {:>10} {:>12} {:>9} {:>7} {:>6}\n", "#", "layout",
                                "step s", "tokens/s", "GiB/rank", "bubble", "MFU");
  for (size_t i = 0; i < std::min(top, plans.size()); ++i) {
    const auto& p = plans[i].prediction;
    out += fmt::format("{:>3}  {:<58} {:>10.4g} {:>12.0f} {:>9.2f} {:>6.1f}% {:>6}\n", i + 1,
                       plans[i].layout.describe(), p.step_s, p.tokens_per_s,
                       p.memory_bytes / (1 << 30), 100 * p.bubble_fraction,
                       p.mfu > 0 ? fmt::format("{:.1f}%", 100 * p.mfu) : std::string("-"));
  }
  return out;
}

std::string plan_json(const std::vector<PlannedLayout>& plans, size_t top) {
  auto out = nlohmann::json::array();
  for (size_t i = 0; i < std::min(top, plans.size()); ++i) {
    const auto& l = plans[i].layout;
    const auto& p = plans[i].prediction;
    out.push_back({{"dp", l.dp},
                   {"tp", l.tp},
                   {"pp", l.pp},
                   {"cp", l.cp},
                   {"zero", l.zero},
                   {"micro_batches", l.micro_batches},
                   {"virtual_stages", l.virtual_stages},
                   {"schedule", l.pp > 1 ? l.schedule : "none"},
                   {"checkpointing", l.checkpointing},
                   {"sequence_parallel", l.sequence_parallel},
                   {"step_s", p.step_s},
                   {"tokens_per_s", p.tokens_per_s},
                   {"memory_bytes", p.memory_bytes},
                   {"parameter_bytes", p.parameter_bytes},
                   {"gradient_bytes", p.gradient_bytes},
                   {"optimizer_bytes", p.optimizer_bytes},
                   {"activation_bytes", p.activation_bytes},
                   {"compute_s", p.compute_s},
                   {"tp_comm_s", p.tp_comm_s},
                   {"cp_comm_s", p.cp_comm_s},
                   {"pp_comm_s", p.pp_comm_s},
                   {"dp_comm_s", p.dp_comm_s},
                   {"optimizer_s", p.optimizer_s},
                   {"bubble_fraction", p.bubble_fraction},
                   {"rank_memory_bytes", p.rank_memory_bytes},
                   {"mfu", p.mfu}});
  }
  return out.dump(2);
}

}  // namespace loom::plan
