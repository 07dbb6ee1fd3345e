#pragma once
// Autoregressive sampling from a CausalLM (no KV cache yet: each new token re-runs the window).
#include <cstdint>
#include <vector>

#include "loom/models/causal_lm.h"

namespace loom::models {

struct GenerateOptions {
  int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0 = greedy
  int64_t top_k = 40;        // 0 = no top-k filter
  uint64_t seed = 1234;      // token i is drawn from a generator seeded by (seed, i)
  // Tokens of context fed to the model: 0 = max_seq_len. Use the training sequence length:
  // positions beyond it were never trained.
  int64_t context = 0;
};

// Returns prompt + generated ids. The model sees the last `context` ids.
// Throws loom::Error for an empty prompt, an id >= vocab_size, temperature < 0, or a context
// outside [0, max_seq_len].
std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options);

}  // namespace loom::models
