#include "loom/data/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <system_error>
#include <unordered_map>
#include <utility>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/data/hf_tokenizer.h"
#include "loom/data/sentencepiece_tokenizer.h"
#include "utf8.h"

namespace loom::data {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// ByteTokenizer

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (char c : text) {
    ids.push_back(static_cast<unsigned char>(c));
  }
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    LOOM_CHECK(ids[i] >= 0 && ids[i] <= 255,
               "ByteTokenizer::decode: id {} at position {} is outside the byte range 0..255",
               ids[i], i);
    text.push_back(static_cast<char>(ids[i]));
  }
  return text;
}

// ---------------------------------------------------------------------------------------------
// UTF-8 and character classes for GPT-2's pre-tokenizer

namespace {

enum class CharClass { kLetter, kNumber, kSpace, kOther };

struct CodePointRange {
  int32_t first, last;
  CharClass cls;
};

// Non-ASCII ranges of \p{L}, \p{N} and \s, generated from the `regex` module that GPT-2 and
// Hugging Face use (scripts/gen-unicode-classes), so pre-tokenization matches theirs exactly.
constexpr CodePointRange kUnicodeClasses[] = {
#include "unicode_classes.inc"
};

// The classes GPT-2's regex distinguishes: \p{L}, \p{N}, \s and everything else.
// Invalid UTF-8 bytes (cp == -1) count as letters: they cannot occur in GPT-2's (Unicode) input,
// and this keeps each one inside a word, where the byte-level vocabulary encodes it.
CharClass classify(int32_t cp) {
  if (cp >= 0 && cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) {
      return CharClass::kLetter;
    }
    if (cp >= '0' && cp <= '9') {
      return CharClass::kNumber;
    }
    if (cp == ' ' || (cp >= '\t' && cp <= '\r')) {
      return CharClass::kSpace;
    }
    return CharClass::kOther;
  }
  if (cp < 0) return CharClass::kLetter;
  const auto* end = std::end(kUnicodeClasses);
  const auto* it = std::upper_bound(std::begin(kUnicodeClasses), end, cp,
                                    [](int32_t c, const CodePointRange& r) { return c < r.first; });
  if (it == std::begin(kUnicodeClasses)) return CharClass::kOther;
  --it;
  return cp <= it->last ? it->cls : CharClass::kOther;
}

CharClass class_at(std::string_view s, size_t pos) {
  return classify(utf8::at(s, pos).cp);
}

// Length of the contraction ('s 't 're 've 'm 'll 'd, case-sensitive like GPT-2) at the start
// of `s`, or 0.
size_t contraction_size(std::string_view s) {
  if (s.size() < 2 || s[0] != '\'') {
    return 0;
  }
  if (s[1] == 's' || s[1] == 't' || s[1] == 'm' || s[1] == 'd') {
    return 2;
  }
  const std::string_view two = s.substr(1, 2);
  return two == "re" || two == "ve" || two == "ll" ? 3 : 0;
}

// Splits text the way GPT-2's pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// does, trying the alternatives in that order at each position.
std::vector<std::string_view> pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = pos + contraction_size(text.substr(pos));
    if (end == pos) {
      // " ?X+": one optional ASCII space, then a run of letters, numbers or "other".
      size_t body = pos;
      if (text[pos] == ' ' && pos + 1 < text.size() &&
          class_at(text, pos + 1) != CharClass::kSpace) {
        body = pos + 1;
      }
      const CharClass cls = class_at(text, body);
      end = body;
      size_t last = body;  // start of the run's last code point
      while (end < text.size()) {
        const utf8::CodePoint c = utf8::at(text, end);
        if (classify(c.cp) != cls) {
          break;
        }
        last = end;
        end += c.size;
      }
      // "\s+(?!\S)" gives the last space of a run that precedes a non-space to the next
      // piece (as its " ?" prefix); "\s+" takes the run whole when it is one space long.
      if (cls == CharClass::kSpace && end < text.size() && last > pos) {
        end = last;
      }
    }
    pieces.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  return pieces;
}

