// loom-elastic's decisions (apps/elastic.h), apart from processes: which ranks an attempt lost,
// and the flags of the relaunch. The processes themselves: ctest reliability.elastic.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "loom/apps/elastic.h"
#include "loom/core/error.h"
#include "loom/core/files.h"

namespace fs = std::filesystem;
namespace el = loom::apps::elastic;
using Args = std::vector<std::string>;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("loom-elastic-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "-" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::error_code ec;
    loom::core::remove_tree(path, ec);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    loom::core::remove_tree(path, ec);
  }
};

void write_status(const fs::path& dir, int rank, const std::string& json) {
  loom::core::write_file_atomic(dir / ("rank-" + std::to_string(rank) + ".json"), json);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const loom::Error& e) {
    return e.what();
  }
  return {};
}

// The value after `flag` in `args`, or "" when the flag is absent.
std::string value_of(const Args& args, const std::string& flag) {
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == flag) return args[i + 1];
  return {};
}

}  // namespace

TEST(Elastic, LostRanksAreTheKilledAndTheVanishedNotThoseTheLauncherStopped) {
  TempDir dir;
  // 0: ended by the launcher's clean-up (asked to stop, then killed with its wrapper);
  // 1: killed by a signal nobody sent through the launcher (the lost one);
  // 2: exited with an error of its own (alive: it reported);
  // 3: no status at all (its wrapper vanished); 4: "running" without a stop request (vanished);
  // 5: asked to stop, then ended by that signal; 6: crashed (SIGSEGV): still there, not lost.
  write_status(dir.path, 0, R"({"rank":0,"state":"running","asked_to_stop":true})");
  write_status(dir.path, 1, R"({"rank":1,"state":"signalled","signal":9,"asked_to_stop":false})");
  write_status(dir.path, 2, R"({"rank":2,"state":"exited","code":1,"asked_to_stop":false})");
  write_status(dir.path, 4, R"({"rank":4,"state":"running","asked_to_stop":false})");
  write_status(dir.path, 5, R"({"rank":5,"state":"signalled","signal":15,"asked_to_stop":true})");
  write_status(dir.path, 6, R"({"rank":6,"state":"signalled","signal":11,"asked_to_stop":false})");
  EXPECT_EQ(el::lost_ranks(dir.path, 7), (std::vector<int64_t>{1, 3, 4}));
  const auto s = el::read_rank_status(dir.path, 1);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->state, "signalled");
  EXPECT_EQ(s->signal, 9);
  EXPECT_FALSE(el::read_rank_status(dir.path, 3).has_value());
}

TEST(Elastic, AStatusFileThatIsNotOneIsReportedByName) {
  TempDir dir;
  write_status(dir.path, 0, "not json");
  write_status(dir.path, 1, R"({"rank":7,"state":"exited"})");
  write_status(dir.path, 2, R"({"rank":2,"state":"sleeping"})");
  EXPECT_NE(error_of([&] { el::read_rank_status(dir.path, 0); })
                .find("rank-0.json' is not a rank "
                      "status file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { el::read_rank_status(dir.path, 1); }).find("rank 7"), std::string::npos);
  EXPECT_NE(error_of([&] { el::read_rank_status(dir.path, 2); }).find("'sleeping'"),
            std::string::npos);
}

TEST(Elastic, WithoutFlagRemovesBothSpellingsAndOnlyThatFlag) {
  const Args args = {"--dp", "4", "--dp-extra", "1", "--dp=2", "--sequence-parallel", "--tp", "2"};
  EXPECT_EQ(el::without_flag(args, "--dp", true),
            (Args{"--dp-extra", "1", "--sequence-parallel", "--tp", "2"}));
  EXPECT_EQ(el::without_flag(args, "--sequence-parallel", false),
            (Args{"--dp", "4", "--dp-extra", "1", "--dp=2", "--tp", "2"}));
}

TEST(Elastic, ARelaunchKeepsTheLayoutWhereItFitsAndAsksThePlannerWhereNot) {
  TempDir dir;
  const auto save = dir.path / "ckpt";  // holds no checkpoint: the relaunch starts afresh
  const Args base = {"--data", "d.bin", "--batch-size", "12", "--save-dir", save.string()};
  // dp 4 -> 3 ranks: the same layout with dp 3.
  auto dp = el::relaunch_args(
      [&] {
        auto a = base;
        a.insert(a.end(), {"--dp", "4", "--resume", "elsewhere"});
        return a;
      }(),
      3, save);
  EXPECT_EQ(value_of(dp.args, "--dp"), "3");
  // No checkpoint of its own yet: from where it started.
  EXPECT_EQ(value_of(dp.args, "--resume"), "elsewhere");
  EXPECT_NE(dp.how.find("the run's layout with dp 3"), std::string::npos) << dp.how;
  // tp 2 over 3 ranks does not divide: the planner, with every layout flag left to it.
  auto a = base;
  a.insert(a.end(), {"--tp", "2", "--zero=1", "--sequence-parallel", "--lr", "1e-3"});
  auto tp = el::relaunch_args(a, 3, save);
  EXPECT_EQ(value_of(tp.args, "--plan"), "auto");
  EXPECT_EQ(value_of(tp.args, "--tp"), "");
  EXPECT_EQ(value_of(tp.args, "--lr"), "1e-3");
  for (const auto& arg : tp.args) {
    EXPECT_NE(arg, "--sequence-parallel");
    EXPECT_NE(arg, "--zero=1");
  }
  EXPECT_NE(tp.how.find("2 ranks per replica do not divide 3 ranks"), std::string::npos) << tp.how;
  // dp 4 -> 5 ranks: 12 sequences do not split over dp 5, the planner again, saying why.
  auto five = el::relaunch_args(base, 5, save);
  EXPECT_EQ(value_of(five.args, "--plan"), "auto");
  EXPECT_NE(five.how.find("--batch-size 12 does not split over dp 5"), std::string::npos)
      << five.how;
  // A run that already plans keeps planning.
  a = base;
  a.insert(a.end(), {"--plan", "auto", "--tp", "2", "--dp", "2"});
  auto planned = el::relaunch_args(a, 3, save);
  EXPECT_EQ(value_of(planned.args, "--tp"), "2");
  EXPECT_EQ(value_of(planned.args, "--dp"), "");  // the old world's
  EXPECT_NE(planned.how.find("--plan auto plans the layout again"), std::string::npos);
  // Bad input names the value.
  EXPECT_NE(error_of([&] { el::relaunch_args(base, 0, save); }).find("not 0"), std::string::npos);
  EXPECT_NE(error_of([&] {
              auto b = base;
              b.push_back("--no-such-flag");
              el::relaunch_args(b, 2, save);
            }).find("--no-such-flag"),
            std::string::npos);
}
