// Every collective x dtype x op against a locally computed expectation, on however many ranks
// mpirun started (ctest: 1, 2, 3 and 4; 3 catches power-of-two assumptions). Plus sub-groups,
// async handles, point-to-point, argument errors and the debug-mode consistency check.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <thread>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/dist/local_communicator.h"
#include "loom/dist/mpi_communicator.h"
#include "loom/dist/nccl_communicator.h"
#include "loom/dist/staging_communicator.h"
#include "loom/dist/watchdog.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::world;
namespace dist = loom::dist;

namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf,
                                             at::kInt,   at::kLong,     at::kByte};
const std::vector<dist::ReduceOp> kOps = {dist::ReduceOp::Sum, dist::ReduceOp::Avg,
                                          dist::ReduceOp::Max};

// Rank r's values: small non-negative integers, exact in every dtype (sums too: < 256).
at::Tensor values_of(int rank, int64_t n, at::ScalarType dtype) {
  auto i = at::arange(n, at::kLong);
  return ((i % 5 + 1) * (rank + 1) + (i % 3)).to(dtype);
}

// What reducing every rank's values gives, computed here with the same torch ops.
at::Tensor expected_reduce(int size, int64_t n, at::ScalarType dtype, dist::ReduceOp op) {
  auto acc = values_of(0, n, dtype);
  for (int r = 1; r < size; ++r) {
    auto v = values_of(r, n, dtype);
    acc = op == dist::ReduceOp::Max ? at::maximum(acc, v) : acc + v;
  }
  if (op == dist::ReduceOp::Avg)
    acc = at::isFloatingType(dtype) ? acc.div(size) : acc.div(size, "trunc");
  return acc;
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(at::equal(got.reshape({-1}), want.reshape({-1})))
      << what << "\ngot  " << got.reshape({-1}).slice(0, 0, 12) << "\nwant "
      << want.reshape({-1}).slice(0, 0, 12);
}

}  // namespace

TEST(Communicator, AllReduceEveryDtypeAndOp) {
  auto& w = world();
  for (auto dtype : kDtypes)
    for (auto op : kOps)
      for (int64_t n : {1, 7, 1000}) {
        auto t = values_of(w.rank(), n, dtype);
        w.all_reduce(t, op);
        expect_equal(
            t, expected_reduce(w.size(), n, dtype, op),
            fmt::format("all_reduce({}) {} n={}", dist::to_string(op), c10::toString(dtype), n));
      }
}

TEST(Communicator, ReduceScatterEveryDtypeAndOp) {
  auto& w = world();
  const int64_t chunk = 6;
  for (auto dtype : kDtypes)
    for (auto op : kOps) {
      auto in = values_of(w.rank(), chunk * w.size(), dtype);
      auto out = at::zeros({chunk}, in.options());
      w.reduce_scatter(out, in, op);
      auto full = expected_reduce(w.size(), chunk * w.size(), dtype, op);
      expect_equal(out, full.narrow(0, chunk * w.rank(), chunk),
                   fmt::format("reduce_scatter({}) {}", dist::to_string(op), c10::toString(dtype)));
    }
}

TEST(Communicator, AllGatherBroadcastAllToAllEveryDtype) {
  auto& w = world();
  const int64_t n = 5;
  for (auto dtype : kDtypes) {
    const auto name = std::string(c10::toString(dtype));
    // all_gather: every rank's tensor, in rank order.
    auto mine = values_of(w.rank(), n, dtype).reshape({1, n});
    auto gathered = at::zeros({w.size(), n}, mine.options());
    w.all_gather(gathered, mine);
    for (int r = 0; r < w.size(); ++r)
      expect_equal(gathered[r], values_of(r, n, dtype), "all_gather " + name);
    // broadcast from every root.
    for (int root = 0; root < w.size(); ++root) {
      auto t = values_of(w.rank(), n, dtype);
      w.broadcast(t, root);
      expect_equal(t, values_of(root, n, dtype), fmt::format("broadcast root {} {}", root, name));
    }
    // all_to_all: chunk j of rank i's input lands as chunk i of rank j's output.
    auto in = at::empty({w.size(), n}, mine.options());
    for (int j = 0; j < w.size(); ++j) in[j].copy_(values_of(w.rank() * 10 + j, n, dtype));
    auto out = at::zeros_like(in);
    w.all_to_all(out, in);
    for (int i = 0; i < w.size(); ++i)
      expect_equal(out[i], values_of(i * 10 + w.rank(), n, dtype), "all_to_all " + name);
  }
  w.barrier();
}