std::array<int32_t, 256> byte_to_code_point() {
  std::array<int32_t, 256> table{};
  for (int b = 0; b < 256; ++b) table[b] = utf8::byte_level_code_point(static_cast<uint8_t>(b));
  return table;
}

// Reads an integer JSON value into int32 range [0, INT32_MAX]; false when it is not one.
bool to_id(const json& value, int32_t& id) {
  if (value.is_number_unsigned()) {
    if (value.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX)) {
      return false;
    }
  } else if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
             value.get<int64_t>() > INT32_MAX) {
    return false;
  }
  id = static_cast<int32_t>(value.get<int64_t>());
  return true;
}

json read_json(const fs::path& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in.is_open(), "cannot open {} file {}", what, path.string());
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("{} file {} is not valid JSON: {}", what, path.string(), e.what());
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Gpt2BpeTokenizer

struct Gpt2BpeTokenizer::State {
  // Merges work on interned symbols: symbol ids index `symbols`, and a merge of two symbols
  // yields the symbol of their concatenated string (so "ab"+"c" and "a"+"bc" meet).
  std::vector<std::string> symbols;
  std::unordered_map<std::string, int32_t> symbol_ids;
  std::array<int32_t, 256> byte_symbol{};  // symbol id of each raw byte
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  std::unordered_map<uint64_t, Merge> merges;  // key: (left symbol << 32) | right symbol
  std::vector<int32_t> symbol_token;           // vocab id of each symbol, -1 if not in vocab

  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<int32_t, std::string> id_to_token;
  int64_t vocab_size = 0;
  std::unordered_map<int32_t, uint8_t> code_point_byte;  // inverse of bytes_to_unicode
  std::filesystem::path vocab_path, merges_path;

  // Pre-token bytes -> token ids. Bounded so a large corpus cannot grow it without limit;
  // the transparent hash lets encode() look pieces up without copying them.
  struct PieceHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  static constexpr size_t kMaxCacheEntries = size_t{1} << 20;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>, PieceHash, std::equal_to<>> cache;

  int32_t intern(const std::string& symbol) {
    const auto [it, inserted] =
        symbol_ids.try_emplace(symbol, static_cast<int32_t>(symbols.size()));
    if (inserted) {
      symbols.push_back(symbol);
    }
    return it->second;
  }

  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right);
  }

  // Byte-pair encoding of one pre-token, as in GPT-2's encoder.py: repeatedly merge every
  // occurrence (left to right) of the adjacent pair with the lowest merge rank.
  std::vector<int32_t> bpe(std::string_view piece) const {
    std::vector<int32_t> word;
    word.reserve(piece.size());
    for (char c : piece) {
      word.push_back(byte_symbol[static_cast<unsigned char>(c)]);
    }
    while (word.size() > 1) {
      const Merge* best = nullptr;
      uint64_t best_key = 0;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const uint64_t key = pair_key(word[i], word[i + 1]);
        const auto it = merges.find(key);
        if (it != merges.end() && (best == nullptr || it->second.rank < best->rank)) {
          best = &it->second;
          best_key = key;
        }
      }
      if (best == nullptr) {
        break;
      }
      std::vector<int32_t> merged;
      merged.reserve(word.size());
      for (size_t i = 0; i < word.size(); ++i) {
        if (i + 1 < word.size() && pair_key(word[i], word[i + 1]) == best_key) {
          merged.push_back(best->result);
          ++i;
        } else {
          merged.push_back(word[i]);
        }
      }
      word = std::move(merged);
    }
    std::vector<int32_t> ids;
    ids.reserve(word.size());
    for (int32_t symbol : word) {
      LOOM_CHECK(symbol_token[symbol] >= 0,
                 "Gpt2BpeTokenizer::encode: token '{}' (after merges) is not in the vocabulary",
                 symbols[symbol]);
      ids.push_back(symbol_token[symbol]);
    }
    return ids;
  }
};

