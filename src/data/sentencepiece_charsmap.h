#pragma once
// A SentencePiece normalizer's precompiled character map (NormalizerSpec.precompiled_charsmap,
// e.g. nmt_nfkc): a little-endian uint32 holding the size in bytes of a darts-clone double-array
// trie over UTF-8 byte strings, the trie's uint32 units, then NUL-terminated replacement strings
// the trie's values point into. Read without darts-clone: only the common-prefix search the
// library's normalizer runs. Internal to src/data.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

class SentencePieceCharsMap {
 public:
  // Empty: no map (the identity normalizer). A malformed blob is a loom::Error naming `where`.
  SentencePieceCharsMap() = default;
  SentencePieceCharsMap(std::string_view blob, const std::string& where);
  bool empty() const { return units_.empty(); }
  // The longest rule matching a prefix of `text`: the bytes it consumes (0: none) and what they
  // become.
  struct Match {
    size_t length = 0;
    std::string_view replacement;
  };
  Match longest_prefix(std::string_view text) const;

 private:
  std::vector<uint32_t> units_;
  std::string normalized_;  // the replacement strings, each NUL-terminated
};

}  // namespace loom::data
