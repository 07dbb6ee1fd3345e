#include "loom/data/token_shard.h"

#include <ATen/ATen.h>

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

TokenShard::TokenShard(const fs::path& path, ShardFormat format)
    : path_(path), file_(std::make_unique<core::MappedFile>(path, "token file")) {
  const size_t file_bytes = file_->size();
  const auto* bytes = file_->data();
  int32_t first = 0;
  if (file_bytes >= 4) std::memcpy(&first, bytes, 4);
  if (format == ShardFormat::kAuto) {
    const auto ext = path.extension().string();
    if (file_bytes >= 4 && first == kLlmcMagic)
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
    LOOM_CHECK(file_bytes < 4 || first == kLlmcMagic,
               "token file '{}' has the wrong magic {}: an llm.c .bin shard starts with {} "
               "(for headerless tokens, name the file *.u16 or *.u32)",
               path.string(), first, kLlmcMagic);
    LOOM_CHECK(file_bytes >= header_bytes,
               "token file '{}' is truncated: {} bytes, shorter than the {}-byte llm.c header",
               path.string(), file_bytes, header_bytes);
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
    LOOM_CHECK(file_bytes >= need,
               "token file '{}' is truncated: its header promises {} tokens ({} bytes) but the "
               "file has {} bytes",
               path.string(), count, need, file_bytes);
    data_ = bytes + header_bytes;
    size_ = count;
  } else {
    width_ = format == ShardFormat::kRawU16 ? 2 : 4;
    LOOM_CHECK(file_bytes % static_cast<size_t>(width_) == 0,
               "raw uint{} token file '{}' has a size ({} bytes) that is not a multiple of {}: "
               "truncated",
               8 * width_, path.string(), file_bytes, width_);
    data_ = bytes;
    size_ = static_cast<int64_t>(file_bytes) / width_;
  }
}

TokenShard::~TokenShard() = default;

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

LlmcShardWriter::LlmcShardWriter(const fs::path& path, int64_t vocab_size)
    : path_(path),
      tmp_(path.string() + ".tmp"),
      vocab_size_(vocab_size),
      version_(llmc_version_for(vocab_size)) {
  file_ = std::fopen(tmp_.c_str(), "wb");
  LOOM_CHECK(file_ != nullptr, "cannot write '{}': {}", tmp_.string(), std::strerror(errno));
  // The header is written last, by finish(); until then it is zeros (no magic: unreadable).
  const std::vector<unsigned char> zeros(kLlmcHeaderInts * sizeof(int32_t), 0);
  if (std::fwrite(zeros.data(), 1, zeros.size(), file_) != zeros.size()) {
    const int err = errno;
    std::fclose(file_);
    file_ = nullptr;
    std::error_code ec;
    fs::remove(tmp_, ec);
    fail("writing '{}' failed: {}", tmp_.string(), std::strerror(err));
  }
}

LlmcShardWriter::~LlmcShardWriter() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::error_code ec;
    fs::remove(tmp_, ec);  // unfinished: nothing half-written stays
  }
}

void LlmcShardWriter::append(std::span<const int32_t> ids) {
  LOOM_CHECK(file_ != nullptr, "'{}' was already finished", path_.string());
  for (size_t i = 0; i < ids.size(); ++i)
    LOOM_CHECK(ids[i] >= 0 && ids[i] < vocab_size_,
               "'{}': id {} at position {} is outside the vocabulary of {} ids (valid: 0..{}); "
               "nothing was written",
               path_.string(), ids[i], count_ + static_cast<int64_t>(i), vocab_size_,
               vocab_size_ - 1);
  LOOM_CHECK(count_ + static_cast<int64_t>(ids.size()) <= std::numeric_limits<int32_t>::max(),
             "'{}': {} tokens do not fit in one llm.c shard (at most 2^31 - 1)", path_.string(),
             count_ + static_cast<int64_t>(ids.size()));
  const size_t width = version_ == kLlmcVersionU16 ? 2 : 4;
  buffer_.resize(ids.size() * width);
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto v = static_cast<uint32_t>(ids[i]);  // little-endian, as llm.c writes
    if (width == 2) {
      const auto narrow = static_cast<uint16_t>(v);
      std::memcpy(buffer_.data() + 2 * i, &narrow, 2);
    } else {
      std::memcpy(buffer_.data() + 4 * i, &v, 4);
    }
  }
  core::account_write(tmp_, buffer_.size());
  LOOM_CHECK(std::fwrite(buffer_.data(), 1, buffer_.size(), file_) == buffer_.size(),
             "writing '{}' failed: {}", tmp_.string(), std::strerror(errno));
  count_ += static_cast<int64_t>(ids.size());
}

void LlmcShardWriter::finish() {
  LOOM_CHECK(file_ != nullptr, "'{}' was already finished", path_.string());
  const int32_t header[3] = {kLlmcMagic, version_, static_cast<int32_t>(count_)};
  const bool ok = std::fseek(file_, 0, SEEK_SET) == 0 &&
                  std::fwrite(header, sizeof(header), 1, file_) == 1 && std::fflush(file_) == 0;
  const int err = errno;
  std::fclose(file_);
  file_ = nullptr;
  std::error_code ec;
  if (!ok) {
    fs::remove(tmp_, ec);
    fail("writing '{}' failed: {}", tmp_.string(), std::strerror(err));
  }
  core::fsync_path(tmp_);
  fs::rename(tmp_, path_, ec);
  LOOM_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp_.string(), path_.string(), ec.message());
  core::fsync_path(path_.parent_path().empty() ? fs::path(".") : path_.parent_path());
}

void truncate_llmc_shard(const fs::path& path, int64_t tokens) {
  const TokenShard shard(path, ShardFormat::kLlmc);
  LOOM_CHECK(tokens >= 0 && tokens <= shard.size(), "cannot cut '{}' ({} tokens) to {} tokens",
             path.string(), shard.size(), tokens);
  const auto bytes = static_cast<uintmax_t>(kLlmcHeaderInts * sizeof(int32_t)) +
                     static_cast<uintmax_t>(tokens) * shard.bytes_per_token();
  std::error_code ec;
  fs::resize_file(path, bytes, ec);
  LOOM_CHECK(!ec, "cannot cut '{}' to {} tokens: {}", path.string(), tokens, ec.message());
  std::FILE* f = std::fopen(path.c_str(), "r+b");
  LOOM_CHECK(f != nullptr, "cannot open '{}': {}", path.string(), std::strerror(errno));
  const auto count = static_cast<int32_t>(tokens);
  const bool ok = std::fseek(f, 2 * sizeof(int32_t), SEEK_SET) == 0 &&
                  std::fwrite(&count, sizeof(count), 1, f) == 1 && std::fflush(f) == 0;
  std::fclose(f);
  LOOM_CHECK(ok, "writing the header of '{}' failed", path.string());
  core::fsync_path(path);
}

void write_llmc_shard(const fs::path& path, std::span<const int32_t> ids, int64_t vocab_size) {
  LlmcShardWriter writer(path, vocab_size);
  writer.append(ids);
  writer.finish();
}

}  // namespace loom::data
