// Data mixtures: --data specs, the stateless mixing rule, and epochs of each source over its
// shards.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "loom/core/files.h"
#include "loom/data/mixture.h"
#include "loom/data/sampler.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace data = loom::data;
namespace fs = std::filesystem;

namespace {

// A shard whose tokens are `base` + their positions: a window's first token says where it is.
void write_positions(const fs::path& path, int32_t base, int64_t n) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[size_t(i)] = base + int32_t(i);
  data::write_llmc_shard(path, ids, 1 << 20);
}

std::shared_ptr<const data::TokenShard> open(const fs::path& path) {
  return std::make_shared<data::TokenShard>(path);
}

}  // namespace

TEST(Mixture, ParsesSourcesNamesWeightsAndGlobs) {
  TempDir dir;
  fs::create_directories(dir / "web");
  for (const char* name : {"shard_001.bin", "shard_000.bin", "notes.txt"})
    write_positions(dir / "web" / name, 0, 100);
  write_positions(dir / "code.bin", 0, 100);
  const auto web = (dir / "web").string(), code = (dir / "code.bin").string();
  auto sources = data::parse_data_sources(web + "/shard_*.bin:0.7," + code + ":0.3");
  ASSERT_EQ(sources.size(), 2u);
  EXPECT_EQ(sources[0].name, "web");  // a glob: its directory's name
  EXPECT_EQ(sources[0].paths,
            (std::vector<fs::path>{dir / "web" / "shard_000.bin", dir / "web" / "shard_001.bin"}));
  EXPECT_EQ(sources[1].name, "code");  // a file: its stem
  EXPECT_DOUBLE_EQ(sources[0].weight, 0.7);
  EXPECT_DOUBLE_EQ(sources[1].weight, 0.3);
  // Weights are normalized; NAME= names a source; one plain path is one source of weight 1.
  sources = data::parse_data_sources("a=" + code + ":3,b=" + code);
  EXPECT_EQ(sources[0].name, "a");
  EXPECT_DOUBLE_EQ(sources[0].weight, 0.75);
  EXPECT_DOUBLE_EQ(sources[1].weight, 0.25);
  sources = data::parse_data_sources(code);
  ASSERT_EQ(sources.size(), 1u);
  EXPECT_EQ(sources[0].paths, std::vector<fs::path>{code});
  EXPECT_DOUBLE_EQ(sources[0].weight, 1.0);

  const auto refused = [&](const std::string& spec, const std::string& part) {
    const auto msg = error_of([&] { data::parse_data_sources(spec, "--val-data"); });
    EXPECT_TRUE(contains(msg, part)) << spec << ": " << msg;
    EXPECT_TRUE(contains(msg, "--val-data")) << msg;
  };
  refused("", "is empty");
  refused(code + ",," + code, "has an empty entry");
  refused(code + ":x", "the weight 'x' of '" + code + ":x' is not a positive number");
  refused(code + ":0", "the weight '0'");
  refused(code + ":-1", "the weight '-1'");
  refused(code + ":nan", "the weight 'nan'");
  refused(web + "/*.u32", "matches no file");
  refused((dir / "none.bin").string(),
          "token file '" + (dir / "none.bin").string() + "' does not exist");
  refused(web, "is a directory; name its shards");
  refused(code + "," + code, "two sources are named 'code'");
  refused("x=:2", "names no path");
}

