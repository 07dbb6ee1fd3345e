#include "loom/parallel/zero/zero_optimizer.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>

#include "loom/core/error.h"
#include "loom/ops/precision.h"
#include "loom/parallel/data/grad_bucket.h"

namespace loom::parallel::zero {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Stage 3 frees a released unit's memory by detaching the storage's allocation, not by dropping
// the tensor: the parameters (and the views autograd saved for backward) keep pointing at the
// same storage, which gets memory again when the unit is gathered.
void free_storage(const at::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void allocate_storage(const at::Tensor& t) {
  const c10::DeviceGuard device(t.device());
  auto* impl = t.storage().unsafeGetStorageImpl();
  const auto nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  LOOM_CHECK(impl->allocator() != nullptr, "ZeRO-3: a unit buffer's storage has no allocator");
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

int64_t storage_nbytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

using ops::squared_norm;

}  // namespace

// Identity in forward; in backward, before the unit's own gradients are computed, gathers the
// unit's parameters again (and prefetches the unit backward reaches next).
struct PreBackwardGather : public torch::autograd::Function<PreBackwardGather> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t engine, int64_t bucket) {
    ctx->saved_data["engine"] = engine;
    ctx->saved_data["bucket"] = bucket;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* engine = reinterpret_cast<ZeroOptimizer*>(ctx->saved_data["engine"].toInt());
    engine->pre_backward(static_cast<size_t>(ctx->saved_data["bucket"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

ZeroOptimizer::ZeroOptimizer(NamedParams params, dist::CommunicatorPtr comm, ZeroOptions options,
                             std::vector<ZeroUnit> units)
    : options_(std::move(options)), comm_(std::move(comm)) {
  LOOM_CHECK(comm_ != nullptr, "ZeRO needs a data-parallel communicator");
  LOOM_CHECK(options_.stage >= 1 && options_.stage <= 3,
             "--zero {} is invalid; ZeRO stages are 1, 2 and 3 (0 is plain data parallelism)",
             options_.stage);
  LOOM_CHECK(options_.bucket_mb > 0, "--bucket-mb {} is invalid; it must be positive",
             options_.bucket_mb);
  ops::check_adamw_options(options_.adamw);
  LOOM_CHECK(!options_.hook || !options_.hook->reduces_once_per_step() || options_.stage == 1 ||
                 options_.reduce_once,
             "ZeRO-{}: --comm-hook {} must see each step's gradients once (a momentum "
             "compression); set reduce_once",
             options_.stage, options_.hook ? options_.hook->name() : std::string());
  rank_ = comm_->rank();
  ranks_ = comm_->size();
  // Stage 3 gathers parameters while gradients are being reduced: on a communicator of its own,
  // each kind of collective keeps one order on every rank however the two interleave.
  gather_comm_ =
      options_.stage == 3 ? comm_->split(0, static_cast<int>(rank_), "zero-gather") : comm_;
  for (auto& [name, p] : params) {
    if (!p.requires_grad()) continue;
    LOOM_CHECK(p.is_leaf(), "ZeRO: parameter '{}' is not a leaf tensor", name);
    params_.emplace_back(name, p);
  }
  LOOM_CHECK(!params_.empty(), "ZeRO: the model has no parameter that requires a gradient");
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index.emplace(params_[i].first, i);

  // Which parameters share a flat buffer.
  std::vector<std::pair<std::string, std::vector<size_t>>> plan;
  if (options_.stage == 3) {
    std::vector<bool> taken(params_.size(), false);
    for (const auto& unit : units) {
      unit_names_.push_back(unit.name);
      std::vector<size_t> members;
      for (const auto& name : unit.params) {
        auto it = index.find(name);
        LOOM_CHECK(it != index.end(),
                   "ZeRO-3 unit '{}' names parameter '{}', which the model does not have (or "
                   "which needs no gradient)",
                   unit.name, name);
        LOOM_CHECK(!taken[it->second], "ZeRO-3: parameter '{}' is in two units ('{}' and another)",
                   name, unit.name);
        taken[it->second] = true;
        members.push_back(it->second);
      }
      std::sort(members.begin(), members.end());  // registration order
      if (members.empty()) {
        bucket_of_unit_.push_back(std::nullopt);
        continue;
      }
      bucket_of_unit_.push_back(plan.size());
      plan.emplace_back(unit.name, std::move(members));
    }
    std::vector<size_t> rest, own;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (taken[i]) continue;
      const auto& name = params_[i].first;
      const bool alone = std::find(options_.own_bucket.begin(), options_.own_bucket.end(), name) !=
                         options_.own_bucket.end();
      (alone ? own : rest).push_back(i);
    }
    if (!rest.empty()) {
      roots_.push_back(plan.size());
      plan.emplace_back("root", std::move(rest));
    }
    for (size_t i : own) {
      roots_.push_back(plan.size());
      plan.emplace_back(params_[i].first, std::vector<size_t>{i});
    }
  } else {
    std::vector<at::Tensor> tensors;
    std::vector<size_t> shared;  // params_ index of each entry of tensors
    std::vector<size_t> own;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& name = params_[i].first;
      if (std::find(options_.own_bucket.begin(), options_.own_bucket.end(), name) !=
          options_.own_bucket.end()) {
        own.push_back(i);
      } else {
        tensors.push_back(params_[i].second);
        shared.push_back(i);
      }
    }
    const auto bucket_bytes = static_cast<int64_t>(options_.bucket_mb * 1024.0 * 1024.0);
    if (!tensors.empty())
      for (auto& members : data::assign_buckets(tensors, std::max<int64_t>(bucket_bytes, 1))) {
        for (auto& m : members) m = shared[m];
        plan.emplace_back(fmt::format("bucket {}", plan.size()), std::move(members));
      }
    // Last in launch order: they wait for nothing else, and nothing waits for them.
    for (size_t i : own) plan.emplace_back(params_[i].first, std::vector<size_t>{i});
  }

  const bool on_gpu = params_.front().second.is_cuda();
  const auto state_device = options_.offload_optimizer ? host_ : params_.front().second.device();
  torch::NoGradGuard no_grad;
  for (size_t bi = 0; bi < plan.size(); ++bi) {
    Bucket b;
    b.name = plan[bi].first;
    b.params = std::move(plan[bi].second);
    std::vector<int64_t> numels;
    const auto& first = params_[b.params.front()].second;
    for (size_t k : b.params) {
      const auto& [name, p] = params_[k];
      LOOM_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                 "ZeRO: '{}' ({} on {}) shares a flat buffer ({}) with '{}' ({} on {}); a buffer "
                 "holds one dtype on one device",
                 name, c10::toString(p.scalar_type()), p.device().str(), b.name,
                 params_[b.params.front()].first, c10::toString(first.scalar_type()),
                 first.device().str());
      numels.push_back(p.numel());
    }
    b.layout = FlatLayout(numels, ranks_);
    const auto options = first.options().requires_grad(false);
    // Rank 0's values, so every replica starts from the same parameters.
    b.full = at::zeros({b.layout.padded_total()}, options);
    for (size_t s = 0; s < b.params.size(); ++s)
      param_view(b, s, b.full).copy_(params_[b.params[s]].second);
    comm_->broadcast(b.full, 0);
    for (size_t s = 0; s < b.params.size(); ++s)
      params_[b.params[s]].second.set_data(param_view(b, s, b.full));
    if (options_.stage == 3) {
      b.param_shard = shard_view(b, b.full).clone();
      b.gathered = Gathered::kYes;
    } else {
      b.param_shard = shard_view(b, b.full);
    }
    if (options_.stage == 1) {
      b.full_grads = at::zeros({b.layout.padded_total()}, options);
      b.grad_shard = shard_view(b, b.full_grads);
      for (size_t s = 0; s < b.params.size(); ++s)
        params_[b.params[s]].second.mutable_grad() = param_view(b, s, b.full_grads);
    } else {
      b.grad_shard = at::zeros({b.layout.shard_numel()}, options);
    }
    // Optimizer state in fp32 (fp64 for fp64 parameters); a master copy where the parameters
    // are narrower, or live on another device.
    const auto state_dtype = ops::accumulation_dtype(first.scalar_type());
    auto state_options = at::TensorOptions(state_dtype).device(state_device);
    if (options_.offload_optimizer && on_gpu) state_options = state_options.pinned_memory(true);
    if (first.scalar_type() != state_dtype || options_.offload_optimizer) {
      b.master = at::empty({b.layout.shard_numel()}, state_options);
      b.master.copy_(b.param_shard);
    }
    b.exp_avg = at::zeros({b.layout.shard_numel()}, state_options);
    b.exp_avg_sq = at::zeros({b.layout.shard_numel()}, state_options);
    if (options_.offload_optimizer && on_gpu)
      b.host_grad = at::empty({b.layout.shard_numel()},
                              at::TensorOptions(first.scalar_type()).pinned_memory(true));
    b.segments = b.layout.segments(rank_);
    for (const auto& seg : b.segments) {
      const auto& [name, p] = params_[b.params[seg.param]];
      b.segment_decays.push_back(options_.decays ? options_.decays(name, p) : p.dim() >= 2);
      if (options_.norm_weight) b.segment_norm_weights.push_back(options_.norm_weight(name));
    }
    buckets_.push_back(std::move(b));
    // Stage 3 keeps only the shard: release each unit as soon as it is sharded, so building
    // the engine never holds a second copy of the whole model.
    if (options_.stage == 3) release(buckets_.size() - 1);
  }
  for (const auto& [name, p] : params_)
    if (options_.decays ? options_.decays(name, p) : p.dim() >= 2) ++decayed_;

  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    auto& b = buckets_[bi];
    for (size_t s = 0; s < b.params.size(); ++s) {
      const auto& [name, p] = params_[b.params[s]];
      hooks_.add(p, name, [this, bi, s] { on_grad_ready(bi, s); });
    }
    b.pending = static_cast<int64_t>(b.params.size());
  }
}

ZeroOptimizer::~ZeroOptimizer() = default;

size_t ZeroOptimizer::unit_index(const std::string& name) const {
  for (size_t u = 0; u < unit_names_.size(); ++u)
    if (unit_names_[u] == name) return u;
  fail("ZeRO has no unit '{}'", name);
}

at::Tensor ZeroOptimizer::shard_view(const Bucket& b, const at::Tensor& flat) const {
  return flat.narrow(0, rank_ * b.layout.shard_numel(), b.layout.shard_numel());
}

at::Tensor ZeroOptimizer::param_view(const Bucket& b, size_t slot, const at::Tensor& flat) const {
  const auto& p = params_[b.params[slot]].second;
  return flat.narrow(0, b.layout.offset(slot), b.layout.numel(slot)).view(p.sizes());
}

// ---- Stage 3: gathering units --------------------------------------------------------------

void ZeroOptimizer::gather(size_t bucket, bool prefetch) {
  auto& b = buckets_[bucket];
  if (b.gathered != Gathered::kNo) return;
  allocate_storage(b.full);
  b.gather_work = gather_comm_->all_gather_async(b.full, b.param_shard);
  b.gathered = Gathered::kInFlight;
  stats_.all_gather_bytes += static_cast<double>(b.full.numel() * b.full.element_size());
  ++stats_.gathers;
  if (prefetch) ++stats_.prefetched;
}

void ZeroOptimizer::wait_gathered(size_t bucket) {
  auto& b = buckets_[bucket];
  if (b.gathered != Gathered::kInFlight) return;
  const auto start = Clock::now();
  b.gather_work->wait();
  stats_.wait_seconds += seconds_since(start);
  b.gather_work = nullptr;
  b.gathered = Gathered::kYes;
}

void ZeroOptimizer::release(size_t bucket) {
  auto& b = buckets_[bucket];
  if (b.gathered == Gathered::kNo) return;
  wait_gathered(bucket);  // never free memory a collective is still writing
  free_storage(b.full);
  b.gathered = Gathered::kNo;
}

void ZeroOptimizer::prefetch_after(int64_t position, int direction) {
  if (!options_.prefetch || order_broken_ || !order_recorded_ || position < 0) return;
  const auto pos = position + direction;
  if (pos < 0 || pos >= static_cast<int64_t>(forward_order_.size())) return;
  const size_t bucket = forward_order_[static_cast<size_t>(pos)];
  // In backward, a unit whose reduction has launched is done (a unit run several times
  // finishes at its first use, before backward reaches its earlier positions).
  if (direction < 0 &&
      std::find(launch_order_.begin(), launch_order_.begin() + static_cast<int64_t>(next_launch_),
                bucket) != launch_order_.begin() + static_cast<int64_t>(next_launch_))
    return;
  gather(bucket, true);
}

void ZeroOptimizer::prepare_forward() {
  forward_pos_ = 0;
  // A forward ran before (with or without backward): its units' order is the order.
  if (!forward_order_.empty()) order_recorded_ = true;
  if (options_.stage != 3) return;
  for (size_t root : roots_) gather(root, false);
  for (size_t root : roots_) wait_gathered(root);
}

at::Tensor ZeroOptimizer::run_unit(size_t unit, const std::function<at::Tensor()>& fn) {
  if (options_.stage != 3) return fn();
  LOOM_CHECK(unit < bucket_of_unit_.size(), "ZeRO-3: unit {} does not exist ({} units)", unit,
             bucket_of_unit_.size());
  if (!bucket_of_unit_[unit]) return fn();  // a unit without trainable parameters
  const size_t bucket = *bucket_of_unit_[unit];
  // The order of the first forward is the order prefetching follows; a forward that runs
  // units in another order turns prefetching off rather than gathering the wrong unit.
  if (!order_recorded_) {
    forward_order_.push_back(bucket);
  } else if (!order_broken_ &&
             (forward_pos_ >= forward_order_.size() || forward_order_[forward_pos_] != bucket)) {
    order_broken_ = true;
    spdlog::warn(
        "ZeRO-3: units ran in another order than in the first forward ('{}' at position "
        "{}); prefetching is off from now on",
        buckets_[bucket].name, forward_pos_);
  }
  const auto position = static_cast<int64_t>(forward_pos_++);
  gather(bucket, false);
  wait_gathered(bucket);
  prefetch_after(position, +1);
  auto out = fn();
  if (!is_root(bucket) && options_.reshard_after_forward) release(bucket);
  if (torch::GradMode::is_enabled() && out.requires_grad())
    out = PreBackwardGather::apply(out, reinterpret_cast<int64_t>(this),
                                   static_cast<int64_t>(bucket));
  return out;
}

void ZeroOptimizer::pre_backward(size_t bucket) {
  if (!order_recorded_ && !forward_order_.empty()) order_recorded_ = true;
  gather(bucket, false);
  wait_gathered(bucket);
  // Backward meets a unit run several times (a block shared by layers) first at its last use.
  const auto last = std::find(forward_order_.rbegin(), forward_order_.rend(), bucket);
  prefetch_after(
      last == forward_order_.rend() ? -1 : static_cast<int64_t>(forward_order_.rend() - last) - 1,
      -1);
}

void ZeroOptimizer::release_parameters() {
  if (options_.stage != 3) return;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) release(bi);
}

