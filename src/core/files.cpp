#include "loom/core/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "loom/core/error.h"

namespace loom::core {

namespace {
std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320U ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}
}  // namespace

uint32_t crc32(const void* data, size_t size, uint32_t crc) {
  static const auto table = make_crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFFU] ^ (crc >> 8);
  return ~crc;
}

uint32_t file_crc32(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in.good(), "cannot open '{}' to checksum it", path.string());
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    crc = crc32(buf.data(), static_cast<size_t>(in.gcount()), crc);
  }
  return crc;
}

void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void write_file_atomic(const std::filesystem::path& path,
                       const std::function<void(std::ostream& out)>& write) {
  const auto tmp = std::filesystem::path(path.string() + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    LOOM_CHECK(out.good(), "cannot write '{}': {}", tmp.string(), std::strerror(errno));
    write(out);
    out.flush();
    LOOM_CHECK(out.good(), "writing '{}' failed: {}", tmp.string(), std::strerror(errno));
  }
  fsync_path(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  LOOM_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp.string(), path.string(), ec.message());
  fsync_path(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

void write_file_atomic(const std::filesystem::path& path, std::string_view contents) {
  write_file_atomic(path, [&](std::ostream& out) {
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  });
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in.good(), "cannot open '{}': {}", path.string(), std::strerror(errno));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void ensure_writable_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  LOOM_CHECK(!ec, "cannot create directory '{}': {}", dir.string(), ec.message());
  LOOM_CHECK(std::filesystem::is_directory(dir), "'{}' exists and is not a directory",
             dir.string());
  const auto probe = dir / ".loom-write-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  LOOM_CHECK(fd >= 0, "directory '{}' is not writable: {}", dir.string(), std::strerror(errno));
  ::close(fd);
  std::filesystem::remove(probe, ec);
}

}  // namespace loom::core
