// The mesh: validation before any collective, rank layout (tp innermost, then dp, then pp), and
// the communicator of each dimension. Plus the watchdog case that dist_cli_test.sh runs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <thread>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/dist/backend_plan.h"
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
  EXPECT_EQ((dist::MeshShape{.cp = 2}).resolve(4, 4).dp, 2);
  msg = error_of([] { (dist::MeshShape{.cp = 3}).resolve(4, 4); });
  EXPECT_TRUE(contains(msg, "tp 1 x pp 1 x cp 3 = 3 ranks does not divide the world of 4")) << msg;
  msg = error_of([] { (dist::MeshShape{.cp = 0}).resolve(4, 4); });
  EXPECT_TRUE(contains(msg, "--cp 0 is invalid")) << msg;
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

// The transport of each group from made-up device maps (no GPU needed): NCCL where a group's
// ranks have distinct GPUs, MPI staging where two share one, MPI for CPU ranks; and the errors.
// --device cuda spreads a node's ranks over its GPUs (sharing when there are more ranks);
// cuda:K pins every rank to K; a device that is not there names the flag's value.
TEST(BackendPlan, EachRankTakesItsNodesGpuByLocalRank) {
  EXPECT_EQ(dist::rank_cuda_device("cpu", 3, 0, false), -1);
  EXPECT_EQ(dist::rank_cuda_device("cuda", 0, 8, true), 0);
  EXPECT_EQ(dist::rank_cuda_device("cuda", 5, 8, true), 5);
  EXPECT_EQ(dist::rank_cuda_device("cuda", 1, 1, true), 0);  // two ranks share one GPU
  EXPECT_EQ(dist::rank_cuda_device("cuda", 5, 4, true), 1);
  EXPECT_EQ(dist::rank_cuda_device("cuda:2", 0, 4, true), 2);
  EXPECT_EQ(dist::rank_cuda_device("cuda:2", 3, 4, true), 2);
  EXPECT_TRUE(contains(error_of([] { dist::rank_cuda_device("cuda", 0, 0, false); }),
                       "--device cuda: there is no such CUDA device (0 visible; this loom was "
                       "built without CUDA)"));
  EXPECT_TRUE(contains(error_of([] { dist::rank_cuda_device("cuda:4", 0, 4, true); }),
                       "--device cuda:4: there is no such CUDA device (4 visible"));
  EXPECT_TRUE(contains(error_of([] { dist::rank_cuda_device("cuda:x", 0, 4, true); }),
                       "--device 'cuda:x' is not valid: cpu, cuda or cuda:N"));
}

