#include "loom/models/causal_lm.h"

#include <ATen/Context.h>
#include <c10/util/ScopeExit.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <array>
#include <cmath>
#include <utility>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/core/rng.h"
#include "loom/models/gpt2.h"
#include "loom/models/llama.h"
#include "loom/ops/attention.h"
#include "loom/ops/precision.h"
#include "loom/parallel/context/ring_attention.h"
#include "loom/parallel/memory/activation_checkpoint.h"
#include "loom/parallel/tensor/layers.h"
#include "loom/parallel/tensor/mappings.h"
#include "loom/parallel/tensor/random.h"

namespace loom::models {

namespace pt = parallel::tensor;

std::string to_string(ActivationCheckpointing mode) {
  switch (mode) {
    case ActivationCheckpointing::kNone:
      return "none";
    case ActivationCheckpointing::kFull:
      return "full";
    case ActivationCheckpointing::kSelective:
      return "selective";
  }
  fail("unknown ActivationCheckpointing value {}", static_cast<int>(mode));
}

ActivationCheckpointing parse_activation_checkpointing(const std::string& name) {
  for (auto mode : {ActivationCheckpointing::kNone, ActivationCheckpointing::kFull,
                    ActivationCheckpointing::kSelective})
    if (name == to_string(mode)) return mode;
  fail("activation checkpointing '{}' is not known; valid values: none, full, selective", name);
}

CausalLM::CausalLM(ModelConfig config, pt::TpGroupPtr tp, ModelPart part)
    : config_(std::move(config)),
      tp_(tp ? std::move(tp) : std::make_shared<pt::TpGroup>()),
      part_(part) {
  config_.validate();
  owners_ = config_.layer_owners();
  check_divisible_by_tp();
  if (part_.end_layer < 0) part_.end_layer = config_.n_layers;
  LOOM_CHECK(part_.first_layer >= 0 && part_.first_layer <= part_.end_layer &&
                 part_.end_layer <= config_.n_layers,
             "model part with layers [{}, {}) does not fit a model of {} layers (valid: 0 <= "
             "first <= end <= {})",
             part_.first_layer, part_.end_layer, config_.n_layers, config_.n_layers);
  LOOM_CHECK(part_.first || part_.last || part_.end_layer > part_.first_layer,
             "a model part in the middle of the pipeline must hold at least one layer (got {})",
             part_.describe(config_.n_layers));
  LOOM_CHECK(config_.mtp_heads == 0 || !part_.last || part_.end_layer > part_.first_layer,
             "multi-token prediction heads read the last layer's input, so the last pipeline "
             "stage must hold at least that layer; this one holds {}",
             part_.describe(config_.n_layers));
  mtp_weights_.assign(static_cast<size_t>(config_.mtp_heads), 1.0);
  mtp_execution_->checkpointing = ActivationCheckpointing::kNone;
}

void CausalLM::check_divisible_by_tp() const {
  const int64_t tp = tp_->size();
  if (tp == 1) return;
  LOOM_CHECK(config_.n_heads % tp == 0,
             "tensor parallelism splits attention heads: n_heads {} is not divisible by tp {} "
             "(valid tp: divisors of {})",
             config_.n_heads, tp, config_.n_heads);
  LOOM_CHECK(config_.n_kv_heads % tp == 0 || tp % config_.n_kv_heads == 0,
             "tensor parallelism splits or replicates key/value heads: n_kv_heads {} and tp {} "
             "must divide one another",
             config_.n_kv_heads, tp);
  LOOM_CHECK(config_.d_ff % tp == 0,
             "tensor parallelism splits the MLP: d_ff {} is not divisible by tp {}", config_.d_ff,
             tp);
}

void CausalLM::set_activation_checkpointing(ActivationCheckpointing mode) {
  LOOM_CHECK(!execution_->offload || mode == ActivationCheckpointing::kFull,
             "activation checkpointing '{}' would leave activation offload without the inputs it "
             "moves: turn offload off first (set_activation_offload(nullptr))",
             to_string(mode));
  execution_->checkpointing = mode;
}

void CausalLM::set_activation_offload(
    std::shared_ptr<parallel::memory::ActivationOffloader> offload) {
  LOOM_CHECK(!offload || execution_->checkpointing == ActivationCheckpointing::kFull,
             "activation offload moves the inputs full activation checkpointing keeps: it needs "
             "activation checkpointing 'full' (it is '{}')",
             to_string(execution_->checkpointing));
  execution_->offload = std::move(offload);
}

void CausalLM::add_block_wrapper(BlockWrapper wrapper) {
  LOOM_CHECK(wrapper, "add_block_wrapper: the wrapper is empty");
  block_wrappers_.push_back(std::move(wrapper));
}

int64_t CausalLM::full_seq_len(const at::Tensor& x) const {
  return tp_->sequence_parallel() ? x.size(1) * tp_->size() : x.size(1);
}

at::Tensor CausalLM::token_positions(int64_t first, int64_t len, int64_t slice_len,
                                     at::Device device) const {
  if (context_parallel_size() == 1)
    return at::arange(first, first + len, at::TensorOptions(at::kLong).device(device));
  return execution_->context->local_positions(slice_len, device).narrow(0, first, len);
}

void CausalLM::set_document_mask(std::optional<int64_t> start_token) {
  if (start_token) {
    LOOM_CHECK(takes_document_mask(),
               "a document mask needs loom's attention; this {} model computes its own: train it "
               "without --doc-mask",
               to_string(config_.family));
    LOOM_CHECK(*start_token >= 0 && *start_token < config_.vocab_size,
               "document mask: start token {} is not an id of the vocabulary [0, {})", *start_token,
               config_.vocab_size);
    LOOM_CHECK(context_parallel_size() == 1,
               "a document mask under context parallelism (cp {}) is not supported yet: ring "
               "attention takes no mask; train with cp 1 or without --doc-mask",
               context_parallel_size());
  }
  document_start_ = start_token;
}

void CausalLM::set_context_parallel(parallel::context::ContextGroupPtr group) {
  if (group && group->size() > 1) {
    LOOM_CHECK(!document_start_,
               "context parallelism with a document mask is not supported yet: ring attention "
               "takes no mask; train with cp 1 or without --doc-mask");
    LOOM_CHECK(config_.family != Family::kCustom,
               "context parallelism needs to know where each token sits in its sequence; a "
               "custom model does not say: train it with cp 1");
    LOOM_CHECK(config_.dropout == 0,
               "dropout ({}) under context parallelism is not supported yet: its masks would "
               "follow this rank's slice, not the tokens' places in the sequence; train with "
               "--dropout 0 or cp 1",
               config_.dropout);
    LOOM_CHECK(config_.mtp_heads == 0,
               "multi-token prediction ({} heads) under context parallelism is not supported yet: "
               "a head's targets lie k tokens ahead, across this rank's chunk boundaries; train "
               "with cp 1",
               config_.mtp_heads);
  }
  execution_->context = group && group->size() > 1 ? std::move(group) : nullptr;
}

at::Tensor CausalLM::forward_part(const at::Tensor& input, const at::Tensor& tokens) {
  first_key_ = at::Tensor();
  if (document_start_) {
    const auto& ids = part_.first ? input : tokens;
    LOOM_CHECK(ids.defined() && ids.dim() == 2 && ids.size(0) == input.size(0),
               "{} runs under a document mask and needs the micro-batch's token ids [batch, seq] "
               "(forward_part(hidden, tokens)); got {}",
               part_.describe(config_.n_layers),
               ids.defined() ? fmt::format("{}", ids.sizes()) : std::string("none"));
    first_key_ = ops::document_first_keys(ids.to(input.device()), *document_start_);
  }
  const auto forget_first_key = c10::make_scope_exit([this] { first_key_ = at::Tensor(); });
  at::Tensor x;
  if (part_.first) {
    check_tokens(input);
    // Under context parallelism the whole sequences arrive and this rank keeps its chunks.
    x = embed(context_parallel_size() > 1 ? execution_->context->slice_sequence(input, 1) : input);
  } else {
    LOOM_CHECK(input.dim() == 3 && input.size(2) == config_.d_model,
               "{} takes hidden states [batch, seq, {}]; got shape {}",
               part_.describe(config_.n_layers), config_.d_model, input.sizes());
    x = input;
  }
  // The multi-token heads need the last block's input: run_block keeps it for loss_from_logits.
  trunk_ = at::Tensor();
  trunk_logits_.reset();
  keep_trunk_ = part_.last && !mtp_heads_.empty() && (is_training() || heads_forward_);
  {
    const auto stop_keeping = c10::make_scope_exit([this] { keep_trunk_ = false; });
    x = run_layers(x);
  }
  trunk_first_key_ = trunk_.defined() ? first_key_ : at::Tensor();
  if (!part_.last) return x;
  auto logits = defer_head_ ? final_norm(x) : head(x);
  if (trunk_.defined()) trunk_logits_ = TensorImplWeak(logits.getIntrusivePtr());
  return logits;
}

at::Tensor CausalLM::logits_shard(const at::Tensor& tokens) {
  LOOM_CHECK(is_whole(), "logits_shard needs the whole model; this one holds {} (use forward_part)",
             part_.describe(config_.n_layers));
  return forward_part(tokens);
}

void CausalLM::register_mtp_heads(const std::shared_ptr<torch::nn::Module>& container,
                                  std::vector<std::shared_ptr<torch::nn::Module>> heads) {
  LOOM_CHECK(static_cast<int64_t>(heads.size()) == config_.mtp_heads && part_.last,
             "register_mtp_heads: {} heads for a config of {} on {}", heads.size(),
             config_.mtp_heads, part_.describe(config_.n_layers));
  mtp_heads_ = std::move(heads);
  for (size_t i = 0; i < mtp_heads_.size(); ++i)
    container->register_module(std::to_string(i), mtp_heads_[i]);
}

at::Tensor CausalLM::mtp_hidden(int64_t /*index*/, const at::Tensor& /*trunk*/,
                                const at::Tensor& /*first_key*/) {
  fail("this {} model has no multi-token prediction heads", to_string(config_.family));
}

at::Tensor CausalLM::unembed(const at::Tensor& /*normed*/) {
  fail("this {} model has no shared unembedding for multi-token heads", to_string(config_.family));
}

at::Tensor CausalLM::final_norm(const at::Tensor& /*x*/) {
  fail("this {} model's head is its own: it has no final norm to run apart from it",
       to_string(config_.family));
}

std::string CausalLM::unembedding_weight_name() const {
  return embedding_weight_name();
}

at::Tensor CausalLM::whole_logits(const at::Tensor& shard) {
  auto logits = pt::gather_from_tp_region(shard, *tp_, -1);
  return logits.size(-1) == config_.vocab_size ? logits : logits.narrow(-1, 0, config_.vocab_size);
}

std::vector<at::Tensor> CausalLM::forward_heads(const at::Tensor& tokens) {
  LOOM_CHECK(!mtp_heads_.empty(),
             "forward_heads: the model has no multi-token prediction heads (mtp_heads is 0)");
  LOOM_CHECK(context_parallel_size() == 1,
             "forward_heads returns whole logits; under context parallelism this rank holds part "
             "of each sequence");
  LOOM_CHECK(is_whole(), "forward_heads needs the whole model; this one holds {}",
             part_.describe(config_.n_layers));
  heads_forward_ = true;
  at::Tensor shard;
  {
    const auto done = c10::make_scope_exit([this] { heads_forward_ = false; });
    shard = forward_part(tokens);
  }
  const auto trunk = std::exchange(trunk_, at::Tensor());
  const auto first_key = std::exchange(trunk_first_key_, at::Tensor());
  trunk_logits_.reset();
  std::vector<at::Tensor> out{whole_logits(shard)};
  for (int64_t i = 0; i < config_.mtp_heads; ++i)
    out.push_back(whole_logits(unembed(mtp_hidden(i, trunk, first_key))));
  return out;
}

at::Tensor CausalLM::run_block(int64_t layer, const at::Tensor& x, const BlockFn& fn) {
  if (keep_trunk_ && part_.first_layer + layer == config_.n_layers - 1) trunk_ = x;
  const size_t block = block_index(layer);
  BlockFn run = fn;
  if (execution_->checkpointing == ActivationCheckpointing::kFull) {
    parallel::memory::CheckpointOptions options;
    // The recompute runs with the position the forward had (a pipeline runs other
    // micro-batches' forwards in between), so it applies the same dropout masks.
    if (is_training() && config_.dropout > 0)
      options.dropout_streams.push_back(tp_->dropout_stream());
    // A custom module's own randomness (its dropout) draws from LibTorch's default generator
    // of the device it runs on.
    if (is_training() && config_.family == Family::kCustom)
      options.generators.push_back(at::globalContext().defaultGenerator(x.device()));
    options.offload = execution_->offload;
    // A block this part runs at several layers: its parameters' gradients come back through the
    // checkpoint, so that autograd sums them over the uses and accumulates them once (data
    // parallelism and ZeRO take one gradient per parameter per backward).
    if (block_uses_[block] > 1)
      for (const auto& p : blocks_[block]->parameters())
        if (p.requires_grad()) options.parameters.push_back(p);
    run = [fn, options](const at::Tensor& in) {
      return parallel::memory::checkpoint(
          [fn](const std::vector<at::Tensor>& args) { return fn(args[0]); }, {in}, options);
    };
  }
  for (const auto& wrapper : block_wrappers_)
    run = [wrapper, block, inner = std::move(run)](const at::Tensor& in) {
      return wrapper(static_cast<int64_t>(block), in, inner);
    };
  return run(x);
}

at::Tensor CausalLM::forward(const at::Tensor& tokens) {
  LOOM_CHECK(context_parallel_size() == 1,
             "forward() returns the whole logits, but under context parallelism (cp {}) this rank "
             "holds 2 of the {} chunks of each sequence: use loss(), or a model at cp 1 (e.g. "
             "loaded from a checkpoint) for logits and generation",
             context_parallel_size(), 2 * context_parallel_size());
  auto logits = whole_logits(logits_shard(tokens));
  trunk_ = at::Tensor();  // no loss follows: the heads' trunk is not needed
  trunk_logits_.reset();
  return logits;
}

const std::map<std::string, pt::ShardSpec>& CausalLM::shard_specs() const {
  if (specs_.empty()) specs_ = pt::collect_shard_specs(*this, tp_->sequence_parallel());
  return specs_;
}

const pt::ShardSpec& CausalLM::shard_spec(const std::string& name) const {
  const auto& specs = shard_specs();
  auto it = specs.find(name);
  LOOM_CHECK(it != specs.end(), "the model has no parameter '{}'", name);
  return it->second;
}

void CausalLM::check_ids(const at::Tensor& ids, const char* what) const {
  // On the CPU only: on a GPU this would stall the stream every forward (the embedding's
  // device-side check catches ids >= vocab there). Vocabulary-parallel lookups and padded
  // heads would otherwise turn a bad id into a silent zero embedding or a loss without target.
  if (!ids.is_cpu() || ids.numel() == 0) return;
  const auto [lo, hi] = at::aminmax(ids);
  LOOM_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < config_.vocab_size,
             "{} ids must be in [0, {}) (the vocabulary); got ids from {} to {}", what,
             config_.vocab_size, lo.item<int64_t>(), hi.item<int64_t>());
}

