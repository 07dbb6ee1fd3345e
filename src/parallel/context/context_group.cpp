#include "loom/parallel/context/context_group.h"

#include <ATen/ATen.h>

#include "loom/core/error.h"

namespace loom::parallel::context {

ContextGroup::ContextGroup(dist::CommunicatorPtr comm) : comm_(std::move(comm)) {
  if (comm_ && comm_->size() == 1) comm_.reset();
}

void ContextGroup::check_seq_len(int64_t seq_len) const {
  LOOM_CHECK(seq_len > 0 && seq_len % (2 * size()) == 0,
             "context parallelism cuts each sequence into 2 x cp = {} chunks: sequence length {} "
             "is not divisible by {} (use a --seq-len that is a multiple of {})",
             2 * size(), seq_len, 2 * size(), 2 * size());
}

at::Tensor ContextGroup::local_positions(int64_t local_len, at::Device device) const {
  const auto options = at::TensorOptions(at::kLong).device(device);
  if (size() == 1) return at::arange(local_len, options);
  LOOM_CHECK(local_len % 2 == 0, "a context-parallel slice holds two equal chunks; got {} tokens",
             local_len);
  const int64_t chunk = local_len / 2;
  const auto [a, b] = chunks_of(rank());
  return at::cat({at::arange(a * chunk, (a + 1) * chunk, options),
                  at::arange(b * chunk, (b + 1) * chunk, options)});
}

at::Tensor ContextGroup::slice_sequence(const at::Tensor& x, int64_t dim) const {
  if (size() == 1) return x;
  const int64_t len = x.size(dim);
  check_seq_len(len);
  const int64_t chunk = len / (2 * size());
  const auto [a, b] = chunks_of(rank());
  return at::cat({x.narrow(dim, a * chunk, chunk), x.narrow(dim, b * chunk, chunk)}, dim);
}

int64_t causal_score_elements(int64_t seq_len, int64_t cp, int64_t rank) {
  LOOM_CHECK(cp >= 1 && rank >= 0 && rank < cp && seq_len % (2 * cp) == 0,
             "causal_score_elements: seq_len {} must be divisible by 2 x cp {}, rank {} in [0, "
             "cp)",
             seq_len, cp, rank);
  const int64_t c = seq_len / (2 * cp);
  int64_t total = 0;
  // A query chunk i sees i whole chunks before it and the lower triangle of its own.
  for (const int64_t i : {rank, 2 * cp - 1 - rank}) total += i * c * c + c * (c + 1) / 2;
  return total;
}

}  // namespace loom::parallel::context
