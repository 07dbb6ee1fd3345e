// Tensor and sequence parallelism: each layer against its unsharded twin, whole GPT-2 and Llama
// models (logits, loss, every gradient) against one process, training over dp x tp against one
// process, the communication volume against its formula, exports, and the errors.
//
// The tensor-parallel group is the whole world (tp = 1, 2, 3, 4 as ctest runs the binary), or
// a divisor of it where a test needs dp x tp.
#include <ATen/ATen.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

#include "../test_util.h"
#include "dist_util.h"
#include "loom/models/hf.h"
#include "loom/parallel/tensor/cross_entropy.h"
#include "loom/parallel/tensor/layers.h"
#include "loom/parallel/tensor/mappings.h"
#include "loom/parallel/tensor/partial_grads.h"
#include "loom/train/grad_clip.h"
#include "loom/train/trainer.h"
#include "tp_models.h"
#include "train_compare.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::small_config;
using loom::testing::world;
using loom::testing::world_group;
namespace dist = loom::dist;
namespace models = loom::models;
namespace pt = loom::parallel::tensor;
namespace train = loom::train;
namespace fs = std::filesystem;

namespace {

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kDouble);  // the tests here run in fp64
}

// Relative difference of two tensors: max |a - b| over max |b| (b is the reference).
double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-30);
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

// Within `bound` relative to the largest reference element.
#define EXPECT_CLOSE_WITHIN(a, b, what, bound)                                           \
  do {                                                                                   \
    ASSERT_EQ((a).sizes(), (b).sizes()) << (what);                                       \
    const double rel = rel_diff((a), (b));                                               \
    EXPECT_LE(rel, (bound)) << (what) << ": relative difference " << rel;                \
    if (std::getenv("LOOM_TEST_VERBOSE")) fmt::print("close: {} {:.3g}\n", (what), rel); \
  } while (0)
// One forward and backward (no optimizer) in another order of sums: each result is off by at
// most ~k*u of its terms for k-term sums (k <= ~100 here). fp64 (u = 1.1e-16): ~1e-14, bound
// 1e-11; fp32 (u = 6e-8, only where an fp32 model is compared): ~6e-6, bound 1e-5.
constexpr double kFp64Close = 1e-11;
constexpr double kFp32Close = 1e-5;
#define EXPECT_CLOSE(a, b, what) EXPECT_CLOSE_WITHIN(a, b, what, kFp64Close)

}  // namespace

// --- The collectives as autograd functions ------------------------------------------------

TEST(TpMappings, EachForwardAndItsDualBackward) {
  auto tp = world_group();
  const int64_t n = tp->size(), r = tp->rank();
  // Rank r's tensor: [2, 3n, 4] filled with values that identify the rank and the position.
  auto mine = randn({2, 3 * n, 4}, 100 + r);
  std::vector<at::Tensor> all;
  for (int64_t k = 0; k < n; ++k) all.push_back(randn({2, 3 * n, 4}, 100 + k));
  auto sum_all = at::stack(all).sum(0);

  {  // copy: identity forward, all-reduce backward
    auto x = mine.clone().requires_grad_();
    auto y = pt::copy_to_tp_region(x, *tp);
    EXPECT_TRUE(at::equal(y, mine));
    y.backward(mine);
    EXPECT_CLOSE(x.grad(), sum_all, "copy_to_tp_region backward");
  }
  {  // reduce: all-reduce forward, identity backward
    auto x = mine.clone().requires_grad_();
    auto y = pt::reduce_from_tp_region(x, *tp);
    EXPECT_CLOSE(y, sum_all, "reduce_from_tp_region forward");
    y.backward(mine);
    EXPECT_TRUE(at::equal(x.grad(), mine));
  }
  {  // gather along the sequence: all-gather forward, reduce-scatter backward
    auto x = mine.narrow(1, 0, 3).clone().requires_grad_();
    auto y = pt::gather_from_sequence_region(x, *tp, 1);
    std::vector<at::Tensor> chunks;
    for (int64_t k = 0; k < n; ++k) chunks.push_back(all[k].narrow(1, 0, 3));
    EXPECT_TRUE(at::equal(y, at::cat(chunks, 1)));
    y.backward(mine);  // [2, 3n, 4]: rank r gets chunk r of the sum of everyone's gradient
    EXPECT_CLOSE(x.grad(), sum_all.narrow(1, 3 * r, 3), "gather_from_sequence backward");
  }
  {  // reduce-scatter along the sequence: reduce-scatter forward, all-gather backward
    auto x = mine.clone().requires_grad_();
    auto y = pt::reduce_scatter_to_sequence_region(x, *tp, 1);
    EXPECT_CLOSE(y, sum_all.narrow(1, 3 * r, 3), "reduce_scatter_to_sequence forward");
    y.backward(mine.narrow(1, 0, 3).contiguous());
    std::vector<at::Tensor> chunks;
    for (int64_t k = 0; k < n; ++k) chunks.push_back(all[k].narrow(1, 0, 3));
    EXPECT_TRUE(at::equal(x.grad(), at::cat(chunks, 1)));
  }
  {  // scatter: own chunk forward, all-gather backward; gather along the last dim and back
    auto x = sum_all.clone().requires_grad_();
    auto y = pt::scatter_to_sequence_region(x, *tp, 1);
    EXPECT_TRUE(at::equal(y, sum_all.narrow(1, 3 * r, 3)));
    auto z = pt::gather_from_tp_region(y, *tp, 1);
    EXPECT_TRUE(at::equal(z, sum_all));
    z.backward(mine);  // rank r's gradient of y is its own chunk; x gets everyone's
    std::vector<at::Tensor> chunks;
    for (int64_t k = 0; k < n; ++k) chunks.push_back(all[k].narrow(1, 3 * k, 3));
    EXPECT_TRUE(at::equal(x.grad(), at::cat(chunks, 1)));
  }
  if (n > 1) {  // a sequence that does not split says so
    auto odd = at::zeros({1, 3 * n + 1, 2});
    const auto msg = error_of([&] { pt::reduce_scatter_to_sequence_region(odd, *tp, 1); });
    EXPECT_TRUE(contains(msg, "must be divisible by tp")) << msg;
  }
}

