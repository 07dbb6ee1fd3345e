#include "loom/data/tokenizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "test_util.h"

namespace fs = std::filesystem;
using loom::data::ByteTokenizer;
using loom::data::Gpt2BpeTokenizer;
using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;

namespace {

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// GPT-2's symbol for byte `b`, spelled out from the definition of bytes_to_unicode() (printable
// Latin-1 stands for itself, the remaining bytes take U+0100.. in order) and encoded as UTF-8.
std::string byte_symbol(int b) {
  const auto printable = [](int c) {
    return (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
  };
  int cp = b;
  if (!printable(b)) {
    cp = 0x100;
    for (int c = 0; c < b; ++c) {
      cp += printable(c) ? 0 : 1;
    }
  }
  if (cp < 0x80) {
    return std::string(1, static_cast<char>(cp));
  }
  return {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
}

// Merges of the test vocabulary, by rank. "Ġ" is the space byte, "Ċ" a newline, and "Ã ©" /
// "Â" are the UTF-8 bytes of "é" / a no-break space.
const std::vector<std::string> kMerges = {
    "Ġ w", "o r",  "Ġw or", "l d", "Ġwor ld", "l l", "H e", "He ll", "Hell o", "' t",
    "d o", "Ġ do", "Ġdo n", "2 0", "20 2",    "Ġ Ġ", "Ã ©", "f Ã©",  ". .",    "a Â",
};

// Token ids: each byte's symbol has the byte's value; merge i's result has id 256 + i.
int32_t merged_id(const std::string& merge) {
  for (size_t i = 0; i < kMerges.size(); ++i) {
    if (kMerges[i] == merge) {
      return static_cast<int32_t>(256 + i);
    }
  }
  ADD_FAILURE() << "no merge " << merge;
  return -1;
}

// Writes vocab.json and merges.txt for the test vocabulary into `dir`.
void write_test_bpe(const fs::path& dir) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    vocab[byte_symbol(b)] = b;
  }
  std::string merges = "#version: 0.2\n";
  for (size_t i = 0; i < kMerges.size(); ++i) {
    const std::string& merge = kMerges[i];
    const size_t space = merge.find(' ');
    vocab[merge.substr(0, space) + merge.substr(space + 1)] = 256 + i;
    merges += merge + "\n";
  }
  write_file(dir / "vocab.json", vocab.dump());
  write_file(dir / "merges.txt", merges);
}

}  // namespace

TEST(Tokenizer, ByteRoundTripsAllByteValues) {
  ByteTokenizer tok;
  std::string text;
  std::vector<int32_t> expected;
  for (int b = 0; b < 256; ++b) {
    text.push_back(static_cast<char>(b));
    expected.push_back(b);
  }
  EXPECT_EQ(tok.encode(text), expected);
  EXPECT_EQ(tok.decode(expected), text);
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.kind(), "byte");
}

TEST(Tokenizer, ByteDecodeRejectsIdOutsideByteRange) {
  ByteTokenizer tok;
  EXPECT_TRUE(contains(error_of([&] { tok.decode({65, 256}); }), "256"));
  EXPECT_TRUE(contains(error_of([&] { tok.decode({-1}); }), "-1"));
}

TEST(Tokenizer, BpeEncodesExactIds) {
  TempDir dir;
  write_test_bpe(dir.path());
  Gpt2BpeTokenizer tok(dir.path() / "vocab.json", dir.path() / "merges.txt");
  EXPECT_EQ(tok.vocab_size(), static_cast<int64_t>(256 + kMerges.size()));
  EXPECT_EQ(tok.kind(), "gpt2-bpe");

  const std::string text = "Hello world, don't stop 2024...\n\nbye   now\n";
  // The ids of each pre-token piece, in order.
  const std::vector<std::vector<int32_t>> pieces = {
      {merged_id("Hell o")},          // "Hello"
      {merged_id("Ġwor ld")},         // " world"
      {','},                          // ","
      {merged_id("Ġdo n")},           // " don"
      {merged_id("' t")},             // "'t"
      {' ', 's', 't', 'o', 'p'},      // " stop": no merge applies
      {' ', merged_id("20 2"), '4'},  // " 2024": digits group, "Ġ" has no merge with "2"
      {merged_id(". ."), '.'},        // "...": the leftmost pair merges first
      {'\n'},                         // "\n\n" before a word splits into "\n" and "\n"
      {'\n'},                         // (the run would otherwise end next to a non-space)
      {'b', 'y', 'e'},                // "bye"
      {merged_id("Ġ Ġ")},             // "  ": a run of spaces leaves its last one to the word
      {' ', 'n', 'o', 'w'},           // " now"
      {'\n'}};                        // "\n"; a trailing run of whitespace stays whole
  std::vector<int32_t> expected;
  for (const auto& ids : pieces) {
    expected.insert(expected.end(), ids.begin(), ids.end());
  }
  EXPECT_EQ(tok.encode(text), expected);
  EXPECT_EQ(tok.decode(expected), text);
}