Gpt2BpeTokenizer::Gpt2BpeTokenizer(const fs::path& vocab_json, const fs::path& merges_txt)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.vocab_path = vocab_json;
  s.merges_path = merges_txt;
  const std::array<int32_t, 256> code_points = byte_to_code_point();
  for (int b = 0; b < 256; ++b) {
    std::string symbol;
    utf8::append(symbol, code_points[b]);
    s.byte_symbol[b] = s.intern(symbol);
    s.code_point_byte[code_points[b]] = static_cast<uint8_t>(b);
  }

  const json vocab = read_json(vocab_json, "vocab");
  LOOM_CHECK(vocab.is_object(), "vocab file {} must hold a JSON object of token -> id, not {}",
             vocab_json.string(), vocab.type_name());
  for (const auto& [token, value] : vocab.items()) {
    int32_t id = 0;
    LOOM_CHECK(to_id(value, id),
               "vocab file {}: token '{}' has id {}, expected an integer in 0..{}",
               vocab_json.string(), token, value.dump(), INT32_MAX);
    const auto [it, inserted] = s.id_to_token.emplace(id, token);
    LOOM_CHECK(inserted, "vocab file {}: tokens '{}' and '{}' share id {}", vocab_json.string(),
               it->second, token, id);
    s.vocab.emplace(token, id);
    // The embedding table needs max id + 1 rows, which is the token count when ids are dense.
    s.vocab_size = std::max<int64_t>(s.vocab_size, int64_t{id} + 1);
  }

  std::ifstream merges(merges_txt, std::ios::binary);
  LOOM_CHECK(merges.is_open(), "cannot open merges file {}", merges_txt.string());
  std::string line;
  int32_t rank = 0;
  for (size_t line_no = 1; std::getline(merges, line); ++line_no) {
    if (!line.empty() && line.back() == '\r') {
      line.pop_back();
    }
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) {
      continue;
    }
    const size_t space = line.find(' ');
    LOOM_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                   line.find(' ', space + 1) == std::string::npos,
               "merges file {}:{}: malformed line '{}', expected two symbols separated by one "
               "space",
               merges_txt.string(), line_no, line);
    const int32_t left = s.intern(line.substr(0, space));
    const int32_t right = s.intern(line.substr(space + 1));
    const int32_t result = s.intern(line.substr(0, space) + line.substr(space + 1));
    // A repeated pair takes its later rank, as in the reference's dict of merges.
    s.merges.insert_or_assign(State::pair_key(left, right), State::Merge{rank++, result});
  }
  LOOM_CHECK(!merges.bad(), "error reading merges file {}", merges_txt.string());

  s.symbol_token.assign(s.symbols.size(), -1);
  for (size_t i = 0; i < s.symbols.size(); ++i) {
    const auto it = s.vocab.find(s.symbols[i]);
    if (it != s.vocab.end()) {
      s.symbol_token[i] = it->second;
    }
  }
}

Gpt2BpeTokenizer::~Gpt2BpeTokenizer() = default;

int64_t Gpt2BpeTokenizer::vocab_size() const {
  return state_->vocab_size;
}

std::vector<Tokenizer::File> Gpt2BpeTokenizer::files() const {
  return {{state_->vocab_path, "vocab.json"}, {state_->merges_path, "merges.txt"}};
}

std::optional<int32_t> Gpt2BpeTokenizer::document_start() const {
  const auto it = state_->vocab.find(std::string(kEndOfText));
  if (it == state_->vocab.end()) return std::nullopt;
  return it->second;
}

