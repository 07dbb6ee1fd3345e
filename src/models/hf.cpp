#include "loom/models/hf.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
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

// A weight file of a Hugging Face directory and the tensors the index maps to it (empty: every
// tensor it holds, for a single model.safetensors).
struct WeightFile {
  fs::path path;
  std::vector<std::string> names;
};

// model.safetensors when there is one (transformers looks for it first), else the files of
// model.safetensors.index.json's weight map.
std::vector<WeightFile> hf_weight_files(const fs::path& dir) {
  const auto single = dir / "model.safetensors";
  if (fs::exists(single)) return {{single, {}}};
  const auto index_file = dir / kHfIndexFile;
  LOOM_CHECK(fs::exists(index_file),
             "'{}' holds neither model.safetensors nor {} (a sharded checkpoint's index)",
             dir.string(), kHfIndexFile);
  json index;
  try {
    index = json::parse(core::read_file(index_file));
  } catch (const json::exception& e) {
    fail("'{}' is not valid JSON: {}", index_file.string(), e.what());
  }
  LOOM_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
             "'{}' has no \"weight_map\" object (tensor name -> file name)", index_file.string());
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : index["weight_map"].items()) {
    LOOM_CHECK(file.is_string(), "'{}': tensor '{}' maps to {}, not a file name",
               index_file.string(), name, file.dump());
    const auto file_name = file.get<std::string>();
    // A plain name in the directory: an index must not reach files elsewhere.
    LOOM_CHECK(!file_name.empty() && file_name != "." && file_name != ".." &&
                   file_name.find('/') == std::string::npos,
               "'{}': tensor '{}' maps to '{}': the weight map names files in the same directory",
               index_file.string(), name, file_name);
    by_file[file_name].push_back(name);
  }
  LOOM_CHECK(!by_file.empty(), "'{}': the weight map is empty", index_file.string());
  std::vector<WeightFile> out;
  for (auto& [file_name, names] : by_file) {
    LOOM_CHECK(fs::exists(dir / file_name),
               "'{}' maps {} tensors (e.g. '{}') to '{}', which is "
               "missing",
               index_file.string(), names.size(), names.front(), file_name);
    out.push_back({dir / file_name, std::move(names)});
  }
  return out;
}

// Llama's rotary settings as transformers (>= 5) reads them.
json hf_rope_parameters(const ModelConfig& c) {
  const auto& rs = c.rope_scaling;
  json p = {{"rope_type", rs.type.empty() ? "default" : rs.type}, {"rope_theta", c.rope_theta}};
  if (!rs.type.empty()) p["factor"] = rs.factor;
  if (rs.type == "llama3") {
    p["low_freq_factor"] = rs.low_freq_factor;
    p["high_freq_factor"] = rs.high_freq_factor;
    p["original_max_position_embeddings"] = rs.original_max_seq_len;
  }
  return p;
}

// True for the weight files save_weight_files writes: model.safetensors and
// model-NNNNN-of-NNNNN.safetensors.
bool is_weight_file_name(const std::string& name) {
  if (name == "model.safetensors") return true;
  return name.size() == std::string_view("model-00001-of-00001.safetensors").size() &&
         name.starts_with("model-") && name.ends_with(".safetensors") &&
         name.substr(11, 4) == "-of-";
}

// One model.safetensors when the tensors fit max_shard_bytes, else shards in name order, each
// filled up to the limit, and the index; then any weight file of an earlier export is removed.
void save_weight_files(const fs::path& dir, const core::NamedTensors& tensors,
                       int64_t max_shard_bytes) {
  std::vector<core::NamedTensors> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& item : tensors) {
    const int64_t bytes = item.second.numel() * static_cast<int64_t>(item.second.element_size());
    if (!shards.back().empty() && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(item);
    in_shard += bytes;
    total += bytes;
  }
  std::set<std::string> written;
  if (shards.size() == 1) {
    core::save_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
    written.insert("model.safetensors");
  } else {
    LOOM_CHECK(shards.size() <= 99999,
               "Hugging Face export of {} bytes in files of at most {}: {} files, more than the "
               "99,999 the naming allows",
               total, max_shard_bytes, shards.size());
    json weight_map = json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const auto name = fmt::format("model-{:05}-of-{:05}.safetensors", i + 1, shards.size());
      core::save_safetensors(dir / name, shards[i], {{"format", "pt"}});
      for (const auto& item : shards[i]) weight_map[item.first] = name;
      written.insert(name);
    }
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    core::write_file_atomic(dir / kHfIndexFile, index.dump(2) + "\n");
    written.insert(kHfIndexFile);
  }
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if ((is_weight_file_name(name) || name == kHfIndexFile) && !written.count(name))
      fs::remove(entry.path());
  }
}

}  // namespace

