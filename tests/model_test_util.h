#pragma once
// What the model tests share (test_models.cpp, test_activation_memory.cpp): a small model of
// either family, built and initialized, a relative difference, and the fixture of the tests that
// run for both families (instantiated once, in test_models.cpp).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>

#include "loom/models/causal_lm.h"

namespace loom::testing {

// gpt2-tiny or llama-tiny cut down to d 32, 2 layers, 4 heads (llama: 2 kv heads), 32 positions.
inline models::ModelConfig tiny_model_config(models::Family family, int64_t vocab = 61) {
  auto c =
      models::ModelConfig::preset(family == models::Family::kGpt2 ? "gpt2-tiny" : "llama-tiny");
  c.vocab_size = vocab;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = family == models::Family::kGpt2 ? 4 : 2;
  c.d_ff = family == models::Family::kGpt2 ? 128 : 88;
  c.max_seq_len = 32;
  return c;
}

inline std::shared_ptr<models::CausalLM> make_initialized(const models::ModelConfig& c,
                                                          uint64_t seed = 1) {
  auto m = models::make_model(c);
  models::init_parameters(*m, seed);
  return m;
}

// max |a - b| / max |b|.
inline double max_rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

class BothFamilies : public ::testing::TestWithParam<models::Family> {};

}  // namespace loom::testing
