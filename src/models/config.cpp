#include "loom/models/config.h"

#include <algorithm>
#include <cmath>

#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/json.h"
#include "loom/models/layer_sharing.h"

namespace loom::models {

std::string to_string(Family family) {
  switch (family) {
    case Family::kGpt2:
      return "gpt2";
    case Family::kLlama:
      return "llama";
    case Family::kCustom:
      return "custom";
  }
  return "unknown";
}

Family family_from_string(const std::string& name) {
  if (name == "gpt2") return Family::kGpt2;
  if (name == "llama") return Family::kLlama;
  if (name == "custom") return Family::kCustom;
  fail("model family '{}' is not known: use gpt2, llama (or custom, for a model of your own)",
       name);
}

void ModelConfig::validate() const {
  auto positive = [](const char* field, int64_t v) {
    LOOM_CHECK(v > 0, "model config: {} = {} must be positive", field, v);
  };
  positive("vocab_size", vocab_size);
  positive("max_seq_len", max_seq_len);
  positive("d_model", d_model);
  positive("n_layers", n_layers);
  positive("n_heads", n_heads);
  positive("n_kv_heads", n_kv_heads);
  positive("d_ff", d_ff);
  LOOM_CHECK(d_model % n_heads == 0,
             "model config: n_heads = {} does not divide d_model = {} (valid n_heads: divisors "
             "of {})",
             n_heads, d_model, d_model);
  LOOM_CHECK(n_heads % n_kv_heads == 0,
             "model config: n_kv_heads = {} does not divide n_heads = {}", n_kv_heads, n_heads);
  if (family == Family::kGpt2) {
    LOOM_CHECK(n_kv_heads == n_heads,
               "model config: GPT-2 has no grouped-query attention; n_kv_heads = {} must equal "
               "n_heads = {}",
               n_kv_heads, n_heads);
    LOOM_CHECK(tie_embeddings, "model config: GPT-2 ties its input and output embeddings");
  } else if (family == Family::kLlama) {
    LOOM_CHECK(head_dim() % 2 == 0, "model config: RoPE needs an even head_dim; got {}",
               head_dim());
  }
  LOOM_CHECK(ffn_blocks >= 1 && d_model % ffn_blocks == 0 && d_ff % ffn_blocks == 0,
             "model config: ffn_blocks = {} must be at least 1 and divide d_model = {} and "
             "d_ff = {} (each block maps d_model / ffn_blocks features to d_ff / ffn_blocks)",
             ffn_blocks, d_model, d_ff);
  LOOM_CHECK(ffn_rank >= 0 && ffn_rank < std::min(d_model, d_ff),
             "model config: ffn_rank = {} must be 0 (dense) or in [1, {}) (below d_model = {} "
             "and d_ff = {}; it saves weights only below d_model d_ff / (d_model + d_ff))",
             ffn_rank, std::min(d_model, d_ff), d_model, d_ff);
  LOOM_CHECK(ffn_rank == 0 || ffn_blocks == 1,
             "model config: ffn_rank = {} and ffn_blocks = {}: an MLP is block-diagonal or low "
             "rank, not both",
             ffn_rank, ffn_blocks);
  LOOM_CHECK(ffn_rank == 0 || family != Family::kCustom,
             "model config: ffn_rank = {} applies to loom's GPT-2 and Llama MLPs, not a custom "
             "model",
             ffn_rank);
  LOOM_CHECK(ffn_blocks == 1 || family != Family::kCustom,
             "model config: ffn_blocks = {} applies to loom's GPT-2 and Llama MLPs, not a custom "
             "model",
             ffn_blocks);
  LOOM_CHECK(mtp_heads >= 0 && mtp_heads <= kMaxMtpHeads,
             "model config: mtp_heads = {} must be in [0, {}] (0: next-token prediction only)",
             mtp_heads, kMaxMtpHeads);
  LOOM_CHECK(mtp_heads == 0 || family != Family::kCustom,
             "model config: mtp_heads = {} adds loom's GPT-2 or Llama blocks as heads; a custom "
             "model has none",
             mtp_heads);
  LOOM_CHECK(share_layers.empty() || family != Family::kCustom,
             "model config: share_layers = '{}' shares loom's GPT-2 or Llama blocks; a custom "
             "model's blocks are its own",
             share_layers);
  parse_layer_sharing(share_layers, n_layers);  // throws on a pattern that does not fit
  LOOM_CHECK(norm_eps > 0, "model config: norm_eps = {} must be positive", norm_eps);
  const auto& rs = rope_scaling;
  LOOM_CHECK(rs.type.empty() || rs.type == "linear" || rs.type == "llama3",
             "model config: rope_scaling type '{}' is not supported (none, linear, llama3)",
             rs.type);
  LOOM_CHECK(rs.type.empty() || family == Family::kLlama,
             "model config: rope_scaling '{}' scales Llama's rotary frequencies; a {} model has "
             "none",
             rs.type, to_string(family));
  LOOM_CHECK(rs.type.empty() || (rs.factor >= 1 && std::isfinite(rs.factor)),
             "model config: rope_scaling factor = {} must be at least 1", rs.factor);
  LOOM_CHECK(
      rs.type != "llama3" || (rs.low_freq_factor > 0 && rs.high_freq_factor > rs.low_freq_factor &&
                              std::isfinite(rs.high_freq_factor)),
      "model config: llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, not "
      "{} and {}",
      rs.low_freq_factor, rs.high_freq_factor);
  LOOM_CHECK(rs.type != "llama3" || rs.original_max_seq_len > 0,
             "model config: llama3 rope_scaling original_max_seq_len = {} must be positive",
             rs.original_max_seq_len);
  LOOM_CHECK(dropout >= 0 && dropout < 1, "model config: dropout = {} must be in [0, 1)", dropout);
}

int64_t ModelConfig::mlp_weights() const {
  // One d_model x d_ff linear: dense, 1/ffn_blocks of it, or two rank-ffn_rank factors.
  const int64_t one = ffn_rank > 0 ? ffn_rank * (d_model + d_ff) : d_model * d_ff / ffn_blocks;
  return (family == Family::kLlama ? 3 : 2) * one;
}

int64_t ModelConfig::block_parameters() const {
  const int64_t d = d_model, kv = n_kv_heads * head_dim();
  // GPT-2's MLP: its linears' weights (mlp_weights) and two biases.
  if (family == Family::kGpt2)
    return (d * 3 * d + 3 * d) + (d * d + d) + mlp_weights() + d_ff + d + 4 * d;
  return d * d + 2 * d * kv + d * d + mlp_weights() + 2 * d;
}

int64_t ModelConfig::mtp_head_parameters() const {
  return block_parameters() + (family == Family::kGpt2 ? 2 * d_model : d_model);
}

int64_t ModelConfig::num_parameters() const {
  const int64_t d = d_model;
  const int64_t embed = vocab_size * d;
  const int64_t extra =
      family == Family::kGpt2 ? max_seq_len * d + 2 * d : d + (tie_embeddings ? 0 : vocab_size * d);
  return embed + extra + unique_blocks() * block_parameters() + mtp_heads * mtp_head_parameters();
}

std::vector<int64_t> ModelConfig::layer_owners() const {
  return parse_layer_sharing(share_layers, n_layers);
}

int64_t ModelConfig::unique_blocks() const {
  return static_cast<int64_t>(held_blocks(layer_owners(), 0, n_layers).size());
}

nlohmann::json ModelConfig::to_json() const {
  nlohmann::json j = {{"family", to_string(family)}, {"vocab_size", vocab_size},
                      {"max_seq_len", max_seq_len},  {"d_model", d_model},
                      {"n_layers", n_layers},        {"n_heads", n_heads},
                      {"n_kv_heads", n_kv_heads},    {"d_ff", d_ff},
                      {"norm_eps", norm_eps},        {"rope_theta", rope_theta},
                      {"dropout", dropout},          {"tie_embeddings", tie_embeddings}};
  // Written only when structured, so a dense model's config reads as it always did.
  if (ffn_blocks != 1) j["ffn_blocks"] = ffn_blocks;
  if (ffn_rank != 0) j["ffn_rank"] = ffn_rank;
  if (mtp_heads != 0) j["mtp_heads"] = mtp_heads;
  if (!share_layers.empty()) j["share_layers"] = share_layers;
  if (!rope_scaling.type.empty())
    j["rope_scaling"] = {{"type", rope_scaling.type},
                         {"factor", rope_scaling.factor},
                         {"low_freq_factor", rope_scaling.low_freq_factor},
                         {"high_freq_factor", rope_scaling.high_freq_factor},
                         {"original_max_seq_len", rope_scaling.original_max_seq_len}};
  return j;
}

ModelConfig ModelConfig::from_json(const nlohmann::json& j) {
  ModelConfig c;
  // Integer fields must hold JSON integers (a float would be cast: undefined when out of range).
  auto like = c.to_json();
  like["ffn_blocks"] = c.ffn_blocks;  // optional, but an integer when present
  like["ffn_rank"] = c.ffn_rank;
  like["mtp_heads"] = c.mtp_heads;
  like["share_layers"] = c.share_layers;
  like["rope_scaling"] = {{"type", ""},
                          {"factor", 1.0},
                          {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0},
                          {"original_max_seq_len", int64_t{8192}}};
  core::check_json_like(j, like, "model config");
  try {
    c.family = family_from_string(j.at("family").get<std::string>());
    c.vocab_size = j.at("vocab_size").get<int64_t>();
    c.max_seq_len = j.at("max_seq_len").get<int64_t>();
    c.d_model = j.at("d_model").get<int64_t>();
    c.n_layers = j.at("n_layers").get<int64_t>();
    c.n_heads = j.at("n_heads").get<int64_t>();
    c.n_kv_heads = j.at("n_kv_heads").get<int64_t>();
    c.d_ff = j.at("d_ff").get<int64_t>();
    c.norm_eps = j.at("norm_eps").get<double>();
    c.rope_theta = j.at("rope_theta").get<double>();
    c.dropout = j.at("dropout").get<double>();
    c.ffn_blocks = j.value("ffn_blocks", int64_t{1});
    c.ffn_rank = j.value("ffn_rank", int64_t{0});
    c.mtp_heads = j.value("mtp_heads", int64_t{0});
    c.share_layers = j.value("share_layers", std::string());
    if (j.contains("rope_scaling")) {
      const auto& rs = j.at("rope_scaling");
      c.rope_scaling.type = rs.at("type").get<std::string>();
      c.rope_scaling.factor = rs.at("factor").get<double>();
      c.rope_scaling.low_freq_factor = rs.at("low_freq_factor").get<double>();
      c.rope_scaling.high_freq_factor = rs.at("high_freq_factor").get<double>();
      c.rope_scaling.original_max_seq_len = rs.at("original_max_seq_len").get<int64_t>();
    }
    c.tie_embeddings = j.at("tie_embeddings").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    fail("model config JSON is missing a field or has a wrong type: {}", e.what());
  }
  c.validate();
  return c;
}

namespace {
ModelConfig gpt2(int64_t d, int64_t layers, int64_t heads, int64_t seq, int64_t vocab) {
  ModelConfig c;
  c.family = Family::kGpt2;
  c.d_model = d;
  c.n_layers = layers;
  c.n_heads = c.n_kv_heads = heads;
  c.d_ff = 4 * d;
  c.max_seq_len = seq;
  c.vocab_size = vocab;
  return c;
}
ModelConfig llama(int64_t d, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ff,
                  int64_t seq, int64_t vocab) {
  ModelConfig c;
  c.family = Family::kLlama;
  c.d_model = d;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.d_ff = ff;
  c.max_seq_len = seq;
  c.vocab_size = vocab;
  c.tie_embeddings = false;
  return c;
}
}  // namespace

std::vector<std::string> ModelConfig::preset_names() {
  return {"gpt2-tiny",  "gpt2-mini",  "gpt2-124m", "gpt2-350m",
          "llama-tiny", "llama-mini", "llama-1b",  "llama-8b"};
}

ModelConfig ModelConfig::preset(const std::string& name) {
  // Vocab sizes are those of the tokenizers the shapes come from; loom-pretrain replaces them
  // with the data's tokenizer vocabulary.
  if (name == "gpt2-tiny") return gpt2(128, 4, 4, 256, 50257);
  if (name == "gpt2-mini") return gpt2(256, 6, 8, 512, 50257);
  if (name == "gpt2-124m") return gpt2(768, 12, 12, 1024, 50257);
  if (name == "gpt2-350m") return gpt2(1024, 24, 16, 1024, 50257);
  if (name == "llama-tiny") return llama(128, 4, 4, 2, 352, 256, 32000);
  // gpt2-mini's width and depth with grouped-query attention: the planner's CPU validation.
  if (name == "llama-mini") return llama(256, 6, 8, 4, 704, 512, 32000);
  if (name == "llama-1b") {  // TinyLlama-1.1B's shape
    auto c = llama(2048, 22, 32, 4, 5632, 2048, 32000);
    return c;
  }
  if (name == "llama-8b") {  // Llama 3 8B's shape
    auto c = llama(4096, 32, 32, 8, 14336, 8192, 128256);
    c.rope_theta = 500000;
    return c;
  }
  fail("model preset '{}' is not known; valid presets: {}", name, fmt::join(preset_names(), ", "));
}

}  // namespace loom::models
