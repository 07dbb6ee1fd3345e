// cross_entropy_emulated: the fused cross-entropy kernels (kernels/loss/cross_entropy.cu) run on
// the CPU under the emulation in this folder, through their entry points, against the host
// reference of kernels/loss and against fp64 math. ctest runs it as
// kernels.cross_entropy_emulated; deliberately broken copies of the kernel must fail it
// (kernels.cross_entropy_emulated_mutant and ..._offset_mutant, WILL_FAIL). Written by the loom
// authors.
//
// Per configuration (fp32, fp16, bf16 logits; 16-byte vector and scalar rows; vocabulary shards
// with an offset and padding columns; an ignored target and targets held by another shard;
// z-loss; grids smaller than the rows; the gradient in place over the logits and into its own
// buffer; a row holding a NaN and one holding -inf values):
//   - stats (row max, sum, target logit, found) and every gradient element equal the host
//     reference's bit for bit (the emulation computes expf with the host's libm, as the
//     reference does);
//   - the log-sum-exp is within the error bound of its fp32 summation of the fp64 value, and
//     each gradient element within its bound of the fp64 gradient (below, at `lse_bound` and
//     `grad_bound`);
//   - every gradient element was written (the buffer starts as NaN), padding columns and
//     ignored rows are 0, nothing outside the buffers was touched (guard pages), and the
//     emulator reported no error (races, barriers, shuffles).
// Refused, not launched: fp64 logits, valid > ld.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "emulated_test_util.h"
#include "loss/cross_entropy.h"

namespace {

namespace k = loom::kernels;
using emulated_test::guarded_copy;
using emulated_test::refused;

struct Config {
  k::LogitsDtype dtype;
  int64_t rows, ld, valid, col_offset;
  float z_loss;
  int64_t max_blocks;  // 0: one block per row
  bool in_place;
  bool specials;  // row 1 holds a NaN, row 2 holds -inf values
};

// Unit roundoff of the gradient's storage type.
double unit(k::LogitsDtype d) {
  return d == k::LogitsDtype::kFloat32 ? 0x1p-24 : d == k::LogitsDtype::kFloat16 ? 0x1p-11 : 0x1p-8;
}

std::vector<Config> configs() {
  using D = k::LogitsDtype;
  return {
      // Vector rows (ld * size a multiple of 16), the whole vocabulary here.
      {D::kBFloat16, 5, 2048, 2048, 0, 0.0f, 0, false, false},
      {D::kFloat16, 4, 1040, 1030, 0, 0.0f, 0, true, true},
      {D::kFloat32, 4, 1028, 1028, 0, 1e-3f, 2, false, true},
      // Scalar rows (odd ld: GPT-2's 50257-like case), grid smaller than the rows.
      {D::kBFloat16, 6, 2501, 2501, 0, 1e-4f, 4, true, false},
      {D::kFloat32, 3, 777, 777, 0, 0.0f, 0, false, false},
      // A vocabulary shard: columns [offset, offset + valid), padding after them.
      {D::kBFloat16, 5, 1024, 1000, 3000, 0.0f, 0, true, false},
      {D::kFloat16, 4, 513, 500, 500, 1e-3f, 3, false, false},
      // A shard that holds only padding (the last tp rank of a padded vocabulary).
      {D::kBFloat16, 3, 64, 0, 4000, 0.0f, 0, false, false},
      // No rows.
      {D::kFloat32, 0, 64, 64, 0, 0.0f, 0, false, false},
  };
}

// Logits a trained head could give: most near 0, a few large, rows with different spreads.
std::vector<float> make_logits(const Config& c, std::mt19937& gen) {
  std::normal_distribution<float> normal;
  std::vector<float> x(size_t(c.rows * c.ld), 0.0f);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = 0; j < c.ld; ++j) {
      const float spread = 1.0f + float(r % 3) * 2.5f;
      float v = normal(gen) * spread;
      if (j % 97 == 5) v += 12.0f;
      x[size_t(r * c.ld + j)] = j < c.valid ? v : 1e4f;  // padding: large, must be left out
    }
  if (c.specials && c.rows > 2 && c.valid > 10) {
    x[size_t(1 * c.ld + 7)] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = 0; j < c.valid; j += 3) x[size_t(2 * c.ld + j)] = -INFINITY;
  }
  return x;
}

