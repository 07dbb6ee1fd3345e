// loom-generate: sample text from a trained checkpoint.
#include <ATen/Parallel.h>

#include "loom/apps/cli.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{"Sample text from a loom checkpoint.", "loom-generate"};
  std::string checkpoint, prompt = "\n";
  loom::models::GenerateOptions options;
  int threads = 0;
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
  return loom::apps::run_app(app, argc, argv, [&] {
    if (threads > 0) at::set_num_threads(threads);
    const auto ckpt =
        loom::train::load_checkpoint(checkpoint, loom::train::model_parameters_only());
    auto model = loom::train::load_model_from_checkpoint(ckpt);
    auto tokenizer = loom::data::load_tokenizer(ckpt.dir);
    if (options.context == 0) {
      // Positions past the training length were never trained: stay within it.
      const auto trained =
          loom::train::TrainConfig::from_json(ckpt.state.value("train_config", nlohmann::json()));
      options.context = std::min(trained.seq_len, model->config().max_seq_len);
    }
    const auto ids32 = tokenizer->encode(prompt);
    std::vector<int64_t> ids(ids32.begin(), ids32.end());
    auto out = loom::models::generate(*model, ids, options);
    const auto text = tokenizer->decode(std::vector<int32_t>(out.begin(), out.end()));
    std::fwrite(text.data(), 1, text.size(), stdout);  // the text may hold NUL bytes
    std::fputc('\n', stdout);
  });
}
