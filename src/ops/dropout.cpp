#include "loom/ops/dropout.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstring>

#include "dropout/dropout.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/core/rng.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::ops {

void DropoutStream::reseed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  position_ = DropoutPosition{.seed = seed};
}

void DropoutStream::set_micro_batch(int64_t step, int64_t first_sample) {
  LOOM_CHECK(step >= 0 && first_sample >= 0,
             "dropout position: step {} and first sample {} must be >= 0", step, first_sample);
  std::lock_guard<std::mutex> lock(mutex_);
  position_.step = step;
  position_.first_sample = first_sample;
}

DropoutPosition DropoutStream::position() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return position_;
}

void DropoutStream::restore(const DropoutPosition& position) {
  std::lock_guard<std::mutex> lock(mutex_);
  position_ = position;
}

uint32_t dropout_site(int64_t layer, DropoutPlace place) {
  constexpr int64_t kMaxLayer = (int64_t(1) << 30) - 2;
  LOOM_CHECK(layer >= -1 && layer <= kMaxLayer,
             "dropout site: layer {} must be in [-1, {}] (-1: before the first block)", layer,
             kMaxLayer);
  return uint32_t(layer + 1) * 4 + static_cast<uint32_t>(place);
}

DropoutSlice split_slice(at::IntArrayRef local_shape, int64_t dim, int64_t parts, int64_t index) {
  DropoutSlice slice{local_shape.vec(), std::vector<int64_t>(local_shape.size(), 0)};
  if (dim < 0 || parts <= 1) return slice;
  LOOM_CHECK(dim < static_cast<int64_t>(local_shape.size()) && index >= 0 && index < parts,
             "dropout slice: dim {} of a {}-dimensional tensor, part {} of {}", dim,
             local_shape.size(), index, parts);
  slice.logical[dim] *= parts;
  slice.offset[dim] = index * local_shape[dim];
  return slice;
}

namespace {

kernels::DropoutParams params_of(at::IntArrayRef shape, double p, const DropoutPosition& position,
                                 uint32_t site, const DropoutSlice& slice) {
  const auto n = static_cast<int64_t>(shape.size());
  LOOM_CHECK(n >= 1 && n <= 4,
             "dropout: a tensor of shape {} ({} dimensions); 1 to 4 are supported (dimension 0: "
             "samples)",
             shape, n);
  LOOM_CHECK(p >= 0 && p < 1, "dropout probability {} must be in [0, 1)", p);
  const bool whole = slice.logical.empty() && slice.offset.empty();
  LOOM_CHECK(whole || (static_cast<int64_t>(slice.logical.size()) == n &&
                       static_cast<int64_t>(slice.offset.size()) == n),
             "dropout: the slice has {} logical sizes and {} offsets for a tensor of shape {}",
             slice.logical.size(), slice.offset.size(), shape);
  LOOM_CHECK(position.first_sample >= 0 && position.step >= 0,
             "dropout position: step {} and first sample {} must be >= 0", position.step,
             position.first_sample);
  kernels::DropoutParams k;
  const uint64_t key = core::mix_seed(
      {position.seed, core::stable_hash("dropout step"), static_cast<uint64_t>(position.step)});
  k.key[0] = uint32_t(key);
  k.key[1] = uint32_t(key >> 32);
  k.site = site;
  k.drop_below = kernels::dropout_threshold(p);
  k.scale = 1.0 / (1.0 - p);
  // Dimension 0 stays the samples, the last becomes the columns, the others fill 1 and 2 from
  // the right (missing ones have size 1).
  for (int64_t d = 0; d < n; ++d) {
    const int64_t to = d == 0 ? 0 : 4 - (n - d);
    k.size[to] = shape[d];
    k.logical[to] = whole ? shape[d] : slice.logical[d];
    k.offset[to] = whole ? 0 : slice.offset[d];
  }
  // Samples are numbered across the global batch.
  k.offset[0] += position.first_sample;
  k.logical[0] += position.first_sample;
  const auto status = kernels::dropout_check(k);
  LOOM_CHECK(status.ok(), "{} (tensor shape {})", status.message, shape);
  return k;
}

// x * mask, or the mask (x undefined), as a new contiguous tensor of `shape` and `options`.
at::Tensor apply_dropout(const at::Tensor& x, at::IntArrayRef shape,
                         const at::TensorOptions& options,
                 const kernels::DropoutParams& k) {
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  LOOM_CHECK(at::isFloatingType(dtype), "dropout of a {} tensor: floating types only",
             c10::toString(dtype));
  auto out = at::empty(shape, options);
  if (out.numel() == 0) return out;
  const auto in = x.defined() ? x.contiguous() : at::Tensor();
  if (out.is_cuda()) {
#ifdef LOOM_WITH_CUDA
    const c10::cuda::CUDAGuard guard(out.device());
    auto kind = kernels::DropoutDtype::kFloat32;
    switch (dtype) {
      case at::kFloat: kind = kernels::DropoutDtype::kFloat32; break;
      case at::kDouble: kind = kernels::DropoutDtype::kFloat64; break;
      case at::kBFloat16: kind = kernels::DropoutDtype::kBFloat16; break;
      case at::kHalf: kind = kernels::DropoutDtype::kFloat16; break;
      default:
        LOOM_CHECK(false, "dropout on the GPU: dtype {} (float, double, bf16, fp16 only)",
                   c10::toString(dtype));
    }
    const auto status = kernels::dropout_apply(kind, in.defined() ? in.const_data_ptr() : nullptr,
                                               out.data_ptr(), k,
                                               c10::cuda::getCurrentCUDAStream().stream());
    LOOM_CHECK(status.ok(), "dropout kernel: {}", status.message);
    return out;
#else
    LOOM_CHECK(false, "dropout on {}: this loom was built without CUDA (LOOM_WITH_CUDA=OFF)",
               out.device().str());
#endif
  }
  LOOM_CHECK(out.device().is_cpu(), "dropout on {}: CPU and CUDA tensors only", out.device().str());
  if (dtype != at::kFloat && dtype != at::kDouble) {
    // bf16, fp16 on the CPU: the fp32 mask, multiplied in fp32 and rounded once, as the kernel.
    auto mask = apply_dropout(at::Tensor(), shape, options.dtype(at::kFloat), k);
    return (in.defined() ? in.to(at::kFloat) * mask : mask).to(dtype);
  }
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, k.size[3]));
  AT_DISPATCH_FLOATING_TYPES(dtype, "loom_dropout", [&] {
    const scalar_t* xp = in.defined() ? in.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = out.data_ptr<scalar_t>();
    at::parallel_for(0, k.rows(), grain, [&](int64_t begin, int64_t end) {
      kernels::dropout_host<scalar_t>(xp, yp, k, begin, end);
    });
  });
  return out;
}