// Stored in the dtype: the values the kernel reads (and the fp64 math uses).
void to_dtype(k::LogitsDtype d, const std::vector<float>& x, std::vector<unsigned char>& bytes,
              std::vector<double>& exact) {
  const int64_t size = k::element_size(d);
  bytes.assign(x.size() * size_t(size), 0);
  exact.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (d == k::LogitsDtype::kFloat32) {
      std::memcpy(&bytes[i * 4], &x[i], 4);
      exact[i] = x[i];
    } else {
      const bool bf16 = d == k::LogitsDtype::kBFloat16;
      const uint16_t h = emulated_test::from_float(bf16, x[i]);
      std::memcpy(&bytes[i * 2], &h, 2);
      exact[i] = emulated_test::to_float(bf16, h);
    }
  }
}

double element(k::LogitsDtype d, const unsigned char* p, int64_t i) {
  if (d == k::LogitsDtype::kFloat32) {
    float f;
    std::memcpy(&f, p + i * 4, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + i * 2, 2);
  return emulated_test::to_float(d == k::LogitsDtype::kBFloat16, h);
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b));
}

bool run(const Config& c) {
  std::mt19937 gen(uint32_t(c.rows * 7919 + c.ld * 31 + c.col_offset + int(c.dtype)));
  const auto x = make_logits(c, gen);
  std::vector<unsigned char> bytes;
  std::vector<double> exact;
  to_dtype(c.dtype, x, bytes, exact);
  // Targets: one in each row's shard, one ignored, one held by another shard.
  std::vector<int64_t> targets(size_t(c.rows));
  for (int64_t r = 0; r < c.rows; ++r)
    targets[size_t(r)] = c.valid > 0 ? c.col_offset + (r * 37 + 5) % c.valid : 17;
  if (c.rows > 3) targets[3] = -100;
  if (c.rows > 4) targets[4] = c.col_offset + c.valid + 11;

  GuardedBuffer logits_buffer, target_buffer, grad_buffer, stats_buffer, lse_buffer, scale_buffer;
  auto* logits = guarded_copy(logits_buffer, bytes);
  const int64_t* target_ptr = guarded_copy(target_buffer, targets);
  k::CrossEntropyRows rows{c.dtype, logits, c.rows, c.ld, c.valid, c.col_offset, target_ptr, -100};

  // Stats: the reference's and the kernel's.
  const size_t n = size_t(c.rows);
  std::vector<float> want(4 * n);
  const k::CrossEntropyStats<float> want_out{want.data(), want.data() + n, want.data() + 2 * n,
                                             want.data() + 3 * n};
  std::string problem;
  if (auto s = k::cross_entropy_stats_host(rows, want_out, 0, c.rows); !s.ok())
    problem = "host stats: " + s.message;
  auto* got = guarded_copy(stats_buffer, std::vector<float>(4 * n, std::nanf("")));
  const k::CrossEntropyStats<float> got_out{got, got + n, got + 2 * n, got + 3 * n};
  const int errors_before = emulation::error_count;
  if (auto s = k::cross_entropy_stats_apply(rows, got_out, nullptr, c.max_blocks); !s.ok())
    problem += "stats apply: " + s.message;
  int64_t stats_differ = 0;
  for (size_t i = 0; i < 4 * n && problem.empty(); ++i) stats_differ += !same_bits(got[i], want[i]);
  if (stats_differ) problem += std::to_string(stats_differ) + " stats differ from the reference; ";

  // The log-sum-exp against fp64: each thread folds about `per_thread` values, each step a few
  // fp32 roundings (exp within 2 ulp, a multiply, an add), then 5 + 5 butterfly levels, each a
  // rescale and an add; the relative error of the sum is below (per_thread + 10) * 5 u, and
  // that is the absolute error of log(sum); the max is exact.
  const int64_t per_thread = (c.valid + k::kCrossEntropyThreads - 1) / k::kCrossEntropyThreads;
  const double lse_bound = double(per_thread + 10) * 5 * 0x1p-24 + 1e-30;
  std::vector<float> lse(n);
  double worst_lse = 0;
  int64_t lse_out = 0;
  for (int64_t r = 0; r < c.rows; ++r) {
    lse[size_t(r)] = want[size_t(r)] + std::log(want[n + size_t(r)]);
    double m = -INFINITY, sum = 0;
    bool nan = false;
    for (int64_t j = 0; j < c.valid; ++j) {
      nan |= std::isnan(exact[size_t(r * c.ld + j)]);
      m = std::max(m, exact[size_t(r * c.ld + j)]);
    }
    for (int64_t j = 0; j < c.valid; ++j) sum += std::exp(exact[size_t(r * c.ld + j)] - m);
    const double lse_exact = c.valid == 0 ? -INFINITY : m + std::log(sum);
    if (nan) {
      lse_out += !std::isnan(lse[size_t(r)]);
      continue;
    }
    if (c.valid == 0) {
      lse_out += !(lse[size_t(r)] == -INFINITY || std::isnan(lse[size_t(r)]));
      continue;
    }
    const double err = std::fabs(double(lse[size_t(r)]) - lse_exact);
    worst_lse = std::max(worst_lse, err);
    // Plus the final log and add: 2 roundings of |lse|.
    lse_out += !(err <= lse_bound + 2 * 0x1p-24 * std::fabs(lse_exact));
    // The target logit and whether this shard holds it.
    const int64_t local = targets[size_t(r)] - c.col_offset;
    const bool here = targets[size_t(r)] != -100 && local >= 0 && local < c.valid;
    if (got[3 * n + size_t(r)] != (here ? 1.0f : 0.0f)) ++lse_out;
    if (here && double(got[2 * n + size_t(r)]) != exact[size_t(r * c.ld + local)]) ++lse_out;
  }
  if (lse_out) problem += std::to_string(lse_out) + " rows' lse or target outside the fp64 bound; ";

  // Grad, scale = 1 / rows (the mean): the reference's and the kernel's.
  const float scale = c.rows > 0 ? 1.0f / float(c.rows) : 1.0f;
  std::vector<unsigned char> want_grad(bytes.size());
  const k::CrossEntropyGradArgs<float> host_args{lse.data(), &scale, c.z_loss, want_grad.data()};
  if (auto s = k::cross_entropy_grad_host(rows, host_args, 0, c.rows); !s.ok())
    problem += "host grad: " + s.message;
  const float* lse_dev = guarded_copy(lse_buffer, lse);
  const float* scale_dev = guarded_copy(scale_buffer, std::vector<float>{scale});
  void* grad = logits;
  if (!c.in_place)
    grad = guarded_copy(grad_buffer, std::vector<unsigned char>(bytes.size(), 0xff));  // NaNs
  const k::CrossEntropyGradArgs<float> args{lse_dev, scale_dev, c.z_loss, grad};
  if (auto s = k::cross_entropy_grad_apply(rows, args, nullptr, c.max_blocks); !s.ok())
    problem += "grad apply: " + s.message;
  const auto* g = static_cast<const unsigned char*>(grad);
  int64_t differ = 0, unwritten = 0, out_of_bound = 0, nonzero_padding = 0;
  double worst_grad = 0;
  for (int64_t r = 0; r < c.rows && problem.empty(); ++r) {
    const bool ignored = targets[size_t(r)] == -100;
    const double lse_r = lse[size_t(r)];
    const double factor = 1 + 2 * double(c.z_loss) * lse_r;
    bool nan_row = false;
    for (int64_t j = 0; j < c.valid; ++j) nan_row |= std::isnan(exact[size_t(r * c.ld + j)]);
    for (int64_t j = 0; j < c.ld; ++j) {
      const int64_t i = r * c.ld + j;
      const double v = element(c.dtype, g, i);
      const double w = element(c.dtype, want_grad.data(), i);
      differ += !(std::memcmp(g + i * k::element_size(c.dtype),
                              want_grad.data() + i * k::element_size(c.dtype),
                              size_t(k::element_size(c.dtype))) == 0 ||
                  (std::isnan(v) && std::isnan(w)));
      if (j >= c.valid || ignored) {
        nonzero_padding += v != 0.0;
        continue;
      }
      if (nan_row) {
        unwritten += !std::isnan(v);  // NaN in, NaN out: a NaN logit reaches every gradient
        continue;
      }
      if (std::isnan(v)) {
        ++unwritten;
        continue;
      }
      // The fp64 gradient at the same lse the kernel reads. The kernel's x - lse rounds to
      // within |x - lse| u, which exp turns into a relative error of p; exp itself is within 2
      // ulp, then up to 3 products and a difference, each one rounding; then the store rounds to
      // the element type.
      const double p = std::exp(exact[size_t(i)] - lse_r);
      const double want_exact =
          (p * factor - (j + c.col_offset == targets[size_t(r)] ? 1.0 : 0.0)) * double(scale);
      const double p_error =
          p > 0 ? p * factor * (std::fabs(exact[size_t(i)] - lse_r) + 6) * 0x1p-24 : 0.0;
      const double bound = unit(c.dtype) * std::fabs(want_exact) * 1.01 +
                           double(scale) * (p_error + 4 * 0x1p-24) + 1e-30;
      const double err = std::fabs(v - want_exact);
      worst_grad = std::max(worst_grad, err / double(scale));
      out_of_bound += !(err <= bound);
    }
  }
  if (differ) problem += std::to_string(differ) + " gradients differ from the reference; ";
  if (unwritten) problem += std::to_string(unwritten) + " gradients not written (or not NaN); ";
  if (out_of_bound) problem += std::to_string(out_of_bound) + " gradients outside the fp64 bound; ";
  if (nonzero_padding)
    problem += std::to_string(nonzero_padding) + " padding or ignored gradients not 0; ";
  if (emulation::error_count != errors_before) problem += "(emulation errors)";
  std::printf(
      "%s  %s %lld x %lld (valid %lld, offset %lld)%s%s%s%s: worst lse %.2e (bound %.2e), "
      "grad %.2e%s%s\n",
      problem.empty() ? "ok  " : "FAIL", k::element_dtype_name(c.dtype), (long long)c.rows,
      (long long)c.ld, (long long)c.valid, (long long)c.col_offset,
      k::cross_entropy_chunk(rows) > 1 ? ", vector" : ", scalar", c.z_loss != 0 ? ", z-loss" : "",
      c.in_place ? ", in place" : "", c.max_blocks ? ", capped grid" : "", worst_lse, lse_bound,
      worst_grad, problem.empty() ? "" : ": ", problem.c_str());
  return problem.empty();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  auto [runs, failed] = emulated_test::run_each(configs(), run);
  double dummy[4] = {};
  float out[4] = {};
  const int64_t target = 0;
  k::CrossEntropyRows fp64{k::LogitsDtype::kFloat64, dummy, 1, 4, 4, 0, &target, -100};
  failed += !refused(k::cross_entropy_stats_apply(fp64, {out, out + 1, out + 2, out + 3}, nullptr),
                     "fp64", "fp64 logits on the kernel");
  k::CrossEntropyRows wide{k::LogitsDtype::kFloat32, out, 1, 4, 5, 0, &target, -100};
  failed += !refused(k::cross_entropy_stats_apply(wide, {out, out + 1, out + 2, out + 3}, nullptr),
                     "valid 5 must be in [0, ld = 4]", "valid > ld");
  return emulated_test::finish(runs + 2, failed, start);
}
