#include "regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>
#include <vector>

#include "loom/core/error.h"

namespace loom::data {

namespace {

// Length of an interval quantifier {n}, {n,} or {n,m} at `i`, or 0.
size_t interval_length(std::string_view p, size_t i) {
  if (i >= p.size() || p[i] != '{') return 0;
  size_t j = i + 1;
  const size_t digits = j;
  while (j < p.size() && std::isdigit(static_cast<unsigned char>(p[j]))) ++j;
  if (j == digits) return 0;
  if (j < p.size() && p[j] == ',') {
    ++j;
    while (j < p.size() && std::isdigit(static_cast<unsigned char>(p[j]))) ++j;
  }
  return j < p.size() && p[j] == '}' ? j + 1 - i : 0;
}

}  // namespace

// Oniguruma's Ruby syntax reads X{n,m}+ as (X{n,m})+, a greedy repeat of the interval, where
// PCRE2 reads a possessive interval; cl100k's "\p{N}{1,3}+" splits digit runs differently under
// the two. Rewrites each such interval to the Ruby meaning; everything else passes unchanged.
std::string Regex::from_ruby_syntax(std::string_view p) {
  std::string out;
  std::vector<size_t> groups;          // where each open group starts in `out`
  size_t atom = std::string::npos;     // where the last atom starts in `out`
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    const size_t start = out.size();
    if (c == '\\' && i + 1 < p.size()) {
      size_t j = i + 2;
      const char e = p[i + 1];
      if ((e == 'p' || e == 'P' || e == 'x' || e == 'u') && j < p.size() && p[j] == '{') {
        j = p.find('}', j);
        j = j == std::string_view::npos ? p.size() : j + 1;
      } else if (e == 'x') {
        while (j < p.size() && j < i + 4 && std::isxdigit(static_cast<unsigned char>(p[j]))) ++j;
      } else if (e == 'u') {
        while (j < p.size() && j < i + 6 && std::isxdigit(static_cast<unsigned char>(p[j]))) ++j;
      } else if ((e == 'p' || e == 'P') && j < p.size()) {
        ++j;  // \pL
      }
      out.append(p.substr(i, j - i));
      i = j;
      atom = start;
    } else if (c == '[') {
      size_t j = i + 1, depth = 1;
      if (j < p.size() && p[j] == '^') ++j;
      if (j < p.size() && p[j] == ']') ++j;  // a leading ] is literal
      while (j < p.size() && depth > 0) {
        if (p[j] == '\\') j += 2;
        else if (p[j] == '[') ++depth, ++j;
        else if (p[j] == ']') --depth, ++j;
        else ++j;
      }
      j = std::min(j, p.size());
      out.append(p.substr(i, j - i));
      i = j;
      atom = start;
    } else if (c == '(') {
      groups.push_back(start);
      out.push_back(c);
      ++i;
      atom = std::string::npos;
    } else if (c == ')') {
      out.push_back(c);
      ++i;
      atom = groups.empty() ? std::string::npos : groups.back();
      if (!groups.empty()) groups.pop_back();
    } else if (const size_t n = interval_length(p, i); n > 0) {
      if (atom != std::string::npos && i + n < p.size() && p[i + n] == '+') {
        out.insert(atom, "(?:");
        out.append(p.substr(i, n));
        out.append(")+");
        i += n + 1;
      } else {
        out.append(p.substr(i, n));
        i += n;
      }
      atom = std::string::npos;
    } else if (c == '|') {
      out.push_back(c);
      ++i;
      atom = std::string::npos;
    } else if (c == '*' || c == '+' || c == '?') {
      out.push_back(c);
      ++i;
    } else {
      size_t j = i + 1;  // one character, with its UTF-8 continuation bytes
      while (j < p.size() && (static_cast<unsigned char>(p[j]) & 0xC0) == 0x80) ++j;
      out.append(p.substr(i, j - i));
      i = j;
      atom = start;
    }
  }
  return out;
}

struct Regex::Compiled {
  pcre2_code* code = nullptr;
  ~Compiled() { pcre2_code_free(code); }
};

Regex::Regex(std::string_view pattern, std::string_view where)
    : compiled_(std::make_unique<Compiled>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  const std::string translated = from_ruby_syntax(pattern);
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                  PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_MULTILINE,
                                  &error,
                                  &offset, nullptr);
  if (compiled_->code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    fail("{}: cannot compile the regular expression '{}': {} at offset {}", where, pattern,
         reinterpret_cast<const char*>(message), offset);
  }
  // The JIT is several times faster; without it (unsupported CPU) the interpreter gives the same
  // matches.
  pcre2_jit_compile(compiled_->code, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() = default;

void Regex::for_each_match(std::string_view subject,
                           const std::function<void(size_t, size_t)>& on_match) const {
  pcre2_match_data* data = pcre2_match_data_create_from_pattern(compiled_->code, nullptr);
  LOOM_CHECK(data != nullptr, "Regex: out of memory for match data");
  const auto* text = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t start = 0;
  while (start <= subject.size()) {
    const int rc = pcre2_match(compiled_->code, text, subject.size(), start, 0, data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      pcre2_match_data_free(data);
      fail("Regex: matching failed at byte {}: {}", start, reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data);
    const size_t begin = ov[0];
    const size_t end = ov[1];
    if (end > begin) {
      on_match(begin, end);
      start = end;
    } else {
      // An empty match yields nothing; step over one character (a UTF-8 sequence, or one byte).
      start = begin + 1;
      while (start < subject.size() && (static_cast<unsigned char>(subject[start]) & 0xC0) == 0x80)
        ++start;
    }
  }
  pcre2_match_data_free(data);
}

}  // namespace loom::data
