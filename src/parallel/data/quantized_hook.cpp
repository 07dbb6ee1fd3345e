#include "loom/parallel/data/quantized_hook.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "loom/core/error.h"
#include "loom/ops/quantize.h"
#include "loom/ops/sign_pack.h"

namespace loom::parallel::data {

QuantizedAllReduceHook::QuantizedAllReduceHook(std::string name, int64_t block)
    : name_(std::move(name)), block_(block) {}

int64_t QuantizedAllReduceHook::segment_numel(int64_t numel, int64_t ranks) const {
  const int64_t per_rank = (numel + ranks - 1) / ranks;
  return to_block(per_rank);
}

void QuantizedAllReduceHook::lay_out(State& s, int64_t n, int64_t rank, int64_t ranks,
                                     const at::TensorOptions& options) const {
  s.ranks = ranks;
  s.segment = segment_numel(n, ranks);
  s.error = at::zeros({ranks * s.segment}, options.dtype(at::kFloat));
  s.server_error = at::zeros({s.segment}, s.error.options());
  if (!s.resharded_error.defined()) return;
  // Resharded: the bucket's values of the mean error, and this rank's segment of the server
  // error (what lies past the bucket was padding, zero).
  const int64_t kept = std::min(n, s.resharded_error.numel());
  s.error.narrow(0, 0, kept).copy_(s.resharded_error.narrow(0, 0, kept));
  const int64_t first = rank * s.segment;
  const int64_t served = std::min({s.segment, n - first, s.resharded_server_error.numel() - first});
  if (served > 0)
    s.server_error.narrow(0, 0, served).copy_(s.resharded_server_error.narrow(0, first, served));
  s.resharded_error = s.resharded_server_error = at::Tensor();
}

void QuantizedAllReduceHook::lay_out_scatter(ScatterState& s, int64_t ranks, int64_t shard,
                                             const at::TensorOptions& options) const {
  s.ranks = ranks;
  s.shard = shard;
  s.segment = to_block(shard);
  s.error = at::zeros({ranks * s.segment}, options.dtype(at::kFloat));
  if (!s.resharded_error.defined()) return;
  // The mean error in bucket order, cut into the new shards. Past the parameters the bucket is
  // padding, never delivered (ZeRO zeroes it in what it receives), so a longer or shorter padded
  // bucket loses nothing that is owed.
  auto joined = at::zeros({ranks * shard}, s.error.options());
  const int64_t kept = std::min(joined.numel(), s.resharded_error.numel());
  joined.narrow(0, 0, kept).copy_(s.resharded_error.narrow(0, 0, kept));
  s.error.view({ranks, s.segment}).narrow(1, 0, shard).copy_(joined.view({ranks, shard}));
  s.resharded_error = at::Tensor();
}

void QuantizedAllReduceHook::lay_out_resharded(int64_t index, int64_t numel, int64_t rank,
                                               int64_t ranks) {
  if (const auto it = state_.find(index);
      it != state_.end() && it->second.resharded_error.defined())
    lay_out(it->second, numel, rank, ranks, at::TensorOptions(at::kCPU));
  if (const auto it = scatter_state_.find(index);
      it != scatter_state_.end() && it->second.resharded_error.defined())
    lay_out_scatter(it->second, ranks, numel / ranks, at::TensorOptions(at::kCPU));
}

dist::WorkPtr QuantizedAllReduceHook::start(GradBucket& bucket, dist::Communicator& comm) {
  const int64_t ranks = comm.size(), n = bucket.numel();
  auto& s = state_[bucket.index];
  if (s.ranks != ranks || s.segment != segment_numel(n, ranks))
    lay_out(s, n, comm.rank(), ranks, bucket.buffer.options());
  // A checkpoint restores the errors on the host.
  if (s.error.device() != bucket.buffer.device()) {
    s.error = s.error.to(bucket.buffer.device());
    s.server_error = s.server_error.to(bucket.buffer.device());
  }
  auto padded = at::zeros_like(s.error);
  padded.narrow(0, 0, n).copy_(bucket.buffer);
  s.send = at::empty({ranks, chunk_bytes(s.segment)}, s.error.options().dtype(at::kByte));
  s.recv = at::empty_like(s.send);
  compress(padded, s.error, s.send);
  // The padding is not a gradient: what it decoded to is dropped, so nothing of it is owed.
  s.error.narrow(0, n, s.error.numel() - n).zero_();
  return comm.all_to_all_async(s.recv, s.send);
}

void QuantizedAllReduceHook::finish(GradBucket& bucket, dist::Communicator& comm) {
  auto& s = state_.at(bucket.index);
  // This rank's segment: the mean of every rank's decompressed chunk.
  const auto mean = decompress(s.recv, s.segment).sum(0) / static_cast<double>(s.ranks);
  auto mine = at::empty({1, chunk_bytes(s.segment)}, s.send.options());
  compress(mean, s.server_error, mine);
  // Likewise the padding in this rank's segment, if any.
  const int64_t first = comm.rank() * s.segment, padding_from = bucket.numel() - first;
  if (padding_from < s.segment)
    s.server_error
        .narrow(0, std::max<int64_t>(0, padding_from),
                s.segment - std::max<int64_t>(0, padding_from))
        .zero_();
  auto gathered = at::empty({s.ranks, mine.size(1)}, mine.options());
  comm.all_gather(gathered, mine);
  bucket.buffer.copy_(decompress(gathered, s.segment).view({-1}).narrow(0, 0, bucket.numel()));
  s.send = s.recv = at::Tensor();
}

dist::WorkPtr QuantizedAllReduceHook::start_reduce_scatter(GradBucket& bucket,
                                                           const at::Tensor& recv,
                                                           dist::Communicator& comm) {
  const int64_t index = bucket.index;
  const auto& send = bucket.buffer;
  const int64_t ranks = comm.size();
  LOOM_CHECK(send.dim() == 1 && send.numel() == ranks * recv.numel(),
             "--comm-hook {}: a reduce-scatter of {} values into shards of {} over {} ranks", name_,
             send.numel(), recv.numel(), ranks);
  const int64_t shard = recv.numel();
  auto& s = scatter_state_[index];
  const int64_t segment = to_block(shard);
  if (s.ranks != ranks || s.shard != shard || !s.error.defined())
    lay_out_scatter(s, ranks, shard, send.options());
  if (s.error.device() != send.device()) s.error = s.error.to(send.device());
  auto padded = at::zeros({ranks, segment}, s.error.options());
  padded.narrow(1, 0, shard).copy_(send.view({ranks, shard}));
  s.send = at::empty({ranks, chunk_bytes(segment)}, s.error.options().dtype(at::kByte));
  s.recv = at::empty_like(s.send);
  compress(padded.view({-1}), s.error, s.send);
  s.error.view({ranks, segment}).narrow(1, shard, segment - shard).zero_();  // the padding
  return comm.all_to_all_async(s.recv, s.send);
}

void QuantizedAllReduceHook::finish_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                                   dist::Communicator& /*comm*/) {
  auto& s = scatter_state_.at(bucket.index);
  const auto mean = decompress(s.recv, s.segment).sum(0) / static_cast<double>(s.ranks);
  recv.copy_(mean.narrow(0, 0, s.shard));
  s.send = s.recv = at::Tensor();
}

