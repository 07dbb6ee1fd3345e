#pragma once
// The interface every loom language model implements, and what is common to all of them:
// construction from a config and a tensor-parallel group, layout-invariant initialization, the
// next-token loss, and the way between the sharded parameters and the single-process ones.
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "loom/models/config.h"
#include "loom/ops/attention.h"
#include "loom/ops/attention_choice.h"
#include "loom/ops/cross_entropy.h"
#include "loom/ops/linear_cross_entropy.h"
#include "loom/ops/norm.h"
#include "loom/ops/swiglu.h"
#include "loom/parallel/context/context_group.h"
#include "loom/parallel/memory/activation_offload.h"
#include "loom/parallel/tensor/shard_spec.h"
#include "loom/parallel/tensor/tp_group.h"

namespace loom::models {

// How one parameter is initialized.
struct ParamInit {
  // kKeep: the value the module was built with stays (a custom model's own initialization).
  enum class Kind { kZeros, kOnes, kNormal, kKeep } kind = Kind::kNormal;
  double std = 0.0;  // for kNormal
};

// What a model recomputes in backward instead of keeping.
//   kNone       everything is kept.
//   kFull       each transformer block keeps only its input; the block runs again in backward.
//   kSelective  only the attention core (q·kᵀ, softmax, dropout, ·v) runs again, as Megatron's
//               selective recompute: the [batch, heads, seq, seq] scores, probabilities and
//               dropout mask are not kept, the projections' and MLP's activations are.
enum class ActivationCheckpointing { kNone, kFull, kSelective };
std::string to_string(ActivationCheckpointing mode);
// "none" | "full" | "selective"; anything else is a loom::Error naming it and the valid values.
ActivationCheckpointing parse_activation_checkpointing(const std::string& name);

// How the blocks of a model execute: owned by the model, shared with its blocks, so a setting
// changed on the model reaches every block.
struct BlockExecution {
  ActivationCheckpointing checkpointing = ActivationCheckpointing::kNone;
  // With kFull: where the blocks' saved inputs wait for backward (null: on their device).
  std::shared_ptr<parallel::memory::ActivationOffloader> offload;
  // Which implementation computes the blocks' attention (kAuto: the fused kernel on CUDA).
  ops::AttentionBackend attention = ops::AttentionBackend::kAuto;
  // With kAuto: measures loom's kernel against SDPA per shape (null: loom's kernel where it
  // takes the inputs).
  std::shared_ptr<ops::AttentionChooser> attention_chooser;
  // Which implementation computes the norms and the residual adds fused with them (kAuto: the
  // fused kernels on CUDA).
  ops::NormBackend norm = ops::NormBackend::kAuto;
  // Which implementation computes gated activations (Llama's SwiGLU; kAuto: the fused kernels on
  // CUDA). GPT-2's GELU is not gated and does not ask.
  ops::ActivationBackend activation = ops::ActivationBackend::kAuto;
  // With 2 or more ranks: the group the sequences are split over; attention runs as ring
  // attention over it (parallel/context/ring_attention.h). Null: the whole sequence is here.
  parallel::context::ContextGroupPtr context;
};
using BlockExecutionPtr = std::shared_ptr<const BlockExecution>;

// The slice of a model that one pipeline stage holds: blocks [first_layer, end_layer), plus the
// token embedding when it is the first part and the final norm and output head when it is the
// last. Parameter names stay those of the whole model ("transformer.h.5.attn.c_attn.weight"), so
// initialization, checkpoints and Hugging Face export do not depend on how the model is split.
// A last part whose head is tied to the embedding holds its own copy of the embedding weight
// (same name, same initial values); the pipeline sums the two copies' gradients every step.
struct ModelPart {
  int64_t first_layer = 0;
  int64_t end_layer = -1;  // -1: through the last layer
  bool first = true;       // holds the embedding: its input is token ids [batch, seq]
  bool last = true;        // holds the final norm and the head: its output is logits

