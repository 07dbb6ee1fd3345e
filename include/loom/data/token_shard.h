#pragma once
// Token shards on disk, memory-mapped: llm.c's .bin format (a 256 x int32 header with magic
// 20240520, a version and the token count; then the tokens: version 1 uint16, version 2 uint32,
// as llm.c writes for vocabularies past 65,536 ids such as Llama 3's) and raw uint16 or uint32
// files. Only the pages that are read come into memory; a shard is never loaded whole.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "loom/core/files.h"

namespace loom::data {

enum class ShardFormat {
  kAuto,    // llm.c if the file starts with its magic; raw for *.u16 / *.raw / *.u32; else an error
  kLlmc,    // llm.c .bin (version 1 or 2)
  kRawU16,  // headerless little-endian uint16
  kRawU32   // headerless little-endian uint32
};

inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int32_t kLlmcVersionU16 = 1;  // uint16 tokens: vocabularies up to 65,536 ids
inline constexpr int32_t kLlmcVersionU32 = 2;  // uint32 tokens
inline constexpr int64_t kLlmcHeaderInts = 256;
inline constexpr int64_t kMaxU16Vocab = 65536;

// The llm.c version a shard of ids from a vocabulary of `vocab_size` is written at: 1 up to
// 65,536 ids, else 2.
int32_t llmc_version_for(int64_t vocab_size);

class TokenShard {
 public:
  // Throws loom::Error naming the path for a missing file, a wrong magic, an unsupported
  // version (the ones it reads are named), or a file shorter than its header says (truncated).
  explicit TokenShard(const std::filesystem::path& path, ShardFormat format = ShardFormat::kAuto);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::filesystem::path& path() const { return path_; }
  int64_t size() const { return size_; }
  // 2 (uint16 tokens: llm.c version 1, raw .u16) or 4 (uint32: version 2, raw .u32).
  int bytes_per_token() const { return width_; }
  // The llm.c version of the file, or 0 for a raw one.
  int32_t version() const { return version_; }

  // Token i (0 <= i < size(), unchecked: the caller's loop bounds it).
  int64_t token(int64_t i) const {
    return width_ == 2 ? int64_t{reinterpret_cast<const uint16_t*>(data_)[i]}
                       : int64_t{reinterpret_cast<const uint32_t*>(data_)[i]};
  }
  // tokens[offset, offset + count) into dst (checked against size()).
  void copy_to(int64_t offset, int64_t count, int64_t* dst) const;
  // tokens[offset, offset + count) as an int64 tensor (a copy).
  at::Tensor slice(int64_t offset, int64_t count) const;

  // Throws loom::Error naming the first position holding an id >= vocab_size.
  void check_vocab(int64_t vocab_size) const;

 private:
  std::filesystem::path path_;
  std::unique_ptr<core::MappedFile> file_;
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
  int width_ = 2;
  int32_t version_ = 0;
};

// Writes tokens in llm.c's .bin format, version 1 (uint16), atomically (temporary name +
// rename).
void write_llmc_shard(const std::filesystem::path& path, std::span<const uint16_t> tokens);

// Writes an llm.c .bin shard as the ids arrive, in constant memory: tokens go to `path`.tmp,
// finish() writes the header's count and renames it to `path`. Without finish() (an error, a
// destructor) the temporary file is removed and `path` is left as it was.
class LlmcShardWriter {
 public:
  // The version is llmc_version_for(vocab_size).
  LlmcShardWriter(const std::filesystem::path& path, int64_t vocab_size);
  ~LlmcShardWriter();
  LlmcShardWriter(const LlmcShardWriter&) = delete;
  LlmcShardWriter& operator=(const LlmcShardWriter&) = delete;

  // Throws loom::Error naming the file and the first id outside [0, vocab_size); the ids before
  // it in the same call are not written either.
  void append(std::span<const int32_t> ids);
  int64_t size() const { return count_; }
  void finish();

 private:
  std::filesystem::path path_, tmp_;
  int64_t vocab_size_;
  int32_t version_;
  int64_t count_ = 0;
  std::FILE* file_ = nullptr;
  std::vector<unsigned char> buffer_;
};

// Cuts an llm.c .bin shard in place to its first `tokens` tokens (the header's count updated).
void truncate_llmc_shard(const std::filesystem::path& path, int64_t tokens);

// Writes ids of a vocabulary of `vocab_size` ids in llm.c's .bin format at
// llmc_version_for(vocab_size): uint16 tokens up to 65,536 ids, uint32 past that. Throws
// loom::Error naming the first id outside [0, vocab_size) before anything is written.
void write_llmc_shard(const std::filesystem::path& path, std::span<const int32_t> ids,
                      int64_t vocab_size);

}  // namespace loom::data
