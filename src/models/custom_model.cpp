#include "loom/models/custom_model.h"

#include <fmt/format.h>

#include "loom/core/error.h"
#include "loom/core/format.h"

namespace loom::models {

namespace {

ModelConfig config_of(const CustomModelSpec& spec) {
  LOOM_CHECK(spec.module && spec.forward,
             "custom model '{}': it needs a module and a forward (tokens -> logits)", spec.name);
  LOOM_CHECK(spec.vocab_size > 0 && spec.max_seq_len > 0 && spec.d_model > 0,
             "custom model '{}': vocab_size {}, max_seq_len {} and d_model {} must be positive",
             spec.name, spec.vocab_size, spec.max_seq_len, spec.d_model);
  LOOM_CHECK(spec.blocks.empty() || !spec.blocks_path.empty(),
             "custom model '{}': {} blocks given without blocks_path (the container holding "
             "them, e.g. \"layers\")",
             spec.name, spec.blocks.size());
  ModelConfig c;
  c.family = Family::kCustom;
  c.vocab_size = spec.vocab_size;
  c.max_seq_len = spec.max_seq_len;
  c.d_model = spec.d_model;
  c.n_layers = std::max<int64_t>(1, static_cast<int64_t>(spec.blocks.size()));
  c.n_heads = c.n_kv_heads = 1;
  c.d_ff = spec.d_model;
  c.tie_embeddings = false;
  return c;
}

// The module as loom's CausalLM: embed and head are the identity, run_layers its forward.
class CustomModel final : public CausalLM {
 public:
  CustomModel(CustomModelSpec spec, parallel::tensor::TpGroupPtr tp)
      : CausalLM(config_of(spec), std::move(tp)), spec_(std::move(spec)) {
    LOOM_CHECK(this->tp().size() == 1,
               "custom model '{}' with tensor parallelism (tp {}): tp splits loom's parallel "
               "layers (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) inside "
               "loom's models; a plain LibTorch module cannot be split: use --tp 1",
               spec_.name, this->tp().size());
    register_module(spec_.name, spec_.module);
    if (spec_.blocks.empty()) {
      no_blocks_ = true;
    } else {
      // Every block must be the module's own, at blocks_path.i, so parameter names line up.
      auto named = spec_.module->named_modules("", /*include_self=*/false);
      for (size_t i = 0; i < spec_.blocks.size(); ++i) {
        const auto path = fmt::format("{}.{}", spec_.blocks_path, i);
        LOOM_CHECK(named.contains(path) && named[path].get() == spec_.blocks[i].get(),
                   "custom model '{}': block {} is not the module registered at '{}'", spec_.name,
                   i, path);
        // One module under two names would give its tensors two names: two optimizer updates,
        // two gradient hooks, two ZeRO units.
        for (size_t j = 0; j < i; ++j)
          LOOM_CHECK(spec_.blocks[j].get() != spec_.blocks[i].get(),
                     "custom model '{}': blocks {} and {} are the same module; each block must "
                     "be a module of its own",
                     spec_.name, j, i);
      }
      adopt_blocks(spec_.name + "." + spec_.blocks_path, spec_.blocks);
    }
  }

  std::string embedding_weight_name() const override { return ""; }
  ParamInit init_for(const std::string&) const override { return {ParamInit::Kind::kKeep, 0.0}; }

  at::Tensor loss_from_logits(const at::Tensor& logits, const at::Tensor& targets) override {
    if (!spec_.loss) return CausalLM::loss_from_logits(logits, targets);
    check_ids(targets, "target");
    return spec_.loss(logits, targets);
  }

 protected:
  at::Tensor embed(const at::Tensor& tokens) override { return tokens; }
  bool takes_document_mask() const override { return false; }
  at::Tensor run_layers(const at::Tensor& tokens) override {
    const auto run = [this](int64_t i, const at::Tensor& x,
                            const std::function<at::Tensor(const at::Tensor&)>& block) {
      LOOM_CHECK(!no_blocks_ && i >= 0 && i < static_cast<int64_t>(spec_.blocks.size()),
                 "custom model '{}': run_block({}) but it declared {} blocks", spec_.name, i,
                 spec_.blocks.size());
      return run_block(i, x, block);
    };
    auto logits = spec_.forward(tokens, run);
    LOOM_CHECK(logits.dim() == 3 && logits.size(0) == tokens.size(0) &&
                   logits.size(1) == tokens.size(1) && logits.size(2) == spec_.vocab_size,
               "custom model '{}': forward returned shape {}; logits are [batch {}, seq {}, "
               "vocab {}]",
               spec_.name, logits.sizes(), tokens.size(0), tokens.size(1), spec_.vocab_size);
    return logits;
  }
  at::Tensor head(const at::Tensor& x) override { return x; }

 private:
  CustomModelSpec spec_;
  bool no_blocks_ = false;
};

}  // namespace

std::shared_ptr<CausalLM> make_custom_model(CustomModelSpec spec, parallel::tensor::TpGroupPtr tp) {
  return std::make_shared<CustomModel>(std::move(spec), std::move(tp));
}

}  // namespace loom::models
