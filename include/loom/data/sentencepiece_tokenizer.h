#pragma once
// A SentencePiece `.model` file (the protobuf ModelProto, read without protobuf) with a BPE
// model (Llama 2, Mistral 7B and their relatives) or a unigram model (T5, ALBERT, XLNet and the
// library's default), with the identity normalizer or a precompiled character map (the
// library's nmt_nfkc, nfkc and the like). Ids equal the `sentencepiece` library's
// `encode(text)`; decode equals its `decode(ids)`.
//
// Encoding as the library does: the text normalized (the character map's longest rule at each
// position, user-defined pieces left as they are; optional collapse of extra spaces, a
// dummy-prefix space, spaces escaped as U+2581); then BPE: user-defined pieces matched first and
// kept whole, pieces merged pairwise by highest score (ties to the left), unknown pieces as
// UTF-8 byte pieces <0xXX> under byte fallback or else one <unk> per run; or unigram: the
// best-scoring segmentation (Viterbi), a character no piece covers as <unk>, or its bytes under
// byte fallback. Word and char models and denormalizer maps are refused with the file named.
#include <filesystem>
#include <memory>

#include "loom/data/tokenizer.h"

namespace loom::data {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& model_file);
  ~SentencePieceTokenizer() override;
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override;
  std::string kind() const override { return "sentencepiece"; }
  // The model's bos_id (its trainer spec), unless disabled (-1).
  std::optional<int32_t> document_start() const override;
  std::vector<File> files() const override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace loom::data