TEST(Mixture, QuotasAreExactPerBlockAndEachSourceIsDealtEveryIndexOnce) {
  const data::MixtureSchedule mix({0.7, 0.2, 0.1}, 5);
  const auto& q = mix.quotas();
  ASSERT_EQ(q.size(), 3u);
  EXPECT_EQ(q[0] + q[1] + q[2], data::MixtureSchedule::kBlock);
  for (size_t s = 0; s < 3; ++s)
    EXPECT_LE(std::abs(double(q[s]) - std::vector{0.7, 0.2, 0.1}[s] * 4096), 1.0) << s;
  // Over three blocks, source s is dealt exactly its indices 0 .. 3 q_s - 1, each once.
  std::vector<std::set<int64_t>> seen(3);
  for (int64_t g = 0; g < 3 * data::MixtureSchedule::kBlock; ++g) {
    const auto d = mix.draw(g);
    ASSERT_TRUE(seen[size_t(d.source)].insert(d.index).second) << g;
  }
  for (size_t s = 0; s < 3; ++s) {
    EXPECT_EQ(int64_t(seen[s].size()), 3 * q[s]);
    EXPECT_EQ(*seen[s].rbegin(), 3 * q[s] - 1);
  }
  // A batch's share is a draw without replacement from the block: within 5 standard deviations
  // of the hypergeometric's, over the first 64 batches of 16 (and the block order is not the
  // sources in turn: few runs of one source fill a whole batch).
  const int64_t n = 1024, N = data::MixtureSchedule::kBlock;
  std::vector<int64_t> count(3, 0);
  for (int64_t g = 0; g < n; ++g) ++count[size_t(mix.draw(g).source)];
  for (size_t s = 0; s < 3; ++s) {
    const double p = double(q[s]) / double(N);
    const double sd = std::sqrt(double(n) * p * (1 - p) * double(N - n) / double(N - 1));
    EXPECT_LE(std::abs(double(count[s]) - double(n) * p), 5 * sd) << s << ": " << count[s];
  }
  // Stateless: another schedule with the seed agrees; another seed deals another order.
  const data::MixtureSchedule again({0.7, 0.2, 0.1}, 5), other({0.7, 0.2, 0.1}, 6);
  int64_t differ = 0;
  for (int64_t g = 0; g < 200; ++g) {
    EXPECT_EQ(again.draw(g).source, mix.draw(g).source);
    EXPECT_EQ(again.draw(g).index, mix.draw(g).index);
    differ += other.draw(g).source != mix.draw(g).source;
  }
  EXPECT_GT(differ, 20);
  // One source: sample g is its g-th.
  const data::MixtureSchedule one({2.0}, 1);
  EXPECT_EQ(one.draw(123456).index, 123456);
  EXPECT_TRUE(contains(error_of([] {
                         data::MixtureSchedule({1.0, 1e-5}, 1);
                       }),
                       "below 1/8192 of it"));
  EXPECT_TRUE(contains(error_of([] {
                         data::MixtureSchedule({1.0, -1.0}, 1);
                       }),
                       "weight -1 must be positive"));
  EXPECT_TRUE(contains(error_of([] { data::MixtureSchedule({}, 1); }), "at least one source"));
}