TEST(Communicator, AsyncOpsCompleteAndKeepTheirOrder) {
  auto& w = world();
  std::vector<at::Tensor> tensors;
  std::vector<dist::WorkPtr> works;
  for (int k = 0; k < 8; ++k) {
    tensors.push_back(at::full({4096}, static_cast<float>(k + w.rank()), at::kFloat));
    works.push_back(w.all_reduce_async(tensors.back(), dist::ReduceOp::Sum));
  }
  const float rank_sum = static_cast<float>(w.size() * (w.size() - 1) / 2);
  for (int k = 0; k < 8; ++k) {
    works[k]->wait(dist::Seconds(60));
    EXPECT_TRUE(works[k]->is_completed());
    EXPECT_FLOAT_EQ(tensors[k][0].item<float>(), static_cast<float>(k * w.size()) + rank_sum);
    EXPECT_EQ(works[k]->info().seq(), works[0]->info().seq() + k);
    EXPECT_TRUE(works[k]->started_at().has_value());
  }
  EXPECT_EQ(dist::Watchdog::instance().in_flight(), 0u);
}

TEST(Communicator, SendRecvRing) {
  auto& w = world();
  if (w.size() < 2) GTEST_SKIP() << "point-to-point needs two ranks";
  const int next = (w.rank() + 1) % w.size(), prev = (w.rank() + w.size() - 1) % w.size();
  for (auto dtype : kDtypes) {
    auto out = values_of(w.rank(), 300, dtype);
    auto in = at::zeros_like(out);
    auto recv = w.recv_async(in, prev, 7);
    auto send = w.send_async(out, next, 7);
    recv->wait(dist::Seconds(60));
    send->wait(dist::Seconds(60));
    expect_equal(in, values_of(prev, 300, dtype), std::string("ring ") + c10::toString(dtype));
  }
  // Two messages with one tag arrive in order.
  if (w.rank() == 0) {
    w.send(at::full({3}, 1.0f), 1, 3);
    w.send(at::full({3}, 2.0f), 1, 3);
  } else if (w.rank() == 1) {
    auto a = at::zeros({3}), b = at::zeros({3});
    w.recv(a, 0, 3);
    w.recv(b, 0, 3);
    EXPECT_EQ(a[0].item<float>(), 1.0f);
    EXPECT_EQ(b[0].item<float>(), 2.0f);
  }
  w.barrier();
}

TEST(Communicator, SplitMakesSubGroupsRankedByKey) {
  auto& w = world();
  // Even and odd ranks, each group ranked in reverse.
  auto sub = w.split(w.rank() % 2, -w.rank(), "parity");
  ASSERT_NE(sub, nullptr);
  const int members = (w.size() + 1 - w.rank() % 2) / 2;
  EXPECT_EQ(sub->size(), members);
  EXPECT_EQ(sub->name(), "parity");
  auto ranks = at::zeros({sub->size()}, at::kInt);
  sub->all_gather(ranks, at::full({1}, w.rank(), at::kInt));
  for (int i = 0; i + 1 < sub->size(); ++i)
    EXPECT_GT(ranks[i].item<int>(), ranks[i + 1].item<int>());
  auto t = at::full({2}, static_cast<float>(w.rank()));
  sub->all_reduce(t, dist::ReduceOp::Max);
  EXPECT_EQ(t[0].item<float>(), ranks[0].item<int>());
  // A negative color joins nothing.
  auto none = w.split(w.rank() == 0 ? -1 : 0, 0, "all-but-0");
  EXPECT_EQ(none == nullptr, w.rank() == 0);
}

