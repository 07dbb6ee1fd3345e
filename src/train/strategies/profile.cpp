// profile: --profile-steps A:B records optimizer steps A through B (1-based, as the log counts
// them) under PyTorch's Kineto profiler and writes, per rank, into --profile-out DIR:
// trace.rank<R>.json (a Chrome trace: chrome://tracing or Perfetto), kernels.rank<R>.json and
// kernels.rank<R>.txt (the top 60 kernels by device time on a GPU, each with the ATen op that
// launched it and its input shapes; on the CPU the top ops by inclusive time). Evaluations and
// checkpoint saves after steps A..B-1 fall inside the recording (they run between steps). It
// observes only:
// the steps it profiles compute what they would without it (at the profiler's overhead in time).
// See docs/gpu.md ("Where the step goes").
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>
#include <memory>

#include "builtin.h"
#include "loom/core/error.h"
#include "loom/train/config.h"
#include "loom/train/device_profile.h"
#include "loom/train/run_context.h"

namespace loom::train::strategies {

namespace {

constexpr size_t kTopRows = 60;

class Profile final : public Strategy {
 public:
  explicit Profile(const StrategySpec& spec) { spec.check_keys({}); }
  std::string name() const override { return "profile"; }
  StrategyTraits traits() const override { return {{}, {"profile_steps", "profile_out"}}; }

  void apply(RunContext& run) override {
    const auto range = parse_profile_steps(run.config.profile_steps, run.config.steps);
    first_ = range.first;
    last_ = range.second;
    dir_ = run.config.profile_out;
    std::filesystem::create_directories(dir_);
    profile_ = std::make_unique<DeviceProfile>(run.device);
  }

  ~Profile() override {
    if (profile_ && profile_->running())
      spdlog::warn("profile: the run ended inside --profile-steps {}-{}; nothing was written",
                   first_, last_);
  }

  void begin_step(RunContext& run) override {
    // run.step counts the steps completed: this one is run.step + 1. A step retried after a
    // failure finds the profiler still running and goes on recording.
    const int64_t step = run.step + 1;
    if (step == first_ && !profile_->running()) profile_->start();
    if (step > first_ && step <= last_ && !profile_->running() && !warned_) {
      warned_ = true;
      spdlog::warn(
          "profile: the run starts at step {}, inside --profile-steps {}-{}; nothing "
          "is profiled",
          step, first_, last_);
    }
  }

  void after_optimizer_step(RunContext& run) override {
    if (run.step != last_ || !profile_->running()) return;
    const double wall_ms = profile_->stop();
    const int64_t rank = run.mesh->rank();
    const auto base = std::filesystem::path(dir_);
    const auto trace = base / fmt::format("trace.rank{}.json", rank);
    profile_->save_trace(trace.string());
    const auto table = profile_->table(last_ - first_ + 1, wall_ms, kTopRows);
    write(base / fmt::format("kernels.rank{}.json", rank), table.dump(1) + "\n");
    write(base / fmt::format("kernels.rank{}.txt", rank), DeviceProfile::format_table(table));
    if (rank == 0)
      spdlog::info("profile: steps {}-{} ({:.1f} ms a step, {:.1f} ms of {} time) written to {}",
                   first_, last_, table.at("step_ms").get<double>(),
                   table.at("kernel_ms_per_step").get<double>(),
                   table.at("times").get<std::string>(), dir_);
  }

 private:
  static void write(const std::filesystem::path& path, const std::string& text) {
    std::ofstream out(path);
    out << text;
    LOOM_CHECK(out.good(), "profile: could not write {}", path.string());
  }

  int64_t first_ = 0, last_ = 0;
  bool warned_ = false;
  std::string dir_;
  std::unique_ptr<DeviceProfile> profile_;
};

}  // namespace

void register_profile() {
  register_strategy("profile", [](const StrategySpec& spec) -> StrategyPtr {
    return std::make_unique<Profile>(spec);
  });
}

}  // namespace loom::train::strategies