std::map<std::string, at::Tensor> QuantizedAllReduceHook::state() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [index, s] : state_) {
    if (!s.error.defined()) continue;  // resharded, not laid out yet (no reduction since)
    out[bucket_state_key(index, "error")] = s.error;
    out[bucket_state_key(index, "server_error")] = s.server_error;
  }
  for (const auto& [index, s] : scatter_state_) {
    if (!s.error.defined()) continue;  // resharded, not laid out yet
    out[bucket_state_key(index, "scatter_error")] = s.error;
    out[bucket_state_key(index, "scatter_shard")] = at::scalar_tensor(s.shard, at::kLong);
  }
  return out;
}

void QuantizedAllReduceHook::load_state(const std::map<std::string, at::Tensor>& state) {
  state_.clear();
  scatter_state_.clear();
  for (const auto& [key, error] : state) {
    const auto scattered = bucket_of_key(key, "scatter_error");
    if (scattered) {
      const auto shard = state.find(bucket_state_key(*scattered, "scatter_shard"));
      LOOM_CHECK(shard != state.end() && shard->second.numel() == 1 && error.dim() == 1,
                 "{} hook state: bucket {}'s reduce-scatter error needs its shard size and one "
                 "dimension",
                 name_, *scattered);
      auto& s = scatter_state_[*scattered];
      s.shard = shard->second.item<int64_t>();
      s.segment = to_block(s.shard);
      LOOM_CHECK(s.segment > 0 && error.numel() % s.segment == 0,
                 "{} hook state: bucket {}'s reduce-scatter error ({} values) is not whole "
                 "shards of {} padded to {}",
                 name_, *scattered, error.numel(), s.shard, s.segment);
      s.ranks = error.numel() / s.segment;
      s.error = error.to(at::kFloat).contiguous().clone();
      continue;
    }
    const auto bucket = bucket_of_key(key, "error");
    if (!bucket) continue;
    const int64_t index = *bucket;
    const auto server = state.find(bucket_state_key(index, "server_error"));
    LOOM_CHECK(
        server != state.end() && server->second.dim() == 1 && error.dim() == 1 &&
            server->second.numel() > 0 && server->second.numel() % block_ == 0 &&
            error.numel() % server->second.numel() == 0,
        "{} hook state: bucket {}'s error ({} values) and server error ({}) do not fit "
        "together (the server error must be one segment, a multiple of {}, and the error "
        "whole segments)",
        name_, index, error.numel(),
        server == state.end() ? std::string("missing") : std::to_string(server->second.numel()),
        block_);
    auto& s = state_[index];
    s.segment = server->second.numel();
    s.ranks = error.numel() / s.segment;
    s.error = error.to(at::kFloat).contiguous().clone();
    s.server_error = server->second.to(at::kFloat).contiguous().clone();
  }
}