TEST(Communicator, BadArgumentsNameTheProblem) {
  auto& w = world();
  EXPECT_TRUE(contains(error_of([&] { w.all_reduce(at::zeros({2}, at::kBool)); }),
                       "dtype Bool of the reduced tensor is not supported"));
  EXPECT_TRUE(contains(error_of([&] {
                         w.all_reduce(at::zeros({4, 4}).t());
                       }),
                       "must be contiguous"));
  EXPECT_TRUE(contains(error_of([&] { w.all_gather(at::zeros({w.size() + 1}), at::zeros({1})); }),
                       "must hold size"));
  EXPECT_TRUE(contains(error_of([&] { w.broadcast(at::zeros({1}), w.size()); }),
                       fmt::format("root {} is not a rank of the group", w.size())));
  EXPECT_TRUE(contains(error_of([&] { w.send(at::zeros({1}), w.rank()); }), "is this rank itself"));
  EXPECT_TRUE(contains(error_of([&] { w.set_timeout(dist::Seconds(0)); }), "must be positive"));
  // Nothing was issued by the failed calls: the group is still in step.
  auto t = at::ones({1});
  w.all_reduce(t);
  EXPECT_EQ(t.item<float>(), static_cast<float>(w.size()));
}

TEST(Communicator, WaitWithTimeoutOnARunningOpThrowsAndTheOpFinishesLater) {
  auto& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs a peer that is late";
  auto sub = w.split(0, w.rank(), "late");
  auto t = at::ones({8});
  if (w.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(600));
  auto work = sub->all_reduce_async(t);
  if (w.rank() == 0) {
    const auto msg = error_of([&] { work->wait(dist::Seconds(0.05)); });
    EXPECT_TRUE(contains(msg, "all_reduce(sum) #0 on group 'late'")) << msg;
    EXPECT_TRUE(contains(msg, "did not complete within")) << msg;
  }
  work->wait();
  EXPECT_EQ(t[0].item<float>(), static_cast<float>(w.size()));
}

TEST(Communicator, DebugModeReportsAShapeMismatchByRank) {
  auto& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs two ranks to disagree";
  auto sub = w.split(0, w.rank(), "checked");
  sub->set_debug(true);
  auto ok = at::ones({4, 8});
  sub->all_reduce(ok);  // agreeing ranks pass the check
  auto t = at::ones({4, w.rank() == 1 ? 9 : 8});
  const auto msg = error_of([&] { sub->all_reduce(t); });
  EXPECT_TRUE(contains(msg, "rank 0 issued all_reduce(sum) #1 Float[4, 8]")) << msg;
  EXPECT_TRUE(contains(msg, "rank 1 issued all_reduce(sum) #1 Float[4, 9]")) << msg;
  EXPECT_TRUE(contains(msg, "group 'checked'")) << msg;
  // The mismatched op was not run: the tensor is untouched.
  EXPECT_EQ(t[0][0].item<float>(), 1.0f);
}

TEST(Communicator, DebugModeReportsASkippedCollective) {
  auto& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs two ranks to disagree";
  auto sub = w.split(0, w.rank(), "checked");
  sub->set_debug(true);
  auto t = at::ones({16});
  // Rank 1 skips the all_reduce and goes on to the broadcast.
  const auto msg = error_of([&] {
    if (w.rank() != 1)
      sub->all_reduce(t);
    else
      sub->broadcast(t, 0);
  });
  EXPECT_TRUE(contains(msg, "rank 0 issued all_reduce(sum) #0 Float[16]")) << msg;
  EXPECT_TRUE(contains(msg, "rank 1 issued broadcast(root 0) #0 Float[16]")) << msg;
}

