#pragma once
// `--attention auto` by measurement: for each shape class on a device, loom's own kernel (the
// fused CUDA kernel; on the CPU loom's CPU kernel) or PyTorch's SDPA, whichever ran a forward
// and backward of that shape faster, timed once on random inputs of the same shape and dtype the
// first time the class is seen, logged with both times, and kept: in memory, and in a JSON file
// when given one, so that a resumed run makes the same choices (and computes the same numbers)
// without timing again. Thread-safe. The timing uses a generator of its own (the run's random
// streams do not move) and leaves autocast as it found it, whatever happens.
//
// A shape class is the device's name, the dtype, batch, query and key/value heads, query and
// key lengths, head dim and causality: a training run meets a handful. The Trainer gives the
// models one on a GPU with --attention auto (docs/gpu.md); without one, auto follows its fixed
// rule (ops/attention.h).
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "loom/ops/attention.h"

namespace loom::ops {

class AttentionChooser {
 public:
  struct Entry {
    AttentionBackend choice = AttentionBackend::kFused;  // kFused (loom's kernel) or kSdpa
    double fused_ms = 0;
    double sdpa_ms = 0;
  };
  // Milliseconds for one forward and backward of `backend` (kFused: loom's kernel) on inputs
  // like q, k, v. The default makes its own random inputs and takes the median of 5 timed runs
  // after 2 warm-ups, synchronizing a GPU; tests pass their own.
  using Timer =
      std::function<double(AttentionBackend backend, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, bool causal, double scale)>;

  // `cache_path` empty: choices kept in memory only. With `read_existing`, a file that exists is
  // read (one that cannot be parsed is ignored with a warning and its choices measured again);
  // each new choice is written back atomically (over an existing file not read).
  explicit AttentionChooser(std::string cache_path = {}, Timer timer = {},
                            bool read_existing = true);

  // kFused or kSdpa for these inputs: the recorded choice for their class, or measured now.
  AttentionBackend choose(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          bool causal, double scale);

  // The shape class of these inputs, as entries() keys it.
  static std::string shape_class(const at::Tensor& q, const at::Tensor& k, bool causal);
  std::map<std::string, Entry> entries() const;
  const std::string& cache_path() const { return cache_path_; }

 private:
  void save() const;  // caller holds mutex_

  std::string cache_path_;
  Timer timer_;
  mutable std::mutex mutex_;
  std::map<std::string, Entry> entries_;
};

}  // namespace loom::ops
