#pragma once
// Text -> llm.c token shards at scale: the engine of loom-prepare. Streaming (the tokens go to
// disk as they are made; memory is bounded by the documents in flight, not by the input), on
// every core (documents are encoded in parallel and written in input order, so the output does
// not depend on the thread count), from files, directories, globs and JSON lines.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom::data {

struct PrepareOptions {
  // Files, directories (every file below, in name order) and globs (`*`, `?` and `[...]` in the
  // last path component: the matching files in name order), named pipes, and "-" for standard
  // input (streams are read once, as they come). Each text file is one document; each line of a
  // JSON-lines file is one.
  std::vector<std::string> inputs;
  std::filesystem::path out_dir;
  double val_fraction = 0.1;  // the share of tokens, from the end, written to val.bin
  // "auto": JSON lines for *.jsonl / *.ndjson, text otherwise; or "text", "jsonl".
  std::string format = "auto";
  std::string text_field = "text";  // the field of each JSON line that holds the document
  int threads = 0;                  // 0: every core
  double progress_seconds = 10;     // a progress line at most this often (0: none)
};

struct PrepareStats {
  int64_t files = 0;
  int64_t documents = 0;
  int64_t text_bytes = 0;
  int64_t tokens = 0;  // document-start tokens included
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  double seconds = 0;
};

// Whether a path component holds a glob character (* ? [), as expand_inputs reads it.
bool has_glob(std::string_view s);

// The files `inputs` name, in order. Throws loom::Error naming an input that matches nothing.
std::vector<std::filesystem::path> expand_inputs(const std::vector<std::string>& inputs);

// Tokenizes every document (the tokenizer's document_start() before each), writes
// out_dir/train.bin and, when val_fraction > 0, out_dir/val.bin (llm.c shards at the version the
// vocabulary needs), and save_tokenizer_meta(). The ids equal encoding each document in turn on
// one thread. Throws loom::Error naming the file (and line) of unreadable input; nothing is
// left half-written.
PrepareStats prepare_shards(const Tokenizer& tokenizer, const PrepareOptions& options);

}  // namespace loom::data
