// loom-bench-cross-entropy: the language-model loss, forward and backward, on one device: loom's
// fused cross-entropy (ops/cross_entropy.h: the kernels on CUDA, the host reference on the CPU)
// against the math path it replaces (what the model ran before: the logits widened to fp32,
// at::cross_entropy_loss, its fp32 gradient cast back) and PyTorch's own loss on the logits as
// they are. Shapes: GPT-2's head (16 x 1024 tokens, vocabulary 50257 and 50304, the padded
// one), Llama 3's (8 x 2048 tokens, 128256). One JSON line per (shape, implementation): ms per
// forward + backward, each row's ratio to the fused one, and the fused path's bytes per second
// (its minimum traffic: the logits read twice and the gradient written once) beside
// --peak-gb-per-s.
//
// Prediction for an H100 SXM (3.35 TB/s) at 16384 x 50257 bf16 (1.65 GB of logits): the fused
// path moves 3 x 1.65 GB = 4.9 GB, about 1.6 ms at 90 % of the peak (its expf work, 2 per
// logit, is ~15 % of the FP32 rate and hides under the memory time); the math path moves
// ~25-40 GB (an fp32 copy, the log-softmax, the zero-filled NLL gradient, the fp32 softmax
// gradient, the cast back): 8-12 ms. scripts/gpu-check runs this and keeps the rows.
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
  std::string dtype = "bf16";
  double min_ms = 200;
  double peak_gb_per_s = 0;
  double scale = 1;  // tokens per shape times this (CPU runs use a small fraction)
};

struct Shape {
  const char* name;
  int64_t tokens, vocab;
};

void run(const Options& o) {
  LOOM_CHECK(o.device == "cpu" || o.device == "cuda", "--device '{}': use cpu or cuda", o.device);
  LOOM_CHECK(o.dtype == "bf16" || o.dtype == "fp16" || o.dtype == "fp32",
             "--dtype '{}': use bf16, fp16 or fp32", o.dtype);
  LOOM_CHECK(o.min_ms > 0, "--min-ms {} must be positive", o.min_ms);
  LOOM_CHECK(o.scale > 0 && o.scale <= 1, "--scale {} must be in (0, 1]", o.scale);
  LOOM_CHECK(o.peak_gb_per_s >= 0, "--peak-gb-per-s {} must be >= 0 (0: not reported)",
             o.peak_gb_per_s);
  const bool cuda = o.device == "cuda";
  LOOM_CHECK(!cuda || torch::cuda::is_available(), "--device cuda: no CUDA device is visible");
  const auto dtype = o.dtype == "bf16" ? at::kBFloat16 : o.dtype == "fp16" ? at::kHalf : at::kFloat;
  const auto options = at::TensorOptions(dtype).device(cuda ? at::kCUDA : at::kCPU);
  const std::vector<Shape> shapes = {{"gpt2 head, 16 x 1024 tokens", 16384, 50257},
                                     {"gpt2 head padded to 50304", 16384, 50304},
                                     {"llama3 head, 8 x 2048 tokens", 16384, 128256}};
  auto gen = loom::core::make_generator(5);
  for (const auto& shape : shapes) {
    const int64_t tokens = std::max<int64_t>(1, int64_t(double(shape.tokens) * o.scale));
    const auto base = (at::randn({tokens, shape.vocab}, gen, at::kFloat) * 2).to(options);
    const auto targets = at::randint(0, shape.vocab, {tokens}, gen, at::kLong).to(options.device());
    // Each call: the logits as a fresh leaf (no copy), the loss, its backward.
    struct Impl {
      const char* name;
      std::function<at::Tensor(const at::Tensor&)> loss;
    };
    const std::vector<Impl> impls = {
        {"fused",
         [&](const at::Tensor& x) {
           // Writing the gradient over the logits saves memory, not traffic; the leaf here is
           // the benchmark's only copy of them, so it gets a buffer of its own.
           return loom::ops::fused_cross_entropy(x, targets);
         }},
        {"math (fp32 widen, as before)",
         [&](const at::Tensor& x) { return at::cross_entropy_loss(x.to(at::kFloat), targets); }},
        {"torch cross_entropy on the logits' dtype",
         [&](const at::Tensor& x) { return at::cross_entropy_loss(x, targets); }},
    };
    const double logits_bytes = double(tokens) * double(shape.vocab) * double(base.element_size());
    double fused_ms = 0;
    for (const auto& impl : impls) {
      const double s = loom::bench::seconds_per_call(
          [&] {
            auto x = base.detach().requires_grad_();
            impl.loss(x).backward();
          },
          o.min_ms, cuda);
      const double ms = s * 1e3;
      if (fused_ms == 0) fused_ms = ms;
      nlohmann::ordered_json row = {{"op", "cross_entropy forward+backward"},
                                    {"shape", shape.name},
                                    {"impl", impl.name},
                                    {"device", o.device},
                                    {"dtype", o.dtype},
                                    {"tokens", tokens},
                                    {"vocab", shape.vocab},
                                    {"ms", ms},
                                    {"speedup_of_fused", ms / fused_ms}};
      if (fused_ms == ms) {
        // The fused loss's own minimum traffic: two reads of the logits and one write.
        row["gb_per_s"] = 3 * logits_bytes / s / 1e9;
        if (o.peak_gb_per_s > 0) row["peak_gb_per_s"] = o.peak_gb_per_s;
      }
      std::printf("%s\n", row.dump().c_str());
      std::fprintf(stderr, "%-32s %-44s %9.3f ms  (%.2fx the fused time)\n", shape.name, impl.name,
                   ms, ms / fused_ms);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "The language-model loss, forward and backward: loom's fused cross-entropy against the "
      "fp32 math path and PyTorch's cross_entropy, at GPT-2 and Llama 3 head shapes.",
      "loom-bench-cross-entropy"};
  Options o;
  app.add_option("--device", o.device, "cuda (loom's kernels) or cpu (the host reference)")
      ->capture_default_str();
  app.add_option("--dtype", o.dtype, "bf16 | fp16 | fp32: the logits' dtype")
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
