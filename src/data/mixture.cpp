#include "loom/data/mixture.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <set>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/data/prepare.h"
#include "loom/data/sampler.h"

namespace loom::data {

namespace fs = std::filesystem;

namespace {

bool is_source_name(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

}  // namespace

std::vector<DataSourceSpec> parse_data_sources(const std::string& spec, std::string_view flag) {
  LOOM_CHECK(!spec.empty(), "{} is empty: name a token shard, or sources as NAME=PATH:WEIGHT,...",
             flag);
  std::vector<DataSourceSpec> out;
  std::set<std::string> names;
  size_t begin = 0;
  while (begin <= spec.size()) {
    const size_t comma = std::min(spec.find(',', begin), spec.size());
    std::string entry = spec.substr(begin, comma - begin);
    begin = comma + 1;
    LOOM_CHECK(!entry.empty(), "{} '{}' has an empty entry (sources are separated by commas)", flag,
               spec);
    DataSourceSpec source;
    const std::string whole = entry;
    // NAME= first: a plain name, so a path holding '=' further on is left alone.
    if (const auto eq = entry.find('='); eq != std::string::npos) {
      if (is_source_name(std::string_view(entry).substr(0, eq))) {
        source.name = entry.substr(0, eq);
        entry = entry.substr(eq + 1);
      }
    }
    // :WEIGHT last: what follows the last ':' when it holds no '/' (a path's ':' is followed by
    // more of the path).
    if (const auto colon = entry.rfind(':');
        colon != std::string::npos && entry.find('/', colon) == std::string::npos) {
      const std::string text = entry.substr(colon + 1);
      char* end = nullptr;
      const double w = std::strtod(text.c_str(), &end);
      LOOM_CHECK(!text.empty() && end == text.c_str() + text.size() && std::isfinite(w) && w > 0,
                 "{}: the weight '{}' of '{}' is not a positive number (entries are "
                 "[NAME=]PATH[:WEIGHT])",
                 flag, text, whole);
      source.weight = w;
      entry = entry.substr(0, colon);
    }
    LOOM_CHECK(!entry.empty(), "{}: '{}' names no path", flag, whole);
    source.pattern = entry;
    const fs::path path(entry);
    std::error_code ec;
    LOOM_CHECK(!fs::is_directory(path, ec),
               "{}: '{}' is a directory; name its shards, e.g. '{}/*.bin' (a glob, quoted)", flag,
               entry, entry);
    if (has_glob(path.filename().string())) {
      try {
        source.paths = expand_inputs({entry});  // matches in name order; none is an error
      } catch (const Error& e) {
        fail("{}: {}", flag, e.what());
      }
    } else {
      LOOM_CHECK(fs::exists(path, ec), "{}: token file '{}' does not exist", flag, entry);
      source.paths = {path};
    }
    if (source.name.empty()) {
      const auto parent = path.parent_path().filename().string();
      source.name = !has_glob(path.filename().string())                 ? path.stem().string()
                    : parent.empty() || parent == "." || parent == ".." ? entry
                                                                        : parent;
    }
    LOOM_CHECK(names.insert(source.name).second,
               "{}: two sources are named '{}'; name them apart as NAME=PATH", flag, source.name);
    out.push_back(std::move(source));
  }
  double total = 0;
  for (const auto& s : out) total += s.weight;
  for (auto& s : out) s.weight /= total;
  return out;
}

MixtureSchedule::MixtureSchedule(const std::vector<double>& weights, uint64_t seed) : seed_(seed) {
  LOOM_CHECK(!weights.empty(), "a data mixture needs at least one source");
  double total = 0;
  for (const double w : weights) {
    LOOM_CHECK(std::isfinite(w) && w > 0, "a data source's weight {} must be positive", w);
    total += w;
  }
  // Largest remainder: floors first, then one more to the largest fractional parts (ties to
  // the earlier source), so the quotas sum to kBlock exactly.
  const auto n = weights.size();
  quota_.resize(n);
  std::vector<double> remainder(n);
  int64_t dealt = 0;
  for (size_t s = 0; s < n; ++s) {
    const double exact = weights[s] / total * static_cast<double>(kBlock);
    quota_[s] = static_cast<int64_t>(std::floor(exact));
    remainder[s] = exact - static_cast<double>(quota_[s]);
    dealt += quota_[s];
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return remainder[a] > remainder[b]; });
  for (size_t i = 0; dealt < kBlock; ++i, ++dealt) ++quota_[order[i % n]];
  first_.resize(n);
  for (size_t s = 0; s < n; ++s) {
    LOOM_CHECK(quota_[s] > 0,
               "data source {} has weight {:.3g} of the total {:.3g}: below 1/{} of it, it would "
               "get no sample in a block of {}; raise it or leave the source out",
               s, weights[s], total, 2 * kBlock, kBlock);
    first_[s] = s == 0 ? 0 : first_[s - 1] + quota_[s - 1];
  }
}

SourceDraw MixtureSchedule::draw(int64_t g) const {
  if (quota_.size() == 1) return {0, g};
  const int64_t block = g / kBlock;
  std::lock_guard<std::mutex> lock(mutex_);
  if (block != block_) {
    // Position p of the block goes to the source whose quota range holds π_b(p); the sources'
    // positions are numbered in order.
    constexpr uint64_t kMixTag = 0x6d6978;  // "mix": keys apart from the windows' permutations
    const uint64_t key = core::mix_seed({kMixTag, seed_, static_cast<uint64_t>(block)});
    source_at_.resize(kBlock);
    index_at_.resize(kBlock);
    std::vector<int32_t> dealt(quota_.size(), 0);
    for (int64_t p = 0; p < kBlock; ++p) {
      const int64_t q = permute_index(p, kBlock, key);
      const auto s = std::upper_bound(first_.begin(), first_.end(), q) - first_.begin() - 1;
      source_at_[p] = static_cast<int32_t>(s);
      index_at_[p] = dealt[s]++;
    }
    block_ = block;
  }
  const int64_t s = source_at_[g % kBlock];
  return {s, block * quota_[s] + index_at_[g % kBlock]};
}

}  // namespace loom::data
