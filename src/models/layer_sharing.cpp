#include "loom/models/layer_sharing.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <charconv>
#include <optional>
#include <set>
#include <string_view>

#include "loom/core/error.h"

namespace loom::models {

namespace {

constexpr const char* kValid =
    "valid: none, all, cycle:K, repeat:K (1 <= K <= n_layers), or a comma-separated list of "
    "L=O (layer L uses layer O's weights, O < L)";

// A decimal integer filling the whole of `text`, or nothing.
std::optional<int64_t> parse_int(std::string_view text) {
  int64_t value = 0;
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

int64_t parse_k(const std::string& pattern, std::string_view digits, int64_t n_layers) {
  const auto k = parse_int(digits);
  LOOM_CHECK(k && *k >= 1 && *k <= n_layers,
             "--share-layers '{}': K = '{}' must be an integer in [1, {}] (the model has {} "
             "layers); {}",
             pattern, digits, n_layers, n_layers, kValid);
  return *k;
}

}  // namespace

std::vector<int64_t> parse_layer_sharing(const std::string& pattern, int64_t n_layers) {
  LOOM_CHECK(n_layers > 0, "parse_layer_sharing: n_layers {} must be positive", n_layers);
  std::vector<int64_t> owners(static_cast<size_t>(n_layers));
  for (int64_t i = 0; i < n_layers; ++i) owners[static_cast<size_t>(i)] = i;
  if (pattern.empty() || pattern == "none") return owners;
  if (pattern == "all") {
    std::fill(owners.begin(), owners.end(), 0);
    return owners;
  }
  const std::string_view text(pattern);
  if (text.starts_with("cycle:")) {
    const int64_t k = parse_k(pattern, text.substr(6), n_layers);
    for (int64_t i = 0; i < n_layers; ++i) owners[static_cast<size_t>(i)] = i % k;
    return owners;
  }
  if (text.starts_with("repeat:")) {
    const int64_t k = parse_k(pattern, text.substr(7), n_layers);
    for (int64_t i = 0; i < n_layers; ++i) owners[static_cast<size_t>(i)] = k * (i / k);
    return owners;
  }
  LOOM_CHECK(text.find('=') != std::string_view::npos, "--share-layers '{}' is not a pattern; {}",
             pattern, kValid);
  std::set<int64_t> users;
  std::string_view rest = text;
  while (true) {
    const auto comma = rest.find(',');
    const auto entry = rest.substr(0, comma);
    const auto eq = entry.find('=');
    const auto user = eq == std::string_view::npos ? std::nullopt : parse_int(entry.substr(0, eq));
    const auto owner =
        eq == std::string_view::npos ? std::nullopt : parse_int(entry.substr(eq + 1));
    LOOM_CHECK(user && owner,
               "--share-layers '{}': entry '{}' is not L=O with integers L and O; {}", pattern,
               entry, kValid);
    for (const int64_t layer : {*user, *owner})
      LOOM_CHECK(layer >= 0 && layer < n_layers,
                 "--share-layers '{}': entry '{}' names layer {}, which does not exist (the model "
                 "has layers 0-{})",
                 pattern, entry, layer, n_layers - 1);
    LOOM_CHECK(*owner < *user,
               "--share-layers '{}': in entry '{}' the layer whose weights are used ({}) must "
               "come before the layer that uses them ({})",
               pattern, entry, *owner, *user);
    LOOM_CHECK(users.insert(*user).second, "--share-layers '{}': layer {} is given weights twice",
               pattern, *user);
    owners[static_cast<size_t>(*user)] = *owner;
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  for (int64_t i = 0; i < n_layers; ++i) {
    const int64_t owner = owners[static_cast<size_t>(i)];
    LOOM_CHECK(owners[static_cast<size_t>(owner)] == owner,
               "--share-layers '{}': layer {} uses layer {}'s weights, but layer {} itself uses "
               "layer {}'s; name layer {} directly",
               pattern, i, owner, owner, owners[static_cast<size_t>(owner)],
               owners[static_cast<size_t>(owner)]);
  }
  return owners;
}

std::vector<int64_t> held_blocks(const std::vector<int64_t>& owners, int64_t first, int64_t end) {
  std::set<int64_t> held;
  for (int64_t i = first; i < end; ++i) held.insert(owners.at(static_cast<size_t>(i)));
  return {held.begin(), held.end()};
}

bool used_outside(const std::vector<int64_t>& owners, int64_t owner, int64_t first, int64_t end) {
  for (int64_t i = 0; i < static_cast<int64_t>(owners.size()); ++i)
    if ((i < first || i >= end) && owners[static_cast<size_t>(i)] == owner) return true;
  return false;
}

std::map<std::string, at::Tensor> expand_shared_layers(std::map<std::string, at::Tensor> tensors,
                                                       const std::string& prefix,
                                                       const std::vector<int64_t>& owners) {
  for (int64_t layer = 0; layer < static_cast<int64_t>(owners.size()); ++layer) {
    const int64_t owner = owners[static_cast<size_t>(layer)];
    if (owner == layer) continue;
    const auto from = prefix + "." + std::to_string(owner) + ".";
    const auto to = prefix + "." + std::to_string(layer) + ".";
    bool found = false;
    for (auto it = tensors.lower_bound(from); it != tensors.end() && it->first.starts_with(from);
         ++it) {
      tensors.emplace(to + it->first.substr(from.size()), it->second);
      found = true;
    }
    LOOM_CHECK(found,
               "expanding shared layers: layer {} uses layer {}'s weights, but there is no "
               "tensor '{}*'",
               layer, owner, from);
  }
  return tensors;
}

}  // namespace loom::models
