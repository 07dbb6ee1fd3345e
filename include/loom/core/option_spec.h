#pragma once
// "NAME[:key=value,...]": how a flag names a registered thing with its options (--strategy
// zero:stage=2, --comm-hook topk:ratio=0.01). Parsed once, read with typed getters whose errors
// name the flag, the whole text, the key and the value.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom::core {

struct OptionSpec {
  std::string name;
  std::map<std::string, std::string> options;
  std::string text;  // as given, for errors
  std::string flag;  // the flag that gave it ("--strategy"), for errors

  // Names and keys are lower-case letters, digits, '-' and '_'. Throws loom::Error naming the
  // flag, the text and the form when it does not parse.
  static OptionSpec parse(const std::string& text, const std::string& flag);
  // The option `key` as a value; `fallback` when absent. Throws naming the spec, the key and
  // the value when it does not parse.
  std::string get(const std::string& key, const std::string& fallback) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_double(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  // Throws naming the first option not in `known` (and the known ones).
  void check_keys(const std::vector<std::string>& known) const;
};

// Whether `s` is a valid name or key.
bool valid_option_name(const std::string& s);

}  // namespace loom::core
