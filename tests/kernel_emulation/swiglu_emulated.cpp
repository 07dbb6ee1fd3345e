// swiglu_emulated: the fused SwiGLU kernels (kernels/activation/swiglu.cu) run on the CPU under
// the emulation in this folder, through their entry points, against the host reference of
// kernels/activation and against fp64 math. ctest runs it as kernels.swiglu_emulated;
// deliberately broken copies of the kernel must fail it (kernels.swiglu_emulated_mutant and
// ..._operand_mutant, WILL_FAIL). Written by the loom authors.
//
// Per configuration (fp32, fp16, bf16 io; n a multiple of a pack, with a tail, below one pack,
// zero; pointers 16-byte aligned and not; grids smaller than the work; grad_gate in place over
// grad_out or its own buffer):
//   - forward (out) and backward (grad_gate, grad_up) equal the host reference's bit for bit;
//   - each is within its error bound of the fp64 value (derived below from the roundings);
//   - every output element was written (buffers start as NaN), nothing outside the buffers was
//     touched (guard pages), and the emulator reported no error.
// Refused, not launched: fp64 io, a null pointer, grad_up aliasing grad_out.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "activation/swiglu.h"
#include "common/host_elements.h"
#include "emulated_test_util.h"

namespace {

namespace k = loom::kernels;
using emulated_test::count_differ;
using emulated_test::refused;
using k::ElementDtype;

constexpr double kU = 0x1p-24;  // fp32 unit roundoff

struct Config {
  ElementDtype io;
  int64_t n;
  bool aligned;        // false: every pointer one element past a 16-byte boundary
  int64_t max_blocks;  // 0: uncapped
  bool in_place;       // grad_gate is grad_out's buffer
};

std::vector<Config> configs() {
  using D = ElementDtype;
  return {
      {D::kBFloat16, 4096, true, 0, false},  // whole packs only
      {D::kBFloat16, 1003, true, 1, true},   // packs and a tail; one block loops; in place
      {D::kFloat16, 777, true, 2, false},   {D::kFloat32, 1030, true, 0, true},  // 4 fp32 a pack
      {D::kFloat32, 37, false, 0, false},  // unaligned: one at a time
      {D::kBFloat16, 300, false, 1, true},  {D::kBFloat16, 5, true, 0, false},  // below one pack
      {D::kFloat16, 0, true, 0, false},                                         // nothing to do
  };
}

double unit(ElementDtype d) {
  return d == ElementDtype::kFloat32 ? kU : d == ElementDtype::kFloat16 ? 0x1p-11 : 0x1p-8;
}

// A guarded buffer of n io elements starting at `offset` elements into it, filled from `bytes`
// (or NaN).
struct IoArray {
  GuardedBuffer buffer;
  void* data = nullptr;
};

void make_array(IoArray& a, ElementDtype d, int64_t n, int64_t offset, const void* bytes) {
  const size_t size = size_t(k::element_size(d));
  std::vector<unsigned char> init(size_t(n + offset) * size, 0);
  for (int64_t i = 0; i < n + offset; ++i)
    k::store_element<double>(d, init.data(), i, std::nan(""));
  if (bytes && n > 0) std::memcpy(init.data() + size_t(offset) * size, bytes, size_t(n) * size);
  a.data = static_cast<unsigned char*>(emulated_test::guarded_copy(a.buffer, init)) +
           size_t(offset) * size;
}

// n values in io: activations of realistic spread with the tails a sigmoid saturates in.
std::vector<unsigned char> make_values(ElementDtype d, int64_t n, std::mt19937& gen, double scale) {
  std::normal_distribution<float> normal;
  std::vector<unsigned char> v(size_t(std::max<int64_t>(n, 1)) * size_t(k::element_size(d)));
  for (int64_t i = 0; i < n; ++i) {
    float x = float(normal(gen) * scale);
    if (i % 97 == 13) x = 40.0f;   // s == 1 in fp32
    if (i % 97 == 29) x = -90.0f;  // exp(90) overflows: s == 0
    if (i % 97 == 41) x = 0.0f;
    k::store_element<float>(d, v.data(), i, x);
  }
  return v;
}

double at(ElementDtype d, const void* p, int64_t i) {
  return k::load_element<double>(d, p, i);
}

// Error bounds of one element, first order in u = 2^-24 (u^2 terms are below 1e-14 of these),
// with the GPU's expf (within 2 ulp) as the worst exp: e = exp(-g) within 4u relative; 1 + e
// within 5u; s = 1 / (1 + e) within 6u, and where exp(-g) overflows fp32 (-g > 88.72) s is 0,
// off by all of its (tiny) value. From s, each product adds its operands' errors and one
// rounding; 1 - s cancels where s is near 1, so every error is carried in absolute terms. Then
// one rounding to io: `io_unit` of the value, or half the io's smallest subnormal step below it.
struct Bounds {
  double out, grad_up, grad_gate;
};

double io_rounding(ElementDtype d, double v) {
  const double tiny = d == ElementDtype::kFloat32   ? 0x1p-150
                      : d == ElementDtype::kFloat16 ? 0x1p-25
                                                    : 0x1p-134;
  return unit(d) * std::fabs(v) + tiny;
}

Bounds bounds(double g, double u, double dh, ElementDtype io) {
  const double s = 1 / (1 + std::exp(-g));
  const double err_s = 6 * kU * s + (-g > 88.72 ? s : 0.0);
  const double silu = g * s, err_silu = std::fabs(g) * err_s + kU * std::fabs(silu);
  const double out = silu * u, err_out = std::fabs(u) * err_silu + kU * std::fabs(out);
  const double grad_up = dh * silu, err_up = std::fabs(dh) * err_silu + kU * std::fabs(grad_up);
  const double t = 1 - s, err_t = err_s + kU * std::fabs(t);
  const double m = g * t, err_m = std::fabs(g) * err_t + kU * std::fabs(m);
  const double q = 1 + m, err_q = err_m + kU * std::fabs(q);
  const double dsilu = s * q, err_dsilu = err_s * std::fabs(q) + s * err_q + kU * std::fabs(dsilu);
  const double a = dh * u, grad_gate = a * dsilu;
  const double err_gate =
      std::fabs(a) * err_dsilu + kU * std::fabs(a) * std::fabs(dsilu) + kU * std::fabs(grad_gate);
  return {err_out * 1.01 + io_rounding(io, out) * 1.01,
          err_up * 1.01 + io_rounding(io, grad_up) * 1.01,
          err_gate * 1.01 + io_rounding(io, grad_gate) * 1.01};
}

bool run(const Config& c) {
  std::mt19937 gen(uint32_t(c.n * 31 + int64_t(c.io) * 7 + c.aligned));
  const auto gate = make_values(c.io, c.n, gen, 3.0);
  const auto up = make_values(c.io, c.n, gen, 1.0);
  const auto grad_out = make_values(c.io, c.n, gen, 0.5);
  const k::SwigluShape shape{c.io, c.n};
  const int64_t offset = c.aligned ? 0 : 1;
  const size_t bytes = size_t(std::max<int64_t>(c.n, 1)) * size_t(k::element_size(c.io));
  std::string problem;

  // The host reference.
  std::vector<unsigned char> want_out(bytes), want_gg(bytes), want_gu(bytes);
  if (auto s = k::swiglu_forward_host(shape, {gate.data(), up.data(), want_out.data()}, 0, c.n);
      !s.ok())
    problem += "host forward: " + s.message + "; ";
  if (auto s = k::swiglu_backward_host(
          shape, {gate.data(), up.data(), grad_out.data(), want_gg.data(), want_gu.data()}, 0, c.n);
      !s.ok())
    problem += "host backward: " + s.message + "; ";

  // The kernels.
  IoArray g, u, out, dh, gg, gu;
  make_array(g, c.io, c.n, offset, gate.data());
  make_array(u, c.io, c.n, offset, up.data());
  make_array(out, c.io, c.n, offset, nullptr);
  make_array(dh, c.io, c.n, offset, grad_out.data());
  if (!c.in_place) make_array(gg, c.io, c.n, offset, nullptr);
  make_array(gu, c.io, c.n, offset, nullptr);
  void* grad_gate = c.in_place ? dh.data : gg.data;
  const int errors_before = emulation::error_count;
  if (auto s = k::swiglu_forward_apply(shape, {g.data, u.data, out.data}, nullptr, c.max_blocks);
      !s.ok())
    problem += "forward apply: " + s.message + "; ";
  if (auto s = k::swiglu_backward_apply(shape, {g.data, u.data, dh.data, grad_gate, gu.data},
                                        nullptr, c.max_blocks);
      !s.ok())
    problem += "backward apply: " + s.message + "; ";
  int64_t differ = count_differ(c.io, out.data, want_out.data(), c.n) +
                   count_differ(c.io, grad_gate, want_gg.data(), c.n) +
                   count_differ(c.io, gu.data, want_gu.data(), c.n);
  if (differ) problem += std::to_string(differ) + " outputs differ from the reference; ";

  int64_t unwritten = 0, out_of_bound = 0;
  double worst[3] = {0, 0, 0};  // |err| / bound
  for (int64_t i = 0; i < c.n; ++i) {
    const double gi = at(c.io, gate.data(), i), ui = at(c.io, up.data(), i);
    const double di = at(c.io, grad_out.data(), i);
    const double s = 1 / (1 + std::exp(-gi));
    const double exact[3] = {gi * s * ui, di * ui * s * (1 + gi * (1 - s)), di * gi * s};
    const Bounds b = bounds(gi, ui, di, c.io);
    const double bound[3] = {b.out, b.grad_gate, b.grad_up};
    const void* got[3] = {out.data, grad_gate, gu.data};
    for (int j = 0; j < 3; ++j) {
      const double v = at(c.io, got[j], i);
      unwritten += std::isnan(v);
      const double err = std::fabs(v - exact[j]);
      out_of_bound += !(err <= bound[j]);
      worst[j] = std::max(worst[j], err / bound[j]);
    }
  }
  if (unwritten) problem += std::to_string(unwritten) + " outputs not written; ";
  if (out_of_bound) problem += std::to_string(out_of_bound) + " outputs outside the fp64 bound; ";
  if (emulation::error_count != errors_before) problem += "(emulation errors)";
  std::printf(
      "%s  %s n %lld%s%s%s: worst |err| / bound: out %.3f, grad_gate %.3f, grad_up %.3f%s%s\n",
      problem.empty() ? "ok  " : "FAIL", k::element_dtype_name(c.io), (long long)c.n,
      c.aligned ? "" : ", unaligned", c.max_blocks ? ", capped grid" : "",
      c.in_place ? ", grad_gate in place" : "", worst[0], worst[1], worst[2],
      problem.empty() ? "" : ": ", problem.c_str());
  return problem.empty();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  auto [runs, failed] = emulated_test::run_each(configs(), run);
  float v[4] = {1, 2, 3, 4}, w[4] = {}, x[4] = {};
  failed += !refused(k::swiglu_forward_apply({ElementDtype::kFloat64, 4}, {v, v, w}, nullptr),
                     "fp64", "fp64 io on the kernel");
  failed += !refused(k::swiglu_forward_apply({ElementDtype::kFloat32, 4}, {v, nullptr, w}, nullptr),
                     "must not be null", "a null operand");
  failed +=
      !refused(k::swiglu_backward_apply({ElementDtype::kFloat32, 4}, {v, v, w, x, w}, nullptr),
               "grad_up must not alias grad_out", "grad_up over grad_out");
  return emulated_test::finish(runs + 3, failed, start);
}
