#pragma once
// Where a training step's time goes, measured the way benchmarks/train_throughput.py measures
// the PyTorch twin, so the two tables can sit side by side (scripts/bench-profile):
//
//  - phase wall times (data, forward, backward, clip, optimizer, zero_grad, metrics) from a
//    steady clock around each phase, on steps that run without any op hook;
//  - on separate steps, the self time of every ATen op and autograd node, taken from ATen's
//    RecordFunction hooks (the mechanism torch.profiler uses on the Python side), grouped by
//    phase and by op class (op_class below; the Python twin has the same table). A phase's wall
//    time minus its ops' self time is what ran outside any op: dispatch from Python or C++,
//    autograd's engine, loom's own loops.
//  - minor page faults per step and the process's peak RSS (allocator cost the op hooks do not
//    see: fresh pages are zeroed by the kernel inside whichever op first touches them).
#include <ATen/record_function.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace loom_bench {

inline constexpr std::array<const char*, 7> kPhases = {"data",      "forward",   "backward", "clip",
                                                       "optimizer", "zero_grad", "metrics"};
inline constexpr std::array<const char*, 10> kOpClasses = {
    "matmul", "attention", "norm",     "activation",  "cross_entropy",
    "memory", "embedding", "autograd", "elementwise", "other"};

// The class of an op by its RecordFunction name; the Python twin's op_class is the same rules
// in the same order (keep them in step).
inline const char* op_class(std::string_view name, bool backward_node) {
  auto has = [&](std::string_view s) { return name.find(s) != std::string_view::npos; };
  if (backward_node || has("autograd::") || has("Backward")) return "autograd";
  if (has("scaled_dot_product") || has("flash_attention") || has("attention")) return "attention";
  if (has("layer_norm") || has("rms_norm")) return "norm";
  if (has("gelu") || has("silu") || has("relu")) return "activation";
  if (has("log_softmax") || has("nll_loss") || has("cross_entropy")) return "cross_entropy";
  if (has("::mm") || has("addmm") || has("bmm") || has("matmul") || has("linear")) return "matmul";
  if (has("embedding") || has("index_select")) return "embedding";
  if (has("copy") || has("fill_") || has("zero") || has("empty") || has("cat") || has("stack") ||
      has("clone") || has("contiguous"))
    return "memory";
  if (has("aten::") || has("loom::")) return "elementwise";
  return "other";
}

class StepProfile {
 public:
  static StepProfile& instance() {
    static StepProfile p;
    return p;
  }

  // Starts `phase` (an index into kPhases), ending the one before.
  void phase(int phase) {
    const auto now = Clock::now();
    if (current_ >= 0) wall_ms_[current_] += ms(now - phase_start_);
    current_ = phase;
    phase_start_ = now;
  }
  // Ends the step's last phase and counts the step.
  void end_step() {
    phase(-1);
    ++steps_;
  }

  // Op hooks on (counting into the op tables) or off (phase walls only). Off between runs.
  void hook_ops(bool on) {
    if (on && !hooked_) {
      handle_ = at::addThreadLocalCallback(
          at::RecordFunctionCallback(&on_start, &on_end)
              .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
      hooked_ = true;
    } else if (!on && hooked_) {
      at::removeCallback(handle_);
      hooked_ = false;
    }
  }

  // Resets every count; the two kinds of steps are measured by two reset/measure rounds.
  void reset() {
    wall_ms_.fill(0);
    self_ms_ = {};
    by_name_.clear();
    steps_ = 0;
    faults_at_reset_ = minor_faults();
  }

  nlohmann::ordered_json phase_walls() const {
    nlohmann::ordered_json out;
    for (size_t p = 0; p < kPhases.size(); ++p) out[kPhases[p]] = wall_ms_[p] / per_step();
    out["minor_faults_per_step"] =
        static_cast<double>(minor_faults() - faults_at_reset_) / per_step();
    return out;
  }
  nlohmann::ordered_json op_tables() const {
    nlohmann::ordered_json out;
    for (size_t p = 0; p < kPhases.size(); ++p) {
      nlohmann::ordered_json row;
      double ops = 0;
      for (size_t c = 0; c < kOpClasses.size(); ++c) {
        row[kOpClasses[c]] = self_ms_[p][c] / per_step();
        ops += self_ms_[p][c];
      }
      row["outside_ops"] = (wall_ms_[p] - ops) / per_step();
      out[kPhases[p]] = row;
    }
    return out;
  }

  // The `n` ops with the most self time: "phase op-name" -> ms per step.
  nlohmann::ordered_json top_ops(size_t n) const {
    std::vector<std::pair<double, std::string>> all;
    for (const auto& [key, total] : by_name_) all.emplace_back(total, key);
    std::sort(all.rbegin(), all.rend());
    nlohmann::ordered_json out;
    for (size_t i = 0; i < std::min(n, all.size()); ++i)
      out[all[i].second] = all[i].first / per_step();
    return out;
  }

  static double peak_rss_mib() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_maxrss) / 1024.0;
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Frame {
    Clock::time_point start;
    double children_ms = 0;
    int op_class = 0;
    int phase = -1;
    const char* name = nullptr;
  };

  static double ms(Clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  }
  double per_step() const { return steps_ > 0 ? static_cast<double>(steps_) : 1.0; }
  static long minor_faults() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
  }

  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    auto& self = instance();
    const char* cls = op_class(fn.name(), fn.scope() == at::RecordScope::BACKWARD_FUNCTION);
    int index = 0;
    while (std::string_view(kOpClasses[index]) != cls) ++index;
    self.stack_.push_back({Clock::now(), 0.0, index, self.current_, fn.name()});
    return nullptr;
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext*) {
    auto& self = instance();
    if (self.stack_.empty()) return;  // hooked mid-op
    const Frame f = self.stack_.back();
    self.stack_.pop_back();
    const double total = ms(Clock::now() - f.start);
    if (f.phase >= 0) {
      self.self_ms_[f.phase][f.op_class] += total - f.children_ms;
      self.by_name_[std::string(kPhases[f.phase]) + " " + f.name] += total - f.children_ms;
    }
    if (!self.stack_.empty()) self.stack_.back().children_ms += total;
  }

  std::array<double, kPhases.size()> wall_ms_{};
  std::array<std::array<double, kOpClasses.size()>, kPhases.size()> self_ms_{};
  std::map<std::string, double> by_name_;
  std::vector<Frame> stack_;  // ops open on the profiled (main) thread
  Clock::time_point phase_start_;
  int current_ = -1;
  long steps_ = 0, faults_at_reset_ = 0;
  bool hooked_ = false;
  at::CallbackHandle handle_ = 0;
};

}  // namespace loom_bench
