#include "loom/core/safetensors.h"

#include <ATen/ATen.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/format.h"
#include "loom/core/json.h"

namespace loom::core {

namespace {

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},   {at::kInt, "I32"},   {at::kShort, "I16"}, {at::kByte, "U8"},
    {at::kChar, "I8"},    {at::kBool, "BOOL"},
};

const char* dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  fail("safetensors: dtype {} is not supported", c10::toString(t));
}

at::ScalarType dtype_from_name(const std::string& name, const std::filesystem::path& path) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  fail(
      "'{}': tensor dtype '{}' is not supported (F64, F32, F16, BF16, I64, I32, I16, U8, I8, BOOL)",
      path.string(), name);
}

}  // namespace

SafetensorsWriter::SafetensorsWriter(const std::filesystem::path& path,
                                     const std::vector<Entry>& entries,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), tmp_(path.string() + ".tmp") {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    LOOM_CHECK(!slots_.count(e.name), "safetensors '{}': tensor name '{}' appears twice",
               path.string(), e.name);
    uint64_t numel = 1;
    for (const auto d : e.shape) numel *= static_cast<uint64_t>(d);
    const uint64_t bytes = numel * c10::elementSize(e.dtype);
    header[e.name] = {{"dtype", dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    slots_.emplace(e.name, Slot{e.dtype, e.shape, offset, bytes});
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const uint64_t header_len = text.size();
  for (auto& [name, slot] : slots_) slot.begin += 8 + header_len;
  out_ = std::make_unique<std::ofstream>(tmp_, std::ios::binary | std::ios::trunc);
  LOOM_CHECK(out_->good(), "cannot write '{}': {}", tmp_.string(), std::strerror(errno));
  char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<char>((header_len >> (8 * i)) & 0xFF);
  try {
    account_write(tmp_, 8 + text.size());
  } catch (...) {
    out_.reset();
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
    throw;
  }
  out_->write(len_bytes, 8);
  out_->write(text.data(), static_cast<std::streamsize>(text.size()));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (finished_) return;
  out_.reset();
  std::error_code ec;
  std::filesystem::remove(tmp_, ec);
}

void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  auto it = slots_.find(name);
  LOOM_CHECK(it != slots_.end(), "safetensors '{}': no tensor '{}' was declared", path_.string(),
             name);
  auto& slot = it->second;
  LOOM_CHECK(!slot.written, "safetensors '{}': tensor '{}' is written twice", path_.string(), name);
  LOOM_CHECK(tensor.scalar_type() == slot.dtype && tensor.sizes() == at::IntArrayRef(slot.shape),
             "safetensors '{}': tensor '{}' is {} {} but was declared {} {}", path_.string(), name,
             c10::toString(tensor.scalar_type()), tensor.sizes(), c10::toString(slot.dtype),
             at::IntArrayRef(slot.shape));
  const auto t = tensor.detach().to(at::kCPU).contiguous();
  account_write(tmp_, slot.bytes);
  out_->seekp(static_cast<std::streamoff>(slot.begin));
  out_->write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(slot.bytes));
  LOOM_CHECK(out_->good(), "writing '{}' failed: {}", tmp_.string(), std::strerror(errno));
  slot.written = true;
}

void SafetensorsWriter::finish() {
  LOOM_CHECK(!finished_, "safetensors '{}' is finished already", path_.string());
  for (const auto& [name, slot] : slots_)
    LOOM_CHECK(slot.written, "safetensors '{}': tensor '{}' was never written", path_.string(),
               name);
  out_->flush();
  LOOM_CHECK(out_->good(), "writing '{}' failed: {}", tmp_.string(), std::strerror(errno));
  out_.reset();
  fsync_path(tmp_);
  std::error_code ec;
  std::filesystem::rename(tmp_, path_, ec);
  LOOM_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp_.string(), path_.string(), ec.message());
  fsync_path(path_.parent_path().empty() ? std::filesystem::path(".") : path_.parent_path());
  finished_ = true;
}

void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, tensor] : tensors)
    entries.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  SafetensorsWriter writer(path, entries, metadata);
  for (const auto& [name, tensor] : tensors) writer.write(name, tensor);
  writer.finish();
}