double ZeroOptimizer::clip_grad_norm(double max_norm) {
  const double norm = std::sqrt(grad_norm_squared());
  if (max_norm > 0 && norm > max_norm) scale_gradients(max_norm / (norm + 1e-6));
  return norm;
}

double ZeroOptimizer::grad_norm_squared() {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> squares;
  for (const auto& b : buckets_) {
    if (b.segment_norm_weights.empty()) {
      squares.push_back(squared_norm(b.grad_shard));
      continue;
    }
    for (size_t k = 0; k < b.segments.size(); ++k)
      squares.push_back(
          squared_norm(b.grad_shard.narrow(0, b.segments[k].shard_offset, b.segments[k].numel)) *
          b.segment_norm_weights[k]);
  }
  // A rank with no buckets still joins the sum, on the device its group takes.
  auto total =
      dist::on_comm_device(*comm_, squares.empty() ? at::zeros({1}, at::kDouble)
                                                   : at::stack(squares).sum().reshape({1}));
  comm_->all_reduce(total, dist::ReduceOp::Sum);  // then one host sync
  return total.item<double>();
}

void ZeroOptimizer::scale_gradients(double factor) {
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) b.grad_shard.mul_(factor);
}

at::Tensor ZeroOptimizer::own_bucket_grad_shard(const std::string& name) {
  for (auto& b : buckets_)
    if (b.params.size() == 1 && params_[b.params.front()].first == name && b.name == name)
      return b.grad_shard;
  fail("ZeRO: '{}' has no bucket of its own (name it in ZeroOptions::own_bucket)", name);
}

