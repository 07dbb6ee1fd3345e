#pragma once
// Pipeline schedules: the order in which each pipeline rank runs the forward and backward passes
// of its model chunks over the micro-batches of one step. A schedule is only that order; the
// executor (executor.h) runs it, moving activations and their gradients between ranks.
//
// Built in: "gpipe" (all forwards, then all backwards), "1f1b" (one forward, one backward in
// steady state, at most pp micro-batches in flight per rank) and "interleaved" (1F1B over v
// model chunks per rank, Megatron-style, which divides the bubble by about v). A user adds one
// by deriving from Schedule and registering it (LOOM_REGISTER_SCHEDULE); `simulate` checks any
// schedule for completeness and deadlock before it runs.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace loom::parallel::pipeline {

// The pipeline a schedule orders: `ranks` pipeline ranks, each holding `virtual_stages` model
// chunks, and `micro_batches` micro-batches per step. Chunk c of rank r is global stage
// c * ranks + r (so with v > 1 the model winds around the ranks v times).
struct PipelineShape {
  int64_t ranks = 1;
  int64_t virtual_stages = 1;
  int64_t micro_batches = 1;

  int64_t stages() const { return ranks * virtual_stages; }
  int64_t stage_of(int64_t rank, int64_t chunk) const { return chunk * ranks + rank; }
  int64_t rank_of(int64_t stage) const { return stage % ranks; }
  int64_t chunk_of(int64_t stage) const { return stage / ranks; }
  // Sizes below 1 are a loom::Error naming them.
  void validate() const;
  // "pp 4 x v 2, 8 micro-batches"
  std::string describe() const;
};

struct Action {
  enum class Kind { kForward, kBackward };
  Kind kind = Kind::kForward;
  int64_t micro_batch = 0;
  int64_t chunk = 0;  // which of the rank's model chunks

  bool operator==(const Action&) const = default;
};
// "F3" (forward of micro-batch 3) or "B3.1" (backward of micro-batch 3 on chunk 1).
std::string to_string(const Action& a);
inline Action forward(int64_t micro_batch, int64_t chunk = 0) {
  return {Action::Kind::kForward, micro_batch, chunk};
}
inline Action backward(int64_t micro_batch, int64_t chunk = 0) {
  return {Action::Kind::kBackward, micro_batch, chunk};
}

class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual std::string name() const = 0;
  // Throws loom::Error, naming the constraint and the values that would be valid, when this
  // schedule cannot run `shape` (interleaved: micro-batches a multiple of pp, say).
  virtual void check(const PipelineShape& shape) const { shape.validate(); }
  // What pipeline rank `rank` runs in one training step, in order: every (micro-batch, chunk)
  // forward once and backward once, after its forward.
  virtual std::vector<Action> actions(int64_t rank, const PipelineShape& shape) const = 0;
};
using SchedulePtr = std::shared_ptr<const Schedule>;

class GPipeSchedule : public Schedule {
 public:
  std::string name() const override { return "gpipe"; }
  void check(const PipelineShape& shape) const override;
  std::vector<Action> actions(int64_t rank, const PipelineShape& shape) const override;
};

class OneFOneBSchedule : public Schedule {
 public:
  std::string name() const override { return "1f1b"; }
  void check(const PipelineShape& shape) const override;
  std::vector<Action> actions(int64_t rank, const PipelineShape& shape) const override;
};

class InterleavedSchedule : public Schedule {
 public:
  std::string name() const override { return "interleaved"; }
  void check(const PipelineShape& shape) const override;
  std::vector<Action> actions(int64_t rank, const PipelineShape& shape) const override;
};

// Forwards only, for evaluation: micro-batch by micro-batch, chunk by chunk.
std::vector<Action> forward_only_actions(const PipelineShape& shape);

// The registry of schedules by name. The built-in three are always there; registering a name
// twice is a loom::Error.
using ScheduleFactory = std::function<SchedulePtr()>;
void register_schedule(const std::string& name, ScheduleFactory factory);
// Unknown names are a loom::Error listing the registered ones.
SchedulePtr make_schedule(const std::string& name);
std::vector<std::string> schedule_names();

// What running a schedule looks like when a forward of one stage takes `forward_time`, its
// backward `backward_time` and messages are free: the predicted timeline.
struct SimulatedRun {
  double makespan = 0;                 // the step, first action to last
  std::vector<double> busy;            // per rank: time computing
  std::vector<int64_t> max_in_flight;  // per rank: most micro-batch chunks forwarded, not back
  // Per rank: idle / makespan; the mean over ranks.
  std::vector<double> bubble_fractions() const;
  double bubble_fraction() const;
};

// Checks every rank's actions (each (micro-batch, chunk) forwarded and backwarded exactly once,
// the backward after the forward; forward_only: forwards only) and plays them out with blocking
// receives, as the executor runs them. A schedule that would deadlock is a loom::Error naming
// each rank's blocked action; so is an incomplete one.
SimulatedRun simulate(const Schedule& schedule, const PipelineShape& shape,
                      double forward_time = 1.0, double backward_time = 2.0);
SimulatedRun simulate_actions(const std::vector<std::vector<Action>>& per_rank,
                              const PipelineShape& shape, const std::string& name,
                              bool forward_only, double forward_time = 1.0,
                              double backward_time = 2.0);

namespace detail {
struct ScheduleRegistration {
  ScheduleRegistration(const std::string& name, ScheduleFactory factory) {
    register_schedule(name, std::move(factory));
  }
};
}  // namespace detail

}  // namespace loom::parallel::pipeline

// Registers Type (a Schedule with a default constructor) under `name` at static-initialization
// time, so --schedule name finds it.
#define LOOM_REGISTER_SCHEDULE(Type, name)                                           \
  static const ::loom::parallel::pipeline::detail::ScheduleRegistration              \
      loom_schedule_registration_##Type(name, [] {                                   \
        return std::static_pointer_cast<const ::loom::parallel::pipeline::Schedule>( \
            std::make_shared<Type>());                                               \
      })
