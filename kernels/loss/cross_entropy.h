#pragma once
// Fused cross-entropy over rows of logits, in two passes that never materialise a softmax, a
// log-softmax or an fp32 copy of the logits (llm.c's fused classifier, split at the loss):
//
//   stats  (forward):  per row, one read of the logits: an online softmax gives the row's max m
//                      and sum of exp(x - m), and the target's logit where this row's target
//                      falls among the columns held here;
//   grad   (backward): per row, one read and one write: d loss / d x = (softmax(x) (1 + 2 z lse)
//                      - onehot(target)) * scale, written in the logits' own dtype, in place
//                      over the logits when the caller passes the same pointer.
//
// The loss itself (lse = m + log sum, minus the target's logit, plus z lse^2) and, for
// vocabulary-parallel shards, the max and sum reductions across ranks are a few operations on
// one value a row, done by the caller (ops/cross_entropy.h). A shard holds columns
// [col_offset, col_offset + valid) of the vocabulary; columns [valid, ld) of each row are
// padding: left out of the stats, their gradient 0. A row whose target is ignore_index gets a
// gradient of 0 (its stats are still computed; the caller leaves it out of the mean).
//
// Both passes give each thread of a CUDA block the same columns: chunks of `chunk` consecutive
// columns (16 bytes when rows are 16-byte aligned, else 1 element), chunk k to thread
// k mod kCrossEntropyThreads; each thread folds its values in column order, then the block's
// partials are combined by a butterfly over each warp's lanes, then over the warps. The host
// reference follows exactly that order (same partition, same combining tree), so on the CPU
// (the kernel emulation) kernel and reference agree bit for bit; on a GPU they differ only by
// expf's last bits. Accumulation is fp32 (fp64 for fp64 logits, host reference only).
#include <cstdint>

#include "common/element_dtype.h"
#include "common/status.h"

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace loom::kernels {

using LogitsDtype = ElementDtype;  // kFloat64: the host reference only

constexpr int kCrossEntropyThreads = 256;

struct CrossEntropyRows {
  LogitsDtype dtype = LogitsDtype::kFloat32;
  const void* logits = nullptr;  // [rows, ld], row-major
  int64_t rows = 0;
  int64_t ld = 0;          // elements per row in memory (the shard's columns, padding included)
  int64_t valid = 0;       // columns [0, valid) are vocabulary entries, [valid, ld) padding
  int64_t col_offset = 0;  // the vocabulary id of column 0 (vocabulary-parallel shards)
  const int64_t* targets = nullptr;  // [rows] vocabulary ids, or ignore_index
  int64_t ignore_index = -100;
};

// Per-row outputs of the stats pass, in the accumulation type (float; double for fp64 logits).
template <typename Acc>
struct CrossEntropyStats {
  Acc* row_max;       // m: the max over the row's valid columns (-inf when there are none)
  Acc* row_sum;       // sum of exp(x - m) over them
  Acc* target_logit;  // x[target - col_offset] when this shard holds the target, else 0
  Acc* target_found;  // 1 when it does, else 0 (summed over shards: 0 means no shard did)
};

// Inputs of the grad pass besides the rows.
template <typename Acc>
struct CrossEntropyGradArgs {
  const Acc* lse;    // [rows] the whole row's log-sum-exp (over every shard)
  const Acc* scale;  // one value: the upstream gradient over the rows in the mean (a device
                     // pointer for the kernel, so that no host sync is needed)
  Acc z_loss;        // weight of z lse^2 in the loss (0: none)
  void* grad;        // [rows, ld] in the logits' dtype; may equal rows.logits (in place)
};

// Shapes, pointers and dtype: an invalid-argument Status naming the field and what is valid.
Status cross_entropy_check(const CrossEntropyRows& rows);

// Columns per chunk: 16 bytes of elements when every row starts 16-byte aligned (the logits
// pointer and ld * element size), else 1. Kernel and reference use the same.
int cross_entropy_chunk(const CrossEntropyRows& rows);

// The host references, rows [row_begin, row_end). Acc is float for fp32/fp16/bf16 logits and
// double for fp64 ones (a mismatch is refused).
template <typename Acc>
Status cross_entropy_stats_host(const CrossEntropyRows& rows, const CrossEntropyStats<Acc>& out,
                                int64_t row_begin, int64_t row_end);
template <typename Acc>
Status cross_entropy_grad_host(const CrossEntropyRows& rows, const CrossEntropyGradArgs<Acc>& args,
                               int64_t row_begin, int64_t row_end);

// The CUDA kernels (fp32, fp16 and bf16 logits; device pointers): one CUDA block of
// kCrossEntropyThreads threads per row, blocks looping over rows past max_blocks (> 0; tests
// use a small cap to make them loop; <= 0: 65535).
Status cross_entropy_stats_apply(const CrossEntropyRows& rows, const CrossEntropyStats<float>& out,
                                 cudaStream_t stream, int64_t max_blocks = 0);
Status cross_entropy_grad_apply(const CrossEntropyRows& rows,
                                const CrossEntropyGradArgs<float>& args, cudaStream_t stream,
                                int64_t max_blocks = 0);

}  // namespace loom::kernels
