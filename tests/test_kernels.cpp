// The kernels' host references against the naive math (docs/gpu.md, "Tests": CPU tests check the
// reference, GPU tests check the kernel against the reference). No GPU needed.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "attention/flash_attention_host.h"
#include "common/float16.h"
#include "flash_attention_host_run.h"
#include "loom/core/error.h"
#include "loom/ops/attention.h"
#include "loom/ops/bsr.h"
#include "loom/ops/sparse24.h"
#include "sparse24_util.h"

namespace kernels = loom::kernels;
namespace ops = loom::ops;

namespace {

using loom::testing::attention_strides_of;
using loom::testing::random_24_weight;

// [batch, heads, seq, dim] fp32 filled with NaN (so an element the reference never writes shows);
// strided: a transposed view of a [batch, seq, heads, dim] tensor, as attention inputs usually are.
at::Tensor nan_tensor(int b, int h, int s, int d, bool strided) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (strided) return at::full({b, s, h, d}, nan).transpose(1, 2);
  return at::full({b, h, s, d}, nan);
}

at::Tensor random_tensor(int b, int h, int s, int d, bool strided) {
  if (strided) return at::randn({b, s, h, d}).transpose(1, 2);
  return at::randn({b, h, s, d});
}

struct Case {
  std::string name;
  int batch, q_heads, kv_heads, q_len, kv_len, head_dim;
  bool causal;
  bool strided;       // inputs and outputs as transposed views [B, T, H, D] -> [B, H, T, D]
  float scale = 0.f;  // 0: 1/sqrt(head_dim)
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

struct Result {
  at::Tensor o, lse, dq, dk, dv;
};

// The plain math in fp64 with autograd: scores = q k^T * scale, causal mask, softmax, times v;
// lse = logsumexp of the masked scores; gradients of sum(o * d_o).
Result naive(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& d_o,
             bool causal, double scale) {
  auto q64 = q.to(at::kDouble).detach().requires_grad_(true);
  auto k64 = k.to(at::kDouble).detach().requires_grad_(true);
  auto v64 = v.to(at::kDouble).detach().requires_grad_(true);
  const int64_t group = q.size(1) / k.size(1);
  auto kk = k64.repeat_interleave(group, 1);
  auto vv = v64.repeat_interleave(group, 1);
  auto scores = at::matmul(q64, kk.transpose(-2, -1)) * scale;
  if (causal) {
    auto mask = at::ones({q.size(2), k.size(2)}, at::kBool).triu(1);
    scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
  }
  auto lse = at::logsumexp(scores, -1);
  auto o = at::matmul(at::softmax(scores, -1), vv);
  (o * d_o.to(at::kDouble)).sum().backward();
  return {o.detach(), lse.detach(), q64.grad(), k64.grad(), v64.grad()};
}

// The reference into NaN-filled outputs laid out like the inputs (strided or not).
loom::testing::FlashAttentionHostRun run_host(const Case& c, const at::Tensor& q,
                                              const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& d_o, float scale) {
  loom::testing::FlashAttentionHostRun out;
  out.o = nan_tensor(c.batch, c.q_heads, c.q_len, c.head_dim, c.strided);
  out.dq = nan_tensor(c.batch, c.q_heads, c.q_len, c.head_dim, c.strided);
  out.dk = nan_tensor(c.batch, c.kv_heads, c.kv_len, c.head_dim, c.strided);
  out.dv = nan_tensor(c.batch, c.kv_heads, c.kv_len, c.head_dim, c.strided);
  return loom::testing::run_flash_attention_host(q, k, v, d_o, c.causal, scale, out);
}

// max |got - want| / max(1, max |want|): absolute error for O(1) values, relative for large ones.
double scaled_error(const at::Tensor& got, const at::Tensor& want) {
  EXPECT_EQ(got.sizes(), want.sizes());
  const double diff = (got.to(at::kDouble) - want).abs().max().item<double>();
  const double mag = want.numel() ? want.abs().max().item<double>() : 0.0;
  return diff / std::max(1.0, mag);
}

class FlashAttentionHost : public ::testing::TestWithParam<Case> {};

// The fp32 host reference against fp64 autograd. Tolerance: 1e-5 on max |error| / max(1, max
// |value|) for o, lse, dq, dk, dv (fp32 rounding over sums of a few hundred terms is ~1e-6).
TEST_P(FlashAttentionHost, MatchesNaiveAttentionForwardAndBackward) {
  const Case& c = GetParam();
  at::manual_seed(1234);
  const auto q = random_tensor(c.batch, c.q_heads, c.q_len, c.head_dim, c.strided);
  const auto k = random_tensor(c.batch, c.kv_heads, c.kv_len, c.head_dim, c.strided);
  const auto v = random_tensor(c.batch, c.kv_heads, c.kv_len, c.head_dim, c.strided);
  const auto d_o = random_tensor(c.batch, c.q_heads, c.q_len, c.head_dim, c.strided);
  const float scale = c.scale > 0 ? c.scale : 1.f / std::sqrt(float(c.head_dim));

  const Result want = naive(q, k, v, d_o, c.causal, scale);
  const auto run = run_host(c, q, k, v, d_o, scale);
  const Result got{run.o, run.lse, run.dq, run.dk, run.dv};
  constexpr double kTol = 1e-5;
  const double err_o = scaled_error(got.o, want.o), err_lse = scaled_error(got.lse, want.lse);
  const double err_dq = scaled_error(got.dq, want.dq), err_dk = scaled_error(got.dk, want.dk);
  const double err_dv = scaled_error(got.dv, want.dv);
  EXPECT_LE(err_o, kTol);
  EXPECT_LE(err_lse, kTol);
  EXPECT_LE(err_dq, kTol);
  EXPECT_LE(err_dk, kTol);
  EXPECT_LE(err_dv, kTol);
  RecordProperty("max_error", std::to_string(std::max({err_o, err_lse, err_dq, err_dk, err_dv})));
  std::printf("  %s: errors o %.2e lse %.2e dq %.2e dk %.2e dv %.2e; tiles fwd %lld bwd %lld\n",
              c.name.c_str(), err_o, err_lse, err_dq, err_dk, err_dv,
              static_cast<long long>(run.forward.tiles),
              static_cast<long long>(run.backward.tiles));

  // The reference visits exactly the tiles the kernel's grid does: every (query tile, key tile)
  // pair of each (batch, query head), less the causal tiles above the diagonal.
  int64_t fwd_tiles = 0, bwd_tiles = 0;
  for (int m = 0; m < kernels::attention_ceil_div(c.q_len, kernels::kFwdBlockM); ++m)
    fwd_tiles += kernels::fwd_num_kv_tiles(m, c.q_len, c.kv_len, c.causal);
  const int block_m = kernels::bwd_block_m(c.head_dim);
  for (int n = 0; n < kernels::attention_ceil_div(c.kv_len, kernels::kBwdBlockN); ++n)
    bwd_tiles += kernels::attention_ceil_div(c.q_len, block_m) -
                 kernels::bwd_first_q_tile(n, block_m, c.causal);
  EXPECT_EQ(run.forward.tiles, fwd_tiles * c.batch * c.q_heads);
  EXPECT_EQ(run.backward.tiles, bwd_tiles * c.batch * c.q_heads);
}

// A document mask: the reference against the fp64 math with the same mask
// (ops::attention_reference), and whole tiles skipped on both sides — fewer than the causal count,
// forward and backward.
TEST(FlashAttentionHostDocuments, MatchesMaskedAttentionAndSkipsTiles) {
  at::manual_seed(77);
  const int t = 2 * kernels::kFwdBlockM + 50;
  auto tokens = at::randint(1, 100, {2, t}, at::kLong);
  for (int64_t start : {0, 70, 71, 150, 300}) tokens[0][start] = 0;
  for (int64_t start : {0, 200}) tokens[1][start] = 0;
  const auto first_key = ops::document_first_keys(tokens, 0);
  const auto q = random_tensor(2, 4, t, 64, false), k = random_tensor(2, 2, t, 64, true);
  const auto v = random_tensor(2, 2, t, 64, false), d_o = random_tensor(2, 4, t, 64, false);
  const float scale = 0.125f;
  const auto run =
      loom::testing::run_flash_attention_host(q, k, v, d_o, true, scale, {}, first_key);
  auto q64 = q.to(at::kDouble).requires_grad_(true), k64 = k.to(at::kDouble).requires_grad_(true),
       v64 = v.to(at::kDouble).requires_grad_(true);
  const auto o = ops::attention_reference(q64, k64, v64,
                                          {.causal = true, .scale = scale, .first_key = first_key});
  (o * d_o.to(at::kDouble)).sum().backward();
  EXPECT_LE(scaled_error(run.o, o.detach()), 1e-5);
  EXPECT_LE(scaled_error(run.dq, q64.grad()), 1e-5);
  EXPECT_LE(scaled_error(run.dk, k64.grad()), 1e-5);
  EXPECT_LE(scaled_error(run.dv, v64.grad()), 1e-5);
  const auto causal = loom::testing::run_flash_attention_host(q, k, v, d_o, true, scale);
  std::printf("  documents: tiles fwd %lld bwd %lld; causal fwd %lld bwd %lld\n",
              static_cast<long long>(run.forward.tiles), static_cast<long long>(run.backward.tiles),
              static_cast<long long>(causal.forward.tiles),
              static_cast<long long>(causal.backward.tiles));
  EXPECT_LT(run.forward.tiles, causal.forward.tiles);
  EXPECT_LT(run.backward.tiles, causal.backward.tiles);
}

std::vector<Case> cases() {
  using kernels::kFwdBlockM;
  using kernels::kFwdBlockN;
  return {
      {"tiny_d16", 2, 2, 2, 7, 7, 16, false, false},
      {"tiny_d16_causal", 2, 2, 2, 7, 7, 16, true, false},
      {"one_row_d64", 1, 2, 2, 1, 1, 64, false, false},
      {"one_row_d64_causal", 1, 2, 1, 1, 1, 64, true, true},
      {"d64_t65_causal_gqa2", 1, 4, 2, 65, 65, 64, true, false},
      {"d64_t130_mha_scale", 1, 2, 2, 130, 130, 64, false, false, 0.3f},
      {"d128_t130_causal_gqa4_strided", 1, 4, 1, 130, 130, 128, true, true},
      {"d128_t130_s77_gqa2", 2, 4, 2, 130, 77, 128, false, false},
      {"d64_t33_s200_gqa4_strided", 1, 4, 1, 33, 200, 64, false, true},
      // Spans several tiles both ways: 3 query tiles and 5 key tiles in the forward.
      {"multi_tile_causal", 1, 1, 1, 2 * kFwdBlockM + 3, 2 * kFwdBlockM + 3, 32, true, false},
      {"multi_tile_s_gt_t", 1, 2, 1, kFwdBlockM + 1, 4 * kFwdBlockN + 1, 32, false, true},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, FlashAttentionHost, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(FlashAttentionHostTiles, LengthsUsedAboveSpanSeveralTiles) {
  // The multi_tile cases above only test tiling if they cross tile boundaries.
  EXPECT_GT(2 * kernels::kFwdBlockM + 3, 2 * kernels::kFwdBlockM);
  EXPECT_GT(4 * kernels::kFwdBlockN + 1, 4 * kernels::kFwdBlockN);
  EXPECT_EQ(kernels::kFwdBlockM, 128);
  EXPECT_EQ(kernels::kFwdBlockN, 64);
  EXPECT_EQ(kernels::kBwdBlockN, 64);
  EXPECT_EQ(kernels::bwd_block_m(64), 64);
  EXPECT_EQ(kernels::bwd_block_m(128), 32);
}

// The tile ranges shared by the kernel and the reference, against brute force over every element:
// a skipped tile is fully masked, a visited one is not, and a tile said to need no mask has no
// masked element.
TEST(FlashAttentionHostTiles, CausalTileRangesMatchTheElementMask) {
  using namespace kernels;
  for (bool causal : {false, true}) {
    for (int len : {1, 2, 63, 64, 65, 127, 128, 129, 200, 256, 300}) {
      const int q_len = len, kv_len = causal ? len : len + 37;
      auto masked = [&](int row, int key) { return key >= kv_len || (causal && key > row); };
      auto count_unmasked = [&](int r0, int r1, int k0, int k1) {
        int n = 0;
        for (int r = r0; r < std::min(r1, q_len); ++r)
          for (int key = k0; key < k1; ++key) n += !masked(r, key);
        return n;
      };
      // Forward.
      for (int m = 0; m < attention_ceil_div(q_len, kFwdBlockM); ++m) {
        const int r0 = m * kFwdBlockM, visited = fwd_num_kv_tiles(m, q_len, kv_len, causal);
        for (int n = 0; n < attention_ceil_div(kv_len, kFwdBlockN) + 1; ++n) {
          const int k0 = n * kFwdBlockN,
                    live = count_unmasked(r0, r0 + kFwdBlockM, k0, k0 + kFwdBlockN);
          if (n < visited) {
            EXPECT_GT(live, 0) << "forward visits a fully masked tile " << m << "," << n;
            const int rows = std::min(kFwdBlockM, q_len - r0);
            if (!fwd_tile_needs_mask(m, n, kv_len, causal)) {
              EXPECT_EQ(live, rows * kFwdBlockN) << "unmasked tile has masked elements";
            }
          } else {
            EXPECT_EQ(live, 0) << "forward skips a live tile " << m << "," << n;
          }
        }
      }
      // Backward, for both query tile heights.
      for (int block_m : {bwd_block_m(64), bwd_block_m(128)}) {
        for (int n = 0; n < attention_ceil_div(kv_len, kBwdBlockN); ++n) {
          const int k0 = n * kBwdBlockN, first = bwd_first_q_tile(n, block_m, causal);
          for (int m = 0; m < attention_ceil_div(q_len, block_m); ++m) {
            const int r0 = m * block_m,
                      live = count_unmasked(r0, r0 + block_m, k0, k0 + kBwdBlockN);
            if (m < first) {
              EXPECT_EQ(live, 0) << "backward skips a live tile " << m << "," << n;
            } else if (!bwd_tile_needs_mask(m, block_m, n, kv_len, causal)) {
              const int rows = std::min(block_m, q_len - r0);
              EXPECT_EQ(live, rows * kBwdBlockN) << "unmasked tile has masked elements";
            }
          }
          if (first < attention_ceil_div(q_len, block_m)) {
            EXPECT_GT(count_unmasked(first * block_m, (first + 1) * block_m, k0, k0 + kBwdBlockN),
                      0);
          }
        }
      }
    }
  }
}

// With no key at all every row is fully masked: o = 0 and lse = -inf (no NaN), zero dq.
TEST(FlashAttentionHostTiles, FullyMaskedRowsGiveZeroOutputAndMinusInfinityLse) {
  const int B = 1, H = 2, T = 5, S = 0, D = 8;
  auto q = at::randn({B, H, T, D}), d_o = at::randn({B, H, T, D});
  auto k = at::empty({B, H, S, D}), v = at::empty({B, H, S, D});
  auto o = at::full({B, H, T, D}, 7.f), lse = at::full({B, H, T}, 7.f);
  auto dq = at::full({B, H, T, D}, 7.f);
  kernels::FlashAttentionHostParams p;
  p.batch = B;
  p.q_heads = p.kv_heads = H;
  p.q_len = T;
  p.kv_len = S;
  p.head_dim = D;
  p.scale = 0.5f;
  p.q_strides = p.o_strides = p.d_o_strides = p.dq_strides = attention_strides_of(q);
  p.k_strides = p.v_strides = p.dk_strides = p.dv_strides = attention_strides_of(k);
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr<float>();
  p.v = v.data_ptr<float>();
  p.o = o.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.d_o = d_o.data_ptr<float>();
  p.dq = dq.data_ptr<float>();
  p.dk = k.data_ptr<float>();
  p.dv = v.data_ptr<float>();
  ASSERT_TRUE(kernels::flash_attention_forward_host(p).ok());
  EXPECT_TRUE(at::equal(o, at::zeros_like(o)));
  EXPECT_TRUE(at::equal(lse, at::full_like(lse, -std::numeric_limits<float>::infinity())));
  ASSERT_TRUE(kernels::flash_attention_backward_host(p).ok());
  EXPECT_TRUE(at::equal(dq, at::zeros_like(dq)));
}

TEST(FlashAttentionChecks, RejectWhatTheKernelCannotRunWithClearMessages) {
  kernels::AttentionProblem p;
  p.batch = 1;
  p.q_heads = 4;
  p.kv_heads = 2;
  p.q_len = p.kv_len = 16;
  p.head_dim = 64;
  p.scale = 0.125f;
  EXPECT_TRUE(kernels::check_attention_problem(p, true).ok());

  auto message = [](const kernels::AttentionProblem& x, bool kernel) {
    auto s = kernels::check_attention_problem(x, kernel);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code, kernels::StatusCode::kInvalidArgument);
    return s.message;
  };
  auto contains = [](const std::string& s, const std::string& part) {
    return s.find(part) != std::string::npos;
  };
  auto bad = p;
  bad.head_dim = 96;
  const auto m = message(bad, true);
  EXPECT_TRUE(contains(m, "head_dim 96") && contains(m, "64, 128")) << m;
  EXPECT_TRUE(kernels::check_attention_problem(bad, false).ok());  // the host reference takes it

  bad = p;
  bad.q_heads = 6;
  bad.kv_heads = 4;
  EXPECT_TRUE(contains(message(bad, true), "q_heads 6 is not a multiple of kv_heads 4"));

  bad = p;
  bad.causal = true;
  bad.kv_len = 17;
  EXPECT_TRUE(contains(message(bad, false), "q_len 16 and kv_len 17"));

  bad = p;
  bad.scale = 0.f;
  EXPECT_TRUE(contains(message(bad, false), "scale"));
}

// ---- 2:4 sparse (kernels/sparse) ------------------------------------------------------------

// The host conversions the references round with agree with c10's (round to nearest even) on
// every kind of value: normal, fp16-subnormal, halfway cases, overflow to inf, zeros of both signs.
TEST(Float16Host, ConversionsRoundLikeC10) {
  std::vector<float> values = {0.f,
                               -0.f,
                               1.f,
                               -1.f,
                               65504.f,
                               65519.f,
                               65520.f,
                               1e9f,
                               -1e9f,
                               6.1035156e-05f,
                               5.9604645e-08f,
                               2.9802322e-08f,
                               8.9406967e-08f,
                               1.0e-10f,
                               3.0e-39f};
  const auto random = at::randn({20000}, at::TensorOptions().dtype(at::kDouble));
  const auto exponents = at::randint(-30, 20, {20000}, at::TensorOptions().dtype(at::kDouble));
  const auto wide = (random * at::pow(2.0, exponents)).to(at::kFloat);
  for (int64_t i = 0; i < wide.numel(); ++i) values.push_back(wide[i].item<float>());
  // Exactly halfway between two bf16 / fp16 values: ties go to even.
  for (uint32_t m = 0; m < 64; ++m) {
    values.push_back(kernels::bits_float(0x3f800000u | (m << 16) | 0x8000u));
    values.push_back(kernels::bits_float(0x3f800000u | (m << 13) | 0x1000u));
  }
  for (const float v : values) {
    const c10::BFloat16 b(v);
    const c10::Half h(v);
    ASSERT_EQ(kernels::float_to_bf16(v), b.x) << v;
    ASSERT_EQ(kernels::float_to_fp16(v), h.x) << v;
    ASSERT_EQ(kernels::bf16_to_float(b.x), static_cast<float>(b)) << v;
    ASSERT_EQ(kernels::fp16_to_float(h.x), static_cast<float>(h)) << v;
  }
}

TEST(Sparse24Host, CompressionRoundTripsAndNamesTheChunkThatIsNot24) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const auto w = random_24_weight(48, 96, dtype);
    const auto c = loom::ops::sparse24_compress(w);
    EXPECT_EQ(c.values.sizes(), (at::IntArrayRef{48, 48}));
    EXPECT_EQ(c.meta.sizes(), (at::IntArrayRef{3, 48}));
    EXPECT_TRUE(at::equal(c.to_dense(), w));
  }
  auto w = random_24_weight(16, 64, at::kBFloat16);
  w.index_put_({5, at::indexing::Slice(36, 40)}, 1.0);  // row 5, columns 36..39: four nonzeros
  w.index_put_({9, at::indexing::Slice(0, 3)}, 2.0);    // row 9 comes later in row-major order
  try {
    loom::ops::sparse24_compress(w);
    FAIL() << "a weight that is not 2:4 was compressed";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 5, columns 36..39"), std::string::npos) << e.what();
  }
  for (const auto& [bad, what] : std::vector<std::pair<at::Tensor, std::string>>{
           {at::zeros({16, 48}, at::kBFloat16), "48"},
           {at::zeros({16, 64}, at::kFloat), "Float"},
           {at::zeros({4, 4, 32}, at::kHalf), "[4, 4, 32]"}}) {
    try {
      loom::ops::sparse24_compress(bad);
      FAIL() << "compressed a bad weight: " << what;
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

// The host reference of the mma.sp product against the fp64 matmul of the same rounded values:
// within one rounding to the element type plus one fp32 rounding of the running sum per k-step
// (and the double sums inside a step), the order it sums in (sparse24.h). Also: extra leading
// dimensions, and the refusals with the value named.
TEST(Sparse24Host, ProductIsTheFp64MatmulWithinTheStatedBound) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const int64_t out = 80, in = 160;
    const auto w = random_24_weight(out, in, dtype);
    const auto x = at::randn({3, 7, in}).to(dtype);
    const auto y = loom::ops::sparse24_linear(x, loom::ops::sparse24_compress(w));
    ASSERT_EQ(y.sizes(), (at::IntArrayRef{3, 7, out}));
    ASSERT_EQ(y.scalar_type(), dtype);
    const auto x64 = x.to(at::kDouble), w64 = w.to(at::kDouble);
    const auto exact = at::matmul(x64, w64.t());
    const auto magnitude = at::matmul(x64.abs(), w64.abs().t());
    const auto bound = loom::testing::sparse24_bound(exact, magnitude, dtype, in / 32, in);
    const auto error = (y.to(at::kDouble) - exact).abs();
    EXPECT_TRUE((error <= bound).all().item<bool>())
        << c10::toString(dtype) << ": worst error / bound " << (error / bound).max().item<double>();
  }
  const auto w = loom::ops::sparse24_compress(random_24_weight(32, 64, at::kBFloat16));
  const auto why_shape = loom::ops::sparse24_unsupported(at::zeros({2, 32}, at::kBFloat16), w);
  ASSERT_TRUE(why_shape.has_value());
  EXPECT_NE(why_shape->find("[..., 64]"), std::string::npos) << *why_shape;
  const auto why_dtype = loom::ops::sparse24_unsupported(at::zeros({2, 64}, at::kHalf), w);
  ASSERT_TRUE(why_dtype.has_value());
  EXPECT_NE(why_dtype->find("Half"), std::string::npos) << *why_dtype;
  const auto odd_rows = loom::ops::sparse24_compress(random_24_weight(24, 64, at::kBFloat16));
  const auto why_rows =
      loom::ops::sparse24_unsupported(at::zeros({2, 64}, at::kBFloat16), odd_rows);
  ASSERT_TRUE(why_rows.has_value());
  EXPECT_NE(why_rows->find("24"), std::string::npos) << *why_rows;
}

// The block-sparse host reference through ops::bsr_linear: the kept tiles found as the ones with
// a nonzero (an empty tile row gives zeros), y within the fp64 bound with one fp32 rounding per
// 16 columns; 32 and 64 tiles, bf16 and fp16; bad blocks are clear errors.
TEST(BsrHost, ProductIsTheFp64MatmulWithinTheStatedBound) {
  for (const int64_t block : {32, 64})
    for (const auto dtype : {at::kBFloat16, at::kHalf}) {
      const int64_t out = 3 * block, in = 4 * block;
      auto tiles = at::rand({3, 4}) < 0.5;
      tiles.select(0, 1).fill_(false);
      const auto w =
          (at::randn({out, in}) * tiles.repeat_interleave(block, 0).repeat_interleave(block, 1))
              .to(dtype);
      const auto c = loom::ops::bsr_compress(w, block);
      EXPECT_EQ(c.tile_col.numel(), tiles.sum().item<int64_t>());
      EXPECT_EQ(c.row_start[2].item<int32_t>(), c.row_start[1].item<int32_t>());  // empty row
      const auto x = at::randn({2, 9, in}).to(dtype);
      const auto y = loom::ops::bsr_linear(x, c);
      const auto x64 = x.to(at::kDouble), w64 = w.to(at::kDouble);
      const auto exact = at::matmul(x64, w64.t());
      const auto bound = loom::testing::sparse24_bound(exact, at::matmul(x64.abs(), w64.abs().t()),
                                                       dtype, in / 16, in);
      EXPECT_TRUE(((y.to(at::kDouble) - exact).abs() <= bound).all().item<bool>())
          << block << " " << c10::toString(dtype);
      EXPECT_TRUE(at::all(y.select(-1, block + 3) == 0).item<bool>()) << "the empty tile row";
    }
  try {
    loom::ops::bsr_compress(at::zeros({96, 96}, at::kBFloat16), 48);
    FAIL() << "block 48 was taken";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block 48"), std::string::npos) << e.what();
  }
}

}  // namespace
