#include "loom/parallel/tensor/layers.h"

#include <ATen/ATen.h>

#include <spdlog/spdlog.h>

#include "loom/core/error.h"
#include "loom/parallel/tensor/mappings.h"

namespace loom::parallel::tensor {

namespace {

// LibTorch's default Linear/Embedding initialization does not matter: models overwrite every
// parameter layout-invariantly. Zeros keep construction cheap and deterministic.
at::Tensor zeros(std::vector<int64_t> shape) {
  return at::zeros(shape);
}

// A layer built without a group is its single-process twin.
TpGroupPtr or_single(TpGroupPtr tp) {
  return tp ? std::move(tp) : std::make_shared<TpGroup>();
}

}  // namespace

ColumnParallelLinear::ColumnParallelLinear(int64_t in, int64_t out, TpGroupPtr tp,
                                           ColumnParallelOptions options, const std::string& what)
    : PrunableLinear(what), tp_(or_single(std::move(tp))) {
  spec_.dim = 0;
  spec_.full = out;
  spec_.padded = options.padded_out;
  spec_.parts = options.parts;
  spec_.units = options.units;
  spec_.check(tp_->size(), what);
  const int64_t local = spec_.local_size(tp_->size());
  weight = register_parameter("weight", zeros({local, in}));
  if (options.bias) bias = register_parameter("bias", zeros({local}));
}

at::Tensor PrunableLinear::product(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias) {
  if (format_.kind == ops::SparseLinearFormat::Kind::kDense) return at::linear(x, weight, bias);
  const auto choice = ops::choose_sparse_linear(x, weight, format_);
  if (!logged_ || choice.path != last_path_) spdlog::info("{}: {}", what_, ops::describe(choice));
  logged_ = true;
  last_path_ = choice.path;
  if (choice.path == ops::SparseLinearPath::kMaskedDense) return at::linear(x, weight, bias);
  auto y = ops::sparse_linear(x, weight, format_, choice);
  return bias ? y + bias->to(y.scalar_type()) : y;
}

at::Tensor ColumnParallelLinear::forward(const at::Tensor& x) {
  return product(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

at::Tensor ColumnParallelLinear::forward_without_bias(const at::Tensor& x) {
  return product(x, weight, std::nullopt);
}

BlockDiagonalLinear::BlockDiagonalLinear(int64_t in, int64_t out, int64_t blocks, TpGroupPtr tp,
                                         bool bias_on, const std::string& what)
    : tp_(or_single(std::move(tp))) {
  const int64_t ranks = tp_->size();
  LOOM_CHECK(blocks >= 1 && in % blocks == 0 && out % blocks == 0,
             "{}: {} blocks must be at least 1 and divide its {} input and {} output features",
             what, blocks, in, out);
  LOOM_CHECK(blocks % ranks == 0,
             "{}: {} blocks cannot be split evenly across tp = {} ranks (each rank holds whole "
             "blocks: the number of blocks must be a multiple of tp)",
             what, blocks, ranks);
  weight_spec_.dim = 0;
  weight_spec_.full = blocks;
  bias_spec_.dim = 0;
  bias_spec_.full = out;
  weight = register_parameter("weight", zeros({blocks / ranks, out / blocks, in / blocks}));
  if (bias_on) bias = register_parameter("bias", zeros({out / ranks}));
}

at::Tensor BlockDiagonalLinear::forward(const at::Tensor& x) {
  const int64_t local = weight.size(0), block_in = weight.size(2);
  LOOM_CHECK(x.size(-1) == local * block_in,
             "block-diagonal layer: input has {} features; this rank's {} blocks take {}",
             x.size(-1), local, local * block_in);
  auto lead = x.sizes().vec();
  lead.pop_back();
  // [..., local, block_in] x [local, block_out, block_in]^T -> [..., local, block_out]
  auto xb = x.reshape({-1, local, block_in}).transpose(0, 1);    // [local, N, block_in]
  auto y = at::bmm(xb, weight.transpose(1, 2)).transpose(0, 1);  // [N, local, block_out]
  lead.push_back(local * weight.size(1));
  y = y.reshape(lead);
  return bias.defined() ? y + bias.to(y.scalar_type()) : y;
}

std::map<std::string, ShardSpec> BlockDiagonalLinear::shard_specs() const {
  std::map<std::string, ShardSpec> out{{"weight", weight_spec_}};
  if (bias.defined()) out.emplace("bias", bias_spec_);
  return out;
}

LowRankColumnLinear::LowRankColumnLinear(int64_t in, int64_t out, int64_t rank, TpGroupPtr tp,
                                         bool bias_on, const std::string& what)
    : tp_(or_single(std::move(tp))) {
  LOOM_CHECK(rank >= 1, "{}: low rank {} must be at least 1", what, rank);
  split_.dim = 0;
  split_.full = out;
  split_.check(tp_->size(), what);
  const int64_t local = split_.local_size(tp_->size());
  u = register_parameter("u", zeros({local, rank}));
  v = register_parameter("v", zeros({rank, in}));
  if (bias_on) bias = register_parameter("bias", zeros({local}));
}

at::Tensor LowRankColumnLinear::forward(const at::Tensor& x) {
  return at::linear(at::linear(x, v), u,
                    bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

std::map<std::string, ShardSpec> LowRankColumnLinear::shard_specs() const {
  ShardSpec shared;
  shared.grad_partial = true;  // every rank's gradient holds its own rows of u's part
  std::map<std::string, ShardSpec> out{{"u", split_}, {"v", shared}};
  if (bias.defined()) out.emplace("bias", split_);
  return out;
}

LowRankRowLinear::LowRankRowLinear(int64_t in, int64_t out, int64_t rank, TpGroupPtr tp,
                                   bool bias_on, const std::string& what)
    : tp_(or_single(std::move(tp))) {
  LOOM_CHECK(rank >= 1, "{}: low rank {} must be at least 1", what, rank);
  split_.dim = 1;
  split_.full = in;
  split_.check(tp_->size(), what);
  u = register_parameter("u", zeros({out, rank}));
  v = register_parameter("v", zeros({rank, split_.local_size(tp_->size())}));
  if (bias_on) bias = register_parameter("bias", zeros({out}));
}

at::Tensor LowRankRowLinear::forward(const at::Tensor& x) {
  auto z = at::linear(x, v);
  if (tp_->size() > 1) z = exit_tp_region(z, *tp_, 1);  // rank values per token
  return at::linear(z, u, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

std::map<std::string, ShardSpec> LowRankRowLinear::shard_specs() const {
  // u and the bias act after the exit: on sequence shards with sequence parallelism.
  ShardSpec after_exit;
  after_exit.grad_partial = tp_->sequence_parallel();
  std::map<std::string, ShardSpec> out{{"v", split_}, {"u", after_exit}};
  if (bias.defined()) out.emplace("bias", after_exit);
  return out;
}

std::map<std::string, ShardSpec> ColumnParallelLinear::shard_specs() const {
  std::map<std::string, ShardSpec> out{{"weight", spec_}};
  if (bias.defined()) out.emplace("bias", spec_);
  return out;
}

RowParallelLinear::RowParallelLinear(int64_t in, int64_t out, TpGroupPtr tp, bool bias_on,
                                     int64_t units, const std::string& what)
    : PrunableLinear(what), tp_(or_single(std::move(tp))) {
  spec_.dim = 1;
  spec_.full = in;
  spec_.units = units;
  spec_.check(tp_->size(), what);
  LOOM_CHECK(spec_.replicas(tp_->size()) == 1,
             "{}: the input features of a row-parallel layer cannot be replicated ({} units over "
             "tp = {})",
             what, units, tp_->size());
  weight = register_parameter("weight", zeros({out, spec_.local_size(tp_->size())}));
  if (bias_on) bias = register_parameter("bias", zeros({out}));
}

at::Tensor RowParallelLinear::forward(const at::Tensor& x) {
  const auto b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  if (tp_->size() == 1) return product(x, weight, b);  // exactly nn::Linear when dense
  // The bias is added once, after the sum, in the activation's dtype (bf16 under autocast, as
  // nn::Linear would).
  auto y = exit_tp_region(product(x, weight, std::nullopt), *tp_, 1);
  return b ? y + b->to(y.scalar_type()) : y;
}

std::map<std::string, ShardSpec> RowParallelLinear::shard_specs() const {
  std::map<std::string, ShardSpec> out{{"weight", spec_}};
  if (bias.defined()) {
    ShardSpec replicated;
    replicated.grad_partial = tp_->sequence_parallel();  // added to sequence shards
    out.emplace("bias", replicated);
  }
  return out;
}

VocabParallelEmbedding::VocabParallelEmbedding(int64_t vocab, int64_t dim, TpGroupPtr tp)
    : tp_(or_single(std::move(tp))) {
  spec_.dim = 0;
  spec_.full = vocab;
  const int64_t padded = tp_->padded_vocab(vocab);
  spec_.padded = padded > vocab ? padded : 0;
  spec_.check(tp_->size(), "embedding");
  weight = register_parameter("weight", zeros({spec_.local_size(tp_->size()), dim}));
}

at::Tensor VocabParallelEmbedding::forward(const at::Tensor& tokens) {
  if (tp_->size() == 1) return at::embedding(weight, tokens);
  // Ids outside this rank's rows look up row 0 and are zeroed; the sum across the group then
  // holds every id's row exactly once.
  const int64_t start = vocab_start(), rows = weight.size(0);
  auto outside = (tokens < start).logical_or(tokens >= start + rows);
  auto local = (tokens - start).masked_fill(outside, 0);
  auto emb = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return exit_tp_region(emb, *tp_, 1);
}

std::map<std::string, ShardSpec> VocabParallelEmbedding::shard_specs() const {
  return {{"weight", spec_}};
}

std::map<std::string, ShardSpec> collect_shard_specs(const torch::nn::Module& root,
                                                     bool sequence_parallel) {
  std::map<std::string, ShardSpec> out;
  auto add = [&](const std::string& prefix, const torch::nn::Module& module) {
    const auto* sharded = dynamic_cast<const ShardedModule*>(&module);
    const auto specs = sharded ? sharded->shard_specs() : std::map<std::string, ShardSpec>{};
    for (const auto& param : module.named_parameters(/*recurse=*/false)) {
      const auto name = prefix.empty() ? param.key() : prefix + "." + param.key();
      ShardSpec spec;
      if (sharded) {
        auto it = specs.find(param.key());
        LOOM_CHECK(it != specs.end(), "parallel module '{}' has no layout for parameter '{}'",
                   prefix, param.key());
        spec = it->second;
      } else {
        spec.grad_partial = sequence_parallel;
      }
      out.emplace(name, spec);
    }
  };
  // The root by reference (it may live on the stack), then its descendants.
  add("", root);
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false))
    add(item.key(), *item.value());
  return out;
}

}  // namespace loom::parallel::tensor
