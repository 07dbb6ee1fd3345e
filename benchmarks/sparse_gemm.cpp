// loom-bench-sparse-gemm: the forward product of a pruned linear layer on a GPU, y = x W^T with
// x [tokens, in] and W [out, in] in bf16. 2:4 rows: loom's mma.sp kernel (ops::sparse24_linear)
// against cuBLAS on the dense W (at::matmul, what an unpruned layer costs) and, where the torch
// build has it, cuSPARSELt on the same 2:4 W (at::_cslt_sparse_mm, as torchao's 2:4 path calls
// it). Block rows: loom's block-sparse kernel (ops::bsr_linear) on 64 x 64 tiles at each of
// --block-sparsities (random tiles dropped) against cuBLAS on the same W, dense with its zeros.
//
// FLOP/s count the dense product's 2 tokens out in FLOPs for all three, so the columns compare
// times. Each row also records the largest difference from the dense result relative to the
// largest |y|, so a fast wrong kernel does not pass for a fast one. Timing: each op runs until
// --min-ms have passed (after two warm-up calls), the device synchronized around it. One JSON
// object per row on stdout, a readable line on stderr. Needs a CUDA device of sm_80 or newer.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "loom/apps/cli.h"
#include "loom/loom.h"
#include "loom/ops/bsr.h"
#include "loom/ops/sparse24.h"

namespace {

struct Options {
  int64_t tokens = 8192;
  // (out, in) pairs: GPT-2 124M's MLP up and down, a Llama-8B-class MLP up and down and its
  // attention projection.
  std::vector<int64_t> shapes{3072, 768, 768, 3072, 14336, 4096, 4096, 14336, 4096, 4096};
  std::vector<double> block_sparsities{0.5, 0.75, 0.9};
  int64_t block = 64;
  double min_ms = 100;
};

// Each element's rank within its group along the last dimension (0: the largest).
at::Tensor ops_rank(const at::Tensor& v) {
  const auto order = std::get<1>(v.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true));
  return std::get<1>(order.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/false));
}

// A 2:4 weight: in each chunk of four, the two largest of four N(0, 1) draws.
at::Tensor pruned_24(int64_t out, int64_t in, const at::TensorOptions& opts) {
  const auto w = at::randn({out, in / 4, 4}, opts.dtype(at::kFloat));
  const auto keep = ops_rank(w.abs()) < 2;
  return (w * keep).reshape({out, in}).to(opts.dtype());
}

