#pragma once
// A small language model in plain LibTorch (embeddings, residual Linear blocks, head) wrapped as
// a loom custom model, for the tests of models/custom_model.h.
#include <torch/torch.h>

#include "loom/models/custom_model.h"

namespace loom::testing {

struct PlainLmImpl : torch::nn::Module {
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList layers;
  torch::nn::Linear head{nullptr};
  PlainLmImpl(int64_t vocab, int64_t width, int64_t n_layers) {
    embed = register_module("embed", torch::nn::Embedding(vocab, width));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < n_layers; ++i) layers->push_back(torch::nn::Linear(width, width));
    head = register_module("head", torch::nn::Linear(width, vocab));
  }
};

// `declare_blocks` false: the same model with no blocks declared (its forward runs them itself).
// `dropout` > 0: each block drops out (from LibTorch's default generator) while training.
inline models::CustomModelFactory plain_lm(bool declare_blocks = true, int64_t n_layers = 2,
                                           double dropout = 0) {
  return [=](const parallel::tensor::TpGroupPtr& tp) {
    auto net = std::make_shared<PlainLmImpl>(256, 16, n_layers);
    models::CustomModelSpec spec;
    spec.module = net;
    spec.forward = [net, declare_blocks, dropout](const at::Tensor& ids,
                                                  const models::CustomModelSpec::BlockRunner& run) {
      auto x = net->embed(ids);
      for (size_t i = 0; i < net->layers->size(); ++i) {
        auto block = [layer = net->layers[i]->as<torch::nn::LinearImpl>(), dropout,
                      training = net->is_training()](const at::Tensor& in) {
          return in + torch::dropout(torch::tanh(layer->forward(in)), dropout, training);
        };
        x = declare_blocks ? run(static_cast<int64_t>(i), x, block) : block(x);
      }
      return net->head(x);
    };
    if (declare_blocks) {
      for (size_t i = 0; i < net->layers->size(); ++i) spec.blocks.push_back(net->layers->ptr(i));
      spec.blocks_path = "layers";
    }
    spec.vocab_size = 256;
    spec.max_seq_len = 64;
    spec.d_model = 16;
    return models::make_custom_model(spec, tp);
  };
}

}  // namespace loom::testing
