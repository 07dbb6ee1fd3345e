// sparsify_emulated: the CUDA threshold-selection and scatter-add kernels
// (kernels/compression/sparsify.cu) run on the CPU under the emulation in this folder, through
// their public entry points, against the host reference of kernels/compression. ctest runs it as
// kernels.sparsify_emulated; a deliberately broken copy of the kernel must fail it
// (kernels.sparsify_emulated_mutant, WILL_FAIL). Written by the loom authors.
//
// Per configuration: the chunk counts, the written indices and values, and the updated error
// equal the reference's bit for bit; slots past the selected ones keep their poison (nothing
// written there), nothing outside the buffers was touched (guard pages), and the emulator
// reported no error. Configurations: lengths that do and do not fill whole chunks, capacities
// below, at and above the count, a NaN, zeros, grids smaller than the work (the grid-stride
// loop), no values. Then the scatter-add of two ranks' lists with padding equals the reference's.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "compression/sparsify.h"
#include "emulated_test_util.h"

namespace {

namespace k = loom::kernels;

struct Config {
  int64_t n;
  float threshold;
  double capacity_fraction;  // of the selected count
  int64_t max_blocks;        // 0: the kernel's default grid
  bool nan;
};

std::vector<Config> configs() {
  return {{256, 1.0f, 1.0, 0, false}, {1000, 1.5f, 0.5, 0, true}, {3000, 0.5f, 2.0, 1, false},
          {3000, 2.0f, 0.3, 2, true}, {77, 0.0f, 1.0, 0, false},  {0, 1.0f, 1.0, 0, false},
          {5000, 1e9f, 1.0, 0, false}};
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(a) && std::isnan(b));
}

constexpr int32_t kPoisonIndex = 0x5a5a5a5a;

bool run(const Config& c) {
  const int64_t n = c.n, chunks = k::select_chunks(n);
  std::mt19937 gen(uint32_t(n + 7));
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(n)), error(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    x[size_t(i)] = normal(gen);
    error[size_t(i)] = 0.3f * normal(gen);
  }
  for (int64_t i = 5; i < std::min<int64_t>(n, 40); ++i) x[size_t(i)] = error[size_t(i)] = 0.0f;
  if (c.nan && n > 300) x[300] = std::numeric_limits<float>::quiet_NaN();

  // The reference: counts, offsets, then the write.
  std::vector<int32_t> want_counts(static_cast<size_t>(chunks));
  k::select_count_host(x.data(), error.data(), n, c.threshold, want_counts.data(), 0, chunks);
  std::vector<int64_t> offsets(static_cast<size_t>(chunks));
  int64_t total = 0;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    offsets[size_t(ch)] = total;
    total += want_counts[size_t(ch)];
  }
  const auto capacity = int64_t(std::ceil(double(total) * c.capacity_fraction));
  std::vector<int32_t> want_indices(static_cast<size_t>(capacity), kPoisonIndex);
  std::vector<float> want_values(static_cast<size_t>(capacity), -7.0f), want_error = error;
  k::select_write_host(x.data(), want_error.data(), n, c.threshold, offsets.data(), capacity,
                       want_indices.data(), want_values.data(), 0, chunks);

  GuardedBuffer xb, eb, cb, ob, ib, vb;
  const float* xd = emulated_test::guarded_copy(xb, x);
  float* ed = emulated_test::guarded_copy(eb, error);
  int32_t* cd = emulated_test::guarded_copy(cb, std::vector<int32_t>(size_t(chunks), -1));
  const int64_t* od = emulated_test::guarded_copy(ob, offsets);
  int32_t* id =
      emulated_test::guarded_copy(ib, std::vector<int32_t>(size_t(capacity), kPoisonIndex));
  float* vd = emulated_test::guarded_copy(vb, std::vector<float>(size_t(capacity), -7.0f));

  const int errors_before = emulation::error_count;
  std::string problem;
  auto status = k::select_count_apply(xd, ed, n, c.threshold, cd, nullptr, c.max_blocks);
  if (!status.ok()) problem = "select_count_apply: " + status.message;
  status =
      k::select_write_apply(xd, ed, n, c.threshold, od, capacity, id, vd, nullptr, c.max_blocks);
  if (!status.ok() && problem.empty()) problem = "select_write_apply: " + status.message;
  int wrong = 0;
  for (int64_t ch = 0; ch < chunks && problem.empty(); ++ch)
    wrong += cd[ch] != want_counts[size_t(ch)];
  if (wrong) problem = std::to_string(wrong) + " chunk counts differ from the reference";
  for (int64_t s = 0; s < capacity && problem.empty(); ++s)
    wrong += id[s] != want_indices[size_t(s)] || !same_bits(vd[s], want_values[size_t(s)]);
  if (wrong && problem.empty())
    problem = std::to_string(wrong) +
              " slots differ from the reference (or were written past "
              "the selected values)";
  for (int64_t i = 0; i < n && problem.empty(); ++i)
    wrong += !same_bits(ed[i], want_error[size_t(i)]);
  if (wrong && problem.empty()) problem = std::to_string(wrong) + " errors differ";
  if (emulation::error_count != errors_before) problem += " (emulation errors)";
  std::printf("%s  %lld values, threshold %g, %lld selected, capacity %lld, grid cap %lld%s%s%s\n",
              problem.empty() ? "ok  " : "FAIL", (long long)n, double(c.threshold),
              (long long)total, (long long)capacity, (long long)c.max_blocks,
              c.nan ? ", a NaN" : "", problem.empty() ? "" : ": ", problem.c_str());
  return problem.empty();
}

