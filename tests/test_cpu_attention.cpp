// loom's CPU attention kernel (src/ops/cpu_attention.cpp) at every x86 level this machine has,
// against an fp64 run of the plain math (ops::attention_reference and its autograd), with a
// bound from a rounding-error estimate built from the same fp64 run (below); and the properties
// the layouts rely on: the same bits at any thread count, grouped-query heads, any strides.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "loom/core/rng.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/attention.h"
#include "loom/ops/attention_partial.h"
#include "loom/ops/cpu_attention.h"
#include "test_util.h"

namespace {

using namespace loom;
using namespace loom::testing;

constexpr double kEps32 = std::numeric_limits<float>::epsilon();  // 2^-23

struct Shape {
  int64_t b, h, h_kv, t, s, d;
  bool causal;
  bool packed;  // q, k, v as strided views of one [B, T, 3, H, D] buffer (GPT-2's layout)
};

// Short and long rows, lengths that are not multiples of the 16-wide tiles or of the 64-row
// backward blocks, grouped-query heads, cross attention with S != T, head_dim 16 to 128.
const Shape kShapes[] = {
    {2, 4, 4, 128, 128, 64, true, true},   {1, 3, 3, 37, 37, 32, true, false},
    {2, 4, 2, 70, 70, 16, true, false},    {2, 2, 1, 19, 50, 48, false, false},
    {1, 2, 2, 150, 150, 128, true, false}, {1, 1, 1, 1, 1, 16, true, false},
    {1, 2, 2, 300, 300, 32, false, true},
};

struct Inputs {
  at::Tensor q, k, v, d_o;
};

Inputs make_inputs(const Shape& s, uint64_t seed) {
  auto gen = core::make_generator(seed);
  Inputs in;
  if (s.packed) {
    auto qkv = at::randn({s.b, s.t, 3, s.h, s.d}, gen, at::kFloat).permute({2, 0, 3, 1, 4});
    in.q = qkv[0], in.k = qkv[1], in.v = qkv[2];
  } else {
    in.q = at::randn({s.b, s.h, s.t, s.d}, gen, at::kFloat);
    in.k = at::randn({s.b, s.h_kv, s.s, s.d}, gen, at::kFloat) * 1.5;
    in.v = at::randn({s.b, s.h_kv, s.s, s.d}, gen, at::kFloat);
  }
  in.d_o = at::randn({s.b, s.h, s.t, s.d}, gen, at::kFloat);
  return in;
}

at::Tensor expand_kv(const at::Tensor& x, int64_t group) {
  return group > 1 ? x.repeat_interleave(group, 1) : x;
}

// The fp64 reference and the error bound of each result. Each fp32 dot product or sum of n
// terms errs by at most n eps times the sum of its terms' magnitudes (the classic gamma_n
// bound), so with A = max_ij sum_d |q_id k_jd|:
//   a score errs by <= d eps scale A; a probability, relatively, by
//   e_p = (2 d scale A + s + 8) eps (its score and the row maximum, the exp polynomial and
//   scaling, the row sum's s terms, the reciprocal);
//   o = P v errs by <= (e_p + s eps) (|P| |v|); dv = P^T dO by <= (e_p + t eps) (|P|^T |dO|);
//   dS = P (dP - delta) with dP and delta dot products of d terms: |dS| errs by
//   <= (e_p + 2 d eps) |P| (|dO| |v|^T + |dO . O|) =: E; dq = scale dS k by
//   <= scale ((e_p + (2 d + s) eps) E' |k|), dk likewise with |q| and t; E' the magnitude above.
// Twice these, for the second-order terms the first-order estimate leaves out.
struct Reference {
  at::Tensor o, lse, dq, dk, dv;
  at::Tensor bound_o, bound_lse, bound_dq, bound_dk, bound_dv;
};

// The keys each query attends under a document mask's first keys [B, T], causal folded in:
// bool [B, 1, T, T].
at::Tensor allowed_keys(const at::Tensor& first_key) {
  const int64_t t = first_key.size(1);
  const auto keys = at::arange(t, at::kLong);
  return ((keys.view({1, 1, t}) >= first_key.to(at::kLong).unsqueeze(-1)) &
          (keys.view({1, 1, t}) <= keys.view({1, t, 1})))
      .unsqueeze(1);
}

Reference reference(const Shape& s, const Inputs& in, const at::Tensor& first_key = {}) {
  const int64_t group = s.h / s.h_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  auto q = in.q.to(at::kDouble).detach().requires_grad_(true);
  auto k = in.k.to(at::kDouble).detach().requires_grad_(true);
  auto v = in.v.to(at::kDouble).detach().requires_grad_(true);
  const auto d_o = in.d_o.to(at::kDouble);
  Reference r;
  r.o = ops::attention_reference(q, k, v, {.causal = s.causal, .first_key = first_key});
  auto grads = torch::autograd::grad({r.o}, {q, k, v}, {d_o});
  r.dq = grads[0], r.dk = grads[1], r.dv = grads[2];
  torch::NoGradGuard no_grad;
  const auto kk = expand_kv(k, group), vv = expand_kv(v, group);
  auto scores = at::matmul(q, kk.transpose(-2, -1)) * scale;
  if (first_key.defined())
    scores.masked_fill_(allowed_keys(first_key).logical_not(), -INFINITY);
  else if (s.causal)
    scores.masked_fill_(at::ones({s.t, s.s}, at::kBool).triu(1), -INFINITY);
  r.lse = at::logsumexp(scores, -1);
  const auto p = at::softmax(scores, -1);
  const double a = at::matmul(q.abs(), kk.abs().transpose(-2, -1)).max().item<double>();
  const double e_p = (2 * s.d * scale * a + s.s + 8) * kEps32;
  r.bound_o = 2 * (e_p + s.s * kEps32) * at::matmul(p, vv.abs());
  r.bound_lse = at::full_like(r.lse, 2 * (s.d * scale * a + s.s + 4) * kEps32);
  const auto dv_terms = at::matmul(p.transpose(-2, -1), d_o.abs());
  r.bound_dv = 2 * (e_p + s.t * kEps32) * dv_terms.unflatten(1, {s.h_kv, group}).sum(2);
  const auto o_abs = at::matmul(p, vv);
  const auto ds_terms =
      p * (at::matmul(d_o.abs(), vv.abs().transpose(-2, -1)) + (d_o * o_abs).abs().sum(-1, true));
  const double e_ds = e_p + 2 * s.d * kEps32;
  r.bound_dq = 2 * scale * (e_ds + s.s * kEps32) * at::matmul(ds_terms, kk.abs());
  const auto dk_terms = at::matmul(ds_terms.transpose(-2, -1), q.abs());
  r.bound_dk = 2 * scale * (e_ds + s.t * kEps32) * dk_terms.unflatten(1, {s.h_kv, group}).sum(2);
  return r;
}

// max over elements of |got - want| / bound (<= 1 passes).
double worst(const at::Tensor& got, const at::Tensor& want, const at::Tensor& bound) {
  return ((got.to(at::kDouble) - want).abs() / (bound + 1e-300)).max().item<double>();
}

std::string name(const Shape& s) {
  return fmt::format("B{} H{}/{} T{} S{} D{}{}{}", s.b, s.h, s.h_kv, s.t, s.s, s.d,
                     s.causal ? " causal" : "", s.packed ? " packed" : "");
}

// The kernel's forward and backward at every x86 level this machine has, each result within
// its bound of the fp64 reference (max |err| / bound <= 1), printed per level. `first_key`: a
// document mask, or none.
void check_every_level(const Shape& shape, const Inputs& in, const Reference& ref,
                       const at::Tensor& first_key = {}) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape.d));
  const std::string label = name(shape) + (first_key.defined() ? " docs" : "");
  for (auto isa : ops::available_cpu_isas()) {
    SCOPED_TRACE(label + " " + ops::to_string(isa));
    auto [o, lse] =
        ops::cpu_attention_forward(in.q, in.k, in.v, shape.causal, scale, isa, first_key);
    auto [dq, dk, dv] = ops::cpu_attention_backward(in.d_o, in.q, in.k, in.v, o, lse, shape.causal,
                                                    scale, isa, first_key);
    const double w[] = {worst(o, ref.o, ref.bound_o), worst(lse, ref.lse, ref.bound_lse),
                        worst(dq, ref.dq, ref.bound_dq), worst(dk, ref.dk, ref.bound_dk),
                        worst(dv, ref.dv, ref.bound_dv)};
    std::printf("%-39s %-8s max |err| / bound: o %.3f lse %.3f dq %.3f dk %.3f dv %.3f\n",
                label.c_str(), ops::to_string(isa).c_str(), w[0], w[1], w[2], w[3], w[4]);
    for (double x : w) EXPECT_LE(x, 1.0);
  }
}