// The params travel in the autograd context as integers (IValue has no place for a struct).
std::vector<int64_t> pack(const kernels::DropoutParams& k) {
  int64_t scale_bits;
  std::memcpy(&scale_bits, &k.scale, sizeof scale_bits);
  std::vector<int64_t> v{k.key[0], k.key[1], k.site, k.drop_below, scale_bits};
  for (int d = 0; d < 4; ++d) v.insert(v.end(), {k.size[d], k.offset[d], k.logical[d]});
  return v;
}

kernels::DropoutParams unpack(const std::vector<int64_t>& v) {
  kernels::DropoutParams k;
  k.key[0] = uint32_t(v[0]);
  k.key[1] = uint32_t(v[1]);
  k.site = uint32_t(v[2]);
  k.drop_below = uint32_t(v[3]);
  std::memcpy(&k.scale, &v[4], sizeof k.scale);
  for (int d = 0; d < 4; ++d) {
    k.size[d] = v[5 + 3 * d];
    k.offset[d] = v[6 + 3 * d];
    k.logical[d] = v[7 + 3 * d];
  }
  return k;
}

// Nothing is saved for backward but the params: the gradient gets the same mask, recomputed.
struct DropoutFunction : torch::autograd::Function<DropoutFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::vector<int64_t>& packed) {
    ctx->saved_data["params"] = packed;
    return apply_dropout(x, x.sizes(), x.options(), unpack(packed));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto k = unpack(ctx->saved_data["params"].toIntVector());
    const auto& g = grads[0];
    return {apply_dropout(g, g.sizes(), g.options(), k), at::Tensor()};
  }
};

}  // namespace

at::Tensor dropout(const at::Tensor& x, double p, const DropoutPosition& position, uint32_t site,
                   const DropoutSlice& slice) {
  const auto k = params_of(x.sizes(), p, position, site, slice);
  if (p == 0) return x;
  return DropoutFunction::apply(x, pack(k));
}

at::Tensor dropout_mask(at::IntArrayRef shape, const at::TensorOptions& options, double p,
                        const DropoutPosition& position, uint32_t site,
                        const DropoutSlice& slice) {
  const auto k = params_of(shape, p, position, site, slice);
  if (p == 0) return {};
  return apply_dropout(at::Tensor(), shape, options, k);
}

}  // namespace loom::ops