// --- Layers against their unsharded twins -------------------------------------------------

class TpLayers : public ::testing::TestWithParam<bool> {};  // sequence parallel?

TEST_P(TpLayers, ColumnThenRowEqualTheirTwins) {
  const bool sp = GetParam();
  auto tp = world_group(sp);
  const int64_t n = tp->size(), r = tp->rank();
  const int64_t heads = 12, hd = 2, d = 8, seq = 2 * n;  // 12 heads split by 1..4 ranks
  // Full (single-process) weights: a fused q/k/v projection of 12 heads, then back to d.
  auto w1 = randn({3 * heads * hd, d}, 1), b1 = randn({3 * heads * hd}, 2);
  auto w2 = randn({d, heads * hd}, 3), b2 = randn({d}, 4);
  auto x_full = randn({2, seq, d}, 5), r_full = randn({2, seq, d}, 6);
  // Between the two layers: q * v + k per head (mixes the three parts, stays head-local).
  auto mix = [](const at::Tensor& qkv, int64_t width) {
    auto parts = qkv.view({qkv.size(0), qkv.size(1), 3, width});
    return parts.select(2, 0) * parts.select(2, 2) + parts.select(2, 1);
  };

  // The twin, in one process.
  auto xr = x_full.clone().requires_grad_();
  auto w1r = w1.clone().requires_grad_(), b1r = b1.clone().requires_grad_();
  auto w2r = w2.clone().requires_grad_(), b2r = b2.clone().requires_grad_();
  auto y_ref = at::linear(mix(at::linear(xr, w1r, b1r), heads * hd), w2r, b2r);
  (y_ref * r_full).sum().backward();

  pt::ColumnParallelLinear col(d, 3 * heads * hd, tp, {.parts = 3, .units = heads}, "test.col");
  pt::RowParallelLinear row(heads * hd, d, tp, true, heads, "test.row");
  col.to(at::kDouble);
  row.to(at::kDouble);
  auto col_specs = col.shard_specs();
  auto row_specs = row.shard_specs();
  {
    torch::NoGradGuard no_grad;
    col.weight.copy_(col_specs["weight"].shard(w1, r, n));
    col.bias.copy_(col_specs["bias"].shard(b1, r, n));
    row.weight.copy_(row_specs["weight"].shard(w2, r, n));
    row.bias.copy_(b2);
  }
  // Sequence parallel: each rank starts from its chunk of the sequence and ends with its chunk.
  auto chunk = [&](const at::Tensor& t) { return sp ? t.narrow(1, 2 * r, 2) : t; };
  auto x_in = chunk(x_full).clone().requires_grad_();
  auto y = row.forward(mix(col.forward(pt::enter_tp_region(x_in, *tp, 1)), heads / n * hd));
  EXPECT_CLOSE(y.detach(), chunk(y_ref.detach()), "output");
  // Replicated output: every rank's loss is the whole loss (Megatron's convention). Sequence
  // parallel: each rank's loss is its chunk's part of the whole.
  (y * chunk(r_full)).sum().backward();
  EXPECT_CLOSE(x_in.grad(), chunk(xr.grad()), "input gradient");
  EXPECT_CLOSE(col.weight.grad(), col_specs["weight"].shard(w1r.grad(), r, n),
               "column weight gradient");
  EXPECT_CLOSE(col.bias.grad(), col_specs["bias"].shard(b1r.grad(), r, n), "column bias gradient");
  EXPECT_CLOSE(row.weight.grad(), row_specs["weight"].shard(w2r.grad(), r, n),
               "row weight gradient");
  // The row bias is replicated: complete on every rank, or (sequence parallel) a partial sum
  // that PartialGradSync completes.
  EXPECT_EQ(row_specs["bias"].grad_partial, sp && n > 1);
  pt::PartialGradSync sync({{"bias", row.bias}}, {{"bias", row_specs["bias"]}}, tp);
  sync.sync();
  EXPECT_CLOSE(row.bias.grad(), b2r.grad(), "row bias gradient");
}

