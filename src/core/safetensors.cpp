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

SafetensorsContents load_safetensors(const std::filesystem::path& path) {
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
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("'{}': safetensors header is not valid JSON: {}", path.string(), e.what());
  }
  const uint64_t data_size = file_size - 8 - header_len;
  std::vector<char> data(data_size);
  in.read(data.data(), static_cast<std::streamsize>(data_size));
  LOOM_CHECK(static_cast<uint64_t>(in.gcount()) == data_size, "'{}': short read", path.string());

  SafetensorsContents out;
  for (const auto& [name, entry] : header.items()) {
    try {
      if (name == "__metadata__") {
        for (const auto& [k, v] : entry.items()) out.metadata[k] = v.get<std::string>();
        continue;
      }
      const auto dtype = dtype_from_name(entry.at("dtype").get<std::string>(), path);
      const auto shape = entry.at("shape").get<std::vector<int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      LOOM_CHECK(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= data_size,
                 "'{}': tensor '{}' has data offsets outside the file (truncated?)", path.string(),
                 name);
      auto t = at::empty(shape, at::TensorOptions().dtype(dtype));
      const uint64_t bytes = t.numel() * t.element_size();
      LOOM_CHECK(bytes == offsets[1] - offsets[0],
                 "'{}': tensor '{}' has {} bytes of data but its shape needs {}", path.string(),
                 name, offsets[1] - offsets[0], bytes);
      std::memcpy(t.data_ptr(), data.data() + offsets[0], bytes);
      out.tensors.emplace(name, std::move(t));
    } catch (const nlohmann::json::exception& e) {
      fail("'{}': malformed entry for tensor '{}': {}", path.string(), name, e.what());
    }
  }
  return out;
}

}  // namespace loom::core