TEST(CpuAttention, ForwardAndBackwardTrackFp64AtEveryLevel) {
  for (const auto& shape : kShapes) {
    const auto in = make_inputs(shape, 11);
    const auto ref = reference(shape, in);
    check_every_level(shape, in, ref);
  }
}

// Token ids [B, T] with a document start (id 0) at a few places in each row: adjacent ones (a
// document of one token), one at position 0 in the first row only, the rest spread at random.
at::Tensor documents(int64_t b, int64_t t, uint64_t seed) {
  auto gen = core::make_generator(seed);
  auto tokens = at::randint(1, 50, {b, t}, gen, at::kLong);
  const auto starts = at::randint(0, t, {b, std::max<int64_t>(1, t / 24)}, gen, at::kLong);
  for (int64_t row = 0; row < b; ++row) tokens[row].index_fill_(0, starts[row], 0);
  tokens[0][0] = 0;
  tokens[b - 1][t / 2] = 0;
  tokens[b - 1][t / 2 + 1] = 0;
  return tokens;
}

// A document mask (ops::document_first_keys) through the kernel at every level, held to the same
// fp64 estimate as the unmasked attention, and through ops::attention's other backends.
TEST(CpuAttention, DocumentMaskTracksFp64AtEveryLevel) {
  const Shape shapes[] = {{2, 4, 2, 150, 150, 32, true, false},
                          {1, 2, 2, 300, 300, 64, true, true},
                          {3, 1, 1, 70, 70, 16, true, false}};
  for (const auto& shape : shapes) {
    const auto in = make_inputs(shape, 17);
    const auto first_key = ops::document_first_keys(documents(shape.b, shape.t, 23), 0);
    const auto ref = reference(shape, in, first_key);
    check_every_level(shape, in, ref, first_key);
    // ops::attention: auto (this kernel, with autograd), SDPA (a boolean mask) and the math.
    for (auto backend : {ops::AttentionBackend::kAuto, ops::AttentionBackend::kSdpa,
                         ops::AttentionBackend::kMath}) {
      SCOPED_TRACE(name(shape) + " docs " + ops::to_string(backend));
      auto q = in.q.clone().requires_grad_(true), k = in.k.clone().requires_grad_(true),
           v = in.v.clone().requires_grad_(true);
      auto o =
          ops::attention(q, k, v, {.causal = true, .backend = backend, .first_key = first_key});
      o.backward(in.d_o);
      EXPECT_LE(worst(o, ref.o, ref.bound_o), 1.0);
      EXPECT_LE(worst(q.grad(), ref.dq, ref.bound_dq), 1.0);
      EXPECT_LE(worst(k.grad(), ref.dk, ref.bound_dk), 1.0);
      EXPECT_LE(worst(v.grad(), ref.dv, ref.bound_dv), 1.0);
    }
  }
}

