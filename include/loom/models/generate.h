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

// What self-speculative decoding did.
struct SpeculativeStats {
  int64_t forwards = 0;  // model forwards (plain greedy decoding makes one per token)
  int64_t drafted = 0;   // tokens the extra heads proposed and the main head checked
  int64_t accepted = 0;  // of those, the ones the main head agreed with
  int64_t tokens = 0;    // tokens generated
  double seconds = 0;
  double tokens_per_forward() const {
    return forwards > 0 ? static_cast<double>(tokens) / static_cast<double>(forwards) : 0.0;
  }
};

// Greedy decoding (options.temperature must be 0) sped up by the model's multi-token heads
// (ModelConfig::mtp_heads > 0): each forward verifies the tokens the extra heads drafted at the
// previous one with the main head, keeps the longest agreeing prefix and the main head's next
// token, and takes the heads' drafts for the tokens after it. The result is generate()'s with
// temperature 0 (the main head decides every token; only how many are checked per forward
// changes), as long as a longer window gives the same logits at earlier positions up to
// rounding. Drafts never run past `context` tokens: beyond it the window slides, and each
// token is one forward, as in plain decoding. Throws loom::Error for what generate() refuses,
// a temperature other than 0, or a model without heads.
std::vector<int64_t> generate_speculative(CausalLM& model, const std::vector<int64_t>& prompt,
                                          const GenerateOptions& options,
                                          SpeculativeStats* stats = nullptr);

}  // namespace loom::models