SafetensorsReader::SafetensorsReader(const std::filesystem::path& path)
    : path_(path), file_(std::make_shared<MappedFile>(path, "safetensors file", true)) {
  const uint64_t file_size = file_->size();
  LOOM_CHECK(file_size >= 8, "'{}' is truncated: {} bytes, a safetensors file has at least 8",
             path.string(), file_size);
  const unsigned char* bytes = file_->data();
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  LOOM_CHECK(header_len <= file_size - 8,
             "'{}' is truncated or not safetensors: header of {} bytes "
             "in a file of {} bytes",
             path.string(), header_len, file_size);
  const std::string_view text(reinterpret_cast<const char*>(bytes) + 8, header_len);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("'{}': safetensors header is not valid JSON: {}", path.string(), e.what());
  }
  LOOM_CHECK(header.is_object(), "'{}': safetensors header is JSON {}, not an object",
             path.string(), header.type_name());
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = file_size - data_start;
  for (const auto& [name, entry] : header.items()) {
    try {
      if (name == "__metadata__") {
        for (const auto& [k, v] : entry.items()) metadata_[k] = v.get<std::string>();
        continue;
      }
      Entry e;
      e.dtype = dtype_from_name(entry.at("dtype").get<std::string>(), path);
      // Each must be a JSON integer: nlohmann casts a float such as 4.6e20 to int64,
      // undefined behaviour (found by fuzz.safetensors).
      const auto tensor = fmt::format("'{}': tensor '{}'", path.string(), name);
      e.shape = json_int64_list(entry.at("shape"), tensor + " shape", 0);
      const auto offsets = json_int64_list(entry.at("data_offsets"), tensor + " data_offsets", 0);
      LOOM_CHECK(offsets.size() == 2, "{} data_offsets has {} entries, not [begin, end]", tensor,
                 offsets.size());
      const auto begin = static_cast<uint64_t>(offsets[0]);
      const auto end = static_cast<uint64_t>(offsets[1]);
      LOOM_CHECK(begin <= end && end <= data_size,
                 "{} has data offsets [{}, {}] outside the file's {} bytes of data (truncated?)",
                 tensor, begin, end, data_size);
      // In bytes, checked against the data actually present as it grows: a shape whose product
      // overflows (or merely exceeds the file) is refused before anything is allocated.
      uint64_t bytes = c10::elementSize(e.dtype);
      for (const auto d : e.shape) {
        LOOM_CHECK(d == 0 || bytes <= data_size / static_cast<uint64_t>(d),
                   "{} has shape {} of more bytes than the file's {} of data", tensor,
                   entry.at("shape").dump(), data_size);
        bytes *= static_cast<uint64_t>(d);
      }
      LOOM_CHECK(bytes == end - begin, "{} has {} bytes of data but its shape needs {}", tensor,
                 end - begin, bytes);
      e.begin = data_start + begin;
      e.bytes = bytes;
      entries_.emplace(name, std::move(e));
    } catch (const nlohmann::json::exception& e) {
      fail("'{}': malformed entry for tensor '{}': {}", path.string(), name, e.what());
    }
  }
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

const SafetensorsReader::Entry& SafetensorsReader::entry(const std::string& name) const {
  auto it = entries_.find(name);
  LOOM_CHECK(it != entries_.end(), "'{}' holds no tensor '{}'", path_.string(), name);
  return it->second;
}

const SafetensorsReader::Entry& SafetensorsReader::present(const std::string& name) const {
  const auto& e = entry(name);
  // A file cut short since it was opened would fault on the missing pages: an error instead.
  LOOM_CHECK(e.begin + e.bytes <= file_->current_size(),
             "'{}': short read of tensor '{}' (the file changed since it was opened?)",
             path_.string(), name);
  return e;
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const auto& e = present(name);
  auto t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  if (e.bytes > 0) std::memcpy(t.data_ptr(), file_->data() + e.begin, e.bytes);
  return t;
}

at::Tensor SafetensorsReader::view(const std::string& name) const {
  const auto& e = present(name);
  // A tensor's data must be aligned to its element size; files written by other tools may not
  // align it (the format does not require it), and those tensors are copied instead.
  if (e.bytes == 0 || e.begin % c10::elementSize(e.dtype) != 0) return read(name);
  auto keep = file_;  // the mapping lives as long as any tensor viewing it
  return at::from_blob(
      file_->data() + e.begin, e.shape, [keep](void*) {}, at::TensorOptions().dtype(e.dtype));
}

SafetensorsContents load_safetensors(const std::filesystem::path& path) {
  const SafetensorsReader reader(path);
  SafetensorsContents out;
  out.metadata = reader.metadata();
  for (const auto& name : reader.names()) out.tensors.emplace(name, reader.view(name));
  return out;
}

}  // namespace loom::core