// ZeRO keeps only a shard of each gradient: PartialGradSync sums pieces of them. Each rank
// passes the same piece (elements 1..d-1) of a per-rank partial gradient; the sum is the whole
// one's piece, the rest untouched. Pieces that differ between ranks are refused by name.
TEST(PartialGradSync, SumsPiecesOfGradientsAndRefusesPiecesThatDiffer) {
  auto tp = world_group(true);
  const int64_t n = tp->size(), r = tp->rank(), d = 5;
  if (n == 1) GTEST_SKIP() << "one rank has no partial gradients";
  auto bias = at::zeros({d}).requires_grad_();
  pt::ShardSpec spec;
  spec.grad_partial = true;
  pt::PartialGradSync sync({{"bias", bias}}, {{"bias", spec}}, tp);
  ASSERT_EQ(sync.num_params(), 1);
  // Rank k's part: (k + 1) * [0, 1, 2, 3, 4]; summed over n ranks: n (n + 1) / 2 times that.
  auto grad = at::arange(d, at::kFloat) * static_cast<double>(r + 1);
  auto shard = grad.clone();
  sync.sync([&](const std::string& name) {
    EXPECT_EQ(name, "bias");
    return pt::PartialGradSync::GradPiece{shard.narrow(0, 1, d - 1), 1};
  });
  auto expected = at::arange(d, at::kFloat) * static_cast<double>(n * (n + 1) / 2);
  expected[0] = grad[0];  // outside the piece
  EXPECT_CLOSE(shard, expected, "summed piece");
  auto fresh = pt::PartialGradSync({{"bias", bias}}, {{"bias", spec}}, tp);
  const auto msg = error_of([&] {
    fresh.sync([&](const std::string&) {
      return pt::PartialGradSync::GradPiece{shard.narrow(0, 0, r == 0 ? 2 : 3), 0};
    });
  });
  EXPECT_TRUE(contains(msg, "different pieces of the gradient of 'bias'")) << msg;
  EXPECT_TRUE(contains(msg, "lengths 2..3")) << msg;
}

INSTANTIATE_TEST_SUITE_P(SequenceParallel, TpLayers, ::testing::Bool());

