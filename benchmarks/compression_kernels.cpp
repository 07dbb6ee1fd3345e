// loom-bench-compression: the communication-compression kernels' throughput on one device (CPU:
// the host references, multi-threaded; CUDA: loom's kernels), as the bytes each reads and writes
// per second, beside a plain copy of the same values (the device's practical memory bandwidth)
// and, given --peak-gb-per-s, the device's nominal peak. One JSON line per operation; scripts/
// gpu-check runs it on a GPU (the goal: quantize and pack at >= 80 % of HBM peak).
// Bytes counted per value: copy 4 + 4; int8 quantize with feedback: x and the error read, the
// error and a code written, a scale per 256 (4 + 4 + 4 + 1 + 4/256); sign pack with feedback:
// 4 + 4 + 4 + 1/8 + 4/1024; sign unpack: 1/8 + 4/1024 read, 4 written; threshold selection: two
// passes over x and the error, the error written once (4 + 4 + 4 + 4 + 4), the few selected
// values not counted.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "loom/apps/cli.h"
#include "loom/loom.h"

namespace {

struct Options {
  std::string device = "cpu";
  int64_t millions = 16;  // values per call, in millions
  double min_ms = 200;
  double peak_gb_per_s = 0;
  int threads = 2;
};

void run(const Options& o) {
  LOOM_CHECK(o.device == "cpu" || o.device == "cuda", "--device '{}': use cpu or cuda", o.device);
  LOOM_CHECK(o.millions > 0, "--millions {} must be positive", o.millions);
  LOOM_CHECK(o.min_ms > 0, "--min-ms {} must be positive", o.min_ms);
  LOOM_CHECK(o.peak_gb_per_s >= 0, "--peak-gb-per-s {} must be >= 0 (0: not reported)",
             o.peak_gb_per_s);
  LOOM_CHECK(o.threads > 0, "--threads {} must be positive", o.threads);
  const bool cuda = o.device == "cuda";
  LOOM_CHECK(!cuda || torch::cuda::is_available(), "--device cuda: no CUDA device is visible");
  at::set_num_threads(o.threads);
  // A whole number of 1024-blocks (int8's 256 divide it too).
  const int64_t n = o.millions * 1024 * 1024;
  const auto options = at::TensorOptions(at::kFloat).device(cuda ? at::kCUDA : at::kCPU);
  auto gen = loom::core::make_generator(3);
  const auto x = at::randn({n}, gen, at::kFloat).to(options.device());
  auto error = at::zeros({n}, options);
  auto copy_dst = at::empty({n}, options);
  const auto packed = loom::ops::pack_signs_with_feedback(x, error);
  const double threshold = loom::ops::kth_largest_magnitude(x, error, n / 100);
  const double values = static_cast<double>(n);

  struct Op {
    const char* name;
    double bytes_per_value;
    std::function<void()> call;
  };
  const std::vector<Op> ops = {
      {"copy", 8, [&] { copy_dst.copy_(x); }},
      {"int8 quantize with feedback", 13 + 4.0 / 256,
       [&] { loom::ops::quantize_int8_with_feedback(x, error); }},
      {"sign pack with feedback", 12 + 1.0 / 8 + 4.0 / 1024,
       [&] { loom::ops::pack_signs_with_feedback(x, error); }},
      {"sign unpack", 4 + 1.0 / 8 + 4.0 / 1024,
       [&] { loom::ops::unpack_signs(packed.words, packed.scales); }},
      {"threshold select with feedback (1 %)", 20,
       [&] { loom::ops::select_with_feedback(x, error, threshold, n / 100); }},
  };
  double copy_gbs = 0;
  for (const auto& op : ops) {
    const double s = loom::bench::seconds_per_call(op.call, o.min_ms, cuda);
    const double gbs = op.bytes_per_value * values / s / 1e9;
    if (copy_gbs == 0) copy_gbs = gbs;
    nlohmann::ordered_json row = {{"op", op.name},
                                  {"device", o.device},
                                  {"values", n},
                                  {"threads", cuda ? 0 : at::get_num_threads()},
                                  {"ms", s * 1e3},
                                  {"gb_per_s", gbs},
                                  {"fraction_of_copy", gbs / copy_gbs}};
    if (o.peak_gb_per_s > 0) row["fraction_of_peak"] = gbs / o.peak_gb_per_s;
    std::printf("%s\n", row.dump().c_str());
    std::fprintf(stderr, "%-40s %9.3f ms  %8.1f GB/s  %5.1f %% of copy\n", op.name, s * 1e3, gbs,
                 100 * gbs / copy_gbs);
  }
  // PowerSGD's orthogonalisation at gpt2-124m's P factors, rank 4 (per layer: qkv 2304 rows,
  // the attention projection 768, the MLP's 3072 and 768; the embeddings 50257 and 1024): small
  // matrices, one CUDA block each, so its time, not its bandwidth, is what matters.
  std::vector<int64_t> offsets, rows;
  int64_t total = 0;
  for (int layer = 0; layer < 12; ++layer)
    for (const int64_t r : {2304, 768, 3072, 768}) rows.push_back(r);
  rows.push_back(50257);
  rows.push_back(1024);
  const int64_t rank = 4;
  for (const int64_t r : rows) {
    offsets.push_back(total);
    total += r * rank;
  }
  auto factors = at::randn({total}, gen, at::kFloat).to(options.device());
  const double s = loom::bench::seconds_per_call(
      [&] { loom::ops::orthogonalize_columns_(factors, offsets, rows, rank); }, o.min_ms, cuda);
  nlohmann::ordered_json row = {{"op", "powersgd orthogonalize (gpt2-124m, rank 4)"},
                                {"device", o.device},
                                {"matrices", static_cast<int64_t>(rows.size())},
                                {"values", total},
                                {"threads", cuda ? 0 : at::get_num_threads()},
                                {"ms", s * 1e3}};
  std::printf("%s\n", row.dump().c_str());
  std::fprintf(stderr, "%-40s %9.3f ms  (%zu matrices, %lld values)\n",
               "powersgd orthogonalize (gpt2-124m, r 4)", s * 1e3, rows.size(),
               static_cast<long long>(total));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Communication-compression kernels (int8 quantize, sign pack/unpack, threshold select) "
      "as bytes moved per second, against a plain copy; PowerSGD's orthogonalisation as time.",
      "loom-bench-compression"};
  Options o;
  app.add_option("--device", o.device, "cpu (the host references) or cuda (loom's kernels)")
      ->capture_default_str();
  app.add_option("--millions", o.millions, "Values per call, in units of 2^20")
      ->capture_default_str();
  app.add_option("--min-ms", o.min_ms, "Time each operation for at least this long")
      ->capture_default_str();
  app.add_option("--peak-gb-per-s", o.peak_gb_per_s,
                 "The device's nominal memory bandwidth, for fraction_of_peak (0: omitted)")
      ->capture_default_str();
  app.add_option("--threads", o.threads, "Intra-op threads (CPU)")->capture_default_str();
  return loom::apps::run_app(app, argc, argv, [&] { run(o); });
}
