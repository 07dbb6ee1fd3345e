// loom-bench-norm: the residual add and the norm after it, forward and backward, on one device:
// loom's fused op (ops/norm.h: the kernels on CUDA, the host reference on the CPU) against the
// math path it replaces (what the model runs with --norm math under bf16 autocast: the fp32 add,
// at::layer_norm or the RMSNorm composition in fp32, the cast to bf16 for the next product).
// Shapes: GPT-2 124M's (16 x 1024 tokens, width 768, LayerNorm with bias), Llama 1B's (16 x 1024,
// 2048, RMSNorm) and Llama 3 8B's (8 x 2048, 4096, RMSNorm). One JSON line per (shape,
// implementation): ms per forward + backward, the ratio to the fused one, and the fused path's
// bytes per second (its minimum traffic) beside --peak-gb-per-s.
//
// Prediction for an H100 SXM (3.35 TB/s): the fused path moves 34 bytes an element (forward:
// the residual and the bf16 branch read, the sum and the bf16 normed written, 12; backward: the
// sum, grad_normed and grad_sum read, grad_input and the bf16 grad_branch written, 16; the weight
// partials read the sum and grad_normed again, 6): 0.43 GB at GPT-2's 12.6 M elements, about
// 0.16 ms at 80 % of the peak. The math path moves about twice that (the add, the norm and the
// cast each a pass forward; the cast back, the norm's backward with its separate weight
// reduction, the residual gradient's add and the branch's cast backward): ~0.3 ms. GPT-2 124M
// runs 25 such norms a step: ~4 ms of math path, ~2 ms fused.
//
// Then Llama's SwiGLU, silu(gate) * up, forward and backward in bf16: loom's fused op
// (ops/swiglu.h) against at::silu and the product (--swiglu math). Shapes: Llama 1B's MLP
// (4 x 2048 tokens, 5632 features) and Llama 3 8B's (2 x 2048, 14336). Prediction for an H100
// SXM: the fused path moves 16 bytes an element (forward: gate and up read, out written, 6;
// backward: gate, up and the output's gradient read, both gradients written, 10): 0.74 GB at
// Llama 1B's 46 M elements, about 0.28 ms at 80 % of the peak; the math path about 28 (silu and
// the product a pass each forward; the product's two gradients and silu's backward, each a pass):
// ~0.48 ms. Llama 1B runs 22 a step: ~10 ms of math path, ~6 ms fused.
// scripts/gpu-check runs this.
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "loom/apps/cli.h"
#include "loom/loom.h"

