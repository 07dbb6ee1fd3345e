#pragma once
// Dropout whose mask is a pure function of where an element sits in the logical tensor (kernels
// layer: raw pointers and a stream, no LibTorch). The draw for element (sample s, a, b, column c)
// of a logical [samples, A, B, C] tensor is word c % 4 of
//     Philox4x32-10(counter = {c / 4, a * B + b, s, site}, key = {key[0], key[1]})
// and the element is dropped when that 32-bit word is below drop_below (= p * 2^32), kept and
// multiplied by scale (= 1 / (1 - p)) otherwise. Nothing is stored between forward and backward
// (the backward applies the same function to the gradient), and the mask does not depend on which
// slice of the logical tensor a rank holds, on the device, or on the order elements are visited:
// the CPU and the GPU, one process and any tensor/sequence/data-parallel split draw alike.
//
// The host reference (dropout_host) walks rows in order; the CUDA kernel (dropout_apply, built
// with LOOM_WITH_CUDA) gives each thread one group of four columns. Plain C++ can include this
// header: the only CUDA type it names is cudaStream_t, declared as the CUDA runtime declares it.
#include <cstdint>

#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

struct DropoutParams {
  uint32_t key[2] = {0, 0};  // the run's seed and the step, mixed (ops::DropoutStream)
  uint32_t site = 0;         // which dropout of the model (layer and place in it)
  uint32_t drop_below = 0;   // dropout_threshold(p)
  double scale = 1.0;        // 1 / (1 - p)
  // The local tensor, contiguous, seen as [size[0], size[1], size[2], size[3]]: its element
  // (i0, i1, i2, i3) is element (i0 + offset[0], ..., i3 + offset[3]) of the logical tensor,
  // whose sizes are logical[0..3] (dimension 0: samples, numbered across the whole batch).
  int64_t size[4] = {1, 1, 1, 1};
  int64_t offset[4] = {0, 0, 0, 0};
  int64_t logical[4] = {1, 1, 1, 1};

  int64_t rows() const { return size[0] * size[1] * size[2]; }
  int64_t numel() const { return rows() * size[3]; }
};

// p * 2^32 rounded down: the draws below it are dropped. p must be in [0, 1).
uint32_t dropout_threshold(double p);

// The checks both implementations make: sizes and offsets non-negative, every slice inside the
// logical tensor, and the logical sizes within what the counter holds (samples and A * B below
// 2^32, columns below 2^34).
Status dropout_check(const DropoutParams& params);

// Host reference, rows [row_begin, row_end) of the [size[0] * size[1] * size[2], size[3]] view:
// y = x * mask, or the mask itself (scale or 0) when x is null. x and y may alias. Callers check
// the params first (dropout_check); T is float or double (the product is taken in T).
template <typename T>
void dropout_host(const T* x, T* y, const DropoutParams& params, int64_t row_begin,
                  int64_t row_end);

enum class DropoutDtype { kFloat32, kFloat64, kBFloat16, kFloat16 };

// The same on the GPU: device pointers, contiguous, of element type `dtype` (bf16 and fp16
// multiply in fp32 and round once). x null: writes the mask. Asynchronous on `stream`; the status
// covers the checks and the launch. At most `max_blocks` blocks of 256 threads (0: 65535), each
// thread looping over the groups beyond the grid.
Status dropout_apply(DropoutDtype dtype, const void* x, void* y, const DropoutParams& params,
                     cudaStream_t stream, int64_t max_blocks = 0);

}  // namespace loom::kernels