void run(const Options& o) {
  LOOM_CHECK(loom::ops::cuda_device_count() > 0,
             "loom-bench-sparse-gemm needs a CUDA device (this machine has none{})",
             loom::ops::built_with_cuda() ? "" : "; and this loom was built without CUDA");
  LOOM_CHECK(o.shapes.size() % 2 == 0 && !o.shapes.empty(),
             "--shapes takes (out, in) pairs; got {} numbers", o.shapes.size());
  const auto opts = at::TensorOptions(at::kBFloat16).device(at::Device(at::kCUDA, 0));
  const auto device_name = loom::ops::cuda_device_name(0);
  for (size_t i = 0; i < o.shapes.size(); i += 2) {
    const int64_t out = o.shapes[i], in = o.shapes[i + 1];
    torch::NoGradGuard no_grad;
    const auto w = pruned_24(out, in, opts);
    const auto x = at::randn({o.tokens, in}, opts);
    const auto compressed = loom::ops::sparse24_compress(w);
    const auto dense_y = at::matmul(x, w.t());
    const double scale = dense_y.abs().max().item<double>();
    auto rel_diff = [&](const at::Tensor& y) {
      return (y.to(at::kFloat) - dense_y.to(at::kFloat)).abs().max().item<double>() / scale;
    };
    const double flops = 2.0 * double(o.tokens) * double(out) * double(in);
    const double dense_s =
        loom::bench::seconds_per_call([&] { at::matmul(x, w.t()); }, o.min_ms, true);
    const double loom_s = loom::bench::seconds_per_call(
        [&] { loom::ops::sparse24_linear(x, compressed); }, o.min_ms, true);
    const double loom_diff = rel_diff(loom::ops::sparse24_linear(x, compressed));
    nlohmann::json row = {{"bench", "sparse24"},
                          {"device", device_name},
                          {"tokens", o.tokens},
                          {"out", out},
                          {"in", in},
                          {"dense_tflops", flops / dense_s / 1e12},
                          {"loom_tflops", flops / loom_s / 1e12},
                          {"loom_vs_dense", dense_s / loom_s},
                          {"loom_rel_diff", loom_diff}};
    std::string cslt = "cuSPARSELt: not in this torch build";
    try {
      const auto w_cslt = at::_cslt_compress(w);
      // A [out, in] sparse times B [in, tokens]; transpose_result gives [tokens, out].
      const auto xt = x.t();
      auto cslt_mm = [&] {
        return at::_cslt_sparse_mm(w_cslt, xt, std::nullopt, std::nullopt, std::nullopt, true);
      };
      const double cslt_diff = rel_diff(cslt_mm());
      const double cslt_s = loom::bench::seconds_per_call([&] { cslt_mm(); }, o.min_ms, true);
      row["cslt_tflops"] = flops / cslt_s / 1e12;
      row["cslt_vs_dense"] = dense_s / cslt_s;
      row["loom_vs_cslt"] = cslt_s / loom_s;
      row["cslt_rel_diff"] = cslt_diff;
      cslt = fmt::format("cuSPARSELt {:.1f} TFLOP/s ({:.2f}x dense)", flops / cslt_s / 1e12,
                         dense_s / cslt_s);
    } catch (const std::exception& e) {
      row["cslt_error"] = std::string(e.what()).substr(0, 200);
    }
    std::printf("%s\n", row.dump().c_str());
    std::fflush(stdout);
    std::fprintf(stderr,
                 "[%lld x %lld] x [%lld x %lld]^T: dense %.1f TFLOP/s, loom 2:4 %.1f TFLOP/s "
                 "(%.2fx dense, rel diff %.1e), %s\n",
                 (long long)o.tokens, (long long)in, (long long)out, (long long)in,
                 flops / dense_s / 1e12, flops / loom_s / 1e12, dense_s / loom_s, loom_diff,
                 cslt.c_str());
    for (const double sparsity : o.block_sparsities) {
      if (out % o.block != 0 || in % o.block != 0) continue;
      const auto tiles =
          at::rand({out / o.block, in / o.block}, opts.dtype(at::kFloat)) >= sparsity;
      const auto wb = at::randn({out, in}, opts) *
                      tiles.repeat_interleave(o.block, 0).repeat_interleave(o.block, 1);
      const auto bsr = loom::ops::bsr_compress(wb, o.block);
      const auto want = at::matmul(x, wb.t());
      const double dense_b_s =
          loom::bench::seconds_per_call([&] { at::matmul(x, wb.t()); }, o.min_ms, true);
      const double bsr_s =
          loom::bench::seconds_per_call([&] { loom::ops::bsr_linear(x, bsr); }, o.min_ms, true);
      const double diff = (loom::ops::bsr_linear(x, bsr).to(at::kFloat) - want.to(at::kFloat))
                              .abs()
                              .max()
                              .item<double>() /
                          std::max(want.abs().max().item<double>(), 1e-30);
      const double kept = tiles.to(at::kDouble).mean().item<double>();
      const nlohmann::json brow = {{"bench", "bsr"},
                                   {"device", device_name},
                                   {"tokens", o.tokens},
                                   {"out", out},
                                   {"in", in},
                                   {"block", o.block},
                                   {"tile_sparsity", 1 - kept},
                                   {"dense_tflops", flops / dense_b_s / 1e12},
                                   {"bsr_vs_dense", dense_b_s / bsr_s},
                                   {"bsr_rel_diff", diff}};
      std::printf("%s\n", brow.dump().c_str());
      std::fflush(stdout);
      std::fprintf(stderr, "  block %lld at %.0f%% dropped: %.2fx dense (rel diff %.1e)\n",
                   (long long)o.block, 100 * (1 - kept), dense_b_s / bsr_s, diff);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "The forward product of a pruned linear layer on a GPU: loom's 2:4 and block-sparse kernels "
      "against dense cuBLAS and cuSPARSELt.",
      "loom-bench-sparse-gemm"};
  Options o;
  app.add_option("--tokens", o.tokens, "Rows of the activations (batch x sequence)")
      ->capture_default_str();
  app.add_option("--shapes", o.shapes, "(out, in) pairs of weight shapes")->capture_default_str();
  app.add_option("--block-sparsities", o.block_sparsities,
                 "Fractions of tiles dropped (block rows)")
      ->capture_default_str();
  app.add_option("--block", o.block, "Tile side of the block rows (32 or 64)")
      ->capture_default_str();
  app.add_option("--min-ms", o.min_ms, "Milliseconds each op is timed for")->capture_default_str();
  return loom::apps::run_app(app, argc, argv, [&] { run(o); });
}