  // The whole model of `n_layers` layers?
  bool whole(int64_t n_layers) const {
    return first && last && first_layer == 0 && (end_layer < 0 || end_layer == n_layers);
  }
  // "layers 2-5 (+ head)", for logs and errors.
  std::string describe(int64_t n_layers) const;
};

class CausalLM : public torch::nn::Module {
 public:
  // tp null: one process (tp = 1, no collectives). With tp > 1 every rank of the group builds
  // the model with the same config and runs every forward on the same tokens.
  // `part`: the slice this object holds (default: the whole model); its layer range is checked
  // against the config with a loom::Error naming both.
  CausalLM(ModelConfig config, parallel::tensor::TpGroupPtr tp, ModelPart part = {});
  const ModelConfig& config() const { return config_; }
  // The slice held, end_layer resolved.
  const ModelPart& part() const { return part_; }
  bool is_whole() const { return part_.whole(config_.n_layers); }
  parallel::tensor::TpGroup& tp() const { return *tp_; }
  const parallel::tensor::TpGroupPtr& tp_ptr() const { return tp_; }
  // Rows of the vocabulary as the output head holds them (padded for tp; see TpOptions).
  int64_t padded_vocab() const { return tp_->padded_vocab(config_.vocab_size); }

  // tokens: [batch, seq] int64 ids < vocab_size, seq <= max_seq_len (with sequence
  // parallelism also a multiple of tp). Returns this rank's vocabulary shard of the logits:
  // [batch, seq, padded_vocab / tp] in the model's compute dtype. Needs the whole model.
  at::Tensor logits_shard(const at::Tensor& tokens);
  // This part's forward: its input is token ids when part().first, else the hidden states
  // [batch, seq, d_model] the previous part returned (with sequence parallelism, this rank's
  // chunk of the sequence); it returns the logits shard when part().last, else hidden states.
  // `tokens`: the micro-batch's token ids, which a part that is not the first needs under a
  // document mask (set_document_mask) to know where its documents begin.
  at::Tensor forward_part(const at::Tensor& input, const at::Tensor& tokens = {});
  // Mean next-token loss from this rank's logits shard (what a last part returns) against
  // targets [batch, seq], in fp32.
  virtual at::Tensor loss_from_logits(const at::Tensor& logits_shard, const at::Tensor& targets);
  // A last part's forward and mean loss in one call: forward_part(input, tokens), then
  // loss_from_logits of its logits against targets, except that the head may run in chunks of
  // rows together with the loss (set_loss_chunk_rows) so that the whole logits never exist; and
  // the fused loss's backward may write its gradient over the logits (nothing else holds them).
  // loss() is this on a whole model; a pipeline's last stage calls it. loom::Error on a part
  // that is not the last.
  at::Tensor part_loss(const at::Tensor& input, const at::Tensor& tokens,
                       const at::Tensor& targets);
  // How part_loss (and so loss()) holds the logits: rows > 0: the head's product and the loss
  // run that many rows of logits at a time (ops/linear_cross_entropy.h: the gradients are made
  // in the forward, d head weight held in fp32 until backward); 0: whole logits, as
  // loss_from_logits takes them; kAutoLossChunks (the default): chunks only where one forward's
  // logits shard would pass 2 GiB, each chunk's logits at most 1 GiB. GPT-2 and Llama take
  // it; a custom model's head is its own, so it takes only 0 and kAuto (whole logits).
  // loom::Error for another value, naming it.
  static constexpr int64_t kAutoLossChunks = ops::kAutoChunkRows;
  void set_loss_chunk_rows(int64_t rows);
  int64_t loss_chunk_rows() const { return loss_chunk_rows_; }
  // The rows per chunk part_loss uses for a forward of `rows` rows on `device` (0: whole logits).
  // loom::Error for a number of rows with the math loss backend (chunks run the fused passes).
  int64_t resolved_loss_chunk_rows(int64_t rows, at::Device device);
  // How many losses this model has computed with the head in chunks (for logs and tests).
  int64_t chunked_losses() const { return chunked_losses_; }
  // The parameter a last part holds as its own copy of the first part's tied embedding (its
  // gradient must be summed with the first part's), or "" when there is none.
  std::string tied_embedding_copy() const;
  // Parameters other parts of the model hold too (a tied embedding on the first and last
  // stages, a shared block used on several stages): their gradients are summed over the parts
  // holding them every step, and their copies stay equal. Empty for a whole model.
  std::vector<std::string> shared_across_parts() const;
  // Of those, the ones another part counts (the tied embedding's copy on the last part, a shared
  // block whose first use lies on an earlier part): left out of gradient norms here.
  bool is_copy(const std::string& name) const;
  // The pipeline stages that hold parameter `name` (one this part holds), for a model split at
  // `bounds` (stage s holds layers [bounds[s], bounds[s + 1])).
  std::vector<int64_t> stages_holding(const std::string& name,
                                      const std::vector<int64_t>& bounds) const;
  // The name of the token embedding's weight (which the head reuses when embeddings are tied).
  virtual std::string embedding_weight_name() const = 0;
  // The whole logits [batch, seq, vocab_size] (gathered across tp, padding dropped). Refused under
  // context parallelism (a rank holds part of each sequence).
  at::Tensor forward(const at::Tensor& tokens);
  // Mean next-token cross-entropy of tokens against targets [batch, seq], in fp32, computed
  // from the vocabulary shards without assembling the whole logits. While training a model with
  // multi-token heads (ModelConfig::mtp_heads), plus each head's weighted loss (below).
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets);

