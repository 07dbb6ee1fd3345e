#include "loom/data/sentencepiece_tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <limits>
#include <unordered_map>

#include "bpe.h"
#include "loom/core/error.h"
#include "loom/core/files.h"
#include "sentencepiece_charsmap.h"
#include "utf8.h"

namespace loom::data {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// Piece types of sentencepiece_model.proto.
enum PieceType : int {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6
};

// A minimal protobuf wire-format reader: the fields ModelProto needs, unknown ones skipped.
class Wire {
 public:
  Wire(std::string_view bytes, const std::string& where) : s_(bytes), where_(where) {}
  bool done() const { return pos_ >= s_.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      LOOM_CHECK(pos_ < s_.size(), "{}: truncated protobuf (a varint runs past the end)", where_);
      const auto b = static_cast<unsigned char>(s_[pos_++]);
      v |= uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("{}: malformed protobuf varint at byte {}", where_, pos_);
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    LOOM_CHECK(n <= s_.size() - pos_, "{}: truncated protobuf (a field of {} bytes at byte {})",
               where_, n, pos_);
    const std::string_view out = s_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  float fixed32_float() {
    LOOM_CHECK(s_.size() - pos_ >= 4, "{}: truncated protobuf (a float at byte {})", where_, pos_);
    float f = 0;
    std::memcpy(&f, s_.data() + pos_, 4);
    pos_ += 4;
    return f;
  }
  void skip(int wire_type) {
    switch (wire_type) {
      case 0:
        varint();
        break;
      case 1:
        LOOM_CHECK(s_.size() - pos_ >= 8, "{}: truncated protobuf", where_);
        pos_ += 8;
        break;
      case 2:
        bytes();
        break;
      case 5:
        LOOM_CHECK(s_.size() - pos_ >= 4, "{}: truncated protobuf", where_);
        pos_ += 4;
        break;
      default:
        fail("{}: not a SentencePiece model (protobuf wire type {} at byte {})", where_, wire_type,
             pos_);
    }
  }

 private:
  std::string_view s_;
  size_t pos_ = 0;
  const std::string& where_;
};

struct TransparentHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace

struct SentencePieceTokenizer::State {
  fs::path path;
  std::string where;
  std::vector<std::string> pieces;
  std::vector<float> scores;
  std::vector<int> types;
  // Pieces a merge may produce (normal and user-defined), and every piece by text.
  std::unordered_map<std::string, int32_t, TransparentHash, std::equal_to<>> mergeable, by_text;
  std::vector<int32_t> user_defined;  // ids, longest text first
  std::array<int32_t, 256> byte_ids{};
  std::vector<int> piece_byte;  // the byte of each byte piece, -1 for the others
  int model_type = 1;
  bool byte_fallback = false, treat_whitespace_as_suffix = false;
  int32_t unk_id = 0, bos_id = 1;
  std::string unk_surface = " \xE2\x81\x87 ";
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
  SentencePieceCharsMap charsmap;  // empty: the identity normalizer
  // Unigram: the normal pieces' lowest and highest scores (as the library takes them), and the
  // longest piece in bytes.
  float min_score = 0, max_score = 0;
  size_t longest_piece = 0;