// What the mask means: each document of a window attends as if it were alone (the math in fp64,
// document by document, against the whole window masked), and the first keys are those of the
// document each position is in.
TEST(CpuAttention, DocumentMaskEqualsEachDocumentAlone) {
  const auto tokens = at::tensor({7, 7, 1, 7, 7, 7, 1, 1, 7, 7}, at::kLong).view({1, 10});
  const auto first_key = ops::document_first_keys(tokens, 1);
  EXPECT_TRUE(
      at::equal(first_key, at::tensor({0, 0, 2, 2, 2, 2, 6, 7, 7, 7}, at::kInt).view({1, 10})));
  EXPECT_EQ(first_key.scalar_type(), at::kInt);
  auto gen = core::make_generator(4);
  const auto q = at::randn({1, 2, 10, 16}, gen, at::kDouble);
  const auto k = at::randn({1, 1, 10, 16}, gen, at::kDouble);
  const auto v = at::randn({1, 1, 10, 16}, gen, at::kDouble);
  const auto masked = ops::attention_reference(q, k, v, {.causal = true, .first_key = first_key});
  const std::pair<int64_t, int64_t> docs[] = {{0, 2}, {2, 6}, {6, 7}, {7, 10}};
  for (const auto& [a, b] : docs) {
    const auto alone = ops::attention_reference(q.slice(2, a, b), k.slice(2, a, b),
                                                v.slice(2, a, b), {.causal = true});
    EXPECT_LE((masked.slice(2, a, b) - alone).abs().max().item<double>(), 1e-12) << a;
  }
  // The kernel, in fp32, on the same rows: the same documents.
  const auto fp32 = ops::cpu_attention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), true,
                                       0.25, first_key);
  const auto math =
      ops::attention_reference(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat),
                               {.causal = true, .scale = 0.25, .first_key = first_key});
  EXPECT_LE((fp32 - math).abs().max().item<double>(), 1e-5);
}

