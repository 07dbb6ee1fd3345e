#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace loom::models {
class CausalLM;
}
namespace loom::dist {
class Communicator;
}

namespace loom::train {

// Global L2 norm of all gradients (accumulated in fp32). If max_norm > 0 and the norm exceeds
// it, scales every gradient by max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_.
// Returns the norm before clipping.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

// The same without a host sync, for a GPU's stream: the norm stays a 0-dim float64 tensor on
// the gradients' device, and the scale (max_norm / (norm + 1e-6) where the norm exceeds
// max_norm, else 1) is applied on the device. One process, unsharded gradients.
at::Tensor clip_grad_norm_on_device(const std::vector<at::Tensor>& params, double max_norm);

// The norm and the factor clip_grad_norm_on_device multiplies by (1 when max_norm <= 0), both
// 0-dim tensors on the gradients' device, without touching the gradients: for an optimizer that
// applies the factor inside its update (AdamW::step's grad_scale), saving a pass over them.
struct GradClip {
  at::Tensor norm, factor;
};
GradClip grad_clip_on_device(const std::vector<at::Tensor>& params, double max_norm);

// The same for a (possibly tensor-parallel) model, giving the norm of the single-process
// model's gradient: squares of sharded gradients are summed across the tp group in one
// all-reduce, a piece held by several ranks (replicated key/value heads) is counted once, and
// replicated parameters, whose gradients are equal on every rank, are counted once. Padded
// vocabulary rows have zero gradients. Collective over the model's tp group.
double clip_grad_norm(const models::CausalLM& model, double max_norm);

// How much parameter `name` of `part` counts in a sum of squared gradients that is then summed
// over the tp group (and over the pipeline): 1 / (tp ranks holding the same values) — 1 / replicas
// for a sharded parameter, 1 / tp for a replicated one, 1 at tp 1 — and 0 for a copy another
// part counts (CausalLM::is_copy: a last part's copy of the tied embedding, a shared block first
// used on an earlier part). ZeRO's engines weight their shards by it.
double grad_norm_weight(const models::CausalLM& part, const std::string& name);

// This rank's weighted sum of squared gradients over `parts` (accumulation dtype: a 0-dim
// float64 tensor on the parameters' device), to be summed over the tp and pipeline groups.
at::Tensor local_grad_squares(const std::vector<const models::CausalLM*>& parts);

// The same over the model parts (pipeline chunks) one rank holds, with the squares also summed
// across the pipeline group `pipeline` (null or size 1: none): the norm of the whole model's
// gradient. Copies another part counts (the tied embedding's on the last part, shared blocks') are
// not counted (the gradients are equal once summed) but are scaled like everything else. Collective
// over the tp and pipeline groups.
double clip_grad_norm(const std::vector<const models::CausalLM*>& parts, double max_norm,
                      dist::Communicator* pipeline);

}  // namespace loom::train
