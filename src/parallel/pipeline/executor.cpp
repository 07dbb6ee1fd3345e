#include "loom/parallel/pipeline/executor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <map>
#include <utility>

#include "loom/core/error.h"

namespace loom::parallel::pipeline {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A message is a fixed header (rank, dtype, sizes), then the tensor: the receiver allocates
// from the header, so stages may send any shape (sequence-parallel chunks, a last micro-batch
// of another size).
constexpr int64_t kMaxDims = 6;

}  // namespace

PipelineExecutor::PipelineExecutor(dist::CommunicatorPtr comm, PipelineShape shape,
                                   SchedulePtr schedule, at::Device device)
    : comm_(std::move(comm)), shape_(shape), schedule_(std::move(schedule)), device_(device) {
  LOOM_CHECK(comm_ && schedule_, "PipelineExecutor needs a communicator and a schedule");
  LOOM_CHECK(comm_->size() == shape_.ranks,
             "the pipeline communicator has {} ranks but the pipeline shape has pp {}",
             comm_->size(), shape_.ranks);
  // Every rank checks the whole schedule (cheap), so a broken one fails everywhere alike before
  // any message is sent.
  simulate(*schedule_, shape_);
  actions_ = schedule_->actions(comm_->rank(), shape_);
}

int PipelineExecutor::tag_of(int64_t micro_batch, int64_t edge, bool gradient) const {
  // Named by the boundary the message crosses (edge s: between stages s and s + 1), so sender
  // and receiver agree. Distinct per message in flight between two ranks; wraps below MPI's
  // guaranteed tag bound (32767), far beyond the micro-batches any schedule keeps in flight.
  const int64_t id = (micro_batch * shape_.stages() + edge) * 2 + (gradient ? 1 : 0);
  return static_cast<int>(id % 32000);
}

void PipelineExecutor::send(const at::Tensor& t, int64_t to_stage, int tag, PipelineStats& stats) {
  LOOM_CHECK(t.defined() && t.dim() <= kMaxDims,
             "pipeline stage output must be a tensor of at most {} dimensions; got {}", kMaxDims,
             t.defined() ? std::to_string(t.dim()) + " dimensions" : "an undefined tensor");
  auto header = at::zeros({kMaxDims + 2}, at::kLong);
  auto h = header.accessor<int64_t, 1>();
  h[0] = t.dim();
  h[1] = static_cast<int64_t>(t.scalar_type());
  for (int64_t d = 0; d < t.dim(); ++d) h[d + 2] = t.size(d);
  const int peer = static_cast<int>(shape_.rank_of(to_stage));
  auto body = t.detach().contiguous();
  pending_sends_.push_back(comm_->send_async(header.to(device_), peer, tag));
  pending_sends_.push_back(comm_->send_async(body, peer, tag));
  ++stats.messages_sent;
  stats.bytes_sent += static_cast<double>(body.numel() * body.element_size());
  // Let go of the buffers of sends that have completed.
  std::erase_if(pending_sends_, [](const dist::WorkPtr& w) { return w->is_completed(); });
}

at::Tensor PipelineExecutor::receive(int64_t from_stage, int tag, PipelineStats& stats) {
  const auto start = Clock::now();
  const int peer = static_cast<int>(shape_.rank_of(from_stage));
  auto header = at::zeros({kMaxDims + 2}, at::TensorOptions(at::kLong).device(device_));
  comm_->recv(header, peer, tag);
  header = header.cpu();
  auto h = header.accessor<int64_t, 1>();
  std::vector<int64_t> sizes;
  for (int64_t d = 0; d < h[0]; ++d) sizes.push_back(h[d + 2]);
  auto t = at::empty(sizes, at::TensorOptions(static_cast<at::ScalarType>(h[1])).device(device_));
  comm_->recv(t, peer, tag);
  stats.wait_seconds += since(start);
  return t;
}