TEST(TpLayers, VocabParallelEmbeddingAndCrossEntropyEqualTheirTwins) {
  for (const int64_t pad_multiple : {1, 8}) {
    auto tp = world_group(false, pad_multiple);
    const int64_t n = tp->size(), vocab = 37, d = 6;  // 37 is prime: never divisible by tp > 1
    auto table = randn({vocab, d}, 11);
    auto tokens = at::tensor({0, 36, 5, 17, 36, 1, 30, 12}, at::kLong).view({2, 4});
    tokens[1][3] = vocab - 1;

    auto table_ref = table.clone().requires_grad_();
    auto emb_ref = at::embedding(table_ref, tokens);
    auto r = randn({2, 4, d}, 12);
    (emb_ref * r).sum().backward();

    pt::VocabParallelEmbedding emb(vocab, d, tp);
    emb.to(at::kDouble);
    const auto spec = emb.shard_specs()["weight"];
    EXPECT_EQ(spec.padded_size(), tp->padded_vocab(vocab));
    EXPECT_EQ(spec.padded_size() % (pad_multiple * n), 0);
    {
      torch::NoGradGuard no_grad;
      emb.weight.copy_(spec.shard(table, tp->rank(), n));
    }
    auto out = emb.forward(tokens);
    EXPECT_CLOSE(out.detach(), emb_ref.detach(), "embedding output");
    (out * r).sum().backward();  // replicated output: each rank's backward sees the whole grad
    EXPECT_CLOSE(emb.weight.grad(), spec.shard(table_ref.grad(), tp->rank(), n),
                 "embedding gradient (padded rows zero)");

    // Cross-entropy over vocabulary shards; the padded columns hold huge values that would
    // dominate the softmax if they were not masked.
    auto logits = randn({2, 4, vocab}, 13) * 3;
    auto logits_ref = logits.clone().requires_grad_();
    auto loss_ref = at::cross_entropy_loss(logits_ref.view({-1, vocab}), tokens.view({-1}));
    loss_ref.backward();
    const int64_t padded = tp->padded_vocab(vocab), local = padded / n;
    auto padded_logits = at::cat({logits, at::full({2, 4, padded - vocab}, 1e4)}, -1);
    auto grad_want = at::cat({logits_ref.grad(), at::zeros({2, 4, padded - vocab})}, -1)
                         .narrow(-1, tp->rank() * local, local);
    // Both backends: the math one (ATen ops) and the fused one (the kernels' host reference on
    // each shard, the group's max and sum between its passes).
    for (const auto backend : {loom::ops::LossBackend::kMath, loom::ops::LossBackend::kFused}) {
      const auto what = loom::ops::to_string(backend);
      auto mine = padded_logits.narrow(-1, tp->rank() * local, local).clone().requires_grad_();
      tp->stats().reset();
      pt::VocabLossOptions options;
      options.backend = backend;
      auto loss = pt::vocab_parallel_cross_entropy(mine, tokens, vocab, *tp, options);
      EXPECT_NEAR(loss.item<double>(), loss_ref.item<double>(),
                  kFp64Close * loss_ref.item<double>())
          << what;
      // math: max (N) + sum of 2N; fused: max (N) + sum of 3N (sums, target logits, found).
      const int64_t per_row = backend == loom::ops::LossBackend::kMath ? 3 : 4;
      EXPECT_EQ(tp->stats().loss_elements, n > 1 ? per_row * tokens.numel() : 0) << what;
      loss.backward();
      EXPECT_CLOSE(mine.grad(), grad_want, "cross-entropy gradient (" + what + ")");
      // z-loss: + z mean(lse^2), lse over the whole (unpadded) vocabulary.
      auto z_ref = logits.clone().requires_grad_();
      const double z = 0.05;
      auto z_loss_ref = at::cross_entropy_loss(z_ref.view({-1, vocab}), tokens.view({-1})) +
                        z * at::logsumexp(z_ref, -1).square().mean();
      z_loss_ref.backward();
      auto z_mine = padded_logits.narrow(-1, tp->rank() * local, local).clone().requires_grad_();
      options.z_loss = z;
      auto z_loss = pt::vocab_parallel_cross_entropy(z_mine, tokens, vocab, *tp, options);
      EXPECT_NEAR(z_loss.item<double>(), z_loss_ref.item<double>(),
                  kFp64Close * z_loss_ref.item<double>())
          << what;
      z_loss.backward();
      EXPECT_CLOSE(z_mine.grad(),
                   at::cat({z_ref.grad(), at::zeros({2, 4, padded - vocab})}, -1)
                       .narrow(-1, tp->rank() * local, local),
                   "z-loss gradient (" + what + ")");
    }
  }
}

// The fused loss on each vocabulary shard of a whole model (the kernels' host reference, the
// group's max and sum between its passes), over whole logits and with the head in chunks,
// against the math path of the same sharded model: loss and every gradient, fp64, with and
// without vocabulary padding, with z-loss.
TEST(TpLayers, ModelsWithTheFusedLossNormsAndSwigluEqualTheMathPath) {
  for (const auto family : {models::Family::kGpt2, models::Family::kLlama})
    for (const int64_t pad_multiple : {1, 8}) {
      // Sequence parallel with padding: the fused norms' weight gradients are partial sums over
      // this rank's tokens, summed across tp as the math path's are.
      auto tp = world_group(pad_multiple > 1, pad_multiple);
      auto config = small_config(family, tp->size());
      config.dropout = 0;  // train mode (the z-loss is a training term) with nothing random
      auto model = models::make_model(config, tp);
      model->to(at::kDouble);
      models::init_parameters(*model, 42);
      model->train();
      model->set_z_loss(family == models::Family::kLlama ? 1e-3 : 0.0);
      auto tokens = at::randint(0, config.vocab_size, {3, 12}, at::kLong);
      auto targets = at::randint(0, config.vocab_size, {3, 12}, at::kLong);
      world().broadcast(tokens, 0);
      world().broadcast(targets, 0);
      std::map<std::string, at::Tensor> want;
      double want_loss = 0;
      // Math (the reference), fused over whole logits, fused with the head in chunks of 5 rows.
      for (const int64_t chunk_rows : {-1, 0, 5}) {
        const auto backend =
            chunk_rows < 0 ? loom::ops::LossBackend::kMath : loom::ops::LossBackend::kFused;
        model->zero_grad();
        model->set_loss_chunk_rows(std::max<int64_t>(chunk_rows, 0));
        model->set_loss_backend(backend);
        model->set_norm_backend(backend);
        model->set_activation_backend(backend);
        auto loss = model->loss(tokens, targets);
        const auto what = fmt::format("{} pad {}{} {} chunks {}", models::to_string(family),
                                      pad_multiple, tp->sequence_parallel() ? " sp" : "",
                                      loom::ops::to_string(backend), chunk_rows);
        // The path asked for is the one that ran.
        const auto node = loss.grad_fn()->name();
        EXPECT_EQ(node.find("FusedCrossEntropy") != std::string::npos, chunk_rows == 0) << node;
        EXPECT_EQ(node.find("LinearCrossEntropy") != std::string::npos, chunk_rows > 0) << node;
        loss.backward();
        if (chunk_rows < 0) {
          want_loss = loss.item<double>();
          for (const auto& item : model->named_parameters())
            want.emplace(item.key(), item.value().grad().clone());
          continue;
        }
        EXPECT_NEAR(loss.item<double>(), want_loss, kFp64Close * want_loss) << what;
        for (const auto& item : model->named_parameters())
          EXPECT_CLOSE(item.value().grad(), want.at(item.key()), what + " " + item.key());
      }
    }
}