  // Per-row losses, for per-source training metrics: while on, each loss_from_logits() of a
  // training forward (and so each loss()) also records, without gradient, each row's next-token
  // cross-entropy summed over its tokens — the z-loss and the multi-token heads left out; under
  // context parallelism over this rank's part of the sequence — computed again from the logits
  // (parallel/tensor's vocab_parallel_token_losses, an extra pass over them). Recorded on tp
  // rank 0 of the group only (its other ranks compute the same values). Off by default.
  void set_record_row_losses(bool on) { record_row_losses_ = on; }
  struct RowLosses {
    at::Tensor sums;         // [batch] fp64, on the logits' device
    int64_t tokens_per_row;  // the tokens each row's sum is over
  };
  // The rows' losses recorded since the last call, one entry per loss_from_logits() in call
  // order; clears them.
  std::vector<RowLosses> take_row_losses() { return std::exchange(row_losses_, {}); }

  // Multi-token prediction. While training, loss() and loss_from_logits() add, for each extra
  // head k = 1..mtp_heads, weight_k x the mean cross-entropy of its logits at position t against
  // the token k + 1 places ahead (targets[t + k]; the last k positions have none). The heads'
  // forwards and backwards run one after another (parallel/memory checkpoint_sum): the logits of
  // only one head exist at a time, for one more forward of each head in backward. In eval mode
  // the loss is the next-token loss alone. Default weights: 1 each (the paper's plain sum); a
  // head of weight 0 is not run and gets no gradient. Throws loom::Error unless there is one
  // finite weight >= 0 per head.
  void set_mtp_loss_weights(std::vector<double> weights);
  const std::vector<double>& mtp_loss_weights() const { return mtp_weights_; }
  // Each extra head's own (unweighted) loss, the mean over the training forwards since the last
  // call, as a [mtp_heads] fp64 tensor on the model's device (a head of weight 0: 0); undefined
  // when no such forward ran here (a part without the heads). Resets the means.
  at::Tensor take_mtp_losses();
  // The main head's whole logits [batch, seq, vocab_size] and each extra head's (head k's at
  // position t predict the token k + 1 places ahead), gathered across tp; what self-speculative
  // decoding drafts and verifies with. Needs the whole model, heads, and cp 1.
  std::vector<at::Tensor> forward_heads(const at::Tensor& tokens);

  // The rule for the parameter with this fully-qualified name (as named_parameters() spells
  // it). Throws loom::Error for a name the model does not own.
  virtual ParamInit init_for(const std::string& name) const = 0;
  // How each parameter (by fully-qualified name) is split across tp.
  const std::map<std::string, parallel::tensor::ShardSpec>& shard_specs() const;
  const parallel::tensor::ShardSpec& shard_spec(const std::string& name) const;