namespace {

struct Options {
  std::string device = "cuda";
  double min_ms = 200;
  double peak_gb_per_s = 0;
  double scale = 1;  // tokens per shape times this (CPU runs use a small fraction)
};

struct Shape {
  const char* name;
  int64_t tokens, width;
  loom::ops::NormKind kind;
};

// SwiGLU forward + backward in bf16 at Llama MLP shapes: fused against math.
void run_swiglu(const Options& o, at::Generator& gen) {
  const bool cuda = o.device == "cuda";
  const auto on = at::TensorOptions(at::kBFloat16).device(cuda ? at::kCUDA : at::kCPU);
  struct SwigluShape {
    const char* name;
    int64_t tokens, features;
  };
  const std::vector<SwigluShape> shapes = {{"llama-1b mlp, 4 x 2048 tokens", 8192, 5632},
                                           {"llama3-8b mlp, 2 x 2048 tokens", 4096, 14336}};
  for (const auto& shape : shapes) {
    const int64_t tokens = std::max<int64_t>(1, int64_t(double(shape.tokens) * o.scale));
    const auto gate = (2 * at::randn({tokens, shape.features}, gen, at::kFloat)).to(on);
    const auto up = at::randn({tokens, shape.features}, gen, at::kFloat).to(on);
    const auto grad = at::randn({tokens, shape.features}, gen, at::kFloat).to(on);
    double fused_ms = 0;
    for (const auto backend :
         {loom::ops::ActivationBackend::kFused, loom::ops::ActivationBackend::kMath}) {
      const bool fused = backend == loom::ops::ActivationBackend::kFused;
      const double s = loom::bench::seconds_per_call(
          [&] {
            auto g = gate.detach().requires_grad_();
            auto u = up.detach().requires_grad_();
            torch::autograd::backward({loom::ops::swiglu(backend, g, u)}, {grad});
          },
          o.min_ms, cuda);
      const double ms = s * 1e3;
      if (fused) fused_ms = ms;
      nlohmann::ordered_json row = {{"op", "swiglu forward+backward"},
                                    {"shape", shape.name},
                                    {"impl", fused ? "fused" : "math (silu, product)"},
                                    {"device", o.device},
                                    {"tokens", tokens},
                                    {"width", shape.features},
                                    {"ms", ms},
                                    {"speedup_of_fused", ms / fused_ms}};
      if (fused) {
        row["gb_per_s"] = 16.0 * double(tokens) * double(shape.features) / s / 1e9;
        if (o.peak_gb_per_s > 0) row["peak_gb_per_s"] = o.peak_gb_per_s;
      }
      std::printf("%s\n", row.dump().c_str());
      std::fprintf(stderr, "%-30s %-38s %9.3f ms  (%.2fx the fused time)\n", shape.name,
                   fused ? "fused" : "math (silu, product)", ms, ms / fused_ms);
    }
  }
}

void run(const Options& o) {
  LOOM_CHECK(o.device == "cpu" || o.device == "cuda", "--device '{}': use cpu or cuda", o.device);
  LOOM_CHECK(o.min_ms > 0, "--min-ms {} must be positive", o.min_ms);
  LOOM_CHECK(o.scale > 0 && o.scale <= 1, "--scale {} must be in (0, 1]", o.scale);
  LOOM_CHECK(o.peak_gb_per_s >= 0, "--peak-gb-per-s {} must be >= 0 (0: not reported)",
             o.peak_gb_per_s);
  const bool cuda = o.device == "cuda";
  LOOM_CHECK(!cuda || torch::cuda::is_available(), "--device cuda: no CUDA device is visible");
  const auto on = at::TensorOptions(at::kFloat).device(cuda ? at::kCUDA : at::kCPU);
  using K = loom::ops::NormKind;
  const std::vector<Shape> shapes = {{"gpt2-124m, 16 x 1024 tokens", 16384, 768, K::kLayerNorm},
                                     {"llama-1b, 16 x 1024 tokens", 16384, 2048, K::kRmsNorm},
                                     {"llama3-8b, 8 x 2048 tokens", 16384, 4096, K::kRmsNorm}};
  auto gen = loom::core::make_generator(7);
  for (const auto& shape : shapes) {
    const int64_t tokens = std::max<int64_t>(1, int64_t(double(shape.tokens) * o.scale));
    const auto residual = at::randn({tokens, shape.width}, gen, at::kFloat).to(on);
    const auto branch =
        at::randn({tokens, shape.width}, gen, at::kFloat).to(on.dtype(at::kBFloat16));
    const auto weight = (1 + 0.1 * at::randn({shape.width}, gen, at::kFloat)).to(on);
    const auto bias = shape.kind == K::kLayerNorm ? at::zeros({shape.width}, on) : at::Tensor();
    const auto grad_normed =
        at::randn({tokens, shape.width}, gen, at::kFloat).to(on.dtype(at::kBFloat16));
    const auto grad_sum = at::randn({tokens, shape.width}, gen, at::kFloat).to(on);
    struct Impl {
      const char* name;
      loom::ops::NormBackend backend;
    };
    const std::vector<Impl> impls = {
        {"fused", loom::ops::NormBackend::kFused},
        {"math (fp32 add, norm, cast to bf16)", loom::ops::NormBackend::kMath}};
    double fused_ms = 0;
    for (const auto& impl : impls) {
      const double s = loom::bench::seconds_per_call(
          [&] {
            auto r = residual.detach().requires_grad_();
            auto b = branch.detach().requires_grad_();
            auto w = weight.detach().requires_grad_();
            auto bi = bias.defined() ? bias.detach().requires_grad_() : at::Tensor();
            const loom::ops::NormParams p{shape.kind, w, bi, 1e-5};
            // The math path's normed output is fp32; the next product's autocast casts it.
            auto out = loom::ops::add_norm(impl.backend, r, b, p);
            auto normed = out.normed.to(at::kBFloat16);
            torch::autograd::backward({out.sum, normed}, {grad_sum, grad_normed});
          },
          o.min_ms, cuda);
      const double ms = s * 1e3;
      if (fused_ms == 0) fused_ms = ms;
      nlohmann::ordered_json row = {{"op", "add + norm forward+backward"},
                                    {"shape", shape.name},
                                    {"impl", impl.name},
                                    {"device", o.device},
                                    {"tokens", tokens},
                                    {"width", shape.width},
                                    {"ms", ms},
                                    {"speedup_of_fused", ms / fused_ms}};
      if (fused_ms == ms) {
        row["gb_per_s"] = 34.0 * double(tokens) * double(shape.width) / s / 1e9;
        if (o.peak_gb_per_s > 0) row["peak_gb_per_s"] = o.peak_gb_per_s;
      }
      std::printf("%s\n", row.dump().c_str());
      std::fprintf(stderr, "%-30s %-38s %9.3f ms  (%.2fx the fused time)\n", shape.name, impl.name,
                   ms, ms / fused_ms);
    }
  }
  run_swiglu(o, gen);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "The residual add and the norm after it, then Llama's SwiGLU, forward and backward: loom's "
      "fused ops against the math path, at GPT-2 124M, Llama 1B and Llama 3 8B widths.",
      "loom-bench-norm"};
  Options o;
  app.add_option("--device", o.device, "cuda (loom's kernels) or cpu (the host reference)")
      ->capture_default_str();
  app.add_option("--min-ms", o.min_ms, "Time each implementation for at least this long")
      ->capture_default_str();
  app.add_option("--scale", o.scale, "Fraction of each shape's tokens (CPU runs: e.g. 0.01)")
      ->capture_default_str();
  app.add_option("--peak-gb-per-s", o.peak_gb_per_s,
                 "The device's nominal memory bandwidth, recorded beside the rows (0: omitted)")
      ->capture_default_str();
  return loom::apps::run_app(app, argc, argv, [&] { run(o); });
}
