#pragma once
// File helpers with the guarantees checkpoints and data files need: atomic replacement
// (write to a temporary name, fsync, rename) and content checksums.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <ostream>
#include <string>
#include <string_view>
#include <system_error>

namespace loom::core {

// CRC-32 (IEEE, as zlib) of a byte range, continuing from `crc`.
uint32_t crc32(const void* data, size_t size, uint32_t crc = 0);
// CRC-32 of a whole file, read in chunks. Throws loom::Error if it cannot be read.
uint32_t file_crc32(const std::filesystem::path& path);

// Writes `contents` to `path` atomically: a reader sees the old file or the new one, never a
// mix. Throws loom::Error naming the path on failure.
void write_file_atomic(const std::filesystem::path& path, std::string_view contents);
// The same, for contents too large to hold at once: `write` streams them into `out`.
void write_file_atomic(const std::filesystem::path& path,
                       const std::function<void(std::ostream& out)>& write);
std::string read_file(const std::filesystem::path& path);

// fsync a file or directory by path (best effort for directories).
void fsync_path(const std::filesystem::path& path);

// Creates `dir` (and parents) and proves it is writable by creating and removing a probe file.
// Throws loom::Error naming the directory and the OS reason otherwise.
void ensure_writable_dir(const std::filesystem::path& dir);

// Removes `path` and everything below it, as std::filesystem::remove_all (symbolic links are
// removed, not followed); returns how many entries it removed, 0 for a path that does not exist.
// On failure sets `ec` and returns what it removed so far. Why not remove_all itself: the torch
// wheel's libtorch.so exports its own copy of it, and on machines where the dynamic linker binds
// a program's call to that copy it jumps to address 0 (seen on a GPU machine, docs/gpu.md).
uintmax_t remove_tree(const std::filesystem::path& path, std::error_code& ec) noexcept;

// Test-only fault injection, so tests can prove what a full or read-only disk does to a
// checkpoint (docs/reliability.md): with LOOM_TEST_WRITE_FAULT=BYTES[:ERRNO[:RANK]] set, every
// write through loom's file writers fails as the OS would (ERRNO: ENOSPC, the default, EROFS or
// EIO) once this process has written BYTES bytes; RANK limits it to one rank of an MPI job. Each
// writer calls this before writing `bytes` to `path`; without the variable it only adds.
// Throws loom::Error naming the path and the error, or a malformed variable.
void account_write(const std::filesystem::path& path, uint64_t bytes);

// A whole file mapped into memory for reading: the operating system pages it in as it is read
// and may drop the pages again, so a reader of a file larger than memory holds none of it
// itself. Token shards and safetensors files are read through one. With copy_on_write, the pages
// may also be written (privately: the file never changes), so tensors viewing them are ordinary
// writable tensors.
class MappedFile {
 public:
  // Throws loom::Error "cannot open <what> '<path>': <reason>" for a missing or unreadable file.
  explicit MappedFile(const std::filesystem::path& path, std::string_view what = "file",
                      bool copy_on_write = false);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // The file's bytes (nullptr for an empty file).
  unsigned char* data() const { return static_cast<unsigned char*>(map_); }
  size_t size() const { return size_; }
  // The size of the mapped file now (it may have been truncated since it was mapped; reading
  // mapped pages past its end would raise SIGBUS). A copy-on-write mapping keeps its file open
  // for this, so it is the mapped file's size even if the path was renamed over since; a
  // read-only one closes it (a run may map thousands of token shards) and asks the path.
  size_t current_size() const;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  void* map_ = nullptr;
  size_t size_ = 0;
};

}  // namespace loom::core
