#include "loom/train/strategy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>

#include "loom/core/error.h"
#include "loom/core/registry.h"

namespace loom::train {

namespace {

core::NamedRegistry<StrategyFactory>& registry() {
  static core::NamedRegistry<StrategyFactory> r("strategy");
  return r;
}

bool valid_name(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  });
}

}  // namespace

StrategySpec StrategySpec::parse(const std::string& text) {
  StrategySpec spec;
  spec.text = text;
  const auto colon = text.find(':');
  spec.name = text.substr(0, colon);
  LOOM_CHECK(valid_name(spec.name),
             "--strategy '{}': the name '{}' is not valid (lower-case letters, digits, '-' and "
             "'_'; the form is NAME or NAME:key=value,...)",
             text, spec.name);
  if (colon == std::string::npos) return spec;
  const auto rest = text.substr(colon + 1);
  size_t begin = 0;
  while (begin <= rest.size()) {
    auto end = rest.find(',', begin);
    if (end == std::string::npos) end = rest.size();
    const auto item = rest.substr(begin, end - begin);
    const auto eq = item.find('=');
    LOOM_CHECK(eq != std::string::npos && eq > 0 && valid_name(item.substr(0, eq)),
               "--strategy '{}': option '{}' is not key=value (the form is NAME:key=value,...)",
               text, item);
    LOOM_CHECK(spec.options.emplace(item.substr(0, eq), item.substr(eq + 1)).second,
               "--strategy '{}': option '{}' is given twice", text, item.substr(0, eq));
    begin = end + 1;
  }
  return spec;
}

std::string StrategySpec::get(const std::string& key, const std::string& fallback) const {
  auto it = options.find(key);
  return it == options.end() ? fallback : it->second;
}

int64_t StrategySpec::get_int(const std::string& key, int64_t fallback) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  int64_t v = 0;
  const auto& s = it->second;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  LOOM_CHECK(ec == std::errc() && ptr == s.data() + s.size(),
             "--strategy '{}': {}={} is not an integer", text, key, s);
  return v;
}

double StrategySpec::get_double(const std::string& key, double fallback) const {
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
  LOOM_CHECK(used == s.size() && used > 0, "--strategy '{}': {}={} is not a number", text, key, s);
  return v;
}

bool StrategySpec::get_bool(const std::string& key, bool fallback) const {
  auto it = options.find(key);
  if (it == options.end()) return fallback;
  const auto& s = it->second;
  LOOM_CHECK(s == "true" || s == "false" || s == "1" || s == "0",
             "--strategy '{}': {}={} is not a boolean (true, false, 1 or 0)", text, key, s);
  return s == "true" || s == "1";
}

void StrategySpec::check_keys(const std::vector<std::string>& known) const {
  for (const auto& [key, value] : options)
    LOOM_CHECK(std::find(known.begin(), known.end(), key) != known.end(),
               "--strategy '{}': '{}' has no option '{}'; its options: {}", text, name, key,
               known.empty() ? std::string("none") : fmt::format("{}", fmt::join(known, ", ")));
}

void register_strategy(const std::string& name, StrategyFactory factory) {
  LOOM_CHECK(valid_name(name),
             "registering strategy '{}': names are lower-case letters, digits, '-' and '_'", name);
  registry().add(name, std::move(factory));
}

std::vector<std::string> strategy_names() {
  return registry().names();
}

StrategyPtr make_strategy(const StrategySpec& spec) {
  const auto factory = registry().find(spec.name);
  LOOM_CHECK(factory, "--strategy '{}': '{}' is not a registered strategy; registered: {}",
             spec.text.empty() ? spec.name : spec.text, spec.name,
             fmt::join(strategy_names(), ", "));
  auto made = factory(spec);
  LOOM_CHECK(made != nullptr, "the factory of strategy '{}' returned nothing", spec.name);
  return made;
}

}  // namespace loom::train
