#pragma once
// The tensor-parallel group a model is sharded over: its communicator (none at tp = 1, where
// every parallel layer runs as its plain twin with no collective), whether sequence
// parallelism is on, how the vocabulary is padded, and a count of what the TP collectives move.
#include <cstdint>
#include <memory>

#include "loom/dist/communicator.h"
#include "loom/ops/dropout.h"

namespace loom::parallel::tensor {

struct TpOptions {
  // Norms, dropout and residual adds run on 1/tp of the sequence; the all-reduces of the
  // tensor-parallel regions become all-gather + reduce-scatter.
  bool sequence_parallel = false;
  // The vocabulary is padded up to a multiple of pad_vocab_multiple * tp (padded rows are
  // zero and masked out of the loss; they never appear in checkpoints or exports).
  int64_t pad_vocab_multiple = 1;
};

// Elements moved by the TP collectives since the last reset, counted as the size of the full
// (unsharded) tensor each op reduces or assembles: an all-reduce of a [b, s, h] activation
// counts b*s*h, and so do the all-gather producing it and the reduce-scatter consuming it.
struct TpCommStats {
  int64_t all_reduce_elements = 0;
  int64_t all_gather_elements = 0;
  int64_t reduce_scatter_elements = 0;
  // The vocabulary-parallel cross-entropy's all-reduces: 3 fp32 values per token (row max, sum
  // of exponentials, target logit).
  int64_t loss_elements = 0;
  int64_t ops = 0;
  int64_t bytes = 0;  // all of the above, times the element size

  // Elements moved for activations (everything but the loss).
  int64_t activation_elements() const {
    return all_reduce_elements + all_gather_elements + reduce_scatter_elements;
  }
  void reset() { *this = TpCommStats{}; }
};

class TpGroup {
 public:
  // comm null or of size 1: tp = 1. Throws loom::Error for pad_vocab_multiple < 1.
  explicit TpGroup(dist::CommunicatorPtr comm = nullptr, TpOptions options = {});

  int64_t size() const { return comm_ ? comm_->size() : 1; }
  int64_t rank() const { return comm_ ? comm_->rank() : 0; }
  // The communicator of the group; null at tp = 1.
  dist::Communicator* comm() const { return comm_.get(); }
  const dist::CommunicatorPtr& comm_ptr() const { return comm_; }
  const TpOptions& options() const { return options_; }
  // Sequence parallelism in effect (asked for, and tp > 1).
  bool sequence_parallel() const { return options_.sequence_parallel && size() > 1; }

  // vocab rounded up to a multiple of pad_vocab_multiple * tp.
  int64_t padded_vocab(int64_t vocab) const;

  TpCommStats& stats() { return stats_; }
  const TpCommStats& stats() const { return stats_; }

  // Where every dropout of the model takes its masks' position from (ops/dropout.h): the run's
  // seed and the micro-batch being run. Counter-based masks need no shared generator state, so
  // ranks agree as long as they are given the same seed and position (the runtime sets both).
  ops::DropoutStream& dropout() const { return *dropout_; }
  const std::shared_ptr<ops::DropoutStream>& dropout_stream() const { return dropout_; }

 private:
  dist::CommunicatorPtr comm_;
  TpOptions options_;
  TpCommStats stats_;
  std::shared_ptr<ops::DropoutStream> dropout_ = std::make_shared<ops::DropoutStream>();
};

using TpGroupPtr = std::shared_ptr<TpGroup>;

}  // namespace loom::parallel::tensor