// --- Whole models against one process -----------------------------------------------------

namespace {

struct Case {
  models::Family family;
  bool sequence_parallel;
  double dropout;
  std::string preset;      // empty: small_config
  int64_t ffn_blocks = 1;  // 12: a multiple of every tp tested that divides d_model and d_ff
  int64_t ffn_rank = 0;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  auto name = fmt::format(
      "{}{}{}{}{}", models::to_string(info.param.family), info.param.sequence_parallel ? "_sp" : "",
      info.param.dropout > 0 ? "_dropout" : "", info.param.ffn_blocks > 1 ? "_ffn_blocks" : "",
      info.param.ffn_rank > 0 ? "_ffn_rank" : "");
  if (!info.param.preset.empty())
    name = info.param.preset + (info.param.sequence_parallel ? "_sp" : "");
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

}  // namespace

class TpModel : public ::testing::TestWithParam<Case> {};

TEST_P(TpModel, LogitsLossAndEveryGradientEqualOneProcess) {
  const auto [family, sp, dropout, preset, ffn_blocks, ffn_rank] = GetParam();
  if (!preset.empty() && world().size() == 3)
    GTEST_SKIP() << preset << " has 4 heads: tp 3 cannot split them";
  auto tp = world_group(sp);
  auto config =
      preset.empty() ? small_config(family, tp->size()) : models::ModelConfig::preset(preset);
  config.dropout = dropout;
  config.ffn_blocks = ffn_blocks;
  config.ffn_rank = ffn_rank;
  config.max_seq_len = std::min<int64_t>(config.max_seq_len, 64);  // small position/RoPE tables
  auto reference = models::make_model(config);
  auto sharded = models::make_model(config, tp);
  reference->to(at::kDouble);  // fp64: gradients compared to 1e-11 (docs/testing.md)
  sharded->to(at::kDouble);
  models::init_parameters(*reference, 42);
  models::init_parameters(*sharded, 42);
  // Initialization is layout-invariant: the shards assemble into the reference, bit for bit.
  const auto assembled = models::gather_parameters(*sharded);
  for (const auto& item : reference->named_parameters())
    EXPECT_TRUE(at::equal(assembled.at(item.key()), item.value())) << item.key();

  auto tokens = at::randint(0, config.vocab_size, {3, 12}, at::kLong);
  auto targets = at::randint(0, config.vocab_size, {3, 12}, at::kLong);
  world().broadcast(tokens, 0);
  world().broadcast(targets, 0);
  if (dropout > 0) {
    reference->train();
    sharded->train();
  } else {
    reference->eval();
    sharded->eval();
  }
  // The same dropout seed for both models (masks must not depend on tp).
  reference->tp().dropout().reseed(7);
  sharded->tp().dropout().reseed(7);
  auto ref_loss = reference->loss(tokens, targets);
  ref_loss.backward();
  auto loss = sharded->loss(tokens, targets);
  loss.backward();
  EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), kFp64Close * ref_loss.item<double>());

  // The broken variant first: the gradients as they are before the partial-gradient sync (the
  // bug of a missing all-reduce of the sequence-parallel norm and bias gradients).
  double unsynced_worst = 0;
  std::string unsynced_name;
  for (const auto& item : reference->named_parameters()) {
    const auto& name = item.key();
    auto grad = models::gather_shard(*sharded, name, sharded->named_parameters()[name].grad());
    const double rel = rel_diff(grad, item.value().grad());
    if (rel > unsynced_worst) unsynced_worst = rel, unsynced_name = name;
  }
  if (sp && tp->size() > 1) {
    if (tp->rank() == 0)
      fmt::print("[broken variant] tp {} sp: partial gradients not summed: worst {:.3g} ({})\n",
                 tp->size(), unsynced_worst, unsynced_name);
    EXPECT_GE(unsynced_worst, 1000 * kFp64Close) << unsynced_name;
  }

  pt::PartialGradSync sync(
      [&] {
        pt::PartialGradSync::NamedParams p;
        for (const auto& item : sharded->named_parameters())
          p.emplace_back(item.key(), item.value());
        return p;
      }(),
      sharded->shard_specs(), tp);
  sync.sync();
  for (const auto& item : reference->named_parameters()) {
    const auto& name = item.key();
    auto grad = models::gather_shard(*sharded, name, sharded->named_parameters()[name].grad());
    EXPECT_CLOSE_WITHIN(grad, item.value().grad(), name + " gradient", kFp64Close);
  }
  // The global gradient norm counts every distinct element once (reference: float64 sums).
  double ref_sq = 0;
  for (const auto& p : reference->parameters())
    ref_sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  const double ref_norm = std::sqrt(ref_sq);
  EXPECT_NEAR(train::clip_grad_norm(*sharded, 0), ref_norm, kFp64Close * ref_norm);

  // Whole logits, gathered across tp (evaluation mode: no dropout).
  reference->eval();
  sharded->eval();
  torch::NoGradGuard no_grad;
  EXPECT_CLOSE_WITHIN(sharded->forward(tokens), reference->forward(tokens), "logits", kFp64Close);
}

