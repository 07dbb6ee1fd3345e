#pragma once
// The text steps of a Hugging Face tokenizer.json around its model (private to src/data):
// normalizers, pre-tokenizers and decoders, each read from its JSON object and applied as the
// `tokenizers` library does. Unsupported types are refused with the file and the type named.
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data::hf {

// One split of the text on its way to the model. `at_text_start`: it begins at offset 0 of the
// original text (Metaspace's prepend_scheme "first" prepends only there).
struct Split {
  std::string text;
  bool at_text_start = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void apply(std::string& text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void apply(std::vector<Split>& splits) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Maps the token strings to strings, as the library's decode_chain does.
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

// `where` names the file for errors. A null JSON value gives nullptr (no step).
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, const std::string& where);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j,
                                                 const std::string& where);
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, const std::string& where);

// The byte-level alphabet (GPT-2's bytes_to_unicode): each byte's character, as UTF-8.
const std::vector<std::string>& byte_level_chars();

}  // namespace loom::data::hf
