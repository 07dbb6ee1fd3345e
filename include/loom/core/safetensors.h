#pragma once
// Reader and writer for the safetensors format (Hugging Face): an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the
// raw little-endian tensor bytes. Used for Hugging Face weights and for loom's checkpoints.
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/files.h"

namespace loom::core {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct SafetensorsContents {
  std::map<std::string, at::Tensor> tensors;  // CPU tensors, owning their memory
  std::map<std::string, std::string> metadata;
};

// Writes atomically (temporary name + rename). Supported dtypes: F64, F32, F16, BF16, I64, I32,
// I16, U8, I8, BOOL. Names must be unique. Throws loom::Error naming the path on failure.
void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Throws loom::Error naming the path and the problem for a missing, truncated or malformed file.
// The tensors view the memory-mapped file (SafetensorsReader::view): loading holds no copy, the
// pages are read as the tensors are.
SafetensorsContents load_safetensors(const std::filesystem::path& path);

// One safetensors file written tensor by tensor: the names, dtypes and shapes are declared up
// front (the header holds every offset), each tensor's bytes are written when it is ready, in any
// order, and finish() makes the file appear atomically (temporary name, fsync, rename). What a
// writer that never holds all of a file's tensors at once (ZeRO-3 gathering one unit at a time)
// uses. A writer destroyed unfinished removes its temporary file.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  // Throws loom::Error naming the path for a name given twice, an unsupported dtype, or a file
  // that cannot be created.
  SafetensorsWriter(const std::filesystem::path& path, const std::vector<Entry>& entries,
                    const std::map<std::string, std::string>& metadata = {});
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  // Writes `tensor` (any device and layout) as entry `name`. Throws loom::Error naming the file
  // for an undeclared name, one written before, or another dtype or shape than declared.
  void write(const std::string& name, const at::Tensor& tensor);
  // Throws loom::Error naming the first entry never written, or the I/O failure.
  void finish();

 private:
  struct Slot {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, bytes = 0;  // from the start of the file
    bool written = false;
  };
  std::filesystem::path path_, tmp_;
  std::map<std::string, Slot> slots_;
  std::unique_ptr<std::ofstream> out_;
  bool finished_ = false;
};

// One safetensors file read tensor by tensor: the file is memory-mapped and its header parsed
// and checked when the reader is made; a tensor's bytes are read only when it is asked for. What
// a loader that needs a few tensors of a large file (a rank's own parameters in a checkpoint)
// uses. The file must not be truncated while a reader or a view of it lives (checkpoints and
// exports are replaced by rename, which leaves an open file whole).
class SafetensorsReader {
 public:
  // Throws loom::Error naming the path and the problem for a missing, truncated or malformed
  // file, as load_safetensors does.
  explicit SafetensorsReader(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  // A new CPU tensor holding `name`'s data. Throws loom::Error naming the file for an unknown
  // name, or a tensor whose bytes are no longer in the file (cut short since it was opened).
  at::Tensor read(const std::string& name) const;
  // A CPU tensor viewing `name`'s bytes in the mapped file, without a copy. The mapping is
  // private and copy-on-write: writing to the tensor never changes the file (two views of one
  // name from one reader share memory, as two views of one tensor do). The tensor keeps the
  // mapping alive after the reader is gone. A tensor whose data is not aligned to its element
  // size is read (copied) instead. Errors as read's; the file must not be cut short while the
  // view lives.
  at::Tensor view(const std::string& name) const;

 private:
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, bytes = 0;  // from the start of the file
  };
  const Entry& entry(const std::string& name) const;
  const Entry& present(const std::string& name) const;  // entry(), its bytes still in the file

  std::filesystem::path path_;
  std::shared_ptr<MappedFile> file_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace loom::core
