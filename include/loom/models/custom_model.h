#pragma once
// A model of your own, written in plain LibTorch, trained by loom's Trainer like its presets:
// wrap the module with make_custom_model and hand the Trainer a factory that builds it.
//
// What the runtime needs from it, and what each strategy needs on top:
//   - parameters (the module's, named "<name>.<path>"), and a forward from token ids [batch, seq]
//     to logits [batch, seq, vocab] — enough for data parallelism, ZeRO-1/2 and ZeRO-3 (the
//     whole model then is one unit, gathered for each use);
//   - the list of its blocks, each run through the `run_block` the forward receives — then ZeRO-3
//     gathers one block at a time and activation checkpointing recomputes each block;
//   - tensor parallelism needs loom's parallel layers and pipeline parallelism stages loom can
//     split the model into: a custom model is refused by both, with a message saying so.
// Initialization is the module's own (ParamInit::kKeep): the Trainer seeds LibTorch's generator
// from --seed before calling the factory, so every rank builds the same values.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/models/causal_lm.h"

namespace loom::models {

struct CustomModelSpec {
  std::shared_ptr<torch::nn::Module> module;
  std::string name = "net";  // parameter names are "<name>.<the module's own names>"
  // Runs block i (an index into `blocks`) on x as block(x), with what strategies add around it.
  using BlockRunner = std::function<at::Tensor(
      int64_t i, const at::Tensor& x, const std::function<at::Tensor(const at::Tensor&)>& block)>;
  // tokens [batch, seq] (int64) -> logits [batch, seq, vocab_size].
  std::function<at::Tensor(const at::Tensor& tokens, const BlockRunner& run_block)> forward;
  // The module's blocks in forward order, and the path of the container holding them inside
  // `module` ("layers" for blocks registered as "layers.0", "layers.1", ...). Empty: none.
  std::vector<std::shared_ptr<torch::nn::Module>> blocks;
  std::string blocks_path;
  // Loss from logits and targets [batch, seq]; empty: mean next-token cross-entropy in fp32.
  std::function<at::Tensor(const at::Tensor& logits, const at::Tensor& targets)> loss;
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;
  int64_t d_model = 0;  // the hidden width, for the log
};

// Wraps `spec` as a CausalLM (family kCustom). Throws loom::Error naming what is missing or
// wrong (no module or forward, a block count that does not match, tp > 1).
std::shared_ptr<CausalLM> make_custom_model(CustomModelSpec spec,
                                            parallel::tensor::TpGroupPtr tp = nullptr);

// Builds the custom model on the run's tp group (the Trainer calls it once per rank).
using CustomModelFactory =
    std::function<std::shared_ptr<CausalLM>(const parallel::tensor::TpGroupPtr& tp)>;

}  // namespace loom::models