std::vector<int32_t> Gpt2BpeTokenizer::encode(std::string_view text) const {
  // "<|endoftext|>" in the text is the special token (as in Hugging Face's GPT2Tokenizer),
  // not characters to merge, when the vocabulary has it.
  const auto eot = document_start();
  std::vector<int32_t> ids;
  while (true) {
    const size_t at = eot ? text.find(kEndOfText) : std::string_view::npos;
    encode_ordinary(text.substr(0, at), ids);
    if (at == std::string_view::npos) break;
    ids.push_back(*eot);
    text.remove_prefix(at + kEndOfText.size());
  }
  return ids;
}

void Gpt2BpeTokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& ids) const {
  const State& s = *state_;
  for (const std::string_view piece : pretokenize(text)) {
    {
      std::lock_guard lock(s.cache_mutex);
      const auto it = s.cache.find(piece);
      if (it != s.cache.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        continue;
      }
    }
    // Merge outside the lock so threads encoding different words do not wait on each other.
    std::vector<int32_t> piece_ids = s.bpe(piece);
    ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
    std::lock_guard lock(s.cache_mutex);
    if (s.cache.size() >= State::kMaxCacheEntries) {
      s.cache.clear();
    }
    s.cache.emplace(piece, std::move(piece_ids));
  }
}

std::string Gpt2BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  const State& s = *state_;
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto token = s.id_to_token.find(ids[i]);
    LOOM_CHECK(token != s.id_to_token.end(),
               "Gpt2BpeTokenizer::decode: id {} at position {} is not in the vocabulary (size {})",
               ids[i], i, s.vocab_size);
    const std::string& text = token->second;
    for (size_t pos = 0; pos < text.size();) {
      const utf8::CodePoint c = utf8::at(text, pos);
      const auto byte = s.code_point_byte.find(c.cp);
      LOOM_CHECK(byte != s.code_point_byte.end(),
                 "Gpt2BpeTokenizer::decode: token '{}' (id {}) has a character outside GPT-2's "
                 "byte alphabet",
                 text, ids[i]);
      bytes.push_back(static_cast<char>(byte->second));
      pos += c.size;
    }
  }
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// meta.json

void save_tokenizer_meta(const Tokenizer& tok, const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  LOOM_CHECK(!ec, "cannot create data directory {}: {}", dir.string(), ec.message());
  const std::vector<Tokenizer::File> files = tok.files();
  // Files of another kind left by an earlier run in the same directory must not describe it.
  for (const std::string& name : tokenizer_file_names()) {
    const bool ours = std::any_of(files.begin(), files.end(),
                                  [&](const Tokenizer::File& f) { return f.name == name; });
    if (!ours && name != "meta.json") fs::remove(dir / name, ec);
  }
  copy_tokenizer_files(tok, dir);
  json meta = {{"tokenizer", tok.kind()}, {"vocab_size", tok.vocab_size()}};
  if (const auto start = tok.document_start()) meta["document_start"] = *start;
  core::write_file_atomic(dir / "meta.json", meta.dump(2) + "\n");
}

void copy_tokenizer_files(const Tokenizer& tok, const fs::path& dir) {
  std::error_code ec;
  for (const auto& [from, name] : tok.files()) {
    const fs::path to = dir / name;
    // Re-saving into the directory the tokenizer was loaded from: nothing to copy, and
    // copy_file would refuse to overwrite a file with itself.
    if (fs::exists(to) && fs::equivalent(from, to, ec)) continue;
    fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
    LOOM_CHECK(!ec, "cannot copy {} to {}: {}", from.string(), to.string(), ec.message());
  }
}

void export_tokenizer_for_hf(const Tokenizer& tok, const fs::path& dir) {
  copy_tokenizer_files(tok, dir);
  const auto files = tok.files();
  const bool has_config = std::any_of(files.begin(), files.end(), [](const Tokenizer::File& f) {
    return f.name == "tokenizer_config.json";
  });
  if (tok.kind() != "hf-json" || has_config) return;
  json config = {{"tokenizer_class", "PreTrainedTokenizerFast"}};
  if (const auto start = tok.document_start()) config["bos_token"] = tok.decode({*start});
  core::write_file_atomic(dir / "tokenizer_config.json", config.dump(2) + "\n");
}

