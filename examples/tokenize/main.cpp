// loom-tokenize: text -> token ids, or ids -> text, with any tokenizer loom reads.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "loom/apps/cli.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{"Encode text to token ids (a JSON array on stdout) or decode ids to text.",
               "loom-tokenize"};
  std::string tokenizer = "byte", input;
  bool decode = false, document_start = false, json_lines = false;
  app.add_option("--tokenizer", tokenizer,
                 "\"byte\", a Hugging Face tokenizer.json, a SentencePiece .model file, or a "
                 "directory holding one (a data directory or checkpoint too)")
      ->capture_default_str();
  app.add_option("--input", input, "File to read (default: standard input)");
  app.add_flag("--decode", decode, "Read a JSON array of ids and write the text they decode to");
  app.add_flag("--json-lines", json_lines,
               "Many texts at once: each input line is a JSON string (or, with --decode, an "
               "array of ids), and each output line the JSON array of ids (or the JSON string)");
  app.add_flag("--document-start", document_start,
               "Put the tokenizer's document-start token first, as loom-prepare does");
  return loom::apps::run_app(app, argc, argv, [&] {
    std::unique_ptr<loom::data::Tokenizer> tok;
    const std::filesystem::path path(tokenizer);
    // A data directory or checkpoint names its tokenizer in meta.json.
    if (std::filesystem::is_regular_file(path / "meta.json"))
      tok = loom::data::load_tokenizer(path);
    else
      tok = loom::data::open_tokenizer(path);
    std::string text;
    if (input.empty())
      text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
    else
      text = loom::core::read_file(input);
    const auto parse = [](const std::string& line) {
      try {
        return nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        loom::fail("cannot read '{}' as JSON: {}", line.substr(0, 80), e.what());
      }
    };
    const auto decode_ids = [&](const nlohmann::json& ids) {
      LOOM_CHECK(ids.is_array(), "--decode expects a JSON array of ids, got {}", ids.type_name());
      std::vector<int32_t> v;
      for (const auto& id : ids) {
        LOOM_CHECK(id.is_number_integer(), "--decode: {} is not an integer id", id.dump());
        v.push_back(id.get<int32_t>());
      }
      return tok->decode(v);
    };
    const auto encode_text = [&](std::string_view t) {
      std::vector<int32_t> ids;
      if (document_start)
        if (const auto start = tok->document_start()) ids.push_back(*start);
      const auto body = tok->encode(t);
      ids.insert(ids.end(), body.begin(), body.end());
      return ids;
    };
    if (!json_lines) {
      if (decode) {
        const std::string out = decode_ids(parse(text));
        std::fwrite(out.data(), 1, out.size(), stdout);
      } else {
        std::puts(nlohmann::json(encode_text(text)).dump().c_str());
      }
      return;
    }
    size_t line_no = 0;
    for (size_t pos = 0; pos < text.size();) {
      size_t end = text.find('\n', pos);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(pos, end - pos);
      pos = end + 1;
      ++line_no;
      if (line.empty()) continue;
      const nlohmann::json value = parse(line);
      if (decode) {
        // Byte-level tokenizers can decode to invalid UTF-8; JSON shows it as U+FFFD.
        std::puts(nlohmann::json(decode_ids(value))
                      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                      .c_str());
      } else {
        LOOM_CHECK(value.is_string(), "line {}: expected a JSON string, got {}", line_no,
                   value.type_name());
        std::puts(nlohmann::json(encode_text(value.get<std::string>())).dump().c_str());
      }
    }
  });
}