// Every op through host buffers equals the direct op (CPU tensors: the copies stay on the host,
// the code path is the one CUDA tensors take), results land in the caller's tensors only on wait,
// and the tensors an op only reads are left as they were.
// A communicator's family total counts what it and every group split from it (and from those)
// send, each op once: a staging wrapper takes the place of the group it wraps, so its sends are
// not counted a second time through that group. Its own bytes_sent stays its own ops'.
TEST(Communicator, FamilyBytesCountSplitGroupsAndWrappersOnce) {
  auto& w = world();
  auto parent = w.split(0, w.rank(), "family");
  auto child = parent->split(w.rank() % 2, w.rank(), "child");
  auto grandchild = child->split(0, w.rank(), "grandchild");
  EXPECT_TRUE(parent->same_family(w));
  EXPECT_TRUE(parent->same_family(*child));
  EXPECT_TRUE(parent->same_family(*grandchild));
  const auto wire = [](const dist::Communicator& c, double bytes) {
    return dist::wire_bytes(dist::OpKind::AllReduce, bytes, c.size(), false);
  };
  auto t = at::ones({1000});
  // Totals are sums of doubles (at 3 ranks an all-reduce sends 4/3 of its bytes): differences
  // of them are exact up to the rounding of the running total.
  const auto expect_sent = [&](double before, double want) {
    EXPECT_NEAR(parent->family_bytes_sent() - before, want, 1e-12 * parent->family_bytes_sent());
  };
  double family = parent->family_bytes_sent();
  const double own = parent->bytes_sent(), grandchild_own = grandchild->bytes_sent();
  grandchild->all_reduce(t);
  child->all_reduce(t);
  expect_sent(family, wire(*grandchild, 4000) + wire(*child, 4000));
  EXPECT_EQ(w.family_bytes_sent(), parent->family_bytes_sent());
  EXPECT_EQ(parent->bytes_sent(), own);
  EXPECT_NEAR(grandchild->bytes_sent() - grandchild_own, wire(*grandchild, 4000),
              1e-12 * grandchild->bytes_sent());
  auto inner = parent->split(0, w.rank(), "inner");
  dist::StagingCommunicator staged(inner);
  EXPECT_TRUE(staged.same_family(*parent));
  EXPECT_FALSE(inner->same_family(*parent));
  family = parent->family_bytes_sent();
  staged.all_reduce(t);
  expect_sent(family, wire(staged, 4000));
  auto staged_child = staged.split(0, w.rank(), "staged-child");
  EXPECT_TRUE(staged_child->same_family(*parent));
  family = parent->family_bytes_sent();
  staged_child->all_reduce(t);
  expect_sent(family, wire(*staged_child, 4000));
  // A group made apart from the world (here a lone rank's) keeps its own total.
  dist::LocalCommunicator alone;
  EXPECT_FALSE(alone.same_family(w));
}

TEST(StagingCommunicator, EveryOpThroughHostBuffersEqualsTheDirectOp) {
  auto& w = world();
  dist::StagingCommunicator s(w.split(0, w.rank(), "staged"));
  EXPECT_EQ(s.backend(), "mpi+staging");
  EXPECT_EQ(s.size(), w.size());
  EXPECT_EQ(s.rank(), w.rank());
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    const auto name = std::string(c10::toString(dtype));
    for (auto op : kOps) {
      auto t = values_of(w.rank(), 7, dtype);
      s.all_reduce(t, op);
      expect_equal(t, expected_reduce(w.size(), 7, dtype, op), "staged all_reduce " + name);
      const int64_t chunk = 3;
      const auto in = values_of(w.rank(), chunk * w.size(), dtype);
      const auto in_before = in.clone();
      auto out = at::zeros({chunk}, in.options());
      s.reduce_scatter(out, in, op);
      expect_equal(
          out,
          expected_reduce(w.size(), chunk * w.size(), dtype, op).narrow(0, chunk * w.rank(), chunk),
          "staged reduce_scatter " + name);
      expect_equal(in, in_before, "staged reduce_scatter leaves its input " + name);
    }
    auto mine = values_of(w.rank(), 4, dtype).reshape({1, 4});
    auto gathered = at::zeros({w.size(), 4}, mine.options());
    s.all_gather(gathered, mine);
    for (int r = 0; r < w.size(); ++r)
      expect_equal(gathered[r], values_of(r, 4, dtype), "staged all_gather " + name);
    for (int root = 0; root < w.size(); ++root) {
      auto t = values_of(w.rank(), 4, dtype);
      s.broadcast(t, root);
      expect_equal(t, values_of(root, 4, dtype), "staged broadcast " + name);
    }
    auto in = at::empty({w.size(), 4}, mine.options());
    for (int j = 0; j < w.size(); ++j) in[j].copy_(values_of(w.rank() * 10 + j, 4, dtype));
    auto out = at::zeros_like(in);
    s.all_to_all(out, in);
    for (int i = 0; i < w.size(); ++i)
      expect_equal(out[i], values_of(i * 10 + w.rank(), 4, dtype), "staged all_to_all " + name);
  }
  // Point to point around a ring, asynchronously.
  if (w.size() > 1) {
    const int next = (w.rank() + 1) % w.size(), prev = (w.rank() + w.size() - 1) % w.size();
    auto got = at::zeros({6}, at::kFloat);
    auto recv = s.recv_async(got, prev, 3);
    auto send = s.send_async(values_of(w.rank(), 6, at::kFloat), next, 3);
    send->wait(dist::Seconds(60));
    recv->wait(dist::Seconds(60));
    expect_equal(got, values_of(prev, 6, at::kFloat), "staged send/recv");
  }
  s.barrier();
  EXPECT_EQ(dist::Watchdog::instance().in_flight(), 0u);
  // A sub-group of a staging communicator stages too.
  auto sub = s.split(w.rank() % 2, w.rank(), "staged-half");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->backend(), "mpi+staging");
  auto t = at::ones({2});
  sub->all_reduce(t);
  EXPECT_EQ(t[0].item<float>(), static_cast<float>(sub->size()));
}