TEST(BackendPlan, EachGroupGetsNcclOnlyWhereItsRanksHaveDistinctGpus) {
  using dist::Transport;
  const dist::BackendFacts nccl{.nccl_available = true}, no_nccl{};
  auto gpus = [](std::vector<int> devices, std::vector<std::string> hosts = {}) {
    std::vector<dist::RankDevice> out;
    for (size_t r = 0; r < devices.size(); ++r)
      out.push_back({hosts.empty() ? "node0" : hosts[r], devices[r]});
    return out;
  };
  const auto automatic = dist::BackendChoice::automatic;
  // dp 2 on two GPUs: NCCL; on one GPU: staged MPI; in a build without NCCL: staged MPI.
  const dist::MeshShape dp2{.dp = 2};
  EXPECT_EQ(dist::plan_backends(dp2, gpus({0, 1}), automatic, nccl).of(dist::Dim::dp),
            Transport::nccl);
  EXPECT_EQ(dist::plan_backends(dp2, gpus({0, 0}), automatic, nccl).of(dist::Dim::dp),
            Transport::mpi_staged);
  EXPECT_EQ(dist::plan_backends(dp2, gpus({0, 1}), automatic, no_nccl).of(dist::Dim::dp),
            Transport::mpi_staged);
  // The same device index on two hosts is two GPUs.
  EXPECT_EQ(dist::plan_backends(dp2, gpus({0, 0}, {"a", "b"}), automatic, nccl).of(dist::Dim::dp),
            Transport::nccl);
  // Ranks with their own CUDA_VISIBLE_DEVICES each see their GPU as device 0: the GPU's
  // identity tells them apart; ranks that report one identity share that GPU.
  auto with_ids = [&](std::vector<std::string> ids) {
    auto out = gpus(std::vector<int>(ids.size(), 0));
    for (size_t r = 0; r < ids.size(); ++r) out[r].gpu_id = ids[r];
    return out;
  };
  EXPECT_EQ(
      dist::plan_backends(dp2, with_ids({"GPU-aa", "GPU-bb"}), automatic, nccl).of(dist::Dim::dp),
      Transport::nccl);
  EXPECT_EQ(
      dist::plan_backends(dp2, with_ids({"GPU-aa", "GPU-aa"}), automatic, nccl).of(dist::Dim::dp),
      Transport::mpi_staged);
  EXPECT_TRUE(contains(
      error_of([&] {
        dist::plan_backends(dp2, with_ids({"GPU-aa", "GPU-aa"}), dist::BackendChoice::nccl, nccl);
      }),
      "ranks 0 and 1 share cuda:0 (GPU-aa) of node0"));
  // --dist-backend mpi: MPI even where NCCL could run; CUDA-aware MPI takes device memory.
  EXPECT_EQ(
      dist::plan_backends(dp2, gpus({0, 1}), dist::BackendChoice::mpi, nccl).of(dist::Dim::dp),
      Transport::mpi_staged);
  EXPECT_EQ(dist::plan_backends(dp2, gpus({0, 1}), dist::BackendChoice::mpi,
                                {.nccl_available = true, .mpi_cuda_aware = true})
                .of(dist::Dim::dp),
            Transport::mpi_cuda);
  // dp 2 x tp 2 on two GPUs, rank r on GPU r / 2: each tp pair shares a GPU (staged), each dp
  // pair spans both (NCCL); pp and cp have one rank each.
  const dist::MeshShape dp2tp2{.dp = 2, .tp = 2};
  auto plan = dist::plan_backends(dp2tp2, gpus({0, 0, 1, 1}), automatic, nccl);
  EXPECT_EQ(plan.of(dist::Dim::tp), Transport::mpi_staged);
  EXPECT_EQ(plan.of(dist::Dim::dp), Transport::nccl);
  EXPECT_EQ(plan.of(dist::Dim::pp), Transport::local);
  EXPECT_EQ(plan.describe(dp2tp2), "dp nccl, tp mpi (CUDA tensors staged through host memory)");
  // ... and with rank r on GPU r % 2 it is the other way round.
  plan = dist::plan_backends(dp2tp2, gpus({0, 1, 0, 1}), automatic, nccl);
  EXPECT_EQ(plan.of(dist::Dim::tp), Transport::nccl);
  EXPECT_EQ(plan.of(dist::Dim::dp), Transport::mpi_staged);
  // pp 2 x dp 2 x tp 2 on four GPUs, two ranks each (r / 2): tp staged, dp and pp NCCL.
  plan = dist::plan_backends({.dp = 2, .tp = 2, .pp = 2}, gpus({0, 0, 1, 1, 2, 2, 3, 3}), automatic,
                             nccl);
  EXPECT_EQ(plan.of(dist::Dim::tp), Transport::mpi_staged);
  EXPECT_EQ(plan.of(dist::Dim::dp), Transport::nccl);
  EXPECT_EQ(plan.of(dist::Dim::pp), Transport::nccl);
  // CPU ranks: MPI; one rank: nothing to plan.
  plan = dist::plan_backends(dp2tp2, gpus({-1, -1, -1, -1}), automatic, nccl);
  EXPECT_EQ(plan.of(dist::Dim::dp), Transport::mpi);
  EXPECT_EQ(plan.of(dist::Dim::tp), Transport::mpi);
  EXPECT_EQ(dist::plan_backends({.dp = 1}, gpus({3}), automatic, nccl).describe({.dp = 1}),
            "one rank: no communication");

  // Errors name the group, the ranks and the way out.
  auto msg = error_of([&] {
    dist::plan_backends(dp2tp2, gpus({0, 0, 1, 1}), dist::BackendChoice::nccl, nccl);
  });
  EXPECT_TRUE(contains(msg, "in the tp group ranks 0 and 1 share cuda:0 of node0") &&
              contains(msg, "--dist-backend auto or mpi"))
      << msg;
  msg = error_of([&] {
    dist::plan_backends(dp2, gpus({-1, -1}), dist::BackendChoice::nccl, nccl);
  });
  EXPECT_TRUE(contains(msg, "NCCL only moves CUDA tensors")) << msg;
  msg = error_of([&] {
    dist::plan_backends(dp2, gpus({0, 1}), dist::BackendChoice::nccl, no_nccl);
  });
  EXPECT_TRUE(contains(msg, "built without NCCL")) << msg;
  msg = error_of([&] { dist::plan_backends(dp2, gpus({0, -1}), automatic, nccl); });
  EXPECT_TRUE(contains(msg, "mixes devices: cuda:0 of node0 and the CPU of node0")) << msg;
  msg = error_of([&] { dist::plan_backends(dp2tp2, gpus({0, 1}), automatic, nccl); });
  EXPECT_TRUE(contains(msg, "2 ranks' devices for a mesh of dp 2 x tp 2 x pp 1 = 4 ranks")) << msg;
  EXPECT_EQ(dist::parse_backend_choice("mpi"), dist::BackendChoice::mpi);
  msg = error_of([&] { dist::parse_backend_choice("gloo"); });
  EXPECT_TRUE(contains(msg, "--dist-backend 'gloo' is not one of auto, nccl, mpi")) << msg;
}