// Two sources, the first of two shards: within each epoch of a source, every window of every
// shard of it is drawn once; the windows are the shards' own tokens; samples_drawn counts what
// the draws say.
TEST(Mixture, EachSourceDrawsEveryWindowOfItsShardsOnceAnEpoch) {
  TempDir dir;
  const int64_t T = 16, per_step = 8;
  write_positions(dir / "a0.bin", 0, 1000);      // 61 windows
  write_positions(dir / "a1.bin", 100000, 500);  // 30 windows
  write_positions(dir / "b.bin", 200000, 700);   // 42 windows
  std::vector<data::SamplerSource> sources = {
      {"a", {open(dir / "a0.bin"), open(dir / "a1.bin")}, 0.6}, {"b", {open(dir / "b.bin")}, 0.4}};
  const data::WindowSampler s(sources, T, 7, data::Sampling::kEpoch, per_step);
  ASSERT_EQ(s.windows_per_epoch(0), 61 + 30);
  ASSERT_EQ(s.windows_per_epoch(1), 42);
  EXPECT_EQ(s.tokens(), 2200);
  // Draw until each source has done two epochs; keep each source's windows in draw order.
  std::map<int64_t, std::vector<int64_t>> drawn;  // source -> first tokens
  int64_t step = 0;
  while (int64_t(drawn[0].size()) < 2 * 91 || int64_t(drawn[1].size()) < 2 * 42) {
    const auto b = s.training_batch(step, 0, per_step);
    EXPECT_TRUE(at::equal(b.inputs.slice(1, 1), b.targets.slice(1, 0, T - 1)));
    for (int64_t i = 0; i < per_step; ++i) {
      const auto w = s.window(step, i);
      const int64_t first = b.inputs[i][0].item<int64_t>();
      const int32_t base = w.source == 1 ? 200000 : w.shard == 1 ? 100000 : 0;
      EXPECT_EQ(first, base + w.start);
      EXPECT_EQ(b.targets[i][T - 1].item<int64_t>(), first + T);  // inside its shard
      drawn[w.source].push_back(first);
    }
    ++step;
  }
  const auto check_epoch = [&](int64_t source, int64_t epoch, int64_t W) {
    std::vector<int64_t> e(drawn[source].begin() + epoch * W,
                           drawn[source].begin() + (epoch + 1) * W);
    std::sort(e.begin(), e.end());
    EXPECT_EQ(std::adjacent_find(e.begin(), e.end()), e.end()) << source << " " << epoch;
    if (epoch == 0) {  // the unshifted cut: every multiple of T of every shard
      std::vector<int64_t> want;
      if (source == 0) {
        for (int64_t w = 0; w < 61; ++w) want.push_back(w * T);
        for (int64_t w = 0; w < 30; ++w) want.push_back(100000 + w * T);
      } else {
        for (int64_t w = 0; w < 42; ++w) want.push_back(200000 + w * T);
      }
      EXPECT_EQ(e, want) << source;
    }
  };
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    check_epoch(0, epoch, 91);
    check_epoch(1, epoch, 42);
  }
  const auto counts = s.samples_drawn(step * per_step);
  EXPECT_EQ(counts[0], int64_t(drawn[0].size()));
  EXPECT_EQ(counts[1], int64_t(drawn[1].size()));
  // A source of one shard keeps a one-shard sampler's draw; random sampling takes one shard.
  const data::WindowSampler one(open(dir / "b.bin"), T, 7, data::Sampling::kEpoch, per_step);
  const data::WindowSampler wrapped({{"b", {open(dir / "b.bin")}, 1.0}}, T, 7,
                                    data::Sampling::kEpoch, per_step);
  for (int64_t st = 0; st < 30; ++st)
    EXPECT_TRUE(at::equal(one.training_batch(st, 0, per_step).inputs,
                          wrapped.training_batch(st, 0, per_step).inputs));
  EXPECT_TRUE(contains(
      error_of([&] { data::WindowSampler(sources, T, 7, data::Sampling::kRandom, per_step); }),
      "--sampling random draws from one token file"));
  write_positions(dir / "short.bin", 0, 16);
  EXPECT_TRUE(contains(error_of([&] {
                         data::WindowSampler(
                             {{"a", {open(dir / "a0.bin"), open(dir / "short.bin")}, 1}}, T, 7,
                             data::Sampling::kEpoch, per_step);
                       }),
                       "short.bin' has 16 tokens; a window of seq_len 16 needs at least 17"));
}

// Validation reads the shards in order, a window never crossing from one shard to the next.
TEST(Mixture, SequentialWindowsRunThroughTheShardsInOrder) {
  TempDir dir;
  write_positions(dir / "a.bin", 0, 45);     // (45 - 1) / 10 = 4 windows
  write_positions(dir / "b.bin", 1000, 31);  // 3 windows
  const data::WindowSampler s({{"v", {open(dir / "a.bin"), open(dir / "b.bin")}, 1}}, 10, 0,
                              data::Sampling::kEpoch, 1);
  ASSERT_EQ(s.num_sequential_windows(), 7);
  const auto b = s.sequential_batch(2, 4);
  std::vector<int64_t> firsts;
  for (int64_t i = 0; i < 4; ++i) firsts.push_back(b.inputs[i][0].item<int64_t>());
  EXPECT_EQ(firsts, (std::vector<int64_t>{20, 30, 1000, 1010}));
  EXPECT_EQ(b.targets[3][9].item<int64_t>(), 1020);
  EXPECT_TRUE(contains(error_of([&] { s.sequential_batch(5, 3); }), "do not fit"));
}
