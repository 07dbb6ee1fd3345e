#pragma once
// The per-chunk step of 2:4 compression (sparse24.h), shared by the host reference and the CUDA
// kernel so that both pick the same elements: of the four elements e[0..3] of a chunk, keep the
// first two nonzeros; a chunk with fewer keeps zeros at the lowest free columns (none: columns 0
// and 1; one at column c > 0: columns 0 and c; one at column 0: columns 0 and 1). A 16-bit
// element is zero when it is +0 or -0 (bit 15 aside, all bits clear), in bf16 and fp16 alike.
#include <cstdint>

#include "common/host_device.h"

namespace loom::kernels {

struct Sparse24Chunk {
  uint32_t nibble;   // first | second << 2, first < second
  uint16_t kept[2];  // e[first], e[second]
  bool over;         // more than two nonzeros: the chunk is not 2:4
};

LOOM_HOST_DEVICE Sparse24Chunk sparse24_compress_chunk(const uint16_t (&e)[4]) {
  int first = -1, second = -1, nonzeros = 0;
  for (int i = 0; i < 4; ++i) {
    if ((e[i] & 0x7fffu) == 0) continue;
    ++nonzeros;
    if (first < 0)
      first = i;
    else if (second < 0)
      second = i;
  }
  if (first < 0) {
    first = 0;
    second = 1;
  } else if (second < 0) {
    second = first == 0 ? 1 : first;
    first = 0;
  }
  return {uint32_t(first) | uint32_t(second) << 2, {e[first], e[second]}, nonzeros > 2};
}

// The two columns a nibble names, or false when it is not an ordered pair (first < second).
LOOM_HOST_DEVICE bool sparse24_nibble_columns(uint32_t nibble, int& first, int& second) {
  first = int(nibble & 3u);
  second = int((nibble >> 2) & 3u);
  return first < second;
}

}  // namespace loom::kernels