// First keys the kernels cannot take are refused, naming the value.
TEST(CpuAttention, InvalidDocumentMaskIsRefused) {
  const auto q = at::randn({1, 1, 4, 16});
  auto run = [&](const at::Tensor& fk, bool causal = true) {
    return error_of([&] { ops::attention(q, q, q, {.causal = causal, .first_key = fk}); });
  };
  auto msg = run(at::tensor({0, 0, 3, 2}, at::kInt).view({1, 4}));  // after its query
  EXPECT_TRUE(contains(msg, "first_key[0, 2] = 3")) << msg;
  msg = run(at::tensor({0, 1, 1, 0}, at::kInt).view({1, 4}));  // back to an earlier document
  EXPECT_TRUE(contains(msg, "first_key[0, 3] = 0")) << msg;
  msg = run(at::tensor({-1, 0, 0, 0}, at::kInt).view({1, 4}));
  EXPECT_TRUE(contains(msg, "first_key[0, 0] = -1")) << msg;
  msg = run(at::tensor({0, 0, 0, 0}, at::kLong).view({1, 4}));
  EXPECT_TRUE(contains(msg, "int32 [batch, seq] = [1, 4]")) << msg;
  msg = run(at::zeros({1, 4}, at::kInt), false);
  EXPECT_TRUE(contains(msg, "needs causal attention")) << msg;
}

// Every head is one thread's, computed in a fixed order: the thread count changes no bit.
TEST(CpuAttention, ThreadCountChangesNoBit) {
  const Shape shape{2, 4, 2, 100, 100, 32, true, false};
  const auto in = make_inputs(shape, 3);
  const int threads = at::get_num_threads();
  auto run = [&] {
    auto [o, lse] = ops::cpu_attention_forward(in.q, in.k, in.v, true, 0.2, ops::best_cpu_isa());
    auto [dq, dk, dv] = ops::cpu_attention_backward(in.d_o, in.q, in.k, in.v, o, lse, true, 0.2,
                                                    ops::best_cpu_isa());
    return std::vector<at::Tensor>{o, lse, dq, dk, dv};
  };
  at::set_num_threads(1);
  const auto one = run();
  at::set_num_threads(3);
  const auto three = run();
  at::set_num_threads(threads);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(at::equal(one[i], three[i])) << i;
}