  // Applies to the forwards that follow (the default is kNone). Dropout inside recomputed parts
  // applies the same masks again (the dropout stream's position at forward is restored), so
  // losses and gradients are those of kNone.
  void set_activation_checkpointing(ActivationCheckpointing mode);
  ActivationCheckpointing activation_checkpointing() const { return execution_->checkpointing; }
  // Which attention implementation the blocks use in the forwards that follow (default kAuto:
  // loom's fused kernel for CUDA bf16/fp16 without attention dropout, else PyTorch's SDPA).
  void set_attention_backend(ops::AttentionBackend backend) {
    execution_->attention = backend;
    mtp_execution_->attention = backend;
  }
  ops::AttentionBackend attention_backend() const { return execution_->attention; }
  // With the kAuto backend: choose between loom's attention kernel and SDPA by timing each
  // shape once (ops/attention_choice.h; null, the default: loom's kernel where it applies).
  void set_attention_chooser(std::shared_ptr<ops::AttentionChooser> chooser) {
    execution_->attention_chooser = chooser;
    mtp_execution_->attention_chooser = std::move(chooser);
  }
  // Document masking: with a start token, attention does not cross document boundaries inside a
  // sequence — a document begins at every position holding `start_token` (the tokenizer's
  // document start, which loom-prepare writes before each document) and at position 0, and each
  // position attends only to earlier positions of its own document (ops::document_first_keys;
  // every attention backend and loom's kernels take it). Positions (GPT-2's learned embeddings,
  // RoPE's angles) still count from the start of the sequence, as in Llama 3's training: under
  // RoPE only differences of positions reach attention, so a document attends exactly as it
  // would alone. nullopt (the default): attention spans the whole sequence. loom::Error for a
  // negative or out-of-vocabulary token, under context parallelism (ring attention takes no
  // mask yet), and for a custom model (its attention is its own).
  void set_document_mask(std::optional<int64_t> start_token);
  std::optional<int64_t> document_mask() const { return document_start_; }
  // Which implementation computes the norms, and the residual add before each block's second
  // norm (ops/norm.h; default kAuto: the fused kernels on CUDA, ATen's operations on the CPU).
  void set_norm_backend(ops::NormBackend backend) {
    execution_->norm = backend;
    mtp_execution_->norm = backend;
  }
  ops::NormBackend norm_backend() const { return execution_->norm; }
  // Which implementation computes gated activations (ops/swiglu.h; default kAuto: the fused
  // kernels on CUDA, the math path on the CPU).
  void set_activation_backend(ops::ActivationBackend backend) {
    execution_->activation = backend;
    mtp_execution_->activation = backend;
  }
  ops::ActivationBackend activation_backend() const { return execution_->activation; }
  // Which implementation computes the cross-entropy (ops/cross_entropy.h; default kAuto: the
  // fused kernels on CUDA, the math path on the CPU). loss() lets the fused backward write the
  // gradient over the logits it made itself; loss_from_logits() leaves a caller's logits alone.
  void set_loss_backend(ops::LossBackend backend) { loss_backend_ = backend; }
  ops::LossBackend loss_backend() const { return loss_backend_; }
  // PaLM's z-loss: adds weight * mean(lse^2) to the next-token loss (and to each multi-token
  // head's) while training; in eval mode the loss is the cross-entropy alone (validation loss
  // stays comparable). 0 (the default): none. loom::Error unless finite and >= 0.
  void set_z_loss(double weight);
  double z_loss() const { return z_loss_; }
  // Activation offload: with kFull, each block's saved input goes to host memory in forward and
  // comes back (prefetched one block ahead) for its recompute in backward. Null turns it off;
  // throws loom::Error when set while checkpointing is not kFull.
  void set_activation_offload(std::shared_ptr<parallel::memory::ActivationOffloader> offload);
  const std::shared_ptr<parallel::memory::ActivationOffloader>& activation_offload() const {
    return execution_->offload;
  }
  // Context parallelism: the forwards that follow take whole sequences (token ids and targets
  // [batch, seq], seq divisible by 2 x cp) and work on this rank's two chunks of each
  // (context_group.h): embeddings and rotary angles at the tokens' global positions, ring
  // attention, and a loss that is the mean over the whole sequences on every rank of the group
  // (its gradients are parts the context-parallel strategy sums over the group). Null or a group
  // of one turns it off. A model with dropout is refused (not supported under it yet).
  void set_context_parallel(parallel::context::ContextGroupPtr group);
  const parallel::context::ContextGroupPtr& context_parallel() const { return execution_->context; }
  int64_t context_parallel_size() const {
    return execution_->context ? execution_->context->size() : 1;
  }

