#include "loom/data/token_shard.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <string_view>

#include "loom/core/error.h"
#include "loom/core/files.h"

namespace loom::data {

namespace fs = std::filesystem;

int32_t llmc_version_for(int64_t vocab_size) {
  LOOM_CHECK(vocab_size > 0 && vocab_size <= (int64_t{1} << 32),
             "a vocabulary of {} ids cannot be stored in a token shard (1 to 2^32 ids)",
             vocab_size);
  return vocab_size <= kMaxU16Vocab ? kLlmcVersionU16 : kLlmcVersionU32;
}

TokenShard::TokenShard(const fs::path& path, ShardFormat format) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  LOOM_CHECK(fd >= 0, "cannot open token file '{}': {}", path.string(), std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  map_bytes_ = static_cast<size_t>(st.st_size);
  if (map_bytes_ > 0) {
    map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    LOOM_CHECK(map_ != MAP_FAILED, "cannot memory-map '{}': {}", path.string(), std::strerror(err));
  } else {
    ::close(fd);
  }
  try {
    const auto* bytes = static_cast<const unsigned char*>(map_);
    int32_t first = 0;
    if (map_bytes_ >= 4) std::memcpy(&first, bytes, 4);
    if (format == ShardFormat::kAuto) {
      const auto ext = path.extension().string();
      if (map_bytes_ >= 4 && first == kLlmcMagic)
        format = ShardFormat::kLlmc;
      else if (ext == ".u16" || ext == ".raw")
        format = ShardFormat::kRawU16;
      else if (ext == ".u32")
        format = ShardFormat::kRawU32;
      else
        format = ShardFormat::kLlmc;  // .bin and anything else: must be llm.c
    }
    if (format == ShardFormat::kLlmc) {
      const size_t header_bytes = kLlmcHeaderInts * sizeof(int32_t);
      // The magic first: a text or foreign file is more often the problem than a cut one.
      LOOM_CHECK(map_bytes_ < 4 || first == kLlmcMagic,
                 "token file '{}' has the wrong magic {}: an llm.c .bin shard starts with {} "
                 "(for headerless tokens, name the file *.u16 or *.u32)",
                 path.string(), first, kLlmcMagic);
      LOOM_CHECK(map_bytes_ >= header_bytes,
                 "token file '{}' is truncated: {} bytes, shorter than the {}-byte llm.c header",
                 path.string(), map_bytes_, header_bytes);
      int32_t header[3];
      std::memcpy(header, bytes, sizeof(header));
      version_ = header[1];
      LOOM_CHECK(version_ == kLlmcVersionU16 || version_ == kLlmcVersionU32,
                 "token file '{}' has llm.c version {}; loom reads version {} (uint16 tokens) "
                 "and {} (uint32 tokens)",
                 path.string(), version_, kLlmcVersionU16, kLlmcVersionU32);
      width_ = version_ == kLlmcVersionU16 ? 2 : 4;
      const int64_t count = header[2];
      LOOM_CHECK(count >= 0, "token file '{}' has a negative token count {} in its header: corrupt",
                 path.string(), count);
      const size_t need = header_bytes + static_cast<size_t>(count) * static_cast<size_t>(width_);
      LOOM_CHECK(map_bytes_ >= need,
                 "token file '{}' is truncated: its header promises {} tokens ({} bytes) but the "
                 "file has {} bytes",
                 path.string(), count, need, map_bytes_);
      data_ = bytes + header_bytes;
      size_ = count;
    } else {
      width_ = format == ShardFormat::kRawU16 ? 2 : 4;
      LOOM_CHECK(map_bytes_ % static_cast<size_t>(width_) == 0,
                 "raw uint{} token file '{}' has a size ({} bytes) that is not a multiple of {}: "
                 "truncated",
                 8 * width_, path.string(), map_bytes_, width_);
      data_ = bytes;
      size_ = static_cast<int64_t>(map_bytes_) / width_;
    }
  } catch (...) {
    if (map_ && map_ != MAP_FAILED) ::munmap(map_, map_bytes_);
    throw;
  }
}

TokenShard::~TokenShard() {
  if (map_ && map_ != MAP_FAILED) ::munmap(map_, map_bytes_);
}

void TokenShard::copy_to(int64_t offset, int64_t count, int64_t* dst) const {
  LOOM_CHECK(offset >= 0 && count >= 0 && offset + count <= size_,
             "token range [{}, {}) is outside '{}' ({} tokens)", offset, offset + count,
             path_.string(), size_);
  if (width_ == 2) {
    const auto* src = reinterpret_cast<const uint16_t*>(data_) + offset;
    for (int64_t i = 0; i < count; ++i) dst[i] = src[i];
  } else {
    const auto* src = reinterpret_cast<const uint32_t*>(data_) + offset;
    for (int64_t i = 0; i < count; ++i) dst[i] = src[i];
  }
}

at::Tensor TokenShard::slice(int64_t offset, int64_t count) const {
  LOOM_CHECK(offset >= 0 && count >= 0 && offset + count <= size_,
             "token range [{}, {}) is outside '{}' ({} tokens)", offset, offset + count,
             path_.string(), size_);
  auto out = at::empty({count}, at::kLong);
  copy_to(offset, count, out.data_ptr<int64_t>());
  return out;
}

void TokenShard::check_vocab(int64_t vocab_size) const {
  for (int64_t i = 0; i < size_; ++i) {
    const int64_t id = token(i);
    LOOM_CHECK(id < vocab_size,
               "token file '{}' holds token id {} at position {}, but the model's vocabulary has "
               "{} ids (valid: 0..{})",
               path_.string(), id, i, vocab_size, vocab_size - 1);
  }
}

namespace {

template <typename T>
void write_shard(const fs::path& path, int32_t version, std::span<const T> tokens) {
  LOOM_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
             "'{}': {} tokens do not fit in one llm.c shard (at most 2^31 - 1)", path.string(),
             tokens.size());
  std::string bytes(kLlmcHeaderInts * sizeof(int32_t) + tokens.size() * sizeof(T), '\0');
  const int32_t header[3] = {kLlmcMagic, version, static_cast<int32_t>(tokens.size())};
  std::memcpy(bytes.data(), header, sizeof(header));
  std::memcpy(bytes.data() + kLlmcHeaderInts * sizeof(int32_t), tokens.data(),
              tokens.size() * sizeof(T));
  core::write_file_atomic(path, bytes);
}

}  // namespace

void write_llmc_shard(const fs::path& path, std::span<const uint16_t> tokens) {
  write_shard(path, kLlmcVersionU16, tokens);
}

void write_llmc_shard(const fs::path& path, std::span<const int32_t> ids, int64_t vocab_size) {
  const int32_t version = llmc_version_for(vocab_size);
  for (size_t i = 0; i < ids.size(); ++i)
    LOOM_CHECK(ids[i] >= 0 && ids[i] < vocab_size,
               "'{}': id {} at position {} is outside the vocabulary of {} ids (valid: 0..{}); "
               "nothing was written",
               path.string(), ids[i], i, vocab_size, vocab_size - 1);
  if (version == kLlmcVersionU16) {
    const std::vector<uint16_t> narrow(ids.begin(), ids.end());
    write_shard<uint16_t>(path, version, narrow);
  } else {
    write_shard<int32_t>(path, version, ids);  // non-negative: the same bits as uint32
  }
}

}  // namespace loom::data