void CausalLM::check_tokens(const at::Tensor& tokens) const {
  LOOM_CHECK(tokens.dim() == 2, "model input must be [batch, seq] token ids; got shape {}",
             tokens.sizes());
  LOOM_CHECK(tokens.scalar_type() == at::kLong, "model input must be int64 token ids; got {}",
             c10::toString(tokens.scalar_type()));
  LOOM_CHECK(tokens.size(1) <= config_.max_seq_len,
             "sequence length {} exceeds the model's max_seq_len {}", tokens.size(1),
             config_.max_seq_len);
  check_ids(tokens, "token");
  const int64_t cp = context_parallel_size();
  if (cp > 1) execution_->context->check_seq_len(tokens.size(1));
  LOOM_CHECK(!tp_->sequence_parallel() || (tokens.size(1) / cp) % tp_->size() == 0,
             "sequence parallelism splits the sequence: length {}{} is not divisible by tp {}",
             tokens.size(1),
             cp != 1 ? fmt::format(" (this rank's {} of it at cp {})", tokens.size(1) / cp, cp)
                     : std::string(),
             tp_->size());
}

namespace {

// What both entries share: the options (attention dropout's mask for this rank's heads, keyed by
// their place among all heads) and the recomputation in backward under kSelective. `attend`
// gets the options and the inputs; `shape` is the probabilities' [B, h, T, T].
template <typename Attend>
at::Tensor attention_core(std::vector<at::Tensor> inputs, std::array<int64_t, 4> shape, double p,
                          const pt::TpGroupPtr& tp, const BlockExecutionPtr& execution,
                          int64_t layer, const at::Tensor& first_key, Attend attend) {
  // Holds the group by value: with kSelective this runs again in backward (where the stream's
  // position is the checkpoint's to restore).
  const auto backend = execution ? execution->attention : ops::AttentionBackend::kAuto;
  auto chooser = execution ? execution->attention_chooser : nullptr;
  const uint32_t site = ops::dropout_site(layer, ops::DropoutPlace::kAttentionProbs);
  auto run = [p, tp, backend, chooser, shape, site, first_key,
              attend](const std::vector<at::Tensor>& in) {
    const auto mask_options = in[0].options().dtype(ops::accumulation_dtype(in[0].scalar_type()));
    return attend(in, ops::AttentionOptions{.causal = true,
                                            .dropout = p,
                                            .dropout_mask = pt::sharded_dropout_mask(
                                                {shape[0], shape[1], shape[2], shape[3]},
                                                mask_options, p, *tp, 1, site),
                                            .backend = backend,
                                            .first_key = first_key,
                                            .chooser = chooser.get()});
  };
  if (!execution || execution->checkpointing != ActivationCheckpointing::kSelective)
    return run(inputs);
  parallel::memory::CheckpointOptions options;
  if (p > 0) options.dropout_streams.push_back(tp->dropout_stream());
  return parallel::memory::checkpoint(run, std::move(inputs), options);
}

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double p,
                            const pt::TpGroupPtr& tp, const BlockExecutionPtr& execution,
                            int64_t layer, const at::Tensor& first_key) {
  const int64_t t = q.size(2);
  if (execution && execution->context) {
    LOOM_CHECK(p == 0,
               "attention dropout ({}) under context parallelism is not supported yet: train "
               "with --dropout 0 or cp 1",
               p);
    LOOM_CHECK(!first_key.defined(),
               "a document mask under context parallelism is not supported yet");
    auto group = execution->context;
    return attention_core(
        {q, k, v}, {q.size(0), q.size(1), t, t}, 0.0, tp, execution, layer, {},
        [group](const std::vector<at::Tensor>& in, const ops::AttentionOptions& o) {
          return parallel::context::ring_attention(in[0], in[1], in[2], *group, o.scale);
        });
  }
  return attention_core({q, k, v}, {q.size(0), q.size(1), t, t}, p, tp, execution, layer, first_key,
                        [](const std::vector<at::Tensor>& in, const ops::AttentionOptions& o) {
                          return ops::attention(in[0], in[1], in[2], o);
                        });
}