StateReshard QuantizedAllReduceHook::reshard_rule(const std::string& key) const {
  if (bucket_of_key(key, "server_error")) return StateReshard::kConcat;
  if (bucket_of_key(key, "scatter_error")) return StateReshard::kMean;
  return CommHook::reshard_rule(key);
}

void QuantizedAllReduceHook::load_resharded_state(const std::map<std::string, at::Tensor>& state) {
  state_.clear();
  scatter_state_.clear();
  for (const auto& [key, error] : state) {
    if (const auto scattered = bucket_of_key(key, "scatter_error")) {
      const auto shard_entry = state.find(bucket_state_key(*scattered, "scatter_shard"));
      const int64_t shard = shard_entry == state.end() || shard_entry->second.numel() != 1
                                ? 0
                                : shard_entry->second.item<int64_t>();
      const int64_t segment = to_block(shard);
      LOOM_CHECK(shard > 0 && error.dim() == 1 && error.numel() % segment == 0,
                 "{} hook state: bucket {}'s resharded reduce-scatter error ({} values) is not "
                 "whole shards of {} padded to the block",
                 name_, *scattered, error.numel(), shard);
      auto& s = scatter_state_[*scattered];  // ranks 0: laid out by lay_out_resharded
      s.resharded_error =
          error.to(at::kFloat).view({-1, segment}).narrow(1, 0, shard).reshape({-1}).clone();
      continue;
    }
    const auto bucket = bucket_of_key(key, "error");
    if (!bucket) continue;
    const auto server = state.find(bucket_state_key(*bucket, "server_error"));
    LOOM_CHECK(server != state.end() && server->second.dim() == 1 && error.dim() == 1,
               "{} hook state: bucket {}'s resharded error needs a 1-D server error beside it",
               name_, *bucket);
    auto& s = state_[*bucket];  // ranks 0: the next reduction lays it out
    s.resharded_error = error.to(at::kFloat).contiguous().clone();
    s.resharded_server_error = server->second.to(at::kFloat).contiguous().clone();
  }
}

std::map<std::string, at::Tensor> QuantizedAllReduceHook::group_values(
    const std::map<std::string, at::Tensor>& group,
    const std::map<int64_t, BucketShape>& buckets) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [index, shape] : buckets) {
    const int64_t n = shape.numel;
    const auto error = group.find(bucket_state_key(index, "error"));
    const auto scattered = group.find(bucket_state_key(index, "scatter_error"));
    if (error != group.end()) {
      const auto server = group.find(bucket_state_key(index, "server_error"));
      LOOM_CHECK(server != group.end(), "{} hook state: bucket {}'s error has no server error",
                 name_, index);
      out[bucket_state_key(index, "owed")] =
          leading_values(error->second, n, name_, index, "error") +
          leading_values(server->second, n, name_, index, "server error");
    } else if (scattered != group.end()) {
      const auto shard_entry = group.find(bucket_state_key(index, "scatter_shard"));
      const int64_t shard = shard_entry == group.end() || shard_entry->second.numel() != 1
                                ? 0
                                : shard_entry->second.item<int64_t>();
      const int64_t segment = to_block(shard);
      LOOM_CHECK(
          shard > 0 && scattered->second.dim() == 1 && scattered->second.numel() % segment == 0,
          "{} hook state: bucket {}'s reduce-scatter error ({} values) is not whole "
          "shards of {} padded to the block",
          name_, index, scattered->second.numel(), shard);
      const auto joined = scattered->second.view({-1, segment}).narrow(1, 0, shard).reshape({-1});
      out[bucket_state_key(index, "owed")] = leading_values(joined, n, name_, index, "error");
    }
  }
  return out;
}

