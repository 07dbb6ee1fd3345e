#pragma once
// Megatron-style tensor-parallel layers. Each holds only its rank's piece of the weight and
// describes that piece with a ShardSpec, so the model it belongs to can be initialized,
// checkpointed and exported as the single-process model it equals. At tp = 1 each layer is
// exactly its plain twin (nn::Linear, nn::Embedding) and issues no collective.
//
// A column-parallel layer splits its output features: its input must already be inside the
// tensor-parallel region (enter_tp_region, done once by the caller for all the layers that
// read the same input, e.g. Llama's q/k/v or gate/up), and its output stays sharded. A
// row-parallel layer splits its input features, takes the sharded activation, and leaves the
// region itself (all-reduce, or reduce-scatter along the sequence) before adding its bias,
// so the bias is added once. A layer given no group (null) is built for tp = 1.
#include <torch/nn/module.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/ops/sparse_linear.h"
#include "loom/parallel/tensor/shard_spec.h"
#include "loom/parallel/tensor/tp_group.h"

namespace loom::parallel::tensor {

// A module whose own parameters (not its children's) are sharded, with their layouts.
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;
  // Keyed by the parameter's local name ("weight", "bias").
  virtual std::map<std::string, ShardSpec> shard_specs() const = 0;
};

// A linear layer whose weight the prune strategy may prune: the product it then takes
// (ops/sparse_linear.h: a sparse kernel where the mask shape has one on the input's device, else
// the masked dense product), chosen per call; the log says which, once per layer and whenever it
// changes. With the default format (dense) it is at::linear.
class PrunableLinear {
 public:
  virtual ~PrunableLinear() = default;
  // `name` is what the log calls the layer (its parameter-name prefix).
  void set_sparse_format(const ops::SparseLinearFormat& format, std::string name) {
    format_ = format;
    what_ = std::move(name);
    logged_ = false;
  }
  const ops::SparseLinearFormat& sparse_format() const { return format_; }
  // The path of the last product (kDense before any format is set).
  ops::SparseLinearPath last_path() const { return last_path_; }

 protected:
  explicit PrunableLinear(std::string what) : what_(std::move(what)) {}
  // x weight^T (+ bias, in the product's dtype).
  at::Tensor product(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias);

 private:
  std::string what_;
  ops::SparseLinearFormat format_;
  ops::SparseLinearPath last_path_ = ops::SparseLinearPath::kDense;
  bool logged_ = false;
};

struct ColumnParallelOptions {
  bool bias = true;
  int64_t parts = 1;       // fused projections split part by part (GPT-2's q, k, v: 3)
  int64_t units = 0;       // heads per part; rows split evenly when 0
  int64_t padded_out = 0;  // output features padded to this (a vocabulary head); 0: none
};

class ColumnParallelLinear : public torch::nn::Module, public ShardedModule, public PrunableLinear {
 public:
  // Throws loom::Error naming `what` when tp cannot split the output this way.
  ColumnParallelLinear(int64_t in, int64_t out, TpGroupPtr tp, ColumnParallelOptions options,
                       const std::string& what);
  // x: [..., in], already inside the TP region. Returns [..., out / tp] (this rank's features).
  at::Tensor forward(const at::Tensor& x);
  // x W^T without the bias, for a caller that adds `bias` in what follows (ops::bias_gelu_tanh,
  // ops::attention_packed).
  at::Tensor forward_without_bias(const at::Tensor& x);
  std::map<std::string, ShardSpec> shard_specs() const override;

  at::Tensor weight, bias;  // [out / tp, in], [out / tp]

 private:
  TpGroupPtr tp_;
  ShardSpec spec_;
};

class RowParallelLinear : public torch::nn::Module, public ShardedModule, public PrunableLinear {
 public:
  // units: heads the input features are grouped in (0: rows split evenly).
  RowParallelLinear(int64_t in, int64_t out, TpGroupPtr tp, bool bias, int64_t units,
                    const std::string& what);
  // x: [batch, seq, in / tp] (this rank's features). Returns [batch, seq, out], summed across
  // the group; with sequence parallelism [batch, seq / tp, out], this rank's sequence chunk.
  at::Tensor forward(const at::Tensor& x);
  std::map<std::string, ShardSpec> shard_specs() const override;

  at::Tensor weight, bias;  // [out, in / tp], [out] (replicated)

 private:
  TpGroupPtr tp_;
  ShardSpec spec_;
};

