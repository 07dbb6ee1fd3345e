#include "loom/models/hf_config.h"

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/json.h"

namespace loom::models {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

template <typename T>
T get_key(const json& j, const char* key, const fs::path& file) {
  LOOM_CHECK(j.contains(key) && !j[key].is_null(), "'{}' has no '{}' key", file.string(), key);
  if constexpr (std::is_same_v<T, int64_t>) {
    return core::json_int64(j[key], fmt::format("'{}': '{}'", file.string(), key));
  } else {
    try {
      return j[key].get<T>();
    } catch (const json::exception& e) {
      fail("'{}': key '{}' has the wrong type: {}", file.string(), key, e.what());
    }
  }
}

// An optional integer key: `fallback` when absent or null.
int64_t int_key_or(const json& j, const char* key, int64_t fallback, const fs::path& file) {
  return j.contains(key) && !j[key].is_null() ? get_key<int64_t>(j, key, file) : fallback;
}

}  // namespace

ModelConfig read_hf_config(const fs::path& dir) {
  const auto file = dir / "config.json";
  LOOM_CHECK(fs::exists(file),
             "'{}' does not exist: a Hugging Face model directory holds "
             "config.json and model.safetensors",
             file.string());
  json j;
  try {
    j = json::parse(core::read_file(file));
  } catch (const json::exception& e) {
    fail("'{}' is not valid JSON: {}", file.string(), e.what());
  }
  const auto type = get_key<std::string>(j, "model_type", file);
  ModelConfig c;
  try {
    if (type == "gpt2") {
      c.family = Family::kGpt2;
      c.vocab_size = get_key<int64_t>(j, "vocab_size", file);
      c.max_seq_len = get_key<int64_t>(j, "n_positions", file);
      c.d_model = get_key<int64_t>(j, "n_embd", file);
      c.n_layers = get_key<int64_t>(j, "n_layer", file);
      c.n_heads = c.n_kv_heads = get_key<int64_t>(j, "n_head", file);
      c.d_ff = int_key_or(j, "n_inner", 4 * c.d_model, file);
      c.norm_eps = j.value("layer_norm_epsilon", 1e-5);
      const auto act = j.value("activation_function", std::string("gelu_new"));
      LOOM_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh",
                 "'{}': activation_function '{}' is not supported (gelu_new, gelu_pytorch_tanh)",
                 file.string(), act);
      // Variants of GPT-2's attention that loom's GPT-2 does not implement.
      LOOM_CHECK(j.value("scale_attn_weights", true) &&
                     !j.value("scale_attn_by_inverse_layer_idx", false) &&
                     !j.value("reorder_and_upcast_attn", false),
                 "'{}': scale_attn_weights=false, scale_attn_by_inverse_layer_idx and "
                 "reorder_and_upcast_attn are not supported",
                 file.string());
      c.tie_embeddings = true;
    } else if (type == "llama") {
      c.family = Family::kLlama;
      c.vocab_size = get_key<int64_t>(j, "vocab_size", file);
      c.max_seq_len = get_key<int64_t>(j, "max_position_embeddings", file);
      c.d_model = get_key<int64_t>(j, "hidden_size", file);
      c.n_layers = get_key<int64_t>(j, "num_hidden_layers", file);
      c.n_heads = get_key<int64_t>(j, "num_attention_heads", file);
      c.n_kv_heads = int_key_or(j, "num_key_value_heads", c.n_heads, file);
      c.d_ff = get_key<int64_t>(j, "intermediate_size", file);
      c.norm_eps = j.value("rms_norm_eps", 1e-6);
      // transformers >= 5 keeps rope_theta and the scaling in rope_parameters; older configs
      // have rope_theta at the top level and the scaling in rope_scaling ("type" before 4.45).
      const bool v5 = j.contains("rope_parameters") && j["rope_parameters"].is_object();
      c.rope_theta = v5 ? j["rope_parameters"].value("rope_theta", j.value("rope_theta", 10000.0))
                        : j.value("rope_theta", 10000.0);
      const json none = json::object();
      const auto& rp = v5 ? j["rope_parameters"]
                       : j.contains("rope_scaling") && j["rope_scaling"].is_object()
                           ? j["rope_scaling"]
                           : none;
      LOOM_CHECK(v5 || !j.contains("rope_scaling") || j["rope_scaling"].is_null() ||
                     j["rope_scaling"].is_object(),
                 "'{}': rope_scaling is {}, not an object", file.string(),
                 j["rope_scaling"].type_name());
      const auto rope_type = rp.value("rope_type", rp.value("type", std::string("default")));
      LOOM_CHECK(rope_type == "default" || rope_type == "linear" || rope_type == "llama3",
                 "'{}': rope_type '{}' is not supported (default, linear, llama3)", file.string(),
                 rope_type);
      if (rope_type != "default") {
        auto& rs = c.rope_scaling;
        rs.type = rope_type;
        LOOM_CHECK(rp.contains("factor"), "'{}': rope_type '{}' without a 'factor'", file.string(),
                   rope_type);
        rs.factor = rp["factor"].get<double>();
        if (rope_type == "llama3") {
          rs.low_freq_factor = rp.value("low_freq_factor", rs.low_freq_factor);
          rs.high_freq_factor = rp.value("high_freq_factor", rs.high_freq_factor);
          // transformers' fallback when the original length is not given.
          rs.original_max_seq_len = int_key_or(
              rp, "original_max_position_embeddings",
              int_key_or(j, "max_position_embeddings", rs.original_max_seq_len, file), file);
        }
      }
      c.tie_embeddings = j.value("tie_word_embeddings", false);
      const auto act = j.value("hidden_act", std::string("silu"));
      LOOM_CHECK(act == "silu", "'{}': hidden_act '{}' is not supported (silu)", file.string(),
                 act);
      LOOM_CHECK(!j.value("attention_bias", false) && !j.value("mlp_bias", false),
                 "'{}': attention_bias / mlp_bias are not supported", file.string());
      // (n_heads 0 is refused by validate() below, after the keys are read.)
      if (c.n_heads > 0) {
        const auto head_dim = int_key_or(j, "head_dim", c.d_model / c.n_heads, file);
        LOOM_CHECK(head_dim == c.d_model / c.n_heads,
                   "'{}': head_dim {} != hidden_size / num_attention_heads = {} is not supported",
                   file.string(), head_dim, c.d_model / c.n_heads);
      }
    } else {
      fail("'{}': model_type '{}' is not supported (gpt2, llama)", file.string(), type);
    }
  } catch (const json::exception& e) {
    fail("'{}': a key has the wrong type: {}", file.string(), e.what());
  }
  c.validate();
  return c;
}

}  // namespace loom::models
