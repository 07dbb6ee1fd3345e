// HfTokenizer (tokenizer.json) and SentencePieceTokenizer (.model) on small hand-made files whose
// ids follow from the algorithms by hand; bad files refused by name. The equality with the
// reference libraries on real files is data.tokenizer_reference (tokenizer_reference.py).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "loom/data/hf_tokenizer.h"
#include "loom/data/sentencepiece_tokenizer.h"
#include "loom/data/tokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using loom::data::HfTokenizer;
using loom::data::SentencePieceTokenizer;
using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;

namespace {

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// GPT-2's byte-level character for byte b, as UTF-8.
std::string byte_char(int b) {
  const auto printable = [](int c) {
    return (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
  };
  int cp = b;
  if (!printable(b)) {
    cp = 0x100;
    for (int c = 0; c < b; ++c) cp += printable(c) ? 0 : 1;
  }
  if (cp < 0x80) return std::string(1, static_cast<char>(cp));
  return {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
}

// A byte-level BPE: ids 0..255 are the bytes, then one id per merge, in rank order.
json byte_level_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges,
                          const json& pre_tokenizer) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  json m = json::array();
  int id = 256;
  for (const auto& [l, r] : merges) {
    vocab[l + r] = id++;
    m.push_back(json::array({l, r}));
  }
  return {{"version", "1.0"},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", m}, {"byte_fallback", false}}}};
}

const json kGpt2PreTokenizer = {
    {"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};

fs::path save(const TempDir& dir, const json& j, const std::string& name = "tokenizer.json") {
  const fs::path path = dir.path() / name;
  write_file(path, j.dump());
  return path;
}

// Protobuf wire format, enough to write a SentencePiece ModelProto.
std::string varint(uint64_t v) {
  std::string out;
  do {
    out.push_back(static_cast<char>((v & 0x7F) | (v > 0x7F ? 0x80 : 0)));
    v >>= 7;
  } while (v != 0);
  return out;
}
std::string field_varint(int f, uint64_t v) {
  return varint(uint64_t(f) << 3) + varint(v);
}
std::string field_bytes(int f, const std::string& b) {
  return varint((uint64_t(f) << 3) | 2) + varint(b.size()) + b;
}
std::string field_float(int f, float x) {
  std::string out = varint((uint64_t(f) << 3) | 5);
  char bytes[4];
  std::memcpy(bytes, &x, 4);
  return out + std::string(bytes, 4);
}
std::string piece(const std::string& p, float score, int type = 1) {
  return field_bytes(1, field_bytes(1, p) + field_float(2, score) + field_varint(3, type));
}

const std::string kSp = "\xE2\x96\x81";  // U+2581

// <unk> <s> </s> ▁ a b ▁a ab [X](user-defined) <0x43>(byte 'C'); "ab" outscores "▁a".
std::string sp_model(int model_type, bool byte_fallback, const std::string& charsmap = "") {
  std::string m = piece("<unk>", 0, 2) + piece("<s>", 0, 3) + piece("</s>", 0, 3) + piece(kSp, -1) +
                  piece("a", -2) + piece("b", -3) + piece(kSp + "a", -0.5f) + piece("ab", -0.1f) +
                  piece("[X]", 0, 4) + piece("<0x43>", 0, 6);
  m += field_bytes(2, field_varint(3, model_type) + field_varint(35, byte_fallback ? 1 : 0));
  std::string norm = field_bytes(1, "identity") + field_varint(3, 1) + field_varint(4, 0);
  if (!charsmap.empty()) norm += field_bytes(2, charsmap);
  return m + field_bytes(3, norm);
}

}  // namespace

TEST(HfTokenizer, ByteLevelBpeMergesByRankAndDecodesBack) {
  TempDir dir;
  const auto path =
      save(dir, byte_level_tokenizer(
                    {{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {byte_char(' '), "h"}},
                    kGpt2PreTokenizer));
  const HfTokenizer tok(path);
  EXPECT_EQ(tok.vocab_size(), 261);
  EXPECT_EQ(tok.kind(), "hf-json");
  // "hello" merges whole (ids 256..259); in " hello" the rank-0 merge h+e comes before
  // Ġ+h (rank 4), so the space stays a byte of its own.
  EXPECT_EQ(tok.encode("hello hello"), (std::vector<int32_t>{259, 32, 259}));
  EXPECT_EQ(tok.decode({259, 32, 259}), "hello hello");
  const std::string text = "caf\xC3\xA9 \xF0\x9F\x99\x82 12\t\r\n  x";
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
  // An invalid byte sequence decodes to U+FFFD, as the library's lossy decoding gives.
  EXPECT_EQ(tok.decode({0xE2, 0x82}), "\xEF\xBF\xBD");
  EXPECT_FALSE(tok.document_start().has_value());
  const std::string message = error_of([&] { tok.decode({261}); });
  EXPECT_TRUE(contains(message, "id 261")) << message;
}

TEST(HfTokenizer, IntervalsRepeatAsInOnigurumasRubySyntax) {
  // X{1,2}+ is (X{1,2})+ for the tokenizers library: "12345" stays one pre-token, and the
  // merge 2+3 applies across what a possessive {1,2} would have cut into 12|34|5.
  TempDir dir;
  const json split = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({{{"type", "Split"},
                     {"pattern", {{"Regex", "\\d{1,2}+"}}},
                     {"behavior", "Isolated"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  const HfTokenizer tok(save(dir, byte_level_tokenizer({{"2", "3"}}, split)));
  EXPECT_EQ(tok.encode("12345"), (std::vector<int32_t>{'1', 256, '4', '5'}));
  EXPECT_EQ(tok.encode("1a2"), (std::vector<int32_t>{'1', 'a', '2'}));
}

TEST(HfTokenizer, AddedTokensSplitTheTextWithTheirFlags) {
  TempDir dir;
  json j = byte_level_tokenizer({}, kGpt2PreTokenizer);
  j["added_tokens"] = json::array(
      {{{"id", 256}, {"content", "<|x|>"}, {"special", true}},
       {{"id", 257}, {"content", "<m>"}, {"special", true}, {"lstrip", true}, {"rstrip", true}},
       {{"id", 258}, {"content", "cat"}, {"special", false}, {"single_word", true}}});
  const HfTokenizer tok(save(dir, j));
  EXPECT_EQ(tok.vocab_size(), 259);
  EXPECT_EQ(tok.encode("a<|x|>b"), (std::vector<int32_t>{'a', 256, 'b'}));
  // lstrip/rstrip take the spaces beside the token with it.
  EXPECT_EQ(tok.encode("a  <m> b"), (std::vector<int32_t>{'a', 257, 'b'}));
  // single_word: "cat" alone is the token, inside "concat" it is text.
  const auto ids = tok.encode("cat concat");
  EXPECT_EQ(ids.front(), 258);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 258), 1);
  EXPECT_EQ(tok.decode(tok.encode("a<|x|>b cat")), "a<|x|>b cat");
}

TEST(HfTokenizer, MetaspaceByteFallbackAndTheDocumentStart) {
  // The SentencePiece kind: Metaspace, byte fallback, <s> from tokenizer_config.json.
  TempDir dir;
  json vocab = {{"<unk>", 0}, {"<s>", 1},     {"</s>", 2}, {kSp, 3},       {"a", 4},
                {"b", 5},     {kSp + "a", 6}, {"ab", 7},   {kSp + "ab", 8}};
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = 9 + b;
  const json j = {
      {"added_tokens", json::array({{{"id", 1}, {"content", "<s>"}, {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Metaspace"},
        {"replacement", kSp},
        {"prepend_scheme", "first"},
        {"split", false}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         json::array({{{"type", "Replace"}, {"pattern", {{"String", kSp}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", json::array({"a b", kSp + " ab"})},
        {"byte_fallback", true},
        {"unk_token", "<unk>"}}}};
  save(dir, j);
  write_file(dir.path() / "tokenizer_config.json", R"({"bos_token": "<s>"})");
  const HfTokenizer tok(dir.path() / "tokenizer.json");
  EXPECT_EQ(tok.document_start(), 1);
  // "▁ab▁ab" -> ▁ab ▁ab (a+b first, then ▁+ab); 'Z' is no token: its byte <0x5A>.
  EXPECT_EQ(tok.encode("ab ab"), (std::vector<int32_t>{8, 8}));
  EXPECT_EQ(tok.encode("aZ"), (std::vector<int32_t>{3, 4, 9 + 'Z'}));  // no ▁+a merge
  EXPECT_EQ(tok.decode({8, 8, 9 + 'Z'}), "ab abZ");
  ASSERT_EQ(tok.files().size(), 2u);
  EXPECT_EQ(tok.files()[1].name, "tokenizer_config.json");
}

TEST(HfTokenizer, RefusesWhatItCannotReadNamingTheFile) {
  TempDir dir;
  const auto expect_refused = [&](const json& j, const std::string& part) {
    const auto path = save(dir, j, "bad.json");
    const std::string message = error_of([&] { HfTokenizer tok(path); });
    EXPECT_TRUE(contains(message, "bad.json")) << message;
    EXPECT_TRUE(contains(message, part)) << message;
  };
  json wordpiece = byte_level_tokenizer({}, kGpt2PreTokenizer);
  wordpiece["model"]["type"] = "WordPiece";
  expect_refused(wordpiece, "WordPiece");
  json bert = byte_level_tokenizer({}, kGpt2PreTokenizer);
  bert["normalizer"] = {{"type", "BertNormalizer"}};
  expect_refused(bert, "BertNormalizer");
  json bad_merge = byte_level_tokenizer({}, kGpt2PreTokenizer);
  bad_merge["model"]["merges"] = json::array({"a zz"});
  expect_refused(bad_merge, "merge 0");
  json bad_regex = byte_level_tokenizer(
      {}, {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}});
  expect_refused(bad_regex, "regular expression");
  json bad_behavior = byte_level_tokenizer(
      {}, {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"}});
  expect_refused(bad_behavior, "Sideways");
  write_file(dir.path() / "broken.json", "{\"model\": {");
  const std::string message = error_of([&] { HfTokenizer tok(dir.path() / "broken.json"); });
  EXPECT_TRUE(contains(message, "broken.json") && contains(message, "not valid JSON")) << message;
  // No unk_token and no byte fallback: a character outside the vocabulary is an error, not
  // silently dropped.
  json no_unk = byte_level_tokenizer({}, nullptr);
  no_unk["decoder"] = nullptr;
  const HfTokenizer plain(save(dir, no_unk, "plain.json"));
  const std::string dropped = error_of([&] { plain.encode("a\xE2\x82\xAC"); });  // a euro sign
  EXPECT_TRUE(contains(dropped, "no unk_token")) << dropped;
}

TEST(SentencePieceTokenizer, MergesByScoreWithUserPiecesBytesAndUnknowns) {
  TempDir dir;
  write_file(dir.path() / "fallback.model", sp_model(2, true));
  const SentencePieceTokenizer tok(dir.path() / "fallback.model");
  EXPECT_EQ(tok.vocab_size(), 10);
  EXPECT_EQ(tok.document_start(), 1);
  // "▁ab": a+b (score -0.1) merges before ▁+a (-0.5); ▁ab is no piece, so ▁ stays.
  EXPECT_EQ(tok.encode("ab"), (std::vector<int32_t>{3, 7}));
  // [X] is matched whole; 'C' goes to its byte piece; 'D' has none, so it is <unk>.
  EXPECT_EQ(tok.encode("a[X]C"), (std::vector<int32_t>{6, 8, 9}));
  EXPECT_EQ(tok.encode("DD"), (std::vector<int32_t>{3, 0}));  // a run of unknowns: one <unk>
  EXPECT_EQ(tok.decode({1, 3, 7, 3, 7, 2}), "ab ab");
  EXPECT_EQ(tok.decode({6, 8, 9, 0}), "a[X]C \xE2\x81\x87 ");
  EXPECT_EQ(tok.encode(""), std::vector<int32_t>{});

  write_file(dir.path() / "plain.model", sp_model(2, false));
  EXPECT_EQ(SentencePieceTokenizer(dir.path() / "plain.model").encode("aC"),
            (std::vector<int32_t>{6, 0}));
}

// A darts-clone double array holding one rule, "A" -> "a": the root's children start at 1, so
// 'A' (0x41) lands on unit 1 ^ 0x41 = 64, whose leaf flag points (offset 2) at unit 66 holding
// the rule's value, the replacement's offset 0 in the strings that follow.
std::string one_rule_charsmap() {
  std::vector<uint32_t> units(67, 0);
  units[0] = 1u << 10;
  units[64] = (2u << 10) | (1u << 8) | 0x41u;
  units[66] = (1u << 31) | 0u;
  const auto trie_bytes = static_cast<uint32_t>(units.size() * 4);
  std::string blob(4 + trie_bytes + 2, '\0');  // + the replacement "a" and its NUL
  std::memcpy(blob.data(), &trie_bytes, 4);
  std::memcpy(blob.data() + 4, units.data(), trie_bytes);
  blob[4 + trie_bytes] = 'a';
  return blob;
}

// Unigram models by hand: the best-scoring segmentation ("▁ab": ▁ + ab scores -1.1, beating
// ▁a + b at -3.5 and ▁ + a + b at -6), user-defined pieces (score ~ -0.1) kept whole, unknown
// characters as their bytes under byte fallback or one <unk> a run, and a precompiled
// character map applied before (A -> a), not to user-defined pieces.
TEST(SentencePieceTokenizer, UnigramModelsTakeTheBestSegmentationAfterTheCharacterMap) {
  TempDir dir;
  write_file(dir.path() / "bytes.model", sp_model(1, true));
  write_file(dir.path() / "unk.model", sp_model(1, false, one_rule_charsmap()));
  const SentencePieceTokenizer bytes(dir.path() / "bytes.model");
  const SentencePieceTokenizer unk(dir.path() / "unk.model");
  EXPECT_EQ(bytes.encode("ab"), (std::vector<int32_t>{3, 7}));
  EXPECT_EQ(bytes.encode("a[X]"), (std::vector<int32_t>{6, 8}));
  EXPECT_EQ(bytes.encode("aC"), (std::vector<int32_t>{6, 9}));
  EXPECT_EQ(unk.encode("aC"), (std::vector<int32_t>{6, 0}));
  EXPECT_EQ(unk.encode("DD b"), (std::vector<int32_t>{3, 0, 3, 5}));  // one <unk> for "DD"
  EXPECT_EQ(unk.encode("Ab"), (std::vector<int32_t>{3, 7}));          // A -> a, then "▁ab"
  EXPECT_EQ(bytes.encode("Ab"), (std::vector<int32_t>{3, 0, 5}));     // no map: A is unknown
  EXPECT_EQ(unk.decode(unk.encode("Ab ab")), "ab ab");
}

TEST(SentencePieceTokenizer, RefusesWhatItCannotReadNamingTheFile) {
  TempDir dir;
  const auto refused = [&](const std::string& bytes, const std::string& part) {
    write_file(dir.path() / "bad.model", bytes);
    const std::string message =
        error_of([&] { SentencePieceTokenizer tok(dir.path() / "bad.model"); });
    EXPECT_TRUE(contains(message, "bad.model")) << message;
    EXPECT_TRUE(contains(message, part)) << message;
  };
  refused(sp_model(3, true), "model type 3 is not supported");
  refused(sp_model(2, true, "charsmap-bytes"), "precompiled character map: a trie of");
  refused(sp_model(1, true, std::string("\x04\0\0\0\0\x04\0\0x", 9)), "do not end in a NUL");
  const std::string model = sp_model(2, true);
  refused(model.substr(0, model.size() / 2), "truncated");
  refused("", "no pieces");
  refused(piece("<unk>", 0, 2) + piece("", 0, 4) + field_bytes(2, field_varint(3, 2)),
          "piece 1 is empty");
}

TEST(Tokenizer, OpenTokenizerPicksTheKindFromThePathAndMetaKeepsIt) {
  TempDir dir;
  fs::create_directories(dir.path() / "hf");
  fs::create_directories(dir.path() / "sp");
  fs::create_directories(dir.path() / "empty");
  write_file(dir.path() / "hf" / "tokenizer.json",
             byte_level_tokenizer({{"h", "e"}}, kGpt2PreTokenizer).dump());
  write_file(dir.path() / "hf" / "tokenizer_config.json", R"({"bos_token": "he"})");
  write_file(dir.path() / "sp" / "tokenizer.model", sp_model(2, true));
  EXPECT_EQ(loom::data::open_tokenizer("byte")->kind(), "byte");
  EXPECT_EQ(loom::data::open_tokenizer(dir.path() / "sp")->kind(), "sentencepiece");
  EXPECT_EQ(loom::data::open_tokenizer(dir.path() / "sp" / "tokenizer.model")->kind(),
            "sentencepiece");
  const auto hf = loom::data::open_tokenizer(dir.path() / "hf");
  EXPECT_EQ(hf->kind(), "hf-json");
  EXPECT_EQ(hf->document_start(), 256);
  for (const fs::path& bad : {dir.path() / "missing.json", dir.path() / "empty"}) {
    const std::string message = error_of([&] { loom::data::open_tokenizer(bad); });
    EXPECT_TRUE(contains(message, bad.string())) << message;
  }

  // A data directory keeps the files and gives the same tokenizer back; another kind saved
  // into it later removes them.
  const fs::path data = dir.path() / "data";
  loom::data::save_tokenizer_meta(*hf, data);
  EXPECT_TRUE(fs::exists(data / "tokenizer.json") && fs::exists(data / "tokenizer_config.json"));
  const auto meta = json::parse(std::ifstream(data / "meta.json"));
  EXPECT_EQ(meta["tokenizer"], "hf-json");
  EXPECT_EQ(meta["document_start"], 256);
  const auto loaded = loom::data::load_tokenizer(data);
  EXPECT_EQ(loaded->encode("hello there"), hf->encode("hello there"));
  EXPECT_EQ(loaded->document_start(), 256);
  loom::data::save_tokenizer_meta(*loom::data::open_tokenizer(dir.path() / "sp"), data);
  EXPECT_FALSE(fs::exists(data / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(data / "tokenizer.model"));
  EXPECT_EQ(loom::data::load_tokenizer(data)->kind(), "sentencepiece");
}