// A mesh built with a plan: the groups it stages are StagingCommunicators over the MPI group
// and compute what the MPI group computes; the others stay plain MPI. CPU tensors here (the
// staging copies then stay on the host), so it runs without a GPU.
TEST(Mesh, APlanStagesTheGroupsItNames) {
  auto& w = world();
  dist::BackendPlan plan;
  plan.dims[static_cast<size_t>(dist::Dim::dp)] = dist::Transport::mpi_staged;
  plan.dims[static_cast<size_t>(dist::Dim::tp)] = dist::Transport::mpi;
  dist::Mesh mesh(loom::testing::runtime().world(), {.dp = w.size()}, 1, plan, -1);
  EXPECT_EQ(mesh.comm(dist::Dim::dp).backend(), "mpi+staging");
  EXPECT_EQ(mesh.comm(dist::Dim::tp).backend(), "mpi");
  EXPECT_EQ(mesh.comm(dist::Dim::dp).name(), "dp");
  EXPECT_EQ(mesh.comm(dist::Dim::dp).rank(), w.rank());
  auto t = at::full({5}, static_cast<float>(w.rank() + 1));
  mesh.comm(dist::Dim::dp).all_reduce(t);
  EXPECT_TRUE(at::equal(t, at::full({5}, static_cast<float>(w.size() * (w.size() + 1) / 2))));
  // Through the Runtime: CPU ranks plan MPI everywhere (a group of one rank is local, on any
  // device), and NCCL on CPU ranks is refused on every rank (a multi-rank world only: one rank
  // has no group to plan).
  auto planned =
      loom::testing::runtime().mesh({.dp = w.size()}, dist::BackendChoice::automatic, -1);
  EXPECT_EQ(planned->comm(dist::Dim::dp).backend(), w.size() > 1 ? "mpi" : "local");
  EXPECT_EQ(planned->comm(dist::Dim::tp).backend(), "local");
  if (w.size() > 1) {
    const auto msg = error_of(
        [&] { loom::testing::runtime().mesh({.dp = w.size()}, dist::BackendChoice::nccl, -1); });
    EXPECT_TRUE(contains(msg, "NCCL only moves CUDA tensors")) << msg;
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