INSTANTIATE_TEST_SUITE_P(Families, TpModel,
                         ::testing::Values(Case{models::Family::kGpt2, false, 0.0, ""},
                                           Case{models::Family::kGpt2, true, 0.0, ""},
                                           Case{models::Family::kLlama, false, 0.0, ""},
                                           Case{models::Family::kLlama, true, 0.0, ""},
                                           Case{models::Family::kGpt2, true, 0.2, ""},
                                           Case{models::Family::kGpt2, false, 0.2, ""},
                                           Case{models::Family::kLlama, false, 0.2, ""},
                                           // The tiny presets as shipped (llama-tiny: 4 heads,
                                           // 2 kv heads).
                                           Case{models::Family::kGpt2, false, 0.0, "gpt2-tiny"},
                                           Case{models::Family::kLlama, true, 0.0, "llama-tiny"},
                                           // Block-diagonal MLPs (each rank its own blocks).
                                           Case{models::Family::kGpt2, false, 0.0, "", 12},
                                           Case{models::Family::kGpt2, true, 0.2, "", 12},
                                           Case{models::Family::kLlama, false, 0.0, "", 12},
                                           Case{models::Family::kLlama, true, 0.0, "", 12},
                                           // Low-rank MLPs (rank 8).
                                           Case{models::Family::kGpt2, false, 0.0, "", 1, 8},
                                           Case{models::Family::kGpt2, true, 0.2, "", 1, 8},
                                           Case{models::Family::kLlama, false, 0.0, "", 1, 8},
                                           Case{models::Family::kLlama, true, 0.0, "", 1, 8}),
                         case_name);

TEST(TpModel, CommunicationVolumeMatchesTheFormula) {
  for (const bool sp : {false, true}) {
    auto tp = world_group(sp);
    for (const auto family : {models::Family::kGpt2, models::Family::kLlama}) {
      auto config = small_config(family, tp->size());
      auto model = models::make_model(config, tp);
      models::init_parameters(*model, 1);
      const int64_t b = 2, s = 12, h = config.d_model, layers = config.n_layers;
      auto tokens = at::zeros({b, s}, at::kLong);
      tp->stats().reset();
      model->loss(tokens, tokens).backward();
      const auto& st = tp->stats();
      // Per block: 2 region entries (attention, MLP) and 2 exits, each a b*s*h tensor, forward
      // and backward; plus the embedding's exit and the head's entry.
      const int64_t ops = (4 * layers + 2) * b * s * h;
      if (tp->size() == 1) {
        EXPECT_EQ(st.activation_elements(), 0);
        EXPECT_EQ(st.ops, 0);
      } else if (sp) {
        EXPECT_EQ(st.all_gather_elements, ops);
        EXPECT_EQ(st.reduce_scatter_elements, ops);
        EXPECT_EQ(st.all_reduce_elements, 0);
      } else {
        EXPECT_EQ(st.all_reduce_elements, ops);
        EXPECT_EQ(st.all_gather_elements + st.reduce_scatter_elements, 0);
      }
      if (tp->size() > 1) {
        EXPECT_EQ(st.loss_elements, 3 * b * s);
      }
    }
  }
}

