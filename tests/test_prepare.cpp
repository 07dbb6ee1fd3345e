// prepare_shards (loom-prepare's engine): streaming, parallel, in input order, from files,
// directories, globs and JSON lines; the ids equal encoding each document in turn.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "loom/data/hf_tokenizer.h"
#include "loom/data/prepare.h"
#include "loom/data/token_shard.h"
#include "test_util.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;

namespace {

void write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::vector<int32_t> read_shard(const fs::path& path) {
  const loom::data::TokenShard shard(path);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < shard.size(); ++i) ids.push_back(static_cast<int32_t>(shard.token(i)));
  return ids;
}

// A byte-level BPE with a few merges and <s> (id 260) as its document start.
fs::path write_tokenizer(const fs::path& dir) {
  json vocab = json::object();
  int next = 256;
  std::vector<std::string> chars(256);
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next++;
    std::string c;
    if (cp < 0x80) {
      c.push_back(static_cast<char>(cp));
    } else {
      c.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      c.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[c] = b;
    chars[b] = c;
  }
  vocab["th"] = 256, vocab["the"] = 257, vocab[chars[' '] + "the"] = 258, vocab["in"] = 259;
  const json tok = {
      {"added_tokens", json::array({{{"id", 260}, {"content", "<s>"}, {"special", true}}})},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", json::array({"t h", "th e", chars[' '] + " the", "i n"})}}}};
  write_file(dir / "tokenizer.json", tok.dump());
  write_file(dir / "tokenizer_config.json", R"({"bos_token": "<s>"})");
  return dir / "tokenizer.json";
}

std::string random_text(std::mt19937& rng, int words) {
  static const char* kWords[] = {"the", "in", "then", "thing", "x", "caf\xC3\xA9", "12",
                                 "\xE4\xB8\xAD\xE6\x96\x87", "  ", "\n", "theta", "!"};
  std::string s;
  for (int i = 0; i < words; ++i) {
    s += kWords[rng() % (sizeof(kWords) / sizeof(kWords[0]))];
    s += rng() % 3 == 0 ? "" : " ";
  }
  return s;
}

}  // namespace

TEST(Prepare, StreamingOnManyThreadsEqualsEncodingEachDocumentInTurn) {
  TempDir dir;
  const loom::data::HfTokenizer tok(write_tokenizer(dir.path() / "tok"));
  ASSERT_EQ(tok.document_start(), 260);
  std::mt19937 rng(7);
  // Two text files and a JSON-lines file of 3,000 documents: several batches in flight.
  std::vector<std::string> docs = {random_text(rng, 5000), random_text(rng, 3)};
  write_file(dir.path() / "in" / "a.txt", docs[0]);
  write_file(dir.path() / "in" / "b.txt", docs[1]);
  std::string lines;
  for (int i = 0; i < 3000; ++i) {
    docs.push_back(random_text(rng, 1 + static_cast<int>(rng() % 40)));
    lines += json({{"id", i}, {"body", docs.back()}}).dump() + "\n";
    if (i % 500 == 0) lines += "\n";  // blank lines are skipped
  }
  write_file(dir.path() / "in" / "c.jsonl", lines);
  std::vector<int32_t> expected;
  for (const auto& d : docs) {
    expected.push_back(260);
    const auto ids = tok.encode(d);
    expected.insert(expected.end(), ids.begin(), ids.end());
  }
  for (const int threads : {1, 3}) {
    loom::data::PrepareOptions o;
    o.inputs = {(dir.path() / "in").string()};
    o.out_dir = dir.path() / ("out" + std::to_string(threads));
    o.text_field = "body";
    o.threads = threads;
    o.val_fraction = 0.1;
    const auto stats = loom::data::prepare_shards(tok, o);
    EXPECT_EQ(stats.files, 3);
    EXPECT_EQ(stats.documents, static_cast<int64_t>(docs.size()));
    EXPECT_EQ(stats.tokens, static_cast<int64_t>(expected.size()));
    const auto n_val = static_cast<int64_t>(static_cast<double>(expected.size()) * 0.1);
    EXPECT_EQ(stats.val_tokens, n_val);
    auto got = read_shard(o.out_dir / "train.bin");
    EXPECT_EQ(static_cast<int64_t>(got.size()), stats.train_tokens);
    const auto val = read_shard(o.out_dir / "val.bin");
    EXPECT_EQ(static_cast<int64_t>(val.size()), n_val);
    got.insert(got.end(), val.begin(), val.end());
    EXPECT_EQ(got, expected) << threads << " threads";
    EXPECT_TRUE(fs::exists(o.out_dir / "tokenizer.json"));
    EXPECT_EQ(loom::data::load_tokenizer(o.out_dir)->document_start(), 260);
    EXPECT_FALSE(fs::exists(o.out_dir / "train.bin.all"));
  }
}

TEST(Prepare, ExpandsDirectoriesAndGlobsInNameOrderAndNamesWhatIsMissing) {
  TempDir dir;
  for (const char* name : {"d/b.txt", "d/a.txt", "d/sub/c.txt", "g/x2.jsonl", "g/x1.jsonl",
                           "g/y.txt"})
    write_file(dir.path() / name, "t");
  const auto files = loom::data::expand_inputs(
      {(dir.path() / "d").string(), (dir.path() / "g" / "x*.jsonl").string(),
       (dir.path() / "g" / "y.txt").string()});
  std::vector<std::string> names;
  for (const auto& f : files) names.push_back(fs::relative(f, dir.path()).string());
  EXPECT_EQ(names, (std::vector<std::string>{"d/a.txt", "d/b.txt", "d/sub/c.txt", "g/x1.jsonl",
                                             "g/x2.jsonl", "g/y.txt"}));
  for (const std::string& bad : {(dir.path() / "g" / "z*.txt").string(),
                                (dir.path() / "nope.txt").string()}) {
    const std::string message = error_of([&] { loom::data::expand_inputs({bad}); });
    EXPECT_TRUE(contains(message, bad)) << message;
  }
}

TEST(Prepare, BadJsonLinesAreNamedByLineAndLeaveNothingBehind) {
  TempDir dir;
  const loom::data::ByteTokenizer tok;
  write_file(dir.path() / "bad.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"text\": oops}\n");
  write_file(dir.path() / "field.jsonl", "{\"text\": \"a\"}\n{\"content\": \"b\"}\n");
  loom::data::PrepareOptions o;
  o.out_dir = dir.path() / "out";
  o.inputs = {(dir.path() / "bad.jsonl").string()};
  std::string message = error_of([&] { loom::data::prepare_shards(tok, o); });
  EXPECT_TRUE(contains(message, "bad.jsonl:3")) << message;
  o.inputs = {(dir.path() / "field.jsonl").string()};
  message = error_of([&] { loom::data::prepare_shards(tok, o); });
  EXPECT_TRUE(contains(message, "field.jsonl:2") && contains(message, "\"text\"")) << message;
  // Nothing half-written: no shards, no temporary files.
  for (const auto& entry : fs::directory_iterator(o.out_dir))
    ADD_FAILURE() << "left behind: " << entry.path();
  o.format = "csv";
  message = error_of([&] { loom::data::prepare_shards(tok, o); });
  EXPECT_TRUE(contains(message, "'csv'")) << message;
}
