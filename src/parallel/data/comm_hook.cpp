#include "loom/parallel/data/comm_hook.h"

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <string_view>

#include "loom/core/error.h"
#include "loom/core/registry.h"
#include "loom/ops/quantize.h"
#include "loom/parallel/data/sparse_hook.h"

namespace loom::parallel::data {

std::string bucket_state_key(int64_t index, const std::string& what) {
  return fmt::format("b{}/{}", index, what);
}

std::optional<int64_t> bucket_of_error_key(const std::string& key) {
  constexpr std::string_view kSuffix = "/error";
  if (key.size() <= 1 + kSuffix.size() || key[0] != 'b' || !key.ends_with(kSuffix))
    return std::nullopt;
  const auto digits = std::string_view(key).substr(1, key.size() - 1 - kSuffix.size());
  int64_t index = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  if (ec != std::errc() || end != digits.data() + digits.size() || index < 0) return std::nullopt;
  return index;
}

dist::WorkPtr AllReduceAvgHook::start(GradBucket& bucket, dist::Communicator& comm) {
  return comm.all_reduce_async(bucket.buffer, dist::ReduceOp::Avg);
}

dist::WorkPtr Bf16CompressHook::start(GradBucket& bucket, dist::Communicator& comm) {
  // Scaling before rounding keeps the bf16 sum in range whatever the number of ranks.
  bucket.scratch = (bucket.buffer / static_cast<double>(comm.size())).to(at::kBFloat16);
  return comm.all_reduce_async(bucket.scratch, dist::ReduceOp::Sum);
}

void Bf16CompressHook::finish(GradBucket& bucket, dist::Communicator&) {
  bucket.buffer.copy_(bucket.scratch);
  bucket.scratch = at::Tensor();
}

// ---- int8 -------------------------------------------------------------------------------

namespace {

constexpr auto packed_bytes = Int8CompressHook::packed_bytes;

// Writes q's codes and scales into `row` (uint8, packed_bytes long).
void pack(const ops::Int8Blocks& q, const at::Tensor& row) {
  const int64_t n = q.codes.numel();
  row.narrow(0, 0, n).copy_(q.codes.view(at::kByte));
  row.narrow(0, n, 4 * q.scales.numel()).copy_(q.scales.contiguous().view(at::kByte));
}

// The values of packed chunks [rows, packed_bytes(segment)]: float32 [rows, segment].
at::Tensor unpack(const at::Tensor& packed, int64_t segment) {
  const int64_t rows = packed.size(0);
  const auto codes = packed.narrow(1, 0, segment).contiguous().view(at::kChar);
  const auto scales = packed.narrow(1, segment, 4 * (segment / Int8CompressHook::kBlock))
                          .contiguous()
                          .view(at::kFloat);
  return ops::dequantize_int8(codes.view({rows, segment}), scales.view({rows, -1}));
}

}  // namespace

int64_t Int8CompressHook::segment_numel(int64_t numel, int64_t ranks) {
  const int64_t per_rank = (numel + ranks - 1) / ranks;
  return (per_rank + kBlock - 1) / kBlock * kBlock;
}

dist::WorkPtr Int8CompressHook::start(GradBucket& bucket, dist::Communicator& comm) {
  const int64_t ranks = comm.size(), n = bucket.numel();
  auto& s = state_[bucket.index];
  if (s.ranks != ranks || s.segment != segment_numel(n, ranks)) {
    s.ranks = ranks;
    s.segment = segment_numel(n, ranks);
    s.error = at::zeros({ranks * s.segment}, bucket.buffer.options().dtype(at::kFloat));
    s.server_error = at::zeros({s.segment}, s.error.options());
  }
  // A checkpoint restores the errors on the host.
  if (s.error.device() != bucket.buffer.device()) {
    s.error = s.error.to(bucket.buffer.device());
    s.server_error = s.server_error.to(bucket.buffer.device());
  }
  auto padded = at::zeros_like(s.error);
  padded.narrow(0, 0, n).copy_(bucket.buffer);
  const auto q = ops::quantize_int8_with_feedback(padded, s.error);
  const int64_t bytes = packed_bytes(s.segment);
  s.send = at::empty({ranks, bytes}, s.error.options().dtype(at::kByte));
  s.recv = at::empty_like(s.send);
  const auto codes = q.codes.view({ranks, s.segment});
  const auto scales = q.scales.view({ranks, -1});
  for (int64_t j = 0; j < ranks; ++j) pack({codes[j], scales[j]}, s.send[j]);
  return comm.all_to_all_async(s.recv, s.send);
}

void Int8CompressHook::finish(GradBucket& bucket, dist::Communicator& comm) {
  auto& s = state_.at(bucket.index);
  // This rank's segment: the mean of every rank's dequantized chunk.
  const auto mean = unpack(s.recv, s.segment).sum(0) / static_cast<double>(s.ranks);
  const auto q = ops::quantize_int8_with_feedback(mean, s.server_error);
  auto mine = at::empty({packed_bytes(s.segment)}, s.send.options());
  pack(q, mine);
  auto gathered = at::empty({s.ranks, mine.numel()}, mine.options());
  comm.all_gather(gathered, mine);
  bucket.buffer.copy_(unpack(gathered, s.segment).view({-1}).narrow(0, 0, bucket.numel()));
  s.send = s.recv = at::Tensor();
}

std::map<std::string, at::Tensor> Int8CompressHook::state() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [index, s] : state_) {
    out[bucket_state_key(index, "error")] = s.error;
    out[bucket_state_key(index, "server_error")] = s.server_error;
  }
  return out;
}

