// The host references of the fused add + norm (add_norm.h): the CUDA kernels' lane partition,
// fold order and butterfly, one row (or one column of a slice) at a time, in plain C++.
#include <cmath>
#include <cstdint>
#include <string>

#include "common/host_elements.h"
#include "norm/add_norm.h"
#include "norm/add_norm_math.h"

namespace loom::kernels {

namespace {

Status bad(const std::string& message) {
  return Status::invalid_argument("add_norm: " + message);
}

template <typename Acc>
Status check_acc(const NormRows& r) {
  if ((r.io == ElementDtype::kFloat64) != (sizeof(Acc) == 8))
    return bad("fp64 io accumulates in double and the others in float; got the other accumulator");
  return norm_rows_check(r);
}

// The sum over 32 lane values, as the kernels' warp_sum leaves it.
template <typename Acc>
Acc lane_sum(Acc (&lanes)[32]) {
  return warp_butterfly(lanes, [](Acc a, Acc b) { return rn_add(a, b); });
}

}  // namespace

Status norm_rows_check(const NormRows& r) {
  if (r.kind != NormKind::kLayerNorm && r.kind != NormKind::kRmsNorm)
    return bad("unknown norm kind " + std::to_string(int(r.kind)));
  if (element_size(r.io) == 0) return bad("unknown io dtype " + std::to_string(int(r.io)));
  if (r.rows < 0) return bad("rows " + std::to_string(r.rows) + " must be >= 0");
  if (r.width < 1) return bad("width " + std::to_string(r.width) + " must be >= 1");
  return Status::success();
}

template <typename Acc>
Status add_norm_forward_check(const NormRows& r, const AddNormForwardArgs<Acc>& a) {
  if (Status s = norm_rows_check(r); !s.ok()) return s;
  if (!(a.eps >= Acc(0)) || !std::isfinite(a.eps))
    return bad("eps " + std::to_string(double(a.eps)) + " must be finite and >= 0");
  if (a.bias && r.kind == NormKind::kRmsNorm) return bad("RMSNorm takes no bias");
  if (r.rows == 0) return Status::success();
  if (!a.residual || !a.weight || !a.normed || !a.rstd)
    return bad("forward: residual, weight, normed and rstd must not be null");
  if (!a.mean && r.kind == NormKind::kLayerNorm) return bad("forward: LayerNorm needs mean");
  if (a.branch && !a.sum) return bad("forward: a branch needs sum (where residual + branch goes)");
  return Status::success();
}

template <typename Acc>
Status add_norm_backward_check(const NormRows& r, const AddNormBackwardArgs<Acc>& a) {
  if (Status s = norm_rows_check(r); !s.ok()) return s;
  if (r.rows == 0) return Status::success();
  if (!a.sum || !a.weight || !a.rstd || !a.grad_normed || !a.grad_input)
    return bad("backward: sum, weight, rstd, grad_normed and grad_input must not be null");
  if (!a.mean && r.kind == NormKind::kLayerNorm) return bad("backward: LayerNorm needs mean");
  return Status::success();
}

template <typename Acc>
Status norm_weight_grad_check(const NormRows& r, const NormWeightGradArgs<Acc>& a) {
  if (Status s = norm_rows_check(r); !s.ok()) return s;
  if (a.slices < 1) return bad("slices " + std::to_string(a.slices) + " must be >= 1");
  if (!a.weight_partial) return bad("weight grad: weight_partial must not be null");
  if (a.bias_partial && r.kind == NormKind::kRmsNorm) return bad("RMSNorm takes no bias");
  if (r.rows > 0 && (!a.sum || !a.rstd || !a.grad_normed))
    return bad("weight grad: sum, rstd and grad_normed must not be null");
  if (r.rows > 0 && !a.mean && r.kind == NormKind::kLayerNorm)
    return bad("weight grad: LayerNorm needs mean");
  return Status::success();
}

template <typename Acc>
Status add_norm_forward_host(const NormRows& r, const AddNormForwardArgs<Acc>& a, int64_t row_begin,
                             int64_t row_end) {
  if (Status s = check_acc<Acc>(r); !s.ok()) return s;
  if (Status s = add_norm_forward_check(r, a); !s.ok()) return s;
  const bool layer = r.kind == NormKind::kLayerNorm;
  const Acc width = Acc(r.width);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t base = row * r.width;
    const Acc* in = a.branch ? a.sum + base : a.residual + base;
    Acc lanes[32];
    for (int l = 0; l < 32; ++l) {
      Acc first = 0;
      for (int64_t j = l; j < r.width; j += 32) {
        Acc v = a.residual[base + j];
        if (a.branch) {
          v = rn_add(v, load_element<Acc>(r.io, a.branch, base + j));
          a.sum[base + j] = v;
        }
        first = rn_add(first, layer ? v : rn_mul(v, v));
      }
      lanes[l] = first;
    }
    const Acc first = lane_sum(lanes);
    Acc mean = 0, moment = first;
    if (layer) {
      mean = rn_div(first, width);
      for (int l = 0; l < 32; ++l) {
        Acc second = 0;
        for (int64_t j = l; j < r.width; j += 32) {
          const Acc d = rn_sub(in[j], mean);
          second = rn_add(second, rn_mul(d, d));
        }
        lanes[l] = second;
      }
      moment = lane_sum(lanes);
    }
    const Acc rstd = norm_rstd(moment, width, a.eps);
    for (int64_t j = 0; j < r.width; ++j)
      store_element(r.io, a.normed, base + j,
                    norm_output(norm_xhat(r.kind, in[j], mean, rstd), a.weight[j],
                                a.bias != nullptr, a.bias ? a.bias[j] : Acc(0)));
    if (a.mean) a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  return Status::success();
}

template <typename Acc>
Status add_norm_backward_host(const NormRows& r, const AddNormBackwardArgs<Acc>& a,
                              int64_t row_begin, int64_t row_end) {
  if (Status s = check_acc<Acc>(r); !s.ok()) return s;
  if (Status s = add_norm_backward_check(r, a); !s.ok()) return s;
  const bool layer = r.kind == NormKind::kLayerNorm;
  const Acc width = Acc(r.width);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t base = row * r.width;
    const Acc* in = a.sum + base;
    const Acc mean = layer ? a.mean[row] : Acc(0), rstd = a.rstd[row];
    const auto gw_at = [&](int64_t j) {
      return rn_mul(load_element<Acc>(r.io, a.grad_normed, base + j), a.weight[j]);
    };
    Acc gw_lanes[32], gw_xhat_lanes[32];
    for (int l = 0; l < 32; ++l) {
      Acc sum_gw = 0, sum_gw_xhat = 0;
      for (int64_t j = l; j < r.width; j += 32) {
        const Acc gw = gw_at(j);
        sum_gw = rn_add(sum_gw, gw);
        sum_gw_xhat = rn_add(sum_gw_xhat, rn_mul(gw, norm_xhat(r.kind, in[j], mean, rstd)));
      }
      gw_lanes[l] = sum_gw;
      gw_xhat_lanes[l] = sum_gw_xhat;
    }
    const Acc mean_gw = layer ? rn_div(lane_sum(gw_lanes), width) : Acc(0);
    const Acc mean_gw_xhat = rn_div(lane_sum(gw_xhat_lanes), width);
    for (int64_t j = 0; j < r.width; ++j) {
      Acc dx = norm_input_grad(r.kind, gw_at(j), norm_xhat(r.kind, in[j], mean, rstd), rstd,
                               mean_gw, mean_gw_xhat);
      if (a.grad_sum) dx = rn_add(a.grad_sum[base + j], dx);
      a.grad_input[base + j] = dx;
      if (a.grad_branch) store_element(r.io, a.grad_branch, base + j, dx);
    }
  }
  return Status::success();
}

