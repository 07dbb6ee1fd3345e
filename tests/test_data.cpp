#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <numeric>

#include "loom/data/sampler.h"
#include "loom/data/token_shard.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace data = loom::data;
namespace fs = std::filesystem;

namespace {
std::vector<uint16_t> iota_tokens(size_t n, uint16_t mod = 50000) {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i % mod);
  return t;
}
}  // namespace

TEST(Data, LlmcShardRoundTripsAndMatchesTheFormat) {
  TempDir dir;
  const auto tokens = iota_tokens(5000);
  data::write_llmc_shard(dir / "a.bin", tokens);
  // The byte layout llm.c's readers expect: 256 int32 header, then uint16 tokens.
  EXPECT_EQ(fs::file_size(dir / "a.bin"), 1024u + 2 * tokens.size());
  std::ifstream in(dir / "a.bin", std::ios::binary);
  int32_t header[3];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 5000);

  data::TokenShard shard(dir / "a.bin");
  ASSERT_EQ(shard.size(), 5000);
  EXPECT_TRUE(std::equal(tokens.begin(), tokens.end(), shard.tokens().begin()));
  auto s = shard.slice(10, 5);
  EXPECT_EQ(s.scalar_type(), at::kLong);
  EXPECT_EQ(s[4].item<int64_t>(), 14);
}

TEST(Data, RawUint16FilesAreReadByExtensionOrFormat) {
  TempDir dir;
  const auto tokens = iota_tokens(300);
  {
    std::ofstream out(dir / "t.u16", std::ios::binary);
    out.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  }
  data::TokenShard shard(dir / "t.u16");
  EXPECT_EQ(shard.size(), 300);
  EXPECT_EQ(shard.tokens()[299], 299);
  fs::copy_file(dir / "t.u16", dir / "t.data");
  data::TokenShard forced(dir / "t.data", data::ShardFormat::kRawU16);
  EXPECT_EQ(forced.size(), 300);
}

TEST(Data, BadFilesGiveErrorsThatNameTheProblem) {
  TempDir dir;
  EXPECT_TRUE(contains(error_of([&] { data::TokenShard(dir / "missing.bin"); }), "missing.bin"));
  {  // wrong magic
    std::vector<int32_t> header(256, 0);
    header[0] = 12345;
    std::ofstream out(dir / "magic.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
  }
  const auto magic = error_of([&] { data::TokenShard(dir / "magic.bin"); });
  EXPECT_TRUE(contains(magic, "wrong magic 12345")) << magic;
  EXPECT_TRUE(contains(magic, "20240520")) << magic;
  // Truncated: the header promises more tokens than the file holds.
  data::write_llmc_shard(dir / "cut.bin", iota_tokens(1000));
  fs::resize_file(dir / "cut.bin", 1024 + 2 * 600);
  const auto cut = error_of([&] { data::TokenShard(dir / "cut.bin"); });
  EXPECT_TRUE(contains(cut, "truncated")) << cut;
  EXPECT_TRUE(contains(cut, "1000 tokens")) << cut;
  // Shorter than the header.
  fs::resize_file(dir / "cut.bin", 100);
  EXPECT_TRUE(contains(error_of([&] { data::TokenShard(dir / "cut.bin"); }), "truncated"));
  // Odd-sized raw file.
  std::ofstream(dir / "odd.u16", std::ios::binary) << "abc";
  EXPECT_TRUE(contains(error_of([&] { data::TokenShard(dir / "odd.u16"); }), "odd size"));
  // Unsupported llm.c version (2 = uint32 tokens).
  {
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 2;
    std::ofstream out(dir / "v2.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
  }
  EXPECT_TRUE(contains(error_of([&] { data::TokenShard(dir / "v2.bin"); }), "version 2"));
}

TEST(Data, TokenIdAtOrAboveVocabIsReportedWithItsPosition) {
  TempDir dir;
  auto tokens = iota_tokens(100, 200);
  tokens[77] = 256;
  data::write_llmc_shard(dir / "a.bin", tokens);
  data::TokenShard shard(dir / "a.bin");
  shard.check_vocab(257);
  const auto msg = error_of([&] { shard.check_vocab(256); });
  EXPECT_TRUE(contains(msg, "token id 256 at position 77")) << msg;
}

TEST(Data, RandomBatchesDependOnlyOnSeedStepAndIndex) {
  TempDir dir;
  data::write_llmc_shard(dir / "a.bin", iota_tokens(10000));
  auto shard = std::make_shared<data::TokenShard>(dir / "a.bin");
  data::WindowSampler a(shard, 16, 42), b(shard, 16, 42), other(shard, 16, 43);
  auto full = a.random_batch(5, 0, 8);
  // Drawing samples 3..5 alone gives the same windows as within the full batch: the data a
  // sample sees does not depend on how the batch is split (micro-batches, ranks).
  auto part = b.random_batch(5, 3, 3);
  EXPECT_TRUE(at::equal(full.inputs.slice(0, 3, 6), part.inputs));
  EXPECT_TRUE(at::equal(a.random_batch(5, 0, 8).inputs, full.inputs));
  EXPECT_FALSE(at::equal(a.random_batch(6, 0, 8).inputs, full.inputs));
  EXPECT_FALSE(at::equal(other.random_batch(5, 0, 8).inputs, full.inputs));
  // Targets are the inputs shifted by one token.
  EXPECT_TRUE(at::equal(full.inputs.slice(1, 1), full.targets.slice(1, 0, 15)));
}

TEST(Data, SequentialWindowsFollowFileOrder) {
  TempDir dir;
  data::write_llmc_shard(dir / "a.bin", iota_tokens(101));
  auto shard = std::make_shared<data::TokenShard>(dir / "a.bin");
  data::WindowSampler s(shard, 10, 0);
  EXPECT_EQ(s.num_sequential_windows(), 10);
  auto b = s.sequential_batch(2, 3);
  EXPECT_EQ(b.inputs[0][0].item<int64_t>(), 20);
  EXPECT_EQ(b.targets[2][9].item<int64_t>(), 50);
  EXPECT_TRUE(contains(error_of([&] { s.sequential_batch(9, 2); }), "do not fit"));
  EXPECT_TRUE(contains(error_of([&] { data::WindowSampler(shard, 101, 0); }), "at least 102"));
}
