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
  EXPECT_EQ(shard.version(), 1);
  EXPECT_EQ(shard.bytes_per_token(), 2);
  for (int64_t i = 0; i < shard.size(); ++i) ASSERT_EQ(shard.token(i), tokens[size_t(i)]) << i;
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
  EXPECT_EQ(shard.token(299), 299);
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
  // Odd-sized raw files.
  std::ofstream(dir / "odd.u16", std::ios::binary) << "abc";
  EXPECT_TRUE(contains(error_of([&] { data::TokenShard(dir / "odd.u16"); }),
                       "not a multiple of 2: truncated"));
  std::ofstream(dir / "odd.u32", std::ios::binary) << "abcdef";
  EXPECT_TRUE(
      contains(error_of([&] { data::TokenShard(dir / "odd.u32"); }), "raw uint32 token file"));
  // An llm.c version it does not read, named with the ones it does.
  {
    std::vector<int32_t> header(256, 0);
    header[0] = 20240520;
    header[1] = 3;
    std::ofstream out(dir / "v3.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(header.data()), 1024);
  }
  const auto v3 = error_of([&] { data::TokenShard(dir / "v3.bin"); });
  EXPECT_TRUE(contains(v3,
                       "has llm.c version 3; loom reads version 1 (uint16 tokens) and 2 "
                       "(uint32 tokens)"))
      << v3;
  // A version 2 file cut inside its uint32 tokens.
  const std::vector<int32_t> ids = {1, 70000, 128255, 5};
  data::write_llmc_shard(dir / "cut2.bin", ids, 128256);
  fs::resize_file(dir / "cut2.bin", 1024 + 4 * 3 + 2);
  const auto cut2 = error_of([&] { data::TokenShard(dir / "cut2.bin"); });
  EXPECT_TRUE(contains(cut2, "promises 4 tokens (1040 bytes)")) << cut2;
}

// Vocabularies past 65,536 ids (Llama 3's 128,256) are written as llm.c version 2, uint32
// tokens, and read back as they were; up to 65,536 ids the same call writes version 1, so
// shards of small vocabularies stay what llm.c and earlier loom read. Raw *.u32 files likewise.
TEST(Data, LargeVocabulariesGoToVersion2ShardsOfUint32Tokens) {
  TempDir dir;
  EXPECT_EQ(data::llmc_version_for(256), 1);
  EXPECT_EQ(data::llmc_version_for(65536), 1);
  EXPECT_EQ(data::llmc_version_for(65537), 2);
  EXPECT_EQ(data::llmc_version_for(128256), 2);
  std::vector<int32_t> ids(3000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 7919) % 128256);
  ids[5] = 128255;
  ids[6] = 65536;
  data::write_llmc_shard(dir / "big.bin", ids, 128256);
  EXPECT_EQ(fs::file_size(dir / "big.bin"), 1024u + 4 * ids.size());
  std::ifstream in(dir / "big.bin", std::ios::binary);
  int32_t header[3];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 2);
  EXPECT_EQ(header[2], 3000);
  data::TokenShard big(dir / "big.bin");
  EXPECT_EQ(big.version(), 2);
  EXPECT_EQ(big.bytes_per_token(), 4);
  ASSERT_EQ(big.size(), 3000);
  for (int64_t i = 0; i < big.size(); ++i) ASSERT_EQ(big.token(i), ids[size_t(i)]) << i;
  EXPECT_EQ(big.slice(5, 2)[1].item<int64_t>(), 65536);
  big.check_vocab(128256);
  const auto over = error_of([&] { big.check_vocab(128255); });
  EXPECT_TRUE(contains(over, "holds token id 128255 at position 5")) << over;

  // The same call with a small vocabulary writes version 1.
  const std::vector<int32_t> small = {0, 255, 17};
  data::write_llmc_shard(dir / "small.bin", small, 256);
  data::TokenShard s(dir / "small.bin");
  EXPECT_EQ(s.version(), 1);
  EXPECT_EQ(s.token(1), 255);
  // An id outside the vocabulary is refused before anything is written.
  const std::vector<int32_t> bad = {3, 256};
  const auto msg = error_of([&] { data::write_llmc_shard(dir / "bad.bin", bad, 256); });
  EXPECT_TRUE(contains(msg, "id 256 at position 1 is outside the vocabulary of 256 ids")) << msg;
  EXPECT_FALSE(fs::exists(dir / "bad.bin"));
  EXPECT_TRUE(contains(error_of([] { data::llmc_version_for(0); }), "cannot be stored"));

  // Raw uint32.
  {
    std::ofstream out(dir / "t.u32", std::ios::binary);
    out.write(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
  }
  data::TokenShard raw(dir / "t.u32");
  EXPECT_EQ(raw.version(), 0);
  EXPECT_EQ(raw.bytes_per_token(), 4);
  EXPECT_EQ(raw.size(), 3000);
  EXPECT_EQ(raw.token(5), 128255);
  data::TokenShard forced(dir / "t.u32", data::ShardFormat::kRawU32);
  EXPECT_EQ(forced.token(6), 65536);
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
  auto full = a.training_batch(5, 0, 8);
  // Drawing samples 3..5 alone gives the same windows as within the full batch: the data a
  // sample sees does not depend on how the batch is split (micro-batches, ranks).
  auto part = b.training_batch(5, 3, 3);
  EXPECT_TRUE(at::equal(full.inputs.slice(0, 3, 6), part.inputs));
  EXPECT_TRUE(at::equal(a.training_batch(5, 0, 8).inputs, full.inputs));
  EXPECT_FALSE(at::equal(a.training_batch(6, 0, 8).inputs, full.inputs));
  EXPECT_FALSE(at::equal(other.training_batch(5, 0, 8).inputs, full.inputs));
  // Targets are the inputs shifted by one token.
  EXPECT_TRUE(at::equal(full.inputs.slice(1, 1), full.targets.slice(1, 0, 15)));
}

