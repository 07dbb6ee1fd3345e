// The safetensors reader on hostile bytes: a header may lie about its length, offsets, shapes
// and dtypes. What it accepts must hold every tensor's bytes inside the file, and loom must
// write it back into a file that reads the same.
#include <ATen/ATen.h>

#include "fuzz_util.h"
#include "loom/core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  const auto path = fuzz::scratch_dir() / "input.safetensors";
  fuzz::write_bytes(path, {reinterpret_cast<const char*>(data), size});
  core::SafetensorsContents contents;
  if (!fuzz::accepts([&] { contents = core::load_safetensors(path); })) return 0;
  uint64_t bytes = 0;
  core::NamedTensors tensors;
  for (const auto& [name, t] : contents.tensors) {
    bytes += t.numel() * t.element_size();
    tensors.emplace_back(name, t);
  }
  fuzz::require(bytes <= size, "tensors hold more bytes than the file");
  const auto copy = fuzz::scratch_dir() / "copy.safetensors";
  core::save_safetensors(copy, tensors, contents.metadata);
  const auto again = core::load_safetensors(copy);
  fuzz::require(again.metadata == contents.metadata, "metadata changed in a round trip");
  fuzz::require(again.tensors.size() == contents.tensors.size(), "tensor count changed");
  for (const auto& [name, t] : contents.tensors) {
    const auto it = again.tensors.find(name);
    fuzz::require(it != again.tensors.end(), "a tensor vanished in a round trip");
    // Bytes, not values: NaN payloads must survive too.
    const auto a = t.reshape({-1}).view(at::kByte), b = it->second.reshape({-1}).view(at::kByte);
    fuzz::require(t.sizes() == it->second.sizes() && t.scalar_type() == it->second.scalar_type() &&
                      (t.numel() == 0 || at::equal(a, b)),
                  "a tensor changed in a round trip");
  }
  return 0;
}