std::pair<at::Tensor, int64_t> ZeroOptimizer::piece_of(const std::string& name,
                                                       at::Tensor Bucket::*shard) {
  for (auto& b : buckets_) {
    for (size_t slot = 0; slot < b.params.size(); ++slot) {
      if (params_[b.params[slot]].first != name) continue;
      // A parameter lies in one bucket, and in at most one segment of each rank's shard.
      for (const auto& seg : b.segments)
        if (seg.param == slot)
          return {(b.*shard).narrow(0, seg.shard_offset, seg.numel), seg.param_offset};
      return {(b.*shard).narrow(0, 0, 0), 0};
    }
  }
  fail("ZeRO: no parameter named '{}' (it does not require a gradient, or is not in this engine)",
       name);
}

std::pair<at::Tensor, int64_t> ZeroOptimizer::grad_shard_of(const std::string& name) {
  return piece_of(name, &Bucket::grad_shard);
}

std::pair<at::Tensor, int64_t> ZeroOptimizer::param_piece_of(const std::string& name) {
  if (options_.stage == 3) return piece_of(name, &Bucket::param_shard);
  for (auto& [n, p] : params_)
    if (n == name) return {p.detach().view({-1}), 0};  // a view of the bucket's full buffer
  fail("ZeRO: no parameter named '{}' (it does not require a gradient, or is not in this engine)",
       name);
}

