// The mesh: validation before any collective, rank layout (tp innermost, then dp, then pp), and
// the communicator of each dimension. Plus the watchdog case that dist_cli_test.sh runs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <thread>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/dist/mesh.h"
#include "loom/dist/watchdog.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::world;
namespace dist = loom::dist;

TEST(MeshShape, ResolvesDpAndRejectsBadShapesWithTheNumbers) {
  EXPECT_EQ((dist::MeshShape{.tp = 2}).resolve(8, 8).dp, 4);
  EXPECT_EQ((dist::MeshShape{.dp = 2, .tp = 2, .pp = 2}).resolve(8, 8).product(), 8);
  auto msg = error_of([] { (dist::MeshShape{.dp = 2, .tp = 2}).resolve(3, 4); });
  EXPECT_TRUE(contains(msg, "dp 2 x tp 2 x pp 1 = 4 ranks, but the world has 3 processes")) << msg;
  msg = error_of([] { (dist::MeshShape{.tp = 0}).resolve(4, 4); });
  EXPECT_TRUE(contains(msg, "--tp 0 is invalid")) << msg;
  msg = error_of([] { (dist::MeshShape{.dp = -2}).resolve(4, 4); });
  EXPECT_TRUE(contains(msg, "--dp -2 is invalid")) << msg;
  msg = error_of([] { (dist::MeshShape{.pp = -1}).resolve(4, 4); });
  EXPECT_TRUE(contains(msg, "--pp -1 is invalid")) << msg;
  msg = error_of([] { (dist::MeshShape{.tp = 2}).resolve(3, 4); });
  EXPECT_TRUE(contains(msg, "does not divide the world of 3 processes")) << msg;
  msg = error_of([] { (dist::MeshShape{.cp = 2}).resolve(4, 4); });
  EXPECT_TRUE(contains(msg, "cp 2 is not supported")) << msg;
  // tp wider than a node only warns.
  EXPECT_EQ((dist::MeshShape{.tp = 4}).resolve(4, 2).dp, 1);
}

TEST(Mesh, ABadShapeFailsOnEveryRankBeforeAnyCollective) {
  auto& w = world();
  const auto before = w.collectives_issued();
  const auto msg =
      error_of([&] { dist::Mesh mesh(loom::testing::runtime().world(), {.dp = w.size() + 1}); });
  EXPECT_TRUE(contains(msg, fmt::format("but the world has {} processes", w.size()))) << msg;
  EXPECT_EQ(w.collectives_issued(), before);
}

TEST(Mesh, RankLayoutPutsTpInnermostThenDpThenPp) {
  auto& w = world();
  const int n = w.size();
  // Every factorization of the world into dp x tp x pp.
  for (int tp = 1; tp <= n; ++tp)
    for (int pp = 1; pp <= n; ++pp) {
      if (n % (tp * pp) != 0) continue;
      const int dp = n / (tp * pp);
      dist::Mesh mesh(loom::testing::runtime().world(), {.tp = tp, .pp = pp});
      ASSERT_EQ(mesh.size(dist::Dim::dp), dp);
      const int r = w.rank();
      EXPECT_EQ(mesh.coord(dist::Dim::tp), r % tp);
      EXPECT_EQ(mesh.coord(dist::Dim::dp), (r / tp) % dp);
      EXPECT_EQ(mesh.coord(dist::Dim::pp), r / (tp * dp));
      EXPECT_EQ(mesh.rank_at(mesh.coords_of(r)), r);
      for (auto d : {dist::Dim::tp, dist::Dim::cp, dist::Dim::dp, dist::Dim::pp}) {
        auto& c = mesh.comm(d);
        ASSERT_EQ(c.size(), mesh.size(d)) << dist::to_string(d);
        EXPECT_EQ(c.rank(), mesh.coord(d)) << dist::to_string(d);
        EXPECT_EQ(c.name(), dist::to_string(d));
        // The group's members: the ranks whose other coordinates equal ours.
        auto members = at::zeros({c.size()}, at::kLong);
        c.all_gather(members, at::full({1}, static_cast<int64_t>(r), at::kLong));
        for (int64_t i = 0; i < c.size(); ++i) {
          auto coords = mesh.coords_of(r);
          coords[static_cast<size_t>(d)] = i;
          EXPECT_EQ(members[i].item<int64_t>(), mesh.rank_at(coords))
              << dist::to_string(d) << " tp=" << tp << " pp=" << pp;
        }
      }
    }
}

TEST(Mesh, SingleProcessNeedsNoMpi) {
  auto mesh = dist::Mesh::single_process();
  EXPECT_EQ(mesh->world_size(), 1);
  EXPECT_EQ(mesh->comm(dist::Dim::dp).backend(), "local");
  auto t = at::ones({3});
  mesh->comm(dist::Dim::dp).all_reduce(t, dist::ReduceOp::Avg);
  EXPECT_EQ(t.sum().item<float>(), 3.0f);
}

TEST(Watchdog, MessageNamesOpGroupSequenceRankAndTensor) {
  dist::OpInfo info{.group = "dp",
                    .group_rank = 1,
                    .group_size = 2,
                    .world_rank = 3,
                    .local_rank = 1,
                    .timeout = dist::Seconds(5)};
  info.call = {.kind = static_cast<int64_t>(dist::OpKind::AllReduce),
               .dtype = static_cast<int64_t>(at::kFloat),
               .seq = 17,
               .numel = 1024,
               .ndim = 1,
               .dims = {1024}};
  const auto msg = dist::Watchdog::timeout_message(info, dist::Seconds(5.2));
  EXPECT_TRUE(contains(msg,
                       "all_reduce(sum) #17 on group 'dp' (rank 1 of 2; world rank 3, "
                       "local rank 1) Float[1024]"))
      << msg;
  EXPECT_TRUE(contains(msg, "has not completed after 5.2 s")) << msg;
  EXPECT_TRUE(contains(msg, "aborting the job")) << msg;
}

// Run by tests/dist/dist_cli_test.sh, not by the normal suite: rank 1 never issues the
// all_reduce, so rank 0 hangs until the watchdog aborts the job.
TEST(WatchdogProvoke, DISABLED_RankSkipsACollective) {
  auto& w = world();
  ASSERT_GE(w.size(), 2);
  auto t = at::ones({1024});
  w.all_reduce(t);                     // everyone: #N
  if (w.rank() != 1) w.all_reduce(t);  // rank 1 skips #N+1
  std::this_thread::sleep_for(std::chrono::seconds(60));
  FAIL() << "the watchdog should have aborted the job";
}
