#pragma once
// Token shards on disk, memory-mapped: llm.c's .bin format (a 256 x int32 header with magic
// 20240520, version 1, token count; then uint16 tokens) and raw uint16 files. Only the pages
// that are read come into memory; a shard is never loaded whole.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <span>

namespace loom::data {

enum class ShardFormat {
  kAuto,   // llm.c if the file starts with its magic; raw for *.u16 / *.raw; else an error
  kLlmc,   // llm.c .bin
  kRawU16  // headerless little-endian uint16
};

inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int32_t kLlmcVersion = 1;
inline constexpr int64_t kLlmcHeaderInts = 256;

class TokenShard {
 public:
  // Throws loom::Error naming the path for a missing file, a wrong magic, an unsupported
  // version, or a file shorter than its header says (truncated).
  explicit TokenShard(const std::filesystem::path& path, ShardFormat format = ShardFormat::kAuto);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::filesystem::path& path() const { return path_; }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  std::span<const uint16_t> tokens() const { return tokens_; }

  // tokens[offset, offset + count) as an int64 tensor (a copy).
  at::Tensor slice(int64_t offset, int64_t count) const;

  // Throws loom::Error naming the first position holding an id >= vocab_size.
  void check_vocab(int64_t vocab_size) const;

 private:
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::span<const uint16_t> tokens_;
};

// Writes tokens in llm.c's .bin format, atomically (temporary name + rename).
void write_llmc_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens);

}  // namespace loom::data