TEST(TpModel, ShapesThatDoNotSplitAreClearErrors) {
  if (world().size() == 1) GTEST_SKIP() << "tp = 1 splits every shape";
  auto tp = world_group();
  const int64_t n = tp->size();
  auto config = small_config(models::Family::kLlama, n);
  config.n_heads = n + 1;  // never divisible by n > 1
  config.d_model = 4 * (n + 1);
  config.n_kv_heads = n + 1;
  auto msg = error_of([&] { models::make_model(config, tp); });
  EXPECT_TRUE(contains(msg, fmt::format("n_heads {} is not divisible by tp {}", n + 1, n))) << msg;
  if (n == 4) {
    config = small_config(models::Family::kLlama, n);
    config.n_kv_heads = 3;  // 12 heads, 3 kv heads, tp 4: neither divides the other
    msg = error_of([&] { models::make_model(config, tp); });
    EXPECT_TRUE(contains(msg, "n_kv_heads 3 and tp 4 must divide one another")) << msg;
  }
  // Block-diagonal MLP blocks that tp cannot hand out whole (48 and 96 features divide by 3 and 2).
  config = small_config(models::Family::kGpt2, n);
  config.ffn_blocks = n == 2 ? 3 : 2;
  msg = error_of([&] { models::make_model(config, tp); });
  EXPECT_TRUE(contains(msg, fmt::format("mlp.c_fc: {} blocks cannot be split evenly across tp = {}",
                                        config.ffn_blocks, n)))
      << msg;
  config = small_config(models::Family::kGpt2, n);
  auto sp_model = models::make_model(config, world_group(true));
  msg = error_of([&] { sp_model->forward(at::zeros({1, n + 1}, at::kLong)); });
  EXPECT_TRUE(contains(msg, fmt::format("length {} is not divisible by tp {}", n + 1, n))) << msg;
}

TEST(TpModel, IdsOutsideTheVocabularyAreClearErrors) {
  // Vocabulary-parallel lookups and padded heads would turn them into zero embeddings or loss
  // terms without a target; every rank refuses them before any collective (tp = 1 included).
  auto tp = world_group(false, 4);  // padded at every tp
  auto config = small_config(models::Family::kGpt2, tp->size());
  auto model = models::make_model(config, tp);
  auto ids = at::zeros({1, 4}, at::kLong);
  auto bad = ids.clone();
  bad[0][2] = config.vocab_size;
  auto msg = error_of([&] { model->loss(bad, ids); });
  EXPECT_TRUE(
      contains(msg, "token ids must be in [0, 101) (the vocabulary); got ids from 0 to 101"))
      << msg;
  bad[0][2] = -100;
  msg = error_of([&] { model->loss(ids, bad); });
  EXPECT_TRUE(contains(msg, "target ids must be in [0, 101)")) << msg;
}

// --- Training over dp x tp against one process --------------------------------------------

TEST(TrainerTp, DpTimesTpTrainsLikeOneProcessAndExportsTheWholeModel) {
  const int64_t n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs at 2 and 4 ranks (tp 2, dp x tp = 2 x 2, tp 4)";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  struct Layout {
    const char* model;
    int64_t tp;
    bool sp;
    int64_t grad_accum;
    double dropout;  // only where dp = 1: data-parallel ranks draw their own masks
  };
  std::vector<Layout> layouts = {
      {"gpt2", 2, false, 2, 0.0}, {"llama", 2, true, 1, 0.0}, {"gpt2", n, true, 1, 0.1}};
  if (n == 4)
    layouts.insert(layouts.end(), {{"gpt2", 4, true, 1, 0.0}, {"llama", 4, false, 2, 0.0}});
  std::map<std::string, loom::testing::RunResult> single;
  for (const auto& layout : layouts) {
    SCOPED_TRACE(fmt::format("{} tp {} dp {}{} accum {} dropout {}", layout.model, layout.tp,
                             n / layout.tp, layout.sp ? " sp" : "", layout.grad_accum,
                             layout.dropout));
    auto config = loom::testing::tiny_layout_config(dir.path(), layout.model);
    config.grad_accum = layout.grad_accum;
    config.dropout = layout.dropout;
    const auto key = fmt::format("{}{}{}", layout.model, layout.grad_accum, layout.dropout);
    if (!single.count(key)) {
      train::Trainer t(config);
      single[key] = loom::testing::run(t);
    }
    config.tp = layout.tp;
    config.sequence_parallel = layout.sp;
    config.export_hf = (dir / fmt::format("hf_{}_{}", layout.model, layout.tp)).string();
    train::Trainer t(config, loom::testing::layout_mesh({.tp = layout.tp}));
    EXPECT_EQ(t.mesh().size(dist::Dim::dp), n / layout.tp);
    auto distributed = loom::testing::run(t);
    loom::testing::expect_same_run(distributed, single[key]);
    // Ranks holding the same replicated key/value head (llama-tiny's 2 kv heads at tp 4) still
    // hold identical copies after training: their gradients were summed, not left partial.
    auto& tp = t.model().tp();
    for (const auto& item : t.model().named_parameters()) {
      const auto& spec = t.model().shard_spec(item.key());
      const int64_t reps = spec.replicas(tp.size());
      if (!spec.sharded() || reps == 1) continue;
      auto mine = item.value().detach().contiguous();
      auto all = at::empty({tp.size(), mine.numel()}, mine.options());
      tp.comm()->all_gather(all, mine.view({-1}));
      const int64_t first = tp.rank() / reps * reps;
      EXPECT_TRUE(at::equal(all[first], mine.view({-1}))) << item.key() << " replicas differ";
    }

    // The export holds the single-process model: its logits are the sharded model's.
    t.fit();  // already at the last step: only exports
    auto tokens = at::randint(0, 256, {2, 16}, at::kLong);
    world().broadcast(tokens, 0);
    torch::NoGradGuard no_grad;
    t.model().eval();
    // On the training device (scripts/gpu-check trains these on the GPU); the export loads on
    // the host.
    const auto device = t.model().parameters().front().device();
    auto logits = t.model().forward(tokens.to(device)).cpu();
    if (world().rank() == 0) {
      auto exported = models::load_hf(config.export_hf);
      exported->eval();
      // The export rounds the fp64 parameters to float32: an fp32 model against the fp64 one.
      EXPECT_CLOSE_WITHIN(exported->forward(tokens), logits, "exported logits", kFp32Close);
      EXPECT_EQ(exported->config().vocab_size, 257);
    }
    world().barrier();
  }
}

