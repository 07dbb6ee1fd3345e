#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>

#include "loom/core/files.h"
#include "loom/core/rng.h"
#include "loom/core/safetensors.h"
#include "test_util.h"

using loom::testing::error_of;
using loom::testing::TempDir;
namespace core = loom::core;

TEST(Core, Crc32MatchesTheStandardCheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(core::crc32(s.data(), s.size()), 0xCBF43926U);
  // Continuing a CRC over two halves equals one pass.
  EXPECT_EQ(core::crc32(s.data() + 4, 5, core::crc32(s.data(), 4)), 0xCBF43926U);
}

TEST(Core, StableHashAndMixSeedAreDeterministicAndSpread) {
  EXPECT_EQ(core::stable_hash("transformer.wte.weight"),
            core::stable_hash("transformer.wte.weight"));
  EXPECT_NE(core::stable_hash("a"), core::stable_hash("b"));
  EXPECT_EQ(core::stable_hash(""), 1469598103934665603ULL);  // FNV-1a offset basis
  EXPECT_EQ(core::mix_seed({1, 2, 3}), core::mix_seed({1, 2, 3}));
  EXPECT_NE(core::mix_seed({1, 2, 3}), core::mix_seed({1, 3, 2}));
}

TEST(Core, GeneratorWithSameSeedGivesSameValues) {
  auto a = at::empty({64}).normal_(0, 1, core::make_generator(7));
  auto b = at::empty({64}).normal_(0, 1, core::make_generator(7));
  auto c = at::empty({64}).normal_(0, 1, core::make_generator(8));
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, c));
}

TEST(Core, SafetensorsRoundTripsEveryDtype) {
  TempDir dir;
  core::NamedTensors tensors;
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16})
    tensors.emplace_back(std::string("t_") + c10::toString(dtype), at::randn({3, 5}).to(dtype));
  tensors.emplace_back("ints", at::arange(10, at::kLong).view({2, 5}));
  tensors.emplace_back("i32", at::arange(7, at::kInt));
  tensors.emplace_back("bytes", at::arange(9, at::kByte));
  tensors.emplace_back("scalar", at::tensor(3.5));
  tensors.emplace_back("empty", at::empty({0, 4}));
  tensors.emplace_back("noncontiguous", at::randn({4, 6}).t());
  core::save_safetensors(dir / "x.safetensors", tensors, {{"format", "pt"}, {"k", "v"}});
  auto back = core::load_safetensors(dir / "x.safetensors");
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(back.tensors.count(name)) << name;
    EXPECT_EQ(back.tensors[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(back.tensors[name], t.contiguous())) << name;
  }
  EXPECT_EQ(back.metadata.at("k"), "v");
  EXPECT_FALSE(std::filesystem::exists(dir / "x.safetensors.tmp"));
}

TEST(Core, SafetensorsReportsTruncationAndGarbage) {
  TempDir dir;
  core::save_safetensors(dir / "x.safetensors", {{"w", at::randn({100})}});
  std::filesystem::resize_file(dir / "x.safetensors",
                               std::filesystem::file_size(dir / "x.safetensors") - 10);
  EXPECT_NE(
      error_of([&] { core::load_safetensors(dir / "x.safetensors"); }).find("outside the file"),
      std::string::npos);
  std::ofstream(dir / "bad.safetensors") << "not a safetensors file at all";
  EXPECT_NE(
      error_of([&] { core::load_safetensors(dir / "bad.safetensors"); }).find("bad.safetensors"),
      std::string::npos);
  EXPECT_NE(error_of([&] { core::load_safetensors(dir / "missing.safetensors"); }).find("missing"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] {
        core::save_safetensors(dir / "dup.safetensors", {{"a", at::ones(1)}, {"a", at::ones(1)}});
      }).find("appears twice"),
      std::string::npos);
}

TEST(Core, AtomicWriteReplacesWholeFile) {
  TempDir dir;
  core::write_file_atomic(dir / "f.txt", "first version");
  core::write_file_atomic(dir / "f.txt", "second");
  EXPECT_EQ(core::read_file(dir / "f.txt"), "second");
  EXPECT_FALSE(std::filesystem::exists(dir / "f.txt.tmp"));
}

TEST(Core, EnsureWritableDirNamesTheProblem) {
  TempDir dir;
  core::ensure_writable_dir(dir / "a" / "b");
  EXPECT_TRUE(std::filesystem::is_directory(dir / "a" / "b"));
  std::ofstream(dir / "file") << "x";
  EXPECT_NE(error_of([&] { core::ensure_writable_dir(dir / "file"); }).find("file"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              core::ensure_writable_dir("/proc/loom-cannot-be-here");
            }).find("/proc/loom-cannot-be-here"),
            std::string::npos);
}
