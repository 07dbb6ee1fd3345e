#include "loom/train/strategy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "loom/core/error.h"
#include "loom/core/registry.h"

namespace loom::train {

namespace {

core::NamedRegistry<StrategyFactory>& registry() {
  static core::NamedRegistry<StrategyFactory> r("strategy");
  return r;
}

}  // namespace

StrategySpec StrategySpec::parse(const std::string& text) {
  return StrategySpec{core::OptionSpec::parse(text, "--strategy")};
}

void register_strategy(const std::string& name, StrategyFactory factory) {
  LOOM_CHECK(core::valid_option_name(name),
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
