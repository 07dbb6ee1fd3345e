#include "loom/parallel/context/ring_attention.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/attention_partial.h"
#include "loom/ops/precision.h"

namespace loom::parallel::context {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kBlockTag = 71;  // key/value blocks
constexpr int kGradTag = 72;   // their gradients, in backward

// The group travels through autograd's saved data as an integer: the model that holds it
// outlives every graph built on it.
ContextGroup& unpack(int64_t group) {
  return *reinterpret_cast<ContextGroup*>(group);
}

// One transfer around the ring: `out` sent to the next rank while `in` arrives from the
// previous one, started now and finished by wait().
class RingTransfer {
 public:
  RingTransfer(ContextGroup& group, const at::Tensor& out, int tag) : group_(group) {
    auto& comm = *group.comm();
    const int n = comm.size(), r = comm.rank();
    in_ = at::empty_like(out);
    out_ = out;
    // Odd ranks receive first: a backend that runs point-to-point ops in issue order (NCCL on
    // its stream) would otherwise have every rank wait in its send for a receive queued behind
    // the neighbour's own send. MPI's non-blocking pairs do not care.
    if (r % 2 == 0) {
      send_ = comm.send_async(out_, (r + 1) % n, tag);
      recv_ = comm.recv_async(in_, (r + n - 1) % n, tag);
    } else {
      recv_ = comm.recv_async(in_, (r + n - 1) % n, tag);
      send_ = comm.send_async(out_, (r + 1) % n, tag);
    }
    group.stats().messages += 1;
    group.stats().bytes += out.numel() * static_cast<int64_t>(out.element_size());
  }
  at::Tensor wait() {
    const auto start = std::chrono::steady_clock::now();
    send_->wait();
    recv_->wait();
    group_.stats().wait_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return in_;
  }