at::Tensor causal_attention_packed(const at::Tensor& qkv, const at::Tensor& bias, double p,
                                   const pt::TpGroupPtr& tp, const BlockExecutionPtr& execution,
                                   int64_t layer, const at::Tensor& first_key) {
  const int64_t t = qkv.size(1);
  if (execution && execution->context) {
    // Ring attention takes q, k and v apart: the heads of the packed projection, bias added.
    const auto x = bias.defined() ? qkv + bias.view({3, qkv.size(3), qkv.size(4)}) : qkv;
    return causal_attention(x.select(2, 0).transpose(1, 2), x.select(2, 1).transpose(1, 2),
                            x.select(2, 2).transpose(1, 2), p, tp, execution, layer, first_key);
  }
  std::vector<at::Tensor> inputs{qkv};
  if (bias.defined()) inputs.push_back(bias);
  return attention_core(
      std::move(inputs), {qkv.size(0), qkv.size(3), t, t}, p, tp, execution, layer, first_key,
      [](const std::vector<at::Tensor>& in, const ops::AttentionOptions& o) {
        return ops::attention_packed(in[0], o, in.size() > 1 ? in[1] : at::Tensor());
      });
}

bool attention_takes_projection_bias(const at::Tensor& input, int64_t head_dim, double p,
                                     const BlockExecutionPtr& execution) {
  if (execution && execution->context) return false;  // ring attention adds no bias itself
  return ops::attention_packed_takes_bias(
      input, head_dim,
      {.dropout = p,
       .backend = execution ? execution->attention : ops::AttentionBackend::kAuto,
       .chooser = execution ? execution->attention_chooser.get() : nullptr});
}