// ops::attention picks the kernel for fp32 CPU inputs (auto), and autograd reaches its backward.
TEST(CpuAttention, AutoBackendRunsItWithAutograd) {
  const Shape shape{1, 2, 2, 40, 40, 32, true, false};
  const auto in = make_inputs(shape, 5);
  auto q = in.q.clone().requires_grad_(true), k = in.k.clone().requires_grad_(true),
       v = in.v.clone().requires_grad_(true);
  auto o = ops::attention(q, k, v, {.causal = true});
  o.backward(in.d_o);
  const double scale = 1.0 / std::sqrt(32.0);
  auto [o_direct, lse] =
      ops::cpu_attention_forward(in.q, in.k, in.v, true, scale, ops::best_cpu_isa());
  auto [dq, dk, dv] = ops::cpu_attention_backward(in.d_o, in.q, in.k, in.v, o_direct, lse, true,
                                                  scale, ops::best_cpu_isa());
  EXPECT_TRUE(at::equal(o, o_direct));
  EXPECT_TRUE(at::equal(q.grad(), dq));
  EXPECT_TRUE(at::equal(k.grad(), dk));
  EXPECT_TRUE(at::equal(v.grad(), dv));
  // The output is a transposed view of [B, T, H, D]: the models' reshape after it is free.
  EXPECT_TRUE(o.transpose(1, 2).is_contiguous());
}

// GPT-2's path: q, k, v packed as c_attn writes them. The gradient arrives in one packed tensor
// with the same bits as the three separate ones; other backends take the heads apart.
TEST(CpuAttention, PackedProjectionGivesTheSameBitsAndOnePackedGradient) {
  auto gen = core::make_generator(9);
  const auto base = at::randn({2, 50, 3, 4, 32}, gen, at::kFloat);
  const auto d_o = at::randn({2, 4, 50, 32}, gen, at::kFloat);
  auto qkv = base.clone().requires_grad_(true);
  auto o = ops::attention_packed(qkv, {.causal = true});
  o.backward(d_o);
  auto split = base.clone().requires_grad_(true);
  const auto heads = split.permute({2, 0, 3, 1, 4}).unbind(0);
  auto o_split = ops::attention(heads[0], heads[1], heads[2], {.causal = true});
  o_split.backward(d_o);
  EXPECT_TRUE(at::equal(o, o_split));
  EXPECT_TRUE(at::equal(qkv.grad(), split.grad()));
  EXPECT_TRUE(qkv.grad().is_contiguous());
  auto sdpa_in = base.clone().requires_grad_(true);
  auto o_sdpa =
      ops::attention_packed(sdpa_in, {.causal = true, .backend = ops::AttentionBackend::kSdpa});
  o_sdpa.backward(d_o);
  // The fallback is held to the same fp64 bound (the estimate holds for any summation order).
  const Shape shape{2, 4, 4, 50, 50, 32, true, true};
  const auto ref = reference(shape, {heads[0], heads[1], heads[2], d_o});
  const auto grads = sdpa_in.grad().permute({2, 0, 3, 1, 4});
  EXPECT_LE(worst(o_sdpa, ref.o, ref.bound_o), 1.0);
  EXPECT_LE(worst(grads[0], ref.dq, ref.bound_dq), 1.0);
  EXPECT_LE(worst(grads[1], ref.dk, ref.bound_dk), 1.0);
  EXPECT_LE(worst(grads[2], ref.dv, ref.bound_dv), 1.0);
  const auto msg = error_of([&] { ops::attention_packed(at::randn({2, 5, 2, 4, 16})); });
  EXPECT_TRUE(contains(msg, "[batch, seq, 3, heads, head_dim]")) << msg;
}

