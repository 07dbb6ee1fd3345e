// loom-prepare: text -> DIR/train.bin and DIR/val.bin (llm.c format) + DIR/meta.json.
#include <spdlog/spdlog.h>

#include "loom/apps/cli.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{"Tokenize text into llm.c token shards (train.bin, val.bin) and meta.json.",
               "loom-prepare"};
  loom::data::PrepareOptions options;
  std::string vocab, merges, tokenizer, out_dir;
  app.add_option("--input", options.inputs,
                 "Files, directories (every file below), globs ('data/*.jsonl') and named pipes, "
                 "in the order given; '-' is standard input. A text file is one document; each "
                 "line of a JSON-lines file (*.jsonl, *.ndjson, or any input with --format "
                 "jsonl) is one. Each document is preceded by the tokenizer's document-start "
                 "token when it has one (BOS <s> or <|begin_of_text|>, GPT-2's <|endoftext|>)")
      ->required();
  app.add_option("--out-dir", out_dir, "Directory for train.bin, val.bin, meta.json")->required();
  app.add_option("--val-fraction", options.val_fraction,
                 "Share of tokens (the end) kept for validation")
      ->capture_default_str();
  app.add_option("--format", options.format,
                 "auto (JSON lines for *.jsonl / *.ndjson, text otherwise), text or jsonl")
      ->capture_default_str();
  app.add_option("--text-field", options.text_field,
                 "The field of each JSON line that holds its document")
      ->capture_default_str();
  app.add_option("--threads", options.threads, "Encoding threads (0: every core)")
      ->capture_default_str();
  app.add_option("--progress-seconds", options.progress_seconds,
                 "A progress line at most this often (0: none)")
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
    options.out_dir = out_dir;
    std::unique_ptr<loom::data::Tokenizer> tok;
    if (!vocab.empty())
      tok = std::make_unique<loom::data::Gpt2BpeTokenizer>(vocab, merges);
    else
      tok = loom::data::open_tokenizer(tokenizer.empty() ? "byte" : tokenizer);
    const auto s = loom::data::prepare_shards(*tok, options);
    spdlog::info(
        "{} files, {} documents, {} bytes of text -> {} tokens ({} tokenizer, vocab {}): {} "
        "train, {} val, in {}; {:.1f} s, {:.2f} MB/s",
        s.files, s.documents, s.text_bytes, s.tokens, tok->kind(), tok->vocab_size(),
        s.train_tokens, s.val_tokens, out_dir, s.seconds,
        s.seconds > 0 ? static_cast<double>(s.text_bytes) / 1e6 / s.seconds : 0.0);
  });
}
