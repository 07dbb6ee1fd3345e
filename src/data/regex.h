#pragma once
// A compiled regular expression for tokenizers' pre-tokenizer patterns (private to src/data).
// PCRE2 in UTF + Unicode-property mode: the patterns of Hugging Face tokenizer.json files (\p{L},
// lookaheads, (?i:...), possessive quantifiers) run unchanged. Invalid UTF-8 in the subject is
// allowed and never matched by any item, so arbitrary bytes fall between matches. ^ and $ match
// at line breaks, and X{n,m}+ repeats the interval, as in Oniguruma's Ruby syntax, which the
// tokenizers library uses.
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace loom::data {

class Regex {
 public:
  // Throws loom::Error naming `where` (e.g. the file) and PCRE2's message with its offset.
  Regex(std::string_view pattern, std::string_view where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls on_match(begin, end) for each successive non-overlapping match, left to right;
  // an empty match advances by one character. Thread-safe.
  void for_each_match(std::string_view subject,
                      const std::function<void(size_t, size_t)>& on_match) const;

  // The PCRE2 pattern with the meaning `pattern` has in Oniguruma's Ruby syntax.
  static std::string from_ruby_syntax(std::string_view pattern);

 private:
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace loom::data
