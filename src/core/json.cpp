#include "loom/core/json.h"

#include <nlohmann/json.hpp>
#include <string>

#include "loom/core/error.h"

namespace loom::core {

namespace {

// The one test of integer-ness: a JSON integer whose value fits int64 (nlohmann parses a
// non-negative integer as unsigned, so 2^63 and above arrive as number_unsigned).
bool fits_int64(const nlohmann::json& v) {
  if (v.is_number_unsigned())
    return v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  return v.is_number_integer();
}

bool int64_in(const nlohmann::json& v, int64_t min, int64_t max) {
  return fits_int64(v) && v.get<int64_t>() >= min && v.get<int64_t>() <= max;
}

// A value as an error message shows it: a hostile file's megabyte string is cut short.
std::string brief(const nlohmann::json& v) {
  auto text = v.dump();
  constexpr size_t kMax = 120;
  if (text.size() > kMax) {
    text.resize(kMax);
    text.append("...");
  }
  return text;
}

}  // namespace

int64_t json_int64(const nlohmann::json& value, std::string_view what, int64_t min, int64_t max) {
  LOOM_CHECK(int64_in(value, min, max), "{} is {}: it must be an integer in [{}, {}]", what,
             brief(value), min, max);
  return value.get<int64_t>();
}

std::vector<int64_t> json_int64_list(const nlohmann::json& value, std::string_view what,
                                     int64_t min, int64_t max) {
  LOOM_CHECK(value.is_array(), "{} is {}: it must be a list of integers in [{}, {}]", what,
             brief(value), min, max);
  std::vector<int64_t> out;
  out.reserve(value.size());
  for (const auto& v : value) {
    LOOM_CHECK(int64_in(v, min, max), "{} is {}: {} is not an integer in [{}, {}]", what,
               brief(value), brief(v), min, max);
    out.push_back(v.get<int64_t>());
  }
  return out;
}

void check_json_like(const nlohmann::json& value, const nlohmann::json& like,
                     std::string_view what) {
  using Type = nlohmann::json::value_t;
  bool ok = true;
  const char* expected = like.type_name();
  switch (like.type()) {
    case Type::number_unsigned:
      ok = value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
      expected = "a non-negative integer";
      break;
    case Type::number_integer:
      ok = fits_int64(value);
      expected = "an integer that fits 64 bits";
      break;
    case Type::number_float:
      ok = value.is_number();
      expected = "a number";
      break;
    case Type::object:
      ok = value.is_object();
      if (ok)
        for (const auto& item : like.items())
          if (value.contains(item.key()))
            check_json_like(value[item.key()], item.value(), std::string(what) + "." + item.key());
      break;
    case Type::array:
      ok = value.is_array();
      if (ok && !like.empty())
        for (size_t i = 0; i < value.size(); ++i)
          check_json_like(value[i], like.front(),
                          std::string(what) + "[" + std::to_string(i) + "]");
      break;
    case Type::null:  // the default says nothing about the type
      break;
    default:
      ok = value.type() == like.type();
      break;
  }
  LOOM_CHECK(ok, "{} is {}: it must be {}", what, brief(value), expected);
}

}  // namespace loom::core