// The keyed permutation behind epoch sampling is a bijection of [0, n) for every n (powers of 4
// and not, 1 included), differs by key, and is not close to the identity.
TEST(Data, PermuteIndexIsABijectionForEveryKeyAndSize) {
  for (const int64_t n : {1, 2, 3, 5, 16, 17, 1000, 4097})
    for (const uint64_t key : {0ull, 7ull, 123456789ull}) {
      std::vector<int64_t> seen(size_t(n), 0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = data::permute_index(i, n, key);
        ASSERT_TRUE(p >= 0 && p < n) << n << " " << key;
        ++seen[size_t(p)];
      }
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), n) << n << " " << key;
    }
  int64_t fixed = 0, same = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    fixed += data::permute_index(i, 1000, 7) == i;
    same += data::permute_index(i, 1000, 7) == data::permute_index(i, 1000, 8);
  }
  EXPECT_LT(fixed, 20);  // a random permutation fixes 1 point on average
  EXPECT_LT(same, 20);
  EXPECT_TRUE(contains(error_of([] { data::permute_index(5, 5, 0); }), "outside [0, 5)"));
}

// Epoch sampling: the samples of epoch 0 (steps 0..77 of 8 samples: 624 windows) start at every
// multiple of seq_len exactly once; epoch 1 visits as many windows, all distinct, its cut shifted
// by one offset in [0, seq_len) and in another order; each window is seq_len + 1 tokens of the
// file; the draw is stateless (a new sampler gives the same batch for any step) and split-free
// (a rank's share equals its rows of the global batch).
TEST(Data, EpochSamplingDrawsEveryWindowOnceAnEpoch) {
  TempDir dir;
  std::vector<int32_t> ids(20000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);  // a token is its position
  data::write_llmc_shard(dir / "pos.bin", ids, 1 << 20);
  auto shard = std::make_shared<data::TokenShard>(dir / "pos.bin");
  const int64_t T = 32, per_step = 8;
  const data::WindowSampler s(shard, T, 42, data::Sampling::kEpoch, per_step);
  const int64_t W = s.windows_per_epoch();
  ASSERT_EQ(W, (20000 - T) / T);  // 624
  ASSERT_EQ(W % per_step, 0);
  auto starts_of_epoch = [&](int64_t epoch) {
    std::vector<int64_t> starts;
    for (int64_t step = epoch * W / per_step; step < (epoch + 1) * W / per_step; ++step) {
      const auto b = s.training_batch(step, 0, per_step);
      EXPECT_TRUE(at::equal(b.inputs.slice(1, 1), b.targets.slice(1, 0, T - 1)));
      for (int64_t i = 0; i < per_step; ++i) {
        const int64_t start = b.inputs[i][0].item<int64_t>();
        // The window is the file's tokens [start, start + T], in order.
        EXPECT_EQ(b.targets[i][T - 1].item<int64_t>(), start + T);
        EXPECT_EQ(s.window_start(step, i), start);
        starts.push_back(start);
      }
    }
    return starts;
  };
  const auto e0 = starts_of_epoch(0), e1 = starts_of_epoch(1);
  auto sorted0 = e0;
  std::sort(sorted0.begin(), sorted0.end());
  for (int64_t w = 0; w < W; ++w) ASSERT_EQ(sorted0[size_t(w)], w * T) << w;
  auto sorted1 = e1;
  std::sort(sorted1.begin(), sorted1.end());
  EXPECT_EQ(std::adjacent_find(sorted1.begin(), sorted1.end()), sorted1.end());
  const int64_t offset = sorted1.front() % T;
  for (const int64_t start : sorted1) {
    EXPECT_EQ(start % T, offset);
    EXPECT_LE(start + T, 19999);
  }
  // Shuffled: few neighbours in draw order are neighbours in the file, and the orders differ.
  int64_t adjacent = 0, equal_order = 0;
  for (size_t i = 1; i < e0.size(); ++i) adjacent += std::abs(e0[i] - e0[i - 1]) == T;
  for (size_t i = 0; i < e0.size(); ++i) equal_order += e0[i] / T == (e1[i] - offset) / T;
  EXPECT_LT(adjacent, 20);
  EXPECT_LT(equal_order, 20);
  // Stateless and split-free.
  const data::WindowSampler fresh(shard, T, 42, data::Sampling::kEpoch, per_step);
  EXPECT_TRUE(
      at::equal(fresh.training_batch(100, 0, 8).inputs, s.training_batch(100, 0, 8).inputs));
  EXPECT_TRUE(at::equal(fresh.training_batch(100, 3, 2).inputs,
                        s.training_batch(100, 0, 8).inputs.slice(0, 3, 5)));
  const data::WindowSampler other_seed(shard, T, 43, data::Sampling::kEpoch, per_step);
  EXPECT_FALSE(
      at::equal(other_seed.training_batch(0, 0, 8).inputs, s.training_batch(0, 0, 8).inputs));
  // Bad use is refused by name.
  EXPECT_TRUE(contains(error_of([&] { s.training_batch(0, 6, 4); }), "not in a global batch of 8"));
  EXPECT_TRUE(
      contains(error_of([&] { data::WindowSampler(shard, T, 1, data::Sampling::kEpoch, 0); }),
               "samples_per_step 0 must be positive"));
  EXPECT_EQ(data::parse_sampling("epoch"), data::Sampling::kEpoch);
  EXPECT_TRUE(
      contains(error_of([] { data::parse_sampling("shuffle"); }), "'shuffle' is not valid"));
  // A shard shorter than two windows still has one window an epoch.
  data::write_llmc_shard(dir / "short.bin", std::span(ids).first(40), 1 << 20);
  const data::WindowSampler tiny(std::make_shared<data::TokenShard>(dir / "short.bin"), T, 1,
                                 data::Sampling::kEpoch, 2);
  EXPECT_EQ(tiny.windows_per_epoch(), 1);
  const auto b = tiny.training_batch(3, 0, 2);
  EXPECT_LE(b.targets[1][T - 1].item<int64_t>(), 39);
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