void QuantizedAllReduceHook::load_group_values(const std::map<std::string, at::Tensor>& values,
                                               bool reduce_scatter) {
  state_.clear();
  scatter_state_.clear();
  for (auto& [index, error] : owed_by_bucket(values)) {
    if (reduce_scatter) {
      scatter_state_[index].resharded_error = std::move(error);
    } else {
      auto& s = state_[index];
      s.resharded_error = std::move(error);
      s.resharded_server_error = at::zeros({0}, at::kFloat);
    }
  }
}

at::Tensor QuantizedAllReduceHook::error(int64_t index) const {
  const auto it = state_.find(index);
  return it == state_.end() ? at::Tensor() : it->second.error;
}

at::Tensor QuantizedAllReduceHook::server_error(int64_t index) const {
  const auto it = state_.find(index);
  return it == state_.end() ? at::Tensor() : it->second.server_error;
}

at::Tensor QuantizedAllReduceHook::scatter_error(int64_t index) const {
  const auto it = scatter_state_.find(index);
  return it == scatter_state_.end() ? at::Tensor() : it->second.error;
}

// ---- int8: a chunk is the segment's codes, then its fp32 scales -------------------------

Int8CompressHook::Int8CompressHook() : QuantizedAllReduceHook("int8", ops::kInt8Block) {}

int64_t Int8CompressHook::chunk_bytes(int64_t segment) const {
  return segment + 4 * (segment / ops::kInt8Block);
}

void Int8CompressHook::compress(const at::Tensor& x, at::Tensor& error,
                                const at::Tensor& chunks) const {
  const int64_t rows = chunks.size(0), segment = x.numel() / rows;
  const auto q = ops::quantize_int8_with_feedback(x, error);
  chunks.narrow(1, 0, segment).copy_(q.codes.view({rows, segment}).view(at::kByte));
  chunks.narrow(1, segment, chunks.size(1) - segment)
      .copy_(q.scales.view({rows, -1}).view(at::kByte));
}

at::Tensor Int8CompressHook::decompress(const at::Tensor& chunks, int64_t segment) const {
  const auto codes = chunks.narrow(1, 0, segment).contiguous().view(at::kChar);
  const auto scales = chunks.narrow(1, segment, chunks.size(1) - segment).contiguous();
  return ops::dequantize_int8(codes, scales.view(at::kFloat));
}

// ---- onebit: a chunk is the segment's sign words, then its fp32 scales ------------------

OneBitCompressHook::OneBitCompressHook() : QuantizedAllReduceHook("onebit", ops::kSignBlock) {}

int64_t OneBitCompressHook::chunk_bytes(int64_t segment) const {
  return segment / 8 + 4 * (segment / ops::kSignBlock);
}

void OneBitCompressHook::compress(const at::Tensor& x, at::Tensor& error,
                                  const at::Tensor& chunks) const {
  const int64_t rows = chunks.size(0), segment = x.numel() / rows;
  const auto s = ops::pack_signs_with_feedback(x, error);
  chunks.narrow(1, 0, segment / 8).copy_(s.words.view({rows, -1}).view(at::kByte));
  chunks.narrow(1, segment / 8, chunks.size(1) - segment / 8)
      .copy_(s.scales.view({rows, -1}).view(at::kByte));
}

at::Tensor OneBitCompressHook::decompress(const at::Tensor& chunks, int64_t segment) const {
  const auto words = chunks.narrow(1, 0, segment / 8).contiguous().view(at::kInt);
  const auto scales = chunks.narrow(1, segment / 8, chunks.size(1) - segment / 8).contiguous();
  return ops::unpack_signs(words, scales.view(at::kFloat));
}

}  // namespace loom::parallel::data
