#include "loom/core/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
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

namespace {

struct WriteFault {
  uint64_t after_bytes = 0;
  int error = ENOSPC;
  std::string text;  // the variable as given, for messages
};

// The rank this process has in an MPI job, from the launcher's environment (-1: none).
int launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(name)) return std::atoi(v);
  return -1;
}

std::optional<WriteFault> parse_write_fault() {
  const char* env = std::getenv("LOOM_TEST_WRITE_FAULT");
  if (!env || !*env) return std::nullopt;
  WriteFault f;
  f.text = env;
  const std::string text = env;
  const auto bad = [&] {
    fail("LOOM_TEST_WRITE_FAULT='{}' is not BYTES[:ERRNO[:RANK]] (ERRNO: ENOSPC, EROFS or EIO)",
         text);
  };
  const auto c1 = text.find(':');
  const auto bytes = text.substr(0, c1);
  if (bytes.empty() || bytes.find_first_not_of("0123456789") != std::string::npos) bad();
  f.after_bytes = std::stoull(bytes);
  if (c1 != std::string::npos) {
    const auto c2 = text.find(':', c1 + 1);
    const auto name =
        text.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
    if (name == "ENOSPC")
      f.error = ENOSPC;
    else if (name == "EROFS")
      f.error = EROFS;
    else if (name == "EIO")
      f.error = EIO;
    else
      bad();
    if (c2 != std::string::npos) {
      const auto rank = text.substr(c2 + 1);
      if (rank.empty() || rank.find_first_not_of("0123456789") != std::string::npos) bad();
      if (std::stoi(rank) != launcher_rank()) return std::nullopt;
    }
  }
  return f;
}

}  // namespace

void account_write(const std::filesystem::path& path, uint64_t bytes) {
  // Parsed once; the count is the one piece of process-wide state, and only tests read it.
  static const std::optional<WriteFault> fault = parse_write_fault();
  static std::atomic<uint64_t> written{0};
  const uint64_t before = written.fetch_add(bytes);
  if (fault && before + bytes > fault->after_bytes)
    fail("writing '{}' failed: {} (injected: LOOM_TEST_WRITE_FAULT={})", path.string(),
         std::strerror(fault->error), fault->text);
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
  std::error_code ec;
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    LOOM_CHECK(out.good(), "cannot write '{}': {}", tmp.string(), std::strerror(errno));
    write(out);
    out.flush();
    LOOM_CHECK(out.good(), "writing '{}' failed: {}", tmp.string(), std::strerror(errno));
    account_write(tmp, static_cast<uint64_t>(out.tellp()));
  } catch (...) {
    std::filesystem::remove(tmp, ec);  // a full disk keeps no half-written leftovers
    throw;
  }
  fsync_path(tmp);
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
  std::error_code ec;
  LOOM_CHECK(std::filesystem::is_regular_file(path, ec), "cannot read '{}': {}", path.string(),
             ec ? ec.message() : "not a regular file");
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in.good(), "cannot open '{}': {}", path.string(), std::strerror(errno));
  try {
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {
    fail("reading '{}' failed: {}", path.string(), e.what());
  }
}

namespace {

// Removes the entry `name` of the directory `parent_fd` (a directory: its contents first),
// adding to `removed`. Plain POSIX calls on descriptors, so no path is looked up twice and no
// std::filesystem function (see remove_tree) is involved.
bool remove_entry(int parent_fd, const char* name, uintmax_t& removed, std::error_code& ec) {
  struct stat st {};
  if (::fstatat(parent_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return true;  // gone meanwhile
    ec.assign(errno, std::generic_category());
    return false;
  }
  if (S_ISDIR(st.st_mode)) {
    const int fd = ::openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      ec.assign(errno, std::generic_category());
      return false;
    }
    // Owns fd from here; closed however this scope ends (an allocation may throw below).
    const std::unique_ptr<DIR, int (*)(DIR*)> dir(::fdopendir(fd), &::closedir);
    if (!dir) {
      ec.assign(errno, std::generic_category());
      ::close(fd);
      return false;
    }
    std::vector<std::string> names;
    bool ok = true;
    for (;;) {
      errno = 0;  // readdir signals an error only through errno
      const dirent* e = ::readdir(dir.get());
      if (e == nullptr) {
        ok = errno == 0;
        break;
      }
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
        names.emplace_back(e->d_name);
    }
    if (!ok) ec.assign(errno, std::generic_category());
    for (size_t i = 0; ok && i < names.size(); ++i)
      ok = remove_entry(::dirfd(dir.get()), names[i].c_str(), removed, ec);
    if (!ok) return false;
  }
  if (::unlinkat(parent_fd, name, S_ISDIR(st.st_mode) ? AT_REMOVEDIR : 0) != 0) {
    if (errno == ENOENT) return true;
    ec.assign(errno, std::generic_category());
    return false;
  }
  ++removed;
  return true;
}

}  // namespace

uintmax_t remove_tree(const std::filesystem::path& path, std::error_code& ec) noexcept {
  ec.clear();
  uintmax_t removed = 0;
  try {
    // unlinkat needs a parent directory and a name: the path's parent ("." for a bare name).
    auto target = path;
    if (target.filename().empty() && target.has_parent_path()) target = target.parent_path();
    const auto parent =
        target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
    const auto name = target.filename();
    if (name.empty() || name == "." || name == "..") {
      ec = std::make_error_code(std::errc::invalid_argument);  // "", "." or "..": refused
      return 0;
    }
    const int parent_fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (parent_fd < 0) {
      // A missing parent, or one that is a file: nothing there to remove, as remove_all says.
      if (errno != ENOENT && errno != ENOTDIR) ec.assign(errno, std::generic_category());
      return 0;
    }
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } close_parent{parent_fd};
    remove_entry(parent_fd, name.c_str(), removed, ec);
  } catch (const std::bad_alloc&) {
    ec = std::make_error_code(std::errc::not_enough_memory);
  }
  return removed;
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

MappedFile::MappedFile(const std::filesystem::path& path, std::string_view what, bool copy_on_write)
    : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
  LOOM_CHECK(fd_ >= 0, "cannot open {} '{}': {}", what, path.string(), std::strerror(errno));
  struct stat st {};
  const bool stat_ok = ::fstat(fd_, &st) == 0;
  const int stat_err = errno;
  if (!stat_ok || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fail("cannot open {} '{}': {}", what, path.string(),
         !stat_ok              ? std::strerror(stat_err)
         : S_ISDIR(st.st_mode) ? "it is a directory"
                               : "it is not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    // Private writable pages are copied on the first write; MAP_NORESERVE keeps a large file
    // from counting against the commit limit for pages nobody writes.
    map_ = copy_on_write
               ? ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd_, 0)
               : ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
    if (map_ == MAP_FAILED) {
      const int err = errno;
      map_ = nullptr;
      ::close(fd_);
      fail("cannot memory-map {} '{}': {}", what, path.string(), std::strerror(err));
    }
  }
  if (!copy_on_write) {
    ::close(fd_);
    fd_ = -1;
  }
}

MappedFile::~MappedFile() {
  if (map_) ::munmap(map_, size_);
  if (fd_ >= 0) ::close(fd_);
}

size_t MappedFile::current_size() const {
  struct stat st {};
  const int status = fd_ >= 0 ? ::fstat(fd_, &st) : ::stat(path_.c_str(), &st);
  return status == 0 ? static_cast<size_t>(st.st_size) : 0;
}

}  // namespace loom::core
