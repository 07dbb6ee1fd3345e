#include "loom/parallel/pipeline/executor.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
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

// A message is a fixed header (its id, number of dimensions, dtype, the codec it was sent with,
// sizes), then the tensor's parts under that codec (activation_codec.h): the receiver allocates
// from the header, so stages may send any shape (sequence-parallel chunks, a last micro-batch of
// another size).
constexpr int64_t kMaxDims = 6;
constexpr int64_t kSizesAt = 4;
constexpr int64_t kHeaderLength = kMaxDims + kSizesAt;

}  // namespace

PipelineExecutor::PipelineExecutor(dist::CommunicatorPtr comm, PipelineShape shape,
                                   SchedulePtr schedule, at::Device device, ActivationCodec codec)
    : comm_(std::move(comm)),
      shape_(shape),
      schedule_(std::move(schedule)),
      device_(device),
      codec_(codec) {
  LOOM_CHECK(comm_ && schedule_, "PipelineExecutor needs a communicator and a schedule");
  LOOM_CHECK(comm_->size() == shape_.ranks,
             "the pipeline communicator has {} ranks but the pipeline shape has pp {}",
             comm_->size(), shape_.ranks);
  // Every rank checks the whole schedule (cheap), so a broken one fails everywhere alike before
  // any message is sent.
  simulate(*schedule_, shape_);
  actions_ = schedule_->actions(comm_->rank(), shape_);
  build_channels();
}

void PipelineExecutor::build_channels() {
  const int64_t n = shape_.ranks, me = comm_->rank();
  if (n == 1) return;
  // Neighbouring ranks r and r + 1 are linked; the last and the first too when chunks wrap
  // around (virtual stages), which for pp 2 is the same pair. Each link gets one communicator
  // per direction. The links are coloured so that no rank is in two links of one colour (a ring
  // of odd length needs a third colour), and each (colour, direction) is one split of the
  // pipeline group, the same sequence of splits on every rank.
  const bool wraps = shape_.virtual_stages > 1 && n > 2;
  const int64_t links = wraps ? n : n - 1;
  const auto colour = [&](int64_t link) -> int64_t {
    return wraps && n % 2 == 1 && link == n - 1 ? 2 : link % 2;
  };
  const int64_t colours = wraps && n % 2 == 1 ? 3 : (links > 1 ? 2 : 1);
  for (int64_t c = 0; c < colours; ++c) {
    for (int direction = 0; direction < 2; ++direction) {
      // My link of this colour, if any: link l joins ranks l and (l + 1) % n.
      int64_t link = -1;
      for (const int64_t l : {me, (me + n - 1) % n})
        if (l < links && colour(l) == c) link = l;
      int split_colour = -1, key = 0;
      int64_t peer = -1;
      bool sender = false;
      if (link >= 0) {
        const int64_t first = link, second = (link + 1) % n;
        const int64_t from = direction == 0 ? first : second;
        sender = me == from;
        peer = me == first ? second : first;
        split_colour = static_cast<int>(link);
        key = sender ? 0 : 1;
      }
      auto channel =
          comm_->split(split_colour, key,
                       fmt::format("{}.{}{}", comm_->name(), direction == 0 ? "fwd" : "bwd", link));
      if (link < 0) continue;
      if (sender)
        outbound_[peer] = channel;
      else
        inbound_[peer].comm = channel;
    }
  }
}

int64_t PipelineExecutor::message_id(int64_t micro_batch, int64_t edge, bool gradient) const {
  return (micro_batch * shape_.stages() + edge) * 2 + (gradient ? 1 : 0);
}

void PipelineExecutor::start_run(const std::function<std::vector<Action>(int64_t rank)>& actions_of,
                                 bool forward_only) {
  const int64_t last_stage = shape_.stages() - 1;
  for (auto& [peer, in] : inbound_) {
    in.order.clear();
    in.next = 0;
    in.early.clear();
    // What `peer` sends, in its order; the ones addressed to this rank are this channel's.
    for (const auto& a : actions_of(peer)) {
      const int64_t stage = shape_.stage_of(peer, a.chunk);
      if (a.kind == Action::Kind::kForward && stage < last_stage) {
        if (shape_.rank_of(stage + 1) == rank())
          in.order.push_back(message_id(a.micro_batch, stage, false));
      } else if (a.kind == Action::Kind::kBackward && !forward_only && stage > 0) {
        if (shape_.rank_of(stage - 1) == rank())
          in.order.push_back(message_id(a.micro_batch, stage - 1, true));
      }
    }
  }
}