PipelineStats PipelineExecutor::run(const ForwardFn& forward, const BackwardHook& before,
                                    const BackwardHook& after) {
  return execute(actions_, forward, before, after, false, shape_.micro_batches);
}

PipelineStats PipelineExecutor::run_forward(const ForwardFn& forward, int64_t micro_batches) {
  LOOM_CHECK(micro_batches >= 0, "run_forward: {} micro-batches", micro_batches);
  if (micro_batches == 0) return {};
  auto shape = shape_;
  shape.micro_batches = micro_batches;
  return execute(forward_only_actions(shape), forward, {}, {}, true, micro_batches);
}

PipelineStats PipelineExecutor::execute(const std::vector<Action>& actions,
                                        const ForwardFn& forward, const BackwardHook& before,
                                        const BackwardHook& after, bool forward_only,
                                        int64_t micro_batches) {
  LOOM_CHECK(forward, "PipelineExecutor: no forward function");
  const auto start = Clock::now();
  const int64_t last_stage = shape_.stages() - 1;
  PipelineStats stats;
  stats.outputs.assign(static_cast<size_t>(micro_batches), 0.0);
  // What a micro-batch's backward needs: the activation received (for its gradient) and the
  // stage's output (the root of its backward).
  struct InFlight {
    at::Tensor input, output;
  };
  std::map<std::pair<int64_t, int64_t>, InFlight> live;
  for (const auto& a : actions) {
    const int64_t stage = shape_.stage_of(rank(), a.chunk);
    if (a.kind == Action::Kind::kForward) {
      at::Tensor input;
      if (stage > 0) {
        input = receive(stage - 1, tag_of(a.micro_batch, stage - 1, false), stats);
        if (!forward_only && at::isFloatingType(input.scalar_type())) input.requires_grad_(true);
      }
      const auto t0 = Clock::now();
      auto output = forward(a.chunk, a.micro_batch, input);
      stats.forward_seconds += since(t0);
      if (stage == last_stage) {
        LOOM_CHECK(output.defined() && output.numel() == 1,
                   "the last pipeline stage's forward must return its scalar loss; got {}",
                   output.defined() ? dist::describe_tensor(output) : "an undefined tensor");
        stats.outputs[static_cast<size_t>(a.micro_batch)] = output.detach().item<double>();
      } else {
        send(output, stage + 1, tag_of(a.micro_batch, stage, false), stats);
      }
      if (!forward_only) {
        live[{a.micro_batch, a.chunk}] = {input, output};
        stats.max_in_flight = std::max<int64_t>(stats.max_in_flight, live.size());
      }
      continue;
    }
    auto it = live.find({a.micro_batch, a.chunk});
    LOOM_CHECK(it != live.end(), "pipeline: {} before its forward", to_string(a));
    if (before) before(a.chunk, a.micro_batch);
    const auto t0 = Clock::now();
    if (stage == last_stage) {
      it->second.output.backward();
    } else {
      auto grad = receive(stage + 1, tag_of(a.micro_batch, stage, true), stats);
      const auto t1 = Clock::now();
      torch::autograd::backward({it->second.output}, {grad});
      stats.backward_seconds += since(t1);
    }
    if (stage == last_stage) stats.backward_seconds += since(t0);
    if (stage > 0) {
      const auto& input = it->second.input;
      // An activation the stage did not use gets a zero gradient: the sender still waits for
      // one.
      auto grad = input.grad().defined() ? input.grad() : at::zeros_like(input);
      send(grad, stage - 1, tag_of(a.micro_batch, stage - 1, true), stats);
    }
    live.erase(it);  // the micro-batch's activations of this chunk can go now
    // After the gradient is on its way: the previous stage need not wait for this hook.
    if (after) after(a.chunk, a.micro_batch);
  }
  LOOM_CHECK(live.empty() || forward_only, "pipeline: {} micro-batches never ran backward",
             live.size());
  for (auto& w : pending_sends_) w->wait();
  pending_sends_.clear();
  stats.seconds = since(start);
  return stats;
}

}  // namespace loom::parallel::pipeline
