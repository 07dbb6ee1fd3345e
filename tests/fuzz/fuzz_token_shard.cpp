// The token-shard reader (llm.c .bin versions 1 and 2, raw uint16 and uint32) on hostile bytes. The
// first byte picks the file name's extension, since the format is chosen from the magic and the
// extension.
#include <ATen/ATen.h>

#include "fuzz_util.h"
#include "loom/data/token_shard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  if (size == 0) return 0;
  static const char* kNames[] = {"shard.bin", "shard.u16", "shard.raw", "shard.tokens",
                                 "shard.u32"};
  const auto path = fuzz::scratch_dir() / kNames[data[0] % 5];
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  fuzz::write_bytes(path, bytes);
  std::unique_ptr<data::TokenShard> shard;
  if (!fuzz::accepts([&] { shard = std::make_unique<data::TokenShard>(path); })) return 0;
  const int64_t n = shard->size();
  const int width = shard->bytes_per_token();
  fuzz::require(width == 2 || width == 4, "a token width other than 2 or 4 bytes");
  fuzz::require(n >= 0 && static_cast<size_t>(n) * static_cast<size_t>(width) <= bytes.size(),
                "more tokens than the file holds");
  int64_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, shard->token(i));
  fuzz::require(largest < (int64_t{1} << (8 * width)), "a token wider than its width");
  if (n > 0) {
    const auto count = std::min<int64_t>(n, 64);
    const auto tail = shard->slice(n - count, count);
    for (int64_t i = 0; i < count; ++i)
      fuzz::require(tail[i].item<int64_t>() == shard->token(n - count + i),
                    "slice differs from the mapped tokens");
    fuzz::require(!fuzz::accepts([&] { shard->check_vocab(largest); }),
                  "check_vocab accepted an id equal to the vocabulary size");
  }
  fuzz::require(fuzz::accepts([&] { shard->check_vocab(largest + 1); }),
                "check_vocab refused ids inside the vocabulary");
  fuzz::require(!fuzz::accepts([&] { shard->slice(n, 1); }), "slice past the end accepted");
  return 0;
}
