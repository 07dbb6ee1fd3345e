// add_norm_emulated: the fused add + norm kernels (kernels/norm/add_norm.cu) run on the CPU under
// the emulation in this folder, through their entry points, against the host reference of
// kernels/norm and against fp64 math. ctest runs it as kernels.add_norm_emulated; deliberately
// broken copies of the kernel must fail it (kernels.add_norm_emulated_mutant and
// ..._input_mutant, WILL_FAIL). Written by the loom authors.
//
// Per configuration (LayerNorm with and without bias, RMSNorm; fp32, fp16, bf16 io; with a branch
// to add and without; widths below, at and above a warp's 32 lanes and not multiples of 32; grids
// smaller than the rows; grad_sum given, absent, and in place with grad_input; grad_branch wanted
// or not; one and several weight slices):
//   - forward (sum, normed, mean, rstd), backward (grad_input, grad_branch) and the weight
//     partials equal the host reference's bit for bit;
//   - each is within its error bound of the fp64 value (bounds derived below from the number of
//     roundings, not from measured errors);
//   - every output element was written (buffers start as NaN), nothing outside the buffers was
//     touched (guard pages), and the emulator reported no error (races, shuffles).
// Refused, not launched: fp64 io, RMSNorm with a bias, a branch without a sum buffer.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/host_elements.h"
#include "emulated_test_util.h"
#include "norm/add_norm.h"

