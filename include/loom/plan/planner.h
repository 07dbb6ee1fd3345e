#pragma once
// The planner: every layout of a world of ranks that can run a workload and fits each rank's
// memory, ranked by the cost model's predicted tokens per second (loom-plan prints them).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/plan/cost_model.h"
#include "loom/plan/machine_profile.h"

namespace loom::plan {

struct PlanRequest {
  Workload workload;
  int64_t world = 1;
  MachineProfile machine;
  // The search: ZeRO stages (with dp > 1), checkpointing modes, micro-batches per step up to
  // this many, context parallelism (where the model allows it).
  std::vector<int> zero_stages{0, 1, 2, 3};
  std::vector<std::string> checkpointing{"none", "full"};
  int64_t max_micro_batches = 64;
  bool context_parallel = true;
  // Sequence parallelism only saves memory: on wherever tp allows it, unless this is false.
  bool sequence_parallel = true;
};

struct PlannedLayout {
  Layout layout;
  Prediction prediction;
};

// The layouts of request.world ranks that check_layout accepts and whose every rank fits its
// device's memory, most predicted tokens/s first (ties: less memory first). When none fits,
// a loom::Error says the least memory per rank any layout would need and which layout that is;
// a world of fewer than 1 rank, or one no layout divides, is a loom::Error too.
std::vector<PlannedLayout> plan_layouts(const PlanRequest& request);

// What a user fixed (loom-pretrain --plan auto with --tp 2, --zero 1, ...): a layout is chosen
// among those that agree with every field set. schedule and virtual_stages bind only with pp > 1.
struct LayoutConstraints {
  std::optional<int64_t> dp, tp, pp, cp, micro_batches, virtual_stages;
  std::optional<int> zero;
  std::optional<std::string> schedule, checkpointing;
  std::optional<bool> sequence_parallel;

  bool allows(const Layout& layout) const;
  std::string describe() const;  // "tp 2, zero 1", or "none"
};

struct LayoutChoice {
  PlannedLayout best;
  std::optional<PlannedLayout> runner_up;  // the next one the constraints allow
  size_t fitting = 0;                      // layouts that fit, before the constraints
  size_t allowed = 0;                      // of those, the ones the constraints allow
};

// The best layout of plan_layouts(request) that `fixed` allows and `runnable` accepts (when
// given: e.g. whether the run's other flags can go with it). A fixed ZeRO stage, checkpointing
// mode, micro-batch count or sequence parallelism widens the search to it. When none is
// allowed, a loom::Error names the constraints and the best layout without them.
LayoutChoice choose_layout(PlanRequest request, const LayoutConstraints& fixed,
                           const std::function<bool(const Layout&)>& runnable = {});
// Why: "on <profile>, N of M layouts that fit allow <constraints>; chose <layout>: predicted
// ... tokens/s, ... GiB per rank (compute, exchanges, optimizer, bubble); next: ...".
std::string explain_choice(const LayoutChoice& choice, const LayoutConstraints& fixed,
                           const std::string& profile);

// One line per layout for a terminal, or a JSON array of objects (best first) with dp, tp, pp,
// cp, zero, micro_batches, virtual_stages, schedule, checkpointing, sequence_parallel, step_s,
// tokens_per_s, memory_bytes and the prediction's parts.
std::string format_plan(const std::vector<PlannedLayout>& plans, size_t top);
std::string plan_json(const std::vector<PlannedLayout>& plans, size_t top);

}  // namespace loom::plan
