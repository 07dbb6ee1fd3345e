#include "loom/parallel/data/powersgd_hook.h"

#include <ATen/ATen.h>

#include <algorithm>

#include <fmt/format.h>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/ops/orthogonalize.h"

namespace loom::parallel::data {

PowerSgdHook::PowerSgdHook(int64_t rank) : rank_(rank) {
  LOOM_CHECK(rank >= 1 && rank <= ops::max_orthogonalize_rank(),
             "--comm-hook powersgd: rank={} is outside [1, {}]; it is the number of columns of "
             "the factors each gradient matrix is sent as (4: a rank-4 approximation)",
             rank, ops::max_orthogonalize_rank());
}

PowerSgdHook::PowerSgdHook(const core::OptionSpec& spec)
    : PowerSgdHook((spec.check_keys({"rank"}), spec.get_int("rank", 4))) {}

bool PowerSgdHook::compresses(int64_t rows, int64_t cols) const {
  return 2 * rank_ * (rows + cols) <= rows * cols;
}

PowerSgdHook::Layout PowerSgdHook::layout_of(const GradBucket& bucket) const {
  return layout_of(shape_of(bucket).shapes, bucket.offsets);
}

PowerSgdHook::Layout PowerSgdHook::layout_of(const std::vector<std::vector<int64_t>>& shapes,
                                             const std::vector<int64_t>& offsets) const {
  Layout l;
  const auto dense = [&](int64_t offset, int64_t length) {
    if (length == 0) return;
    if (!l.dense.empty() && l.dense.back().first + l.dense.back().second == offset) {
      l.dense.back().second += length;  // adjacent runs travel as one
    } else {
      l.dense.emplace_back(offset, length);
    }
    l.dense_numel += length;
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& shape = shapes[i];
    int64_t numel = 1;
    for (const int64_t size : shape) numel *= size;
    const int64_t rows = shape.size() >= 2 ? shape[0] : 0;
    const int64_t cols = rows > 0 ? numel / rows : 0;
    if (shape.size() < 2 || !compresses(rows, cols)) {
      dense(offsets[i], numel);
      continue;
    }
    l.matrices.push_back(Matrix{offsets[i], rows, cols, l.error_numel, l.p_numel, l.q_numel});
    l.error_numel += rows * cols;
    l.p_numel += rows * rank_;
    l.q_numel += cols * rank_;
  }
  return l;
}

at::Tensor PowerSgdHook::draw_first_q(int64_t bucket_index, int64_t numel, const at::Tensor& like) {
  // Integers only (no libm, no vectorized ATen sampler), so that every rank draws the same bits.
  auto q = at::empty({numel}, at::kFloat);
  float* qp = q.data_ptr<float>();
  const uint64_t seed =
      core::mix_seed({0x706f776572736764ull, static_cast<uint64_t>(bucket_index)});
  for (int64_t i = 0; i < numel; ++i) {
    const uint64_t bits = core::mix_seed({seed, static_cast<uint64_t>(i)});
    qp[i] = static_cast<float>(static_cast<int64_t>(bits >> 40) - (int64_t{1} << 23)) * 0x1p-23f;
  }
  return q.to(like.device());
}

int64_t PowerSgdHook::values_sent(const GradBucket& bucket) const {
  const auto l = layout_of(bucket);
  return l.p_numel + l.dense_numel + l.q_numel;
}

dist::WorkPtr PowerSgdHook::start(GradBucket& bucket, dist::Communicator& comm) {
  auto& s = state_[bucket.index];
  s.layout = layout_of(bucket);
  const auto& l = s.layout;
  const auto options = bucket.buffer.options().dtype(at::kFloat);
  if (!s.error.defined()) {
    s.error = at::zeros({l.error_numel}, options);
    s.q = draw_first_q(bucket.index, l.q_numel, s.error);
  }
  if (!s.first_q.defined() || s.first_q.numel() != l.q_numel)
    s.first_q = draw_first_q(bucket.index, l.q_numel, s.error);
  // Restored state must fit (every rank restores the same sizes, so all stop alike).
  LOOM_CHECK(s.error.numel() == l.error_numel && s.q.numel() == l.q_numel,
             "--comm-hook powersgd: bucket {} carries an error of {} values and Q factors of {}; "
             "its matrices at rank {} need {} and {} (state from another model, bucket size or "
             "rank?)",
             bucket.index, s.error.numel(), s.q.numel(), rank_, l.error_numel, l.q_numel);
  // A checkpoint restores the state on the host.
  if (s.error.device() != bucket.buffer.device()) {
    s.error = s.error.to(bucket.buffer.device());
    s.q = s.q.to(bucket.buffer.device());
    s.first_q = s.first_q.to(bucket.buffer.device());
  }
  // What another layout owed: into the matrices' errors, and onto the values sent as they are
  // (every rank adds the same, so the average delivers it).
  if (const auto pending = pending_owed_.find(bucket.index); pending != pending_owed_.end()) {
    int64_t params_end = 0;
    for (size_t i = 0; i < bucket.params.size(); ++i)
      params_end = std::max(params_end, bucket.offsets[i] + bucket.params[i].numel());
    LOOM_CHECK(pending->second.numel() == params_end,
               "--comm-hook powersgd: bucket {}'s pending_owed holds {} values; its parameters "
               "have {} (state from another model or bucket size?)",
               bucket.index, pending->second.numel(), params_end);
    const auto owed = pending->second.to(s.error.device());
    for (const auto& m : l.matrices)
      s.error.narrow(0, m.error_offset, m.rows * m.cols)
          .add_(owed.narrow(0, m.bucket_offset, m.rows * m.cols));
    for (const auto& [offset, length] : l.dense)
      bucket.buffer.narrow(0, offset, length).add_(owed.narrow(0, offset, length));
    pending_owed_.erase(pending);
  }
  s.message = at::empty({l.p_numel + l.dense_numel}, options);
  for (const auto& m : l.matrices) {
    auto big = s.error.narrow(0, m.error_offset, m.rows * m.cols).view({m.rows, m.cols});
    big.add_(bucket.buffer.narrow(0, m.bucket_offset, m.rows * m.cols).view({m.rows, m.cols}));
    auto p = s.message.narrow(0, m.p_offset, m.rows * rank_).view({m.rows, rank_});
    at::mm_out(p, big, s.q.narrow(0, m.q_offset, m.cols * rank_).view({m.cols, rank_}));
  }
  int64_t pos = l.p_numel;
  for (const auto& [offset, length] : l.dense) {
    s.message.narrow(0, pos, length).copy_(bucket.buffer.narrow(0, offset, length));
    pos += length;
  }
  return comm.all_reduce_async(s.message, dist::ReduceOp::Avg);
}

void PowerSgdHook::finish(GradBucket& bucket, dist::Communicator& comm) {
  auto& s = state_.at(bucket.index);
  const auto& l = s.layout;
  int64_t pos = l.p_numel;
  for (const auto& [offset, length] : l.dense) {
    bucket.buffer.narrow(0, offset, length).copy_(s.message.narrow(0, pos, length));
    pos += length;
  }
  if (l.matrices.empty()) {
    s.message = at::Tensor();
    return;
  }
  std::vector<int64_t> offsets, rows;
  for (const auto& m : l.matrices) {
    offsets.push_back(m.p_offset);
    rows.push_back(m.rows);
  }
  ops::orthogonalize_columns_(s.message, offsets, rows, rank_);
  const auto p_of = [&](const Matrix& m) {
    return s.message.narrow(0, m.p_offset, m.rows * rank_).view({m.rows, rank_});
  };
  const auto q_of = [&](const Matrix& m) {
    return s.q.narrow(0, m.q_offset, m.cols * rank_).view({m.cols, rank_});
  };
  const auto big_of = [&](const Matrix& m) {
    return s.error.narrow(0, m.error_offset, m.rows * m.cols).view({m.rows, m.cols});
  };
  for (const auto& m : l.matrices) {
    auto q = q_of(m);
    at::mm_out(q, big_of(m).t(), p_of(m));
  }
  comm.all_reduce(s.q, dist::ReduceOp::Avg);
  // The averaged Q is the same on every rank, so all of them take the same branch.
  const bool finite = at::isfinite(s.q).all().item<bool>();
  for (const auto& m : l.matrices) {
    auto grad = bucket.buffer.narrow(0, m.bucket_offset, m.rows * m.cols).view({m.rows, m.cols});
    grad.copy_(at::mm(p_of(m), q_of(m).t()));
    // What the gradient holds, rounded to its dtype (bf16 buffers), is what was applied.
    big_of(m).sub_(grad);
  }
  if (!finite) {
    s.error.zero_();
    s.q.copy_(s.first_q);
  } else {
    // A column of Q that is all zero (its P column was: a matrix whose gradient was zero on every
    // rank) would stay zero under warm start, and the matrix would be sent as zeros from then on:
    // such columns start again from the first Q's. The same on every rank (Q is).
    for (const auto& m : l.matrices) {
      auto q = q_of(m);
      const auto dead = q.abs().amax(0, /*keepdim=*/true) == 0;
      q.copy_(at::where(dead, s.first_q.narrow(0, m.q_offset, m.cols * rank_).view(q.sizes()), q));
    }
  }
  s.message = at::Tensor();
}

std::map<std::string, at::Tensor> PowerSgdHook::state() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [index, s] : state_) {
    out[bucket_state_key(index, "error")] = s.error;
    out[bucket_state_key(index, "q")] = s.q;
  }
  for (const auto& [index, owed] : pending_owed_)
    out[bucket_state_key(index, "pending_owed")] = owed;
  return out;
}

