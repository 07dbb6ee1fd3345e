// The host references of the fused cross-entropy (cross_entropy.h): the CUDA kernels' column
// partition, fold order and combining tree, one row at a time, in plain C++.
#include <cmath>
#include <cstdint>
#include <string>

#include "common/host_elements.h"
#include "loss/cross_entropy.h"
#include "loss/cross_entropy_math.h"

namespace loom::kernels {

namespace {

template <typename Acc>
Status check_acc(const CrossEntropyRows& rows) {
  const bool fp64 = rows.dtype == LogitsDtype::kFloat64;
  if (fp64 != (sizeof(Acc) == 8))
    return Status::invalid_argument(
        "cross_entropy host reference: fp64 logits accumulate in double and the others in "
        "float; got the other accumulator");
  return cross_entropy_check(rows);
}

template <typename Acc>
SoftmaxPartial<Acc> butterfly(SoftmaxPartial<Acc> (&v)[32]) {
  return warp_butterfly(v, [](const SoftmaxPartial<Acc>& a, const SoftmaxPartial<Acc>& b) {
    return softmax_combine(a, b);
  });
}

}  // namespace

Status cross_entropy_check(const CrossEntropyRows& r) {
  const auto bad = [](const std::string& m) {
    return Status::invalid_argument("cross_entropy: " + m);
  };
  if (element_size(r.dtype) == 0)
    return bad("unknown logits dtype " + std::to_string(int(r.dtype)));
  if (r.rows < 0) return bad("rows " + std::to_string(r.rows) + " must be >= 0");
  if (r.ld < 1) return bad("ld " + std::to_string(r.ld) + " must be >= 1 (the row length)");
  if (r.valid < 0 || r.valid > r.ld)
    return bad("valid " + std::to_string(r.valid) + " must be in [0, ld = " + std::to_string(r.ld) +
               "]");
  if (r.col_offset < 0) return bad("col_offset " + std::to_string(r.col_offset) + " must be >= 0");
  if (r.rows > 0 && (r.logits == nullptr || r.targets == nullptr))
    return bad("logits and targets must not be null for " + std::to_string(r.rows) + " rows");
  return Status::success();
}

int cross_entropy_chunk(const CrossEntropyRows& r) {
  const int64_t size = element_size(r.dtype);
  if (size == 0 || size > 16) return 1;
  const bool aligned = reinterpret_cast<uintptr_t>(r.logits) % 16 == 0 && (r.ld * size) % 16 == 0;
  return aligned ? int(16 / size) : 1;
}

template <typename Acc>
Status cross_entropy_stats_host(const CrossEntropyRows& r, const CrossEntropyStats<Acc>& out,
                                int64_t row_begin, int64_t row_end) {
  if (Status s = check_acc<Acc>(r); !s.ok()) return s;
  const int64_t chunk = cross_entropy_chunk(r);
  const int64_t chunks = (r.valid + chunk - 1) / chunk;
  constexpr int kWarps = kCrossEntropyThreads / 32;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t base = row * r.ld;
    SoftmaxPartial<Acc> warp_partials[32];
    for (int w = 0; w < 32; ++w) warp_partials[w] = {Acc(-INFINITY), Acc(0)};
    for (int w = 0; w < kWarps; ++w) {
      SoftmaxPartial<Acc> lanes[32];
      for (int l = 0; l < 32; ++l) {
        SoftmaxPartial<Acc> p{Acc(-INFINITY), Acc(0)};
        for (int64_t k = w * 32 + l; k < chunks; k += kCrossEntropyThreads)
          for (int64_t j = 0; j < chunk; ++j) {
            const int64_t c = k * chunk + j;
            if (c < r.valid) softmax_add(p, load_element<Acc>(r.dtype, r.logits, base + c));
          }
        lanes[l] = p;
      }
      warp_partials[w] = butterfly(lanes);
    }
    const SoftmaxPartial<Acc> total = butterfly(warp_partials);
    const int64_t target = r.targets[row];
    const int64_t local = target - r.col_offset;
    const bool here = target != r.ignore_index && local >= 0 && local < r.valid;
    out.row_max[row] = total.max;
    out.row_sum[row] = total.sum;
    out.target_logit[row] = here ? load_element<Acc>(r.dtype, r.logits, base + local) : Acc(0);
    out.target_found[row] = here ? Acc(1) : Acc(0);
  }
  return Status::success();
}

template <typename Acc>
Status cross_entropy_grad_host(const CrossEntropyRows& r, const CrossEntropyGradArgs<Acc>& a,
                               int64_t row_begin, int64_t row_end) {
  if (Status s = check_acc<Acc>(r); !s.ok()) return s;
  if (row_begin >= row_end) return Status::success();
  if (a.lse == nullptr || a.scale == nullptr || a.grad == nullptr)
    return Status::invalid_argument("cross_entropy grad: lse, scale and grad must not be null");
  const Acc scale = *a.scale;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t base = row * r.ld, target = r.targets[row];
    if (target == r.ignore_index) {
      for (int64_t c = 0; c < r.ld; ++c) store_element(r.dtype, a.grad, base + c, Acc(0));
      continue;
    }
    const Acc lse = a.lse[row];
    const Acc factor = cross_entropy_grad_factor(lse, a.z_loss);
    const int64_t local = target - r.col_offset;
    for (int64_t c = 0; c < r.ld; ++c) {
      const Acc g = c < r.valid
                        ? cross_entropy_grad_value(load_element<Acc>(r.dtype, r.logits, base + c),
                                                   lse, factor, c == local, scale)
                        : Acc(0);
      store_element(r.dtype, a.grad, base + c, g);
    }
  }
  return Status::success();
}

template Status cross_entropy_stats_host<float>(const CrossEntropyRows&,
                                                const CrossEntropyStats<float>&, int64_t, int64_t);
template Status cross_entropy_stats_host<double>(const CrossEntropyRows&,
                                                 const CrossEntropyStats<double>&, int64_t,
                                                 int64_t);
template Status cross_entropy_grad_host<float>(const CrossEntropyRows&,
                                               const CrossEntropyGradArgs<float>&, int64_t,
                                               int64_t);
template Status cross_entropy_grad_host<double>(const CrossEntropyRows&,
                                                const CrossEntropyGradArgs<double>&, int64_t,
                                                int64_t);

}  // namespace loom::kernels
