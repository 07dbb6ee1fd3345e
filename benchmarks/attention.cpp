// loom-bench-attention: loom's fused attention kernel against at::scaled_dot_product_attention
// (PyTorch's own choice of FlashAttention-2, memory-efficient or cuDNN kernels) in the same
// process, on the same inputs. For each sequence length, head dim and causal or not: forward
// and forward + backward TFLOP/s of both, and their ratio.
//
// FLOPs (FlashAttention's convention): forward 4 b h s^2 d (two matrix products), halved when
// causal; backward 2.5 times the forward, so forward + backward is 3.5 times it. b * s is held at
// --tokens (16384) and h * d at --width (2048), as FlashAttention's own benchmark does, so every
// row moves about the same data. Timing: each measurement runs the op until at least --min-ms
// have passed (after two warm-up calls), then divides; the device is synchronized around it.
// Each row also records the largest difference between the two outputs, so a fast wrong kernel
// does not pass for a fast one.
//
// --masks docs (with --doc-len L) adds causal attention under a document mask of documents L
// tokens long (ops::document_first_keys): loom's kernel given the first keys against SDPA given
// the equivalent boolean mask (ops::attention's sdpa backend), their FLOPs counted over the
// query-key pairs the mask keeps; `vs_causal` is loom's causal time over its masked time.
//
// Prints one JSON object per row on stdout and a readable line on stderr. Needs a CUDA device,
// except with --device cpu: loom's CPU kernel (ops/cpu_attention.h) against PyTorch's CPU SDPA in
// fp32, for example `--device cpu --tokens 2048 --width 256 --seq-lens 128 --head-dims 32 64`.
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "loom/apps/cli.h"
#include "loom/loom.h"
#include "loom/ops/attention.h"
#include "loom/ops/cpu_attention.h"
#include "loom/ops/flash_attention.h"