std::shared_ptr<CausalLM> load_hf(const fs::path& dir) {
  const auto config = read_hf_config(dir);
  auto model = make_model(config);
  // GPT2Model checkpoints (e.g. the original "gpt2") lack the "transformer." prefix.
  std::map<std::string, at::Tensor> by_name;
  std::map<std::string, fs::path> file_of;  // for messages
  const auto files = hf_weight_files(dir);
  for (const auto& [file, listed] : files) {
    const core::SafetensorsReader reader(file);
    if (!listed.empty())  // an index: its files hold what it maps to them, and only that
      for (const auto& name : reader.names())
        LOOM_CHECK(std::find(listed.begin(), listed.end(), name) != listed.end(),
                   "'{}' holds tensor '{}', which {} does not map to it", file.string(), name,
                   kHfIndexFile);
    for (const auto& name : listed.empty() ? reader.names() : listed) {
      LOOM_CHECK(reader.contains(name), "{} maps tensor '{}' to '{}', which does not hold it",
                 kHfIndexFile, name, file.string());
      std::string key = name;
      if (config.family == Family::kGpt2 && key.rfind("transformer.", 0) != 0 &&
          key != "lm_head.weight")
        key = "transformer." + key;
      LOOM_CHECK(!by_name.count(key), "'{}': tensor '{}' is also in '{}'", file.string(), name,
                 file_of[key].string());
      by_name[key] = reader.view(name);
      file_of[key] = file;
    }
  }
  // What load_parameters names for a missing or mis-shaped parameter.
  const auto source = files.front().names.empty() ? files.front().path : dir / kHfIndexFile;
  // HF's Conv1D stores [in, out]; loom's linear layers [out, in].
  std::set<std::string> used;
  for (const auto& item : model->named_parameters()) {
    auto it = by_name.find(item.key());
    if (it == by_name.end()) continue;  // load_parameters names what is missing
    if (config.family == Family::kGpt2 && is_conv1d_weight(item.key())) it->second = it->second.t();
    used.insert(item.key());
  }
  load_parameters(*model, by_name, source.string());
  for (const auto& [name, t] : by_name) {
    // Tied heads may be stored too; GPT-2's attention-mask buffers are not parameters.
    const bool ignorable = (name == "lm_head.weight" && config.tie_embeddings) ||
                           name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") ||
                           name.ends_with("rotary_emb.inv_freq");
    LOOM_CHECK(used.count(name) || ignorable, "'{}': tensor '{}' does not belong to a {} model",
               file_of.at(name).string(), name, to_string(config.family));
  }
  return model;
}

void save_hf(const CausalLM& model, const fs::path& dir, const HfSaveOptions& options) {
  const auto dtype = options.dtype;
  LOOM_CHECK(options.max_shard_bytes > 0,
             "Hugging Face export: the largest weight file must be a positive number of bytes, "
             "not {}",
             options.max_shard_bytes);
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
         {"rope_parameters", hf_rope_parameters(c)},
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
  save_weight_files(dir, tensors, options.max_shard_bytes);
  if (!mtp_tensors.empty())
    core::save_safetensors(dir / kMtpHeadsFile, mtp_tensors,
                           {{"format", "pt"}, {"mtp_heads", std::to_string(c.mtp_heads)}});
  else
    fs::remove(dir / kMtpHeadsFile);  // an earlier export's heads are not this model's
  // Where it came from (transformers keeps unknown keys as attributes, and ignores them).
  if (!c.share_layers.empty()) j["loom_share_layers"] = c.share_layers;
  json generation = {{"_from_model_config", true}};
  for (const auto& [key, id] :
       {std::pair{"bos_token_id", options.bos_token_id}, {"eos_token_id", options.eos_token_id}})
    if (id) j[key] = generation[key] = *id;
  core::write_file_atomic(dir / "config.json", j.dump(2) + "\n");
  if (options.bos_token_id || options.eos_token_id)
    core::write_file_atomic(dir / "generation_config.json", generation.dump(2) + "\n");
  else
    fs::remove(dir / "generation_config.json");  // an earlier export's ids are not this one's
}

}  // namespace loom::models