namespace {

namespace k = loom::kernels;
using emulated_test::count_differ;
using emulated_test::guarded_copy;
using emulated_test::refused;
using k::ElementDtype;
using k::NormKind;

constexpr double kU = 0x1p-24;  // fp32 unit roundoff

struct Config {
  NormKind kind;
  ElementDtype io;
  int64_t rows, width;
  bool branch, bias;
  int64_t max_blocks;  // 0: uncapped
  int grad_sum;        // 0: none, 1: its own buffer, 2: in place (grad_sum == grad_input)
  bool grad_branch;
  int64_t slices;
};

std::vector<Config> configs() {
  using D = ElementDtype;
  const auto L = NormKind::kLayerNorm, R = NormKind::kRmsNorm;
  return {
      {L, D::kBFloat16, 9, 768, true, true, 0, 1, true, 3},    // GPT-2's width, autocast
      {L, D::kFloat32, 5, 100, true, true, 1, 2, true, 1},     // fp32 run, one block loops
      {L, D::kFloat16, 19, 33, false, true, 2, 0, false, 4},   // no branch (a block's first norm)
      {L, D::kBFloat16, 4, 17, true, false, 0, 2, true, 2},    // fewer columns than lanes
      {R, D::kBFloat16, 11, 256, true, false, 2, 2, true, 5},  // Llama: RMSNorm
      {R, D::kFloat32, 3, 1, false, false, 0, 1, false, 1},    // width 1
      {R, D::kFloat16, 6, 130, true, false, 0, 0, true, 6},
      {L, D::kFloat32, 0, 64, true, true, 0, 1, true, 2},  // no rows
  };
}

const char* kind_name(NormKind kind) {
  return kind == NormKind::kLayerNorm ? "LayerNorm" : "RMSNorm";
}

double unit(ElementDtype d) {
  return d == ElementDtype::kFloat32 ? kU : d == ElementDtype::kFloat16 ? 0x1p-11 : 0x1p-8;
}

// Values stored in the io dtype, and what they are exactly.
struct IoBuffer {
  std::vector<unsigned char> bytes;
  std::vector<double> exact;
};

IoBuffer make_io(ElementDtype d, size_t n, std::mt19937& gen, double scale) {
  std::normal_distribution<float> normal;
  IoBuffer b;
  b.bytes.assign(n * size_t(k::element_size(d)), 0);
  b.exact.resize(n);
  for (size_t i = 0; i < n; ++i) {
    k::store_element(d, b.bytes.data(), int64_t(i), float(normal(gen) * scale));
    b.exact[i] = k::load_element<double>(d, b.bytes.data(), int64_t(i));
  }
  return b;
}

std::vector<float> make_floats(size_t n, std::mt19937& gen, float mean, float scale) {
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (auto& x : v) x = mean + normal(gen) * scale;
  return v;
}

// The fp64 forward and backward of one configuration's rows.
struct Exact {
  std::vector<double> sum, normed, mean, rstd, grad_input, weight_grad, bias_grad;
  std::vector<double> normed_scale, grad_scale;  // per element: what the bounds multiply
};

Exact exact_math(const Config& c, const std::vector<float>& residual, const IoBuffer& branch,
                 const std::vector<float>& weight, const std::vector<float>& bias,
                 const IoBuffer& grad_normed, const std::vector<float>& grad_sum) {
  const bool layer = c.kind == NormKind::kLayerNorm;
  const size_t n = size_t(c.rows * c.width), w = size_t(c.width);
  Exact e;
  e.sum.resize(n);
  e.normed.resize(n);
  e.grad_input.resize(n);
  e.normed_scale.resize(n);
  e.grad_scale.resize(n);
  e.weight_grad.assign(w, 0);
  e.bias_grad.assign(w, 0);
  for (int64_t r = 0; r < c.rows; ++r) {
    const size_t base = size_t(r) * w;
    double first = 0, abs_sum = 0;
    for (size_t j = 0; j < w; ++j) {
      e.sum[base + j] = double(residual[base + j]) + (c.branch ? branch.exact[base + j] : 0.0);
      first += layer ? e.sum[base + j] : e.sum[base + j] * e.sum[base + j];
      abs_sum += std::fabs(e.sum[base + j]);
    }
    const double mean = layer ? first / double(w) : 0.0;
    double moment = 0;
    for (size_t j = 0; j < w; ++j) {
      const double d = e.sum[base + j] - mean;
      moment += layer ? d * d : 0.0;
    }
    if (!layer) moment = first;
    const double rstd = 1.0 / std::sqrt(moment / double(w) + 1e-5);
    e.mean.push_back(mean);
    e.rstd.push_back(rstd);
    double sum_gw = 0, sum_gw_xhat = 0, abs_gw = 0, abs_gw_xhat = 0;
    for (size_t j = 0; j < w; ++j) {
      const double xhat = (e.sum[base + j] - mean) * rstd;
      e.normed[base + j] = xhat * weight[j] + (c.bias ? bias[j] : 0.0);
      e.normed_scale[base + j] = std::fabs(xhat * weight[j]) +
                                 std::fabs(weight[j]) * rstd * abs_sum / double(w) +
                                 (c.bias ? std::fabs(bias[j]) : 0.0);
      const double gw = grad_normed.exact[base + j] * weight[j];
      sum_gw += gw;
      sum_gw_xhat += gw * xhat;
      abs_gw += std::fabs(gw);
      abs_gw_xhat += std::fabs(gw * xhat);
    }
    for (size_t j = 0; j < w; ++j) {
      const double xhat = (e.sum[base + j] - mean) * rstd;
      const double gw = grad_normed.exact[base + j] * weight[j];
      const double dx =
          rstd * (gw - (layer ? sum_gw / double(w) : 0.0) - xhat * sum_gw_xhat / double(w));
      e.grad_input[base + j] = dx + (c.grad_sum ? double(grad_sum[base + j]) : 0.0);
      // |xhat| carries the error of the statistics (relative) and of the mean (rstd times it).
      const double xhat_scale = std::fabs(xhat) + rstd * abs_sum / double(w);
      e.grad_scale[base + j] =
          rstd * (std::fabs(gw) + abs_gw / double(w) + xhat_scale * abs_gw_xhat / double(w)) +
          (c.grad_sum ? std::fabs(double(grad_sum[base + j])) : 0.0);
      e.weight_grad[j] += grad_normed.exact[base + j] * xhat;
      e.bias_grad[j] += grad_normed.exact[base + j];
    }
  }
  return e;
}

bool run(const Config& c) {
  std::mt19937 gen(uint32_t(c.rows * 131 + c.width * 7 + int(c.io) * 3 + int(c.kind)));
  const size_t n = size_t(c.rows * c.width), w = size_t(c.width);
  const k::NormRows rows{c.kind, c.io, c.rows, c.width};
  const auto residual = make_floats(n, gen, 0.3f, 1.0f);
  const auto branch = make_io(c.io, n, gen, 0.5);
  const auto weight = make_floats(w, gen, 1.0f, 0.2f);
  const auto bias = make_floats(w, gen, 0.0f, 0.1f);
  const auto grad_normed = make_io(c.io, n, gen, 1.0);
  const auto grad_sum = make_floats(n, gen, 0.0f, 0.3f);
  const float nan = std::nanf("");
  const std::vector<float> nan_rows(n, nan), nan_stats(size_t(c.rows), nan);
  const std::vector<unsigned char> nan_io(n * size_t(k::element_size(c.io)), 0xff);
  const size_t io_bytes = nan_io.size();

  // Forward: the host reference's outputs and the kernel's.
  std::vector<float> want_sum(n, nan), want_mean(size_t(c.rows)), want_rstd(size_t(c.rows));
  std::vector<unsigned char> want_normed(io_bytes);
  const k::AddNormForwardArgs<float> host_fwd{residual.data(),
                                              c.branch ? branch.bytes.data() : nullptr,
                                              weight.data(),
                                              c.bias ? bias.data() : nullptr,
                                              1e-5f,
                                              c.branch ? want_sum.data() : nullptr,
                                              want_normed.data(),
                                              want_mean.data(),
                                              want_rstd.data()};
  std::string problem;
  if (auto s = k::add_norm_forward_host(rows, host_fwd, 0, c.rows); !s.ok())
    problem += "host forward: " + s.message + "; ";
  GuardedBuffer b_res, b_branch, b_w, b_b, b_sum, b_normed, b_mean, b_rstd;
  const k::AddNormForwardArgs<float> dev_fwd{
      guarded_copy(b_res, residual),
      c.branch ? guarded_copy(b_branch, branch.bytes) : nullptr,
      guarded_copy(b_w, weight),
      c.bias ? guarded_copy(b_b, bias) : nullptr,
      1e-5f,
      c.branch ? guarded_copy(b_sum, nan_rows) : nullptr,
      guarded_copy(b_normed, nan_io),
      guarded_copy(b_mean, nan_stats),
      guarded_copy(b_rstd, nan_stats)};
  const int errors_before = emulation::error_count;
  if (auto s = k::add_norm_forward_apply(rows, dev_fwd, nullptr, c.max_blocks); !s.ok())
    problem += "forward apply: " + s.message + "; ";
  int64_t differ = 0;
  if (c.branch)
    differ += count_differ(ElementDtype::kFloat32, dev_fwd.sum, want_sum.data(), int64_t(n));
  differ += count_differ(c.io, dev_fwd.normed, want_normed.data(), int64_t(n));
  differ += count_differ(ElementDtype::kFloat32, dev_fwd.mean, want_mean.data(), c.rows);
  differ += count_differ(ElementDtype::kFloat32, dev_fwd.rstd, want_rstd.data(), c.rows);
  if (differ) problem += std::to_string(differ) + " forward outputs differ from the reference; ";

  const Exact e = exact_math(c, residual, branch, weight, bias, grad_normed, grad_sum);
  // A lane folds ceil(width / 32) values, then 5 butterfly levels: k roundings a sum.
  const double k_sums = double((c.width + 31) / 32 + 5);
  int64_t unwritten = 0, out_of_bound = 0;
  double worst_normed = 0, worst_grad = 0, worst_weight = 0;
  const float* sum = c.branch ? dev_fwd.sum : dev_fwd.residual;
  for (size_t i = 0; i < n; ++i) {
    if (c.branch) {
      unwritten += std::isnan(sum[i]);
      out_of_bound += !(std::fabs(double(sum[i]) - e.sum[i]) <= kU * std::fabs(e.sum[i]));
    }
    const double got = k::load_element<double>(c.io, dev_fwd.normed, int64_t(i));
    unwritten += std::isnan(got);
    // Mean and moment: k + 2 roundings each; rstd: half the moment's, plus 4 (div, add, sqrt,
    // div); xhat, product, bias: 3 more; then the store's rounding to the io dtype.
    const double bound = unit(c.io) * std::fabs(e.normed[i]) * 1.01 +
                         (k_sums + 10) * kU * e.normed_scale[i] * 1.01 + 1e-30;
    const double err = std::fabs(got - e.normed[i]);
    out_of_bound += !(err <= bound);
    if (e.normed_scale[i] > 0) worst_normed = std::max(worst_normed, err / e.normed_scale[i]);
  }

  // Backward: grad_sum absent, in its own buffer, or in place in grad_input.
  std::vector<float> want_gi(c.grad_sum ? grad_sum : nan_rows);
  std::vector<unsigned char> want_gb(io_bytes);
  const k::AddNormBackwardArgs<float> host_bwd{
      sum,  // the kernel's sum equals the reference's (checked above)
      weight.data(),
      want_mean.data(),
      want_rstd.data(),
      grad_normed.bytes.data(),
      c.grad_sum == 0   ? nullptr
      : c.grad_sum == 2 ? want_gi.data()
                        : grad_sum.data(),
      want_gi.data(),
      c.grad_branch ? want_gb.data() : nullptr};
  if (auto s = k::add_norm_backward_host(rows, host_bwd, 0, c.rows); !s.ok())
    problem += "host backward: " + s.message + "; ";
  GuardedBuffer b_gn, b_gs, b_gi, b_gb;
  const float* dev_gn_sum = nullptr;
  float* dev_gi = guarded_copy(b_gi, c.grad_sum == 2 ? grad_sum : nan_rows);
  if (c.grad_sum == 1) dev_gn_sum = guarded_copy(b_gs, grad_sum);
  if (c.grad_sum == 2) dev_gn_sum = dev_gi;
  const k::AddNormBackwardArgs<float> dev_bwd{sum,
                                              dev_fwd.weight,
                                              dev_fwd.mean,
                                              dev_fwd.rstd,
                                              guarded_copy(b_gn, grad_normed.bytes),
                                              dev_gn_sum,
                                              dev_gi,
                                              c.grad_branch ? guarded_copy(b_gb, nan_io) : nullptr};
  if (auto s = k::add_norm_backward_apply(rows, dev_bwd, nullptr, c.max_blocks); !s.ok())
    problem += "backward apply: " + s.message + "; ";
  differ = count_differ(ElementDtype::kFloat32, dev_gi, want_gi.data(), int64_t(n));
  if (c.grad_branch) differ += count_differ(c.io, dev_bwd.grad_branch, want_gb.data(), int64_t(n));
  if (differ) problem += std::to_string(differ) + " gradients differ from the reference; ";
  for (size_t i = 0; i < n; ++i) {
    unwritten += std::isnan(dev_gi[i]);
    // The statistics and xhat as above (k + 10), the row means of gw and gw xhat (k + 2 each),
    // the final combination (4), grad_sum's add (1): 2k + 20 roundings of the magnitudes.
    const double bound = (2 * k_sums + 20) * kU * e.grad_scale[i] * 1.01 + 1e-30;
    const double err = std::fabs(double(dev_gi[i]) - e.grad_input[i]);
    out_of_bound += !(err <= bound);
    if (e.grad_scale[i] > 0) worst_grad = std::max(worst_grad, err / e.grad_scale[i]);
    if (c.grad_branch) {
      const double gb = k::load_element<double>(c.io, dev_bwd.grad_branch, int64_t(i));
      unwritten += std::isnan(gb);
      out_of_bound +=
          !(std::fabs(gb - double(dev_gi[i])) <= unit(c.io) * std::fabs(double(dev_gi[i])) + 1e-30);
    }
  }

  // Weight partials, summed over slices here in fp64.
  const size_t partial = size_t(c.slices) * w;
  std::vector<float> want_wp(partial), want_bp(partial);
  const bool with_bias = c.kind == NormKind::kLayerNorm;
  const k::NormWeightGradArgs<float> host_wg{sum,
                                             want_mean.data(),
                                             want_rstd.data(),
                                             grad_normed.bytes.data(),
                                             c.slices,
                                             want_wp.data(),
                                             with_bias ? want_bp.data() : nullptr};
  if (auto s = k::norm_weight_grad_host(rows, host_wg, 0, c.slices); !s.ok())
    problem += "host weight grad: " + s.message + "; ";
  GuardedBuffer b_wp, b_bp;
  const std::vector<float> nan_partial(partial, nan);
  const k::NormWeightGradArgs<float> dev_wg{sum,
                                            dev_fwd.mean,
                                            dev_fwd.rstd,
                                            dev_bwd.grad_normed,
                                            c.slices,
                                            guarded_copy(b_wp, nan_partial),
                                            with_bias ? guarded_copy(b_bp, nan_partial) : nullptr};
  if (auto s = k::norm_weight_grad_apply(rows, dev_wg, nullptr); !s.ok())
    problem += "weight grad apply: " + s.message + "; ";
  differ =
      count_differ(ElementDtype::kFloat32, dev_wg.weight_partial, want_wp.data(), int64_t(partial));
  if (with_bias)
    differ +=
        count_differ(ElementDtype::kFloat32, dev_wg.bias_partial, want_bp.data(), int64_t(partial));
  if (differ) problem += std::to_string(differ) + " weight partials differ from the reference; ";
  const int64_t per = c.rows > 0 ? (c.rows + c.slices - 1) / c.slices : 0;
  for (size_t j = 0; j < w; ++j) {
    double gw = 0, gb = 0, scale = 0, gb_scale = 0;
    for (int64_t s = 0; s < c.slices; ++s) {
      gw += dev_wg.weight_partial[size_t(s) * w + j];
      if (with_bias) gb += dev_wg.bias_partial[size_t(s) * w + j];
    }
    for (int64_t r = 0; r < c.rows; ++r) {
      const size_t i = size_t(r) * w + j;
      const double xhat_scale = std::fabs((e.sum[i] - e.mean[size_t(r)]) * e.rstd[size_t(r)]) +
                                e.rstd[size_t(r)] * std::fabs(e.sum[i]);
      scale += std::fabs(grad_normed.exact[i]) * xhat_scale;
      gb_scale += std::fabs(grad_normed.exact[i]);
    }
    unwritten += std::isnan(gw) + std::isnan(gb);
    // xhat as in the forward (k + 10), the product (1), the slice's sum (per).
    const double bound = (k_sums + 11 + double(per)) * kU * scale * 1.01 + 1e-30;
    out_of_bound += !(std::fabs(gw - e.weight_grad[j]) <= bound);
    if (with_bias)
      out_of_bound += !(std::fabs(gb - e.bias_grad[j]) <= double(per) * kU * gb_scale + 1e-30);
    if (scale > 0) worst_weight = std::max(worst_weight, std::fabs(gw - e.weight_grad[j]) / scale);
  }
  if (unwritten) problem += std::to_string(unwritten) + " outputs not written; ";
  if (out_of_bound) problem += std::to_string(out_of_bound) + " outputs outside the fp64 bound; ";
  if (emulation::error_count != errors_before) problem += "(emulation errors)";
  std::printf(
      "%s  %s %s %lld x %lld%s%s%s, grad_sum %s%s, %lld slices: worst normed %.2e (bound factor "
      "%.0f u), grad %.2e (%.0f u), weight %.2e%s%s\n",
      problem.empty() ? "ok  " : "FAIL", kind_name(c.kind), k::element_dtype_name(c.io),
      (long long)c.rows, (long long)c.width, c.branch ? ", add" : "", c.bias ? ", bias" : "",
      c.max_blocks ? ", capped grid" : "",
      c.grad_sum == 0   ? "none"
      : c.grad_sum == 1 ? "own"
                        : "in place",
      c.grad_branch ? ", grad_branch" : "", (long long)c.slices, worst_normed, k_sums + 10,
      worst_grad, 2 * k_sums + 20, worst_weight, problem.empty() ? "" : ": ", problem.c_str());
  return problem.empty();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  auto [runs, failed] = emulated_test::run_each(configs(), run);
  float v[4] = {1, 2, 3, 4}, out[4] = {};
  const k::AddNormForwardArgs<float> plain{v, nullptr, v, nullptr, 1e-5f, nullptr, out, out, out};
  failed += !refused(k::add_norm_forward_apply({NormKind::kLayerNorm, ElementDtype::kFloat64, 1, 4},
                                               plain, nullptr),
                     "fp64", "fp64 io on the kernel");
  k::AddNormForwardArgs<float> rms_bias = plain;
  rms_bias.bias = v;
  failed += !refused(k::add_norm_forward_apply({NormKind::kRmsNorm, ElementDtype::kFloat32, 1, 4},
                                               rms_bias, nullptr),
                     "RMSNorm takes no bias", "RMSNorm with a bias");
  k::AddNormForwardArgs<float> no_sum = plain;
  no_sum.branch = v;
  failed += !refused(k::add_norm_forward_apply({NormKind::kLayerNorm, ElementDtype::kFloat32, 1, 4},
                                               no_sum, nullptr),
                     "a branch needs sum", "a branch without a sum buffer");
  return emulated_test::finish(runs + 3, failed, start);
}