namespace {

struct Options {
  std::vector<int64_t> seq_lens{512, 1024, 2048, 4096, 8192};
  std::vector<int64_t> head_dims{64, 128};
  int64_t tokens = 16384, width = 2048;
  std::string dtype = "bf16";
  std::string device = "cuda";
  double min_ms = 100;
  std::vector<std::string> masks{"full", "causal"};
  int64_t doc_len = 256;
};

void run(const Options& o) {
  LOOM_CHECK(o.device == "cuda" || o.device == "cpu", "--device '{}' must be cuda or cpu",
             o.device);
  const bool cuda = o.device == "cuda";
  LOOM_CHECK(!cuda || loom::ops::cuda_device_count() > 0,
             "loom-bench-attention needs a CUDA device (this machine has none{}); --device cpu "
             "times the CPU kernel",
             loom::ops::built_with_cuda() ? "" : "; and this loom was built without CUDA");
  LOOM_CHECK(!cuda || o.dtype == "bf16" || o.dtype == "fp16", "--dtype '{}' must be bf16 or fp16",
             o.dtype);
  // The CPU kernel computes in fp32.
  const auto dtype = !cuda ? at::kFloat : o.dtype == "bf16" ? at::kBFloat16 : at::kHalf;
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const auto device_name = cuda ? loom::ops::cuda_device_name(0)
                                : "cpu (" + loom::ops::to_string(loom::ops::best_cpu_isa()) + ")";
  for (int64_t d : o.head_dims)
    for (int64_t s : o.seq_lens)
      LOOM_CHECK(s > 0 && d > 0 && o.tokens % s == 0 && o.width % d == 0,
                 "--tokens {} must be a multiple of every sequence length ({}) and --width {} of "
                 "every head dim ({})",
                 o.tokens, s, o.width, d);
  for (const auto& mask : o.masks)
    LOOM_CHECK(mask == "full" || mask == "causal" || mask == "docs",
               "--masks: '{}' is not one of full, causal, docs", mask);
  LOOM_CHECK(o.doc_len > 0, "--doc-len {} must be positive", o.doc_len);
  for (int64_t d : o.head_dims)
    for (int64_t s : o.seq_lens)
      for (const auto& mask : o.masks) {
        const bool causal = mask != "full", docs = mask == "docs";
        const int64_t b = o.tokens / s, h = o.width / d;
        const auto opts = at::TensorOptions(dtype).device(device);
        // Documents of doc_len tokens: a start token (0) every doc_len positions.
        at::Tensor first_key;
        double pairs = static_cast<double>(s) * static_cast<double>(causal ? s + 1 : 2 * s) / 2;
        if (docs) {
          const auto positions = at::arange(s, at::kLong);
          const auto tokens = at::where(positions.remainder(o.doc_len) == 0, 0, 1).expand({b, s});
          first_key = loom::ops::document_first_keys(tokens, 0).to(device);
          pairs = (positions - first_key[0].cpu().to(at::kLong) + 1).sum().item<double>();
        }
        auto q = at::randn({b, h, s, d}, opts).requires_grad_();
        auto k = at::randn({b, h, s, d}, opts).requires_grad_();
        auto v = at::randn({b, h, s, d}, opts).requires_grad_();
        auto d_o = at::randn({b, h, s, d}, opts);
        const double scale = 1.0 / std::sqrt(static_cast<double>(d));
        using Attn = std::function<at::Tensor()>;
        const Attn fused = [&] {
          return cuda ? loom::ops::flash_attention(q, k, v, causal, scale, first_key)
                      : loom::ops::cpu_attention(q, k, v, causal, scale, first_key);
        };
        const Attn sdpa = [&] {
          if (docs)
            return loom::ops::attention(q, k, v,
                                        {.causal = true,
                                         .scale = scale,
                                         .backend = loom::ops::AttentionBackend::kSdpa,
                                         .first_key = first_key});
          return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, causal, scale);
        };
        // Loom's kernel without the document mask, for vs_causal.
        const Attn fused_causal = [&] {
          return cuda ? loom::ops::flash_attention(q, k, v, true, scale)
                      : loom::ops::cpu_attention(q, k, v, true, scale);
        };
        double max_diff = 0;
        {
          torch::NoGradGuard no_grad;
          max_diff = (fused() - sdpa()).abs().max().item<double>();
        }
        // FlashAttention's convention (s^2 / 2 pairs when causal); with documents, the pairs kept.
        const double fwd_flops = 4.0 * static_cast<double>(b * h * d) *
                                 (docs ? pairs : static_cast<double>(s * s) * (causal ? 0.5 : 1));
        auto time = [&](const Attn& attn, bool backward) {
          if (!backward) {
            torch::NoGradGuard no_grad;
            return loom::bench::seconds_per_call([&] { attn(); }, o.min_ms, cuda);
          }
          return loom::bench::seconds_per_call(
              [&] {
                q.mutable_grad() = k.mutable_grad() = v.mutable_grad() = at::Tensor();
                attn().backward(d_o);
              },
              o.min_ms, cuda);
        };
        const double fused_fwd = time(fused, false), sdpa_fwd = time(sdpa, false);
        const double fused_all = time(fused, true), sdpa_all = time(sdpa, true);
        const double causal_all = docs ? time(fused_causal, true) : 0.0;
        nlohmann::ordered_json row = {{"bench", "attention"},
                                      {"device", device_name},
                                      {"dtype", cuda ? o.dtype : "fp32"},
                                      {"batch", b},
                                      {"heads", h},
                                      {"seq_len", s},
                                      {"head_dim", d},
                                      {"causal", causal},
                                      {"doc_len", docs ? o.doc_len : 0},
                                      {"fused_fwd_tflops", fwd_flops / fused_fwd / 1e12},
                                      {"sdpa_fwd_tflops", fwd_flops / sdpa_fwd / 1e12},
                                      {"fwd_ratio", sdpa_fwd / fused_fwd},
                                      {"fused_fwd_bwd_tflops", 3.5 * fwd_flops / fused_all / 1e12},
                                      {"sdpa_fwd_bwd_tflops", 3.5 * fwd_flops / sdpa_all / 1e12},
                                      {"fwd_bwd_ratio", sdpa_all / fused_all},
                                      {"max_abs_diff_vs_sdpa", max_diff}};
        if (docs) row["vs_causal"] = causal_all / fused_all;
        std::printf("%s\n", row.dump().c_str());
        std::fflush(stdout);
        // The readable line in TFLOP/s on a GPU, GFLOP/s on the CPU.
        const double unit = cuda ? 1.0 : 1e3;
        std::fprintf(
            stderr,
            "d %3ld s %5ld %-6s fwd: fused %6.1f sdpa %6.1f %s (x%.2f) | fwd+bwd: "
            "fused %6.1f sdpa %6.1f (x%.2f) | max diff %.3g%s\n",
            static_cast<long>(d), static_cast<long>(s), mask.c_str(),
            unit * row["fused_fwd_tflops"].get<double>(),
            unit * row["sdpa_fwd_tflops"].get<double>(), cuda ? "TFLOP/s" : "GFLOP/s",
            row["fwd_ratio"].get<double>(), unit * row["fused_fwd_bwd_tflops"].get<double>(),
            unit * row["sdpa_fwd_bwd_tflops"].get<double>(), row["fwd_bwd_ratio"].get<double>(),
            max_diff, max_diff > 0.05 ? "  <- SUSPECT: outputs disagree" : "");
      }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Fused attention vs at::scaled_dot_product_attention: TFLOP/s forward and "
      "forward + backward (CUDA; --device cpu: loom's CPU kernel in fp32).",
      "loom-bench-attention"};
  Options o;
  app.add_option("--seq-lens", o.seq_lens, "Sequence lengths")->capture_default_str();
  app.add_option("--head-dims", o.head_dims, "Head dims (the kernel has 64 and 128)")
      ->capture_default_str();
  app.add_option("--tokens", o.tokens, "batch x sequence length, held constant")
      ->capture_default_str();
  app.add_option("--width", o.width, "heads x head dim, held constant")->capture_default_str();
  app.add_option("--dtype", o.dtype, "bf16 | fp16 (CUDA; the CPU kernel is fp32)")
      ->capture_default_str();
  app.add_option("--device", o.device, "cuda | cpu")->capture_default_str();
  app.add_option("--masks", o.masks,
                 "full, causal and/or docs (causal under a document mask of --doc-len tokens)")
      ->capture_default_str();
  app.add_option("--doc-len", o.doc_len, "Document length for --masks docs")->capture_default_str();
  app.add_option("--min-ms", o.min_ms, "Time each measurement at least this long")
      ->capture_default_str();
  return loom::apps::run_app(app, argc, argv, [&] { run(o); });
}