// GPT-2's c_attn bias, left out of the GEMM and added by the kernel as it packs q, k, v: the
// same bits as adding it first, and its gradient (summed over batch and positions in the kernel)
// within the fp32 summation bound of the fp64 sum, the same at any thread count.
TEST(CpuAttention, PackedProjectionBiasIsAddedAndDifferentiatedInTheKernel) {
  auto gen = core::make_generator(13);
  const auto base = at::randn({3, 45, 3, 2, 48}, gen, at::kFloat);
  const auto bias0 = at::randn({3 * 2 * 48}, gen, at::kFloat);
  const auto d_o = at::randn({3, 2, 45, 48}, gen, at::kFloat);
  const int threads = at::get_num_threads();
  auto run = [&](int n_threads) {
    at::set_num_threads(n_threads);
    auto qkv = base.clone().requires_grad_(true), bias = bias0.clone().requires_grad_(true);
    auto o = ops::attention_packed(qkv, {.causal = true}, bias);
    o.backward(d_o);
    at::set_num_threads(threads);
    return std::vector<at::Tensor>{o.detach(), qkv.grad(), bias.grad()};
  };
  const auto one = run(1), three = run(3);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(at::equal(one[i], three[i])) << i;
  auto added = (base + bias0.view({3, 2, 48})).requires_grad_(true);
  auto o_added = ops::attention_packed(added, {.causal = true});
  o_added.backward(d_o);
  EXPECT_TRUE(at::equal(one[0], o_added));
  EXPECT_TRUE(at::equal(one[1], added.grad()));
  const auto rows = added.grad().to(at::kDouble).reshape({-1, 3 * 2 * 48});
  const double bound = rows.size(0) * kEps32 * rows.abs().sum(0).max().item<double>();
  const double err = (one[2].to(at::kDouble) - rows.sum(0)).abs().max().item<double>();
  std::printf("bias gradient: max |err| %.3g, bound %.3g\n", err, bound);
  EXPECT_LE(err, bound);
  // Other backends add the bias before taking the heads apart.
  auto sdpa_in = base.clone().requires_grad_(true), sdpa_bias = bias0.clone().requires_grad_(true);
  auto o_sdpa = ops::attention_packed(
      sdpa_in, {.causal = true, .backend = ops::AttentionBackend::kSdpa}, sdpa_bias);
  o_sdpa.backward(d_o);
  const auto heads = added.detach().permute({2, 0, 3, 1, 4});
  const auto ref =
      reference({3, 2, 2, 45, 45, 48, true, true}, {heads[0], heads[1], heads[2], d_o});
  EXPECT_LE(worst(o_sdpa, ref.o, ref.bound_o), 1.0);
  // Its bias gradient: SDPA's dq, dk, dv errors (their bounds) summed over batch and positions,
  // plus the sum's own rounding.
  const auto grad_bounds =
      at::stack({ref.bound_dq, ref.bound_dk, ref.bound_dv}).sum({1, 3}).reshape({-1});
  EXPECT_LE(((sdpa_bias.grad().to(at::kDouble) - rows.sum(0)).abs() / (grad_bounds + bound))
                .max()
                .item<double>(),
            1.0);
  const auto msg = error_of([&] { ops::attention_packed(base, {}, at::randn({5})); });
  EXPECT_TRUE(contains(msg, "bias has 5 values")) << msg;
}

// A whole model on the kernel (head dim 16; GPT-2: packed gradient and c_attn bias in the
// kernel; Llama: grouped-query heads, RoPE'd q and k), with activation checkpointing, against an
// fp64 run of the same model (which takes SDPA): the kernel path's errors are no larger than
// those of the same fp32 model on PyTorch's SDPA (twice, plus a floor at fp32's resolution), and
// recomputing the attention core (selective) or each block (full) changes no bit of the loss.
class ModelOnTheKernel : public ::testing::TestWithParam<models::Family> {};

