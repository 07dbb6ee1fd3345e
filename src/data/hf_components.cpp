#include "hf_components.h"

#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <algorithm>

#include "loom/core/error.h"
#include "regex.h"
#include "utf8.h"

namespace loom::data::hf {

using json = nlohmann::json;

namespace {

// GPT-2's pre-tokenizer pattern, which ByteLevel applies when use_regex is set.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string field_string(const json& j, const char* key, const std::string& where,
                         const char* type) {
  LOOM_CHECK(j.contains(key) && j[key].is_string(), "{}: {} needs a string \"{}\", got {}", where,
             type, key, j.contains(key) ? j[key].dump() : "nothing");
  return j[key].get<std::string>();
}

bool field_bool(const json& j, const char* key, bool fallback) {
  return j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : fallback;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  size_t pos = 0;
  for (size_t at; (at = s.find(from, pos)) != std::string::npos; pos = at + from.size()) {
    out.append(s, pos, at - pos);
    out.append(to);
  }
  out.append(s, pos);
  s = std::move(out);
}

// A pattern as tokenizer.json writes it: {"String": literal} or {"Regex": pattern}.
class Pattern {
 public:
  Pattern(const json& j, const std::string& where, const char* type) {
    if (j.is_object() && j.contains("String") && j["String"].is_string()) {
      literal_ = j["String"].get<std::string>();
    } else if (j.is_object() && j.contains("Regex") && j["Regex"].is_string()) {
      regex_ = std::make_unique<Regex>(j["Regex"].get<std::string>(), where);
    } else {
      fail("{}: {}'s pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}, got {}", where,
           type, j.dump());
    }
  }
  // Non-overlapping matches, left to right, as byte ranges.
  std::vector<std::pair<size_t, size_t>> matches(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    if (regex_) {
      regex_->for_each_match(s, [&](size_t b, size_t e) { out.emplace_back(b, e); });
    } else if (!literal_.empty()) {
      for (size_t at = s.find(literal_); at != std::string_view::npos;
           at = s.find(literal_, at + literal_.size()))
        out.emplace_back(at, at + literal_.size());
    }
    return out;
  }

 private:
  std::string literal_;
  std::unique_ptr<Regex> regex_;
};

// ---------------------------------------------------------------------------------------------
// Normalizers

class SequenceNormalizer final : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> steps;
  void apply(std::string& text) const override {
    for (const auto& s : steps) s->apply(text);
  }
};

class PrependNormalizer final : public Normalizer {
 public:
  std::string prefix;
  void apply(std::string& text) const override {
    if (!text.empty()) text = prefix + text;
  }
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(const json& j, const std::string& where)
      : pattern(j.value("pattern", json()), where, "Replace"),
        content(field_string(j, "content", where, "Replace")) {}
  Pattern pattern;
  std::string content;
  void apply(std::string& text) const override {
    std::string out;
    size_t pos = 0;
    for (const auto& [b, e] : pattern.matches(text)) {
      out.append(text, pos, b - pos);
      out.append(content);
      pos = e;
    }
    out.append(text, pos);
    text = std::move(out);
  }
};

bool is_unicode_space(int32_t cp) {
  return cp >= 0 && u_isUWhiteSpace(cp);
}

class StripNormalizer final : public Normalizer {
 public:
  bool left = true, right = true;
  void apply(std::string& text) const override {
    size_t begin = 0, end = text.size();
    if (left) {
      while (begin < end) {
        const auto c = utf8::at(text, begin);
        if (!is_unicode_space(c.cp)) break;
        begin += c.size;
      }
    }
    if (right) {
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
        const auto c = utf8::at(text, start);
        if (c.cp < 0 || start + c.size != end || !is_unicode_space(c.cp)) break;
        end = start;
      }
    }
    text = text.substr(begin, end - begin);
  }
};

