// Tokenizer files from someone else: a Hugging Face tokenizer.json (input starting with '{') or
// a SentencePiece .model (anything else), then a text. What loads must encode any text into ids
// inside the vocabulary and decode them back without failing.
#include "fuzz_util.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/sentencepiece_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  const auto parts = fuzz::split_files(data, size, 2);
  const auto dir = fuzz::scratch_dir();
  const bool json = !parts[0].empty() && parts[0][0] == '{';
  const auto path = dir / (json ? "tokenizer.json" : "tokenizer.model");
  fuzz::write_bytes(path, parts[0]);
  std::unique_ptr<data::Tokenizer> tok;
  if (!fuzz::accepts([&] {
        if (json)
          tok = std::make_unique<data::HfTokenizer>(path);
        else
          tok = std::make_unique<data::SentencePieceTokenizer>(path);
      }))
    return 0;
  std::vector<int32_t> ids;
  // A vocabulary without <unk> or byte fallback may not cover the text: a refusal, not a crash.
  if (!fuzz::accepts([&] { ids = tok->encode(parts[1]); })) return 0;
  for (const auto id : ids)
    fuzz::require(id >= 0 && id < tok->vocab_size(), "encode gave an id outside the vocabulary");
  std::string text;
  fuzz::require(fuzz::accepts([&] { text = tok->decode(ids); }), "decode refused encode's ids");
  return 0;
}