// Two ranks' lists (distinct indices within each, shared across them, -1 padding and an index
// past the end) added one after the other into zeros.
bool run_scatter(int64_t max_blocks) {
  const int64_t n = 2000, m = 700;
  std::mt19937 gen(3);
  std::vector<float> dense(static_cast<size_t>(n), 0.0f), want(size_t(n), 0.0f);
  GuardedBuffer db;
  float* dd = emulated_test::guarded_copy(db, dense);
  std::string problem;
  const int errors_before = emulation::error_count;
  for (int rank = 0; rank < 2; ++rank) {
    std::vector<int32_t> perm(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) perm[size_t(i)] = int32_t(i);
    std::shuffle(perm.begin(), perm.end(), gen);
    std::vector<int32_t> indices(perm.begin(), perm.begin() + m);
    indices[10] = -1;
    indices[11] = int32_t(n);  // past the end: skipped
    std::vector<float> values(static_cast<size_t>(m));
    std::normal_distribution<float> normal;
    for (auto& v : values) v = normal(gen);
    k::scatter_add_host(want.data(), n, indices.data(), values.data(), m);
    GuardedBuffer ib, vb;
    const int32_t* id = emulated_test::guarded_copy(ib, indices);
    const float* vd = emulated_test::guarded_copy(vb, values);
    const auto status = k::scatter_add_apply(dd, n, id, vd, m, nullptr, max_blocks);
    if (!status.ok()) problem = "scatter_add_apply: " + status.message;
  }
  int wrong = 0;
  for (int64_t i = 0; i < n && problem.empty(); ++i) wrong += !same_bits(dd[i], want[size_t(i)]);
  if (wrong) problem = std::to_string(wrong) + " sums differ from the reference";
  if (emulation::error_count != errors_before) problem += " (emulation errors)";
  std::printf("%s  scatter-add of two lists, grid cap %lld%s%s\n",
              problem.empty() ? "ok  " : "FAIL", (long long)max_blocks, problem.empty() ? "" : ": ",
              problem.c_str());
  return problem.empty();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto start = std::chrono::steady_clock::now();
  auto [runs, failed] = emulated_test::run_each(configs(), run);
  for (const int64_t max_blocks : {0, 1}) {
    failed += !run_scatter(max_blocks);
    ++runs;
  }
  // Refused, not launched: a negative capacity.
  float dummy = 0;
  int64_t offset = 0;
  int32_t index = 0;
  const auto status =
      k::select_write_apply(&dummy, &dummy, 1, 1.0f, &offset, -1, &index, &dummy, nullptr);
  const bool refused = !status.ok() && status.message.find("capacity -1") != std::string::npos;
  std::printf("%s  capacity -1 is refused: %s\n", refused ? "ok  " : "FAIL",
              status.message.c_str());
  failed += !refused;
  return emulated_test::finish(runs + 1, failed, start);
}