std::vector<std::string> tokenizer_file_names() {
  return {"meta.json",      "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
          "tokenizer.model"};
}

int32_t document_start_for_mask(const Tokenizer& tok, const fs::path& dir) {
  const auto start = tok.document_start();
  LOOM_CHECK(start,
             "--doc-mask needs a tokenizer that puts a document-start token (BOS, "
             "<|endoftext|>) before each document; the {} tokenizer of {} has none",
             tok.kind(), dir.string());
  return *start;
}

std::unique_ptr<Tokenizer> load_tokenizer(const fs::path& dir) {
  LOOM_CHECK(fs::is_directory(dir), "data directory {} does not exist", dir.string());
  const fs::path meta_path = dir / "meta.json";
  if (!fs::exists(meta_path)) {
    return std::make_unique<ByteTokenizer>();
  }
  const json meta = read_json(meta_path, "tokenizer meta");
  LOOM_CHECK(meta.is_object() && meta.contains("tokenizer") && meta["tokenizer"].is_string(),
             "{}: expected an object with a string field \"tokenizer\"", meta_path.string());
  const std::string kind = meta["tokenizer"].get<std::string>();

  std::unique_ptr<Tokenizer> tok;
  if (kind == "byte") {
    tok = std::make_unique<ByteTokenizer>();
  } else if (kind == "gpt2-bpe") {
    tok = std::make_unique<Gpt2BpeTokenizer>(dir / "vocab.json", dir / "merges.txt");
  } else if (kind == "hf-json") {
    tok = std::make_unique<HfTokenizer>(dir / "tokenizer.json");
  } else if (kind == "sentencepiece") {
    tok = std::make_unique<SentencePieceTokenizer>(dir / "tokenizer.model");
  } else {
    fail(
        "{}: unknown tokenizer '{}', expected \"byte\", \"gpt2-bpe\", \"hf-json\" or "
        "\"sentencepiece\"",
        meta_path.string(), kind);
  }
  // A vocab_size that disagrees with the files means they were swapped or edited since.
  if (meta.contains("vocab_size")) {
    const json& size = meta["vocab_size"];
    LOOM_CHECK(size.is_number_integer() && size.get<int64_t>() == tok->vocab_size(),
               "{}: vocab_size {} does not match the {} tokenizer's {}", meta_path.string(),
               size.dump(), kind, tok->vocab_size());
  }
  return tok;
}

std::unique_ptr<Tokenizer> open_tokenizer(const fs::path& path) {
  if (path == "byte") return std::make_unique<ByteTokenizer>();
  if (fs::is_directory(path)) {
    if (fs::is_regular_file(path / "tokenizer.json"))
      return std::make_unique<HfTokenizer>(path / "tokenizer.json");
    if (fs::is_regular_file(path / "tokenizer.model"))
      return std::make_unique<SentencePieceTokenizer>(path / "tokenizer.model");
    if (fs::is_regular_file(path / "vocab.json") && fs::is_regular_file(path / "merges.txt"))
      return std::make_unique<Gpt2BpeTokenizer>(path / "vocab.json", path / "merges.txt");
    fail(
        "tokenizer directory {} holds no tokenizer.json, tokenizer.model, or vocab.json + "
        "merges.txt",
        path.string());
  }
  LOOM_CHECK(fs::is_regular_file(path),
             "tokenizer {} does not exist (expected \"byte\", a tokenizer.json, a SentencePiece "
             ".model file, or a directory holding one)",
             path.string());
  if (path.extension() == ".json") return std::make_unique<HfTokenizer>(path);
  return std::make_unique<SentencePieceTokenizer>(path);
}

}  // namespace loom::data
