#include "loom/models/generate.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <chrono>

#include "loom/core/error.h"
#include "loom/core/rng.h"

namespace loom::models {

namespace {

// The checks both decoders make; returns the context length in effect.
int64_t checked_context(const CausalLM& model, const std::vector<int64_t>& prompt,
                        const GenerateOptions& options) {
  const auto& config = model.config();
  LOOM_CHECK(!prompt.empty(), "generate: the prompt is empty");
  LOOM_CHECK(options.temperature >= 0, "generate: temperature {} must be >= 0",
             options.temperature);
  LOOM_CHECK(options.top_k >= 0, "generate: top_k {} must be >= 0", options.top_k);
  LOOM_CHECK(options.context >= 0 && options.context <= config.max_seq_len,
             "generate: context {} must be in [0, max_seq_len = {}]", options.context,
             config.max_seq_len);
  const int64_t context = options.context > 0 ? options.context : config.max_seq_len;
  for (auto id : prompt)
    LOOM_CHECK(id >= 0 && id < config.vocab_size,
               "generate: prompt token {} is outside the vocabulary [0, {})", id,
               config.vocab_size);
  return context;
}

at::Tensor window_of(const std::vector<int64_t>& ids, int64_t start, at::Device device) {
  return at::tensor(std::vector<int64_t>(ids.begin() + start, ids.end()), at::kLong)
      .unsqueeze(0)
      .to(device);
}

}  // namespace

std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt,
                              const GenerateOptions& options) {
  const int64_t context = checked_context(model, prompt, options);
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.parameters().front().device();
  std::vector<int64_t> ids = prompt;
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - context);
    const auto window = window_of(ids, start, device);
    auto logits =
        model.forward(window).select(1, window.size(1) - 1).squeeze(0).to(at::kFloat).cpu();
    int64_t next;
    if (options.temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / options.temperature;
      if (options.top_k > 0 && options.top_k < logits.size(0)) {
        const auto kth = std::get<0>(logits.topk(options.top_k)).min();
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
      }
      auto gen = core::make_generator(core::mix_seed({options.seed, static_cast<uint64_t>(i)}));
      next = at::multinomial(at::softmax(logits, 0), 1, false, gen).item<int64_t>();
    }
    ids.push_back(next);
  }
  model.train(was_training);
  return ids;
}

std::vector<int64_t> generate_speculative(CausalLM& model, const std::vector<int64_t>& prompt,
                                          const GenerateOptions& options, SpeculativeStats* stats) {
  const int64_t context = checked_context(model, prompt, options);
  LOOM_CHECK(options.temperature == 0,
             "speculative decoding reproduces greedy decoding: temperature must be 0 (got {})",
             options.temperature);
  LOOM_CHECK(model.config().mtp_heads > 0,
             "speculative decoding drafts with the model's multi-token prediction heads, and this "
             "model has none (train it with --mtp N)");
  const auto start_time = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.parameters().front().device();
  SpeculativeStats local;
  std::vector<int64_t> ids = prompt, draft;
  const int64_t target = static_cast<int64_t>(prompt.size()) + options.max_new_tokens;
  while (static_cast<int64_t>(ids.size()) < target) {
    const int64_t length = static_cast<int64_t>(ids.size());
    // Verified positions must see the window greedy decoding gave them: from the first token
    // while everything fits the context. One token is left for the main head's own.
    const int64_t room = std::min(std::max<int64_t>(0, context - length), target - length - 1);
    draft.resize(static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(draft.size()), room)));
    const int64_t start = draft.empty() ? std::max<int64_t>(0, length - context) : 0;
    auto window_ids = ids;
    window_ids.insert(window_ids.end(), draft.begin(), draft.end());
    const auto heads = model.forward_heads(window_of(window_ids, start, device));
    ++local.forwards;
    // The main head's choice after each position; the last kept token sits at `last`.
    // Compared in fp32, as generate() compares.
    const auto choice = heads[0][0].to(at::kFloat).argmax(-1).cpu();
    const auto* next = choice.data_ptr<int64_t>();
    int64_t last = length - 1 - start, accepted = 0;
    while (accepted < static_cast<int64_t>(draft.size()) &&
           draft[static_cast<size_t>(accepted)] == next[last]) {
      ids.push_back(draft[static_cast<size_t>(accepted)]);
      ++accepted;
      ++last;
    }
    local.drafted += static_cast<int64_t>(draft.size());
    local.accepted += accepted;
    ids.push_back(next[last]);
    // Head k at `last` predicts the token k + 1 places ahead: the ones after the token above.
    draft.clear();
    for (size_t k = 1; k < heads.size(); ++k)
      draft.push_back(heads[k][0][last].to(at::kFloat).argmax().item<int64_t>());
  }
  model.train(was_training);
  local.tokens = options.max_new_tokens;
  local.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  if (stats) *stats = local;
  return ids;
}

}  // namespace loom::models
