#pragma once
// Philox4x32-10, the counter-based generator of Salmon et al., "Parallel Random Numbers: As Easy
// as 1, 2, 3" (SC 2011): 128 random bits as a pure function of a 128-bit counter and a 64-bit key,
// so any element's random number is computed where it is needed, in any order, on any device.
// loom's dropout (dropout.h) draws from it. Plain C++ that nvcc also compiles for the device;
// the products use 64-bit multiplies (mul.wide.u32 on the GPU) rather than __umulhi, so the
// host compiler and the kernel emulation need nothing of CUDA's.
#include <cstdint>

#include "common/host_device.h"

namespace loom::kernels {

struct Philox4x32 {
  uint32_t v[4];
};

// The multipliers and the Weyl key increments of Philox4x32 (the paper's Table 2 and sec. 3.3).
inline constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
inline constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
inline constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

LOOM_HOST_DEVICE Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key schedule: a Weyl sequence, bumped before every round but the first
      key0 += kPhiloxW0;
      key1 += kPhiloxW1;
    }
    const uint64_t p0 = uint64_t(kPhiloxM0) * counter.v[0];
    const uint64_t p1 = uint64_t(kPhiloxM1) * counter.v[2];
    counter = Philox4x32{{uint32_t(p1 >> 32) ^ counter.v[1] ^ key0, uint32_t(p1),
                          uint32_t(p0 >> 32) ^ counter.v[3] ^ key1, uint32_t(p0)}};
  }
  return counter;
}

}  // namespace loom::kernels