TEST(Tokenizer, EndOfTextIsOneSpecialTokenWhenTheVocabularyHasIt) {
  TempDir dir;
  write_test_bpe(dir.path());
  Gpt2BpeTokenizer plain(dir.path() / "vocab.json", dir.path() / "merges.txt");
  EXPECT_FALSE(plain.document_start().has_value());
  EXPECT_GT(plain.encode("a<|endoftext|>b").size(), 3u);  // just characters here
  auto vocab = nlohmann::json::parse(loom::core::read_file(dir / "vocab.json"));
  const int32_t eot = static_cast<int32_t>(vocab.size());
  vocab["<|endoftext|>"] = eot;
  write_file(dir / "vocab.json", vocab.dump());
  Gpt2BpeTokenizer tok(dir.path() / "vocab.json", dir.path() / "merges.txt");
  ASSERT_EQ(tok.document_start(), eot);
  const auto ids = tok.encode("a<|endoftext|>b<|endoftext|>");
  EXPECT_EQ(ids, (std::vector<int32_t>{'a', eot, 'b', eot}));
  EXPECT_EQ(tok.decode(ids), "a<|endoftext|>b<|endoftext|>");
  EXPECT_FALSE(ByteTokenizer().document_start().has_value());
}

TEST(Tokenizer, BpeClassifiesUnicodeLikeGpt2) {
  TempDir dir;
  write_test_bpe(dir.path());
  Gpt2BpeTokenizer tok(dir.path() / "vocab.json", dir.path() / "merges.txt");
  // "é" stays in the word " café", so "f Ã©" merges across the letter boundary.
  const std::vector<int32_t> cafe = {'n', 'a', 0xC3, 0xAF, 'v',
                                     'e', ' ', 'c',  'a',  merged_id("f Ã©")};
  EXPECT_EQ(tok.encode("naïve café"), cafe);
  // A no-break space (C2 A0) is whitespace, so "a Â" cannot merge across it.
  EXPECT_EQ(tok.encode("a\u00A0b"), (std::vector<int32_t>{'a', 0xC2, 0xA0, 'b'}));
  // "²" (C2 B2) is a number (\p{N}), not a letter: "a" and "²" are separate words, so the
  // merge "a Â" does not apply either. "ª" (C2 AA) is a letter: the merge applies.
  EXPECT_EQ(tok.encode("a\u00B2"), (std::vector<int32_t>{'a', 0xC2, 0xB2}));
  EXPECT_EQ(tok.encode("a\u00AA"), (std::vector<int32_t>{merged_id("a Â"), 0xAA}));
}

TEST(Tokenizer, BpeRoundTripsArbitraryText) {
  TempDir dir;
  write_test_bpe(dir.path());
  Gpt2BpeTokenizer tok(dir.path() / "vocab.json", dir.path() / "merges.txt");
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) {
    all_bytes.push_back(static_cast<char>(b));
  }
  const std::vector<std::string> texts = {
      "",        "naïve café", "Hello world, don't stop 2024...\n\nbye   now\n",
      "  \t\n ", "'s'S''ll",   "日本語のテキスト — «quoted» €5",
      all_bytes};
  for (const std::string& text : texts) {
    EXPECT_EQ(tok.decode(tok.encode(text)), text) << text;
    // The second encode is served from the word cache and must agree with the first.
    EXPECT_EQ(tok.encode(text), tok.encode(text)) << text;
  }
}

TEST(Tokenizer, BpeEncodeFromManyThreadsAgrees) {
  TempDir dir;
  write_test_bpe(dir.path());
  const Gpt2BpeTokenizer tok(dir.path() / "vocab.json", dir.path() / "merges.txt");
  const std::string text = "Hello world, don't stop 2024...\n\nbye   now\nnaïve café";
  const std::vector<int32_t> expected = tok.encode(text);
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < mismatches.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        // A fresh word per iteration keeps the threads inserting into the shared cache.
        const std::string word = fmt::format(" w{}x{}", t, i);
        mismatches[t] += tok.encode(text + word) != tok.encode(text + word) ? 1 : 0;
        mismatches[t] += tok.encode(text) != expected ? 1 : 0;
      }
    });
  }
  for (std::thread& thread : threads) {
    thread.join();
  }
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(Tokenizer, BpeUnknownTokenAfterMergeNamesIt) {
  TempDir dir;
  write_test_bpe(dir.path());
  write_file(dir.path() / "merges.txt", "x y\n");  // "xy" is not in the vocabulary
  Gpt2BpeTokenizer tok(dir.path() / "vocab.json", dir.path() / "merges.txt");
  EXPECT_TRUE(contains(error_of([&] { tok.encode("a xy"); }), "'xy'"));
}