void Int8CompressHook::load_state(const std::map<std::string, at::Tensor>& state) {
  state_.clear();
  for (const auto& [key, error] : state) {
    const auto bucket = bucket_of_error_key(key);
    if (!bucket) continue;
    const int64_t index = *bucket;
    const auto server = state.find(bucket_state_key(index, "server_error"));
    LOOM_CHECK(
        server != state.end() && server->second.dim() == 1 && error.dim() == 1 &&
            server->second.numel() > 0 && server->second.numel() % kBlock == 0 &&
            error.numel() % server->second.numel() == 0,
        "int8 hook state: bucket {}'s error ({} values) and server error ({}) do not fit "
        "together (the server error must be one segment, a multiple of {}, and the error "
        "whole segments)",
        index, error.numel(),
        server == state.end() ? std::string("missing") : std::to_string(server->second.numel()),
        kBlock);
    auto& s = state_[index];
    s.segment = server->second.numel();
    s.ranks = error.numel() / s.segment;
    s.error = error.to(at::kFloat).contiguous().clone();
    s.server_error = server->second.to(at::kFloat).contiguous().clone();
  }
}

at::Tensor Int8CompressHook::error(int64_t index) const {
  const auto it = state_.find(index);
  return it == state_.end() ? at::Tensor() : it->second.error;
}

at::Tensor Int8CompressHook::server_error(int64_t index) const {
  const auto it = state_.find(index);
  return it == state_.end() ? at::Tensor() : it->second.server_error;
}

namespace {

using Registry = core::NamedRegistry<CommHookFactory>;

Registry& registry() {
  static Registry r("communication hook");
  static const bool built_in = [] {
    r.add("avg",
          [](const core::OptionSpec& spec) { return detail::make_hook<AllReduceAvgHook>(spec); });
    r.add("bf16",
          [](const core::OptionSpec& spec) { return detail::make_hook<Bf16CompressHook>(spec); });
    r.add("int8",
          [](const core::OptionSpec& spec) { return detail::make_hook<Int8CompressHook>(spec); });
    r.add("topk", [](const core::OptionSpec& spec) { return SparseCompressHook::topk(spec); });
    r.add("threshold",
          [](const core::OptionSpec& spec) { return SparseCompressHook::threshold(spec); });
    return true;
  }();
  (void)built_in;
  return r;
}

}  // namespace

void register_comm_hook(const std::string& name, CommHookFactory factory) {
  registry().add(name, std::move(factory));
}

std::vector<std::string> comm_hook_names() {
  return registry().names();
}

std::shared_ptr<CommHook> make_comm_hook(const std::string& text) {
  const auto spec = core::OptionSpec::parse(text, "--comm-hook");
  const auto factory = registry().find(spec.name);
  LOOM_CHECK(factory, "--comm-hook '{}': '{}' is not a known communication hook; valid: {}", text,
             spec.name, fmt::join(comm_hook_names(), ", "));
  auto hook = factory(spec);
  LOOM_CHECK(hook != nullptr, "the factory of communication hook '{}' returned nothing", spec.name);
  return hook;
}

}  // namespace loom::parallel::data
