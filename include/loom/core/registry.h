#pragma once
// A registry of factories by name: where users plug their own pipeline schedules and
// communication hooks into loom without forking it (registered at static-initialization time by
// the LOOM_REGISTER_* macros, looked up by the name a flag gives). Thread-safe; registering a
// name twice is a loom::Error.
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (moved out of format.h in fmt 11)

#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.h"

namespace loom::core {

template <typename Factory>
class NamedRegistry {
 public:
  // `what` names the kind of thing in errors ("pipeline schedule").
  explicit NamedRegistry(std::string what) : what_(std::move(what)) {}

  void add(const std::string& name, Factory factory) {
    LOOM_CHECK(!name.empty() && factory, "registering a {}: empty name or factory", what_);
    std::lock_guard<std::mutex> lock(mutex_);
    LOOM_CHECK(factories_.emplace(name, std::move(factory)).second,
               "a {} named '{}' is already registered", what_, name);
  }

  // The factory registered as `name`; empty when there is none.
  Factory find(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = factories_.find(name);
    return it == factories_.end() ? Factory{} : it->second;
  }

  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const auto& kv : factories_) out.push_back(kv.first);
    return out;
  }

  // What the factory registered as `name` makes; a loom::Error naming `flag` (the option that
  // chose it), the name and the registered names when there is none.
  auto make(const std::string& name, const std::string& flag) const {
    const auto factory = find(name);
    LOOM_CHECK(factory, "{} '{}' is not a known {}; valid: {}", flag, name, what_,
               fmt::join(names(), ", "));
    auto made = factory();
    LOOM_CHECK(made != nullptr, "the factory of {} '{}' returned nothing", what_, name);
    return made;
  }

 private:
  std::string what_;
  mutable std::mutex mutex_;
  std::map<std::string, Factory> factories_;
};

}  // namespace loom::core