std::shared_ptr<CausalLM> make_model(const ModelConfig& config, pt::TpGroupPtr tp, ModelPart part) {
  LOOM_CHECK(config.family != Family::kCustom,
             "a custom model is built by its own code (models::make_custom_model), not from its "
             "config: rebuild it and load the checkpoint's parameters into it");
  if (config.family == Family::kGpt2) return std::make_shared<Gpt2>(config, std::move(tp), part);
  return std::make_shared<Llama>(config, std::move(tp), part);
}

void init_parameters(CausalLM& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  const int64_t tp = model.tp().size(), rank = model.tp().rank();
  for (const auto& item : model.named_parameters()) {
    const auto& name = item.key();
    auto param = item.value();
    const auto rule = model.init_for(name);
    if (rule.kind == ParamInit::Kind::kKeep) continue;
    const auto& spec = model.shard_spec(name);
    // The whole single-process tensor, in fp32 on the CPU (the same values for every dtype,
    // device and tp), then this rank's shard of it (padding rows zero).
    const auto shape = spec.full_shape(param.sizes());
    at::Tensor values;
    switch (rule.kind) {
      case ParamInit::Kind::kZeros:
        values = at::zeros(shape, at::kFloat);
        break;
      case ParamInit::Kind::kOnes:
        values = at::ones(shape, at::kFloat);
        break;
      case ParamInit::Kind::kNormal: {
        auto gen = core::make_generator(core::mix_seed({seed, core::stable_hash(name)}));
        values = at::empty(shape, at::kFloat).normal_(0.0, rule.std, gen);
        break;
      }
      case ParamInit::Kind::kKeep:  // skipped above
        continue;
    }
    param.copy_(spec.shard(values, rank, tp));
  }
}

