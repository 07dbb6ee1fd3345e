// Run options that change how a step runs but not what it computes. --profile-steps (the
// "profile" strategy, train/device_profile.h): a short CPU run writes the Chrome trace and the op
// table for exactly the steps asked for, trains the same parameters as an unprofiled run, and bad
// ranges are refused by name. --pad-vocab-multiple's automatic value.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "loom/core/files.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace {

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace train = loom::train;
namespace fs = std::filesystem;

train::TrainConfig profile_config(const fs::path& dir) {
  train::TrainConfig c;
  c.model = "gpt2";
  c.preset = "gpt2-tiny";
  c.data = (dir / "train.bin").string();
  c.val_data = (dir / "val.bin").string();
  c.seq_len = 32;
  c.batch_size = 4;
  c.steps = 4;
  c.log_every = 1000;
  c.eval_batches = 1;
  return c;
}

std::map<std::string, at::Tensor> parameters(train::Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : t.model().named_parameters())
    out[item.key()] = item.value().detach().clone();
  return out;
}

TEST(Profile, WritesTheTraceAndTheOpTableOfTheStepsAskedForAndChangesNothing) {
  TempDir dir;
  loom::testing::write_corpus_data(dir.path(), 20000, 4000);
  auto c = profile_config(dir.path());
  train::Trainer plain(c);
  plain.fit();
  c.profile_steps = "2:3";
  c.profile_out = (dir.path() / "prof").string();
  train::Trainer profiled(c);
  profiled.fit();
  // The profiler observes: the same parameters, bit for bit.
  const auto want = parameters(plain), got = parameters(profiled);
  for (const auto& [name, p] : want) EXPECT_TRUE(at::equal(got.at(name), p)) << name;

  const auto trace =
      nlohmann::json::parse(loom::core::read_file(c.profile_out + "/trace.rank0.json"));
  ASSERT_TRUE(trace.contains("traceEvents"));
  bool saw_mm = false;
  for (const auto& e : trace["traceEvents"])
    saw_mm |= e.value("name", std::string()).find("aten::mm") != std::string::npos ||
              e.value("name", std::string()).find("aten::addmm") != std::string::npos;
  EXPECT_TRUE(saw_mm) << "no matrix product in the trace";

  const auto table =
      nlohmann::json::parse(loom::core::read_file(c.profile_out + "/kernels.rank0.json"));
  EXPECT_EQ(table["steps"], 2);
  EXPECT_EQ(table["times"], "inclusive op");
  EXPECT_GT(table["step_ms"].get<double>(), 0);
  ASSERT_FALSE(table["top"].empty());
  EXPECT_LE(table["top"].size(), 60u);
  bool shapes = false;
  for (const auto& r : table["top"]) {
    EXPECT_GT(r["calls_per_step"].get<double>(), 0) << r;
    shapes |= contains(r["input_shapes"].get<std::string>(), "[");
  }
  EXPECT_TRUE(shapes) << "no row records its input shapes";
  const auto text = loom::core::read_file(c.profile_out + "/kernels.rank0.txt");
  EXPECT_TRUE(contains(text, "2 steps")) << text;
  EXPECT_TRUE(contains(text, "input shapes")) << text;
}

TEST(Profile, BadRangesAreRefusedByName) {
  auto c = profile_config("/nonexistent");
  for (const auto& [text, why] :
       std::map<std::string, std::string>{{"0:2", "1 <= A <= B <= --steps 4"},
                                          {"3:2", "1 <= A <= B"},
                                          {"2:9", "--steps 4"},
                                          {"two", "is not valid"},
                                          {"1:", "is not valid"}}) {
    c.profile_steps = text;
    const auto msg = error_of([&] { c.validate(); });
    EXPECT_TRUE(contains(msg, "--profile-steps '" + text + "' is not valid")) << msg;
    EXPECT_TRUE(contains(msg, why)) << msg;
  }
  c.profile_steps = "2";
  c.profile_out = "";
  const auto msg = error_of([&] { c.validate(); });
  EXPECT_TRUE(contains(msg, "needs --profile-out DIR")) << msg;
  EXPECT_EQ(train::parse_profile_steps("3", 4), std::make_pair(int64_t{3}, int64_t{3}));
}

TEST(TrainConfig, VocabPaddingIsAutomaticOnCudaOnlyAndAnExplicitValueWins) {
  train::TrainConfig c;
  EXPECT_EQ(c.pad_vocab_multiple, 0);
  EXPECT_EQ(c.vocab_padding_multiple(), 1);  // the CPU: no padding
  c.device = "cuda";
  EXPECT_EQ(c.vocab_padding_multiple(), 128);
  c.device = "cuda:1";
  EXPECT_EQ(c.vocab_padding_multiple(), 128);
  c.pad_vocab_multiple = 8;
  EXPECT_EQ(c.vocab_padding_multiple(), 8);
  c = profile_config("/nonexistent");
  c.pad_vocab_multiple = -1;
  const auto msg = error_of([&] { c.validate(); });
  EXPECT_TRUE(contains(msg, "--pad-vocab-multiple -1 is not valid: 0 (auto) or more")) << msg;
}

}  // namespace
