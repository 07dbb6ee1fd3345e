// loom-prepare: text files -> DIR/train.bin and DIR/val.bin (llm.c format) + DIR/meta.json.
#include <spdlog/spdlog.h>

#include "loom/apps/cli.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{"Tokenize text files into llm.c token shards (train.bin, val.bin) and meta.json.",
               "loom-prepare"};
  std::vector<std::string> inputs;
  std::string out_dir, vocab, merges, tokenizer;
  double val_fraction = 0.1;
  app.add_option("--input", inputs,
                 "Text files, one document each, in the order given (each document is preceded "
                 "by the tokenizer's document-start token when it has one: BOS <s> or "
                 "<|begin_of_text|>, GPT-2's <|endoftext|>)")
      ->required();
  app.add_option("--out-dir", out_dir, "Directory for train.bin, val.bin, meta.json")->required();
  app.add_option("--val-fraction", val_fraction, "Share of tokens (the end) kept for validation")
      ->capture_default_str();
  auto* t = app.add_option("--tokenizer", tokenizer,
                           "\"byte\" (the default), a Hugging Face tokenizer.json, a SentencePiece "
                           ".model file, or a directory holding one of them (or vocab.json + "
                           "merges.txt)");
  auto* v = app.add_option("--vocab", vocab, "GPT-2 BPE vocab.json (with --merges)");
  auto* m = app.add_option("--merges", merges, "GPT-2 BPE merges.txt");
  v->needs(m);
  m->needs(v);
  t->excludes(v);
  t->excludes(m);
  return loom::apps::run_app(app, argc, argv, [&] {
    loom::core::setup_logging("info");
    LOOM_CHECK(val_fraction >= 0 && val_fraction < 1, "--val-fraction {} must be in [0, 1)",
               val_fraction);
    std::unique_ptr<loom::data::Tokenizer> tok;
    if (!vocab.empty())
      tok = std::make_unique<loom::data::Gpt2BpeTokenizer>(vocab, merges);
    else
      tok = loom::data::open_tokenizer(tokenizer.empty() ? "byte" : tokenizer);
    // Each file is a document. The tokenizer's document-start token (BOS, or GPT-2's
    // <|endoftext|>) goes before every document, as llm.c's data preparation does.
    size_t text_bytes = 0;
    std::vector<int32_t> ids;
    for (const auto& file : inputs) {
      const auto text = loom::core::read_file(file);
      text_bytes += text.size();
      if (const auto start = tok->document_start()) ids.push_back(*start);
      const auto doc = tok->encode(text);
      ids.insert(ids.end(), doc.begin(), doc.end());
    }
    LOOM_CHECK(ids.size() >= 2, "the input holds {} tokens; at least 2 are needed", ids.size());
    const auto n_val = static_cast<size_t>(static_cast<double>(ids.size()) * val_fraction);
    const auto n_train = ids.size() - n_val;
    loom::core::ensure_writable_dir(out_dir);
    const std::filesystem::path dir(out_dir);
    // llm.c version 1 (uint16 tokens) up to 65,536 ids, version 2 (uint32) past that.
    const int64_t vocab_size = tok->vocab_size();
    loom::data::write_llmc_shard(dir / "train.bin", {ids.data(), n_train}, vocab_size);
    if (n_val > 0)
      loom::data::write_llmc_shard(dir / "val.bin", {ids.data() + n_train, n_val}, vocab_size);
    // Nothing stale from an earlier run in the same directory may describe this data.
    if (n_val == 0) std::filesystem::remove(dir / "val.bin");
    loom::data::save_tokenizer_meta(*tok, dir);
    spdlog::info("{} bytes of text -> {} tokens ({} tokenizer, vocab {}): {} train, {} val, in {}",
                 text_bytes, ids.size(), tok->kind(), tok->vocab_size(), n_train, n_val, out_dir);
  });
}
