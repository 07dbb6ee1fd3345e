#include "loom/models/generate.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "loom/core/error.h"
#include "loom/core/rng.h"

namespace loom::models {

std::vector<int64_t> generate(CausalLM& model, const std::vector<int64_t>& prompt,
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
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.parameters().front().device();
  std::vector<int64_t> ids = prompt;
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - context);
    auto window = at::tensor(std::vector<int64_t>(ids.begin() + start, ids.end()), at::kLong)
                      .unsqueeze(0)
                      .to(device);
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

}  // namespace loom::models