template <typename Acc>
Status norm_weight_grad_host(const NormRows& r, const NormWeightGradArgs<Acc>& a,
                             int64_t slice_begin, int64_t slice_end) {
  if (Status s = check_acc<Acc>(r); !s.ok()) return s;
  if (Status s = norm_weight_grad_check(r, a); !s.ok()) return s;
  const bool layer = r.kind == NormKind::kLayerNorm;
  const int64_t per = (r.rows + a.slices - 1) / a.slices;
  for (int64_t slice = slice_begin; slice < slice_end; ++slice) {
    const int64_t end = (slice + 1) * per < r.rows ? (slice + 1) * per : r.rows;
    for (int64_t col = 0; col < r.width; ++col) {
      Acc gw = 0, gb = 0;
      for (int64_t row = slice * per; row < end; ++row) {
        const int64_t i = row * r.width + col;
        const Acc gn = load_element<Acc>(r.io, a.grad_normed, i);
        const Acc xhat = norm_xhat(r.kind, a.sum[i], layer ? a.mean[row] : Acc(0), a.rstd[row]);
        gw = rn_add(gw, rn_mul(gn, xhat));
        gb = rn_add(gb, gn);
      }
      a.weight_partial[slice * r.width + col] = gw;
      if (a.bias_partial) a.bias_partial[slice * r.width + col] = gb;
    }
  }
  return Status::success();
}

#define LOOM_ADD_NORM_INSTANTIATE(Acc)                                                            \
  template Status add_norm_forward_check<Acc>(const NormRows&, const AddNormForwardArgs<Acc>&);   \
  template Status add_norm_backward_check<Acc>(const NormRows&, const AddNormBackwardArgs<Acc>&); \
  template Status norm_weight_grad_check<Acc>(const NormRows&, const NormWeightGradArgs<Acc>&);   \
  template Status add_norm_forward_host<Acc>(const NormRows&, const AddNormForwardArgs<Acc>&,     \
                                             int64_t, int64_t);                                   \
  template Status add_norm_backward_host<Acc>(const NormRows&, const AddNormBackwardArgs<Acc>&,   \
                                              int64_t, int64_t);                                  \
  template Status norm_weight_grad_host<Acc>(const NormRows&, const NormWeightGradArgs<Acc>&,     \
                                             int64_t, int64_t);
LOOM_ADD_NORM_INSTANTIATE(float)
LOOM_ADD_NORM_INSTANTIATE(double)
#undef LOOM_ADD_NORM_INSTANTIATE

}  // namespace loom::kernels