TEST(LocalCommunicator, CollectivesOfOneRank) {
  dist::LocalCommunicator c("solo");
  EXPECT_EQ(c.size(), 1);
  auto t = at::arange(6, at::kFloat);
  for (auto op : kOps) {
    c.all_reduce(t, op);
    EXPECT_TRUE(at::equal(t, at::arange(6, at::kFloat)));
  }
  auto out = at::zeros({6});
  c.all_gather(out, t);
  EXPECT_TRUE(at::equal(out, t));
  out.zero_();
  c.reduce_scatter(out, t);
  EXPECT_TRUE(at::equal(out, t));
  c.broadcast(t, 0);
  c.barrier();
  EXPECT_TRUE(contains(error_of([&] { c.send(t, 0); }), "is this rank itself"));
  EXPECT_EQ(c.collectives_issued(), 7);
  EXPECT_NE(c.split(0, 0, "x"), nullptr);
}

TEST(Nccl, CollectivesOnTheGpu) {
  if (!dist::nccl_available()) GTEST_SKIP() << "built without CUDA: no NCCL backend";
  if (torch::cuda::device_count() == 0)
    GTEST_SKIP() << "no CUDA device on this machine: the NCCL test runs where a GPU exists";
  auto& w = world();
  if (loom::testing::runtime().local_size() > static_cast<int>(torch::cuda::device_count()))
    GTEST_SKIP() << "NCCL needs a GPU per rank: " << loom::testing::runtime().local_size()
                 << " ranks on this node, " << torch::cuda::device_count() << " GPUs";
  const int device = loom::testing::runtime().local_rank();
  auto nccl = dist::make_nccl_communicator(loom::testing::runtime().world(), device, "nccl");
  const auto cuda = at::TensorOptions().device(at::kCUDA, device);
  for (auto dtype : kDtypes)
    for (auto op : kOps) {
      auto t = values_of(w.rank(), 1000, dtype).to(cuda);
      nccl->all_reduce(t, op);
      expect_equal(
          t.cpu(), expected_reduce(w.size(), 1000, dtype, op),
          fmt::format("nccl all_reduce({}) {}", dist::to_string(op), c10::toString(dtype)));
    }
  auto mine = values_of(w.rank(), 5, at::kFloat).to(cuda);
  auto gathered = at::zeros({w.size() * 5}, mine.options());
  nccl->all_gather(gathered, mine);
  for (int r = 0; r < w.size(); ++r)
    expect_equal(gathered.narrow(0, r * 5, 5).cpu(), values_of(r, 5, at::kFloat), "nccl gather");
  nccl->barrier();
}