void PipelineExecutor::send(const at::Tensor& t, int64_t to_stage, int64_t id,
                            PipelineStats& stats) {
  LOOM_CHECK(t.defined() && t.dim() <= kMaxDims,
             "pipeline stage output must be a tensor of at most {} dimensions; got {}", kMaxDims,
             t.defined() ? std::to_string(t.dim()) + " dimensions" : "an undefined tensor");
  const auto codec = codec_for(t.scalar_type(), codec_);
  auto header = at::zeros({kHeaderLength}, at::kLong);
  auto h = header.accessor<int64_t, 1>();
  h[0] = id;
  h[1] = t.dim();
  h[2] = static_cast<int64_t>(t.scalar_type());
  h[3] = static_cast<int64_t>(codec);
  for (int64_t d = 0; d < t.dim(); ++d) h[d + kSizesAt] = t.size(d);
  const auto peer = shape_.rank_of(to_stage);
  auto& channel = *outbound_.at(peer);
  pending_sends_.push_back(channel.send_async(header.to(device_), 1));
  for (auto& part : encode_activation(t, codec)) {
    stats.bytes_sent += static_cast<double>(part.numel() * part.element_size());
    pending_sends_.push_back(channel.send_async(part, 1));
  }
  ++stats.messages_sent;
  stats.uncompressed_bytes += static_cast<double>(t.numel() * t.element_size());
  // Let go of the buffers of sends that have completed.
  std::erase_if(pending_sends_, [](const dist::WorkPtr& w) { return w->is_completed(); });
}

at::Tensor PipelineExecutor::receive(int64_t from_stage, int64_t id, PipelineStats& stats) {
  const auto start = Clock::now();
  const auto peer = shape_.rank_of(from_stage);
  auto& in = inbound_.at(peer);
  at::Tensor out;
  if (auto it = in.early.find(id); it != in.early.end()) {
    out = std::move(it->second);
    in.early.erase(it);
  }
  while (!out.defined()) {
    LOOM_CHECK(in.next < in.order.size(),
               "pipeline: rank {} waits for message {} from rank {}, which that rank's schedule "
               "does not send it",
               rank(), id, peer);
    const int64_t expected = in.order[in.next++];
    auto header = at::zeros({kHeaderLength}, at::TensorOptions(at::kLong).device(device_));
    in.comm->recv(header, 0);
    header = header.cpu();
    auto h = header.accessor<int64_t, 1>();
    LOOM_CHECK(h[0] == expected,
               "pipeline: rank {} expected message {} from rank {} next and got message {}: the "
               "ranks disagree on the schedule",
               rank(), expected, peer, h[0]);
    LOOM_CHECK(h[1] >= 0 && h[1] <= kMaxDims && h[3] >= 0 &&
                   h[3] <= static_cast<int64_t>(ActivationCodec::kInt8),
               "pipeline: message {} from rank {} has a malformed header ({} dimensions, codec "
               "{})",
               h[0], peer, h[1], h[3]);
    std::vector<int64_t> sizes;
    for (int64_t d = 0; d < h[1]; ++d) sizes.push_back(h[d + kSizesAt]);
    const auto dtype = static_cast<at::ScalarType>(h[2]);
    const auto codec = static_cast<ActivationCodec>(h[3]);
    auto parts = activation_parts(sizes, dtype, codec, device_);
    for (auto& part : parts) in.comm->recv(part, 0);
    auto t = decode_activation(parts, sizes, dtype, codec);
    if (expected == id) {
      out = t;
    } else {
      in.early.emplace(expected, t);
      ++stats.messages_received_early;
    }
  }
  stats.wait_seconds += since(start);
  return out;
}

PipelineStats PipelineExecutor::run(const ForwardFn& forward, const BackwardHook& before,
                                    const BackwardHook& after) {
  start_run([&](int64_t r) { return schedule_->actions(r, shape_); }, false);
  return execute(actions_, forward, before, after, false, shape_.micro_batches);
}

PipelineStats PipelineExecutor::run_forward(const ForwardFn& forward, int64_t micro_batches) {
  LOOM_CHECK(micro_batches >= 0, "run_forward: {} micro-batches", micro_batches);
  if (micro_batches == 0) return {};
  auto shape = shape_;
  shape.micro_batches = micro_batches;
  const auto actions = forward_only_actions(shape);  // the same on every rank
  start_run([&](int64_t) { return actions; }, true);
  return execute(actions, forward, {}, {}, true, micro_batches);
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
        input = receive(stage - 1, message_id(a.micro_batch, stage - 1, false), stats);
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
        send(output, stage + 1, message_id(a.micro_batch, stage, false), stats);
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
      auto grad = receive(stage + 1, message_id(a.micro_batch, stage, true), stats);
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
      send(grad, stage - 1, message_id(a.micro_batch, stage - 1, true), stats);
    }
    live.erase(it);  // the micro-batch's activations of this chunk can go now
    // After the gradient is on its way: the previous stage need not wait for this hook.
    if (after) after(a.chunk, a.micro_batch);
  }
  LOOM_CHECK(live.empty() || forward_only, "pipeline: {} micro-batches never ran backward",
             live.size());
  for (const auto& [peer, in] : inbound_)
    LOOM_CHECK(in.next == in.order.size() && in.early.empty(),
               "pipeline: rank {} ends its run with {} messages from rank {} not used", rank(),
               in.order.size() - in.next + in.early.size(), peer);
  for (auto& w : pending_sends_) w->wait();
  pending_sends_.clear();
  stats.seconds = since(start);
  return stats;
}

}  // namespace loom::parallel::pipeline
