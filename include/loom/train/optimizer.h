#pragma once
// AdamW with parameter groups and fp32 master weights.
//
// Groups: parameters with weight decay (matrices of linear layers) and without (norm weights,
// biases, embeddings) by default. When a parameter is narrower than fp32 (bf16 training), the
// optimizer keeps an fp32 master copy, reads the low-precision gradient, updates the master and
// writes the rounded value back, so small updates are not lost to bf16 rounding. fp64 parameters
// keep fp64 moments and no master (ops::accumulation_dtype).
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>

#include "loom/core/safetensors.h"
#include "loom/ops/adamw.h"

namespace loom::train {

using AdamWOptions = ops::AdamWOptions;

// Default grouping rule: decay 2-D weights, except embedding tables.
bool default_decays(const std::string& name, const at::Tensor& param);

class AdamW {
 public:
  AdamW(const core::NamedTensors& named_params, AdamWOptions options,
        std::function<bool(const std::string&, const at::Tensor&)> decays = default_decays);

  // One update with learning rate `lr` from the parameters' .grad() times `grad_scale` (a 0-dim
  // tensor, e.g. the gradient clip's factor computed on the device; undefined: 1), applied inside
  // the update (ops::AdamWTensors). Parameters without a gradient are skipped (their moments
  // are untouched). The gradients are not to be read afterwards: zero_grad() next.
  void step(double lr, const at::Tensor& grad_scale = at::Tensor());
  // Which implementation updates the list (--adamw; ops::AdamWBackend).
  void set_backend(ops::AdamWBackend backend) { backend_ = backend; }
  ops::AdamWBackend backend() const { return backend_; }
  void zero_grad();

  int64_t steps_taken() const { return steps_; }
  int64_t num_decayed() const;
  int64_t num_not_decayed() const;

  // Moments, master weights and the step count as named tensors (for checkpoints).
  core::NamedTensors state() const;
  // Restores what state() returned; throws loom::Error naming a missing or misshapen entry.
  void load_state(const std::map<std::string, at::Tensor>& state);

 private:
  struct Slot {
    std::string name;
    at::Tensor param;
    at::Tensor master;  // fp32 copy when param is narrower (bf16); otherwise undefined
    at::Tensor exp_avg, exp_avg_sq;
    bool decay = true;
  };
  std::vector<Slot> slots_;
  AdamWOptions options_;
  ops::AdamWBackend backend_ = ops::AdamWBackend::kAuto;
  int64_t steps_ = 0;
};

}  // namespace loom::train