// Unicode normal forms and lower-casing through ICU, on each valid UTF-8 run (invalid bytes
// stay as they are: the library never sees them, and loom does not drop them).
class IcuNormalizer final : public Normalizer {
 public:
  enum class Form { kNfc, kNfd, kNfkc, kNfkd, kLower };
  explicit IcuNormalizer(Form form) : form_(form) {}
  void apply(std::string& text) const override {
    std::string out;
    size_t run = 0;
    for (size_t pos = 0; pos <= text.size();) {
      const bool at_end = pos == text.size();
      const auto c = at_end ? utf8::CodePoint{0, 0} : utf8::at(text, pos);
      if (at_end || c.cp < 0) {
        out += transform(std::string_view(text).substr(run, pos - run));
        if (at_end) break;
        out.push_back(text[pos]);
        run = pos + 1;
      }
      pos += at_end ? 1 : c.size;
    }
    text = std::move(out);
  }

 private:
  std::string transform(std::string_view s) const {
    if (s.empty()) return {};
    UErrorCode status = U_ZERO_ERROR;
    std::u16string in(s.size() + 1, u'\0');
    int32_t in_len = 0;
    u_strFromUTF8(in.data(), static_cast<int32_t>(in.size()), &in_len, s.data(),
                  static_cast<int32_t>(s.size()), &status);
    LOOM_CHECK(U_SUCCESS(status), "tokenizer normalizer: ICU cannot read the text: {}",
               u_errorName(status));
    in.resize(in_len);
    std::u16string res(in.size() * 4 + 16, u'\0');
    int32_t res_len = 0;
    if (form_ == Form::kLower) {
      res_len = u_strToLower(res.data(), static_cast<int32_t>(res.size()), in.data(), in_len, "",
                             &status);
    } else {
      const UNormalizer2* n = form_ == Form::kNfc    ? unorm2_getNFCInstance(&status)
                              : form_ == Form::kNfd  ? unorm2_getNFDInstance(&status)
                              : form_ == Form::kNfkc ? unorm2_getNFKCInstance(&status)
                                                     : unorm2_getNFKDInstance(&status);
      res_len = unorm2_normalize(n, in.data(), in_len, res.data(),
                                 static_cast<int32_t>(res.size()), &status);
    }
    LOOM_CHECK(U_SUCCESS(status), "tokenizer normalizer: ICU failed: {}", u_errorName(status));
    std::string out(static_cast<size_t>(res_len) * 3 + 4, '\0');
    int32_t out_len = 0;
    u_strToUTF8(out.data(), static_cast<int32_t>(out.size()), &out_len, res.data(), res_len,
                &status);
    LOOM_CHECK(U_SUCCESS(status), "tokenizer normalizer: ICU failed: {}", u_errorName(status));
    out.resize(out_len);
    return out;
  }
  Form form_;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers

// Splits each split at the matches, as NormalizedString::split does for `behavior`.
void split_all(std::vector<Split>& splits, const Pattern& pattern, const std::string& behavior,
               bool invert) {
  std::vector<Split> out;
  for (const Split& split : splits) {
    std::vector<std::pair<std::pair<size_t, size_t>, bool>> parts;  // (range, is match)
    size_t pos = 0;
    for (const auto& [b, e] : pattern.matches(split.text)) {
      if (b > pos) parts.push_back({{pos, b}, false});
      parts.push_back({{b, e}, true});
      pos = e;
    }
    if (pos < split.text.size()) parts.push_back({{pos, split.text.size()}, false});
    if (invert)
      for (auto& p : parts) p.second = !p.second;

    std::vector<std::pair<size_t, size_t>> ranges;
    bool previous_match = false;
    if (behavior == "Removed") {
      for (const auto& [r, m] : parts)
        if (!m) ranges.push_back(r);
    } else if (behavior == "Isolated") {
      for (const auto& [r, m] : parts) ranges.push_back(r);
    } else if (behavior == "MergedWithPrevious") {
      for (const auto& [r, m] : parts) {
        if (m && !previous_match && !ranges.empty())
          ranges.back().second = r.second;
        else
          ranges.push_back(r);
        previous_match = m;
      }
    } else if (behavior == "MergedWithNext") {
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->second && !previous_match && !ranges.empty())
          ranges.back().first = it->first.first;
        else
          ranges.push_back(it->first);
        previous_match = it->second;
      }
      std::reverse(ranges.begin(), ranges.end());
    } else {  // Contiguous
      for (const auto& [r, m] : parts) {
        if (m == previous_match && !ranges.empty())
          ranges.back().second = r.second;
        else
          ranges.push_back(r);
        previous_match = m;
      }
    }
    for (const auto& [b, e] : ranges) {
      if (e > b) out.push_back({split.text.substr(b, e - b), split.at_text_start && b == 0});
    }
  }
  splits = std::move(out);
}

