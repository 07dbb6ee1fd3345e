#pragma once
// Activation checkpointing: run a function without keeping its intermediate activations, and run
// it again in backward to get them back. Only the inputs are kept; memory goes from "every
// activation inside fn" to "fn's inputs", for the price of a second forward of fn in backward.
//
// Why reentrant. PyTorch's Python checkpoint has a non-reentrant form built on saved-tensor hooks
// (the recompute happens inside the original graph, and torch.autograd.grad works). LibTorch's
// C++ API has no saved-tensor hooks, so loom uses the reentrant form: checkpoint() is one
// autograd node whose backward recomputes fn with grad enabled on detached copies of the inputs
// and calls torch::autograd::backward on that fresh graph. What this implies:
//   - Parameters used inside fn get their gradients through their own AccumulateGrad nodes in
//     that inner backward, so .grad and post-accumulate-grad hooks (data-parallel buckets, ZeRO)
//     work as without checkpointing. Only .backward() is supported: torch::autograd::grad with
//     explicit inputs cannot see those gradients, and is refused with a loom::Error.
//   - fn must not capture tensors that need gradients other than parameters (leaves): a captured
//     activation would be recomputed from nowhere and its gradient lost. Pass such tensors as
//     inputs. Captured tensors that need no gradient (rotary tables, masks) are fine.
//   - fn runs again in backward, possibly after the caller's locals are gone: it must hold what it
//     needs by value (shared pointers, tensors), and must not change its inputs in place.
//   - Randomness inside fn must come from generators listed in options.generators: their state
//     at forward is restored for the recompute (so dropout draws the same masks), and put back
//     afterwards, so code running after the recompute draws what it would have drawn anyway.
//     loom's own dropout reads a DropoutStream's position (ops/dropout.h) instead: the streams in
//     options.dropout_streams get back, for the recompute, the position they had at forward (a
//     pipeline runs other micro-batches' forwards in between).
//   - Autocast (thread-local, while backward may run on another thread) is captured at forward
//     for the CPU and CUDA and re-established for the recompute.
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "loom/ops/dropout.h"
#include "loom/parallel/memory/activation_offload.h"

namespace loom::parallel::memory {

struct CheckpointOptions {
  // The generators fn draws random numbers from (handles: copies share the generator).
  std::vector<at::Generator> generators;
  // The dropout streams fn reads positions from (ops::dropout's masks).
  std::vector<std::shared_ptr<ops::DropoutStream>> dropout_streams;
  // When set, the floating-point inputs are not kept on their device between forward and
  // backward: they go to the host through this offloader and come back for the recompute, and
  // the backward of the checkpoint with ticket t prefetches ticket t - 1 (the block backward
  // reaches next when blocks are checkpointed in forward order).
  std::shared_ptr<ActivationOffloader> offload;
  // Leaves fn uses (parameters) whose gradients this node returns, instead of the recompute
  // accumulating them into .grad: each then gets one accumulation per backward, summed with its
  // uses outside fn, which is what data parallelism and ZeRO count on (a weight shared with the
  // rest of the model, like an output head tied to the embedding). When this is not empty, the
  // recompute is differentiated for the inputs and these leaves only: every leaf fn needs a
  // gradient for must be listed, and the rest get none. Never offloaded.
  std::vector<at::Tensor> parameters;
};

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// fn(inputs), computed without saving fn's activations; in backward fn(inputs) is recomputed and
// differentiated. Inputs may be undefined or non-floating (integer ids): they get no gradient.
// With grad mode off this is fn(inputs). With grad mode on and no input needing a gradient, the
// node is still recorded (so parameters inside fn get gradients), and the result requires grad.
at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                      const CheckpointOptions& options = {});

// fns[0](inputs) + fns[1](inputs) + ..., computed one after another without saving their
// activations; in backward each is recomputed and differentiated in turn, so the activations of
// only one of them exist at a time (several output heads on one trunk, each with its own
// vocabulary-wide logits). Generators and dropout streams replay from the state they had before
// fns[0], so the functions must draw in the same order both times. Empty fns is a loom::Error.
at::Tensor checkpoint_sum(const std::vector<CheckpointFn>& fns,
                          const std::vector<at::Tensor>& inputs,
                          const CheckpointOptions& options = {});

}  // namespace loom::parallel::memory