  // One transformer block applied to its input. It may be called again in backward (activation
  // checkpointing), so whatever it uses it holds by value.
  using BlockFn = std::function<at::Tensor(const at::Tensor&)>;
  // Runs block `layer` (an index into blocks()) on x by calling run(x) (once, in forward), and
  // may act around it: gather sharded parameters before and release them after, offload, time.
  // A wrapper that needs the block's parameters in backward must arrange that itself (with
  // kFull the block's forward runs again inside its backward).
  using BlockWrapper =
      std::function<at::Tensor(int64_t layer, const at::Tensor& x, const BlockFn& run)>;
  // Wrappers nest in the order added: the first added is innermost, activation checkpointing
  // (kFull) is inside all of them. A block shared by several layers (ModelConfig::share_layers)
  // is wrapped at each of its uses, with the same index.
  void add_block_wrapper(BlockWrapper wrapper);

  // The transformer blocks this part holds, each once however many layers use it, each with its
  // fully-qualified name prefix as named_parameters() spells it ("transformer.h.0",
  // "model.layers.0": the number is the first layer of the model that uses it), ascending by
  // that number.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> blocks() const;
  // Per layer of the model, the layer whose block it runs (ModelConfig::layer_owners).
  const std::vector<int64_t>& layer_owners() const { return owners_; }

 protected:
  // The part's pieces, run by forward_part. embed: token ids -> hidden states (first part);
  // run_layers: the part's blocks (through run_block); head: hidden states -> logits shard
  // (last part).
  virtual at::Tensor embed(const at::Tensor& tokens) = 0;
  virtual at::Tensor run_layers(const at::Tensor& x) = 0;
  virtual at::Tensor head(const at::Tensor& x) = 0;
  // For the chunked loss (set_loss_chunk_rows), a model whose head is unembed(final_norm(x))
  // with unembed a plain product by unembedding_shard() (this rank's rows [padded_vocab / tp,
  // d_model], no bias) says so by returning that weight; undefined (the default): the head is
  // the model's own, and part_loss always makes whole logits.
  virtual at::Tensor final_norm(const at::Tensor& x);
  virtual at::Tensor unembedding_shard() { return at::Tensor(); }
  // Multi-token heads (last part, ModelConfig::mtp_heads > 0). mtp_hidden: head `index`
  // (0-based) on the trunk, its block and final norm; unembed: the shared unembedding of such
  // normalized hidden states (this rank's vocabulary shard of the logits); its weight's name.
  // `first_key`: the document mask's first keys of the trunk's forward (undefined: none).
  virtual at::Tensor mtp_hidden(int64_t index, const at::Tensor& trunk,
                                const at::Tensor& first_key);
  virtual at::Tensor unembed(const at::Tensor& normed);
  virtual std::string unembedding_weight_name() const;
  // The models' constructors register their heads here, under the container at `prefix`,
  // named by their 0-based index.
  void register_mtp_heads(const std::shared_ptr<torch::nn::Module>& container,
                          std::vector<std::shared_ptr<torch::nn::Module>> heads);
  // What the heads' blocks run with: the model's attention backend, never recomputation (the
  // heads are recomputed as a whole) and never context parallelism (refused with heads).
  BlockExecutionPtr mtp_execution() const { return mtp_execution_; }
  // The models' constructors register their blocks here, under the container at `prefix`
  // ("transformer.h"): one per entry of held_blocks(), named by that layer index.
  void register_blocks(std::string prefix, std::shared_ptr<torch::nn::Module> container,
                       std::vector<std::shared_ptr<torch::nn::Module>> blocks);
  // The layers whose blocks this part holds: the distinct owners of its layers, ascending.
  std::vector<int64_t> held_blocks() const;
  // The index into blocks() of the block that runs layer first_layer + `layer` of this part.
  size_t block_index(int64_t layer) const { return block_of_layer_.at(static_cast<size_t>(layer)); }
  // The same for blocks already registered (a custom model's), named "<prefix>.<index>".
  void adopt_blocks(std::string prefix, std::vector<std::shared_ptr<torch::nn::Module>> blocks);
  // Sequence length of the whole sequence from hidden states x [batch, seq, d] of this rank
  // (under context parallelism: of this rank's slice of it).
  int64_t full_seq_len(const at::Tensor& x) const;
  // The positions in the whole sequence of tokens [first, first + len) of this rank's slice of
  // `slice_len` tokens (arange without context parallelism), int64 on `device`.
  at::Tensor token_positions(int64_t first, int64_t len, int64_t slice_len,
                             at::Device device) const;
  // During forward_part under a document mask: the first keys of its tokens ([batch, seq] int32,
  // ops::document_first_keys), for run_layers to hand its blocks by value (they may run again in
  // backward, after another micro-batch's forward). Undefined otherwise.
  const at::Tensor& first_key() const { return first_key_; }
  // Whether set_document_mask may apply (false: the model's attention is not loom's).
  virtual bool takes_document_mask() const { return true; }
  // Blocks receive this at construction and read the checkpointing mode from it.
  BlockExecutionPtr execution() const { return execution_; }
  // Runs this part's layer `layer` (0-based within the part) as fn(x), with kFull checkpointing
  // and the wrappers (given its block_index) around it.
  at::Tensor run_block(int64_t layer, const at::Tensor& x, const BlockFn& fn);