const std::vector<std::string> kSplitBehaviors = {"Removed", "Isolated", "MergedWithPrevious",
                                                  "MergedWithNext", "Contiguous"};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  std::vector<std::unique_ptr<PreTokenizer>> steps;
  void apply(std::vector<Split>& splits) const override {
    for (const auto& s : steps) s->apply(splits);
  }
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(const json& j, const std::string& where)
      : pattern(j.value("pattern", json()), where, "Split"),
        behavior(field_string(j, "behavior", where, "Split")),
        invert(field_bool(j, "invert", false)) {
    LOOM_CHECK(std::find(kSplitBehaviors.begin(), kSplitBehaviors.end(), behavior) !=
                   kSplitBehaviors.end(),
               "{}: Split behavior '{}' is not one of Removed, Isolated, MergedWithPrevious, "
               "MergedWithNext, Contiguous",
               where, behavior);
  }
  Pattern pattern;
  std::string behavior;
  bool invert;
  void apply(std::vector<Split>& splits) const override {
    split_all(splits, pattern, behavior, invert);
  }
};

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(const json& j, const std::string& where)
      : add_prefix_space(field_bool(j, "add_prefix_space", true)),
        regex(field_bool(j, "use_regex", true) ? std::make_unique<Pattern>(
                                                     json{{"Regex", kGpt2Pattern}}, where, "ByteLevel")
                                               : nullptr) {}
  bool add_prefix_space;
  std::unique_ptr<Pattern> regex;
  void apply(std::vector<Split>& splits) const override {
    if (add_prefix_space)
      for (Split& s : splits)
        if (!s.text.starts_with(' ')) s.text = " " + s.text;
    if (regex) split_all(splits, *regex, "Isolated", false);
    const auto& chars = byte_level_chars();
    for (Split& s : splits) {
      std::string mapped;
      mapped.reserve(s.text.size() * 2);
      for (char c : s.text) mapped += chars[static_cast<unsigned char>(c)];
      s.text = std::move(mapped);
    }
  }
};

// prepend_scheme: "always", "first" or "never"; older files write add_prefix_space instead.
std::string prepend_scheme(const json& j, const std::string& where, const char* type) {
  if (j.contains("prepend_scheme") && j["prepend_scheme"].is_string()) {
    const std::string s = j["prepend_scheme"].get<std::string>();
    LOOM_CHECK(s == "always" || s == "first" || s == "never",
               "{}: {} prepend_scheme '{}' is not one of always, first, never", where, type, s);
    return s;
  }
  return field_bool(j, "add_prefix_space", true) ? "always" : "never";
}

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(const json& j, const std::string& where)
      : replacement(field_string(j, "replacement", where, "Metaspace")),
        scheme(prepend_scheme(j, where, "Metaspace")),
        split(field_bool(j, "split", true)),
        on_replacement(json{{"String", replacement}}, where, "Metaspace") {}
  std::string replacement;
  std::string scheme;
  bool split;
  Pattern on_replacement;
  void apply(std::vector<Split>& splits) const override {
    for (Split& s : splits) {
      replace_all(s.text, " ", replacement);
      const bool prepend = scheme == "always" || (scheme == "first" && s.at_text_start);
      if (prepend && !s.text.starts_with(replacement)) s.text = replacement + s.text;
    }
    if (split) split_all(splits, on_replacement, "MergedWithNext", false);
  }
};

