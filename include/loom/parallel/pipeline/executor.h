#pragma once
// Runs a pipeline schedule on one pipeline rank: for each action it receives what the action
// needs from the neighbouring stage, runs the caller's forward or the autograd backward, and
// sends the result on. Activations travel forward and their gradients backward point to point;
// sends are asynchronous (a rank blocks only on what it receives), so any schedule `simulate`
// accepts runs without deadlock.
//
// The messages travel on channels built for NCCL's rules, and used the same way on every
// backend so the CPU tests run the GPU's logic: NCCL has no tags (messages between two ranks
// arrive in the order they were sent), and a send may not finish before its receive is posted,
// while ops on one communicator run one after another. So each direction between two
// neighbouring ranks gets a communicator of its own (a send stuck waiting for its receiver never
// holds up a receive), its messages go untagged, and the receiver takes them in the order the
// sender sends them: it knows that order from the sender's schedule, and keeps a message that
// arrives before it is needed (an interleaved schedule's activations and gradients share a
// channel when pp is 2). Every message's header names it, and the receiver checks the name.
//
// A received activation is a leaf that requires grad: the stage's backward leaves the gradient
// to send back in its .grad. The stage's own output is kept only until its backward, so a rank
// holds exactly the micro-batches the schedule has in flight.
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <vector>

#include "loom/dist/communicator.h"
#include "loom/parallel/pipeline/activation_codec.h"
#include "loom/parallel/pipeline/schedule.h"

namespace loom::parallel::pipeline {

// What one run of the schedule did on this rank.
struct PipelineStats {
  double seconds = 0;          // the whole run
  double wait_seconds = 0;     // blocked receiving activations or gradients (the bubble)
  double forward_seconds = 0;  // in the caller's forwards
  double backward_seconds = 0;
  int64_t max_in_flight = 0;  // most (micro-batch, chunk) pairs forwarded, not yet backwarded
  int64_t messages_sent = 0;
  double bytes_sent = 0;  // activations and their gradients as sent (headers not counted)
  // What those tensors take in their own dtypes: bytes_sent / this is what the codec saved.
  double uncompressed_bytes = 0;
  // Messages received before the action that needs them (kept until it runs): the channel's
  // order differed from this rank's order of use.
  int64_t messages_received_early = 0;
  // Last stage only: the value of each micro-batch's forward (its loss), by micro-batch.
  std::vector<double> outputs;
  // This rank's idle share of its own run: wait_seconds / seconds. It leaves out the time a
  // rank that finishes early waits for the step's slowest rank (the theory's bubble counts it),
  // so it reads below (p - 1) / (m + p - 1); loom-bench-pipeline measures the step's bubble.
  double bubble_fraction() const { return seconds > 0 ? wait_seconds / seconds : 0.0; }
};

class PipelineExecutor {
 public:
  // comm: the pipeline communicator (its rank is the pipeline rank, its size pp). `device`:
  // where received activations and gradients (and the message headers) are allocated: the
  // stages' device, one the communicator's backend takes. Collective over `comm` (it splits the
  // channels off it): every pipeline rank constructs its executor at the same point.
  // `codec`: how activations and their gradients cross the stage boundaries
  // (activation_codec.h; --compress-activations).
  PipelineExecutor(dist::CommunicatorPtr comm, PipelineShape shape, SchedulePtr schedule,
                   at::Device device = at::kCPU, ActivationCodec codec = ActivationCodec::kNone);

  // Runs chunk `chunk` forward on micro-batch `micro_batch`. `input` is undefined on the first
  // stage (which reads its own tokens) and the received activation elsewhere. The first stages
  // return their output activation; the last stage returns the scalar to backpropagate (the
  // micro-batch's loss, already scaled as the caller wants its gradients).
  using ForwardFn =
      std::function<at::Tensor(int64_t chunk, int64_t micro_batch, const at::Tensor& input)>;
  // Called just before / just after the backward of (chunk, micro_batch): e.g. to turn gradient
  // synchronization on for a chunk's last micro-batch, and to finish it.
  using BackwardHook = std::function<void(int64_t chunk, int64_t micro_batch)>;

  // One training step: the schedule's forwards and backwards.
  PipelineStats run(const ForwardFn& forward, const BackwardHook& before_backward = {},
                    const BackwardHook& after_backward = {});
  // Forwards only (evaluation; run it under torch::NoGradGuard): `micro_batches` micro-batches
  // (any number, 0 included) through every stage, nothing kept for backward.
  PipelineStats run_forward(const ForwardFn& forward, int64_t micro_batches);

  const PipelineShape& shape() const { return shape_; }
  ActivationCodec codec() const { return codec_; }
  const Schedule& schedule() const { return *schedule_; }
  int64_t rank() const { return comm_->rank(); }
  // Whether this rank holds the first / last global stage.
  bool has_first_stage() const { return rank() == 0; }
  bool has_last_stage() const { return rank() == shape_.ranks - 1; }

 private:
  PipelineStats execute(const std::vector<Action>& actions, const ForwardFn& forward,
                        const BackwardHook& before_backward, const BackwardHook& after_backward,
                        bool forward_only, int64_t micro_batches);
  // A message's name: the boundary it crosses (edge s: between stages s and s + 1), the
  // micro-batch and the direction; unique within one run.
  int64_t message_id(int64_t micro_batch, int64_t edge, bool gradient) const;
  void send(const at::Tensor& t, int64_t to_stage, int64_t id, PipelineStats& stats);
  at::Tensor receive(int64_t from_stage, int64_t id, PipelineStats& stats);
  // The order in which the peer of each inbound channel sends this rank its messages, when
  // every rank runs `actions_of(rank)`; resets the channels for a run.
  void start_run(const std::function<std::vector<Action>(int64_t rank)>& actions_of,
                 bool forward_only);
  void build_channels();

  struct Inbound {
    dist::CommunicatorPtr comm;           // two ranks: the sender is rank 0
    std::vector<int64_t> order;           // message ids in the sender's order, for this run
    size_t next = 0;                      // the next one to come off the channel
    std::map<int64_t, at::Tensor> early;  // received, not yet needed
  };
  std::map<int64_t, dist::CommunicatorPtr> outbound_;  // by peer pipeline rank; I am rank 0
  std::map<int64_t, Inbound> inbound_;                 // by peer pipeline rank

  dist::CommunicatorPtr comm_;
  PipelineShape shape_;
  SchedulePtr schedule_;
  at::Device device_;
  ActivationCodec codec_;
  std::vector<Action> actions_;  // this rank's, checked at construction
  std::vector<dist::WorkPtr> pending_sends_;
};

}  // namespace loom::parallel::pipeline