  void check_tokens(const at::Tensor& tokens) const;
  // The mean cross-entropy of a logits shard against targets of its shape (minus the vocabulary).
  at::Tensor token_loss(const at::Tensor& logits, const at::Tensor& targets);
  // Ids in [0, vocab_size); `what` names them in the error ("token", "target").
  void check_ids(const at::Tensor& ids, const char* what) const;
  // Heads and widths tp must divide, checked with messages that name them.
  void check_divisible_by_tp() const;

 private:
  ModelConfig config_;
  parallel::tensor::TpGroupPtr tp_;
  mutable std::map<std::string, parallel::tensor::ShardSpec> specs_;  // filled at first use
  std::shared_ptr<BlockExecution> execution_ = std::make_shared<BlockExecution>();
  std::vector<BlockWrapper> block_wrappers_;
  ModelPart part_;
  std::string blocks_prefix_;
  std::vector<int64_t> owners_;  // per layer of the whole model
  std::vector<std::shared_ptr<torch::nn::Module>> blocks_;
  std::vector<int64_t> block_layers_;   // per entry of blocks_: the layer it is named by
  std::vector<size_t> block_of_layer_;  // per layer of the part: its index into blocks_
  std::vector<int64_t> block_uses_;     // per entry of blocks_: the part's layers that run it
  // The owner layer of a block parameter's name ("transformer.h.3.attn..." -> 3), or -1.
  int64_t owner_of(const std::string& name) const;
  // Gathered across tp, vocabulary padding dropped.
  at::Tensor whole_logits(const at::Tensor& shard);
  ops::LossBackend loss_backend_ = ops::LossBackend::kAuto;
  double z_loss_ = 0;
  std::optional<int64_t> document_start_;
  bool record_row_losses_ = false;
  std::vector<RowLosses> row_losses_;
  void record_row_losses(const at::Tensor& logits, const at::Tensor& local_targets);
  // loss_from_logits of a last part's output: its logits (chunk_rows 0), or its final norm's
  // output (chunk_rows > 0: the head runs with the loss, chunk_rows rows at a time).
  at::Tensor loss_of_output(const at::Tensor& out, int64_t chunk_rows, const at::Tensor& targets);
  // The head's product and the mean cross-entropy in chunks, from the final norm's output inside
  // the tp region.
  at::Tensor chunked_token_loss(const at::Tensor& hidden, const at::Tensor& targets,
                                int64_t chunk_rows);
  int64_t loss_chunk_rows_ = kAutoLossChunks;
  int64_t chunked_losses_ = 0;
  bool defer_head_ = false;     // forward_part returns final_norm's output, not logits
  at::Tensor first_key_;        // of the forward_part running now
  at::Tensor trunk_first_key_;  // of the forward whose trunk the multi-token heads read
  // The logits loss() made and hands to loss_from_logits: nothing else holds them, so the
  // fused backward may overwrite them with their gradient. Null outside loss().
  const c10::TensorImpl* own_logits_ = nullptr;
  // Multi-token prediction: the heads' execution settings, modules and loss weights, and the
  // trunk the last forward_part kept for them (with the logits it returned, to pair them).
  std::shared_ptr<BlockExecution> mtp_execution_ = std::make_shared<BlockExecution>();
  std::vector<std::shared_ptr<torch::nn::Module>> mtp_heads_;
  std::vector<double> mtp_weights_;
  bool keep_trunk_ = false;
  bool heads_forward_ = false;  // forward_heads: keep the trunk in eval mode too
  at::Tensor mtp_loss_sums_;    // per head, over the forwards counted below
  int64_t mtp_loss_forwards_ = 0;
  at::Tensor trunk_;
  using TensorImplWeak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  TensorImplWeak trunk_logits_{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  // The heads' weighted losses, recomputed one head at a time in backward.
  at::Tensor mtp_loss(const at::Tensor& trunk, const at::Tensor& targets,
                      const at::Tensor& first_key);
};

// The attention core of the models' blocks: causal ops::attention of q [B, h, T, hd] with k, v
// [B, h_kv, T, hd], with attention dropout p (0 outside training) on the probabilities, its
// mask keyed by block `layer` and this rank's heads' place among all heads (tp-invariant masks,
// parallel/tensor/random.h). Recomputed in backward, dropout mask included, when `execution`
// asks for kSelective. `first_key`: a document mask (ops::AttentionOptions::first_key), or
// undefined.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double p,
                            const parallel::tensor::TpGroupPtr& tp,
                            const BlockExecutionPtr& execution, int64_t layer,
                            const at::Tensor& first_key = {});
