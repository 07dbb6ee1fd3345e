#pragma once
// Helpers shared by the test files.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>
#include <type_traits>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/data/token_shard.h"
#include "loom/data/tokenizer.h"

namespace loom::testing {

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "loom_test") {
    std::random_device rd;
    const uint64_t id = (uint64_t{rd()} << 32) | rd();
    path_ = std::filesystem::temp_directory_path() / fmt::format("{}_{:016x}", tag, id);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    loom::core::remove_tree(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// Runs f and returns the message of the `Exception` it throws (by default a loom::Error; pass
// std::exception for errors that come back through the autograd engine); fails the test if it
// does not throw one.
template <typename Exception = loom::Error, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  }
  ADD_FAILURE() << (std::is_same_v<Exception, loom::Error> ? "expected a loom::Error"
                                                           : "expected an exception");
  return "";
}

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Path of the corpus that ships in the repository.
inline std::filesystem::path corpus_path() {
  return std::filesystem::path(LOOM_SOURCE_DIR) / "data" / "corpus" / "kjv.txt";
}

// Byte tokens of the shipped corpus: train.bin from the first `train_bytes`, val.bin from the
// last `val_bytes`, plus meta.json, the way loom-prepare writes a data directory.
inline void write_corpus_data(const std::filesystem::path& dir, size_t train_bytes,
                              size_t val_bytes) {
  const auto text = loom::core::read_file(corpus_path());
  std::vector<uint16_t> train(text.begin(),
                              text.begin() + static_cast<std::ptrdiff_t>(train_bytes));
  std::vector<uint16_t> val(text.end() - static_cast<std::ptrdiff_t>(val_bytes), text.end());
  for (auto& t : train) t &= 0xFF;
  for (auto& t : val) t &= 0xFF;
  loom::data::write_llmc_shard(dir / "train.bin", train);
  loom::data::write_llmc_shard(dir / "val.bin", val);
  loom::data::save_tokenizer_meta(loom::data::ByteTokenizer(), dir);
}

}  // namespace loom::testing