void PowerSgdHook::load_state(const std::map<std::string, at::Tensor>& state) {
  state_.clear();
  pending_owed_.clear();
  for (const auto& [key, t] : state) {
    if (const auto index = bucket_of_key(key, "pending_owed")) {
      LOOM_CHECK(t.dim() == 1, "--comm-hook powersgd state: bucket {}'s pending_owed has {} dims",
                 *index, t.dim());
      pending_owed_[*index] = t.to(at::kFloat).contiguous().clone();
    }
  }
  for (const auto& [key, error] : state) {
    const auto bucket = bucket_of_key(key, "error");
    if (!bucket) continue;
    const auto q = state.find(bucket_state_key(*bucket, "q"));
    LOOM_CHECK(error.dim() == 1 && q != state.end() && q->second.dim() == 1,
               "--comm-hook powersgd state: bucket {} needs a 1-D error and a 1-D q; got an "
               "error of {} dims and {} q",
               *bucket, error.dim(), q == state.end() ? "no" : "a");
    auto& s = state_[*bucket];
    s.error = error.to(at::kFloat).contiguous().clone();
    s.q = q->second.to(at::kFloat).contiguous().clone();
  }
}

std::map<std::string, at::Tensor> PowerSgdHook::group_values(
    const std::map<std::string, at::Tensor>& group,
    const std::map<int64_t, BucketShape>& buckets) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [index, shape] : buckets) {
    const auto error = group.find(bucket_state_key(index, "error"));
    const auto pending = group.find(bucket_state_key(index, "pending_owed"));
    if (error == group.end() && pending == group.end()) continue;
    auto owed = pending != group.end()
                    ? leading_values(pending->second, shape.numel, name(), index, "pending_owed")
                    : at::zeros({shape.numel}, at::kFloat);
    if (error != group.end()) {
      const auto l = layout_of(shape.shapes, shape.offsets);
      const auto carried = leading_values(error->second, l.error_numel, name(), index, "error");
      for (const auto& m : l.matrices)
        owed.narrow(0, m.bucket_offset, m.rows * m.cols)
            .add_(carried.narrow(0, m.error_offset, m.rows * m.cols));
    }
    out[bucket_state_key(index, "owed")] = owed;
  }
  return out;
}

void PowerSgdHook::load_group_values(const std::map<std::string, at::Tensor>& values,
                                     bool /*reduce_scatter*/) {
  state_.clear();
  pending_owed_.clear();
  pending_owed_ = owed_by_bucket(values);
}

at::Tensor PowerSgdHook::error(int64_t index) const {
  const auto it = state_.find(index);
  return it == state_.end() ? at::Tensor() : it->second.error;
}

at::Tensor PowerSgdHook::q(int64_t index) const {
  const auto it = state_.find(index);
  return it == state_.end() ? at::Tensor() : it->second.q;
}

}  // namespace loom::parallel::data
