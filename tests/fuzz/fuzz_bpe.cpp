// GPT-2 BPE files from someone else: vocab.json, merges.txt, then a text to encode. What loads
// must encode any text into ids inside the vocabulary and decode them back without failing.
#include "fuzz_util.h"
#include "loom/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  const auto parts = fuzz::split_files(data, size, 3);
  const auto dir = fuzz::scratch_dir();
  fuzz::write_bytes(dir / "vocab.json", parts[0]);
  fuzz::write_bytes(dir / "merges.txt", parts[1]);
  std::unique_ptr<data::Gpt2BpeTokenizer> tok;
  if (!fuzz::accepts([&] {
        tok = std::make_unique<data::Gpt2BpeTokenizer>(dir / "vocab.json", dir / "merges.txt");
      }))
    return 0;
  std::vector<int32_t> ids;
  // A vocabulary may lack tokens the text needs: that is a refusal, not a crash.
  if (!fuzz::accepts([&] { ids = tok->encode(parts[2]); })) return 0;
  for (const auto id : ids)
    fuzz::require(id >= 0 && id < tok->vocab_size(), "encode gave an id outside the vocabulary");
  std::string text;
  fuzz::require(fuzz::accepts([&] { text = tok->decode(ids); }), "decode refused encode's ids");
  return 0;
}
