// Hugging Face directories as the hub holds them: sharded weights with their index, RoPE
// scaling, generation_config.json; and the memory-mapped safetensors reader under them.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "loom/core/files.h"
#include "loom/core/rng.h"
#include "loom/core/safetensors.h"
#include "loom/models/hf.h"
#include "loom/models/llama.h"
#include "model_test_util.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace fs = std::filesystem;
namespace models = loom::models;
using nlohmann::json;

namespace {

json read_json(const fs::path& path) {
  return json::parse(loom::core::read_file(path));
}

void expect_same_parameters(const models::CausalLM& a, const models::CausalLM& b) {
  auto b_params = b.named_parameters();
  for (const auto& item : a.named_parameters())
    EXPECT_TRUE(at::equal(item.value(), *b_params.find(item.key()))) << item.key();
}

std::vector<std::string> weight_files(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(HfFiles, SafetensorsViewsShareTheMappedFileAndNeverWriteIt) {
  TempDir dir;
  const auto a = at::arange(12, at::kFloat).view({3, 4});
  const auto b = at::arange(5, at::kLong);
  loom::core::save_safetensors(dir / "x.safetensors", {{"a", a}, {"b", b}});
  at::Tensor view;
  {
    const loom::core::SafetensorsReader reader(dir / "x.safetensors");
    view = reader.view("a");
    EXPECT_TRUE(at::equal(view, a));
    EXPECT_TRUE(at::equal(reader.read("b"), b));
    EXPECT_TRUE(contains(error_of([&] { reader.view("c"); }), "holds no tensor 'c'"));
  }
  // The view outlives its reader; writing to it is private to this process's mapping.
  view.fill_(7);
  EXPECT_TRUE(at::equal(loom::core::load_safetensors(dir / "x.safetensors").tensors.at("a"), a));
  EXPECT_TRUE(contains(error_of([&] { loom::core::SafetensorsReader r(dir.path()); }),
                       "it is a directory"));
  EXPECT_TRUE(contains(error_of([&] { loom::core::SafetensorsReader r(dir / "none"); }),
                       "cannot open safetensors file"));
}

TEST(HfFiles, LargeModelsAreWrittenAsShardsWithAnIndexAndReadBack) {
  TempDir dir;
  const auto m =
      loom::testing::make_initialized(loom::testing::tiny_model_config(models::Family::kLlama), 5);
  // ~6 KB files: the tiny model's tensors (the largest 61 x 32 fp32 = 7.8 KB) over many.
  models::save_hf(*m, dir.path(), models::HfSaveOptions{.max_shard_bytes = 6000});
  const auto files = weight_files(dir.path());
  ASSERT_GT(files.size(), 3u);
  const auto n = files.size();
  EXPECT_EQ(files.front(), fmt::format("model-00001-of-{:05}.safetensors", n));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  const auto index = read_json(dir / models::kHfIndexFile);
  int64_t total = 0, listed = 0;
  for (const auto& file : files) {
    const loom::core::SafetensorsReader reader(dir / file);
    for (const auto& name : reader.names()) {
      EXPECT_EQ(index["weight_map"][name], file) << name;
      total += reader.read(name).numel() * 4;
      ++listed;
    }
    // Only a tensor larger than the limit has a file beyond it.
    if (reader.names().size() > 1) {
      EXPECT_LE(fs::file_size(dir / file), 6000u + 1024u) << file;  // + header
    }
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_EQ(static_cast<int64_t>(index["weight_map"].size()), listed);
  auto back = models::load_hf(dir.path());
  expect_same_parameters(*m, *back);

  // A smaller model (or a larger limit) in the same directory: one file, the shards gone.
  models::save_hf(*m, dir.path());
  EXPECT_EQ(weight_files(dir.path()), std::vector<std::string>{"model.safetensors"});
  EXPECT_FALSE(fs::exists(dir / models::kHfIndexFile));
  expect_same_parameters(*m, *models::load_hf(dir.path()));
}

TEST(HfFiles, AnIndexThatDoesNotMatchItsFilesIsNamed) {
  TempDir dir;
  const auto m =
      loom::testing::make_initialized(loom::testing::tiny_model_config(models::Family::kGpt2), 6);
  models::save_hf(*m, dir.path(), models::HfSaveOptions{.max_shard_bytes = 20000});
  const auto index = read_json(dir / models::kHfIndexFile);
  const auto expect_refused = [&](const json& bad, const std::string& part) {
    loom::core::write_file_atomic(dir / models::kHfIndexFile, bad.dump());
    const auto msg = error_of([&] { models::load_hf(dir.path()); });
    EXPECT_TRUE(contains(msg, part)) << msg;
  };
  const std::string some = index["weight_map"].begin().key();
  auto bad = index;
  bad["weight_map"][some] = "../elsewhere.safetensors";
  expect_refused(bad, "names files in the same directory");
  bad["weight_map"][some] = "model-99999-of-99999.safetensors";
  expect_refused(bad, "which is missing");
  bad = index;
  bad["weight_map"].erase(some);  // its file still holds it
  expect_refused(bad, "holds tensor '" + some + "', which model.safetensors.index.json does not");
  bad = index;
  bad["weight_map"]["transformer.h.9.mlp.c_fc.weight"] = bad["weight_map"][some];
  expect_refused(bad, "maps tensor 'transformer.h.9.mlp.c_fc.weight' to");
  expect_refused(json::array(), "no \"weight_map\" object");
  loom::core::write_file_atomic(dir / models::kHfIndexFile, "{");
  EXPECT_TRUE(contains(error_of([&] { models::load_hf(dir.path()); }), "is not valid JSON"));
  fs::remove(dir / models::kHfIndexFile);
  EXPECT_TRUE(contains(error_of([&] { models::load_hf(dir.path()); }),
                       "holds neither model.safetensors nor model.safetensors.index.json"));
  EXPECT_TRUE(contains(error_of([&] {
                         models::save_hf(*m, dir.path(),
                                         models::HfSaveOptions{.max_shard_bytes = 0});
                       }),
                       "must be a positive number of bytes, not 0"));
}

TEST(HfFiles, TokenIdsGoToConfigAndGenerationConfig) {
  TempDir dir;
  const auto m =
      loom::testing::make_initialized(loom::testing::tiny_model_config(models::Family::kLlama), 7);
  models::save_hf(*m, dir.path(), models::HfSaveOptions{.bos_token_id = 1, .eos_token_id = 2});
  const auto generation = read_json(dir / "generation_config.json");
  EXPECT_EQ(generation["bos_token_id"], 1);
  EXPECT_EQ(generation["eos_token_id"], 2);
  EXPECT_EQ(read_json(dir / "config.json")["eos_token_id"], 2);
  models::save_hf(*m, dir.path());  // no ids: no stale generation config either
  EXPECT_FALSE(fs::exists(dir / "generation_config.json"));
  EXPECT_FALSE(read_json(dir / "config.json").contains("bos_token_id"));
}

// Each rule of the two scalings, computed here from its definition.
TEST(HfFiles, RopeScalingFollowsLinearAndLlama3Rules) {
  auto c = loom::testing::tiny_model_config(models::Family::kLlama);  // head_dim 8
  c.rope_theta = 10000;
  const auto plain = models::rope_inverse_frequencies(c);
  ASSERT_EQ(plain.numel(), 4);
  EXPECT_DOUBLE_EQ(plain[1].item<double>(), std::pow(10000.0, -2.0 / 8));
  c.rope_scaling = {.type = "linear", .factor = 4};
  EXPECT_TRUE(at::allclose(models::rope_inverse_frequencies(c), plain / 4, 0, 0));
  // Wavelengths 2 pi theta^(2i/8): 6.3, 62.8, 628, 6283. With the original context 400 and
  // frequency factors 1 and 20, those above 400 / 1 are scaled, those below 400 / 20 kept, and
  // 62.8 is blended.
  c.rope_scaling = {.type = "llama3",
                    .factor = 8,
                    .low_freq_factor = 1,
                    .high_freq_factor = 20,
                    .original_max_seq_len = 400};
  const auto scaled = models::rope_inverse_frequencies(c);
  const auto f = [&](int i) { return plain[i].item<double>(); };
  EXPECT_DOUBLE_EQ(scaled[0].item<double>(), f(0));  // wavelength 6.3 < 400 / 20
  const double blend = (400 / (2 * M_PI / f(1)) - 1) / (20 - 1);
  EXPECT_NEAR(scaled[1].item<double>(), (1 - blend) * f(1) / 8 + blend * f(1), 1e-15);
  EXPECT_DOUBLE_EQ(scaled[2].item<double>(), f(2) / 8);  // 628 > 400 / 1
  EXPECT_DOUBLE_EQ(scaled[3].item<double>(), f(3) / 8);
  // Factor 1 changes nothing, whatever the band.
  c.rope_scaling.factor = 1;
  EXPECT_TRUE(at::allclose(models::rope_inverse_frequencies(c), plain, 1e-15, 0));

  // The config keeps it (checkpoints), validates it, and the HF round trip keeps it.
  c.rope_scaling.factor = 8;
  EXPECT_EQ(models::ModelConfig::from_json(c.to_json()).rope_scaling, c.rope_scaling);
  auto bad = c;
  bad.rope_scaling.type = "yarn";
  EXPECT_TRUE(contains(error_of([&] { bad.validate(); }), "rope_scaling type 'yarn'"));
  bad = c;
  bad.rope_scaling.factor = 0.5;
  EXPECT_TRUE(contains(error_of([&] { bad.validate(); }), "factor = 0.5 must be at least 1"));
  bad = c;
  bad.rope_scaling.high_freq_factor = 1;
  EXPECT_TRUE(contains(error_of([&] { bad.validate(); }), "low_freq_factor < high_freq_factor"));
  auto gpt2 = loom::testing::tiny_model_config(models::Family::kGpt2);
  gpt2.rope_scaling.type = "linear";
  EXPECT_TRUE(contains(error_of([&] { gpt2.validate(); }), "a gpt2 model has none"));
  TempDir dir;
  const auto m = loom::testing::make_initialized(c, 8);
  models::save_hf(*m, dir.path());
  const auto rp = read_json(dir / "config.json")["rope_parameters"];
  EXPECT_EQ(rp["rope_type"], "llama3");
  EXPECT_EQ(rp["original_max_position_embeddings"], 400);
  const auto back = models::load_hf(dir.path());
  EXPECT_EQ(back->config().rope_scaling, c.rope_scaling);
  torch::NoGradGuard no_grad;
  const auto tokens = at::randint(0, 61, {2, 20}, loom::core::make_generator(3));
  EXPECT_TRUE(at::equal(m->forward(tokens), back->forward(tokens)));
}

TEST(HfFiles, OlderConfigsKeepRopeScalingAtTheTopLevel) {
  TempDir dir;
  const auto m =
      loom::testing::make_initialized(loom::testing::tiny_model_config(models::Family::kLlama), 9);
  models::save_hf(*m, dir.path());
  auto config = read_json(dir / "config.json");
  config.erase("rope_parameters");
  config["rope_theta"] = 500000.0;
  config["rope_scaling"] = {{"type", "llama3"},  // "rope_type" since transformers 4.45
                            {"factor", 8.0},
                            {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 8192}};
  loom::core::write_file_atomic(dir / "config.json", config.dump());
  auto c = models::read_hf_config(dir.path());
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_EQ(c.rope_scaling.original_max_seq_len, 8192);
  config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  loom::core::write_file_atomic(dir / "config.json", config.dump());
  c = models::read_hf_config(dir.path());
  EXPECT_EQ(c.rope_scaling.type, "linear");
  EXPECT_EQ(c.rope_scaling.factor, 2.0);
  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  loom::core::write_file_atomic(dir / "config.json", config.dump());
  EXPECT_TRUE(contains(error_of([&] { models::read_hf_config(dir.path()); }),
                       "rope_type 'yarn' is not supported (default, linear, llama3)"));
  config["rope_scaling"] = {{"rope_type", "linear"}};
  loom::core::write_file_atomic(dir / "config.json", config.dump());
  EXPECT_TRUE(contains(error_of([&] { models::read_hf_config(dir.path()); }),
                       "rope_type 'linear' without a 'factor'"));
  config["rope_scaling"] = nullptr;
  loom::core::write_file_atomic(dir / "config.json", config.dump());
  EXPECT_TRUE(models::read_hf_config(dir.path()).rope_scaling.type.empty());
}