// The same for one projection's packed output qkv [B, T, 3, h, hd] (ops::attention_packed), with
// the projection's bias [3 h hd] when its GEMM left it out (undefined otherwise).
at::Tensor causal_attention_packed(const at::Tensor& qkv, const at::Tensor& bias, double p,
                                   const parallel::tensor::TpGroupPtr& tp,
                                   const BlockExecutionPtr& execution, int64_t layer,
                                   const at::Tensor& first_key = {});
// Whether causal_attention_packed takes the projection's bias itself for a block whose
// projection input is `input` (ops::attention_packed_takes_bias with the block's settings).
bool attention_takes_projection_bias(const at::Tensor& input, int64_t head_dim, double p,
                                     const BlockExecutionPtr& execution);

// GPT-2 or Llama, by config.family, sharded over `tp` (null: one process), holding `part` of
// the model (default: all of it). Parameters are not initialized: call init_parameters for
// loom's layout-invariant values (or load_parameters).
std::shared_ptr<CausalLM> make_model(const ModelConfig& config,
                                     parallel::tensor::TpGroupPtr tp = nullptr,
                                     ModelPart part = {});

// Layout-invariant initialization: each parameter is drawn whole, in its single-process
// shape, from its own generator seeded by (seed, fully-qualified name), and each rank keeps its
// shard, so the values never depend on tp or on the order in which parameters were created.
void init_parameters(CausalLM& model, uint64_t seed);

// Copies tensors[name] (single-process shapes) into every parameter, each rank taking its
// shard (cast to the parameter's dtype). A missing name or a shape that differs is a
// loom::Error naming `source` (the file or directory they came from), raised before any
// parameter is written.
void load_parameters(CausalLM& model, const std::map<std::string, at::Tensor>& tensors,
                     const std::string& source);

// Copies shards[name], already this rank's shard of each parameter (its local shape, as
// ShardSpec::shard cuts it), into every parameter. A missing name or a shape that differs is a
// loom::Error naming `source`, raised before any parameter is written.
void load_parameter_shards(CausalLM& model, const std::map<std::string, at::Tensor>& shards,
                           const std::string& source);

// Every parameter in its single-process shape (vocabulary padding dropped), assembled from the
// shards. Sharded parameters come back as new tensors; replicated ones as detached aliases of
// the live parameters (clone them to keep a snapshot). Collective over the model's tp group:
// every rank of it must call this.
std::map<std::string, at::Tensor> gather_parameters(const CausalLM& model);

// A tensor holding a shard of parameter `name` (its optimizer moments, say), made whole the
// same way. Collective over the tp group.
at::Tensor gather_shard(const CausalLM& model, const std::string& name, const at::Tensor& shard);

// Mean cross-entropy of logits [B, T, V] against targets [B, T], computed in fp32.
at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace loom::models
