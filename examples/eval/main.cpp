// loom-eval: mean next-token loss of a model on the first K windows of a token file.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <filesystem>

#include "loom/apps/cli.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{
      "Score a model on a token file: the mean next-token loss over the first K "
      "windows in file order (window i: inputs tokens[i*T, i*T+T), targets shifted by "
      "one). The last line printed is JSON: {\"loss\": ..., \"tokens\": ...}.",
      "loom-eval"};
  std::string checkpoint, hf_dir, data;
  int64_t seq_len = 128, batches = 8, batch_size = 8;
  std::string logits_out;
  int threads = 0;
  bool doc_mask = false;
  auto* source = app.add_option_group("model", "Where the model comes from");
  source->add_option("--checkpoint", checkpoint, "loom checkpoint or save directory");
  source->add_option("--init-from-hf", hf_dir, "Hugging Face directory");
  source->require_option(1);
  app.add_option("--data", data, "Token file (llm.c .bin or raw *.u16)")->required();
  app.add_option("--seq-len", seq_len, "Tokens per window")->capture_default_str();
  app.add_option("--batches", batches, "Number of windows K to score")->capture_default_str();
  app.add_option("--batch-size", batch_size, "Windows per forward pass")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads (0: PyTorch's default)");
  app.add_option("--logits-out", logits_out,
                 "Also write the logits of the scored windows ([K, T, vocab], fp32) to this "
                 "safetensors file");
  app.add_flag("--doc-mask", doc_mask,
               "Attention within each document of a window, as loom-pretrain --doc-mask: a "
               "document begins at each document-start token of the data's tokenizer (the "
               "meta.json beside --data)");
  return loom::apps::run_app(app, argc, argv, [&] {
    if (threads > 0) at::set_num_threads(threads);
    LOOM_CHECK(batches > 0 && batch_size > 0, "--batches {} and --batch-size {} must be positive",
               batches, batch_size);
    auto model = checkpoint.empty() ? loom::models::load_hf(hf_dir)
                                    : loom::train::load_model_from_checkpoint(checkpoint);
    auto shard = std::make_shared<loom::data::TokenShard>(data);
    shard->check_vocab(model->config().vocab_size);
    if (doc_mask) {
      const auto dir = std::filesystem::absolute(data).parent_path();
      const auto tokenizer = loom::data::load_tokenizer(dir);
      model->set_document_mask(loom::data::document_start_for_mask(*tokenizer, dir));
    }
    loom::data::WindowSampler windows(shard, seq_len, /*seed=*/0);
    LOOM_CHECK(batches <= windows.num_sequential_windows(),
               "--batches {} windows of {} tokens do not fit in '{}' ({} tokens: at most {})",
               batches, seq_len, data, shard->size(), windows.num_sequential_windows());
    torch::NoGradGuard no_grad;
    model->eval();
    double sum = 0;
    std::vector<at::Tensor> all_logits;
    for (int64_t first = 0; first < batches; first += batch_size) {
      const int64_t count = std::min(batch_size, batches - first);
      auto b = windows.sequential_batch(first, count);
      auto logits = model->forward(b.inputs);
      sum += loom::models::next_token_loss(logits, b.targets).item<double>() *
             static_cast<double>(count);
      if (!logits_out.empty()) all_logits.push_back(logits.to(at::kFloat));
    }
    if (!logits_out.empty())
      loom::core::save_safetensors(logits_out, {{"logits", at::cat(all_logits, 0)}});
    const nlohmann::json result = {{"loss", sum / static_cast<double>(batches)},
                                   {"tokens", batches * seq_len}};
    std::printf("%s\n", result.dump().c_str());
  });
}