TEST(Tokenizer, BpeDecodeRejectsUnknownId) {
  TempDir dir;
  write_test_bpe(dir.path());
  Gpt2BpeTokenizer tok(dir.path() / "vocab.json", dir.path() / "merges.txt");
  EXPECT_TRUE(contains(error_of([&] { tok.decode({1, 99999}); }), "99999"));
}

TEST(Tokenizer, BpeMissingVocabFileNamesIt) {
  TempDir dir;
  write_test_bpe(dir.path());
  const std::string message = error_of(
      [&] { Gpt2BpeTokenizer(dir.path() / "missing_vocab.json", dir.path() / "merges.txt"); });
  EXPECT_TRUE(contains(message, "missing_vocab.json")) << message;
}

TEST(Tokenizer, BpeMalformedMergesLineNamesFileAndLine) {
  TempDir dir;
  write_test_bpe(dir.path());
  write_file(dir.path() / "bad_merges.txt", "#version: 0.2\nĠ w\nnospace\n");
  const std::string message =
      error_of([&] { Gpt2BpeTokenizer(dir.path() / "vocab.json", dir.path() / "bad_merges.txt"); });
  EXPECT_TRUE(contains(message, "bad_merges.txt:3")) << message;
  EXPECT_TRUE(contains(message, "nospace")) << message;
}

TEST(Tokenizer, BpeMalformedVocabNamesFile) {
  TempDir dir;
  write_test_bpe(dir.path());
  write_file(dir.path() / "broken.json", "{\"a\": 0,");
  const std::string message =
      error_of([&] { Gpt2BpeTokenizer(dir.path() / "broken.json", dir.path() / "merges.txt"); });
  EXPECT_TRUE(contains(message, "broken.json")) << message;
}

TEST(Tokenizer, MetaRoundTripByte) {
  TempDir dir;
  const fs::path data = dir.path() / "data";
  loom::data::save_tokenizer_meta(ByteTokenizer(), data);
  const auto meta = nlohmann::json::parse(std::ifstream(data / "meta.json"));
  EXPECT_EQ(meta["tokenizer"], "byte");
  EXPECT_EQ(meta["vocab_size"], 256);
  const auto tok = loom::data::load_tokenizer(data);
  EXPECT_EQ(tok->kind(), "byte");
  EXPECT_EQ(tok->vocab_size(), 256);
}

TEST(Tokenizer, MetaRoundTripBpe) {
  TempDir dir;
  const fs::path source = dir.path() / "source";
  const fs::path data = dir.path() / "data";
  fs::create_directories(source);
  write_test_bpe(source);
  const Gpt2BpeTokenizer original(source / "vocab.json", source / "merges.txt");
  loom::data::save_tokenizer_meta(original, data);
  EXPECT_TRUE(fs::exists(data / "vocab.json"));
  EXPECT_TRUE(fs::exists(data / "merges.txt"));

  const auto tok = loom::data::load_tokenizer(data);
  EXPECT_EQ(tok->kind(), "gpt2-bpe");
  EXPECT_EQ(tok->vocab_size(), original.vocab_size());
  const std::string text = "Hello world, don't stop 2024...\n";
  EXPECT_EQ(tok->encode(text), original.encode(text));

  // Saving again from the copies already in `data` must not try to copy a file onto itself.
  loom::data::save_tokenizer_meta(*tok, data);
  EXPECT_EQ(loom::data::load_tokenizer(data)->encode(text), original.encode(text));
}

TEST(Tokenizer, LoadWithoutMetaIsByte) {
  TempDir dir;
  EXPECT_EQ(loom::data::load_tokenizer(dir.path())->kind(), "byte");
}

TEST(Tokenizer, LoadRejectsUnknownKind) {
  TempDir dir;
  write_file(dir.path() / "meta.json", R"({"tokenizer": "wordpiece", "vocab_size": 30000})");
  const std::string message = error_of([&] { loom::data::load_tokenizer(dir.path()); });
  EXPECT_TRUE(contains(message, "wordpiece")) << message;
  EXPECT_TRUE(contains(message, "\"byte\"")) << message;
  EXPECT_TRUE(contains(message, "\"gpt2-bpe\"")) << message;
}