class DigitsPreTokenizer final : public PreTokenizer {
 public:
  DigitsPreTokenizer(const json& j, const std::string& where)
      : digits(json{{"Regex", field_bool(j, "individual_digits", false) ? "\\p{N}" : "\\p{N}+"}},
               where, "Digits") {}
  Pattern digits;
  void apply(std::vector<Split>& splits) const override {
    split_all(splits, digits, "Isolated", false);
  }
};

// ---------------------------------------------------------------------------------------------
// Decoders

class SequenceDecoder final : public Decoder {
 public:
  std::vector<std::unique_ptr<Decoder>> steps;
  void apply(std::vector<std::string>& tokens) const override {
    for (const auto& s : steps) s->apply(tokens);
  }
};

class ByteLevelDecoder final : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    static const std::unordered_map<int32_t, char> byte_of = [] {
      std::unordered_map<int32_t, char> m;
      for (int b = 0; b < 256; ++b)
        m[utf8::byte_level_code_point(static_cast<uint8_t>(b))] = static_cast<char>(b);
      return m;
    }();
    std::string bytes;
    for (const std::string& t : tokens) {
      // A token with a character outside the alphabet (an added token's text) passes whole.
      std::string mapped;
      bool all = true;
      for (size_t pos = 0; pos < t.size();) {
        const auto c = utf8::at(t, pos);
        const auto it = byte_of.find(c.cp);
        if (c.cp < 0 || it == byte_of.end()) {
          all = false;
          break;
        }
        mapped.push_back(it->second);
        pos += c.size;
      }
      bytes += all ? mapped : t;
    }
    tokens = {utf8::replace_invalid(bytes)};
  }
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(const json& j, const std::string& where)
      : pattern(j.value("pattern", json()), where, "Replace"),
        content(field_string(j, "content", where, "Replace")) {}
  Pattern pattern;
  std::string content;
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      std::string out;
      size_t pos = 0;
      for (const auto& [b, e] : pattern.matches(t)) {
        out.append(t, pos, b - pos);
        out.append(content);
        pos = e;
      }
      out.append(t, pos);
      t = std::move(out);
    }
  }
};

// <0xXX> tokens become bytes; a run of them that is not valid UTF-8 becomes one U+FFFD per byte.
class ByteFallbackDecoder final : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string bytes;
    size_t count = 0;
    const auto flush = [&] {
      if (count == 0) return;
      if (utf8::replace_invalid(bytes) == bytes) {
        out.push_back(bytes);
      } else {
        for (size_t i = 0; i < count; ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      bytes.clear();
      count = 0;
    };
    for (std::string& t : tokens) {
      if (const int value = utf8::byte_piece_value(t); value >= 0) {
        bytes.push_back(static_cast<char>(value));
        ++count;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

class FuseDecoder final : public Decoder {
 public:
  void apply(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens = {all};
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(const json& j, const std::string& where)
      : content(field_string(j, "content", where, "Strip")),
        start(j.value("start", 0)),
        stop(j.value("stop", 0)) {}
  std::string content;
  int start, stop;
  void apply(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      size_t b = 0, e = t.size();
      for (int i = 0; i < start && !content.empty() && t.compare(b, content.size(), content) == 0;
           ++i)
        b += content.size();
      for (int i = 0; i < stop && !content.empty() && e >= b + content.size() &&
                      t.compare(e - content.size(), content.size(), content) == 0;
           ++i)
        e -= content.size();
      t = t.substr(b, e - b);
    }
  }
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(const json& j, const std::string& where)
      : replacement(field_string(j, "replacement", where, "Metaspace")),
        scheme(prepend_scheme(j, where, "Metaspace")) {}
  std::string replacement;
  std::string scheme;
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      replace_all(tokens[i], replacement, " ");
      if (i == 0 && scheme != "never" && tokens[i].starts_with(' ')) tokens[i].erase(0, 1);
    }
  }
};

std::string type_of(const json& j, const std::string& where, const char* what) {
  LOOM_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(),
             "{}: a {} must be an object with a string \"type\", got {}", where, what,
             j.dump().substr(0, 200));
  return j["type"].get<std::string>();
}

}  // namespace