 private:
  ContextGroup& group_;
  at::Tensor out_, in_;
  dist::WorkPtr send_, recv_;
};

// The block pairs of one ring step: this rank's query chunks against the chunks of the block
// that started on rank `origin`. A key chunk after a query chunk is skipped (masked entirely),
// the same chunk is the causal diagonal, an earlier one is attended to in full.
template <typename Fn>
void for_each_pair(const ContextGroup& group, int64_t origin, int64_t chunk, Fn fn) {
  const auto mine = group.chunks_of(group.rank());
  const auto theirs = group.chunks_of(origin);
  for (int64_t qi = 0; qi < 2; ++qi)
    for (int64_t kj = 0; kj < 2; ++kj) {
      if (theirs[kj] > mine[qi]) continue;
      const auto mask = theirs[kj] == mine[qi] ? ops::BlockMask::kCausal : ops::BlockMask::kFull;
      fn(qi * chunk, kj * chunk, mask);
    }
}

int64_t pair_work(ops::BlockMask mask, int64_t chunk) {
  return mask == ops::BlockMask::kFull ? chunk * chunk : chunk * (chunk + 1) / 2;
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t group_id, double scale) {
    auto& group = unpack(group_id);
    const int64_t n = group.size(), r = group.rank();
    const int64_t c = q.size(2) / 2;
    const int64_t rows = q.size(0) * q.size(1);
    std::vector<ops::PartialAttention> acc;
    for (int64_t i = 0; i < 2; ++i)
      acc.push_back(ops::empty_partial_attention(q.narrow(2, i * c, c)));
    auto block = at::stack({k, v}).contiguous();
    for (int64_t s = 0; s < n; ++s) {
      std::optional<RingTransfer> transfer;
      if (s + 1 < n) transfer.emplace(group, block, kBlockTag);
      for_each_pair(group, (r + n - s) % n, c, [&](int64_t qo, int64_t ko, ops::BlockMask mask) {
        const auto part = ops::attention_partial_forward(
            q.narrow(2, qo, c), block[0].narrow(2, ko, c), block[1].narrow(2, ko, c), mask, scale);
        ops::merge_partial_attention(acc[static_cast<size_t>(qo / c)], part);
        group.stats().score_elements += rows * pair_work(mask, c);
      });
      if (transfer) block = transfer->wait();
    }
    auto out = at::cat({acc[0].out, acc[1].out}, 2);
    auto lse = at::cat({acc[0].lse, acc[1].lse}, 2);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["group"] = group_id;
    ctx->saved_data["scale"] = scale;
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& group = unpack(ctx->saved_data["group"].toInt());
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const auto acc = out.scalar_type();
    const auto dout = grads[0].to(acc);
    const int64_t n = group.size(), r = group.rank();
    const int64_t c = q.size(2) / 2;
    auto dq = at::zeros(q.sizes(), out.options());
    auto block = at::stack({k, v}).contiguous();
    // Gradients of the key/value blocks in the accumulation dtype: this rank's own block's
    // share stays here; another block's travels with it, gathering each rank's share, and after
    // the last step (which holds the next rank's block) goes home: n - 1 hops.
    auto own_grad = at::zeros(block.sizes(), out.options());
    at::Tensor carried;
    for (int64_t s = 0; s < n; ++s) {
      std::optional<RingTransfer> transfer;
      if (s + 1 < n) transfer.emplace(group, block, kBlockTag);
      auto& grad = s == 0 ? own_grad : carried;
      for_each_pair(group, (r + n - s) % n, c, [&](int64_t qo, int64_t ko, ops::BlockMask mask) {
        const auto g = ops::attention_partial_backward(
            q.narrow(2, qo, c), block[0].narrow(2, ko, c), block[1].narrow(2, ko, c),
            out.narrow(2, qo, c), lse.narrow(2, qo, c), dout.narrow(2, qo, c), mask, scale);
        dq.narrow(2, qo, c).add_(g.dq);
        grad[0].narrow(2, ko, c).add_(g.dk);
        grad[1].narrow(2, ko, c).add_(g.dv);
      });
      std::optional<RingTransfer> grad_transfer;
      if (s > 0) grad_transfer.emplace(group, carried, kGradTag);
      if (transfer) block = transfer->wait();
      // Next step's block starts its journey here (s = 0) or arrives with what it gathered.
      carried = grad_transfer ? grad_transfer->wait() : at::zeros(block.sizes(), out.options());
    }
    // The last arrival is this rank's own block, with every other rank's share.
    own_grad.add_(carried);
    return {dq.to(q.scalar_type()), own_grad[0].to(k.scalar_type()),
            own_grad[1].to(v.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

struct ContextMean : torch::autograd::Function<ContextMean> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group_id) {
    auto& group = unpack(group_id);
    ctx->saved_data["size"] = group.size();
    auto y = x.detach().clone().contiguous();
    group.comm()->all_reduce(y, dist::ReduceOp::Avg);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0] / static_cast<double>(ctx->saved_data["size"].toInt()), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          ContextGroup& group, std::optional<double> scale) {
  LOOM_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() &&
                 q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3) &&
                 k.size(1) > 0 && q.size(1) % k.size(1) == 0,
             "ring attention takes q [B, Hq, T, D] and k, v [B, Hkv, T, D] with Hkv dividing Hq; "
             "got {}, {}, {}",
             q.sizes(), k.sizes(), v.sizes());
  LOOM_CHECK(group.size() > 1, "ring attention needs a context-parallel group of 2 or more ranks");
  LOOM_CHECK(q.size(2) % 2 == 0,
             "ring attention: this rank's slice holds two equal chunks; got {} tokens", q.size(2));
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  return RingAttention::apply(q, k, v, reinterpret_cast<int64_t>(&group), s);
}

at::Tensor context_mean(const at::Tensor& local_mean, ContextGroup& group) {
  if (group.size() == 1) return local_mean;
  return ContextMean::apply(local_mean, reinterpret_cast<int64_t>(&group));
}

}  // namespace loom::parallel::context
