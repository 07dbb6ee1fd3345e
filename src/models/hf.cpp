#include "loom/models/hf.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <set>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/format.h"
#include "loom/core/safetensors.h"
#include "loom/models/layer_sharing.h"

namespace loom::models {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// GPT-2's projections are Conv1D in Hugging Face: weight stored as [in, out].
bool is_conv1d_weight(const std::string& name) {
  for (const char* suffix :
       {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"})
    if (name.ends_with(suffix)) return true;
  return false;
}

}  // namespace

std::shared_ptr<CausalLM> load_hf(const fs::path& dir) {
  const auto config = read_hf_config(dir);
  auto model = make_model(config);
  const auto weights_file = dir / "model.safetensors";
  auto contents = core::load_safetensors(weights_file);
  // GPT2Model checkpoints (e.g. the original "gpt2") lack the "transformer." prefix.
  std::map<std::string, at::Tensor> by_name;
  for (auto& [name, tensor] : contents.tensors) {
    std::string key = name;
    if (config.family == Family::kGpt2 && key.rfind("transformer.", 0) != 0 &&
        key != "lm_head.weight")
      key = "transformer." + key;
    by_name[key] = tensor;
  }
  // HF's Conv1D stores [in, out]; loom's linear layers [out, in].
  std::set<std::string> used;
  for (const auto& item : model->named_parameters()) {
    auto it = by_name.find(item.key());
    if (it == by_name.end()) continue;  // load_parameters names what is missing
    if (config.family == Family::kGpt2 && is_conv1d_weight(item.key())) it->second = it->second.t();
    used.insert(item.key());
  }
  load_parameters(*model, by_name, weights_file.string());
  for (const auto& [name, t] : by_name) {
    // Tied heads may be stored too; GPT-2's attention-mask buffers are not parameters.
    const bool ignorable = (name == "lm_head.weight" && config.tie_embeddings) ||
                           name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") ||
                           name.ends_with("rotary_emb.inv_freq");
    LOOM_CHECK(used.count(name) || ignorable, "'{}': tensor '{}' does not belong to a {} model",
               weights_file.string(), name, to_string(config.family));
  }
  return model;
}

void save_hf(const CausalLM& model, const fs::path& dir, at::ScalarType dtype) {
  LOOM_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
             "Hugging Face export in {}: use float32, bfloat16 or float16 (an fp64 model is "
             "exported rounded to float32)",
             c10::toString(dtype));
  core::ensure_writable_dir(dir);
  const auto& c = model.config();
  const char* dtype_name = dtype == at::kBFloat16 ? "bfloat16"
                           : dtype == at::kHalf   ? "float16"
                                                  : "float32";
  json j;
  if (c.family == Family::kGpt2) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"vocab_size", c.vocab_size},
         {"n_positions", c.max_seq_len},
         {"n_ctx", c.max_seq_len},
         {"n_embd", c.d_model},
         {"n_layer", c.n_layers},
         {"n_head", c.n_heads},
         {"n_inner", c.d_ff},
         {"activation_function", "gelu_new"},
         {"layer_norm_epsilon", c.norm_eps},
         {"resid_pdrop", c.dropout},
         {"embd_pdrop", c.dropout},
         {"attn_pdrop", c.dropout},
         {"initializer_range", 0.02},
         {"tie_word_embeddings", true},
         {"use_cache", true},
         {"dtype", dtype_name},
         {"torch_dtype", dtype_name}};
  } else {
    j = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"vocab_size", c.vocab_size},
         {"hidden_size", c.d_model},
         {"intermediate_size", c.d_ff},
         {"num_hidden_layers", c.n_layers},
         {"num_attention_heads", c.n_heads},
         {"num_key_value_heads", c.n_kv_heads},
         {"head_dim", c.head_dim()},
         {"max_position_embeddings", c.max_seq_len},
         {"rms_norm_eps", c.norm_eps},
         {"rope_theta", c.rope_theta},
         {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
         {"hidden_act", "silu"},
         {"attention_bias", false},
         {"mlp_bias", false},
         {"attention_dropout", c.dropout},
         {"initializer_range", 0.02},
         {"tie_word_embeddings", c.tie_embeddings},
         {"use_cache", true},
         {"dtype", dtype_name},
         {"torch_dtype", dtype_name}};
  }
  // Vocabulary padding is dropped; a tensor-parallel model is gathered by the caller first
  // (gather_parameters is collective, this function is not).
  LOOM_CHECK(model.tp().size() == 1,
             "save_hf: the model is split across tp = {} ranks; gather_parameters() on every rank, "
             "then save a single-process model holding them",
             model.tp().size());
  core::NamedTensors tensors, mtp_tensors;
  // Shared blocks go out as one copy per layer: Hugging Face's models have no sharing.
  const auto params = expand_shared_layers(
      gather_parameters(model), c.family == Family::kGpt2 ? "transformer.h" : "model.layers",
      model.layer_owners());
  for (const auto& [key, value] : params) {
    std::string name = key;
    auto t = value.detach();
    // Multi-token heads have no place in the Hugging Face model: they go beside it, as loom
    // stores them (names and [out, in] layouts).
    if (name.find(".mtp.") != std::string::npos) {
      mtp_tensors.emplace_back(name, t.to(at::kCPU, dtype).contiguous());
      continue;
    }
    // Structured MLP weights go out as the dense matrices they stand for, the same function in a
    // format without structure: a block-diagonal [blocks, out / blocks, in / blocks] with zeros
    // off the diagonal; low-rank factors u [out, rank] and v [rank, in] as u v (in the model's
    // precision, then rounded).
    if (t.dim() == 3) t = at::block_diag(std::vector<at::Tensor>(t.unbind(0)));
    if (name.ends_with(".v")) continue;
    if (name.ends_with(".u")) {
      name = name.substr(0, name.size() - 2);
      t = at::mm(t, params.at(name + ".v").detach());
      name += ".weight";
    }
    t = t.to(at::kCPU, dtype);
    if (c.family == Family::kGpt2 && is_conv1d_weight(name)) t = t.t().contiguous();
    tensors.emplace_back(name, t);
  }
  core::save_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
  if (!mtp_tensors.empty())
    core::save_safetensors(dir / kMtpHeadsFile, mtp_tensors,
                           {{"format", "pt"}, {"mtp_heads", std::to_string(c.mtp_heads)}});
  else
    fs::remove(dir / kMtpHeadsFile);  // an earlier export's heads are not this model's
  // Where it came from (transformers keeps unknown keys as attributes, and ignores them).
  if (!c.share_layers.empty()) j["loom_share_layers"] = c.share_layers;
  core::write_file_atomic(dir / "config.json", j.dump(2) + "\n");
}

}  // namespace loom::models