const std::vector<std::string>& byte_level_chars() {
  static const std::vector<std::string> chars = [] {
    std::vector<std::string> c(256);
    for (int b = 0; b < 256; ++b) utf8::append(c[b], utf8::byte_level_code_point(b));
    return c;
  }();
  return chars;
}

std::unique_ptr<Normalizer> make_normalizer(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, where, "normalizer");
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceNormalizer>();
    for (const json& s : j.value("normalizers", json::array())) {
      if (auto n = make_normalizer(s, where)) seq->steps.push_back(std::move(n));
    }
    return seq;
  }
  if (type == "Prepend") {
    auto p = std::make_unique<PrependNormalizer>();
    p->prefix = field_string(j, "prepend", where, "Prepend");
    return p;
  }
  if (type == "Replace") return std::make_unique<ReplaceNormalizer>(j, where);
  if (type == "Strip") {
    auto s = std::make_unique<StripNormalizer>();
    s->left = field_bool(j, "strip_left", true);
    s->right = field_bool(j, "strip_right", true);
    return s;
  }
  using Form = IcuNormalizer::Form;
  if (type == "NFC") return std::make_unique<IcuNormalizer>(Form::kNfc);
  if (type == "NFD") return std::make_unique<IcuNormalizer>(Form::kNfd);
  if (type == "NFKC") return std::make_unique<IcuNormalizer>(Form::kNfkc);
  if (type == "NFKD") return std::make_unique<IcuNormalizer>(Form::kNfkd);
  if (type == "Lowercase") return std::make_unique<IcuNormalizer>(Form::kLower);
  fail("{}: normalizer type '{}' is not supported (supported: Sequence, Prepend, Replace, Strip, "
       "NFC, NFD, NFKC, NFKD, Lowercase)",
       where, type);
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, where, "pre-tokenizer");
  if (type == "Sequence") {
    auto seq = std::make_unique<SequencePreTokenizer>();
    for (const json& s : j.value("pretokenizers", json::array())) {
      if (auto p = make_pre_tokenizer(s, where)) seq->steps.push_back(std::move(p));
    }
    return seq;
  }
  if (type == "Split") return std::make_unique<SplitPreTokenizer>(j, where);
  if (type == "ByteLevel") return std::make_unique<ByteLevelPreTokenizer>(j, where);
  if (type == "Metaspace") return std::make_unique<MetaspacePreTokenizer>(j, where);
  if (type == "Digits") return std::make_unique<DigitsPreTokenizer>(j, where);
  fail("{}: pre-tokenizer type '{}' is not supported (supported: Sequence, Split, ByteLevel, "
       "Metaspace, Digits)",
       where, type);
}

std::unique_ptr<Decoder> make_decoder(const json& j, const std::string& where) {
  if (j.is_null()) return nullptr;
  const std::string type = type_of(j, where, "decoder");
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceDecoder>();
    for (const json& s : j.value("decoders", json::array())) {
      if (auto d = make_decoder(s, where)) seq->steps.push_back(std::move(d));
    }
    return seq;
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Replace") return std::make_unique<ReplaceDecoder>(j, where);
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") return std::make_unique<StripDecoder>(j, where);
  if (type == "Metaspace") return std::make_unique<MetaspaceDecoder>(j, where);
  fail("{}: decoder type '{}' is not supported (supported: Sequence, ByteLevel, Replace, "
       "ByteFallback, Fuse, Strip, Metaspace)",
       where, type);
}

}  // namespace loom::data::hf