TEST(TrainerTp, CheckpointAtTpResumesAtAnotherTp) {
  const int64_t n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs at 2 and 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = loom::testing::tiny_layout_config(dir.path(), "llama");
  config.steps = 4;
  config.lr_decay_steps = 4;  // the first half stops at step 2 on the same schedule
  loom::testing::RunResult straight;
  {
    train::Trainer t(config);
    straight = loom::testing::run(t);
  }
  // Two steps at tp = n (checkpoint), then two more at tp = n / 2 with dp = 2 from it.
  auto first = config;
  first.tp = n;
  first.save_dir = (dir / "ckpt").string();
  first.save_every = 2;
  first.steps = 2;
  {
    train::Trainer t(first, loom::testing::layout_mesh({.tp = n}));
    t.fit();
  }
  auto second = config;
  second.tp = n / 2;
  second.resume = (dir / "ckpt").string();
  train::Trainer t(second, loom::testing::layout_mesh({.tp = n / 2}));
  EXPECT_EQ(t.step(), 2);
  auto resumed = loom::testing::run(t);
  resumed.losses.insert(resumed.losses.begin(), straight.losses.begin(),
                        straight.losses.begin() + 2);
  loom::testing::expect_same_run(resumed, straight);
}

TEST(TrainerTp, TpThatDoesNotDivideTheHeadsIsAClearError) {
  if (world().size() != 3) GTEST_SKIP() << "needs 3 ranks (gpt2-tiny has 4 heads)";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  auto config = loom::testing::tiny_layout_config(dir.path(), "gpt2");
  config.tp = 3;
  config.batch_size = 3;
  const auto msg =
      error_of([&] { train::Trainer t(config, loom::testing::layout_mesh({.tp = 3})); });
  EXPECT_TRUE(contains(msg, "n_heads 4 is not divisible by tp 3")) << msg;
}

TEST(TrainerTp, Bf16TracksOneProcess) {
  const int64_t n = world().size();
  if (n != 2 && n != 4) GTEST_SKIP() << "runs at 2 and 4 ranks";
  loom::testing::SharedTempDir dir;
  loom::testing::write_shared_corpus(dir, 30000, 4000);
  // bf16 under autocast: partial sums leave the TP regions in bf16, so the sharded run rounds
  // differently from one process; it must still track it to bf16 precision.
  for (const char* model : {"gpt2", "llama"}) {
    SCOPED_TRACE(model);
    auto config = loom::testing::tiny_layout_config(dir.path(), model);
    config.precision = "bf16";
    loom::testing::RunResult single;
    {
      train::Trainer t(config);
      single = loom::testing::run(t);
    }
    config.tp = n;
    config.sequence_parallel = true;
    train::Trainer t(config, loom::testing::layout_mesh({.tp = n}));
    // Measured: losses within 2.7e-4, parameters 0.5-0.6% at tp 2 and 4 (docs/testing.md).
    loom::testing::expect_bf16_tracks(loom::testing::run(t), single,
                                      fmt::format("{} tp {}", model, n));
  }
}
