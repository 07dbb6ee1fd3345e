#pragma once
// loom-pretrain's flags as an object of their own, apart from running them: the command line
// (and a --config TOML file) parse into `config` without starting a runtime, which is what the
// pretrain tool and the config fuzzer (tests/fuzz) both need.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "loom/train/config.h"

namespace loom::apps {

struct PretrainCommandLine {
  // Declares every flag on `app` (named `name` in messages), bound to the fields below.
  explicit PretrainCommandLine(const std::string& name);
  PretrainCommandLine(const PretrainCommandLine&) = delete;
  PretrainCommandLine& operator=(const PretrainCommandLine&) = delete;

  // After app.parse(): folds --micro-batches into grad_accum. Throws loom::Error naming both
  // values when they disagree.
  void finish();

  CLI::App app;
  train::TrainConfig config;
  int threads = 0;
  double comm_timeout = 300;
  std::string log_level = "info";
  int64_t micro_batches = 0;
  std::string plan = "none";             // --plan: none | auto (plan_auto.h)
  std::string plan_profile = "measure";  // --plan-profile: measure | FILE | a built-in profile
};

}  // namespace loom::apps
