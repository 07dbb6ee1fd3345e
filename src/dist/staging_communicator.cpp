#include "loom/dist/staging_communicator.h"

#include <ATen/ATen.h>

#include <mutex>

#include "loom/core/error.h"

namespace loom::dist {

namespace {

// A host buffer shaped like `t` (pinned when `t` is on a GPU, so the copies run at full speed),
// holding t's values when `with_contents`.
at::Tensor host_copy(const at::Tensor& t, bool with_contents) {
  if (!t.defined()) return t;
  auto host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
  if (with_contents) host.copy_(t);
  return host;
}

// The wrapped op's work, plus the copy of its result back into the caller's tensor, done once by
// whoever first waits for it. Not started for the watchdog: the wrapped op is watched itself.
class StagedWork : public Work {
 public:
  StagedWork(OpInfo info, WorkPtr inner, at::Tensor target, at::Tensor staged)
      : Work(std::move(info)),
        inner_(std::move(inner)),
        target_(std::move(target)),
        staged_(std::move(staged)) {}

 protected:
  bool wait_until(std::optional<Clock::time_point> deadline) override {
    if (!inner_->wait_done(deadline)) return false;
    std::call_once(copied_, [&] {
      if (inner_->failure() || !target_.defined()) return;
      try {
        target_.copy_(staged_);
      } catch (...) {
        copy_error_ = std::current_exception();
      }
      staged_ = at::Tensor();  // the host buffer is not needed any more
    });
    return true;
  }
  bool test() override { return inner_->is_completed(); }
  std::exception_ptr error() const override {
    if (auto f = inner_->failure()) return std::make_exception_ptr(Error(*f));
    return copy_error_;
  }

 private:
  WorkPtr inner_;
  at::Tensor target_, staged_;
  std::once_flag copied_;
  std::exception_ptr copy_error_;
};

}  // namespace

StagingCommunicator::StagingCommunicator(CommunicatorPtr inner)
    : Communicator(inner->name(), inner->rank(), inner->size()), inner_(std::move(inner)) {
  take_family_place_of(*inner_);
  set_timeout(inner_->timeout());
  set_debug(false);  // the wrapped communicator runs the debug check on what it is given
}

std::shared_ptr<Communicator> StagingCommunicator::split(int color, int key,
                                                         const std::string& name) {
  auto sub = inner_->split(color, key, name);
  return sub ? in_family(std::make_shared<StagingCommunicator>(std::move(sub))) : nullptr;
}

WorkPtr StagingCommunicator::launch(Call call) {
  Communicator& c = *inner_;
  at::Tensor out;  // the host buffer the op writes, copied back into call.output on wait
  WorkPtr work;
  switch (call.kind()) {
    case OpKind::AllReduce:
      out = host_copy(call.output, true);
      work = c.all_reduce_async(out, call.reduce());
      break;
    case OpKind::ReduceScatter:
      out = host_copy(call.output, false);
      work = c.reduce_scatter_async(out, host_copy(call.input, true), call.reduce());
      break;
    case OpKind::AllGather:
      out = host_copy(call.output, false);
      work = c.all_gather_async(out, host_copy(call.input, true));
      break;
    case OpKind::Broadcast:
      out = host_copy(call.output, rank() == call.peer());  // only the root's values matter
      work = c.broadcast_async(out, call.peer());
      break;
    case OpKind::AllToAll:
      out = host_copy(call.output, false);
      work = c.all_to_all_async(out, host_copy(call.input, true));
      break;
    case OpKind::Barrier:
      work = c.barrier_async();
      break;
    case OpKind::Send:
      work = c.send_async(host_copy(call.input, true), call.peer(), call.tag());
      break;
    case OpKind::Recv:
      out = host_copy(call.output, false);
      work = c.recv_async(out, call.peer(), call.tag());
      break;
    case OpKind::Split:
      fail("staging: split is not an op to launch on group '{}'", name());
  }
  return std::make_shared<StagedWork>(std::move(call.info), std::move(work),
                                      out.defined() ? call.output : at::Tensor(), out);
}

}  // namespace loom::dist