// ---- The optimizer step --------------------------------------------------------------------

void ZeroOptimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ++steps_;
  // Offloaded from a GPU: every bucket's gradient shard starts down to pinned host memory at
  // once (queued on the current stream, an event after each), and each bucket's update waits
  // only for its own copy, so the host updates one bucket while the next is still crossing. The
  // updated parameters go back up asynchronously from the pinned masters; the next step's
  // copies queue behind them, so a master is never rewritten while it is being read.
  const bool staged = !buckets_.empty() && buckets_.front().host_grad.defined();
  std::vector<c10::Event> copied;
  if (staged) {
    const auto device = buckets_.front().grad_shard.device();
    const auto stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
    for (auto& b : buckets_) {
      b.host_grad.copy_(b.grad_shard, /*non_blocking=*/true);
      copied.emplace_back(device.type());
      copied.back().record(stream);
    }
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    at::Tensor grad;
    if (staged) {
      copied[i].synchronize();
      grad = b.host_grad.to(b.exp_avg.scalar_type());  // itself when the dtypes agree
    } else {
      grad = b.grad_shard.to(b.exp_avg.device(), b.exp_avg.scalar_type(), /*non_blocking=*/false);
    }
    auto& weight = b.master.defined() ? b.master : b.param_shard;
    for (size_t k = 0; k < b.segments.size(); ++k)
      if (b.segment_decays[k])
        ops::adamw_decay_(weight.narrow(0, b.segments[k].shard_offset, b.segments[k].numel), lr,
                          options_.adamw);
    ops::adamw_update_(weight, grad, b.exp_avg, b.exp_avg_sq, lr, steps_, options_.adamw);
    if (b.master.defined()) b.param_shard.copy_(b.master, /*non_blocking=*/staged);
  }
  if (options_.stage == 3) return;  // gathered when next needed
  // Stages 1-2: every rank needs every updated parameter.
  std::vector<std::pair<dist::WorkPtr, at::Tensor>> works;
  for (auto& b : buckets_) {
    auto mine = b.param_shard.clone();  // the output buffer holds the input's slice
    works.emplace_back(comm_->all_gather_async(b.full, mine), mine);
    stats_.all_gather_bytes += static_cast<double>(b.full.numel() * b.full.element_size());
  }
  const auto start = Clock::now();
  for (auto& [work, mine] : works) work->wait();
  stats_.wait_seconds += seconds_since(start);
}