  void parse(std::string_view bytes);
  // The library's normalizer (normalizer.cc): each prefix mapped by the character map (the
  // longest rule; user-defined pieces pass as they are; malformed UTF-8 bytes become U+FFFD one
  // at a time), leading, trailing and repeated spaces dropped, the dummy-prefix space, spaces
  // escaped as U+2581.
  std::string normalize(std::string_view text) const;
  // One normalized prefix of `text`: what it becomes and how many bytes it consumes.
  std::pair<std::string_view, size_t> normalize_prefix(std::string_view text) const;
  std::vector<int32_t> encode_bpe(std::string_view norm) const;
  std::vector<int32_t> encode_unigram(std::string_view norm) const;
};

void SentencePieceTokenizer::State::parse(std::string_view bytes) {
  Wire model(bytes, where);
  std::string normalizer_name, charsmap, denormalizer_charsmap;
  while (!model.done()) {
    const uint64_t tag = model.varint();
    const int field = static_cast<int>(tag >> 3), wire = static_cast<int>(tag & 7);
    if (field == 1 && wire == 2) {
      Wire p(model.bytes(), where);
      std::string piece;
      float score = 0;
      int type = kNormal;
      while (!p.done()) {
        const uint64_t t = p.varint();
        const int f = static_cast<int>(t >> 3), w = static_cast<int>(t & 7);
        if (f == 1 && w == 2)
          piece = std::string(p.bytes());
        else if (f == 2 && w == 5)
          score = p.fixed32_float();
        else if (f == 3 && w == 0)
          type = static_cast<int>(p.varint());
        else
          p.skip(w);
      }
      pieces.push_back(std::move(piece));
      scores.push_back(score);
      types.push_back(type);
    } else if ((field == 2 || field == 3 || field == 5) && wire == 2) {
      Wire spec(model.bytes(), where);
      while (!spec.done()) {
        const uint64_t t = spec.varint();
        const int f = static_cast<int>(t >> 3), w = static_cast<int>(t & 7);
        const auto as_int = [&] {
          return static_cast<int32_t>(static_cast<int64_t>(spec.varint()));
        };
        if (field == 2 && w == 0 && f == 3)
          model_type = as_int();
        else if (field == 2 && w == 0 && f == 24)
          treat_whitespace_as_suffix = spec.varint() != 0;
        else if (field == 2 && w == 0 && f == 35)
          byte_fallback = spec.varint() != 0;
        else if (field == 2 && w == 0 && f == 40)
          unk_id = as_int();
        else if (field == 2 && w == 0 && f == 41)
          bos_id = as_int();
        else if (field == 2 && w == 2 && f == 44)
          unk_surface = std::string(spec.bytes());
        else if (field == 3 && w == 2 && f == 1)
          normalizer_name = std::string(spec.bytes());
        else if (field != 2 && w == 2 && f == 2)
          (field == 3 ? charsmap : denormalizer_charsmap) = std::string(spec.bytes());
        else if (field == 3 && w == 0 && f == 3)
          add_dummy_prefix = spec.varint() != 0;
        else if (field == 3 && w == 0 && f == 4)
          remove_extra_whitespaces = spec.varint() != 0;
        else if (field == 3 && w == 0 && f == 5)
          escape_whitespaces = spec.varint() != 0;
        else
          spec.skip(w);
      }
    } else {
      model.skip(wire);
    }
  }
  LOOM_CHECK(!pieces.empty(), "{}: not a SentencePiece model (no pieces)", where);
  LOOM_CHECK(model_type == 1 || model_type == 2,
             "{}: SentencePiece model type {} is not supported: loom reads unigram (1) and BPE "
             "(2) models (3 word and 4 char are not)",
             where, model_type);
  // A denormalizer (decode-time map) changes what decode gives; none of the library's presets
  // has one.
  LOOM_CHECK(denormalizer_charsmap.empty(),
             "{}: the model has a denormalizer character map, which loom does not apply", where);
  this->charsmap = SentencePieceCharsMap(charsmap, where);
  LOOM_CHECK(!treat_whitespace_as_suffix, "{}: treat_whitespace_as_suffix is not supported", where);
  const auto n = static_cast<int32_t>(pieces.size());
  LOOM_CHECK(unk_id >= 0 && unk_id < n, "{}: unk_id {} is outside the {} pieces", where, unk_id, n);
  byte_ids.fill(-1);
  piece_byte.assign(pieces.size(), -1);
  for (int32_t id = 0; id < n; ++id) {
    LOOM_CHECK(!pieces[id].empty(), "{}: piece {} is empty", where, id);
    by_text.try_emplace(pieces[id], id);
    if (types[id] == kNormal || types[id] == kUserDefined) mergeable.try_emplace(pieces[id], id);
    if (types[id] == kUserDefined) user_defined.push_back(id);
    if (types[id] == kByte) {
      const int value = utf8::byte_piece_value(pieces[id]);
      LOOM_CHECK(value >= 0, "{}: piece {} '{}' is a byte piece but not of the form <0xHH>", where,
                 id, pieces[id]);
      byte_ids[value] = id;
      piece_byte[id] = value;
    }
  }
  std::stable_sort(user_defined.begin(), user_defined.end(),
                   [&](int32_t a, int32_t b) { return pieces[a].size() > pieces[b].size(); });
  // The library's initial values (FLT_MAX, and FLT_MIN: the smallest positive float, so a
  // user-defined piece scores about -0.1 whatever its length).
  min_score = std::numeric_limits<float>::max();
  max_score = std::numeric_limits<float>::min();
  for (int32_t id = 0; id < n; ++id) {
    if (types[id] == kNormal) {
      min_score = std::min(min_score, scores[id]);
      max_score = std::max(max_score, scores[id]);
    }
    longest_piece = std::max(longest_piece, pieces[id].size());
  }
}

std::pair<std::string_view, size_t> SentencePieceTokenizer::State::normalize_prefix(
    std::string_view text) const {
  for (int32_t id : user_defined)
    if (text.starts_with(pieces[id])) return {text.substr(0, pieces[id].size()), pieces[id].size()};
  const auto match = charsmap.longest_prefix(text);
  if (match.length > 0) return {match.replacement, match.length};
  const auto c = utf8::at(text, 0);
  if (c.cp < 0) return {"\xEF\xBF\xBD", 1};  // U+FFFD for one malformed byte
  return {text.substr(0, c.size), c.size};
}

std::string SentencePieceTokenizer::State::normalize(std::string_view text) const {
  if (remove_extra_whitespaces) {
    while (!text.empty()) {
      const auto [out, consumed] = normalize_prefix(text);
      if (out != " ") break;
      text.remove_prefix(consumed);
    }
  }
  if (text.empty()) return {};
  const std::string_view space = escape_whitespaces ? kSpaceSymbol : std::string_view(" ");
  std::string out;
  out.reserve(text.size() + 8);
  if (add_dummy_prefix) out += space;
  bool previous_space = remove_extra_whitespaces;
  while (!text.empty()) {
    auto [piece, consumed] = normalize_prefix(text);
    if (previous_space)
      while (piece.starts_with(' ')) piece.remove_prefix(1);
    if (!piece.empty()) {
      for (char c : piece) {
        if (c == ' ')
          out += space;
        else
          out.push_back(c);
      }
      previous_space = piece.ends_with(' ');
    }
    text.remove_prefix(consumed);
    if (!remove_extra_whitespaces) previous_space = false;
  }
  if (remove_extra_whitespaces)
    while (std::string_view(out).ends_with(space)) out.erase(out.size() - space.size());
  return out;
}

SentencePieceTokenizer::SentencePieceTokenizer(const fs::path& model_file)
    : state_(std::make_unique<State>()) {
  state_->path = model_file;
  state_->where = model_file.string();
  LOOM_CHECK(fs::is_regular_file(model_file), "cannot open SentencePiece model {}",
             model_file.string());
  state_->parse(core::read_file(model_file));
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

int64_t SentencePieceTokenizer::vocab_size() const {
  return static_cast<int64_t>(state_->pieces.size());
}

std::optional<int32_t> SentencePieceTokenizer::document_start() const {
  const int32_t id = state_->bos_id;
  if (id < 0 || id >= static_cast<int32_t>(state_->pieces.size())) return std::nullopt;
  return id;
}

std::vector<Tokenizer::File> SentencePieceTokenizer::files() const {
  return {{state_->path, "tokenizer.model"}};
}

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  const std::string normalized = state_->normalize(text);
  return state_->model_type == 1 ? state_->encode_unigram(normalized)
                                 : state_->encode_bpe(normalized);
}

// The library's optimized Viterbi (unigram_model.cc): the best-scoring segmentation into normal
// and user-defined pieces (a user-defined piece scores length x max_score - 0.1), a character no
// piece starts with as one unknown node of score min_score - 10 (a run of them one <unk>, or
// their bytes under byte fallback); scores summed along each path in float, ties to the
// segmentation found first. In long documents (path scores past ~1e5, where float's spacing is
// ~0.01) the library was seen to keep the other of two equal-scoring segmentations (docs/data.md).
std::vector<int32_t> SentencePieceTokenizer::State::encode_unigram(std::string_view norm) const {
  struct Best {
    int32_t id = -1;
    float score = 0;
    int64_t starts_at = -1;
  };
  const size_t size = norm.size();
  std::vector<Best> ends_at(size + 1);
  const float unk_score = min_score - 10.0f;
  for (size_t start = 0; start < size;) {
    const float till_here = ends_at[start].score;
    // The library's character length: from the lead byte alone.
    const size_t char_len = std::min<size_t>(
        "\1\1\1\1\1\1\1\1\1\1\1\1\2\2\3\4"[static_cast<unsigned char>(norm[start]) >> 4],
        size - start);
    bool single = false;
    for (size_t len = 1; len <= std::min(longest_piece, size - start); ++len) {
      const auto it = by_text.find(norm.substr(start, len));
      if (it == by_text.end()) continue;
      const int32_t id = it->second;
      if (types[id] != kNormal && types[id] != kUserDefined) continue;
      Best& target = ends_at[start + len];
      const float score = types[id] == kUserDefined
                              ? static_cast<float>(static_cast<float>(len) * max_score - 0.1)
                              : scores[id];
      const float candidate = score + till_here;
      if (target.starts_at < 0 || candidate > target.score)
        target = {id, candidate, static_cast<int64_t>(start)};
      single = single || len == char_len;
    }
    if (!single) {
      Best& target = ends_at[start + char_len];
      const float score = unk_score + till_here;
      if (target.starts_at < 0 || score > target.score)
        target = {unk_id, score, static_cast<int64_t>(start)};
    }
    start += char_len;
  }
  std::vector<int32_t> ids;
  for (size_t end = size; end > 0;) {
    const Best& node = ends_at[end];
    const auto start = static_cast<size_t>(node.starts_at);
    if (node.id == unk_id && byte_fallback) {
      // Byte fallback: the unknown piece as its UTF-8 bytes, backwards like the path.
      for (size_t b = end; b > start; --b) {
        const int32_t byte_id = byte_ids[static_cast<unsigned char>(norm[b - 1])];
        ids.push_back(byte_id >= 0 ? byte_id : unk_id);  // a byte the model lacks: <unk>
      }
    } else if (node.id != unk_id || ids.empty() || ids.back() != unk_id) {
      ids.push_back(node.id);  // a run of unknown characters is one <unk>, as the library gives
    }
    end = start;
  }
  std::reverse(ids.begin(), ids.end());
  return ids;
}

std::vector<int32_t> SentencePieceTokenizer::State::encode_bpe(std::string_view norm) const {
  const State& s = *this;
  // Characters, with user-defined pieces taken whole (longest first) and frozen.
  std::vector<BpeSymbol> symbols;
  for (size_t pos = 0; pos < norm.size();) {
    bool user = false;
    for (int32_t id : s.user_defined) {
      if (norm.compare(pos, s.pieces[id].size(), s.pieces[id]) == 0) {
        symbols.push_back({static_cast<uint32_t>(pos),
                           static_cast<uint32_t>(pos + s.pieces[id].size()), id, true});
        pos += s.pieces[id].size();
        user = true;
        break;
      }
    }
    if (user) continue;
    const auto c = utf8::at(norm, pos);
    const auto it = s.mergeable.find(norm.substr(pos, c.size));
    symbols.push_back({static_cast<uint32_t>(pos), static_cast<uint32_t>(pos + c.size),
                       it == s.mergeable.end() ? -1 : it->second});
    pos += c.size;
  }
  bpe_merge(symbols, [&](const BpeSymbol& l, const BpeSymbol& r) -> std::optional<BpeMerge> {
    const auto it = s.mergeable.find(norm.substr(l.begin, r.end - l.begin));
    if (it == s.mergeable.end()) return std::nullopt;
    return BpeMerge{-static_cast<double>(s.scores[it->second]), it->second};
  });
  std::vector<int32_t> ids;
  ids.reserve(symbols.size());
  for (const BpeSymbol& sym : symbols) {
    int32_t id = sym.id;
    if (id < 0) {
      const auto it = s.by_text.find(norm.substr(sym.begin, sym.end - sym.begin));
      if (it != s.by_text.end()) id = it->second;
    }
    if (id >= 0) {
      ids.push_back(id);
      continue;
    }
    bool bytes_found = s.byte_fallback;
    for (uint32_t b = sym.begin; bytes_found && b < sym.end; ++b)
      bytes_found = s.byte_ids[static_cast<unsigned char>(norm[b])] >= 0;
    if (bytes_found) {
      for (uint32_t b = sym.begin; b < sym.end; ++b)
        ids.push_back(s.byte_ids[static_cast<unsigned char>(norm[b])]);
    } else if (ids.empty() || ids.back() != s.unk_id) {
      ids.push_back(s.unk_id);  // a run of unknown pieces is one <unk>, as the library gives
    }
  }
  return ids;
}

std::string SentencePieceTokenizer::decode(const std::vector<int32_t>& ids) const {
  const State& s = *state_;
  std::string text, bytes;
  // The dummy prefix's space is dropped once, from the first piece that starts with one while
  // nothing has been written yet (the library's is_bos_ws / bos_ws_seen).
  bool is_bos_ws = true, bos_ws_seen = false;
  const auto flush_bytes = [&] {
    // Each byte that does not begin a valid character decodes to U+FFFD, as the library does.
    for (size_t pos = 0; pos < bytes.size();) {
      const auto c = utf8::at(bytes, pos);
      text += c.cp < 0 ? std::string("\xEF\xBF\xBD") : bytes.substr(pos, c.size);
      pos += c.size;
    }
    bytes.clear();
  };
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    LOOM_CHECK(id >= 0 && id < static_cast<int32_t>(s.pieces.size()),
               "SentencePieceTokenizer::decode: id {} at position {} is not a piece of {} ({} "
               "pieces)",
               id, i, s.where, s.pieces.size());
    const int type = s.types[id];
    if (type == kByte) {
      bytes.push_back(static_cast<char>(s.piece_byte[id]));
      continue;
    }
    flush_bytes();
    if (bos_ws_seen || !text.empty()) is_bos_ws = false;
    bos_ws_seen = false;
    if (type == kControl) continue;
    if (type == kUnknown) {
      text += s.unk_surface;
      continue;
    }
    std::string_view piece = s.pieces[id];
    if (is_bos_ws && (s.add_dummy_prefix || s.remove_extra_whitespaces) &&
        piece.starts_with(kSpaceSymbol)) {
      piece.remove_prefix(kSpaceSymbol.size());
      bos_ws_seen = !s.remove_extra_whitespaces;
    }
    for (size_t pos = 0; pos < piece.size();) {
      if (piece.compare(pos, kSpaceSymbol.size(), kSpaceSymbol) == 0) {
        text.push_back(' ');
        pos += kSpaceSymbol.size();
      } else {
        text.push_back(piece[pos++]);
      }
    }
  }
  flush_bytes();
  return text;
}

}  // namespace loom::data
