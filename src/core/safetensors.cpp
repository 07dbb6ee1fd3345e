#include "loom/core/safetensors.h"

#include <ATen/ATen.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "loom/core/error.h"
#include "loom/core/files.h"

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

void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> contiguous;
  std::set<std::string> seen;
  size_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    LOOM_CHECK(seen.insert(name).second, "safetensors '{}': tensor name '{}' appears twice",
               path.string(), name);
    auto t = tensor.detach().to(at::kCPU).contiguous();
    const size_t bytes = t.numel() * t.element_size();
    header[name] = {{"dtype", dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    contiguous.push_back(std::move(t));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const uint64_t header_len = text.size();

  write_file_atomic(path, [&](std::ostream& out) {
    char len_bytes[8];
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<char>((header_len >> (8 * i)) & 0xFF);
    out.write(len_bytes, 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& t : contiguous)
      out.write(static_cast<const char*>(t.data_ptr()),
                static_cast<std::streamsize>(t.numel() * t.element_size()));
  });
}

SafetensorsReader::SafetensorsReader(const std::filesystem::path& path) : path_(path) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK(in.good() && std::filesystem::is_regular_file(path),
             "cannot open safetensors file '{}'", path.string());
  const auto file_size = std::filesystem::file_size(path);
  LOOM_CHECK(file_size >= 8, "'{}' is truncated: {} bytes, a safetensors file has at least 8",
             path.string(), file_size);
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  LOOM_CHECK(header_len <= file_size - 8,
             "'{}' is truncated or not safetensors: header of {} bytes "
             "in a file of {} bytes",
             path.string(), header_len, file_size);
  std::string text(header_len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(header_len));
  LOOM_CHECK(static_cast<uint64_t>(in.gcount()) == header_len, "'{}': short read", path.string());
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("'{}': safetensors header is not valid JSON: {}", path.string(), e.what());
  }
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
      e.shape = entry.at("shape").get<std::vector<int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      LOOM_CHECK(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= data_size,
                 "'{}': tensor '{}' has data offsets outside the file (truncated?)", path.string(),
                 name);
      uint64_t numel = 1;
      for (const auto d : e.shape) {
        LOOM_CHECK(d >= 0, "'{}': tensor '{}' has a negative dimension {}", path.string(), name, d);
        numel *= static_cast<uint64_t>(d);
      }
      const uint64_t bytes = numel * c10::elementSize(e.dtype);
      LOOM_CHECK(bytes == offsets[1] - offsets[0],
                 "'{}': tensor '{}' has {} bytes of data but its shape needs {}", path.string(),
                 name, offsets[1] - offsets[0], bytes);
      e.begin = data_start + offsets[0];
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

at::Tensor SafetensorsReader::read(const std::string& name) const {
  auto it = entries_.find(name);
  LOOM_CHECK(it != entries_.end(), "'{}' holds no tensor '{}'", path_.string(), name);
  const auto& e = it->second;
  auto t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  std::ifstream in(path_, std::ios::binary);
  LOOM_CHECK(in.good(), "cannot open safetensors file '{}'", path_.string());
  in.seekg(static_cast<std::streamoff>(e.begin));
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.bytes));
  LOOM_CHECK(in.good() && static_cast<uint64_t>(in.gcount()) == e.bytes,
             "'{}': short read of tensor '{}' (the file changed since it was opened?)",
             path_.string(), name);
  return t;
}

SafetensorsContents load_safetensors(const std::filesystem::path& path) {
  const SafetensorsReader reader(path);
  SafetensorsContents out;
  out.metadata = reader.metadata();
  for (const auto& name : reader.names()) out.tensors.emplace(name, reader.read(name));
  return out;
}

}  // namespace loom::core
