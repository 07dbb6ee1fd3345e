#include "loom/core/option_spec.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>

#include "loom/core/error.h"

namespace loom::core {

bool valid_option_name(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  });
}

OptionSpec OptionSpec::parse(const std::string& text, const std::string& flag) {
  OptionSpec spec;
  spec.text = text;
  spec.flag = flag;
  const auto colon = text.find(':');
  spec.name = text.substr(0, colon);
  LOOM_CHECK(valid_option_name(spec.name),
             "{} '{}': the name '{}' is not valid (lower-case letters, digits, '-' and '_'; the "
             "form is NAME or NAME:key=value,...)",
             flag, text, spec.name);
  if (colon == std::string::npos) return spec;
  const auto rest = text.substr(colon + 1);
  size_t begin = 0;
  while (begin <= rest.size()) {
    auto end = rest.find(',', begin);
    if (end == std::string::npos) end = rest.size();
    const auto item = rest.substr(begin, end - begin);
    const auto eq = item.find('=');
    LOOM_CHECK(eq != std::string::npos && eq > 0 && valid_option_name(item.substr(0, eq)),
               "{} '{}': option '{}' is not key=value (the form is NAME:key=value,...)", flag, text,
               item);
    LOOM_CHECK(spec.options.emplace(item.substr(0, eq), item.substr(eq + 1)).second,
               "{} '{}': option '{}' is given twice", flag, text, item.substr(0, eq));
    begin = end + 1;
  }
  return spec;
}

std::string OptionSpec::get(const std::string& key, const std::string& fallback) const {
  auto it = options.find(key);
  return it == options.end() ? fallback : it->second;
}

int64_t OptionSpec::get_int(const std::string& key, int64_t fallback) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  int64_t v = 0;
  const auto& s = it->second;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  LOOM_CHECK(ec == std::errc() && ptr == s.data() + s.size(), "{} '{}': {}={} is not an integer",
             flag, text, key, s);
  return v;
}

double OptionSpec::get_double(const std::string& key, double fallback) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  const auto& s = it->second;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  LOOM_CHECK(used == s.size() && used > 0, "{} '{}': {}={} is not a number", flag, text, key, s);
  return v;
}

bool OptionSpec::get_bool(const std::string& key, bool fallback) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  const auto& s = it->second;
  LOOM_CHECK(s == "true" || s == "false" || s == "1" || s == "0",
             "{} '{}': {}={} is not a boolean (true, false, 1 or 0)", flag, text, key, s);
  return s == "true" || s == "1";
}

void OptionSpec::check_keys(const std::vector<std::string>& known) const {
  for (const auto& [key, value] : options)
    LOOM_CHECK(std::find(known.begin(), known.end(), key) != known.end(),
               "{} '{}': '{}' has no option '{}'; its options: {}", flag, text, name, key,
               known.empty() ? std::string("none") : fmt::format("{}", fmt::join(known, ", ")));
}

}  // namespace loom::core
