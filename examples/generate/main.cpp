// loom-generate: sample text from a trained checkpoint.
#include <ATen/Parallel.h>

#include <chrono>

#include "loom/apps/cli.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{"Sample text from a loom checkpoint.", "loom-generate"};
  std::string checkpoint, prompt = "\n";
  loom::models::GenerateOptions options;
  int threads = 0;
  std::string tokenizer_path;
  app.add_option("--checkpoint", checkpoint, "loom checkpoint or save directory")->required();
  app.add_option("--prompt", prompt, "Text to continue")->capture_default_str();
  app.add_option("--max-tokens", options.max_new_tokens, "Tokens to generate")
      ->capture_default_str();
  app.add_option("--temperature", options.temperature, "Sampling temperature (0: greedy)")
      ->capture_default_str();
  app.add_option("--top-k", options.top_k, "Sample among the k most likely tokens (0: all)")
      ->capture_default_str();
  app.add_option("--seed", options.seed, "Sampling seed")->capture_default_str();
  app.add_option("--context", options.context,
                 "Tokens of context the model sees (0: the --seq-len it was trained with)")
      ->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads (0: PyTorch's default)");
  app.add_option("--tokenizer", tokenizer_path,
                 "Tokenizer for the prompt and the output (a tokenizer.json, a SentencePiece "
                 ".model, a directory, or \"byte\"; default: the one saved with the checkpoint)");
  bool speculative = false;
  app.add_flag("--speculative", speculative,
               "Self-speculative decoding with the model's multi-token heads (--temperature 0): "
               "also decodes greedily without them, checks the outputs are identical and reports "
               "accepted tokens per forward and the speed-up (on stderr)");
  return loom::apps::run_app(app, argc, argv, [&] {
    if (threads > 0) at::set_num_threads(threads);
    const auto ckpt =
        loom::train::load_checkpoint(checkpoint, loom::train::model_parameters_only());
    auto model = loom::train::load_model_from_checkpoint(ckpt);
    auto tokenizer = tokenizer_path.empty() ? loom::data::load_tokenizer(ckpt.dir)
                                            : loom::data::open_tokenizer(tokenizer_path);
    LOOM_CHECK(tokenizer->vocab_size() <= model->config().vocab_size,
               "the tokenizer's vocabulary ({} ids) is larger than the model's ({})",
               tokenizer->vocab_size(), model->config().vocab_size);
    if (options.context == 0) {
      // Positions past the training length were never trained: stay within it.
      const auto trained =
          loom::train::TrainConfig::from_json(ckpt.state.value("train_config", nlohmann::json()));
      options.context = std::min(trained.seq_len, model->config().max_seq_len);
    }
    const auto ids32 = tokenizer->encode(prompt);
    std::vector<int64_t> ids(ids32.begin(), ids32.end());
    std::vector<int64_t> out;
    if (speculative) {
      // Checked first: a greedy run of a model that cannot speculate would be wasted. A warm-up
      // forward before either is timed (first-call costs would count against the first).
      loom::models::SpeculativeStats stats;
      auto warm_up = options;
      warm_up.max_new_tokens = 1;
      loom::models::generate_speculative(*model, ids, warm_up);
      out = loom::models::generate_speculative(*model, ids, options, &stats);
      const auto start = std::chrono::steady_clock::now();
      const auto greedy = loom::models::generate(*model, ids, options);
      const double greedy_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      LOOM_CHECK(greedy == out,
                 "speculative decoding gave other tokens than greedy decoding: it must not (a "
                 "bug, or logits whose top two tie within rounding)");
      fmt::print(
          stderr,
          "speculative: {} tokens in {} forwards ({:.2f} tokens per forward; {} of {} "
          "drafted tokens accepted, {:.1f} %), {:.3f} s vs greedy {:.3f} s ({} forwards): "
          "speed-up {:.2f}x, output identical\n",
          stats.tokens, stats.forwards, stats.tokens_per_forward(), stats.accepted, stats.drafted,
          stats.drafted > 0
              ? 100.0 * static_cast<double>(stats.accepted) / static_cast<double>(stats.drafted)
              : 0.0,
          stats.seconds, greedy_s, options.max_new_tokens,
          stats.seconds > 0 ? greedy_s / stats.seconds : 0.0);
    } else {
      out = loom::models::generate(*model, ids, options);
    }
    const auto text = tokenizer->decode(std::vector<int32_t>(out.begin(), out.end()));
    std::fwrite(text.data(), 1, text.size(), stdout);  // the text may hold NUL bytes
    std::fputc('\n', stdout);
  });
}
