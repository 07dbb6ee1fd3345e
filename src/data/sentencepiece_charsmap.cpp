#include "sentencepiece_charsmap.h"

#include <cstring>

#include "loom/core/error.h"

namespace loom::data {

namespace {

// A darts-clone unit: a leaf flag, a label (bit 31 set on value units, so no byte matches one),
// a value (on the unit a leaf flag points to) and the offset to the unit's children.
bool has_leaf(uint32_t unit) {
  return ((unit >> 8) & 1) != 0;
}
uint32_t value(uint32_t unit) {
  return unit & ((1U << 31) - 1);
}
uint32_t label(uint32_t unit) {
  return unit & ((1U << 31) | 0xFF);
}
uint32_t offset(uint32_t unit) {
  return (unit >> 10) << ((unit & (1U << 9)) >> 6);
}

}  // namespace

SentencePieceCharsMap::SentencePieceCharsMap(std::string_view blob, const std::string& where) {
  if (blob.empty()) return;
  LOOM_CHECK(blob.size() >= 4, "{}: precompiled character map of {} bytes is truncated", where,
             blob.size());
  uint32_t trie_bytes = 0;
  std::memcpy(&trie_bytes, blob.data(), 4);  // little endian, as x86 and the file are
  LOOM_CHECK(trie_bytes % 4 == 0 && trie_bytes >= 4 && trie_bytes <= blob.size() - 4,
             "{}: precompiled character map: a trie of {} bytes does not fit its {} bytes (a "
             "positive multiple of 4 up to the blob's size less 4)",
             where, trie_bytes, blob.size());
  units_.resize(trie_bytes / 4);
  std::memcpy(units_.data(), blob.data() + 4, trie_bytes);
  normalized_ = std::string(blob.substr(4 + trie_bytes));
  LOOM_CHECK(normalized_.empty() || normalized_.back() == '\0',
             "{}: precompiled character map: its replacement strings do not end in a NUL", where);
}

SentencePieceCharsMap::Match SentencePieceCharsMap::longest_prefix(std::string_view text) const {
  Match best;
  if (units_.empty()) return best;
  size_t node = offset(units_[0]);
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    node ^= c;
    if (node >= units_.size()) break;
    const uint32_t unit = units_[node];
    if (label(unit) != c) break;
    node ^= offset(unit);
    if (!has_leaf(unit)) continue;
    if (node >= units_.size()) break;
    const uint32_t at = value(units_[node]);
    LOOM_CHECK(at < normalized_.size(),
               "precompiled character map: a rule points at byte {} of {} bytes of replacements",
               at, normalized_.size());
    best = {i + 1, std::string_view(normalized_.c_str() + at)};
  }
  return best;
}

}  // namespace loom::data