TEST_P(ModelOnTheKernel, IsAsAccurateAsOnSdpaAndCheckpointsExactly) {
  const bool gpt2 = GetParam() == models::Family::kGpt2;
  auto c = models::ModelConfig::preset(gpt2 ? "gpt2-tiny" : "llama-tiny");
  c.vocab_size = 61, c.d_model = 64, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = gpt2 ? 4 : 2;
  c.d_ff = gpt2 ? 256 : 176, c.max_seq_len = 32;
  const auto tokens = at::randint(0, c.vocab_size, {4, 32}, core::make_generator(1));
  const auto targets = at::randint(0, c.vocab_size, {4, 32}, core::make_generator(2));
  struct Run {
    at::Tensor loss;
    std::vector<at::Tensor> grads;
  };
  auto run = [&](at::ScalarType dtype, ops::AttentionBackend backend,
                 models::ActivationCheckpointing mode) {
    auto m = models::make_model(c);
    models::init_parameters(*m, 3);
    m->to(dtype);
    m->set_attention_backend(backend);
    m->set_activation_checkpointing(mode);
    Run r{m->loss(tokens, targets), {}};
    r.loss.backward();
    for (const auto& p : m->parameters()) r.grads.push_back(p.grad().to(at::kDouble));
    return r;
  };
  using models::ActivationCheckpointing;
  using ops::AttentionBackend;
  const auto exact = run(at::kDouble, AttentionBackend::kAuto, ActivationCheckpointing::kNone);
  const auto kernel = run(at::kFloat, AttentionBackend::kAuto, ActivationCheckpointing::kNone);
  const auto sdpa = run(at::kFloat, AttentionBackend::kSdpa, ActivationCheckpointing::kNone);
  // Largest gradient error relative to the largest gradient, over parameters.
  auto error = [&](const Run& r) {
    double worst = 0;
    for (size_t i = 0; i < r.grads.size(); ++i)
      worst = std::max(worst, ((r.grads[i] - exact.grads[i]).abs().max() /
                               exact.grads[i].abs().max().clamp_min(1e-300))
                                  .item<double>());
    return worst;
  };
  const double loss_kernel = std::abs(kernel.loss.item<double>() - exact.loss.item<double>());
  const double loss_sdpa = std::abs(sdpa.loss.item<double>() - exact.loss.item<double>());
  std::printf(
      "%s vs fp64: loss error kernel %.3g sdpa %.3g; gradient error kernel %.3g sdpa %.3g\n",
      gpt2 ? "GPT-2" : "Llama", loss_kernel, loss_sdpa, error(kernel), error(sdpa));
  const double floor = 16 * kEps32;
  EXPECT_LE(loss_kernel, 2 * loss_sdpa + floor * exact.loss.item<double>());
  EXPECT_LE(error(kernel), 2 * error(sdpa) + floor);
  for (auto mode : {ActivationCheckpointing::kSelective, ActivationCheckpointing::kFull}) {
    const auto r = run(at::kFloat, AttentionBackend::kAuto, mode);
    EXPECT_TRUE(at::equal(r.loss, kernel.loss)) << models::to_string(mode);
    for (size_t i = 0; i < r.grads.size(); ++i)
      EXPECT_LE(((r.grads[i] - kernel.grads[i]).abs().max() /
                 kernel.grads[i].abs().max().clamp_min(1e-30))
                    .item<double>(),
                1e-6)
          << models::to_string(mode) << " parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(CpuAttention, ModelOnTheKernel,
                         ::testing::Values(models::Family::kGpt2, models::Family::kLlama),
                         [](const auto& info) { return models::to_string(info.param); });

TEST(CpuAttention, RefusesWhatItCannotTakeWithTheReason) {
  auto q = at::randn({1, 2, 8, 32});
  auto why = [](const at::Tensor& a, const at::Tensor& b, double p = 0.0) {
    auto r = ops::cpu_attention_unsupported(a, b, b, p);
    return r ? *r : std::string("(supported)");
  };
  EXPECT_TRUE(contains(why(q.to(at::kDouble), q.to(at::kDouble)), "fp32")) << why(q, q);
  EXPECT_TRUE(contains(why(at::randn({1, 2, 8, 20}), at::randn({1, 2, 8, 20})), "multiple of 16"));
  EXPECT_TRUE(contains(why(q, at::randn({1, 3, 8, 32})), "not a multiple of 3"));
  EXPECT_TRUE(contains(why(q, at::randn({1, 2, 0, 32})), "no keys"));
  EXPECT_TRUE(contains(why(q, q, 0.1), "dropout"));
  EXPECT_EQ(why(q, q), "(supported)");
  const auto msg = error_of([&] { ops::cpu_attention(q.to(at::kDouble), q, q, true, 0.1); });
  EXPECT_TRUE(contains(msg, "CPU attention kernel cannot take these inputs")) << msg;
  // What it does not take, auto hands to PyTorch's SDPA.
  const auto d = q.to(at::kDouble);
  const auto sdpa = ops::attention(d, d, d, {.causal = true});
  EXPECT_LE((sdpa - ops::attention_reference(d, d, d, {.causal = true})).abs().max().item<double>(),
            1e-12);
}

}  // namespace