// A block-diagonal linear layer (Wei et al. 2024, structured FFN): `blocks` independent
// products, block i mapping input features [i in/B, (i+1) in/B) to output features
// [i out/B, (i+1) out/B): 1/B of a dense layer's weights and FLOPs. Tensor parallelism gives each
// rank B/tp whole blocks (B a multiple of tp), so a rank needs only its slice of the input and
// makes only its slice of the output: no partial sums, no all-reduce (enter_feature_blocks /
// exit_feature_blocks move the activations). Not prunable.
class BlockDiagonalLinear : public torch::nn::Module, public ShardedModule {
 public:
  // Throws loom::Error naming `what` and the values when blocks < 1, blocks does not divide in
  // and out, or tp does not divide blocks.
  BlockDiagonalLinear(int64_t in, int64_t out, int64_t blocks, TpGroupPtr tp, bool bias,
                      const std::string& what);
  // x: [..., in / tp] (this rank's blocks' input features). Returns [..., out / tp].
  at::Tensor forward(const at::Tensor& x);
  std::map<std::string, ShardSpec> shard_specs() const override;

  // [blocks / tp, out / blocks, in / blocks], [out / tp]
  at::Tensor weight, bias;

 private:
  TpGroupPtr tp_;
  ShardSpec weight_spec_, bias_spec_;
};

// A low-rank linear layer (Wei et al. 2024's second structure): the weight as the product of
// two factors, W = u v (u: [out, rank], v: [rank, in]), rank (in + out) weights instead of
// in out. Two placements for tensor parallelism, as the dense column- and row-parallel layers:
//  - LowRankColumnLinear (the MLP's first linears): v replicated, u and the bias split by output
//    rows. The input is inside the TP region (replicated or sequence-gathered): x v^T is the
//    same on every rank, and each rank's gradient of v is partial (its rows of u), summed across
//    tp after backward (ShardSpec::grad_partial, PartialGradSync): no collective of its own.
//  - LowRankRowLinear (the MLP's last linear): v split by input features, u and the bias
//    replicated. Each rank's x v^T is a partial sum of `rank` values per token, leaving the
//    region there (all-reduced; reduce-scattered with sequence parallelism), and u is applied
//    after: the MLP's forward all-reduce carries rank values per token instead of d_model (its
//    backward all-reduce, at the region's entry, still d_model).
// Parameters "u", "v" (and "bias"). Not prunable.
class LowRankColumnLinear : public torch::nn::Module, public ShardedModule {
 public:
  // Throws loom::Error naming `what` when rank < 1 or tp does not divide out.
  LowRankColumnLinear(int64_t in, int64_t out, int64_t rank, TpGroupPtr tp, bool bias,
                      const std::string& what);
  // x: [..., in], inside the TP region. Returns [..., out / tp].
  at::Tensor forward(const at::Tensor& x);
  std::map<std::string, ShardSpec> shard_specs() const override;

  at::Tensor u, v, bias;  // [out / tp, rank], [rank, in], [out / tp]

 private:
  TpGroupPtr tp_;
  ShardSpec split_;
};

class LowRankRowLinear : public torch::nn::Module, public ShardedModule {
 public:
  // Throws loom::Error naming `what` when rank < 1 or tp does not divide in.
  LowRankRowLinear(int64_t in, int64_t out, int64_t rank, TpGroupPtr tp, bool bias,
                   const std::string& what);
  // x: [batch, seq, in / tp] (this rank's features). Returns [batch, seq, out], summed across
  // the group; with sequence parallelism [batch, seq / tp, out], this rank's sequence chunk.
  at::Tensor forward(const at::Tensor& x);
  std::map<std::string, ShardSpec> shard_specs() const override;

  at::Tensor u, v, bias;  // [out, rank], [rank, in / tp], [out]

 private:
  TpGroupPtr tp_;
  ShardSpec split_;
};

// Embedding table split by vocabulary rows, padded to TpGroup::padded_vocab(vocab).
class VocabParallelEmbedding : public torch::nn::Module, public ShardedModule {
 public:
  VocabParallelEmbedding(int64_t vocab, int64_t dim, TpGroupPtr tp);
  // tokens: [batch, seq] ids < vocab. Returns [batch, seq, dim]; with sequence parallelism
  // [batch, seq / tp, dim] (this rank's chunk).
  at::Tensor forward(const at::Tensor& tokens);
  std::map<std::string, ShardSpec> shard_specs() const override;
  // First vocabulary row this rank holds.
  int64_t vocab_start() const { return tp_->rank() * weight.size(0); }

  at::Tensor weight;  // [padded_vocab / tp, dim]

 private:
  TpGroupPtr tp_;
  ShardSpec spec_;
};

// The layout of every parameter of `root`, keyed as root.named_parameters() names them.
// Parameters of plain modules are replicated; with sequence parallelism their gradients are
// marked partial (they act on sequence shards).
std::map<std::string, ShardSpec> collect_shard_specs(const torch::nn::Module& root,
                                                     bool sequence_parallel);

}  // namespace loom::parallel::tensor
