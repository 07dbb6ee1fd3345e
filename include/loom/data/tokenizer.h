#pragma once
// Tokenizers: text <-> token ids. Torch-free on purpose (used by loom-prepare, loom-generate).
//
// Four kinds ship:
//  - ByteTokenizer: one token per byte (vocab 256). The default; needs no files.
//  - Gpt2BpeTokenizer: GPT-2's byte-level BPE, from a Hugging Face style `vocab.json`
//    (token string -> id) and `merges.txt` (one "a b" merge per line, by rank).
//  - HfTokenizer (hf_tokenizer.h): a Hugging Face `tokenizer.json` with a BPE model.
//  - SentencePieceTokenizer (sentencepiece_tokenizer.h): a SentencePiece `.model` file (BPE).
// open_tokenizer() picks one from a path; save_tokenizer_meta/load_tokenizer keep it with the
// data (and checkpoints) it tokenized.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  // Short name stored in a data directory's meta.json: "byte", "gpt2-bpe", "hf-json" or
  // "sentencepiece".
  virtual std::string kind() const = 0;
  // The id loom-prepare puts before each document (BOS, or GPT-2's <|endoftext|>), if any.
  virtual std::optional<int32_t> document_start() const { return std::nullopt; }
  // The files this tokenizer was read from, and the names they take in a data directory (or a
  // checkpoint), where load_tokenizer finds them.
  struct File {
    std::filesystem::path source;
    std::string name;
  };
  virtual std::vector<File> files() const { return {}; }
};

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return 256; }
  std::string kind() const override { return "byte"; }
};

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  // Throws loom::Error naming the file and line when either file is missing or malformed.
  Gpt2BpeTokenizer(const std::filesystem::path& vocab_json,
                   const std::filesystem::path& merges_txt);
  ~Gpt2BpeTokenizer() override;
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override;
  std::string kind() const override { return "gpt2-bpe"; }
  // The id of "<|endoftext|>" when the vocabulary has it.
  std::optional<int32_t> document_start() const override;
  std::vector<File> files() const override;

  static constexpr std::string_view kEndOfText = "<|endoftext|>";

 private:
  void encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const;
  struct State;
  std::unique_ptr<State> state_;
};

// Writes `dir/meta.json` ({"tokenizer": kind, "vocab_size": N}) and copies the tokenizer's
// files() into `dir`, so the data directory is self-describing.
void save_tokenizer_meta(const Tokenizer& tok, const std::filesystem::path& dir);
// Copies the tokenizer's files() into `dir`, under their names there (nothing to copy for bytes).
void copy_tokenizer_files(const Tokenizer& tok, const std::filesystem::path& dir);
// Puts what transformers' AutoTokenizer.from_pretrained needs into a Hugging Face model
// directory: the tokenizer's files and, for a tokenizer.json that came without one, a
// tokenizer_config.json naming its document-start token as the BOS. Bytes have no Hugging Face
// tokenizer: nothing is written for them.
void export_tokenizer_for_hf(const Tokenizer& tok, const std::filesystem::path& dir);
// Reads what save_tokenizer_meta wrote. A directory without meta.json means "byte".
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& dir);
// The document-start id a document mask (--doc-mask) splits windows at: tok.document_start(),
// or a loom::Error naming the tokenizer's kind and `dir` (where it came from) when it has none.
int32_t document_start_for_mask(const Tokenizer& tok, const std::filesystem::path& dir);
// The names a data directory may hold for its tokenizer (meta.json and every kind's files).
std::vector<std::string> tokenizer_file_names();

// A tokenizer from what a user names: "byte"; a tokenizer.json (any *.json); a SentencePiece
// model (any other file); or a directory holding tokenizer.json, tokenizer.model, or
// vocab.json + merges.txt (looked for in that order). Errors name the path and what was found.
std::unique_ptr<Tokenizer> open_tokenizer(const std::filesystem::path& path);

}  // namespace loom::data