// Partial attention (what ring attention computes per block pair): blocks merged by their
// log-sum-exp equal the whole causal attention, and the per-block gradients, given the whole
// attention's log-sum-exp and row sums, add up to its gradients. fp64: the only differences are
// sums in another order (~1e-15); a missed rescale or a wrong mask is off by 1e-2 or more.
TEST(AttentionPartial, BlocksMergeIntoTheWholeAttentionAndItsGradients) {
  const int64_t b = 2, hq = 4, hkv = 2, c = 5, d = 16, t = 3 * c;  // three blocks of c tokens
  at::manual_seed(11);
  auto q = at::randn({b, hq, t, d}, at::kDouble).requires_grad_();
  auto k = at::randn({b, hkv, t, d}, at::kDouble).requires_grad_();
  auto v = at::randn({b, hkv, t, d}, at::kDouble).requires_grad_();
  const auto dout = at::randn({b, hq, t, d}, at::kDouble);
  const auto want = ops::attention_reference(q, k, v, {.causal = true});
  (want * dout).sum().backward();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto block = [&](const at::Tensor& x, int64_t i) { return x.detach().narrow(2, i * c, c); };
  std::vector<at::Tensor> outs, lses;
  for (int64_t i = 0; i < 3; ++i) {
    // Merged newest-first, so the accumulator's rescale is exercised in both directions.
    auto acc = ops::empty_partial_attention(block(q, i));
    for (int64_t j = i; j >= 0; --j)
      ops::merge_partial_attention(
          acc, ops::attention_partial_forward(
                   block(q, i), block(k, j), block(v, j),
                   j == i ? ops::BlockMask::kCausal : ops::BlockMask::kFull, scale));
    outs.push_back(acc.out);
    lses.push_back(acc.lse);
  }
  const auto out = at::cat(outs, 2), lse = at::cat(lses, 2);
  auto rel = [](const at::Tensor& got, const at::Tensor& ref) {
    return (got - ref).abs().max().item<double>() / ref.abs().max().item<double>();
  };
  EXPECT_LE(rel(out, want.detach()), 1e-12);
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      const auto g = ops::attention_partial_backward(
          block(q, i), block(k, j), block(v, j), out.narrow(2, i * c, c), lse.narrow(2, i * c, c),
          dout.narrow(2, i * c, c), j == i ? ops::BlockMask::kCausal : ops::BlockMask::kFull,
          scale);
      dq.narrow(2, i * c, c).add_(g.dq);
      dk.narrow(2, j * c, c).add_(g.dk);
      dv.narrow(2, j * c, c).add_(g.dv);
    }
  EXPECT_LE(rel(dq, q.grad()), 1e-12);
  EXPECT_LE(rel(dk, k.grad()), 1e-12);
  EXPECT_LE(rel(dv, v.grad()), 1e-12);
  // A causal block needs as many queries as keys; mismatched heads are named.
  auto msg = error_of([&] {
    ops::attention_partial_forward(block(q, 0), block(k, 0).narrow(2, 0, 2),
                                   block(v, 0).narrow(2, 0, 2), ops::BlockMask::kCausal, scale);
  });
  EXPECT_TRUE(contains(msg, "as many queries as keys")) << msg;
  msg = error_of([&] {
    ops::attention_partial_forward(block(q, 0), at::zeros({b, 3, c, d}, at::kDouble),
                                   at::zeros({b, 3, c, d}, at::kDouble), ops::BlockMask::kFull,
                                   scale);
  });
  EXPECT_TRUE(contains(msg, "key/value heads dividing query heads")) << msg;
}