void load_parameters(CausalLM& model, const std::map<std::string, at::Tensor>& tensors,
                     const std::string& source) {
  const int64_t tp = model.tp().size(), rank = model.tp().rank();
  // Every name and shape first: a source that does not fit leaves the model untouched.
  std::map<std::string, at::Tensor> shards;
  for (const auto& item : model.named_parameters()) {
    auto it = tensors.find(item.key());
    LOOM_CHECK(it != tensors.end(), "'{}' has no tensor '{}'", source, item.key());
    const auto& spec = model.shard_spec(item.key());
    const auto full_shape = spec.full_shape(item.value().sizes());
    LOOM_CHECK(it->second.sizes() == at::IntArrayRef(full_shape),
               "'{}': tensor '{}' has shape {} but the model needs {}", source, item.key(),
               it->second.sizes(), at::IntArrayRef(full_shape));
    shards.emplace(item.key(), spec.shard(it->second, rank, tp));
  }
  load_parameter_shards(model, shards, source);
}

void load_parameter_shards(CausalLM& model, const std::map<std::string, at::Tensor>& shards,
                           const std::string& source) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    auto it = shards.find(item.key());
    LOOM_CHECK(it != shards.end(), "'{}' has no tensor '{}'", source, item.key());
    LOOM_CHECK(it->second.sizes() == item.value().sizes(),
               "'{}': the shard of tensor '{}' has shape {} but this rank's parameter is {}",
               source, item.key(), it->second.sizes(), item.value().sizes());
  }
  for (auto& item : model.named_parameters()) item.value().copy_(shards.at(item.key()));
}

at::Tensor gather_shard(const CausalLM& model, const std::string& name, const at::Tensor& shard) {
  const auto& spec = model.shard_spec(name);
  if (!spec.sharded()) return shard;
  auto& tp = model.tp();
  if (tp.size() == 1) return spec.unshard({shard});
  const auto piece = shard.detach().contiguous();
  std::vector<int64_t> stacked{tp.size()};
  for (auto s : piece.sizes()) stacked.push_back(s);
  auto all = at::empty(stacked, piece.options());
  tp.comm()->all_gather(all, piece);
  std::vector<at::Tensor> pieces;
  for (int64_t r = 0; r < tp.size(); ++r) pieces.push_back(all[r]);
  return spec.unshard(pieces);
}

std::map<std::string, at::Tensor> gather_parameters(const CausalLM& model) {
  torch::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model.named_parameters())
    out.emplace(item.key(), gather_shard(model, item.key(), item.value().detach()));
  return out;
}

}  // namespace loom::models