void ZeroOptimizer::zero_grad() {
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    if (b.full_grads.defined())
      b.full_grads.zero_();  // stage 1: the .grad views too
    else
      b.grad_shard.zero_();
  }
}

// ---- Parameters and memory (the checkpoint state: zero_optimizer_state.cpp) ----------------

std::map<std::string, at::Tensor> ZeroOptimizer::gather_parameters(
    std::optional<int64_t> only_rank) {
  std::map<std::string, at::Tensor> out;
  for_each_gathered_parameter(only_rank, [&](const std::string& name, const at::Tensor& value) {
    out.emplace(name, value);
  });
  return out;
}

void ZeroOptimizer::for_each_gathered_parameter(
    std::optional<int64_t> only_rank,
    const std::function<void(const std::string& name, const at::Tensor& value)>& visit) {
  torch::NoGradGuard no_grad;
  const bool visits = !only_rank || *only_rank == rank_;
  for (auto& b : buckets_) {
    at::Tensor flat = b.full;
    if (options_.stage == 3) {
      // Unit by unit; a rank that does not visit drops each unit right away.
      flat = at::empty({b.layout.padded_total()}, b.param_shard.options());
      gather_comm_->all_gather(flat, b.param_shard);
    }
    if (!visits) continue;
    for (size_t s = 0; s < b.params.size(); ++s)
      visit(params_[b.params[s]].first, param_view(b, s, flat));
  }
}

ZeroMemory ZeroOptimizer::memory() const {
  ZeroMemory m;
  for (const auto& b : buckets_) {
    m.parameters += storage_nbytes(b.full);
    if (options_.stage == 3) m.parameters += storage_nbytes(b.param_shard);
    m.gradients +=
        options_.stage == 1 ? storage_nbytes(b.full_grads) : storage_nbytes(b.grad_shard);
    m.optimizer +=
        storage_nbytes(b.master) + storage_nbytes(b.exp_avg) + storage_nbytes(b.exp_avg_sq);
  }
  // A compressing hook's error feedback: what this rank sends is every shard of each bucket, so
  // its carried error is bucket-sized (fp32), not shard-sized.
  if (options_.hook)
    for (const auto& [key, t] : options_.hook->state()) m.gradients += storage_nbytes(t);
  return m;
}

}  // namespace loom::parallel::zero
