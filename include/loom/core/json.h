#pragma once
// Reading numbers out of JSON that someone else wrote (HF configs, checkpoint metadata,
// safetensors headers). nlohmann's get<int64_t>() turns a float into an integer with a plain
// cast: undefined behaviour for 1e20 and a silent truncation of 2.5. These read an integer only
// when the JSON value is one, in the range the caller names, else throw a loom::Error naming it.
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

namespace loom::core {

// `value` as an int64 in [min, max]; `what` names it in the error ("'config.json': n_layer").
int64_t json_int64(const nlohmann::json& value, std::string_view what,
                   int64_t min = std::numeric_limits<int64_t>::min(),
                   int64_t max = std::numeric_limits<int64_t>::max());

// `value` as a list of int64s, each in [min, max] (a shape, data offsets, layer bounds).
std::vector<int64_t> json_int64_list(const nlohmann::json& value, std::string_view what,
                                     int64_t min = std::numeric_limits<int64_t>::min(),
                                     int64_t max = std::numeric_limits<int64_t>::max());

// Checks, before a get<T>() of a whole struct, that `value` has the JSON types of `like` (the
// struct's defaults as JSON) wherever both have a key: an integer field takes only a JSON
// integer that fits (an unsigned one only a non-negative one), a float field any number, a
// string a string, a bool a bool; objects and lists recursively. Keys only one side has are
// left to the caller (older files lack newer keys).
void check_json_like(const nlohmann::json& value, const nlohmann::json& like,
                     std::string_view what);

}  // namespace loom::core
