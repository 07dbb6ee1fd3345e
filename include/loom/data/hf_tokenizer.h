#pragma once
// A Hugging Face `tokenizer.json` with a BPE model: the byte-level kind (GPT-2, Llama 3, Qwen,
// Mistral's Tekken-style) and the SentencePiece-style kind (Metaspace or Prepend + Replace,
// byte fallback: Llama 2, Mistral 7B). Ids equal those of the `tokenizers` library's
// `encode(text, add_special_tokens=False)`; decode equals its `decode(ids)`.
//
// Read from the file: normalizer (Sequence, Prepend, Replace, Strip), pre-tokenizer (Sequence,
// Split with a String or Regex pattern and any behaviour, ByteLevel, Metaspace, Digits), model
// (BPE: vocab, merges in either form, byte_fallback, unk_token, fuse_unk, ignore_merges),
// added tokens (matched in the text before the model, as the library does; lstrip, rstrip,
// single_word, normalized), decoder (Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip,
// Metaspace). Anything else is refused at load with the file and the component named.
#include <filesystem>
#include <memory>

#include "loom/data/tokenizer.h"

namespace loom::data {

class HfTokenizer final : public Tokenizer {
 public:
  // The document-start token is, in this order: `bos_token` in a tokenizer_config.json beside
  // the file, the first special token of the post-processor's single-sequence template, or the
  // first added token named <|begin_of_text|>, <s>, <bos>, <|startoftext|> or <|endoftext|>.
  explicit HfTokenizer(const std::filesystem::path& tokenizer_json);
  ~HfTokenizer() override;
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override;
  std::string kind() const override { return "hf-json"; }
  std::optional<int32_t> document_start() const override;
  std::vector<File> files() const override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace loom::data
