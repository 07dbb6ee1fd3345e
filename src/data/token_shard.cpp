#include "loom/data/token_shard.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

#include "loom/core/error.h"
#include "loom/core/files.h"

namespace loom::data {

namespace fs = std::filesystem;

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
      else
        format = ShardFormat::kLlmc;  // .bin and anything else: must be llm.c
    }
    if (format == ShardFormat::kLlmc) {
      const size_t header_bytes = kLlmcHeaderInts * sizeof(int32_t);
      // The magic first: a text or foreign file is more often the problem than a cut one.
      LOOM_CHECK(map_bytes_ < 4 || first == kLlmcMagic,
                 "token file '{}' has the wrong magic {}: an llm.c .bin shard starts with {} "
                 "(for headerless uint16 tokens, name the file *.u16)",
                 path.string(), first, kLlmcMagic);
      LOOM_CHECK(map_bytes_ >= header_bytes,
                 "token file '{}' is truncated: {} bytes, shorter than the {}-byte llm.c header",
                 path.string(), map_bytes_, header_bytes);
      int32_t header[3];
      std::memcpy(header, bytes, sizeof(header));
      LOOM_CHECK(header[1] == kLlmcVersion,
                 "token file '{}' has llm.c version {}; loom reads version {} (uint16 tokens)",
                 path.string(), header[1], kLlmcVersion);
      const int64_t count = header[2];
      const size_t need = header_bytes + static_cast<size_t>(count) * 2;
      LOOM_CHECK(count >= 0 && map_bytes_ >= need,
                 "token file '{}' is truncated: its header promises {} tokens ({} bytes) but the "
                 "file has {} bytes",
                 path.string(), count, need, map_bytes_);
      tokens_ = {reinterpret_cast<const uint16_t*>(bytes + header_bytes),
                 static_cast<size_t>(count)};
    } else {
      LOOM_CHECK(map_bytes_ % 2 == 0,
                 "raw uint16 token file '{}' has an odd size ({} bytes): truncated", path.string(),
                 map_bytes_);
      tokens_ = {reinterpret_cast<const uint16_t*>(bytes), map_bytes_ / 2};
    }
  } catch (...) {
    if (map_ && map_ != MAP_FAILED) ::munmap(map_, map_bytes_);
    throw;
  }
}

TokenShard::~TokenShard() {
  if (map_ && map_ != MAP_FAILED) ::munmap(map_, map_bytes_);
}

at::Tensor TokenShard::slice(int64_t offset, int64_t count) const {
  LOOM_CHECK(offset >= 0 && count >= 0 && offset + count <= size(),
             "token range [{}, {}) is outside '{}' ({} tokens)", offset, offset + count,
             path_.string(), size());
  auto out = at::empty({count}, at::kLong);
  auto* dst = out.data_ptr<int64_t>();
  const auto* src = tokens_.data() + offset;
  for (int64_t i = 0; i < count; ++i) dst[i] = src[i];
  return out;
}

void TokenShard::check_vocab(int64_t vocab_size) const {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    LOOM_CHECK(tokens_[i] < vocab_size,
               "token file '{}' holds token id {} at position {}, but the model's vocabulary has "
               "{} ids (valid: 0..{})",
               path_.string(), tokens_[i], i, vocab_size, vocab_size - 1);
  }
}

void write_llmc_shard(const fs::path& path, std::span<const uint16_t> tokens) {
  LOOM_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
             "'{}': {} tokens do not fit in one llm.c shard", path.string(), tokens.size());
  std::string bytes(kLlmcHeaderInts * sizeof(int32_t) + tokens.size() * 2, '\0');
  const int32_t header[3] = {kLlmcMagic, kLlmcVersion, static_cast<int32_t>(tokens.size())};
  std::memcpy(bytes.data(), header, sizeof(header));
  std::memcpy(bytes.data() + kLlmcHeaderInts * sizeof(int32_t), tokens.data(), tokens.size() * 2);
  core::write_file_atomic(path, bytes);
}

}  // namespace loom::data
